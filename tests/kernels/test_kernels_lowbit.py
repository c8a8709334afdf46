"""int2 and int1 codecs (compression ablation): kernels against the reference, and their formats."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ddiloco import kernels
from ddiloco.kernels import reference

EPS32 = float(np.finfo(np.float32).eps)
TINY32 = float(np.finfo(np.float32).smallest_subnormal)
FLOAT32_MAX = float(np.finfo(np.float32).max)
SETTINGS = settings(max_examples=30, deadline=None)

CODECS = {
    "int2": (kernels.quantize_int2, kernels.dequantize_int2, kernels.accumulate_int2, 4),
    "int1": (kernels.quantize_int1, kernels.dequantize_int1, kernels.accumulate_int1, 8),
}
REFERENCES = {
    "int2": (reference.quantize_int2, reference.dequantize_int2, reference.accumulate_int2),
    "int1": (reference.quantize_int1, reference.dequantize_int1, reference.accumulate_int1),
}


@st.composite
def cases(draw):
    name = draw(st.sampled_from(sorted(CODECS)))
    per_byte = CODECS[name][3]
    block = draw(st.sampled_from([b for b in (8, 16, 24, 64, 128, 256) if b % per_byte == 0]))
    blocks = draw(st.integers(1, 9))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    x = (rng.standard_normal(blocks * block) * draw(st.sampled_from([1e-3, 1.0, 1e4]))).astype(np.float32)
    rows = x.reshape(blocks, block)
    features = draw(st.sets(st.sampled_from(["zero", "outlier", "denormal", "huge"])))
    if "zero" in features:
        rows[rng.integers(blocks)] = 0.0
    if "outlier" in features:
        x[rng.integers(x.size)] = np.float32(-1e30)
    if "denormal" in features:
        rows[rng.integers(blocks)] = rng.integers(-3, 4, block) * np.float32(TINY32)
    if "huge" in features:
        rows[rng.integers(blocks)] = rng.uniform(-1.0, 1.0, block).astype(np.float32) * np.float32(FLOAT32_MAX)
    return name, x, block


@SETTINGS
@given(cases())
def test_quantize_matches_reference(case):
    name, x, block = case
    quantize, dequantize, _, per_byte = CODECS[name]
    ref_quantize, ref_dequantize, _ = REFERENCES[name]
    codes, scales = quantize(x, block)
    ref_codes, ref_scales = ref_quantize(x, block)
    assert codes.shape == (x.size // per_byte,) and scales.shape == (x.size // block,)
    # int1 means are float64 sums in different orders: equal up to the float32 rounding
    np.testing.assert_allclose(scales, ref_scales, rtol=EPS32, atol=0)
    y = dequantize(codes, scales, block)
    y_ref = ref_dequantize(ref_codes, scales, block)
    # a level may differ only where x sits on a midpoint between two levels (int2) or at 0 (int1)
    differs = y != y_ref
    if name == "int2":
        s = np.repeat(scales.astype(np.float64), block)
        q = np.divide(x.astype(np.float64), s, out=np.zeros(x.size), where=s > 0)
        assert (np.abs(q[differs] - np.rint(q[differs] / 2) * 2) < 1e-9).all()
    else:
        assert not differs.any()
    assert np.isfinite(y).all()


@SETTINGS
@given(cases())
def test_dequantize_matches_reference_exactly(case):
    name, x, block = case
    quantize, dequantize, _, _ = CODECS[name]
    codes, scales = quantize(x, block)
    out = np.full(x.size, np.nan, dtype=np.float32)
    assert dequantize(codes, scales, block, out=out) is out
    np.testing.assert_array_equal(out, REFERENCES[name][1](codes, scales, block))


@SETTINGS
@given(cases(), st.floats(-4.0, 4.0, allow_nan=False, width=32))
def test_fused_accumulate_matches_reference(case, weight):
    name, x, block = case
    quantize, _, accumulate, _ = CODECS[name]
    codes, scales = quantize(x, block)
    acc0 = np.random.default_rng(1).standard_normal(x.size).astype(np.float32)
    got, want = acc0.copy(), acc0.copy()
    accumulate(got, weight, codes, scales, block)
    with np.errstate(over="ignore"):
        REFERENCES[name][2](want, weight, codes, scales, block)
    term = np.abs(np.float64(weight) * REFERENCES[name][1](codes, scales, block))
    tol = 4 * EPS32 * (np.abs(acc0) + term) + 16 * TINY32
    finite = np.isfinite(want)
    assert (np.abs(got[finite].astype(np.float64) - want[finite]) <= tol[finite]).all()


def test_int2_levels_and_layout():
    # absmax 3 gives scale 1: levels are -3, -1, 1, 3; midpoints (-2, 0, 2) go to the upper level
    x = np.array([3.0, -3.0, 0.9, -0.2, 2.0, 0.0, -2.0, -2.5], dtype=np.float32)
    codes, scales = kernels.quantize_int2(x, 8)
    assert scales[0] == 1.0
    np.testing.assert_array_equal(kernels.dequantize_int2(codes, scales, 8), [3, -3, 1, -1, 3, 1, -1, -3])
    # byte j holds elements j, j+2, j+4, j+6 in bits 0-1, 2-3, 4-5, 6-7; index = (level + 3) / 2
    idx = [3, 0, 2, 1, 3, 2, 1, 0]
    assert codes.tolist() == [idx[j] | idx[j + 2] << 2 | idx[j + 4] << 4 | idx[j + 6] << 6 for j in (0, 1)]


def test_int1_signs_mean_and_layout():
    x = np.array([1.0, -2.0, 0.0, 3.0, -4.0, 5.0, -6.0, 7.0, -0.0, 1, 1, 1, 1, 1, 1, -1], dtype=np.float32)
    codes, scales = kernels.quantize_int1(x, 16)
    assert scales[0] == np.float32(np.abs(x).sum() / 16)
    signs = np.where(x >= 0, 1.0, -1.0)  # both zeros count as positive
    np.testing.assert_array_equal(kernels.dequantize_int1(codes, scales, 16), signs * scales[0])
    bits = (x >= 0).astype(int)
    assert codes.tolist() == [sum(bits[j + 2 * r] << r for r in range(8)) for j in (0, 1)]


@pytest.mark.parametrize(
    ("name", "rms_max"),
    # measured on blocks of 128: int2 0.549, int1 0.600 (sign + mean |x| on a Gaussian: sqrt(1 - 2/pi))
    [("int2", 0.56), ("int1", 0.61)],
)
def test_gaussian_relative_rms_error(name, rms_max):
    quantize, dequantize, _, _ = CODECS[name]
    x = np.random.default_rng(11).standard_normal(1 << 16).astype(np.float32)
    y = dequantize(*quantize(x))
    rel_rms = np.sqrt(np.mean((y.astype(np.float64) - x) ** 2) / np.mean(x.astype(np.float64) ** 2))
    assert rms_max - 0.1 < rel_rms < rms_max


@pytest.mark.parametrize("name", sorted(CODECS))
def test_largest_values_decode_finite(name):
    quantize, dequantize, _, _ = CODECS[name]
    x = np.full(128, FLOAT32_MAX, dtype=np.float32)
    x[::3] = -FLOAT32_MAX
    y = dequantize(*quantize(x))
    assert np.isfinite(y).all() and np.abs(y).min() > 0.99 * FLOAT32_MAX


@pytest.mark.parametrize("name", sorted(CODECS))
def test_quantize_rejects_non_finite(name):
    x = np.ones(256, dtype=np.float32)
    x[3] = np.nan
    with pytest.raises(kernels.KernelInputError, match="NaN or Inf"):
        CODECS[name][0](x)


@pytest.mark.parametrize("name", sorted(CODECS))
def test_parallel_path_matches_reference(name):
    quantize, dequantize, accumulate, _ = CODECS[name]
    n = 1031 * 128
    rng = np.random.default_rng(5)
    x = rng.standard_normal(n).astype(np.float32)
    codes, scales = quantize(x)
    ref_codes, ref_scales = REFERENCES[name][0](x)
    np.testing.assert_allclose(scales, ref_scales, rtol=EPS32, atol=0)
    y = dequantize(codes, scales)
    assert (y != REFERENCES[name][1](ref_codes, scales)).sum() <= 2
    acc = rng.standard_normal(n).astype(np.float32)
    want = acc.copy()
    accumulate(acc, -0.7, codes, scales)
    REFERENCES[name][2](want, -0.7, codes, scales)
    np.testing.assert_allclose(acc, want, rtol=4 * EPS32, atol=4 * EPS32 * 8)
