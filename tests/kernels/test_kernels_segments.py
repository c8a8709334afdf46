"""Per-tensor kernels for RDA: sums of squares and norm-scaled accumulation, dense and int4."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ddiloco import kernels
from ddiloco.kernels import _parallelism, reference

EPS32 = float(np.finfo(np.float32).eps)
TINY32 = float(np.finfo(np.float32).smallest_subnormal)
SETTINGS = settings(max_examples=40, deadline=None)


@st.composite
def fragments(draw, block=None):
    """(x, offsets, block): tensors of random sizes (empty ones included), some all-zero, then
    zero padding that belongs to no tensor. With `block`, the length is a multiple of it."""
    block = block or draw(st.sampled_from([2, 8, 64, 128]))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    sizes = draw(st.lists(st.sampled_from([0, 1, 3, 50, 127, 128, 129, 400, 1000]), min_size=1, max_size=12))
    covered = int(sum(sizes))
    padding = draw(st.integers(0, 2 * block))
    n = -(-(covered + padding) // block) * block
    x = np.zeros(n, dtype=np.float32)
    x[:covered] = rng.standard_normal(covered).astype(np.float32) * np.float32(10.0 ** rng.integers(-3, 4))
    offsets = np.zeros(len(sizes) + 1, dtype=np.int64)
    np.cumsum(sizes, out=offsets[1:])
    for i in np.flatnonzero(rng.random(len(sizes)) < 0.25):  # zero tensors have norm 0
        x[offsets[i] : offsets[i + 1]] = 0.0
    return x, offsets, block


def outside(offsets, n, norms):
    """Mask of the values RDA must leave untouched: padding and tensors whose norm is 0."""
    mask = np.ones(n, dtype=bool)
    for i, norm in enumerate(norms):
        if norm > 0:
            mask[offsets[i] : offsets[i + 1]] = False
    return mask


@SETTINGS
@given(fragments())
def test_segment_sumsq_matches_reference(case):
    x, offsets, _ = case
    got = kernels.segment_sumsq(x, offsets)
    assert got.dtype == np.float64 and got.shape == (offsets.size - 1,)
    np.testing.assert_allclose(got, reference.segment_sumsq(x, offsets), rtol=1e-12, atol=0)


@SETTINGS
@given(fragments())
def test_segment_sumsq_int4_matches_reference(case):
    x, offsets, block = case
    codes, scales = kernels.quantize_int4(x, block)
    got = kernels.segment_sumsq_int4(codes, scales, offsets, block)
    # the kernel squares code * scale exactly, the reference its float32 rounding
    np.testing.assert_allclose(got, reference.segment_sumsq_int4(codes, scales, offsets, block), rtol=4 * EPS32, atol=0)


@SETTINGS
@given(fragments(), st.floats(-3.0, 3.0, allow_nan=False))
def test_rda_accumulate_matches_reference(case, weight):
    x, offsets, _ = case
    norms = np.sqrt(reference.segment_sumsq(x, offsets))
    acc0 = np.random.default_rng(9).standard_normal(x.size).astype(np.float32)
    got, want = acc0.copy(), acc0.copy()
    kernels.rda_accumulate(got, weight, x, offsets, norms)
    reference.rda_accumulate(want, weight, x, offsets, norms)
    np.testing.assert_array_equal(got, want)
    untouched = outside(offsets, x.size, norms)
    np.testing.assert_array_equal(got[untouched], acc0[untouched])


@SETTINGS
@given(fragments(), st.floats(-3.0, 3.0, allow_nan=False))
def test_rda_accumulate_int4_matches_reference(case, weight):
    x, offsets, block = case
    codes, scales = kernels.quantize_int4(x, block)
    norms = np.sqrt(reference.segment_sumsq_int4(codes, scales, offsets, block))
    acc0 = np.random.default_rng(9).standard_normal(x.size).astype(np.float32)
    got, want = acc0.copy(), acc0.copy()
    kernels.rda_accumulate_int4(got, weight, codes, scales, offsets, norms, block)
    reference.rda_accumulate_int4(want, weight, codes, scales, offsets, norms, block)
    term = np.abs(want.astype(np.float64) - acc0)
    tol = 2 * EPS32 * (np.abs(acc0) + term) + TINY32
    assert (np.abs(got.astype(np.float64) - want) <= tol).all()
    untouched = outside(offsets, x.size, norms)
    np.testing.assert_array_equal(got[untouched], acc0[untouched])


def test_rda_unit_vectors_by_hand():
    # tensor 0 = (3, 4) has norm 5; tensor 1 is empty; tensor 2 = (0,) has norm 0; then padding
    x = np.array([3.0, 4.0, 0.0, 9.0], dtype=np.float32)
    offsets = np.array([0, 2, 2, 3], dtype=np.int64)
    norms = np.sqrt(kernels.segment_sumsq(x, offsets))
    np.testing.assert_array_equal(norms, [5.0, 0.0, 0.0])
    acc = np.zeros(4, dtype=np.float32)
    kernels.rda_accumulate(acc, 10.0, x, offsets, norms)
    np.testing.assert_array_equal(acc, [6.0, 8.0, 0.0, 0.0])


def test_tiny_norm_does_not_overflow():
    # weight / norm is far beyond float32, but each x / norm is at most 1
    x = np.zeros(8, dtype=np.float32)
    x[:2] = np.float32(TINY32)
    offsets = np.array([0, 2], dtype=np.int64)
    norms = np.sqrt(kernels.segment_sumsq(x, offsets))
    acc = np.zeros(8, dtype=np.float32)
    kernels.rda_accumulate(acc, 1e30, x, offsets, norms)
    np.testing.assert_allclose(acc[:2], 1e30 / np.sqrt(2), rtol=1e-6)


def large_fragment(block=128):
    rng = np.random.default_rng(21)
    n = (1 << 21) + 5 * block
    sizes = rng.integers(0, 40000, 50)  # about 1.3M elements in tensors: all 64 slices used
    sizes[3] = 300000  # one tensor spanning many slices
    sizes[10] = 0
    offsets = np.zeros(sizes.size + 1, dtype=np.int64)
    np.cumsum(sizes, out=offsets[1:])
    assert offsets[-1] < n
    x = rng.standard_normal(n).astype(np.float32)
    x[offsets[-1] :] = 0.0
    return x, offsets


def test_parallel_path_matches_reference():
    x, offsets = large_fragment()
    end = int(offsets[-1])
    assert _parallelism.use_parallel(end) and _parallelism.slice_bounds(end, 1 << 14).size - 1 == 64
    np.testing.assert_allclose(kernels.segment_sumsq(x, offsets), reference.segment_sumsq(x, offsets), rtol=1e-12)
    codes, scales = kernels.quantize_int4(x)
    np.testing.assert_allclose(
        kernels.segment_sumsq_int4(codes, scales, offsets),
        reference.segment_sumsq_int4(codes, scales, offsets),
        rtol=4 * EPS32,
    )
    norms = np.sqrt(reference.segment_sumsq(x, offsets))
    acc, want = np.ones(x.size, np.float32), np.ones(x.size, np.float32)
    kernels.rda_accumulate(acc, 0.5, x, offsets, norms)
    reference.rda_accumulate(want, 0.5, x, offsets, norms)
    np.testing.assert_array_equal(acc, want)
    acc, want = np.ones(x.size, np.float32), np.ones(x.size, np.float32)
    kernels.rda_accumulate_int4(acc, 0.5, codes, scales, offsets, norms)
    reference.rda_accumulate_int4(want, 0.5, codes, scales, offsets, norms)
    np.testing.assert_allclose(acc, want, rtol=2 * EPS32, atol=2 * EPS32)


@pytest.mark.parametrize("codec", ["fp32", "int4"])
def test_sums_are_the_same_bits_on_either_driver(codec, monkeypatch):
    # the serial driver walks the same slices as the parallel one, so replay on any machine (or in a
    # process that may not use threads) reproduces a merge exactly
    x, offsets = large_fragment()
    codes, scales = kernels.quantize_int4(x)
    run = {
        "fp32": lambda: kernels.segment_sumsq(x, offsets),
        "int4": lambda: kernels.segment_sumsq_int4(codes, scales, offsets),
    }[codec]
    parallel = run()
    monkeypatch.setattr(_parallelism, "_forked_child", True)
    assert not _parallelism.use_parallel(x.size)
    np.testing.assert_array_equal(run(), parallel)
