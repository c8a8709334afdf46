"""Plain-numpy references of every kernel, with the same signatures.

They define what the kernels compute and are written for clarity, not speed: whole-array numpy
expressions, float64 where the definition says so, temporaries allowed. Tests compare the kernels
against them on random inputs and the merge benchmark times them as the numpy baseline. They
validate only what changes their result (a non-finite input to a quantizer raises).
"""

from __future__ import annotations

import numpy as np

from ddiloco.kernels._checks import BLOCK_DEFAULT
from ddiloco.kernels._errors import KernelInputError

_INT4_CODE_MAX = 7
_INT4_OFFSET = 8
_INT2_LEVEL_MAX = 3


def _blocks(x: np.ndarray, block: int) -> np.ndarray:
    """float32[n] as float32[n/block, block], rejecting NaN/Inf as the quantizers do."""
    if not np.isfinite(x).all():
        raise KernelInputError("x has NaN or Inf values")
    return x.reshape(-1, block)


def _absmax_scales(xb: np.ndarray, code_max: int) -> np.ndarray:
    return (np.abs(xb).max(axis=1).astype(np.float64) / code_max).astype(np.float32)


def _ratios(xb: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """x times the float64 reciprocal of the scale, 0 where the scale is 0: the kernels' arithmetic
    (a multiply, not a division: the two differ by an ulp now and then, which moves a value that
    sits on a rounding midpoint to the other code)."""
    s = scales.astype(np.float64)[:, None]
    inv = np.divide(1.0, s, out=np.zeros(s.shape), where=s > 0)
    return xb.astype(np.float64) * inv


def _pack(fields: np.ndarray, parts: int, bits: int) -> np.ndarray:
    """uint8 codes from per-value fields[blocks, block]: byte j of a block holds the value
    j + r * block/parts in bits [r*bits, (r+1)*bits)."""
    blocks, block = fields.shape
    width = block // parts
    out = np.zeros((blocks, width), dtype=np.uint8)
    for r in range(parts):
        out |= (fields[:, r * width : (r + 1) * width].astype(np.uint8) << (r * bits)).astype(np.uint8)
    return out.ravel()


def _unpack(codes: np.ndarray, block: int, parts: int, bits: int) -> np.ndarray:
    """int64[blocks, block] fields, the inverse of _pack."""
    rows = codes.reshape(-1, block // parts).astype(np.int64)
    mask = (1 << bits) - 1
    return np.concatenate([(rows >> (r * bits)) & mask for r in range(parts)], axis=1)


def _fill(values: np.ndarray, out: np.ndarray | None) -> np.ndarray:
    if out is None:
        return values
    out[...] = values
    return out


# ---- int4 ----


def quantize_int4(x: np.ndarray, block: int = BLOCK_DEFAULT) -> tuple[np.ndarray, np.ndarray]:
    xb = _blocks(x, block)
    scales = _absmax_scales(xb, _INT4_CODE_MAX)
    codes = np.clip(np.rint(_ratios(xb, scales)), -_INT4_CODE_MAX, _INT4_CODE_MAX).astype(np.int64)
    return _pack(codes + _INT4_OFFSET, 2, 4), scales


def dequantize_int4(
    codes: np.ndarray, scales: np.ndarray, block: int = BLOCK_DEFAULT, *, out: np.ndarray | None = None
) -> np.ndarray:
    values = (_unpack(codes, block, 2, 4) - _INT4_OFFSET).astype(np.float32) * scales[:, None]
    return _fill(values.ravel(), out)


def accumulate_int4(
    acc: np.ndarray, weight: float, codes: np.ndarray, scales: np.ndarray, block: int = BLOCK_DEFAULT
) -> None:
    acc += np.float32(weight) * dequantize_int4(codes, scales, block)


# ---- int2 ----


def quantize_int2(x: np.ndarray, block: int = BLOCK_DEFAULT) -> tuple[np.ndarray, np.ndarray]:
    xb = _blocks(x, block)
    scales = _absmax_scales(xb, _INT2_LEVEL_MAX)
    # nearest of the odd levels -3, -1, 1, 3 (midpoints go up)
    levels = np.clip(2.0 * np.floor(_ratios(xb, scales) / 2.0) + 1.0, -3, 3).astype(np.int64)
    return _pack((levels + 3) // 2, 4, 2), scales


def dequantize_int2(
    codes: np.ndarray, scales: np.ndarray, block: int = BLOCK_DEFAULT, *, out: np.ndarray | None = None
) -> np.ndarray:
    values = (2 * _unpack(codes, block, 4, 2) - 3).astype(np.float32) * scales[:, None]
    return _fill(values.ravel(), out)


def accumulate_int2(
    acc: np.ndarray, weight: float, codes: np.ndarray, scales: np.ndarray, block: int = BLOCK_DEFAULT
) -> None:
    acc += np.float32(weight) * dequantize_int2(codes, scales, block)


# ---- int1 ----


def quantize_int1(x: np.ndarray, block: int = BLOCK_DEFAULT) -> tuple[np.ndarray, np.ndarray]:
    xb = _blocks(x, block)
    scales = np.abs(xb.astype(np.float64)).mean(axis=1).astype(np.float32)
    return _pack(xb >= 0, 8, 1), scales


def dequantize_int1(
    codes: np.ndarray, scales: np.ndarray, block: int = BLOCK_DEFAULT, *, out: np.ndarray | None = None
) -> np.ndarray:
    values = (2 * _unpack(codes, block, 8, 1) - 1).astype(np.float32) * scales[:, None]
    return _fill(values.ravel(), out)


def accumulate_int1(
    acc: np.ndarray, weight: float, codes: np.ndarray, scales: np.ndarray, block: int = BLOCK_DEFAULT
) -> None:
    acc += np.float32(weight) * dequantize_int1(codes, scales, block)


# ---- bfloat16 ----


def _bf16_value(u: np.ndarray) -> np.ndarray:
    """float64 value of bfloat16 bit patterns, with the pattern one past the largest finite value
    read as +-2**128: the point IEEE rounding measures overflow against."""
    magnitude = (u.astype(np.uint32) & 0x7FFF) << 16
    value = magnitude.view(np.float32).astype(np.float64)
    value = np.where(magnitude == 0x7F800000, 2.0**128, value)
    return np.where(u & 0x8000, -value, value)


def to_bf16(x: np.ndarray, *, out: np.ndarray | None = None) -> np.ndarray:
    """Round to nearest by comparing the distances to the two neighbouring bfloat16 values."""
    bits = x.view(np.uint32)
    down = (bits >> 16).astype(np.uint16)  # truncation: the neighbour towards zero
    up = down + np.uint16(1)  # the neighbour away from zero (wraps only for NaN patterns)
    with np.errstate(invalid="ignore"):  # NaN patterns are handled below
        x64 = x.astype(np.float64)
        d_down = np.abs(x64 - _bf16_value(down))
        d_up = np.abs(_bf16_value(up) - x64)
    exact = (bits & 0xFFFF) == 0
    choose_up = ~exact & ((d_up < d_down) | ((d_up == d_down) & (down % 2 == 1)))
    result = np.where(choose_up, up, down).astype(np.uint16)
    nan = np.isnan(x)
    result[nan] = down[nan] | np.uint16(0x0040)
    return _fill(result, out)


def from_bf16(u: np.ndarray, *, out: np.ndarray | None = None) -> np.ndarray:
    return _fill((u.astype(np.uint32) << 16).view(np.float32), out)


# ---- dense ----


def accumulate(acc: np.ndarray, weight: float, x: np.ndarray) -> None:
    acc += np.float32(weight) * x


def count_nonfinite(x: np.ndarray) -> int:
    return int(np.count_nonzero(~np.isfinite(x)))


def all_finite(x: np.ndarray) -> bool:
    return bool(np.isfinite(x).all())


# ---- segments (RDA) ----


def _segments(offsets: np.ndarray):
    return zip(offsets[:-1].tolist(), offsets[1:].tolist())


def segment_sumsq(x: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    return np.array([np.sum(np.square(x[a:b].astype(np.float64))) for a, b in _segments(offsets)], dtype=np.float64)


def segment_sumsq_int4(
    codes: np.ndarray, scales: np.ndarray, offsets: np.ndarray, block: int = BLOCK_DEFAULT
) -> np.ndarray:
    return segment_sumsq(dequantize_int4(codes, scales, block), offsets)


def rda_accumulate(acc: np.ndarray, weight: float, x: np.ndarray, offsets: np.ndarray, norms: np.ndarray) -> None:
    for (a, b), norm in zip(_segments(offsets), norms.tolist()):
        if norm > 0:
            acc[a:b] += (x[a:b].astype(np.float64) * (weight / norm)).astype(np.float32)


def rda_accumulate_int4(
    acc: np.ndarray,
    weight: float,
    codes: np.ndarray,
    scales: np.ndarray,
    offsets: np.ndarray,
    norms: np.ndarray,
    block: int = BLOCK_DEFAULT,
) -> None:
    rda_accumulate(acc, weight, dequantize_int4(codes, scales, block), offsets, norms)


# ---- outer optimizer ----


def nesterov_step(theta: np.ndarray, buf: np.ndarray, g: np.ndarray, lr: float, mu: float) -> None:
    mu32, lr32 = np.float32(mu), np.float32(lr)
    buf *= mu32
    buf += g
    theta -= lr32 * (g + mu32 * buf)


# ---- a round's fused merge ----


def round_mean_int4(out, weights, codes, scales, block=BLOCK_DEFAULT) -> None:
    out[...] = 0
    for w, c, s in zip(weights, codes, scales):
        accumulate_int4(out, w, c, s, block)


def round_mean_step_int4(theta, buf, weights, codes, scales, lr, mu, block=BLOCK_DEFAULT) -> None:
    g = np.zeros_like(theta)
    round_mean_int4(g, weights, codes, scales, block)
    nesterov_step(theta, buf, g, lr, mu)


def round_mean(out, weights, xs) -> None:
    out[...] = 0
    for w, x in zip(weights, xs):
        accumulate(out, w, x)


def round_mean_step(theta, buf, weights, xs, lr, mu) -> None:
    g = np.zeros_like(theta)
    round_mean(g, weights, xs)
    nesterov_step(theta, buf, g, lr, mu)


def rda_accumulate_round(acc, weights, xs, offsets, norms) -> None:
    for w, x, n in zip(weights, xs, norms):
        rda_accumulate(acc, w, x, offsets, n)


def rda_accumulate_round_int4(acc, weights, codes, scales, offsets, norms, block=BLOCK_DEFAULT) -> None:
    for w, c, s, n in zip(weights, codes, scales, norms):
        rda_accumulate_int4(acc, w, c, s, offsets, n, block)


def rda_accumulate_round_sumsq(acc, weights, xs, offsets, norms) -> np.ndarray:
    rda_accumulate_round(acc, weights, xs, offsets, norms)
    return segment_sumsq(acc, offsets)


def rda_accumulate_round_int4_sumsq(acc, weights, codes, scales, offsets, norms, block=BLOCK_DEFAULT) -> np.ndarray:
    rda_accumulate_round_int4(acc, weights, codes, scales, offsets, norms, block)
    return segment_sumsq(acc, offsets)


def nesterov_step_segments(theta, buf, g, offsets, factors, lr, mu) -> None:
    scaled = g.copy()
    for (a, b), f in zip(_segments(offsets), factors):
        scaled[a:b] *= np.float32(f)
    nesterov_step(theta, buf, scaled, lr, mu)


# ---- the learner's encode and apply ----


def quantize_delta_int4(base, theta, residual=None, block=BLOCK_DEFAULT):
    target = base - theta if residual is None else (base - theta) + residual
    codes, scales = quantize_int4(target, block)
    new_residual = None if residual is None else target - dequantize_int4(codes, scales, block)
    return codes, scales, new_residual


def apply_delta_int4(theta, base, codes, scales, block=BLOCK_DEFAULT) -> None:
    d = dequantize_int4(codes, scales, block)
    theta += d
    base += d


def publish_delta_int4(published, theta, block=BLOCK_DEFAULT):
    codes, scales = quantize_int4(theta - published, block)
    published += dequantize_int4(codes, scales, block)
    return codes, scales


def add_delta_int4(published, codes, scales, block=BLOCK_DEFAULT) -> None:
    published += dequantize_int4(codes, scales, block)


def add_delta_apart_int4(onto, anchor, codes, scales, block=BLOCK_DEFAULT):
    published = onto + dequantize_int4(codes, scales, block)
    return published, published - anchor


__all__ = [
    "accumulate",
    "accumulate_int1",
    "accumulate_int2",
    "accumulate_int4",
    "add_delta_apart_int4",
    "add_delta_int4",
    "all_finite",
    "apply_delta_int4",
    "count_nonfinite",
    "dequantize_int1",
    "dequantize_int2",
    "dequantize_int4",
    "from_bf16",
    "nesterov_step",
    "nesterov_step_segments",
    "publish_delta_int4",
    "quantize_delta_int4",
    "quantize_int1",
    "quantize_int2",
    "quantize_int4",
    "rda_accumulate",
    "rda_accumulate_int4",
    "rda_accumulate_round",
    "rda_accumulate_round_int4",
    "rda_accumulate_round_int4_sumsq",
    "rda_accumulate_round_sumsq",
    "round_mean",
    "round_mean_int4",
    "round_mean_step",
    "round_mean_step_int4",
    "segment_sumsq",
    "segment_sumsq_int4",
    "to_bf16",
]
