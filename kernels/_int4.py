"""int4 blockwise absmax codec (docs/algorithm.md, "Compression"): quantize, dequantize, fused accumulate.

Format, per block of `block` values (block even, default 128):
- scale = absmax / 7 as float32 (one per block); a block of zeros has scale 0 and decodes to 0.
- code = round-half-to-even(x / scale) clipped to [-7, 7]; a value decodes to code * scale.
- Codes are stored offset by 8 (code + 8, so 1..15) in nibbles, split half per block: byte j of a
  block holds element j in its low nibble and element j + block/2 in its high nibble. Both halves
  then decode with the same contiguous loop, which vectorises. A nibble of 0 (code -8) is never
  written by the quantizer; it decodes linearly to -8 * scale, so no byte value is undefined.

Floating point: codes come from float64 arithmetic, so a denormal scale never yields an infinite
reciprocal. 7 * scale cannot overflow: float32(max / 7) happens to round down, and rounding is
monotonic, so no absmax gives a larger scale (tests check the extreme). No fastmath anywhere
here: it would change the rounding of codes and the NaN checks.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from ddiloco.kernels import _checks
from ddiloco.kernels._blockcodec import BlockCodec

CODE_MAX = 7
_CODE_OFFSET = 8
_PER_BYTE = 2  # two nibbles to a byte
_ABS_MASK = np.uint32(0x7FFFFFFF)
_NONFINITE_BITS = np.uint32(0x7F800000)  # |x| bit patterns at or above this are Inf or NaN


@njit(nogil=True, cache=True)
def _quantize_serial(x, xbits, codes, scales, block):
    # x: f32[m], xbits: u32[m] (same memory), codes: u8[m/2], scales: f32[m/block]; m = blocks*block
    half = block // 2
    nonfinite = 0
    amax_bits = np.empty(1, np.uint32)  # u32[1], reinterpreted as f32 below
    amax_f32 = amax_bits.view(np.float32)  # f32[1]
    for k in range(scales.size):
        xb = xbits[k * block : (k + 1) * block]  # u32[block]
        m = np.uint32(0)
        # absmax on the bit patterns: for |x| the integer order is the float order, integer max
        # vectorises without fastmath, and Inf/NaN land above every finite value.
        for j in range(block):
            m = max(m, xb[j] & _ABS_MASK)
        if m >= _NONFINITE_BITS:
            nonfinite += 1
            continue
        amax_bits[0] = m
        scale = np.float32(np.float64(amax_f32[0]) / CODE_MAX)
        scales[k] = scale
        inv = 0.0 if scale == 0 else 1.0 / np.float64(scale)  # f64: finite even for denormal scales
        lo = x[k * block : k * block + half]  # f32[half]
        hi = x[k * block + half : (k + 1) * block]  # f32[half]
        c = codes[k * half : (k + 1) * half]  # u8[half]
        for j in range(half):
            ql = np.int32(min(max(np.rint(np.float64(lo[j]) * inv), -7.0), 7.0))
            qh = np.int32(min(max(np.rint(np.float64(hi[j]) * inv), -7.0), 7.0))
            c[j] = np.uint8((ql + _CODE_OFFSET) | ((qh + _CODE_OFFSET) << 4))
    return nonfinite


@njit(parallel=True, nogil=True, cache=True)
def _quantize_parallel(x, xbits, codes, scales, block, bounds):
    # bounds: i64[s+1] element boundaries, multiples of block
    nonfinite = 0
    for s in prange(bounds.size - 1):
        a = bounds[s]
        b = bounds[s + 1]
        nonfinite += _quantize_serial(x[a:b], xbits[a:b], codes[a // 2 : b // 2], scales[a // block : b // block], block)
    return nonfinite


@njit(nogil=True, cache=True)
def _dequantize_serial(codes, scales, out, block):
    # codes: u8[m/2], scales: f32[m/block], out: f32[m]
    half = block // 2
    for k in range(scales.size):
        s = scales[k]
        c = codes[k * half : (k + 1) * half]  # u8[half]
        lo = out[k * block : k * block + half]  # f32[half]
        hi = out[k * block + half : (k + 1) * block]  # f32[half]
        for j in range(half):
            b = np.int32(c[j])
            lo[j] = np.float32((b & 15) - _CODE_OFFSET) * s
            hi[j] = np.float32((b >> 4) - _CODE_OFFSET) * s


@njit(parallel=True, nogil=True, cache=True)
def _dequantize_parallel(codes, scales, out, block, bounds):
    for s in prange(bounds.size - 1):
        a = bounds[s]
        b = bounds[s + 1]
        _dequantize_serial(codes[a // 2 : b // 2], scales[a // block : b // block], out[a:b], block)


@njit(nogil=True, cache=True)
def _accumulate_serial(acc, weight, codes, scales, block):
    # acc: f32[m] (in place), weight: f64, codes: u8[m/2], scales: f32[m/block]
    half = block // 2
    for k in range(scales.size):
        ws = np.float32(weight * np.float64(scales[k]))  # one product per block, not per value
        c = codes[k * half : (k + 1) * half]  # u8[half]
        lo = acc[k * block : k * block + half]  # f32[half]
        hi = acc[k * block + half : (k + 1) * block]  # f32[half]
        for j in range(half):
            b = np.int32(c[j])
            lo[j] += ws * np.float32((b & 15) - _CODE_OFFSET)
            hi[j] += ws * np.float32((b >> 4) - _CODE_OFFSET)


@njit(parallel=True, nogil=True, cache=True)
def _accumulate_parallel(acc, weight, codes, scales, block, bounds):
    for s in prange(bounds.size - 1):
        a = bounds[s]
        b = bounds[s + 1]
        _accumulate_serial(acc[a:b], weight, codes[a // 2 : b // 2], scales[a // block : b // block], block)


_CODEC = BlockCodec(
    _PER_BYTE,
    (_quantize_serial, _quantize_parallel),
    (_dequantize_serial, _dequantize_parallel),
    (_accumulate_serial, _accumulate_parallel),
)


def quantize_int4(x: np.ndarray, block: int = _checks.BLOCK_DEFAULT) -> tuple[np.ndarray, np.ndarray]:
    """Blockwise absmax int4: returns (codes uint8[n/2], scales float32[n/block]).

    `x` is float32[n] with n a multiple of `block`; NaN or Inf anywhere raises KernelInputError.
    """
    return _CODEC.quantize(x, block)


def dequantize_int4(
    codes: np.ndarray, scales: np.ndarray, block: int = _checks.BLOCK_DEFAULT, *, out: np.ndarray | None = None
) -> np.ndarray:
    """float32[n] = code * scale of each value; n = scales.size * block. Writes into `out` if given."""
    return _CODEC.dequantize(codes, scales, block, out)


def accumulate_int4(
    acc: np.ndarray, weight: float, codes: np.ndarray, scales: np.ndarray, block: int = _checks.BLOCK_DEFAULT
) -> None:
    """acc += weight * dequantize_int4(codes, scales) in place, without materialising the fp32 vector."""
    _CODEC.accumulate(acc, weight, codes, scales, block)
