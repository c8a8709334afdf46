"""A round's fused kernels: one pass over every contribution gives the bits of one kernel call per
contribution (and of the outer step after it), on either driver, and the numpy reference's values."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ddiloco import kernels
from ddiloco.kernels import _parallelism, reference

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


# ---- the round's accumulate with the sums of squares of its result ----


def bits(a):
    """The array's bit patterns: NaN payloads compared too."""
    return a.view({4: np.uint32, 8: np.uint64}[a.itemsize])


def two_pass(acc, weights, payload, offsets, norms, block, parallel):
    """What the fused call replaces: the round's accumulate, then segment_sumsq of the result."""
    if block is None:
        kernels.rda_accumulate_round(acc, weights, payload, offsets, norms, parallel=parallel)
    else:
        kernels.rda_accumulate_round_int4(acc, weights, *payload, offsets, norms, block, parallel=parallel)
    return kernels.segment_sumsq(acc, offsets, parallel=parallel)


def fused(acc, weights, payload, offsets, norms, block, parallel):
    if block is None:
        return kernels.rda_accumulate_round_sumsq(acc, weights, payload, offsets, norms, parallel=parallel)
    return kernels.rda_accumulate_round_int4_sumsq(acc, weights, *payload, offsets, norms, block, parallel=parallel)


def assert_fused_is_two_pass(start, weights, payload, offsets, norms, block, parallel):
    want_acc, got_acc = start.copy(), start.copy()
    want = two_pass(want_acc, weights, payload, offsets, norms, block, parallel)
    got = fused(got_acc, weights, payload, offsets, norms, block, parallel)
    assert got.dtype == np.float64 and got.shape == (offsets.size - 1,)
    np.testing.assert_array_equal(bits(got), bits(want))
    np.testing.assert_array_equal(bits(got_acc), bits(want_acc))
    end = int(offsets[-1])
    np.testing.assert_array_equal(bits(got_acc[end:]), bits(start[end:]))  # the padding is never written
    return got_acc, got


def payload_of(xs, block):
    return xs if block is None else int4_of(xs, block)


def norms_of(xs, offsets, block):
    if block is None:
        return np.stack([np.sqrt(kernels.segment_sumsq(x, offsets)) for x in xs])
    codes, scales = int4_of(xs, block)
    return np.stack([np.sqrt(kernels.segment_sumsq_int4(c, s, offsets, block)) for c, s in zip(codes, scales)])


@SETTINGS
@given(rounds(), st.booleans(), st.booleans())
def test_rda_accumulate_round_sumsq_is_the_accumulate_then_segment_sumsq(case, int4, parallel):
    xs, weights, offsets, block, rng = case
    block = block if int4 else None
    start = rng.standard_normal(xs[0].size).astype(np.float32)
    norms = norms_of(xs, offsets, block)
    got_acc, got = assert_fused_is_two_pass(start, weights, payload_of(xs, block), offsets, norms, block, parallel)
    np.testing.assert_allclose(got, reference.segment_sumsq(got_acc, offsets), rtol=1e-12, atol=0)
    ref_acc = start.copy()
    if block is None:
        ref = reference.rda_accumulate_round_sumsq(ref_acc, weights, xs, offsets, norms)
        np.testing.assert_array_equal(got_acc, ref_acc)
        np.testing.assert_allclose(got, ref, rtol=1e-12, atol=0)
    else:
        ref = reference.rda_accumulate_round_int4_sumsq(ref_acc, weights, *int4_of(xs, block), offsets, norms, block)
        # the reference decodes to float32 before scaling: a few float32 roundings per element apart
        assert (np.abs(got - ref) <= 1e-5 * (ref + np.diff(offsets))).all()


def layout(name, n):
    """Segment boundaries of a few shapes of fragment, over a vector of n elements."""
    chunk = 1 << 14
    if name == "one huge tensor":
        return np.array([0, n], dtype=np.int64)
    if name == "padding":
        return np.array([0, n // 3, n - 300], dtype=np.int64)
    if name == "many tiny tensors":
        sizes = np.random.default_rng(3).integers(0, 4, n // 2)
        return np.concatenate([[0], np.minimum(np.cumsum(sizes), n - 77)]).astype(np.int64)
    if name == "empty tensors":  # at the start, the end, on slice and tile bounds and inside them
        cuts = [0, 0, 5, 5, 5, n // 7, chunk, chunk, 2 * chunk, 2 * chunk + 1, n // 2, n // 2, n - 128, n - 128]
        return np.array(sorted(min(c, n - 128) for c in cuts), dtype=np.int64)
    if name == "nothing but padding":
        return np.array([0, 0, 0], dtype=np.int64)
    raise ValueError(name)


LAYOUTS = ["one huge tensor", "padding", "many tiny tensors", "empty tensors", "nothing but padding"]
# below the parallel threshold, just above it, and a fragment the size of the one profiled (2.6M) whose
# slices hold several tiles
SIZES = [3 * 1024 + 256, kernels.PARALLEL_ELEMENTS_MIN + 3 * 128, 159 * (1 << 14) + 5 * 128]


@pytest.fixture(scope="module")
def contributions():
    rng = np.random.default_rng(11)
    return {n: [rng.standard_normal(n).astype(np.float32) for _ in range(5)] for n in SIZES}


@pytest.mark.parametrize("parallel", [True, False])
@pytest.mark.parametrize("codec", ["fp32", "int4"])
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("name", LAYOUTS)
def test_rda_accumulate_round_sumsq_bits_over_layouts(contributions, name, n, codec, parallel):
    block = 128 if codec == "int4" else None
    offsets = layout(name, n)
    start = np.random.default_rng(5).standard_normal(n).astype(np.float32)
    for m in range(1, 6):
        xs = contributions[n][:m]
        weights = np.linspace(1.0, 2.0, m) / m
        assert_fused_is_two_pass(
            start, weights, payload_of(xs, block), offsets, norms_of(xs, offsets, block), block, parallel
        )


def test_rda_accumulate_round_sumsq_uses_every_reduction_slice():
    # 64 slices of several tiles each, one tensor across many of them: the parallel driver's case
    n = SIZES[-1]
    end = n - 300
    assert kernels.PARALLEL_ELEMENTS_MIN <= end and _parallelism.slice_bounds(end, 1 << 14).size - 1 == 64
    offsets = layout("padding", n)
    xs = [np.random.default_rng(i).standard_normal(n).astype(np.float32) for i in range(3)]
    norms = norms_of(xs, offsets, 128)
    _, got = assert_fused_is_two_pass(
        np.zeros(n, np.float32), np.full(3, 1 / 3), int4_of(xs, 128), offsets, norms, 128, True
    )
    _, serial = assert_fused_is_two_pass(
        np.zeros(n, np.float32), np.full(3, 1 / 3), int4_of(xs, 128), offsets, norms, 128, False
    )
    np.testing.assert_array_equal(bits(got), bits(serial))


@pytest.mark.parametrize("block", [96, 6, 1 << 15])
@pytest.mark.parametrize("parallel", [True, False])
def test_blocks_that_do_not_divide_the_sums_cut_take_two_passes_with_the_same_bits(block, parallel):
    n = -(-(kernels.PARALLEL_ELEMENTS_MIN + 5000) // block) * block
    offsets = np.array([0, 7, 20000, n // 2, n - block // 2], dtype=np.int64)
    xs = [np.random.default_rng(i).standard_normal(n).astype(np.float32) for i in range(2)]
    norms = norms_of(xs, offsets, block)
    start = np.random.default_rng(9).standard_normal(n).astype(np.float32)
    assert_fused_is_two_pass(start, np.array([0.25, 0.75]), int4_of(xs, block), offsets, norms, block, parallel)


@pytest.mark.parametrize("parallel", [True, False])
@pytest.mark.parametrize("codec", ["fp32", "int4"])
def test_nan_and_inf_reach_the_sums_as_in_two_passes(codec, parallel):
    n = SIZES[1]
    block = 128 if codec == "int4" else None
    offsets = np.array([0, 1000, 30000, 40000, n - 64], dtype=np.int64)
    xs = [np.random.default_rng(i).standard_normal(n).astype(np.float32) for i in range(3)]
    norms = norms_of(xs, offsets, block)
    if block is None:
        xs[1][1500] = np.inf  # a norm given finite, a vector that is not: +Inf meets -Inf below
        xs[2][1500] = -np.inf
        xs[0][2000] = np.nan
    start = np.zeros(n, dtype=np.float32)
    start[10] = np.nan
    start[31000] = np.inf
    start[31001] = -np.inf  # one tensor holding both: Inf squared twice stays +Inf
    start[n - 10] = np.nan  # padding: neither summed nor written
    acc, got = assert_fused_is_two_pass(
        start, np.full(3, 1 / 3), payload_of(xs, block), offsets, norms, block, parallel
    )
    assert np.isnan(got[0]) and got[2] == np.inf and np.isfinite(got[3])
    assert np.isnan(got[1]) == (block is None)
    assert np.isnan(acc[n - 10])


def test_bad_rounds_with_sums_are_refused_before_anything_is_written():
    n = 1024
    x = np.ones(n, dtype=np.float32)
    codes, scales = kernels.quantize_int4(x)
    acc = np.ones(n, dtype=np.float32)
    w = np.array([0.5, 0.5])
    off = np.array([0, n], dtype=np.int64)
    good = np.ones((2, 1))
    frozen = np.ones(n, dtype=np.float32)
    frozen.flags.writeable = False
    fp32 = kernels.rda_accumulate_round_sumsq
    int4 = kernels.rda_accumulate_round_int4_sumsq
    bad = [
        (lambda: fp32(acc, w, [x, x], off, np.ones((1, 1))), r"shape \(2, 1\)"),
        (lambda: fp32(acc, w, [x, x], off, np.full((2, 1), np.nan)), "norms must be finite"),
        (lambda: fp32(acc, w, [x, x], off, -good), "norms must be finite and non-negative"),
        (lambda: fp32(acc, w, [x], off, good), "xs must hold 2"),
        (lambda: fp32(acc, w, x, off, good), "list or tuple"),
        (lambda: fp32(acc, w, [x, acc], off, good), "share memory"),
        (lambda: fp32(acc, w, [x, x[:10]], off, good), "xs\\[1\\] must have 1024"),
        (lambda: fp32(acc, w, [x, x.astype(np.float64)], off, good), "dtype float32"),
        (lambda: fp32(acc, np.array([0.5, np.inf]), [x, x], off, good), "weights must be finite"),
        (lambda: fp32(acc, w, [x, x], np.array([0, n + 1]), good), "past the 1024 elements"),
        (lambda: fp32(acc, w, [x, x], np.array([0, n], dtype=np.int32), good), "dtype int64"),
        (lambda: fp32(frozen, w, [x, x], off, good), "writeable"),
        (lambda: int4(acc, w, [codes], [scales, scales], off, good), "codes must hold 2"),
        (lambda: int4(acc, w, [codes, codes[:10]], [scales] * 2, off, good), "codes must have"),
        (lambda: int4(acc, w, [codes] * 2, [scales] * 2, off, good, 64), "scales must have"),
        (lambda: int4(acc, w, [codes] * 2, [scales, -scales], off, good), "scales must be finite"),
        (lambda: int4(acc, w, [codes] * 2, [scales] * 2, off, good, 3), "block must be a positive even"),
        (lambda: int4(acc, np.array([0.5, -1.0]), [codes] * 2, [scales] * 2, off, good), "weights must be finite"),
    ]
    for call, message in bad:
        with pytest.raises(kernels.KernelInputError, match=message):
            call()
        assert (acc == 1).all()


def test_a_round_over_no_tensor_sums_nothing():
    acc = np.ones(256, dtype=np.float32)
    x = np.ones(256, dtype=np.float32)
    got = kernels.rda_accumulate_round_sumsq(acc, np.array([1.0]), [x], np.zeros(3, np.int64), np.zeros((1, 2)))
    np.testing.assert_array_equal(got, np.zeros(2))
    assert (acc == 1).all()
