"""int2 blockwise codec for the compression ablation (docs/algorithm.md, "Compression": 2 bits collapse quality).

Format, per block of `block` values (block a multiple of 4):
- scale = absmax / 3 as float32; a block of zeros has scale 0 and decodes to 0.
- Four symmetric levels {-3, -1, 1, 3} * scale, so the extremes are +-absmax and no code is wasted.
  A value takes the nearest level; exact midpoints (x / scale in {-2, 0, 2}) go to the upper one.
- The level index u = (level + 3) / 2 in 0..3 takes two bits, split in quarters per block: byte j of
  a block holds element j + r * block/4 in bits 2r..2r+1, for r = 0..3.

Same floating-point care as int4 (float64 reciprocal, no fastmath); float32(max / 3) rounds down
too, so decoding never overflows.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from ddiloco.kernels import _checks
from ddiloco.kernels._blockcodec import BlockCodec

LEVEL_MAX = 3
_PER_BYTE = 4  # four 2-bit level indices to a byte
_ABS_MASK = np.uint32(0x7FFFFFFF)
_NONFINITE_BITS = np.uint32(0x7F800000)


@njit(nogil=True, cache=True)
def _quantize_serial(x, xbits, codes, scales, block):
    # x: f32[m], xbits: u32[m] (same memory), codes: u8[m/4], scales: f32[m/block]
    quarter = block // 4
    nonfinite = 0
    amax_bits = np.empty(1, np.uint32)  # u32[1], reinterpreted as f32
    amax_f32 = amax_bits.view(np.float32)  # f32[1]
    for k in range(scales.size):
        xb = xbits[k * block : (k + 1) * block]  # u32[block]
        m = np.uint32(0)
        for j in range(block):  # absmax on bit patterns, see _int4
            m = max(m, xb[j] & _ABS_MASK)
        if m >= _NONFINITE_BITS:
            nonfinite += 1
            continue
        amax_bits[0] = m
        scale = np.float32(np.float64(amax_f32[0]) / LEVEL_MAX)
        scales[k] = scale
        inv = 0.0 if scale == 0 else 1.0 / np.float64(scale)
        xs = x[k * block : (k + 1) * block]  # f32[block]
        c = codes[k * quarter : (k + 1) * quarter]  # u8[quarter]
        for j in range(quarter):
            byte = 0
            for r in range(4):
                q = np.float64(xs[j + r * quarter]) * inv
                # nearest odd integer: 2*floor(q/2) + 1, then clipped to the outer levels
                level = min(max(2.0 * np.floor(0.5 * q) + 1.0, -3.0), 3.0)
                byte |= (np.int32(level) + 3) >> 1 << (2 * r)
            c[j] = np.uint8(byte)
    return nonfinite


@njit(parallel=True, nogil=True, cache=True)
def _quantize_parallel(x, xbits, codes, scales, block, bounds):
    nonfinite = 0
    for s in prange(bounds.size - 1):
        a = bounds[s]
        b = bounds[s + 1]
        nonfinite += _quantize_serial(x[a:b], xbits[a:b], codes[a // 4 : b // 4], scales[a // block : b // block], block)
    return nonfinite


@njit(nogil=True, cache=True)
def _dequantize_serial(codes, scales, out, block):
    # codes: u8[m/4], scales: f32[m/block], out: f32[m]
    quarter = block // 4
    for k in range(scales.size):
        s = scales[k]
        c = codes[k * quarter : (k + 1) * quarter]  # u8[quarter]
        for r in range(4):
            o = out[k * block + r * quarter : k * block + (r + 1) * quarter]  # f32[quarter]
            shift = 2 * r
            for j in range(quarter):
                u = (np.int32(c[j]) >> shift) & 3
                o[j] = np.float32(2 * u - 3) * s


@njit(parallel=True, nogil=True, cache=True)
def _dequantize_parallel(codes, scales, out, block, bounds):
    for s in prange(bounds.size - 1):
        a = bounds[s]
        b = bounds[s + 1]
        _dequantize_serial(codes[a // 4 : b // 4], scales[a // block : b // block], out[a:b], block)


@njit(nogil=True, cache=True)
def _accumulate_serial(acc, weight, codes, scales, block):
    # acc: f32[m] (in place), weight: f64, codes: u8[m/4], scales: f32[m/block]
    quarter = block // 4
    for k in range(scales.size):
        ws = np.float32(weight * np.float64(scales[k]))
        c = codes[k * quarter : (k + 1) * quarter]  # u8[quarter]
        for r in range(4):
            a = acc[k * block + r * quarter : k * block + (r + 1) * quarter]  # f32[quarter]
            shift = 2 * r
            for j in range(quarter):
                u = (np.int32(c[j]) >> shift) & 3
                a[j] += ws * np.float32(2 * u - 3)


@njit(parallel=True, nogil=True, cache=True)
def _accumulate_parallel(acc, weight, codes, scales, block, bounds):
    for s in prange(bounds.size - 1):
        a = bounds[s]
        b = bounds[s + 1]
        _accumulate_serial(acc[a:b], weight, codes[a // 4 : b // 4], scales[a // block : b // block], block)


_CODEC = BlockCodec(
    _PER_BYTE,
    (_quantize_serial, _quantize_parallel),
    (_dequantize_serial, _dequantize_parallel),
    (_accumulate_serial, _accumulate_parallel),
)


def quantize_int2(x: np.ndarray, block: int = _checks.BLOCK_DEFAULT) -> tuple[np.ndarray, np.ndarray]:
    """Four-level int2: returns (codes uint8[n/4], scales float32[n/block]); NaN/Inf raise."""
    return _CODEC.quantize(x, block)


def dequantize_int2(
    codes: np.ndarray, scales: np.ndarray, block: int = _checks.BLOCK_DEFAULT, *, out: np.ndarray | None = None
) -> np.ndarray:
    """float32[n] = level * scale of each value; n = scales.size * block."""
    return _CODEC.dequantize(codes, scales, block, out)


def accumulate_int2(
    acc: np.ndarray, weight: float, codes: np.ndarray, scales: np.ndarray, block: int = _checks.BLOCK_DEFAULT
) -> None:
    """acc += weight * dequantize_int2(codes, scales) in place, fused."""
    _CODEC.accumulate(acc, weight, codes, scales, block)
