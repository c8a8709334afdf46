"""bfloat16 conversion: bit-exact against the reference, which rounds by comparing distances."""

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from ddiloco import kernels
from ddiloco.kernels import reference


def as_f32(bits):
    return np.asarray(bits, dtype=np.uint32).view(np.float32)


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 2**32 - 1), st.integers(1, 3000))
def test_to_bf16_matches_reference_on_any_bit_pattern(seed, n):
    # uniformly random bit patterns: normals, denormals, zeros, Inf and NaN alike
    bits = np.random.default_rng(seed).integers(0, 2**32, n, dtype=np.uint64).astype(np.uint32)
    x = bits.view(np.float32)
    got = kernels.to_bf16(x)
    assert got.dtype == np.uint16
    np.testing.assert_array_equal(got, reference.to_bf16(x))
    back = kernels.from_bf16(got)
    np.testing.assert_array_equal(np.isnan(back), np.isnan(x))
    np.testing.assert_array_equal(back, reference.from_bf16(got))


def test_every_bf16_round_trips():
    u = np.arange(2**16, dtype=np.uint32).astype(np.uint16)
    x = kernels.from_bf16(u)
    np.testing.assert_array_equal(x.view(np.uint32), u.astype(np.uint32) << 16)
    again = kernels.to_bf16(x)
    nan = np.isnan(x)
    np.testing.assert_array_equal(again[~nan], u[~nan])
    assert np.isnan(kernels.from_bf16(again[nan])).all()


def test_ties_go_to_even_and_overflow_to_inf():
    one = 0x3F80
    x = np.array(
        [
            1 + 2**-8,  # halfway between 1 and 1 + 2**-7: to 1 (even)
            1 + 3 * 2**-8,  # halfway between 1 + 2**-7 and 1 + 2**-6: to 1 + 2**-6 (even)
            1 + 2**-8 + 2**-20,  # just above halfway: up
            -(1 + 2**-8),
            np.finfo(np.float32).max,  # beyond the largest bfloat16 + half an ulp: Inf
        ],
        dtype=np.float32,
    )
    assert kernels.to_bf16(x).tolist() == [one, one + 2, one + 1, 0x8000 | one, 0x7F80]


def test_nan_stays_nan_even_with_payload_only_in_low_bits():
    x = as_f32([0x7F800001, 0xFF800001, 0x7FC00000, 0x7F800000])  # two such NaNs, a quiet NaN, Inf
    back = kernels.from_bf16(kernels.to_bf16(x))
    assert np.isnan(back[:3]).all() and back[3] == np.inf


def test_out_buffers_and_parallel_path():
    n = 64 * (1 << 14) + 77  # every slice used, the last one short
    x = np.random.default_rng(2).standard_normal(n).astype(np.float32) * np.float32(1e3)
    out16 = np.zeros(n, dtype=np.uint16)
    assert kernels.to_bf16(x, out=out16) is out16
    np.testing.assert_array_equal(out16, reference.to_bf16(x))
    out32 = np.zeros(n, dtype=np.float32)
    assert kernels.from_bf16(out16, out=out32) is out32
    np.testing.assert_array_equal(out32, reference.from_bf16(out16))
