"""Fragment codecs: a flat float32 fragment to bytes and back, with a small self-describing header.

docs/algorithm.md, "Compression". Outer gradients travel int4 by default (blockwise absmax, one float32
scale per block of 128, codes in [-7, 7]); fp32, bf16, int2 and int1 exist for broadcasts and for the
compression ablation. A received payload is parsed into an `Encoded` view without copying, and the
syncer merges straight from it: the fused kernels never materialise the fp32 vector for int4.

Payload layout (little-endian):

    offset  size  field
    0       4     magic b"DDCF"
    4       1     format version (1)
    5       1     codec id (Codec.ident)
    6       2     reserved, zero
    8       4     block (values per scale; 0 for fp32 / bf16)
    12      8     elements n (a multiple of block for block codecs)
    20      4     body bytes (everything after this 24-byte header)
    24      ...   body: fp32 -> float32[n]; bf16 -> uint16[n];
                  int4 / int2 / int1 -> float32 scales[n/block] then uint8 codes[n/2 | n/4 | n/8]
"""

from __future__ import annotations

import enum
import struct
from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np

from ddiloco import kernels
from ddiloco.errors import UserError

_HEADER = struct.Struct("<4sBBHIQI")
HEADER_BYTES = _HEADER.size
_MAGIC = b"DDCF"
_FORMAT = 1
ELEMENTS_MAX = 2**31 - 1
# The largest code of a block codec in steps of its scale: int4 codes are in [-7, 7], but a nibble of
# a payload can say -8; int2 and int1 levels are smaller.
BLOCK_CODE_ABS_MAX = 8


class CodecError(UserError, ValueError):
    """A payload or an input that a codec cannot take; the message says what is wrong."""


class Codec(str, enum.Enum):
    FP32 = "fp32"
    BF16 = "bf16"
    INT4 = "int4"
    INT2 = "int2"
    INT1 = "int1"

    @property
    def ident(self) -> int:
        return _IDENTS[self]

    @property
    def dense_bytes(self) -> int | None:
        """Bytes per element of an uncompressed codec; None for the blockwise quantized ones."""
        return {Codec.FP32: 4, Codec.BF16: 2}.get(self)

    @property
    def is_block(self) -> bool:
        return self in _CODES_PER_BYTE

    def body_bytes(self, elements: int, block: int) -> int:
        if self is Codec.FP32:
            return 4 * elements
        if self is Codec.BF16:
            return 2 * elements
        return 4 * (elements // block) + elements // _CODES_PER_BYTE[self]

    def elements_of_body(self, body_bytes: int, block: int) -> int:
        """The element count of a body of `body_bytes` (the inverse of `body_bytes`)."""
        if not self.is_block:
            return body_bytes // self.dense_bytes
        return body_bytes // (4 + block // _CODES_PER_BYTE[self]) * block


_IDENTS = {Codec.FP32: 1, Codec.BF16: 2, Codec.INT4: 3, Codec.INT2: 4, Codec.INT1: 5}
_BY_IDENT = {v: k for k, v in _IDENTS.items()}
_CODES_PER_BYTE = {Codec.INT4: 2, Codec.INT2: 4, Codec.INT1: 8}
# The kernels by name, looked up at the call: `kernels` imports numba on first use (its __init__),
# and a syncer imports this module before it listens, numba after.
_QUANTIZE = {Codec.INT4: "quantize_int4", Codec.INT2: "quantize_int2", Codec.INT1: "quantize_int1"}
_DEQUANTIZE = {Codec.INT4: "dequantize_int4", Codec.INT2: "dequantize_int2", Codec.INT1: "dequantize_int1"}
_ACCUMULATE = {Codec.INT4: "accumulate_int4", Codec.INT2: "accumulate_int2", Codec.INT1: "accumulate_int1"}


def parse_codec(name: str | Codec) -> Codec:
    try:
        return Codec(name)
    except ValueError:
        raise CodecError(f"unknown codec {name!r}; one of {[c.value for c in Codec]}") from None


@dataclass(frozen=True)
class Encoded:
    """A parsed payload: views into one buffer (the encoder's, or the received one), validated, never
    copied. `body` is the payload without the codec header (scales, then codes, for block codecs): what
    the wire message and the tape carry, the codec, block and size beside it as fields."""

    codec: Codec
    block: int
    elements: int
    data: np.ndarray  # float32[n] | uint16[n] | uint8[n/2|n/4|n/8]
    scales: np.ndarray | None  # float32[n/block] for block codecs
    body: memoryview = field(repr=False, compare=False)  # read-only bytes that `data` and `scales` view

    def header(self) -> bytes:
        """The 24-byte codec header of this payload (header + body are the bytes `encode` returns)."""
        return header(self.codec, self.block, self.elements)

    def decode(self, *, parallel: bool = True) -> np.ndarray:
        """The fp32 vector (materialised; the merge path avoids this for int4). `parallel=False` keeps
        every kernel of this and the methods below on the calling thread (same bits)."""
        if self.codec is Codec.FP32:
            return self.data.copy()
        if self.codec is Codec.BF16:
            return kernels.from_bf16(self.data, parallel=parallel)
        return getattr(kernels, _DEQUANTIZE[self.codec])(self.data, self.scales, self.block, parallel=parallel)

    def accumulate_into(self, acc: np.ndarray, weight: float, *, parallel: bool = True) -> None:
        """acc += weight * decode(self), fused for every codec but bf16."""
        if self.codec is Codec.FP32:
            kernels.accumulate(acc, weight, self.data, parallel=parallel)
        elif self.codec is Codec.BF16:
            kernels.accumulate(acc, weight, kernels.from_bf16(self.data, parallel=parallel), parallel=parallel)
        else:
            getattr(kernels, _ACCUMULATE[self.codec])(
                acc, weight, self.data, self.scales, self.block, parallel=parallel
            )

    def segment_sumsq(self, offsets: np.ndarray, *, parallel: bool = True) -> np.ndarray:
        """float64[k] sums of squares of each tensor (the squared norms RDA needs)."""
        if self.codec is Codec.FP32:
            return kernels.segment_sumsq(self.data, offsets, parallel=parallel)
        if self.codec is Codec.INT4:
            return kernels.segment_sumsq_int4(self.data, self.scales, offsets, self.block, parallel=parallel)
        return kernels.segment_sumsq(self.decode(parallel=parallel), offsets, parallel=parallel)

    def rda_accumulate_into(
        self, acc: np.ndarray, weight: float, offsets: np.ndarray, norms: np.ndarray, *, parallel: bool = True
    ) -> None:
        """acc[seg] += weight * x[seg] / norms[seg] (nothing where the norm is 0)."""
        if self.codec is Codec.FP32:
            kernels.rda_accumulate(acc, weight, self.data, offsets, norms, parallel=parallel)
        elif self.codec is Codec.INT4:
            kernels.rda_accumulate_int4(
                acc, weight, self.data, self.scales, offsets, norms, self.block, parallel=parallel
            )
        else:
            kernels.rda_accumulate(acc, weight, self.decode(parallel=parallel), offsets, norms, parallel=parallel)

    def within(self, limit: float) -> bool:
        """Whether every decoded value lies in [-limit, limit] (so is finite): a block codec's from its
        scales (a code is at most BLOCK_CODE_ABS_MAX steps of its scale), the dense codecs' from their
        values (`values_within`). A NaN or Inf scale fails the comparison as a NaN value does."""
        if self.scales is not None:
            return float(np.max(np.abs(self.scales), initial=0.0)) * BLOCK_CODE_ABS_MAX <= limit
        return values_within(self.data if self.codec is Codec.FP32 else kernels.from_bf16(self.data), limit)

    def all_finite(self, *, parallel: bool = True) -> bool:
        """Whether every decoded value is finite, checked without materialising block codecs: codes are
        bounded, so a block codec is finite exactly when its scales are."""
        if self.scales is not None:
            return kernels.all_finite(self.scales, parallel=parallel)
        values = self.data if self.codec is Codec.FP32 else kernels.from_bf16(self.data, parallel=parallel)
        return kernels.all_finite(values, parallel=parallel)


def values_within(values: np.ndarray, limit: float) -> bool:
    """Whether every value lies in [-limit, limit]: from the extremes, without a copy (NaN fails both
    comparisons)."""
    return bool(values.size == 0 or (np.max(values) <= limit and np.min(values) >= -limit))


def encode(x: np.ndarray, codec: Codec | str, block: int = kernels.BLOCK_DEFAULT, *, parallel: bool = True) -> bytes:
    """Header + body for the float32 vector `x`. Raises CodecError on NaN/Inf or a bad length.
    `parallel=False` keeps the kernels on the calling thread (a learner's training step holds the
    cores); the bytes are the same either way."""
    codec = parse_codec(codec)
    x = _check_vector(x)
    if not kernels.all_finite(x, parallel=parallel):
        raise CodecError("cannot encode a vector with NaN or Inf values")
    n = x.size
    if codec.is_block:
        _check_block(codec, block, n)
        codes, scales = getattr(kernels, _QUANTIZE[codec])(x, block, parallel=parallel)
        body = [_bytes_of(scales), _bytes_of(codes)]
    elif codec is Codec.BF16:
        body, block = [_bytes_of(kernels.to_bf16(x, parallel=parallel))], 0
    else:
        body, block = [_bytes_of(x)], 0
    size = sum(b.nbytes for b in body)
    assert size == codec.body_bytes(n, block)
    return b"".join([header(codec, block, n), *body])  # the payload's one copy: the kernels' outputs joined


def header(codec: Codec, block: int, elements: int) -> bytes:
    """The 24-byte header of a payload with this codec, block and size."""
    return _HEADER.pack(_MAGIC, _FORMAT, codec.ident, 0, block, elements, codec.body_bytes(elements, block))


def parse(buf: bytes | bytearray | memoryview, *, elements: int | None = None) -> Encoded:
    """Validate `buf` (header + body) and return views into it. `elements`, when given, is the size
    the receiver expects (the fragment's padded size); a payload of another size is refused."""
    view = memoryview(buf).cast("B")
    if view.nbytes < HEADER_BYTES:
        raise CodecError(f"payload of {view.nbytes} bytes is shorter than the {HEADER_BYTES}-byte codec header")
    magic, fmt, ident, reserved, block, n, size = _HEADER.unpack_from(view, 0)
    if magic != _MAGIC:
        raise CodecError(f"bad codec magic {magic!r}")
    if fmt != _FORMAT or reserved != 0:
        raise CodecError(f"codec format {fmt} (reserved {reserved}) is not format {_FORMAT}")
    if ident not in _BY_IDENT:
        raise CodecError(f"unknown codec id {ident}")
    codec = _BY_IDENT[ident]
    body = view[HEADER_BYTES:]
    if size != body.nbytes:
        raise CodecError(f"header says the body has {size} bytes, buffer has {body.nbytes}")
    return from_body(codec, block, n, body, elements=elements)


def from_body(
    codec: Codec | str, block: int, n: int, body: bytes | memoryview, *, elements: int | None = None
) -> Encoded:
    """Views into a header-less body whose codec, block and size are known from elsewhere (the wire
    message carries them). Validates exactly what `parse` validates."""
    codec = parse_codec(codec)
    view = memoryview(body).cast("B")
    if n > ELEMENTS_MAX:
        raise CodecError(f"payload declares {n} elements, above the limit of {ELEMENTS_MAX}")
    if elements is not None and n != elements:
        raise CodecError(f"payload has {n} elements, expected {elements}")
    if codec.is_block:
        _check_block(codec, block, n)
    elif block != 0:
        raise CodecError(f"{codec.value} payload declares block {block}, expected 0")
    expected = codec.body_bytes(n, block)
    if view.nbytes != expected:
        raise CodecError(f"{codec.value} payload of {n} elements needs a {expected}-byte body, got {view.nbytes}")
    view = view.toreadonly()
    raw = np.frombuffer(view, dtype=np.uint8)
    if codec is Codec.FP32:
        return Encoded(codec, 0, n, raw.view(np.float32), None, view)
    if codec is Codec.BF16:
        return Encoded(codec, 0, n, raw.view(np.uint16), None, view)
    nscales = 4 * (n // block)
    scales = raw[:nscales].view(np.float32)
    # The quantizers never write a negative scale, and the kernels refuse one when they merge: a
    # malformed payload, refused here. (A NaN compares false: it is a non-finite payload, all_finite.)
    if (scales < 0).any():
        raise CodecError(f"{codec.value} payload has a negative block scale")
    return Encoded(codec, block, n, raw[nscales:], scales, view)


@dataclass(frozen=True)
class FeedbackState:
    """Error feedback (ours): the part of the outer gradient that compression lost last time, added to
    the next one so that nothing is lost for good."""

    residual: np.ndarray  # float32[n]


def feedback_init(elements: int) -> FeedbackState:
    return FeedbackState(residual=np.zeros(elements, dtype=np.float32))


def encode_with_feedback(
    x: np.ndarray,
    state: FeedbackState,
    codec: Codec | str,
    block: int = kernels.BLOCK_DEFAULT,
    *,
    parallel: bool = True,
) -> tuple[bytes, FeedbackState]:
    """Encode x + residual; the new residual is what that encoding lost."""
    x = _check_vector(x)
    if state.residual.shape != x.shape:
        raise CodecError(f"feedback residual has shape {state.residual.shape}, vector {x.shape}")
    target = x + state.residual
    payload = encode(target, codec, block, parallel=parallel)
    return payload, FeedbackState(residual=target - parse(payload).decode(parallel=parallel))


def encode_delta(
    base: np.ndarray,
    theta: np.ndarray,
    state: FeedbackState | None,
    codec: Codec | str,
    block: int = kernels.BLOCK_DEFAULT,
    *,
    parallel: bool = True,
) -> tuple[bytes, FeedbackState | None]:
    """A learner's outer gradient base - theta encoded, with error feedback when `state` is given: the
    same bytes and residual as `encode_with_feedback(base - theta, state, ...)` (or `encode`), and for
    int4 in one pass over the fragment (kernels.quantize_delta_int4) instead of four."""
    codec = parse_codec(codec)
    base, theta = _check_vector(base), _check_vector(theta)
    if base.shape != theta.shape:
        raise CodecError(f"base has shape {base.shape}, theta {theta.shape}")
    if codec is not Codec.INT4:
        if state is None:
            return encode(base - theta, codec, block, parallel=parallel), None
        return encode_with_feedback(base - theta, state, codec, block, parallel=parallel)
    if state is not None and state.residual.shape != base.shape:
        raise CodecError(f"feedback residual has shape {state.residual.shape}, vector {base.shape}")
    _check_block(codec, block, base.size)
    try:
        codes, scales, residual = kernels.quantize_delta_int4(
            base, theta, None if state is None else state.residual, block, parallel=parallel
        )
    except kernels.KernelInputError:
        raise CodecError("cannot encode a vector with NaN or Inf values") from None
    payload = b"".join([header(codec, block, base.size), _bytes_of(scales), _bytes_of(codes)])
    return payload, None if state is None else FeedbackState(residual=residual)


def warm_up(codecs: Iterable[Codec | str], block: int = kernels.BLOCK_DEFAULT) -> None:
    """Compile (or load from numba's disk cache) the kernels that encoding and decoding with these
    codecs run, serial and parallel drivers alike. A learner calls this before it joins: a kernel
    compiled on first use holds the GIL for seconds (tens on a cold cache), which starves the
    network thread until the syncer drops it as a reader that stopped reading."""
    for c in {parse_codec(c) for c in codecs} | {Codec.BF16}:
        for n in kernels.warmup_sizes(block):
            x = np.linspace(-1.0, 1.0, n, dtype=np.float32)
            parse(encode(x, c, block)).decode()
            encode_delta(x, x[::-1].copy(), None, c, block)
            encode_delta(x, x[::-1].copy(), feedback_init(n), c, block)


def _bytes_of(a: np.ndarray) -> memoryview:
    """A contiguous array's bytes, as a view (joined into the payload without a copy of its own)."""
    return memoryview(np.ascontiguousarray(a)).cast("B")


def _check_vector(x: np.ndarray) -> np.ndarray:
    if not isinstance(x, np.ndarray) or x.dtype != np.float32 or x.ndim != 1:
        raise CodecError(f"expected a 1-D float32 array, got {getattr(x, 'dtype', type(x))} {getattr(x, 'shape', '')}")
    if x.size > ELEMENTS_MAX:
        raise CodecError(f"{x.size} elements is above the limit of {ELEMENTS_MAX}")
    return np.ascontiguousarray(x)


def _check_block(codec: Codec, block: int, n: int) -> None:
    multiple = max(2, _CODES_PER_BYTE[codec])
    if block <= 0 or block % multiple or block > 1 << 20:
        raise CodecError(f"{codec.value} block must be a positive multiple of {multiple} up to 2^20, got {block}")
    if n % block:
        raise CodecError(f"{codec.value}: {n} elements is not a multiple of the block {block}")
