"""Per-tensor kernels for radial-directional averaging (RDA).

docs/algorithm.md, "Syncer: one round of fragment p", item 5.

A fragment is a flat concatenation of tensors, described by int64 offsets[k+1]: tensor i is
x[offsets[i]:offsets[i+1]]; offsets[-1] may stop short of the vector's end (zero padding that belongs
to no tensor and is neither summed nor written).

The vector up to offsets[-1] is cut into slices (see _parallelism) regardless of where the tensors
fall, so one huge embedding and many small norms spread over all cores alike. A slice meets a run of
consecutive segments; each (slice, segment) overlap is a "piece". For the sums of squares the cut
depends on the length only, every piece gets its own partial sum, and the partials are added per
segment in slice order afterwards: no two threads write the same number, and the result depends only
on the layout, never on the threads. The accumulates are elementwise and take one slice per thread.

A round's RDA merge runs in three passes here: the per-tensor norms of each contribution
(segment_sumsq*, from the codes alone), every contribution's unit vector accumulated with the merged
direction's per-tensor sums of squares taken as it goes (rda_accumulate_round*_sumsq), and, once those
norms are known, the per-tensor scaling fused into the outer step (nesterov_step_segments).

The accumulate with the sums runs on segment_sumsq's own cut (slices of CHUNK_ELEMENTS, at most
REDUCTION_SLICES_MAX of them, fixed by the length) rather than one slice per thread, and sums each of
its pieces right after the tile that completes it, while the piece is still in cache (a piece is at
most a slice, 1/64 of the fragment: 160 KiB of a 2.6M-element one): the same ranges summed by the same
loop, so the same bits as segment_sumsq after the accumulate, on either driver. A piece is summed
whole, never tile by tile, because the reassociated sum's order depends on its bounds. It follows that
this accumulate uses at most REDUCTION_SLICES_MAX threads, and that an int4 block which does not
divide CHUNK_ELEMENTS (none the core uses) takes the two passes instead.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
from numba import njit, prange

from ddiloco.kernels import _checks
from ddiloco.kernels._errors import KernelInputError
from ddiloco.kernels._parallelism import (
    CHUNK_ELEMENTS,
    slice_bounds,
    thread_bounds,
    tile_elements,
    typed_list,
    use_parallel,
)

_CODE_OFFSET = 8  # int4 nibbles hold code + 8, see _int4


def _piece_plan(offsets: np.ndarray, bounds: np.ndarray, end: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """For slices [bounds[s], bounds[s+1]) clipped to `end`: the first segment each slice meets,
    where its pieces start in the flat piece array, and the segment of every piece."""
    starts = bounds[:-1]
    stops = np.minimum(bounds[1:], end)
    # searchsorted 'right' skips empty segments sitting at the same offset
    seg_first = np.searchsorted(offsets, starts, side="right").astype(np.int64) - 1
    seg_last = np.searchsorted(offsets, stops - 1, side="right").astype(np.int64) - 1
    counts = seg_last - seg_first + 1
    piece_start = np.zeros(counts.size + 1, dtype=np.int64)
    np.cumsum(counts, out=piece_start[1:])
    piece_segment = np.repeat(seg_first - piece_start[:-1], counts) + np.arange(piece_start[-1], dtype=np.int64)
    return seg_first, piece_start, piece_segment


# ---- sums of squares, float32 input ----


@njit(nogil=True, cache=True, fastmath={"reassoc", "contract"})
def _sumsq_serial(x):
    # x: f32[m] -> f64. reassoc lets the sum vectorise; no nnan/ninf, so Inf and NaN still propagate.
    total = 0.0
    for i in range(x.size):
        v = np.float64(x[i])
        total += v * v
    return total


@njit(nogil=True, cache=True)
def _sumsq_slice(x, offsets, a, b, seg, partial, p):
    # x: f32[n], offsets: i64[k+1], partial: f64[pieces]; one piece per segment met in [a, b)
    pos = a
    while pos < b:
        end = min(offsets[seg + 1], b)
        partial[p] = _sumsq_serial(x[pos:end])
        pos = end
        seg += 1
        p += 1


@njit(parallel=True, nogil=True, cache=True)
def _sumsq_parallel(x, offsets, bounds, end, seg_first, piece_start, partial):
    for s in prange(bounds.size - 1):
        _sumsq_slice(x, offsets, bounds[s], min(bounds[s + 1], end), seg_first[s], partial, piece_start[s])


@njit(nogil=True, cache=True)
def _sumsq_sequential(x, offsets, bounds, end, seg_first, piece_start, partial):
    # the same slices one after another: identical partials, so identical results on either path
    for s in range(bounds.size - 1):
        _sumsq_slice(x, offsets, bounds[s], min(bounds[s + 1], end), seg_first[s], partial, piece_start[s])


# ---- sums of squares, int4 input ----


@njit(nogil=True, cache=True)
def _code_sumsq(c, lo, hi, half):
    # c: u8[half] one block's codes; exact integer sum of code^2 over elements [lo, hi) of the block
    total = 0
    for e in range(lo, min(hi, half)):
        v = (np.int32(c[e]) & 15) - _CODE_OFFSET
        total += v * v
    for e in range(max(lo, half), hi):
        v = (np.int32(c[e - half]) >> 4) - _CODE_OFFSET
        total += v * v
    return total


@njit(nogil=True, cache=True)
def _block_code_sumsq(c):
    # c: u8[half] the codes of one whole block -> exact sum of code^2 (at most 64 * block: int32)
    total = np.int32(0)
    for j in range(c.size):
        b = np.int32(c[j])
        lo = (b & 15) - np.int32(_CODE_OFFSET)
        hi = (b >> 4) - np.int32(_CODE_OFFSET)
        total += lo * lo + hi * hi
    return total


@njit(nogil=True, cache=True)
def _sumsq_int4_range(codes, scales, block, lo, hi):
    # codes: u8[n/2], scales: f32[n/block]; sum of (code * scale)^2 over elements [lo, hi) of one
    # tensor, as scale^2 * sum(code^2) per block: exact integers, one float product per block.
    half = block // 2
    total = 0.0
    pos = lo
    while pos < hi:
        k = pos // block
        base = k * block
        if pos == base and hi >= base + block:
            full_end = hi // block  # a run of whole blocks: the tight loop
            for kk in range(k, full_end):
                s = np.float64(scales[kk])
                total += s * s * _block_code_sumsq(codes[kk * half : (kk + 1) * half])
            pos = full_end * block
        else:
            stop = min(base + block, hi)
            s = np.float64(scales[k])
            total += s * s * _code_sumsq(codes[k * half : (k + 1) * half], pos - base, stop - base, half)
            pos = stop
    return total


@njit(nogil=True, cache=True)
def _sumsq_int4_slice(codes, scales, offsets, block, a, b, seg, partial, p):
    # partial: f64[pieces]; one piece per segment met in [a, b), a is a multiple of block
    pos = a
    while pos < b:
        end = min(offsets[seg + 1], b)
        partial[p] = _sumsq_int4_range(codes, scales, block, pos, end)
        pos = end
        seg += 1
        p += 1


@njit(parallel=True, nogil=True, cache=True)
def _sumsq_int4_parallel(codes, scales, offsets, block, bounds, end, seg_first, piece_start, partial):
    for s in prange(bounds.size - 1):
        _sumsq_int4_slice(
            codes, scales, offsets, block, bounds[s], min(bounds[s + 1], end), seg_first[s], partial, piece_start[s]
        )


@njit(nogil=True, cache=True)
def _sumsq_int4_sequential(codes, scales, offsets, block, bounds, end, seg_first, piece_start, partial):
    for s in range(bounds.size - 1):
        _sumsq_int4_slice(
            codes, scales, offsets, block, bounds[s], min(bounds[s + 1], end), seg_first[s], partial, piece_start[s]
        )


# ---- RDA accumulate ----


@njit(nogil=True, cache=True)
def _axpy_f64(acc, factor, x):
    # acc: f32[m] (in place), factor: f64, x: f32[m]. The product is formed in float64 and rounded
    # once: weight / norm can exceed the float32 range (a tiny norm) while every x / norm is <= 1.
    for i in range(acc.size):
        acc[i] += np.float32(np.float64(x[i]) * factor)


@njit(nogil=True, cache=True)
def _rda_slice(acc, weight, x, offsets, norms, a, b, seg):
    pos = a
    while pos < b:
        end = min(offsets[seg + 1], b)
        norm = norms[seg]
        if norm > 0.0 and end > pos:  # unit(0) = 0: a zero tensor adds nothing
            _axpy_f64(acc[pos:end], weight / norm, x[pos:end])
        pos = end
        seg += 1


@njit(parallel=True, nogil=True, cache=True)
def _rda_parallel(acc, weight, x, offsets, norms, bounds, end, seg_first):
    for s in prange(bounds.size - 1):
        _rda_slice(acc, weight, x, offsets, norms, bounds[s], min(bounds[s + 1], end), seg_first[s])


@njit(nogil=True, cache=True)
def _rda_int4_piece(acc, factor, c, lo, hi, half):
    # acc: f32[block] one block of the accumulator, c: u8[half] its codes; elements [lo, hi)
    for e in range(lo, min(hi, half)):
        acc[e] += np.float32(np.float64((np.int32(c[e]) & 15) - _CODE_OFFSET) * factor)
    for e in range(max(lo, half), hi):
        acc[e] += np.float32(np.float64((np.int32(c[e - half]) >> 4) - _CODE_OFFSET) * factor)


@njit(nogil=True, cache=True)
def _rda_int4_block(acc, factor, c):
    # the common case, a whole block inside one tensor: both halves as contiguous loops
    half = c.size
    lo = acc[:half]  # f32[half]
    hi = acc[half:]  # f32[half]
    for j in range(half):
        b = np.int32(c[j])
        lo[j] += np.float32(np.float64((b & 15) - _CODE_OFFSET) * factor)
        hi[j] += np.float32(np.float64((b >> 4) - _CODE_OFFSET) * factor)


@njit(nogil=True, cache=True)
def _rda_int4_range(acc, unit_weight, codes, scales, block, lo, hi):
    # acc[lo:hi] += unit_weight * code * scale over elements [lo, hi) of one tensor
    half = block // 2
    pos = lo
    while pos < hi:
        k = pos // block
        base = k * block
        if pos == base and hi >= base + block:
            full_end = hi // block
            for kk in range(k, full_end):
                factor = unit_weight * np.float64(scales[kk])
                _rda_int4_block(acc[kk * block : (kk + 1) * block], factor, codes[kk * half : (kk + 1) * half])
            pos = full_end * block
        else:
            stop = min(base + block, hi)
            factor = unit_weight * np.float64(scales[k])
            _rda_int4_piece(
                acc[base : base + block], factor, codes[k * half : (k + 1) * half], pos - base, stop - base, half
            )
            pos = stop


@njit(nogil=True, cache=True)
def _rda_int4_slice(acc, weight, codes, scales, offsets, norms, block, a, b, seg):
    pos = a
    while pos < b:
        end = min(offsets[seg + 1], b)
        norm = norms[seg]
        if norm > 0.0 and end > pos:
            _rda_int4_range(acc, weight / norm, codes, scales, block, pos, end)
        pos = end
        seg += 1


@njit(parallel=True, nogil=True, cache=True)
def _rda_int4_parallel(acc, weight, codes, scales, offsets, norms, block, bounds, end, seg_first):
    for s in prange(bounds.size - 1):
        _rda_int4_slice(
            acc, weight, codes, scales, offsets, norms, block, bounds[s], min(bounds[s + 1], end), seg_first[s]
        )


# ---- a round's RDA: every contribution accumulated in one pass, the scaling fused into the outer step ----


@njit(nogil=True, cache=True)
def _rda_round_tile(acc, weights, xs, codes, scales, offsets, norms, block, int4, t0, t1):
    # Every contribution in learner order over elements [t0, t1): exactly the additions of one
    # rda_accumulate* call per contribution. int4: codes/scales are used, else xs.
    seg = np.searchsorted(offsets, t0, side="right") - 1
    for m in range(weights.size):
        if int4:
            _rda_int4_slice(acc, weights[m], codes[m], scales[m], offsets, norms[m], block, t0, t1, seg)
        else:
            _rda_slice(acc, weights[m], xs[m], offsets, norms[m], t0, t1, seg)


@njit(nogil=True, cache=True)
def _rda_round_range(acc, weights, xs, codes, scales, offsets, norms, block, int4, lo, hi, tile):
    # Elements [lo, hi) (hi <= offsets[-1]) tile by tile: the tile of `acc` stays in cache while the
    # contributions stream past.
    for t0 in range(lo, hi, tile):
        _rda_round_tile(acc, weights, xs, codes, scales, offsets, norms, block, int4, t0, min(t0 + tile, hi))


@njit(parallel=True, nogil=True, cache=True)
def _rda_round_parallel(acc, weights, xs, codes, scales, offsets, norms, block, int4, end, tile, bounds):
    for s in prange(bounds.size - 1):
        _rda_round_range(
            acc, weights, xs, codes, scales, offsets, norms, block, int4, bounds[s], min(bounds[s + 1], end), tile
        )


@njit(nogil=True, cache=True)
def _rda_round_sumsq_slice(acc, weights, xs, codes, scales, offsets, norms, block, int4, a, b, tile, seg, partial, p):
    # One slice [a, b) of segment_sumsq's cut, accumulated as _rda_round_range does, with each of its
    # pieces summed (as _sumsq_slice sums it) once the tile holding its last element is done: a piece
    # is read back from cache, and its sum sees the same range, hence the same bits, as after the
    # whole accumulate. A piece cannot be summed tile by tile: _sumsq_serial's reassociated order
    # depends on where it starts and ends.
    pos = a
    for t0 in range(a, b, tile):
        t1 = min(t0 + tile, b)
        _rda_round_tile(acc, weights, xs, codes, scales, offsets, norms, block, int4, t0, t1)
        while pos < t1:
            end = min(offsets[seg + 1], b)
            if end > t1:
                break  # its last elements lie in a later tile
            partial[p] = _sumsq_serial(acc[pos:end])
            pos = end
            seg += 1
            p += 1


@njit(parallel=True, nogil=True, cache=True)
def _rda_round_sumsq_parallel(
    acc, weights, xs, codes, scales, offsets, norms, block, int4, tile, bounds, end, seg_first, piece_start, partial
):
    for s in prange(bounds.size - 1):
        _rda_round_sumsq_slice(
            acc,
            weights,
            xs,
            codes,
            scales,
            offsets,
            norms,
            block,
            int4,
            bounds[s],
            min(bounds[s + 1], end),
            tile,
            seg_first[s],
            partial,
            piece_start[s],
        )


@njit(nogil=True, cache=True)
def _rda_round_sumsq_sequential(
    acc, weights, xs, codes, scales, offsets, norms, block, int4, tile, bounds, end, seg_first, piece_start, partial
):
    # the same slices one after another, as _sumsq_sequential: identical partials
    for s in range(bounds.size - 1):
        _rda_round_sumsq_slice(
            acc,
            weights,
            xs,
            codes,
            scales,
            offsets,
            norms,
            block,
            int4,
            bounds[s],
            min(bounds[s + 1], end),
            tile,
            seg_first[s],
            partial,
            piece_start[s],
        )


@njit(nogil=True, cache=True)
def _nesterov_scaled(theta, buf, g, factor, lr, mu):
    # the outer step of _nesterov with outer gradient g * factor (float32 product, as `g *= factor`)
    for i in range(theta.size):
        gi = g[i] * factor
        b = mu * buf[i] + gi
        buf[i] = b
        theta[i] -= lr * (gi + mu * b)


@njit(nogil=True, cache=True)
def _nesterov_segments_range(theta, buf, g, offsets, factors, lr, mu, lo, hi):
    # elements [lo, hi): each tensor's piece with its factor, the padding past offsets[-1] unscaled
    end = offsets[-1]
    pos = lo
    if pos < end:
        seg = np.searchsorted(offsets, pos, side="right") - 1
        while pos < min(hi, end):
            stop = min(offsets[seg + 1], hi)
            _nesterov_scaled(theta[pos:stop], buf[pos:stop], g[pos:stop], factors[seg], lr, mu)
            pos = stop
            seg += 1
    if pos < hi:
        _nesterov_scaled(theta[pos:hi], buf[pos:hi], g[pos:hi], np.float32(1.0), lr, mu)


@njit(parallel=True, nogil=True, cache=True)
def _nesterov_segments_parallel(theta, buf, g, offsets, factors, lr, mu, bounds):
    for s in prange(bounds.size - 1):
        _nesterov_segments_range(theta, buf, g, offsets, factors, lr, mu, bounds[s], bounds[s + 1])


# ---- public wrappers ----


def _first_segment(offsets: np.ndarray) -> int:
    """The segment element 0 belongs to, skipping empty segments at offset 0."""
    return int(np.searchsorted(offsets, 0, side="right")) - 1


def _reduce(partial: np.ndarray, piece_segment: np.ndarray, segments: int) -> np.ndarray:
    out = np.zeros(segments, dtype=np.float64)
    np.add.at(out, piece_segment, partial)  # unbuffered and in piece order: deterministic
    return out


def segment_sumsq(x: np.ndarray, offsets: np.ndarray, *, parallel: bool = True) -> np.ndarray:
    """float64[k]: sum of squares of each tensor x[offsets[i]:offsets[i+1]], accumulated in float64."""
    x = _checks.vector("x", x, np.float32)
    segments, offsets = _checks.offsets("offsets", offsets, x.size)
    end = int(offsets[-1])
    if end == 0:
        return np.zeros(segments, dtype=np.float64)
    bounds = slice_bounds(end, CHUNK_ELEMENTS)
    seg_first, piece_start, piece_segment = _piece_plan(offsets, bounds, end)
    partial = np.zeros(piece_start[-1], dtype=np.float64)
    run = _sumsq_parallel if use_parallel(end, parallel) else _sumsq_sequential
    run(x, offsets, bounds, end, seg_first, piece_start, partial)
    return _reduce(partial, piece_segment, segments)


def segment_sumsq_int4(
    codes: np.ndarray,
    scales: np.ndarray,
    offsets: np.ndarray,
    block: int = _checks.BLOCK_DEFAULT,
    *,
    parallel: bool = True,
) -> np.ndarray:
    """segment_sumsq of the int4-coded vector, from the codes (never materialised).

    Each value counts as code * scale exactly (the float32 decode rounds that product; the sums
    differ by at most a float32 rounding per value)."""
    block, n, codes, scales = _checks.coded(codes, scales, block, 2)
    segments, offsets = _checks.offsets("offsets", offsets, n)
    end = int(offsets[-1])
    if end == 0:
        return np.zeros(segments, dtype=np.float64)
    bounds = slice_bounds(end, block)
    seg_first, piece_start, piece_segment = _piece_plan(offsets, bounds, end)
    partial = np.zeros(piece_start[-1], dtype=np.float64)
    run = _sumsq_int4_parallel if use_parallel(end, parallel) else _sumsq_int4_sequential
    run(codes, scales, offsets, block, bounds, end, seg_first, piece_start, partial)
    return _reduce(partial, piece_segment, segments)


def _check_rda(
    acc: np.ndarray, weight: float, offsets: np.ndarray, norms: np.ndarray
) -> tuple[float, int, np.ndarray, np.ndarray]:
    _checks.vector("acc", acc, np.float32, writeable=True)
    weight = _checks.finite_scalar("weight", weight)
    segments, offsets = _checks.offsets("offsets", offsets, acc.size)
    norms = _checks.vector("norms", norms, np.float64)
    _checks.length("norms", norms, segments)
    _checks.non_negative_finite("norms", norms, np.inf)
    return weight, int(offsets[-1]), offsets, norms


def rda_accumulate(
    acc: np.ndarray, weight: float, x: np.ndarray, offsets: np.ndarray, norms: np.ndarray, *, parallel: bool = True
) -> None:
    """For each tensor i: acc[seg] += weight * x[seg] / norms[i], nothing where norms[i] == 0.

    The factor weight / norms[i] and its product with x are float64; each term is rounded to float32
    once before it is added."""
    weight, end, offsets, norms = _check_rda(acc, weight, offsets, norms)
    x = _checks.vector("x", x, np.float32)
    _checks.length("x", x, acc.size)
    _checks.disjoint(acc=acc, x=x, offsets=offsets, norms=norms)
    if end == 0:
        return
    bounds = thread_bounds(end, CHUNK_ELEMENTS, parallel)
    if bounds is None:
        _rda_slice(acc, weight, x, offsets, norms, 0, end, _first_segment(offsets))
    else:
        _rda_parallel(acc, weight, x, offsets, norms, bounds, end, _piece_plan(offsets, bounds, end)[0])


def rda_accumulate_int4(
    acc: np.ndarray,
    weight: float,
    codes: np.ndarray,
    scales: np.ndarray,
    offsets: np.ndarray,
    norms: np.ndarray,
    block: int = _checks.BLOCK_DEFAULT,
    *,
    parallel: bool = True,
) -> None:
    """rda_accumulate of the int4-coded vector, fused: acc[seg] += weight * code * scale / norms[i]."""
    weight, end, offsets, norms = _check_rda(acc, weight, offsets, norms)
    block, _, codes, scales = _checks.coded(codes, scales, block, 2, acc.size)
    _checks.disjoint(acc=acc, codes=codes, scales=scales, offsets=offsets, norms=norms)
    if end == 0:
        return
    bounds = thread_bounds(end, block, parallel)
    if bounds is None:
        _rda_int4_slice(acc, weight, codes, scales, offsets, norms, block, 0, end, _first_segment(offsets))
    else:
        _rda_int4_parallel(
            acc, weight, codes, scales, offsets, norms, block, bounds, end, _piece_plan(offsets, bounds, end)[0]
        )


def _readonly_empty(dtype: type) -> np.ndarray:
    a = np.zeros(0, dtype=dtype)
    a.flags.writeable = False
    return a


# Stand-ins for the list a round does not use (fp32 rounds have no codes, int4 rounds no fp32 vectors):
# a typed list takes its type from its items, so it cannot be empty.
_UNUSED_F32 = (_readonly_empty(np.float32),)
_UNUSED_U8 = (_readonly_empty(np.uint8),)


class _Round(NamedTuple):
    """A round's arguments, validated, in the order its kernels take them (with the lists typed)."""

    acc: np.ndarray
    weights: np.ndarray
    xs: Sequence[np.ndarray]
    codes: Sequence[np.ndarray]
    scales: Sequence[np.ndarray]
    offsets: np.ndarray
    norms: np.ndarray
    block: int
    int4: bool


def _checked_round(
    acc: object,
    weights: object,
    xs: object,
    codes: object,
    scales: object,
    offsets: object,
    norms: object,
    block: object,
) -> tuple[_Round, int, int]:
    """A round's arguments validated, with the number of segments and the alignment unit of its
    slices (the int4 block, or CHUNK_ELEMENTS)."""
    int4 = xs is None
    _checks.vector("acc", acc, np.float32, writeable=True)
    weights = _checks.weights(weights)
    segments, offsets = _checks.offsets("offsets", offsets, acc.size)
    norms = _checks.matrix("norms", norms, np.float64, (weights.size, segments))
    _checks.non_negative_finite("norms", norms.ravel(), np.inf)
    named = {}
    if int4:
        codes = _checks.sequence("codes", codes, weights.size)
        scales = _checks.sequence("scales", scales, weights.size)
        for m in range(weights.size):
            block, _, codes[m], scales[m] = _checks.coded(codes[m], scales[m], block, 2, acc.size)
            named[f"codes[{m}]"], named[f"scales[{m}]"] = codes[m], scales[m]
        xs, unit = _UNUSED_F32, block
    else:
        xs = _checks.sequence("xs", xs, weights.size)
        for m in range(weights.size):
            xs[m] = _checks.vector(f"xs[{m}]", xs[m], np.float32)
            _checks.length(f"xs[{m}]", xs[m], acc.size)
            named[f"xs[{m}]"] = xs[m]
        codes, scales, block, unit = _UNUSED_U8, _UNUSED_F32, 0, CHUNK_ELEMENTS
    _checks.written_apart({"acc": acc}, {"offsets": offsets, "norms": norms, **named})
    return _Round(acc, weights, xs, codes, scales, offsets, norms, block, int4), segments, unit


def _kernel_args(r: _Round) -> _Round:
    """The round as its kernels take it: the per-contribution arrays as typed lists, built per call."""
    return r._replace(xs=typed_list(r.xs), codes=typed_list(r.codes), scales=typed_list(r.scales))


def _run_round(r: _Round, unit: int, parallel: bool) -> None:
    end = int(r.offsets[-1])
    if end == 0:
        return
    tile = tile_elements(unit)
    bounds = thread_bounds(end, unit, parallel)
    if bounds is None:
        _rda_round_range(*_kernel_args(r), 0, end, tile)
    else:
        _rda_round_parallel(*_kernel_args(r), end, tile, bounds)


def _run_round_sumsq(r: _Round, segments: int, unit: int, parallel: bool) -> np.ndarray:
    """_run_round, then segment_sumsq(acc, offsets) of the result with its bits, in the same pass."""
    acc, offsets = r.acc, r.offsets
    end = int(offsets[-1])
    if end == 0:
        return np.zeros(segments, dtype=np.float64)
    if CHUNK_ELEMENTS % unit:
        # The sums' cut would start slices inside a block, where the accumulate never starts a tile:
        # two passes keep every bit as it is. No codec the core uses has such a block.
        _run_round(r, unit, parallel)
        return segment_sumsq(acc, offsets, parallel=parallel)
    # segment_sumsq's own cut and pieces, which fix its bits; the accumulate gives the same values on
    # any cut, each element being computed alone
    bounds = slice_bounds(end, CHUNK_ELEMENTS)
    seg_first, piece_start, piece_segment = _piece_plan(offsets, bounds, end)
    partial = np.zeros(piece_start[-1], dtype=np.float64)
    run = _rda_round_sumsq_parallel if use_parallel(end, parallel) else _rda_round_sumsq_sequential
    run(*_kernel_args(r), tile_elements(unit), bounds, end, seg_first, piece_start, partial)
    return _reduce(partial, piece_segment, segments)


def rda_accumulate_round(
    acc: np.ndarray,
    weights: np.ndarray,
    xs: Sequence[np.ndarray],
    offsets: np.ndarray,
    norms: np.ndarray,
    *,
    parallel: bool = True,
) -> None:
    """Every contribution of a round in one pass: for m in order, rda_accumulate(acc, weights[m], xs[m],
    offsets, norms[m]), with the same bits; norms is float64[m, k]. Each contribution is read once and
    each tile of `acc` stays in cache while they are added."""
    r, _, unit = _checked_round(acc, weights, xs, None, None, offsets, norms, 0)
    _run_round(r, unit, parallel)


def rda_accumulate_round_int4(
    acc: np.ndarray,
    weights: np.ndarray,
    codes: Sequence[np.ndarray],
    scales: Sequence[np.ndarray],
    offsets: np.ndarray,
    norms: np.ndarray,
    block: int = _checks.BLOCK_DEFAULT,
    *,
    parallel: bool = True,
) -> None:
    """rda_accumulate_round of int4-coded contributions: for m in order, rda_accumulate_int4(acc,
    weights[m], codes[m], scales[m], offsets, norms[m], block), in one pass and with the same bits."""
    r, _, unit = _checked_round(acc, weights, None, codes, scales, offsets, norms, block)
    _run_round(r, unit, parallel)


def rda_accumulate_round_sumsq(
    acc: np.ndarray,
    weights: np.ndarray,
    xs: Sequence[np.ndarray],
    offsets: np.ndarray,
    norms: np.ndarray,
    *,
    parallel: bool = True,
) -> np.ndarray:
    """rda_accumulate_round, returning float64[k] segment_sumsq(acc, offsets) of the result, the same
    bits on either driver, without the pass over `acc` that call would take: each piece of `acc` is
    summed while it is still in cache."""
    r, segments, unit = _checked_round(acc, weights, xs, None, None, offsets, norms, 0)
    return _run_round_sumsq(r, segments, unit, parallel)


def rda_accumulate_round_int4_sumsq(
    acc: np.ndarray,
    weights: np.ndarray,
    codes: Sequence[np.ndarray],
    scales: Sequence[np.ndarray],
    offsets: np.ndarray,
    norms: np.ndarray,
    block: int = _checks.BLOCK_DEFAULT,
    *,
    parallel: bool = True,
) -> np.ndarray:
    """rda_accumulate_round_int4, returning float64[k] segment_sumsq(acc, offsets) of the result with
    its bits, as rda_accumulate_round_sumsq does."""
    r, segments, unit = _checked_round(acc, weights, None, codes, scales, offsets, norms, block)
    return _run_round_sumsq(r, segments, unit, parallel)


def nesterov_step_segments(
    theta: np.ndarray,
    buf: np.ndarray,
    g: np.ndarray,
    offsets: np.ndarray,
    factors: np.ndarray,
    lr: float,
    mu: float,
    *,
    parallel: bool = True,
) -> None:
    """The outer step with outer gradient g scaled per tensor, in one pass: nesterov_step(theta, buf,
    g * factors[i] on tensor i, lr, mu), g unscaled past offsets[-1] (padding); `g` is not modified.
    The products are float32, so the bits are those of `g[seg] *= factors[i]` then nesterov_step."""
    _checks.vector("theta", theta, np.float32, writeable=True)
    _checks.vector("buf", buf, np.float32, writeable=True)
    g = _checks.vector("g", g, np.float32)
    _checks.length("buf", buf, theta.size)
    _checks.length("g", g, theta.size)
    segments, offsets = _checks.offsets("offsets", offsets, theta.size)
    factors = _checks.vector("factors", factors, np.float32)
    _checks.length("factors", factors, segments)
    if factors.size and not np.isfinite(factors).all():
        raise KernelInputError("factors must be finite")
    lr32 = np.float32(_checks.finite_scalar("lr", lr))
    mu32 = np.float32(_checks.finite_scalar("mu", mu))
    _checks.disjoint(theta=theta, buf=buf, g=g, offsets=offsets, factors=factors)
    bounds = thread_bounds(theta.size, CHUNK_ELEMENTS, parallel)
    if bounds is None:
        _nesterov_segments_range(theta, buf, g, offsets, factors, lr32, mu32, 0, theta.size)
    else:
        _nesterov_segments_parallel(theta, buf, g, offsets, factors, lr32, mu32, bounds)
