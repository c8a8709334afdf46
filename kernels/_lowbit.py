"""The blockwise low-bit codecs, int4, int2 and int1 (docs/algorithm.md, "Compression"), behind one set of drivers.

Every codec stores one float32 scale per block of `block` values and `8 / bits` codes per byte, the
codes of a block split in `8 / bits` contiguous parts (byte j of a block holds element j + r * part
in bits [r * bits, (r + 1) * bits)), so that each part decodes with one contiguous loop that
vectorises. Formats, per block:

- int4 (bits 4, block even, default 128): scale = absmax / 7 as float32; code = round-half-to-even
  (x / scale) clipped to [-7, 7], stored as code + 8 (1..15). A nibble of 0 (code -8) is never
  written; it decodes linearly to -8 * scale, so no byte value is undefined.
- int2 (bits 2, block a multiple of 4): scale = absmax / 3; four symmetric levels {-3, -1, 1, 3} *
  scale, a value takes the nearest (exact midpoints go to the upper one), stored as (level + 3) / 2.
- int1 (bits 1, block a multiple of 8): scale = mean |x| (summed in float64); 1 for x >= 0 (both
  zeros), decoding to +scale, 0 to -scale.

A block of zeros has scale 0 and decodes to 0. Codes come from float64 arithmetic, so a denormal scale
never yields an infinite reciprocal; float32(max / 7) and float32(max / 3) round down and a mean is at
most the absmax, so decoding never overflows (tests check the extremes). Inf and NaN are found on the
float32 bit patterns (for |x| the integer order is the float order, and the integer max vectorises
without fastmath) before anything is computed from a block. No fastmath, except for int1's float64
sum of |x|, which may be reordered so that it vectorises.

The loops are written once: a loop over blocks per operation that takes the codec's block function as
an argument (inlined at numba's level, so it compiles to one tight loop per codec), a serial driver
that picks the codec once per call, and a parallel driver that runs it over slices of whole blocks.
Inlining matters: a block function called per block cost 0.24-0.57 ns per value against 0.13 ns
inlined (one thread, int4 accumulate, a micro-benchmark on this project's 2-core host), since the
vectorised loop then sees the slices it works on. All of it lives in this one file because numba's on-disk cache is invalidated only by edits to
the cached function's own file (a driver calling loops from another file could run stale code), and a
driver made by a factory closure is never loaded from the cache at all (measured: a recompile per process).

The learner's kernels are here too: quantize_delta (outer gradient base - theta, plus the error-feedback
residual, quantised, and the new residual, in one pass) and apply_delta (theta and base += a decoded
delta, in one pass). So are the broadcast's (core.publish): publish_delta (the syncer's delta
theta - published quantised and its decoded value added to published, in one pass) and add_delta (a
learner's published += the decoded delta, the same float32 operations, so the same bits).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from numba import njit, prange

from ddiloco.kernels import _checks
from ddiloco.kernels._errors import KernelInputError
from ddiloco.kernels._nesterov import _nesterov_serial
from ddiloco.kernels._parallelism import thread_bounds, tile_elements, typed_list

INT4_CODE_MAX = 7
INT2_LEVEL_MAX = 3
_INT4_OFFSET = 8
_ABS_MASK = np.uint32(0x7FFFFFFF)
_NONFINITE_BITS = np.uint32(0x7F800000)  # |x| bit patterns at or above this are Inf or NaN


# ---- one block of each codec: xs f32[block], c its code bytes u8[block * bits / 8] ----


@njit(nogil=True, inline="always")
def _absmax_bits(xb):
    # xb: u32[block] bit patterns -> the largest |x| pattern (Inf/NaN land above every finite value)
    # Every value stays uint32: numba widens uint32 & uint32 to 64 bits, and a max in 64-bit lanes
    # holds half as many values per vector (this pass was about a tenth of int4 quantise's time).
    m = np.uint32(0)
    for j in range(xb.size):
        v = np.uint32(xb[j] & _ABS_MASK)
        m = v if v > m else m
    return m


@njit(nogil=True, cache=True, fastmath={"reassoc"})
def _abs_sum(xs):
    # f64 sum of |x|; reassoc only reorders the sum so it vectorises (Inf/NaN were ruled out before).
    # Not inlined: the caller has no fastmath, and the flag must stay on this loop.
    total = 0.0
    for j in range(xs.size):
        total += abs(np.float64(xs[j]))
    return total


@njit(nogil=True, inline="always")
def _scale4(amax):
    # -> (scale, 1 / scale in f64): f64 so that the reciprocal is finite even for a denormal scale
    scale = np.float32(np.float64(amax) / INT4_CODE_MAX)
    return scale, 0.0 if scale == 0 else 1.0 / np.float64(scale)


@njit(nogil=True, inline="always")
def _code4(x, inv):
    # the code of x as an integral f64 in [-7, 7]
    return min(max(np.rint(np.float64(x) * inv), -7.0), 7.0)


@njit(nogil=True, inline="always")
def _pack4(ql, qh):
    # (ql + 8) | (qh + 8) << 4 from integral f64 codes, summed as floats: one conversion per byte,
    # not two 64-bit integer lanes (numba widens int32 arithmetic with int literals)
    return np.uint8(np.int32(ql + 16.0 * qh + (_INT4_OFFSET + 16 * _INT4_OFFSET)))


@njit(nogil=True, inline="always")
def _quantize4(xs, c, amax):
    half = c.size
    scale, inv = _scale4(amax)
    lo = xs[:half]
    hi = xs[half:]
    for j in range(half):
        c[j] = _pack4(_code4(lo[j], inv), _code4(hi[j], inv))
    return scale


@njit(nogil=True, inline="always")
def _quantize4_residual(xs, c, amax, out, scratch):
    # _quantize4, and out = xs - decode(codes) in the same loop: the decoded value is the f32 product
    # code * scale that _set4 makes, so the bits are those of quantise, decode, subtract. The learner's
    # encode went from 0.86 to 0.69 ns per value (one thread, this project's 2-core host), the
    # syncer's publish (below) from 0.90 to 0.55. scratch is unused.
    half = c.size
    scale, inv = _scale4(amax)
    xl = xs[:half]
    xh = xs[half:]
    ol = out[:half]
    oh = out[half:]
    for j in range(half):
        ql = _code4(xl[j], inv)
        qh = _code4(xh[j], inv)
        c[j] = _pack4(ql, qh)
        ol[j] = xl[j] - np.float32(ql) * scale
        oh[j] = xh[j] - np.float32(qh) * scale
    return scale


@njit(nogil=True, inline="always")
def _quantize4_publish(xs, c, amax, published):
    # _quantize4, and published += decode(codes) in the same loop (the f32 add of _set4's product
    # that a learner makes in _add_published_blocks, so both copies keep the same bits). Not one
    # function with _quantize4_residual (out = onto + sign * decode): written so, the publish ran at
    # 1.45 ns per value instead of 0.55 (its in-place add no longer vectorised) and the encode at 0.74
    # instead of 0.69 (one thread, this project's 2-core host).
    half = c.size
    scale, inv = _scale4(amax)
    xl = xs[:half]
    xh = xs[half:]
    pl = published[:half]
    ph = published[half:]
    for j in range(half):
        ql = _code4(xl[j], inv)
        qh = _code4(xh[j], inv)
        c[j] = _pack4(ql, qh)
        pl[j] += np.float32(ql) * scale
        ph[j] += np.float32(qh) * scale
    return scale


@njit(nogil=True, inline="always")
def _quantize2(xs, c, amax):
    quarter = c.size
    scale = np.float32(np.float64(amax) / INT2_LEVEL_MAX)
    inv = 0.0 if scale == 0 else 1.0 / np.float64(scale)
    for j in range(quarter):
        byte = 0
        for r in range(4):
            q = np.float64(xs[j + r * quarter]) * inv
            # nearest odd integer: 2*floor(q/2) + 1, then clipped to the outer levels
            level = min(max(2.0 * np.floor(0.5 * q) + 1.0, -3.0), 3.0)
            byte |= (np.int32(level) + 3) >> 1 << (2 * r)
        c[j] = np.uint8(byte)
    return scale


@njit(nogil=True, inline="always")
def _quantize1(xs, c, amax):
    eighth = c.size
    c[:] = 0
    for r in range(8):  # one bit plane at a time over contiguous values
        part = xs[r * eighth : (r + 1) * eighth]
        for j in range(eighth):
            c[j] |= np.uint8(part[j] >= 0) << np.uint8(r)
    return np.float32(_abs_sum(xs) / xs.size)


@njit(nogil=True, inline="always")
def _add4(out, c, s):
    # out[j] += s * code_j over one block
    half = c.size
    lo = out[:half]
    hi = out[half:]
    for j in range(half):
        b = np.int32(c[j])
        lo[j] += s * np.float32((b & 15) - _INT4_OFFSET)
        hi[j] += s * np.float32((b >> 4) - _INT4_OFFSET)


@njit(nogil=True, inline="always")
def _add2(out, c, s):
    quarter = c.size
    for r in range(4):
        o = out[r * quarter : (r + 1) * quarter]
        shift = 2 * r
        for j in range(quarter):
            o[j] += s * np.float32(2 * ((np.int32(c[j]) >> shift) & 3) - 3)


@njit(nogil=True, inline="always")
def _add1(out, c, s):
    eighth = c.size
    for r in range(8):
        o = out[r * eighth : (r + 1) * eighth]
        for j in range(eighth):
            o[j] += s * np.float32(2 * ((np.int32(c[j]) >> r) & 1) - 1)


@njit(nogil=True, inline="always")
def _set4(out, c, s):
    # out[j] = code_j * s over one block
    half = c.size
    lo = out[:half]
    hi = out[half:]
    for j in range(half):
        b = np.int32(c[j])
        lo[j] = np.float32((b & 15) - _INT4_OFFSET) * s
        hi[j] = np.float32((b >> 4) - _INT4_OFFSET) * s


@njit(nogil=True, inline="always")
def _set2(out, c, s):
    quarter = c.size
    for r in range(4):
        o = out[r * quarter : (r + 1) * quarter]
        shift = 2 * r
        for j in range(quarter):
            o[j] = np.float32(2 * ((np.int32(c[j]) >> shift) & 3) - 3) * s


@njit(nogil=True, inline="always")
def _set1(out, c, s):
    eighth = c.size
    for r in range(8):
        o = out[r * eighth : (r + 1) * eighth]
        for j in range(eighth):
            o[j] = np.float32(2 * ((np.int32(c[j]) >> r) & 1) - 1) * s


@njit(nogil=True, inline="always")
def _minus_decoded(xs, c, s, out, scratch, set_):
    # out = xs - decode(c, s), decoded into scratch (f32[block]) first; -> s
    set_(scratch, c, s)
    for j in range(xs.size):
        out[j] = xs[j] - scratch[j]
    return s


@njit(nogil=True, inline="always")
def _quantize2_residual(xs, c, amax, out, scratch):
    # _quantize4_residual's contract for int2, in two passes
    return _minus_decoded(xs, c, _quantize2(xs, c, amax), out, scratch, _set2)


@njit(nogil=True, inline="always")
def _quantize1_residual(xs, c, amax, out, scratch):
    return _minus_decoded(xs, c, _quantize1(xs, c, amax), out, scratch, _set1)


# ---- the loops over blocks, written once: each takes a codec's block functions as arguments ----
# numba specialises an inlined function per function argument, so each is a template that becomes one
# tight loop per codec. The drivers choose the codec once per call (per tile in a round), never per
# block: a branch between three inlined block loops inside the per-block loop left the int4 loop at
# 0.33 ns per value against 0.13 ns (one thread, measured on this project's 2-core host).


@njit(nogil=True, inline="always")
def _quantize_blocks(x, xbits, codes, scales, block, cb, quantize):
    nonfinite = 0
    amax = np.empty(1, np.uint32)  # u32[1], reinterpreted as f32
    amax_f32 = amax.view(np.float32)
    for k in range(scales.size):
        m = _absmax_bits(xbits[k * block : (k + 1) * block])
        if m >= _NONFINITE_BITS:
            nonfinite += 1
            continue
        amax[0] = m
        scales[k] = quantize(x[k * block : (k + 1) * block], codes[k * cb : (k + 1) * cb], amax_f32[0])
    return nonfinite


@njit(nogil=True, inline="always")
def _add_blocks(out, weight, codes, scales, block, cb, add):
    for k in range(scales.size):
        s = np.float32(weight * np.float64(scales[k]))  # one product per block, not per value
        add(out[k * block : (k + 1) * block], codes[k * cb : (k + 1) * cb], s)


@njit(nogil=True, inline="always")
def _set_blocks(out, codes, scales, block, cb, set_):
    for k in range(scales.size):
        set_(out[k * block : (k + 1) * block], codes[k * cb : (k + 1) * cb], scales[k])


@njit(nogil=True, inline="always")
def _delta_blocks(base, theta, residual, out_residual, codes, scales, block, cb, feedback, quantize, quantize_residual):
    # target = (base - theta) + residual per value (float32, the order of the numpy expression);
    # codes/scales of the target; out_residual = target - decode(target). residual and out_residual
    # are unused (any length) without feedback.
    t = np.empty(block, np.float32)
    tbits = t.view(np.uint32)
    scratch = np.empty(block, np.float32)
    amax = np.empty(1, np.uint32)
    amax_f32 = amax.view(np.float32)
    nonfinite = 0
    for k in range(scales.size):
        lo = k * block
        bk = base[lo : lo + block]
        th = theta[lo : lo + block]
        if feedback:
            r = residual[lo : lo + block]
            for j in range(block):
                t[j] = (bk[j] - th[j]) + r[j]
        else:
            for j in range(block):
                t[j] = bk[j] - th[j]
        m = _absmax_bits(tbits)
        if m >= _NONFINITE_BITS:
            nonfinite += 1
            continue
        amax[0] = m
        c = codes[k * cb : (k + 1) * cb]
        if feedback:
            scales[k] = quantize_residual(t, c, amax_f32[0], out_residual[lo : lo + block], scratch)
        else:
            scales[k] = quantize(t, c, amax_f32[0])
    return nonfinite


@njit(nogil=True, inline="always")
def _apply_blocks(theta, base, codes, scales, block, cb, set_):
    # d = decode(codes, scales); theta += d; base += d (float32 adds of the decoded value)
    d = np.empty(block, np.float32)
    for k in range(scales.size):
        set_(d, codes[k * cb : (k + 1) * cb], scales[k])
        th = theta[k * block : (k + 1) * block]
        bs = base[k * block : (k + 1) * block]
        for j in range(block):
            th[j] += d[j]
            bs[j] += d[j]


# ---- the drivers: a serial loop per operation (the codec chosen once) and its parallel driver ----

# The block every layout uses unless told otherwise (core.config). The hot int4 drivers call their
# block loop with it as a literal when the block is this one: the inner loops then have a trip count
# known at compile time, and vectorise without the run-time checks and remainder loops of an unknown
# one. Per value, one thread, 16M values (this project's 2-core host, same bits): the learner's
# encode 0.91 -> 0.81 ns, its apply of a delta 1.31 -> 1.19, the syncer's publish 0.94 -> 0.80,
# dequantise 0.63 -> 0.52. int4's quantise alone and the fused round gained nothing, and stay generic.
_BLOCK_USUAL = 128


@njit(nogil=True, cache=True)
def _quantize_serial(x, xbits, codes, scales, block, bits):
    # x: f32[m], xbits: u32[m] (same memory), codes: u8[m*bits/8], scales: f32[m/block]; -> bad blocks
    cb = block * bits // 8
    if bits == 4:
        return _quantize_blocks(x, xbits, codes, scales, block, cb, _quantize4)
    if bits == 2:
        return _quantize_blocks(x, xbits, codes, scales, block, cb, _quantize2)
    return _quantize_blocks(x, xbits, codes, scales, block, cb, _quantize1)


@njit(parallel=True, nogil=True, cache=True)
def _quantize_parallel(x, xbits, codes, scales, block, bits, bounds):
    # bounds: i64[s+1] element boundaries, multiples of block
    nonfinite = 0
    for s in prange(bounds.size - 1):
        a = bounds[s]
        b = bounds[s + 1]
        nonfinite += _quantize_serial(
            x[a:b], xbits[a:b], codes[a * bits // 8 : b * bits // 8], scales[a // block : b // block], block, bits
        )
    return nonfinite


@njit(nogil=True, cache=True)
def _decode_serial(out, weight, codes, scales, block, bits, add):
    # out: f32[m]; add: out += weight * decode (weight f64, one product per block), else out = decode
    cb = block * bits // 8
    if not add and bits == 4 and block == _BLOCK_USUAL:
        _set_blocks(out, codes, scales, _BLOCK_USUAL, _BLOCK_USUAL // 2, _set4)
    elif add:
        if bits == 4:
            _add_blocks(out, weight, codes, scales, block, cb, _add4)
        elif bits == 2:
            _add_blocks(out, weight, codes, scales, block, cb, _add2)
        else:
            _add_blocks(out, weight, codes, scales, block, cb, _add1)
    elif bits == 4:
        _set_blocks(out, codes, scales, block, cb, _set4)
    elif bits == 2:
        _set_blocks(out, codes, scales, block, cb, _set2)
    else:
        _set_blocks(out, codes, scales, block, cb, _set1)


@njit(parallel=True, nogil=True, cache=True)
def _decode_parallel(out, weight, codes, scales, block, bits, add, bounds):
    for s in prange(bounds.size - 1):
        a = bounds[s]
        b = bounds[s + 1]
        _decode_serial(
            out[a:b], weight, codes[a * bits // 8 : b * bits // 8], scales[a // block : b // block], block, bits, add
        )


@njit(nogil=True, cache=True)
def _quantize_delta_serial(base, theta, residual, out_residual, codes, scales, block, bits, feedback):
    cb = block * bits // 8
    if bits == 4 and block == _BLOCK_USUAL:
        return _delta_blocks(
            base,
            theta,
            residual,
            out_residual,
            codes,
            scales,
            _BLOCK_USUAL,
            _BLOCK_USUAL // 2,
            feedback,
            _quantize4,
            _quantize4_residual,
        )
    if bits == 4:
        return _delta_blocks(
            base, theta, residual, out_residual, codes, scales, block, cb, feedback, _quantize4, _quantize4_residual
        )
    if bits == 2:
        return _delta_blocks(
            base, theta, residual, out_residual, codes, scales, block, cb, feedback, _quantize2, _quantize2_residual
        )
    return _delta_blocks(
        base, theta, residual, out_residual, codes, scales, block, cb, feedback, _quantize1, _quantize1_residual
    )


@njit(parallel=True, nogil=True, cache=True)
def _quantize_delta_parallel(base, theta, residual, out_residual, codes, scales, block, bits, feedback, bounds):
    nonfinite = 0
    for s in prange(bounds.size - 1):
        a = bounds[s]
        b = bounds[s + 1]
        ra, rb = (a, b) if feedback else (0, 0)
        nonfinite += _quantize_delta_serial(
            base[a:b],
            theta[a:b],
            residual[ra:rb],
            out_residual[ra:rb],
            codes[a * bits // 8 : b * bits // 8],
            scales[a // block : b // block],
            block,
            bits,
            feedback,
        )
    return nonfinite


@njit(nogil=True, cache=True)
def _apply_delta_serial(theta, base, codes, scales, block, bits):
    cb = block * bits // 8
    if bits == 4:
        _apply_blocks(theta, base, codes, scales, block, cb, _set4)
    elif bits == 2:
        _apply_blocks(theta, base, codes, scales, block, cb, _set2)
    else:
        _apply_blocks(theta, base, codes, scales, block, cb, _set1)


@njit(parallel=True, nogil=True, cache=True)
def _apply_delta_parallel(theta, base, codes, scales, block, bits, bounds):
    for s in prange(bounds.size - 1):
        a = bounds[s]
        b = bounds[s + 1]
        _apply_delta_serial(
            theta[a:b], base[a:b], codes[a * bits // 8 : b * bits // 8], scales[a // block : b // block], block, bits
        )


@njit(nogil=True, inline="always")
def _publish_blocks(published, theta, codes, scales, block, cb, quantize_publish):
    # t = theta - published (float32); codes/scales of t; published += decode(codes, scales) (the
    # float32 add a learner makes in _add_published_blocks, so both copies keep the same bits)
    t = np.empty(block, np.float32)
    tbits = t.view(np.uint32)
    amax = np.empty(1, np.uint32)
    amax_f32 = amax.view(np.float32)
    nonfinite = 0
    for k in range(scales.size):
        lo = k * block
        pb = published[lo : lo + block]
        th = theta[lo : lo + block]
        for j in range(block):
            t[j] = th[j] - pb[j]
        m = _absmax_bits(tbits)
        if m >= _NONFINITE_BITS:
            nonfinite += 1
            continue
        amax[0] = m
        scales[k] = quantize_publish(t, codes[k * cb : (k + 1) * cb], amax_f32[0], pb)
    return nonfinite


@njit(nogil=True, inline="always")
def _add_published_blocks(published, codes, scales, block, cb, set_):
    # published += decode(codes, scales), value by value as _publish_blocks adds it
    d = np.empty(block, np.float32)
    for k in range(scales.size):
        set_(d, codes[k * cb : (k + 1) * cb], scales[k])
        pb = published[k * block : (k + 1) * block]
        for j in range(block):
            pb[j] += d[j]


@njit(nogil=True, inline="always")
def _add_published_apart_blocks(onto, anchor, published, difference, codes, scales, block, cb, set_):
    # published = onto + decode(codes, scales), the same f32 additions as _add_published_blocks, and
    # difference = published - anchor in the same pass: a learner's arriving version and the
    # progress it keeps over it, with onto and anchor read once
    d = np.empty(block, np.float32)
    for k in range(scales.size):
        set_(d, codes[k * cb : (k + 1) * cb], scales[k])
        lo = k * block
        ob = onto[lo : lo + block]
        ab = anchor[lo : lo + block]
        pb = published[lo : lo + block]
        db = difference[lo : lo + block]
        for j in range(block):
            v = ob[j] + d[j]
            pb[j] = v
            db[j] = v - ab[j]


@njit(nogil=True, cache=True)
def _add_published_apart_serial(onto, anchor, published, difference, codes, scales, block):
    if block == _BLOCK_USUAL:
        _add_published_apart_blocks(
            onto, anchor, published, difference, codes, scales, _BLOCK_USUAL, _BLOCK_USUAL // 2, _set4
        )
    else:
        _add_published_apart_blocks(onto, anchor, published, difference, codes, scales, block, block // 2, _set4)


@njit(parallel=True, nogil=True, cache=True)
def _add_published_apart_parallel(onto, anchor, published, difference, codes, scales, block, bounds):
    for s in prange(bounds.size - 1):
        a = bounds[s]
        b = bounds[s + 1]
        _add_published_apart_serial(
            onto[a:b],
            anchor[a:b],
            published[a:b],
            difference[a:b],
            codes[a // 2 : b // 2],
            scales[a // block : b // block],
            block,
        )


@njit(nogil=True, cache=True)
def _publish_serial(published, theta, codes, scales, block):
    if block == _BLOCK_USUAL:
        return _publish_blocks(published, theta, codes, scales, _BLOCK_USUAL, _BLOCK_USUAL // 2, _quantize4_publish)
    return _publish_blocks(published, theta, codes, scales, block, block // 2, _quantize4_publish)


@njit(parallel=True, nogil=True, cache=True)
def _publish_parallel(published, theta, codes, scales, block, bounds):
    nonfinite = 0
    for s in prange(bounds.size - 1):
        a = bounds[s]
        b = bounds[s + 1]
        nonfinite += _publish_serial(
            published[a:b], theta[a:b], codes[a // 2 : b // 2], scales[a // block : b // block], block
        )
    return nonfinite


@njit(nogil=True, cache=True)
def _add_published_serial(published, codes, scales, block):
    _add_published_blocks(published, codes, scales, block, block // 2, _set4)


@njit(parallel=True, nogil=True, cache=True)
def _add_published_parallel(published, codes, scales, block, bounds):
    for s in prange(bounds.size - 1):
        a = bounds[s]
        b = bounds[s + 1]
        _add_published_serial(published[a:b], codes[a // 2 : b // 2], scales[a // block : b // block], block)


# ---- a round's merge, fused: every contribution decoded, weighted and summed per tile ----


@njit(nogil=True, inline="always")
def _round_mean_tiles(theta, buf, weights, codes, scales, block, cb, lo, hi, step, lr, mu, tile, add):
    # Over elements [lo, hi) (multiples of block), tile by tile: g = sum_m weights[m] * decode_m in
    # learner order (the float32 rounding of acc += w * decode, one contribution after the other), then
    # either the outer step on theta/buf (step) or theta[...] = g (theta is then the output and buf unused).
    # g stays in cache while every contribution's bytes stream past.
    g = np.empty(tile, np.float32)
    for t0 in range(lo, hi, tile):
        t1 = min(t0 + tile, hi)
        gt = g[: t1 - t0]
        gt[:] = 0.0
        k0 = t0 // block
        k1 = t1 // block
        for m in range(weights.size):
            _add_blocks(gt, weights[m], codes[m][k0 * cb : k1 * cb], scales[m][k0:k1], block, cb, add)
        if step:
            _nesterov_serial(theta[t0:t1], buf[t0:t1], gt, lr, mu)  # the outer step, the one loop of it
        else:
            theta[t0:t1] = gt


@njit(nogil=True, cache=True)
def _round_mean_range(theta, buf, weights, codes, scales, block, bits, lo, hi, step, lr, mu, tile):
    cb = block * bits // 8
    if bits == 4:
        _round_mean_tiles(theta, buf, weights, codes, scales, block, cb, lo, hi, step, lr, mu, tile, _add4)
    elif bits == 2:
        _round_mean_tiles(theta, buf, weights, codes, scales, block, cb, lo, hi, step, lr, mu, tile, _add2)
    else:
        _round_mean_tiles(theta, buf, weights, codes, scales, block, cb, lo, hi, step, lr, mu, tile, _add1)


@njit(parallel=True, nogil=True, cache=True)
def _round_mean_parallel(theta, buf, weights, codes, scales, block, bits, step, lr, mu, tile, bounds):
    for s in prange(bounds.size - 1):
        _round_mean_range(theta, buf, weights, codes, scales, block, bits, bounds[s], bounds[s + 1], step, lr, mu, tile)


# ---- the validating wrappers ----


_NO_RESIDUAL = np.zeros(0, dtype=np.float32)


class BlockCodec:
    """One low-bit codec: `bits` per code, so `8 // bits` codes to a byte and blocks a multiple of it."""

    def __init__(self, bits: int):
        assert bits in (1, 2, 4)
        self.bits = bits
        self.per_byte = 8 // bits

    def quantize(self, x: object, block: object, parallel: bool) -> tuple[np.ndarray, np.ndarray]:
        block = _checks.block_size(block, self.per_byte)
        x = _checks.vector("x", x, np.float32)
        blocks = _checks.blocked_length("x", x.size, block)
        codes = np.empty(x.size // self.per_byte, dtype=np.uint8)
        scales = np.empty(blocks, dtype=np.float32)
        bounds = thread_bounds(x.size, block, parallel)
        # The loops read the absmax (and Inf/NaN) off the bit patterns, hence the uint32 view.
        if bounds is None:
            bad = _quantize_serial(x, x.view(np.uint32), codes, scales, block, self.bits)
        else:
            bad = _quantize_parallel(x, x.view(np.uint32), codes, scales, block, self.bits, bounds)
        if bad:
            # The outputs were fresh and are dropped here, so the caller sees nothing modified.
            raise KernelInputError(f"x has NaN or Inf values in {bad} of its {blocks} blocks")
        return codes, scales

    def dequantize(self, codes: object, scales: object, block: object, out: object, parallel: bool) -> np.ndarray:
        block, n, codes, scales = _checks.coded(codes, scales, block, self.per_byte)
        out = _checks.out_vector(out, np.float32, n)
        _checks.disjoint(out=out, codes=codes, scales=scales)
        self._decode(out, 1.0, codes, scales, block, False, parallel)
        return out

    def accumulate(
        self, acc: object, weight: object, codes: object, scales: object, block: object, parallel: bool
    ) -> None:
        _checks.vector("acc", acc, np.float32, writeable=True)
        weight = _checks.finite_scalar("weight", weight)
        block, _, codes, scales = _checks.coded(codes, scales, block, self.per_byte, acc.size)
        _checks.disjoint(acc=acc, codes=codes, scales=scales)
        self._decode(acc, weight, codes, scales, block, True, parallel)

    def _decode(
        self,
        out: np.ndarray,
        weight: float,
        codes: np.ndarray,
        scales: np.ndarray,
        block: int,
        add: bool,
        parallel: bool,
    ) -> None:
        bounds = thread_bounds(out.size, block, parallel)
        if bounds is None:
            _decode_serial(out, weight, codes, scales, block, self.bits, add)
        else:
            _decode_parallel(out, weight, codes, scales, block, self.bits, add, bounds)

    def quantize_delta(
        self, base: object, theta: object, residual: object, block: object, parallel: bool
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        block = _checks.block_size(block, self.per_byte)
        base = _checks.vector("base", base, np.float32)
        theta = _checks.vector("theta", theta, np.float32)
        _checks.length("theta", theta, base.size)
        blocks = _checks.blocked_length("base", base.size, block)
        feedback = residual is not None
        if feedback:
            residual = _checks.vector("residual", residual, np.float32)
            _checks.length("residual", residual, base.size)
            out_residual = np.empty(base.size, dtype=np.float32)
        else:
            residual = out_residual = _NO_RESIDUAL
        codes = np.empty(base.size // self.per_byte, dtype=np.uint8)
        scales = np.empty(blocks, dtype=np.float32)
        bounds = thread_bounds(base.size, block, parallel)
        args = (base, theta, residual, out_residual, codes, scales, block, self.bits, feedback)
        bad = _quantize_delta_serial(*args) if bounds is None else _quantize_delta_parallel(*args, bounds)
        if bad:
            raise KernelInputError(f"base - theta (+ residual) has NaN or Inf values in {bad} of its {blocks} blocks")
        return codes, scales, out_residual if feedback else None

    def apply_delta(
        self, theta: object, base: object, codes: object, scales: object, block: object, parallel: bool
    ) -> None:
        _checks.vector("theta", theta, np.float32, writeable=True)
        _checks.vector("base", base, np.float32, writeable=True)
        _checks.length("base", base, theta.size)
        block, _, codes, scales = _checks.coded(codes, scales, block, self.per_byte, theta.size)
        _checks.disjoint(theta=theta, base=base, codes=codes, scales=scales)
        bounds = thread_bounds(theta.size, block, parallel)
        if bounds is None:
            _apply_delta_serial(theta, base, codes, scales, block, self.bits)
        else:
            _apply_delta_parallel(theta, base, codes, scales, block, self.bits, bounds)

    def publish_delta(
        self, published: object, theta: object, block: object, parallel: bool
    ) -> tuple[np.ndarray, np.ndarray]:
        assert self.bits == 4, "the broadcast delta is int4 only"
        block = _checks.block_size(block, self.per_byte)
        published = _checks.vector("published", published, np.float32, writeable=True)
        theta = _checks.vector("theta", theta, np.float32)
        _checks.length("theta", theta, published.size)
        _checks.disjoint(published=published, theta=theta)
        blocks = _checks.blocked_length("published", published.size, block)
        codes = np.empty(published.size // self.per_byte, dtype=np.uint8)
        scales = np.empty(blocks, dtype=np.float32)
        bounds = thread_bounds(published.size, block, parallel)
        if bounds is None:
            bad = _publish_serial(published, theta, codes, scales, block)
        else:
            bad = _publish_parallel(published, theta, codes, scales, block, bounds)
        if bad:
            # Blocks before and after the bad ones were published: the caller's copy is no longer one
            # a learner can reconstruct (theta - published overflowed: a bug upstream, never a peer's).
            raise KernelInputError(f"theta - published has NaN or Inf values in {bad} of its {blocks} blocks")
        return codes, scales

    def add_delta(self, published: object, codes: object, scales: object, block: object, parallel: bool) -> None:
        assert self.bits == 4, "the broadcast delta is int4 only"
        _checks.vector("published", published, np.float32, writeable=True)
        block, _, codes, scales = _checks.coded(codes, scales, block, self.per_byte, published.size)
        _checks.disjoint(published=published, codes=codes, scales=scales)
        bounds = thread_bounds(published.size, block, parallel)
        if bounds is None:
            _add_published_serial(published, codes, scales, block)
        else:
            _add_published_parallel(published, codes, scales, block, bounds)

    def add_delta_apart(
        self, onto: object, anchor: object, codes: object, scales: object, block: object, parallel: bool
    ) -> tuple[np.ndarray, np.ndarray]:
        assert self.bits == 4, "the broadcast delta is int4 only"
        onto = _checks.vector("onto", onto, np.float32)
        anchor = _checks.vector("anchor", anchor, np.float32)
        _checks.length("anchor", anchor, onto.size)
        block, _, codes, scales = _checks.coded(codes, scales, block, self.per_byte, onto.size)
        published = np.empty(onto.size, dtype=np.float32)
        difference = np.empty(onto.size, dtype=np.float32)
        args = (onto, anchor, published, difference, codes, scales, block)
        bounds = thread_bounds(onto.size, block, parallel)
        if bounds is None:
            _add_published_apart_serial(*args)
        else:
            _add_published_apart_parallel(*args, bounds)
        return published, difference

    def round_mean(
        self,
        theta: object,
        buf: object,
        weights: object,
        codes: object,
        scales: object,
        block: object,
        lr: object,
        mu: object,
        parallel: bool,
    ) -> None:
        """The fused mean of a round: with `buf` None, theta = sum_m weights[m] * decode_m (theta is the
        output); else that sum is the outer gradient of a Nesterov step on theta and buf, in place."""
        step = buf is not None
        theta = _checks.vector("theta" if step else "out", theta, np.float32, writeable=True)
        n = theta.size
        block = _checks.block_size(block, self.per_byte)
        weights = _checks.weights(weights)
        codes = _checks.sequence("codes", codes, weights.size)
        scales = _checks.sequence("scales", scales, weights.size)
        named = {}
        for m in range(weights.size):
            _, _, codes[m], scales[m] = _checks.coded(codes[m], scales[m], block, self.per_byte, n)
            named[f"codes[{m}]"], named[f"scales[{m}]"] = codes[m], scales[m]
        if step:
            buf = _checks.vector("buf", buf, np.float32, writeable=True)
            _checks.length("buf", buf, n)
            _checks.written_apart({"theta": theta, "buf": buf}, named)
            lr32, mu32 = np.float32(_checks.finite_scalar("lr", lr)), np.float32(_checks.finite_scalar("mu", mu))
        else:
            _checks.written_apart({"out": theta}, named)
            buf, lr32, mu32 = theta, np.float32(0.0), np.float32(0.0)
        args = (theta, buf, weights, typed_list(codes), typed_list(scales), block, self.bits)
        tile = tile_elements(block)
        bounds = thread_bounds(n, block, parallel)
        if bounds is None:
            _round_mean_range(*args, 0, n, step, lr32, mu32, tile)
        else:
            _round_mean_parallel(*args, step, lr32, mu32, tile, bounds)


INT4 = BlockCodec(4)
INT2 = BlockCodec(2)
INT1 = BlockCodec(1)
_DEFAULT = _checks.BLOCK_DEFAULT


def quantize_int4(x: np.ndarray, block: int = _DEFAULT, *, parallel: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """Blockwise absmax int4: returns (codes uint8[n/2], scales float32[n/block]).

    `x` is float32[n] with n a multiple of `block`; NaN or Inf anywhere raises KernelInputError.
    `parallel=False` keeps the work on the calling thread (same bits either way).
    """
    return INT4.quantize(x, block, parallel)


def dequantize_int4(
    codes: np.ndarray,
    scales: np.ndarray,
    block: int = _DEFAULT,
    *,
    out: np.ndarray | None = None,
    parallel: bool = True,
) -> np.ndarray:
    """float32[n] = code * scale of each value; n = scales.size * block. Writes into `out` if given."""
    return INT4.dequantize(codes, scales, block, out, parallel)


def accumulate_int4(
    acc: np.ndarray,
    weight: float,
    codes: np.ndarray,
    scales: np.ndarray,
    block: int = _DEFAULT,
    *,
    parallel: bool = True,
) -> None:
    """acc += weight * dequantize_int4(codes, scales) in place, without materialising the fp32 vector."""
    INT4.accumulate(acc, weight, codes, scales, block, parallel)


def quantize_int2(x: np.ndarray, block: int = _DEFAULT, *, parallel: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """Four-level int2: returns (codes uint8[n/4], scales float32[n/block]); NaN/Inf raise."""
    return INT2.quantize(x, block, parallel)


def dequantize_int2(
    codes: np.ndarray,
    scales: np.ndarray,
    block: int = _DEFAULT,
    *,
    out: np.ndarray | None = None,
    parallel: bool = True,
) -> np.ndarray:
    """float32[n] = level * scale of each value; n = scales.size * block."""
    return INT2.dequantize(codes, scales, block, out, parallel)


def accumulate_int2(
    acc: np.ndarray,
    weight: float,
    codes: np.ndarray,
    scales: np.ndarray,
    block: int = _DEFAULT,
    *,
    parallel: bool = True,
) -> None:
    """acc += weight * dequantize_int2(codes, scales) in place, fused."""
    INT2.accumulate(acc, weight, codes, scales, block, parallel)


def quantize_int1(x: np.ndarray, block: int = _DEFAULT, *, parallel: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """Sign bits and mean-|x| scales: returns (codes uint8[n/8], scales float32[n/block]); NaN/Inf raise."""
    return INT1.quantize(x, block, parallel)


def dequantize_int1(
    codes: np.ndarray,
    scales: np.ndarray,
    block: int = _DEFAULT,
    *,
    out: np.ndarray | None = None,
    parallel: bool = True,
) -> np.ndarray:
    """float32[n] = +-scale of each value; n = scales.size * block."""
    return INT1.dequantize(codes, scales, block, out, parallel)


def accumulate_int1(
    acc: np.ndarray,
    weight: float,
    codes: np.ndarray,
    scales: np.ndarray,
    block: int = _DEFAULT,
    *,
    parallel: bool = True,
) -> None:
    """acc += weight * dequantize_int1(codes, scales) in place, fused."""
    INT1.accumulate(acc, weight, codes, scales, block, parallel)


def quantize_delta_int4(
    base: np.ndarray,
    theta: np.ndarray,
    residual: np.ndarray | None = None,
    block: int = _DEFAULT,
    *,
    parallel: bool = True,
) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """A learner's outer gradient, quantised in one pass: target = (base - theta) + residual (residual
    omitted: none), returns (codes, scales) of quantize_int4(target) and the new error-feedback
    residual target - dequantize_int4(codes, scales) as a fresh array (None without a residual).
    Bit for bit the numpy expressions; NaN/Inf in the target raise and nothing is modified."""
    return INT4.quantize_delta(base, theta, residual, block, parallel)


def apply_delta_int4(
    theta: np.ndarray,
    base: np.ndarray,
    codes: np.ndarray,
    scales: np.ndarray,
    block: int = _DEFAULT,
    *,
    parallel: bool = True,
) -> None:
    """An arrived int4 delta d = dequantize_int4(codes, scales), applied in one pass and in place:
    theta += d and base += d (the learner's own progress since its base is kept)."""
    INT4.apply_delta(theta, base, codes, scales, block, parallel)


def publish_delta_int4(
    published: np.ndarray, theta: np.ndarray, block: int = _DEFAULT, *, parallel: bool = True
) -> tuple[np.ndarray, np.ndarray]:
    """The syncer's broadcast step in one pass: (codes, scales) = quantize_int4(theta - published) and
    published += dequantize_int4(codes, scales) in place, bit for bit those numpy expressions. NaN/Inf in
    theta - published raise (published is then partly updated: a bug upstream, never a peer's input)."""
    return INT4.publish_delta(published, theta, block, parallel)


def add_delta_int4(
    published: np.ndarray, codes: np.ndarray, scales: np.ndarray, block: int = _DEFAULT, *, parallel: bool = True
) -> None:
    """A learner's side of the broadcast: published += dequantize_int4(codes, scales) in place, the same
    float32 additions as publish_delta_int4 makes, so both copies hold the same bits."""
    INT4.add_delta(published, codes, scales, block, parallel)


def add_delta_apart_int4(
    onto: np.ndarray,
    anchor: np.ndarray,
    codes: np.ndarray,
    scales: np.ndarray,
    block: int = _DEFAULT,
    *,
    parallel: bool = True,
) -> tuple[np.ndarray, np.ndarray]:
    """A learner's arriving int4 version in one pass, as new arrays: (published, difference) with
    published = onto + dequantize_int4(codes, scales), the bits add_delta_int4 leaves in a copy of
    onto, and difference = published - anchor (the progress kept since anchor, added to the
    parameters). onto and anchor are left as they are."""
    return INT4.add_delta_apart(onto, anchor, codes, scales, block, parallel)


def round_mean_int4(
    out: np.ndarray,
    weights: np.ndarray,
    codes: Sequence[np.ndarray],
    scales: Sequence[np.ndarray],
    block: int = _DEFAULT,
    *,
    parallel: bool = True,
) -> None:
    """out = sum_m weights[m] * dequantize_int4(codes[m], scales[m]), every contribution read once in one
    pass: bit for bit `accumulate_int4` into zeros, one contribution after the other in this order."""
    INT4.round_mean(out, None, weights, codes, scales, block, None, None, parallel)


def round_mean_step_int4(
    theta: np.ndarray,
    buf: np.ndarray,
    weights: np.ndarray,
    codes: Sequence[np.ndarray],
    scales: Sequence[np.ndarray],
    lr: float,
    mu: float,
    block: int = _DEFAULT,
    *,
    parallel: bool = True,
) -> None:
    """One round of the syncer in one pass over the fragment: the merged mean g of `round_mean_int4`
    (never materialised) and `nesterov_step(theta, buf, g, lr, mu)` in place, with the same bits."""
    INT4.round_mean(theta, buf, weights, codes, scales, block, lr, mu, parallel)
