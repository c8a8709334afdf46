"""The learner's one-pass kernels: outer gradient + int4 quantisation with error feedback, and the apply
of an arrived int4 delta, against the numpy expressions they replace."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ddiloco import kernels
from ddiloco.kernels import reference

SETTINGS = settings(max_examples=30, deadline=None)


@st.composite
def fragments(draw):
    block = draw(st.sampled_from([2, 16, 128]))
    n = block * draw(st.sampled_from([1, 5, 700, 1100]))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    base = rng.standard_normal(n).astype(np.float32)
    theta = base - (rng.standard_normal(n) * draw(st.sampled_from([1e-4, 1e-2, 1.0]))).astype(np.float32)
    if draw(st.booleans()):
        theta[:block] = base[:block]  # an untouched block: zero outer gradient
    residual = (rng.standard_normal(n) * 1e-3).astype(np.float32) if draw(st.booleans()) else None
    return base, theta, residual, block


@SETTINGS
@given(fragments(), st.booleans())
def test_quantize_delta_is_the_numpy_expression_quantised(case, parallel):
    base, theta, residual, block = case
    before = (base.copy(), theta.copy(), None if residual is None else residual.copy())
    codes, scales, new_residual = kernels.quantize_delta_int4(base, theta, residual, block, parallel=parallel)
    target = base - theta if residual is None else (base - theta) + residual
    want_codes, want_scales = kernels.quantize_int4(target, block, parallel=False)
    np.testing.assert_array_equal(codes, want_codes)
    np.testing.assert_array_equal(scales, want_scales)
    _, ref_scales, _ = reference.quantize_delta_int4(base, theta, residual, block)
    np.testing.assert_array_equal(scales, ref_scales)
    if residual is None:
        assert new_residual is None
    else:
        np.testing.assert_array_equal(new_residual, target - kernels.dequantize_int4(codes, scales, block))
        # error feedback loses nothing: what was sent plus what is kept is the target
        np.testing.assert_allclose(
            kernels.dequantize_int4(codes, scales, block) + new_residual, target, rtol=1e-6, atol=1e-30
        )
    for a, b in zip(before, (base, theta, residual)):
        if a is not None:
            np.testing.assert_array_equal(a, b)  # inputs untouched; the residual comes back fresh


@SETTINGS
@given(fragments(), st.booleans())
def test_apply_delta_adds_the_decoded_delta_to_theta_and_base(case, parallel):
    base, theta, _, block = case
    codes, scales = kernels.quantize_int4(base - theta, block)
    t, b = theta.copy(), base.copy()
    kernels.apply_delta_int4(t, b, codes, scales, block, parallel=parallel)
    t_ref, b_ref = theta.copy(), base.copy()
    reference.apply_delta_int4(t_ref, b_ref, codes, scales, block)
    np.testing.assert_array_equal(t, t_ref)
    np.testing.assert_array_equal(b, b_ref)


@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_a_non_finite_outer_gradient_is_refused_and_nothing_changes(bad):
    n = 1 << 17
    base = np.ones(n, dtype=np.float32)
    theta = np.zeros(n, dtype=np.float32)
    theta[n - 5] = bad
    residual = np.full(n, 0.25, dtype=np.float32)
    with pytest.raises(kernels.KernelInputError, match="NaN or Inf values in 1 of"):
        kernels.quantize_delta_int4(base, theta, residual)
    assert (residual == 0.25).all() and (base == 1).all()


def test_bad_learner_calls():
    n = 256
    x = np.ones(n, dtype=np.float32)
    codes, scales = kernels.quantize_int4(x)
    with pytest.raises(kernels.KernelInputError, match="theta must have 256"):
        kernels.quantize_delta_int4(x, x[:128])
    with pytest.raises(kernels.KernelInputError, match="residual must have dtype float32"):
        kernels.quantize_delta_int4(x, x, x.astype(np.float64))
    with pytest.raises(kernels.KernelInputError, match="share memory"):
        kernels.apply_delta_int4(x, x, codes, scales)
    with pytest.raises(kernels.KernelInputError, match="scales must have 2"):
        kernels.apply_delta_int4(x, x.copy(), codes, scales[:1])


@SETTINGS
@given(fragments(), st.booleans())
def test_publish_delta_is_the_numpy_expressions_and_a_learner_reconstructs_its_bits(case, parallel):
    published, theta, _, block = case
    theta_before = theta.copy()
    mine, ref = published.copy(), published.copy()
    codes, scales = kernels.publish_delta_int4(mine, theta, block, parallel=parallel)
    ref_codes, ref_scales = reference.publish_delta_int4(ref, theta, block)
    np.testing.assert_array_equal(codes, ref_codes)
    np.testing.assert_array_equal(scales, ref_scales)
    np.testing.assert_array_equal(mine.view(np.uint32), ref.view(np.uint32))
    np.testing.assert_array_equal(theta, theta_before)
    # a learner holding the old published copy adds the decoded delta and holds the same bits
    learner, learner_ref = published.copy(), published.copy()
    kernels.add_delta_int4(learner, codes, scales, block, parallel=not parallel)
    reference.add_delta_int4(learner_ref, codes, scales, block)
    np.testing.assert_array_equal(learner.view(np.uint32), mine.view(np.uint32))
    np.testing.assert_array_equal(learner_ref.view(np.uint32), mine.view(np.uint32))
    # published is now within half a quantisation step of theta, block by block
    step = np.repeat(scales, block)
    assert (np.abs(theta - mine) <= 0.5 * step * (1 + 1e-5) + 1e-30 + np.abs(theta) * 1e-6).all()


def test_publish_delta_refuses_bad_calls():
    x = np.ones(256, dtype=np.float32)
    with pytest.raises(kernels.KernelInputError):
        kernels.publish_delta_int4(x, x)  # the same memory
    with pytest.raises(kernels.KernelInputError):
        kernels.publish_delta_int4(x.copy(), x[:128])
    theta = x.copy()
    theta[3] = np.inf
    with pytest.raises(kernels.KernelInputError, match="NaN or Inf values in 1 of"):
        kernels.publish_delta_int4(x.copy(), theta)
    codes, scales = kernels.quantize_int4(x)
    with pytest.raises(kernels.KernelInputError):
        kernels.add_delta_int4(x[:128].copy(), codes, scales)


@SETTINGS
@given(fragments(), st.booleans())
def test_add_delta_apart_is_add_delta_onto_a_copy_and_the_difference_to_the_anchor(case, parallel):
    onto, anchor, _, block = case
    theta = onto + np.float32(0.5) * (anchor - onto)
    codes, scales = kernels.quantize_int4(theta - onto, block)
    before = (onto.copy(), anchor.copy())
    published, difference = kernels.add_delta_apart_int4(onto, anchor, codes, scales, block, parallel=parallel)
    want = onto.copy()
    kernels.add_delta_int4(want, codes, scales, block, parallel=False)
    np.testing.assert_array_equal(published.view(np.uint32), want.view(np.uint32))
    np.testing.assert_array_equal(difference.view(np.uint32), (want - anchor).view(np.uint32))
    ref_published, ref_difference = reference.add_delta_apart_int4(onto, anchor, codes, scales, block)
    np.testing.assert_array_equal(published.view(np.uint32), ref_published.view(np.uint32))
    np.testing.assert_array_equal(difference.view(np.uint32), ref_difference.view(np.uint32))
    for a, b in zip(before, (onto, anchor)):
        np.testing.assert_array_equal(a, b)  # inputs untouched


def test_add_delta_apart_refuses_bad_calls():
    x = np.ones(256, dtype=np.float32)
    codes, scales = kernels.quantize_int4(x)
    with pytest.raises(kernels.KernelInputError, match="anchor must have 256"):
        kernels.add_delta_apart_int4(x, x[:128], codes, scales)
    with pytest.raises(kernels.KernelInputError, match="onto must have dtype float32"):
        kernels.add_delta_apart_int4(x.astype(np.float64), x, codes, scales)
    with pytest.raises(kernels.KernelInputError, match="scales must have 2"):
        kernels.add_delta_apart_int4(x, x.copy(), codes, scales[:1])
