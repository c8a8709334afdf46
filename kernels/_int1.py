"""int1 sign + scale codec for the compression ablation (the classic 1-bit scheme).

Format, per block of `block` values (block a multiple of 8):
- scale = mean |x| of the block as float32 (sum in float64); a block of zeros decodes to 0.
- One bit per value: 1 for x >= 0 (both zeros included), decoding to +scale; 0 decodes to -scale.
- Bits split in eighths per block: byte j of a block holds element j + r * block/8 in bit r.

The mean is at most the absmax, so decoding never overflows. Inf and NaN are caught on the bit
patterns before the mean is taken; only that float64 sum may be reordered (fastmath reassoc).
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from ddiloco.kernels import _checks
from ddiloco.kernels._blockcodec import BlockCodec

_PER_BYTE = 8  # eight sign bits to a byte
_ABS_MASK = np.uint32(0x7FFFFFFF)
_NONFINITE_BITS = np.uint32(0x7F800000)


@njit(nogil=True, cache=True, fastmath={"reassoc"})
def _abs_sum(xs):
    # xs: f32[block] -> f64 sum of |x|. reassoc only reorders the sum so it vectorises; the caller
    # has already ruled out Inf and NaN on the bit patterns.
    total = 0.0
    for j in range(xs.size):
        total += abs(np.float64(xs[j]))
    return total


@njit(nogil=True, cache=True)
def _quantize_serial(x, xbits, codes, scales, block):
    # x: f32[m], xbits: u32[m] (same memory), codes: u8[m/8], scales: f32[m/block]
    eighth = block // 8
    nonfinite = 0
    for k in range(scales.size):
        xb = xbits[k * block : (k + 1) * block]  # u32[block]
        m = np.uint32(0)
        for j in range(block):  # Inf/NaN detection on bit patterns, see _int4
            m = max(m, xb[j] & _ABS_MASK)
        if m >= _NONFINITE_BITS:
            nonfinite += 1
            continue
        xs = x[k * block : (k + 1) * block]  # f32[block]
        scales[k] = np.float32(_abs_sum(xs) / block)
        c = codes[k * eighth : (k + 1) * eighth]  # u8[eighth]
        c[:] = 0
        for r in range(8):  # one bit plane at a time over contiguous values
            part = xs[r * eighth : (r + 1) * eighth]  # f32[eighth]
            for j in range(eighth):
                c[j] |= np.uint8(part[j] >= 0) << np.uint8(r)
    return nonfinite


@njit(parallel=True, nogil=True, cache=True)
def _quantize_parallel(x, xbits, codes, scales, block, bounds):
    nonfinite = 0
    for s in prange(bounds.size - 1):
        a = bounds[s]
        b = bounds[s + 1]
        nonfinite += _quantize_serial(x[a:b], xbits[a:b], codes[a // 8 : b // 8], scales[a // block : b // block], block)
    return nonfinite


@njit(nogil=True, cache=True)
def _dequantize_serial(codes, scales, out, block):
    # codes: u8[m/8], scales: f32[m/block], out: f32[m]
    eighth = block // 8
    for k in range(scales.size):
        s = scales[k]
        c = codes[k * eighth : (k + 1) * eighth]  # u8[eighth]
        for r in range(8):
            o = out[k * block + r * eighth : k * block + (r + 1) * eighth]  # f32[eighth]
            for j in range(eighth):
                bit = (np.int32(c[j]) >> r) & 1
                o[j] = np.float32(2 * bit - 1) * s


@njit(parallel=True, nogil=True, cache=True)
def _dequantize_parallel(codes, scales, out, block, bounds):
    for s in prange(bounds.size - 1):
        a = bounds[s]
        b = bounds[s + 1]
        _dequantize_serial(codes[a // 8 : b // 8], scales[a // block : b // block], out[a:b], block)


@njit(nogil=True, cache=True)
def _accumulate_serial(acc, weight, codes, scales, block):
    # acc: f32[m] (in place), weight: f64, codes: u8[m/8], scales: f32[m/block]
    eighth = block // 8
    for k in range(scales.size):
        ws = np.float32(weight * np.float64(scales[k]))
        c = codes[k * eighth : (k + 1) * eighth]  # u8[eighth]
        for r in range(8):
            a = acc[k * block + r * eighth : k * block + (r + 1) * eighth]  # f32[eighth]
            for j in range(eighth):
                bit = (np.int32(c[j]) >> r) & 1
                a[j] += ws * np.float32(2 * bit - 1)


@njit(parallel=True, nogil=True, cache=True)
def _accumulate_parallel(acc, weight, codes, scales, block, bounds):
    for s in prange(bounds.size - 1):
        a = bounds[s]
        b = bounds[s + 1]
        _accumulate_serial(acc[a:b], weight, codes[a // 8 : b // 8], scales[a // block : b // block], block)


_CODEC = BlockCodec(
    _PER_BYTE,
    (_quantize_serial, _quantize_parallel),
    (_dequantize_serial, _dequantize_parallel),
    (_accumulate_serial, _accumulate_parallel),
)


def quantize_int1(x: np.ndarray, block: int = _checks.BLOCK_DEFAULT) -> tuple[np.ndarray, np.ndarray]:
    """Sign bits and mean-|x| scales: returns (codes uint8[n/8], scales float32[n/block]); NaN/Inf raise."""
    return _CODEC.quantize(x, block)


def dequantize_int1(
    codes: np.ndarray, scales: np.ndarray, block: int = _checks.BLOCK_DEFAULT, *, out: np.ndarray | None = None
) -> np.ndarray:
    """float32[n] = +-scale of each value; n = scales.size * block."""
    return _CODEC.dequantize(codes, scales, block, out)


def accumulate_int1(
    acc: np.ndarray, weight: float, codes: np.ndarray, scales: np.ndarray, block: int = _checks.BLOCK_DEFAULT
) -> None:
    """acc += weight * dequantize_int1(codes, scales) in place, fused."""
    _CODEC.accumulate(acc, weight, codes, scales, block)
