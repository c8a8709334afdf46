"""A round's fused kernels: one pass over every contribution gives the bits of one kernel call per
contribution (and of the outer step after it), on either driver, and the numpy reference's values."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ddiloco import kernels
from ddiloco.kernels import reference

EPS32 = float(np.finfo(np.float32).eps)
SETTINGS = settings(max_examples=25, deadline=None)
LR, MU = 0.7, 0.9


@st.composite
def rounds(draw):
    """m contributions of one fragment: sizes from a few blocks to past the parallel threshold and
    several tiles, tensors of uneven sizes (empty ones too), zero and tiny contributions mixed in."""
    block = draw(st.sampled_from([8, 64, 128]))
    blocks = draw(st.sampled_from([1, 3, 17, 600, 1100, 2600]))
    n = blocks * block
    m = draw(st.integers(1, 6))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    xs = [(rng.standard_normal(n) * rng.choice([1e-3, 1.0, 1e3])).astype(np.float32) for _ in range(m)]
    if draw(st.booleans()):
        xs[rng.integers(m)][:] = 0.0
    weights = rng.uniform(0.0, 1.0, m)
    weights[rng.integers(m)] = draw(st.sampled_from([0.0, 1e-30, 0.5]))
    cuts = np.sort(rng.integers(0, n + 1, draw(st.integers(0, 6))))
    end = int(rng.integers(max(0, n - 2 * block), n + 1))
    offsets = np.concatenate([[0], np.minimum(cuts, end), [end]]).astype(np.int64)
    return xs, weights, offsets, block, rng


def int4_of(xs, block):
    coded = [kernels.quantize_int4(x, block) for x in xs]
    return [c for c, _ in coded], [s for _, s in coded]


@SETTINGS
@given(rounds(), st.booleans())
def test_round_mean_int4_is_one_accumulate_per_contribution(case, parallel):
    xs, weights, _, block, rng = case
    codes, scales = int4_of(xs, block)
    n = xs[0].size
    want = np.zeros(n, dtype=np.float32)
    for w, c, s in zip(weights, codes, scales):
        kernels.accumulate_int4(want, w, c, s, block, parallel=False)
    got = np.full(n, np.nan, dtype=np.float32)  # every value is written
    kernels.round_mean_int4(got, weights, codes, scales, block, parallel=parallel)
    np.testing.assert_array_equal(got, want)
    ref = np.empty(n, dtype=np.float32)
    reference.round_mean_int4(ref, weights, codes, scales, block)
    bound = 4 * EPS32 * sum(w * np.repeat(s, block) * 8 for w, s in zip(weights, scales))
    assert (np.abs(got.astype(np.float64) - ref) <= bound + 1e-38).all()
    theta = rng.standard_normal(n).astype(np.float32)
    buf = rng.standard_normal(n).astype(np.float32)
    theta_want, buf_want = theta.copy(), buf.copy()
    kernels.nesterov_step(theta_want, buf_want, want, LR, MU, parallel=False)
    kernels.round_mean_step_int4(theta, buf, weights, codes, scales, LR, MU, block, parallel=parallel)
    np.testing.assert_array_equal(theta, theta_want)
    np.testing.assert_array_equal(buf, buf_want)


@SETTINGS
@given(rounds(), st.booleans())
def test_round_mean_fp32_is_one_accumulate_per_contribution(case, parallel):
    xs, weights, _, _, rng = case
    n = xs[0].size
    want = np.zeros(n, dtype=np.float32)
    for w, x in zip(weights, xs):
        kernels.accumulate(want, w, x, parallel=False)
    got = np.full(n, np.nan, dtype=np.float32)
    kernels.round_mean(got, weights, xs, parallel=parallel)
    np.testing.assert_array_equal(got, want)
    ref = np.empty(n, dtype=np.float32)
    reference.round_mean(ref, weights, xs)
    np.testing.assert_array_equal(got, ref)  # float32 weight times x, added in order: numpy's rounding
    theta = rng.standard_normal(n).astype(np.float32)
    buf = np.zeros(n, dtype=np.float32)
    theta_ref, buf_ref = theta.copy(), buf.copy()
    reference.round_mean_step(theta_ref, buf_ref, weights, xs, LR, MU)
    kernels.round_mean_step(theta, buf, weights, xs, LR, MU, parallel=parallel)
    np.testing.assert_array_equal(theta, theta_ref)
    np.testing.assert_array_equal(buf, buf_ref)


@SETTINGS
@given(rounds(), st.booleans())
def test_rda_accumulate_round_is_one_rda_accumulate_per_contribution(case, parallel):
    xs, weights, offsets, block, rng = case
    codes, scales = int4_of(xs, block)
    n = xs[0].size
    norms = np.stack([np.sqrt(kernels.segment_sumsq_int4(c, s, offsets, block)) for c, s in zip(codes, scales)])
    norms_fp32 = np.stack([np.sqrt(kernels.segment_sumsq(x, offsets)) for x in xs])
    start = rng.standard_normal(n).astype(np.float32)  # the kernels add to whatever acc holds
    want, want_fp32 = start.copy(), start.copy()
    for m, w in enumerate(weights):
        kernels.rda_accumulate_int4(want, w, codes[m], scales[m], offsets, norms[m], block, parallel=False)
        kernels.rda_accumulate(want_fp32, w, xs[m], offsets, norms_fp32[m], parallel=False)
    got, got_fp32 = start.copy(), start.copy()
    kernels.rda_accumulate_round_int4(got, weights, codes, scales, offsets, norms, block, parallel=parallel)
    kernels.rda_accumulate_round(got_fp32, weights, xs, offsets, norms_fp32, parallel=parallel)
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(got_fp32, want_fp32)
    ref = start.copy()
    reference.rda_accumulate_round(ref, weights, xs, offsets, norms_fp32)
    np.testing.assert_array_equal(got_fp32, ref)


@SETTINGS
@given(rounds(), st.booleans())
def test_nesterov_step_segments_is_scale_then_step(case, parallel):
    xs, _, offsets, _, rng = case
    g = xs[0]
    factors = rng.uniform(0.0, 3.0, offsets.size - 1).astype(np.float32)
    theta = rng.standard_normal(g.size).astype(np.float32)
    buf = rng.standard_normal(g.size).astype(np.float32)
    theta_ref, buf_ref = theta.copy(), buf.copy()
    reference.nesterov_step_segments(theta_ref, buf_ref, g, offsets, factors, LR, MU)
    before = g.copy()
    kernels.nesterov_step_segments(theta, buf, g, offsets, factors, LR, MU, parallel=parallel)
    np.testing.assert_array_equal(theta, theta_ref)
    np.testing.assert_array_equal(buf, buf_ref)
    np.testing.assert_array_equal(g, before)


def test_a_payload_sent_twice_is_two_contributions():
    x = np.linspace(-1, 1, 1024, dtype=np.float32)
    codes, scales = kernels.quantize_int4(x)
    once = np.zeros(1024, dtype=np.float32)
    kernels.round_mean_int4(once, np.array([1.0]), [codes], [scales])
    twice = np.zeros(1024, dtype=np.float32)
    kernels.round_mean_int4(twice, np.array([0.5, 0.5]), [codes, codes], [scales, scales])
    np.testing.assert_array_equal(twice, once)


def test_bad_rounds_are_refused_before_anything_is_written():
    n = 1024
    x = np.ones(n, dtype=np.float32)
    codes, scales = kernels.quantize_int4(x)
    theta = np.ones(n, dtype=np.float32)
    buf = np.zeros(n, dtype=np.float32)
    w = np.array([0.5, 0.5])
    bad = [
        (lambda: kernels.round_mean_step_int4(theta, buf, w, [codes], [scales, scales], LR, MU), "codes must hold 2"),
        (
            lambda: kernels.round_mean_step_int4(theta, buf, np.array([0.5, -1.0]), [codes] * 2, [scales] * 2, LR, MU),
            "weights must be finite and non-negative",
        ),
        (
            lambda: kernels.round_mean_step_int4(theta, buf, np.array([], dtype=np.float64), [], [], LR, MU),
            "at least one",
        ),
        (
            lambda: kernels.round_mean_step_int4(theta, buf, w, [codes, codes[:10]], [scales] * 2, LR, MU),
            "codes must have",
        ),
        (lambda: kernels.round_mean_step_int4(theta, theta, w, [codes] * 2, [scales] * 2, LR, MU), "share memory"),
        (lambda: kernels.round_mean_step(theta, buf, w, [x, theta], LR, MU), "share memory"),
        (lambda: kernels.round_mean_step(theta, buf, w, (x, x.astype(np.float64)), LR, MU), "dtype float32"),
        (lambda: kernels.round_mean(theta, w, x), "list or tuple"),
        (lambda: kernels.rda_accumulate_round(theta, w, [x, x], np.array([0, n]), np.ones((1, 1))), r"shape \(2, 1\)"),
        (
            lambda: kernels.rda_accumulate_round(theta, w, [x, x], np.array([0, n]), np.full((2, 1), np.nan)),
            "norms must be finite",
        ),
        (
            lambda: kernels.nesterov_step_segments(
                theta, buf, x, np.array([0, n]), np.array([np.inf], np.float32), LR, MU
            ),
            "factors must be finite",
        ),
    ]
    for call, message in bad:
        with pytest.raises(kernels.KernelInputError, match=message):
            call()
        assert (theta == 1).all() and (buf == 0).all()
