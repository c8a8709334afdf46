"""Frames of the syncer protocol: encode a message into frames, reassemble frames into messages.

Pure and synchronous (no sockets, no event loop): the websocket server and client send each frame
as one binary websocket message and feed every binary message they receive to a `Reassembler`.
The byte layout, the rules and the limits are written down in docs/protocol.md.

Public surface:

- `WireLimits`: the named limits of one side of a connection (frozen, validated);
  `max_msg_size` is the value to give aiohttp for them.
- `encode(message, *, message_id, limits) -> list[memoryview]`: the frames of one message, each a
  read-only view into one buffer that holds the payload copied exactly once.
- `Reassembler(limits, *, accepted=...)`: `feed(frame) -> Message | None`, a message when its last
  frame arrives. Frames of different messages may interleave (a control message between the chunks
  of a bulk one); chunks of one message arrive in order. Kinds outside `accepted` are refused
  before anything is allocated for them (`ALL_KINDS` by default; `LEARNER_KINDS` on the syncer,
  `SYNCER_KINDS` on a learner, both from `ddiloco.net.messages`). `lane_chunk(header, prefix)`
  and `lane_end(chunk)` take a frame whose header came alone and whose data came on the
  connection's lane (net.lane), written straight into the message's memory.
- `WireError(code, text, *, fatal)`: a `ValueError` carrying an `ErrorCode`; `to_message()` turns
  it into the `Error` to send back.
- `HEADER`, `HEADER_BYTES`, `LANE_PREFIX`, `LaneChunk`, `MAGIC`, `PROTOCOL_VERSION`, `SUPPORTED_VERSIONS`.

After a `WireError`: if `fatal` is false the error was confined to one single-frame message whose
header was intact; that message is dropped, the reassembler is unchanged and the connection may go
on. If `fatal` is true the byte stream can no longer be trusted (corruption, a broken chunk
sequence, a limit exceeded): the reassembler refuses every later frame and the connection must be
closed after sending the error.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from ddiloco.core.checksum import crc32
from ddiloco.errors import UserError
from ddiloco.net.messages import (
    BULK_KINDS,
    CLASS_OF_KIND,
    Error,
    ErrorCode,
    Kind,
    Message,
    message_from_meta,
    message_meta,
)

MAGIC = b"DDLC"
# 2: learner-driven pushes and the delta broadcast; 3: an update carries the syncer's global step
# (docs/protocol.md, "Version 2", "Version 3")
PROTOCOL_VERSION = 3
SUPPORTED_VERSIONS = (3,)  # versions this implementation decodes
# magic, version, kind, flags, message id, chunk index, chunk count, chunk offset,
# payload bytes, meta bytes, crc32; little-endian, no padding
HEADER = struct.Struct("<4sBBHQIIQQII")
HEADER_BYTES = HEADER.size  # 48
# what precedes each frame's data on a lane (net.lane): message id, chunk index, data bytes
LANE_PREFIX = struct.Struct("<QII")
CRC_OFFSET = HEADER_BYTES - 4  # the CRC is the header's last field and covers everything else
META_BYTES_MIN = 2  # "{}"
META_ALIGN_BYTES = 8  # the JSON meta is padded with spaces so a lone frame's payload is 8-aligned
U32_MAX = 2**32 - 1
U64_MAX = 2**64 - 1
I64_MAX = 2**63 - 1  # the body length a message may declare stays a signed 64-bit count
CONTROL_BYTES_MIN = 256  # any smaller and an Error with a short text would not fit
FRAME_BYTES_MIN = 128  # a header and a few bytes; tiny frames are for tests

# aiohttp's default max_msg_size is 4 MiB and a message of exactly that size is rejected, so the
# default frame stays one page below it.
FRAME_BYTES_MAX_DEFAULT = 4 * 2**20 - 4 * 2**10
MESSAGE_BYTES_MAX_DEFAULT = 2**30
CONTROL_BYTES_MAX_DEFAULT = 64 * 2**10
MESSAGES_IN_FLIGHT_MAX_DEFAULT = 2

ALL_KINDS = frozenset(Kind)


@dataclass(frozen=True)
class WireLimits:
    """Limits of one side of a connection, enforced when encoding and when reassembling.

    frame_bytes_max: one frame, header included (a websocket binary message).
    message_bytes_max: JSON meta plus payload of one bulk message.
    control_bytes_max: the JSON meta of any message, so all of a control message.
    messages_in_flight_max: partially reassembled multi-frame messages per connection, of any
    kind (a control message longer than one frame counts too).
    A reassembler therefore holds at most messages_in_flight_max * message_bytes_max bytes.
    """

    frame_bytes_max: int = FRAME_BYTES_MAX_DEFAULT
    message_bytes_max: int = MESSAGE_BYTES_MAX_DEFAULT
    control_bytes_max: int = CONTROL_BYTES_MAX_DEFAULT
    messages_in_flight_max: int = MESSAGES_IN_FLIGHT_MAX_DEFAULT

    def __post_init__(self) -> None:
        for name in ("frame_bytes_max", "message_bytes_max", "control_bytes_max", "messages_in_flight_max"):
            value = getattr(self, name)
            if type(value) is not int or value < 1:
                raise ValueError(f"WireLimits.{name} must be a positive int, got {value!r}")
        if self.control_bytes_max < CONTROL_BYTES_MIN or self.control_bytes_max > U32_MAX:
            raise ValueError(
                f"WireLimits.control_bytes_max must be in [{CONTROL_BYTES_MIN}, 2**32), got {self.control_bytes_max}"
            )
        if self.frame_bytes_max < FRAME_BYTES_MIN:
            raise ValueError(
                f"WireLimits.frame_bytes_max must be at least {FRAME_BYTES_MIN}, got {self.frame_bytes_max}"
            )
        if not self.control_bytes_max <= self.message_bytes_max <= I64_MAX:
            raise ValueError(
                f"WireLimits.message_bytes_max ({self.message_bytes_max}) must be at least"
                f" control_bytes_max ({self.control_bytes_max}) and below 2**63"
            )
        if -(-self.message_bytes_max // self.frame_data_bytes_max) > U32_MAX:
            raise ValueError("WireLimits: message_bytes_max / frame_bytes_max needs more than 2**32 chunks")

    @property
    def max_msg_size(self) -> int:
        """The value for aiohttp's `max_msg_size` on a connection with these limits: aiohttp
        rejects a message of exactly `max_msg_size` bytes, and a full frame has
        `frame_bytes_max`."""
        return self.frame_bytes_max + 1

    @property
    def frame_data_bytes_max(self) -> int:
        """Message bytes one frame carries after its header."""
        return self.frame_bytes_max - HEADER_BYTES


class WireError(UserError, ValueError):
    """Bad bytes on the wire (or a message too large to send), with the code to report."""

    def __init__(self, code: ErrorCode, text: str, *, fatal: bool = True) -> None:
        super().__init__(f"{code.name.lower()}: {text}")
        self.code = code
        self.text = text
        self.fatal = fatal

    def to_message(self) -> Error:
        """The `Error` message that tells the peer what was wrong."""
        return Error(code=self.code, text=self.text, fatal=self.fatal)


class _Header(NamedTuple):
    magic: bytes
    version: int
    kind: int
    flags: int
    message_id: int
    chunk_index: int
    chunk_count: int
    chunk_offset: int
    payload_bytes: int
    meta_bytes: int
    crc: int

    @property
    def body_bytes(self) -> int:
        return self.meta_bytes + self.payload_bytes


def encode(message: Message, *, message_id: int, limits: WireLimits) -> list[memoryview]:
    """The frames of `message`, to be sent in order, each as one binary websocket message.

    `message_id` must be unique among this connection's messages in flight (a counter per
    connection and direction does it). The payload is copied once, into the frames' buffer.
    Raises `WireError(OVERSIZED)` if the message exceeds `limits`.
    """
    if type(message_id) is not int or not 0 <= message_id <= U64_MAX:
        raise ValueError(f"message_id must be an int in [0, 2**64), got {message_id!r}")
    meta = _padded(message_meta(message))
    payload = message.payload if message.KIND in BULK_KINDS else memoryview(b"")
    _check_sizes(message.KIND, len(meta), len(payload), limits)
    body_bytes = len(meta) + len(payload)
    capacity = limits.frame_data_bytes_max
    chunk_count = -(-body_bytes // capacity)
    # np.empty: every byte is written below, so no zero fill is needed
    buffer = memoryview(np.empty(chunk_count * HEADER_BYTES + body_bytes, dtype=np.uint8))
    frames = []
    start = 0
    for index in range(chunk_count):
        offset = index * capacity
        data_bytes = min(capacity, body_bytes - offset)
        frame = buffer[start : start + HEADER_BYTES + data_bytes]
        _fill_data(frame[HEADER_BYTES:], meta, payload, offset)
        header = _Header(
            MAGIC, PROTOCOL_VERSION, message.KIND, 0, message_id, index, chunk_count, offset, len(payload), len(meta), 0
        )
        HEADER.pack_into(frame, 0, *header)
        struct.pack_into("<I", frame, CRC_OFFSET, _frame_crc(frame))
        frames.append(frame.toreadonly())
        start += len(frame)
    return frames


def _padded(meta: bytes) -> bytes:
    # trailing spaces are JSON whitespace: decoders ignore them
    return meta + b" " * (-len(meta) % META_ALIGN_BYTES)


def _fill_data(data: memoryview, meta: bytes, payload: memoryview, offset: int) -> None:
    """Copy body bytes [offset, offset + len(data)) of meta || payload into `data`."""
    written = 0
    if offset < len(meta):
        piece = meta[offset : offset + len(data)]
        data[: len(piece)] = piece
        written = len(piece)
    if written < len(data):
        start = offset + written - len(meta)  # >= 0: the meta is behind us
        data[written:] = payload[start : start + len(data) - written]


def _frame_crc(frame: memoryview | bytes) -> int:
    return _crc(frame[:HEADER_BYTES], (frame[HEADER_BYTES:],))


def _crc(header: memoryview | bytes, data: tuple[memoryview | bytes, ...]) -> int:
    """A frame's CRC: its header but the CRC field, then its data, which may lie in pieces."""
    crc = crc32(header[:CRC_OFFSET])
    for piece in data:
        crc = crc32(piece, crc)
    return crc


def _check_sizes(kind: Kind, meta_bytes: int, payload_bytes: int, limits: WireLimits) -> None:
    """Raise `WireError` if a message of these sizes is impossible (BAD_FRAME) or breaks
    `limits` (OVERSIZED). Both sides call it: the sender before writing, the receiver before
    allocating."""
    if kind not in BULK_KINDS and payload_bytes != 0:
        raise WireError(
            ErrorCode.BAD_FRAME,
            f"{kind.name.lower()} is a control kind and carries no payload, header declares {payload_bytes} bytes",
        )
    if meta_bytes < META_BYTES_MIN:
        raise WireError(ErrorCode.BAD_FRAME, f"meta of {meta_bytes} bytes cannot hold a JSON object")
    if meta_bytes > limits.control_bytes_max:
        raise WireError(
            ErrorCode.OVERSIZED,
            f"{kind.name.lower()} meta of {meta_bytes} bytes exceeds control_bytes_max {limits.control_bytes_max}",
        )
    if meta_bytes + payload_bytes > limits.message_bytes_max:
        raise WireError(
            ErrorCode.OVERSIZED,
            f"{kind.name.lower()} of {meta_bytes + payload_bytes}"
            f" bytes exceeds message_bytes_max {limits.message_bytes_max}",
        )


@dataclass(frozen=True)
class LaneChunk:
    """A frame whose data comes on the lane (`Reassembler.lane_chunk`): fill `views` in order with
    its `data_bytes` bytes, then hand it to `Reassembler.lane_end`."""

    fields: _Header
    header: bytes  # the 48 bytes as they came: the CRC covers them
    views: tuple[memoryview, ...]
    data_bytes: int


@dataclass
class _Partial:
    """A multi-frame message whose first frame has arrived."""

    first: _Header
    kind: Kind
    meta: bytearray  # (meta_bytes,) the JSON, decoded once its last byte is in
    payload: np.ndarray  # (payload_bytes,) uint8, the message's payload memory
    message: Message | None  # built as soon as the meta is complete
    next_index: int
    received_bytes: int  # body bytes (meta included) received so far

    def take(self, data: memoryview) -> None:
        """Store the next `len(data)` body bytes; decode the meta when it becomes complete."""
        at = 0
        for view in self.views(len(data)):
            view[:] = data[at : at + len(view)]
            at += len(view)
        self.settle(len(data))

    def views(self, data_bytes: int) -> list[memoryview]:
        """Where the next `data_bytes` body bytes go, in order: the rest of the meta, then the
        payload (writable views into this message's own memory)."""
        meta_bytes = len(self.meta)
        at = self.received_bytes
        views = []
        if at < meta_bytes:
            piece = min(data_bytes, meta_bytes - at)
            views.append(memoryview(self.meta)[at : at + piece])
            data_bytes -= piece
            at += piece
        if data_bytes:
            start = at - meta_bytes
            views.append(memoryview(self.payload)[start : start + data_bytes])
        return views

    def settle(self, data_bytes: int) -> None:
        """The next `data_bytes` body bytes are in place: count them, and decode the meta when
        they complete it."""
        meta_bytes = len(self.meta)
        before = self.received_bytes
        self.received_bytes = before + data_bytes
        if before < meta_bytes <= self.received_bytes:
            view = memoryview(self.payload).toreadonly()
            self.message = _decode(self.kind, memoryview(self.meta), view)


class Reassembler:
    """Turns the frames received on one connection back into messages.

    Memory: at most `limits.messages_in_flight_max` partial messages, each holding its declared
    meta and payload (checked against the limits before allocating). A single-frame message's
    payload is a view into the frame it came in: do not reuse that frame's buffer.
    """

    def __init__(self, limits: WireLimits, *, accepted: frozenset[Kind] = ALL_KINDS) -> None:
        self._limits = limits
        self._accepted = accepted
        self._partials: dict[int, _Partial] = {}
        self._broken: WireError | None = None

    @property
    def messages_in_flight(self) -> int:
        """Multi-frame messages started and not yet complete."""
        return len(self._partials)

    @property
    def bytes_in_flight(self) -> int:
        """Meta and payload bytes reserved by the messages in flight."""
        return sum(len(p.meta) + p.payload.nbytes for p in self._partials.values())

    def feed(self, frame: bytes | bytearray | memoryview) -> Message | None:
        """Take one frame; return the message it completes, else None. Raises `WireError`."""
        self._check_usable()
        try:
            view = memoryview(frame).cast("B")
            header = self._header(view)
            if header.chunk_count == 1:
                return self._whole(header, view)
            return self._chunk(header, view[HEADER_BYTES:])
        except WireError as error:
            if error.fatal:
                self._fail(error)
            raise

    def _header(self, view: memoryview) -> _Header:
        """Unpack and check the parts of the header that need no per-message state."""
        if len(view) < HEADER_BYTES:
            raise WireError(
                ErrorCode.BAD_FRAME, f"frame of {len(view)} bytes is shorter than the {HEADER_BYTES}-byte header"
            )
        if len(view) > self._limits.frame_bytes_max:
            raise WireError(
                ErrorCode.OVERSIZED,
                f"frame of {len(view)} bytes exceeds frame_bytes_max {self._limits.frame_bytes_max}",
            )
        if len(view) == HEADER_BYTES:  # every frame carries data: a header alone is a lane's (net.lane)
            raise WireError(
                ErrorCode.BAD_FRAME,
                "a frame of its header alone, whose data would come on a lane, and this connection has none",
            )
        header = _unpack(view)
        if _frame_crc(view) != header.crc:
            raise WireError(
                ErrorCode.CHECKSUM,
                f"crc32 mismatch in a frame of {len(view)} bytes"
                f" (message {header.message_id}, chunk {header.chunk_index})",
            )
        # from here on the header is intact: the fields are what the peer sent
        self._check_fields(header)
        return header

    @staticmethod
    def _check_fields(header: _Header) -> None:
        if header.flags != 0:
            raise WireError(ErrorCode.BAD_FRAME, f"flags {header.flags:#x} set; version 1 has none")
        if not header.chunk_index < header.chunk_count:
            raise WireError(
                ErrorCode.BAD_FRAME, f"chunk index {header.chunk_index} not below chunk count {header.chunk_count}"
            )

    def _whole(self, header: _Header, view: memoryview) -> Message:
        """A message in one frame: every error is confined to it."""
        try:
            self._check_span(header, len(view) - HEADER_BYTES)
            kind = self._kind(header)
            _check_sizes(kind, header.meta_bytes, header.payload_bytes, self._limits)
            if header.message_id in self._partials:
                raise WireError(ErrorCode.BAD_FRAME, f"message id {header.message_id} is already in flight")
            if len(view) - HEADER_BYTES != header.body_bytes:
                raise WireError(
                    ErrorCode.BAD_FRAME,
                    f"frame carries {len(view) - HEADER_BYTES} body bytes, header declares {header.body_bytes}",
                )
            meta_end = HEADER_BYTES + header.meta_bytes
            return _decode(kind, view[HEADER_BYTES:meta_end], view[meta_end:].toreadonly())
        except WireError as error:
            error.fatal = False
            raise

    def _chunk(self, header: _Header, data: memoryview) -> Message | None:
        """One frame of a multi-frame message."""
        self._check_span(header, len(data))
        partial = self._start(header) if header.chunk_index == 0 else self._continued(header)
        partial.take(data)
        return self._advance(partial, header)

    def _advance(self, partial: _Partial, header: _Header) -> Message | None:
        """A chunk of `partial` is in: the message, if that was its last chunk."""
        partial.next_index += 1
        if partial.next_index < header.chunk_count:
            return None
        del self._partials[header.message_id]
        if partial.received_bytes != header.body_bytes:
            raise WireError(
                ErrorCode.BAD_FRAME,
                f"message {header.message_id} ended after"
                f" {partial.received_bytes} bytes, header declares {header.body_bytes}",
            )
        assert partial.message is not None  # the meta is complete once every body byte is in
        return partial.message

    def lane_chunk(self, header: bytes | memoryview, prefix: bytes | memoryview) -> LaneChunk:
        """A frame whose 48-byte header came alone and whose data follows on the connection's lane
        behind `prefix` (`LANE_PREFIX`: message id, chunk index, data bytes; net.lane). Checked as
        `feed` checks a frame, but for the CRC, which covers the data (`lane_end` checks it); the
        answer says where the data goes, straight into the message's memory. Raises `WireError`,
        always fatal: a lane whose bytes do not match the headers is out of step for good."""
        self._check_usable()
        try:
            view = memoryview(header).cast("B")
            if len(view) != HEADER_BYTES:
                raise WireError(ErrorCode.BAD_FRAME, f"a lane frame's header is {len(view)} bytes, not {HEADER_BYTES}")
            fields = _unpack(view)
            self._check_fields(fields)
            message_id, chunk_index, data_bytes = LANE_PREFIX.unpack(prefix)
            if (message_id, chunk_index) != (fields.message_id, fields.chunk_index):
                raise WireError(
                    ErrorCode.BAD_FRAME,
                    f"the lane carries message {message_id} chunk {chunk_index}, the header announced"
                    f" message {fields.message_id} chunk {fields.chunk_index}",
                )
            if HEADER_BYTES + data_bytes > self._limits.frame_bytes_max:
                raise WireError(
                    ErrorCode.OVERSIZED,
                    f"lane frame of {HEADER_BYTES + data_bytes} bytes exceeds frame_bytes_max"
                    f" {self._limits.frame_bytes_max}",
                )
            self._check_span(fields, data_bytes)
            partial = self._start(fields) if fields.chunk_index == 0 else self._continued(fields)
            return LaneChunk(fields, bytes(view), tuple(partial.views(data_bytes)), data_bytes)
        except WireError as error:
            self._fail(error)
            raise

    def lane_end(self, chunk: LaneChunk) -> Message | None:
        """`chunk`'s data is in place: check its CRC; the message, if that was its last chunk.
        Raises `WireError`, always fatal."""
        self._check_usable()
        try:
            fields = chunk.fields
            if _crc(chunk.header, chunk.views) != fields.crc:
                raise WireError(
                    ErrorCode.CHECKSUM,
                    f"crc32 mismatch in a lane frame of {HEADER_BYTES + chunk.data_bytes} bytes"
                    f" (message {fields.message_id}, chunk {fields.chunk_index})",
                )
            partial = self._partials[fields.message_id]
            partial.settle(chunk.data_bytes)
            return self._advance(partial, fields)
        except WireError as error:
            self._fail(error)
            raise

    def _check_usable(self) -> None:
        if self._broken is not None:
            raise WireError(self._broken.code, f"connection unusable after an earlier error: {self._broken.text}")

    def _fail(self, error: WireError) -> None:
        error.fatal = True
        self._broken = error
        self._partials.clear()  # release the buffers now, not when the connection goes

    def _continued(self, header: _Header) -> _Partial:
        partial = self._partials.get(header.message_id)
        if partial is None:
            raise WireError(
                ErrorCode.BAD_FRAME,
                f"chunk {header.chunk_index} of message {header.message_id}, which is not in flight",
            )
        self._check_continues(partial, header)
        return partial

    def _start(self, header: _Header) -> _Partial:
        """The first frame of a multi-frame message: check the declarations, then allocate."""
        kind = self._kind(header)
        _check_sizes(kind, header.meta_bytes, header.payload_bytes, self._limits)
        if header.message_id in self._partials:
            raise WireError(ErrorCode.BAD_FRAME, f"message id {header.message_id} is already in flight")
        if len(self._partials) >= self._limits.messages_in_flight_max:
            raise WireError(
                ErrorCode.OVERLOADED,
                f"more than messages_in_flight_max {self._limits.messages_in_flight_max} messages in flight",
            )
        if header.chunk_offset != 0:
            raise WireError(ErrorCode.BAD_FRAME, f"first chunk at offset {header.chunk_offset}, not 0")
        # np.empty reserves address space only; pages are committed as chunks are written
        partial = _Partial(
            header, kind, bytearray(header.meta_bytes), np.empty(header.payload_bytes, dtype=np.uint8), None, 0, 0
        )
        self._partials[header.message_id] = partial
        return partial

    def _kind(self, header: _Header) -> Kind:
        if header.kind not in CLASS_OF_KIND:
            raise WireError(
                ErrorCode.UNKNOWN_KIND, f"kind {header.kind} is not a kind of protocol version {header.version}"
            )
        kind = Kind(header.kind)
        if kind not in self._accepted:
            raise WireError(ErrorCode.UNEXPECTED_KIND, f"{kind.name.lower()} is not accepted here")
        return kind

    def _check_span(self, header: _Header, data_bytes: int) -> None:
        """The frame's data must be non-empty and lie inside the declared body."""
        if data_bytes == 0:
            raise WireError(ErrorCode.BAD_FRAME, "frame carries no message bytes")
        if header.chunk_offset + data_bytes > header.body_bytes:
            raise WireError(
                ErrorCode.BAD_FRAME,
                f"chunk at offset {header.chunk_offset} with"
                f" {data_bytes} bytes overruns the {header.body_bytes}-byte message",
            )

    def _check_continues(self, partial: _Partial, header: _Header) -> None:
        """A later chunk must repeat the first chunk's declarations and come next in order."""
        first = partial.first
        same = (header.kind, header.chunk_count, header.payload_bytes, header.meta_bytes) == (
            first.kind,
            first.chunk_count,
            first.payload_bytes,
            first.meta_bytes,
        )
        if not same:
            raise WireError(
                ErrorCode.BAD_FRAME,
                f"chunk {header.chunk_index} of message {header.message_id} disagrees with its first chunk's header",
            )
        if header.chunk_index != partial.next_index:
            raise WireError(
                ErrorCode.BAD_FRAME,
                f"message {header.message_id}: chunk {header.chunk_index} arrived, expected chunk {partial.next_index}",
            )
        if header.chunk_offset != partial.received_bytes:
            raise WireError(
                ErrorCode.BAD_FRAME,
                f"message {header.message_id}: chunk offset {header.chunk_offset}, expected {partial.received_bytes}",
            )


def _unpack(view: memoryview) -> _Header:
    """The header's fields, once its magic and version are ours."""
    header = _Header._make(HEADER.unpack_from(view))
    if header.magic != MAGIC:
        raise WireError(ErrorCode.BAD_FRAME, f"bad magic {header.magic!r}, expected {MAGIC!r}")
    if header.version not in SUPPORTED_VERSIONS:
        raise WireError(
            ErrorCode.PROTOCOL_VERSION,
            f"protocol version {header.version} is not understood; this peer understands {list(SUPPORTED_VERSIONS)}",
        )
    return header


def _decode(kind: Kind, meta: memoryview, payload: memoryview) -> Message:
    try:
        return message_from_meta(kind, meta, payload)
    except ValueError as exc:  # orjson.JSONDecodeError included
        raise WireError(ErrorCode.BAD_MESSAGE, str(exc)) from exc
