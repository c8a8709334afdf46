"""The messages of the syncer protocol: one frozen, validated dataclass per kind.

A message is its typed fields plus, for the three bulk kinds, a binary payload. This module knows
nothing of frames: `ddiloco.net.wire` cuts messages into frames and puts them back together.

Public surface:

- `Kind`: the message kinds and their numbers on the wire.
- `ErrorCode`: the numeric codes an `Error` message (and a `WireError`) carries.
- `CodecName`: the codec of a bulk payload (`fp32`, `bf16`, `int4`, `int2`, `int1`).
- `Hello`, `Welcome`, `Progress`, `Push`, `Init`, `Update`, `Error`, `Bye` and their
  union `Message`; `BULK_KINDS`, `LEARNER_KINDS`, `SYNCER_KINDS`.
- `message_meta(message) -> bytes`: the message's fields as canonical JSON (keys sorted).
- `message_from_meta(kind, meta, payload) -> Message`: the inverse; raises `ValueError` naming the
  field that is missing, unknown or wrongly typed.

Every field is checked when a message is built, whether by the sender or by the decoder, so a
message that exists is a valid one. Integers are non-negative and at most `INT_MAX` (2**53 - 1);
lists of integers are tuples; a vector clock is a `dict[str, int]` of at most `vclock.ENTRIES_MAX`
entries, keyed by names (`NAME_RE`). A payload is any C-contiguous buffer (bytes, a
numpy array ...) and is kept as a read-only byte `memoryview` over it, without copying: do not
change the buffer until the message has been encoded.
"""

from __future__ import annotations

import enum
import functools
import re
import types
import typing
from collections.abc import Callable
from dataclasses import MISSING, dataclass, field, fields
from typing import ClassVar

import orjson

from ddiloco.core import vclock
from ddiloco.core.codec import Codec

# The largest integer any field may hold. Every JSON reader holds it exactly (a float64 has 53 bits
# of mantissa), and it is far below 2**63, so nothing a receiver computes from a counter (a tick of a
# clock, a sum of a few counters) can overflow an int64. It is the clocks' own limit.
INT_MAX = vclock.COUNTER_MAX
# A learner's name and a vector clock's process names: printable ASCII (they go into logs, the
# status page and the tape as they are), 1 to vclock.NAME_CHARS_MAX characters.
NAME_RE = re.compile(rf"[\x20-\x7e]{{1,{vclock.NAME_CHARS_MAX}}}")
DIGEST_RE = re.compile(r"[0-9a-f]{8,128}")  # a layout digest: lowercase hex, 4 to 64 bytes
SHOWN_CHARS_MAX = 60  # how much of a bad value an error text quotes
PEER_URL_CHARS_MAX = 512


class Kind(enum.IntEnum):
    """Message kinds; the number is the `kind` byte of every frame header."""

    HELLO = 1
    WELCOME = 2
    PROGRESS = 3
    # 4 was Request (protocol 1: the syncer asked for a push); retired in protocol 2, where learners
    # push on their own schedule: a frame of kind 4 is an unknown kind. The number is not reused.
    PUSH = 5
    INIT = 6
    UPDATE = 7
    ERROR = 8
    BYE = 9
    MARKER = 10  # Chandy-Lamport snapshot marker (net.snapshot)
    LOCAL_STATE = 11  # a learner's local state recorded on a marker


class ErrorCode(enum.IntEnum):
    """Why a peer rejected something. Values are stable across protocol versions."""

    BAD_FRAME = 1  # frame header or chunk sequence is malformed
    CHECKSUM = 2  # a frame's CRC32 does not match its bytes
    OVERSIZED = 3  # a frame or message exceeds a limit
    UNKNOWN_KIND = 4  # the kind byte names no kind of this protocol version
    PROTOCOL_VERSION = 5  # the header's protocol version is not understood
    BAD_MESSAGE = 6  # the JSON body does not match the kind's schema
    UNEXPECTED_KIND = 7  # a valid kind this side never accepts, or not in this state
    BAD_LAYOUT = 8  # the layout digest differs from the syncer's
    BAD_SHAPE = 9  # fragment index, element count or payload size does not match the layout
    NON_FINITE = 10  # a payload holds NaN or Inf
    STALE = 11  # a push was computed from a base version that is no longer current
    DUPLICATE = 12  # a second push for the same fragment and round
    UNAUTHORIZED = 13  # missing or wrong token
    OVERLOADED = 14  # too many messages in flight or a full queue
    INTERNAL = 15  # a bug on the side that sends this code
    SHUTTING_DOWN = 16  # the syncer is stopping; reconnect later
    LATE = 17  # a push for a round that closed before it arrived (its tokens are booked as late)


# The wire names codecs exactly as the codecs themselves do: one enum for both.
CodecName = Codec


UPDATE_CODECS = frozenset({CodecName.FP32, CodecName.BF16, CodecName.INT4})  # what a broadcast may use


class _Body:
    """Shared validation: every field is normalised and checked against its annotation, then
    the kind's own rules run (`_check`)."""

    KIND: ClassVar[Kind]

    def __post_init__(self) -> None:
        for name, where, normalise in _field_plan(type(self)):
            object.__setattr__(self, name, normalise(where, getattr(self, name)))
        self._check()

    def _check(self) -> None:
        """Rules that tie fields together; a kind overrides this when it has any."""


@dataclass(frozen=True)
class Hello(_Body):
    """Learner -> syncer, first message of a session. A learner that held parameters before
    names its previous learner id and the version of each fragment it holds. `tensors_json`
    describes the learner's parameter tensors (the syncer's own format, parsed and limited
    there), so a syncer that holds no state can build its layout from the first learner."""

    KIND: ClassVar[Kind] = Kind.HELLO
    name: str
    layout_digest: str
    shard: int
    resume_learner_id: int | None
    held_versions: tuple[int, ...]
    clock: dict[str, int]
    tensors_json: str
    # Optional (omitted from the body when empty): where this learner serves its state to peers.
    peer_url: str = ""

    def _check(self) -> None:
        _check_name("Hello.name", self.name)
        _require(len(self.peer_url) <= PEER_URL_CHARS_MAX, f"Hello.peer_url is above {PEER_URL_CHARS_MAX} characters")
        _require(
            self.peer_url == "" or self.peer_url.startswith(("http://", "https://")),
            f"Hello.peer_url must be an http(s) URL, got {_show(self.peer_url)}",
        )
        _check_digest("Hello.layout_digest", self.layout_digest)


@dataclass(frozen=True)
class Welcome(_Body):
    """Syncer -> learner, the answer to `Hello`: who the learner is and the plan it follows.
    Fragment p is synchronised at global step t when t mod sync_every_steps == fragment_offsets[p].
    `layout_json` is the syncer's fragment layout (its own format, whose digest is
    `layout_digest`)."""

    KIND: ClassVar[Kind] = Kind.WELCOME
    learner_id: int
    layout_digest: str
    fragment_count: int
    versions: tuple[int, ...]
    sync_every_steps: int
    fragment_offsets: tuple[int, ...]
    global_step: int
    codec: CodecName
    codec_block: int
    clock: dict[str, int]
    needs_init: bool
    layout_json: str
    # Optional (omitted from the body when empty): JSON list of [learner id, peer url, versions] of
    # the live learners that serve their state, for a (re)joining learner to copy from.
    peers_json: str = ""
    # Optional (omitted at 0 of 1): a sharded syncer's shard index and shard count (core.shards).
    shard: int = 0
    shards: int = 1

    def _check(self) -> None:
        _check_digest("Welcome.layout_digest", self.layout_digest)
        _require(
            1 <= self.shards <= self.fragment_count and self.shard < self.shards,
            f"Welcome.shard {self.shard} of {self.shards} shards does not fit {self.fragment_count} fragments",
        )
        _require(self.fragment_count >= 1, "Welcome.fragment_count must be at least 1")
        _require(self.sync_every_steps >= 1, "Welcome.sync_every_steps must be at least 1")
        _require(self.codec_block >= 1, "Welcome.codec_block must be at least 1")
        for name in ("versions", "fragment_offsets"):
            _require(
                len(getattr(self, name)) == self.fragment_count,
                f"Welcome.{name} has {len(getattr(self, name))} entries for fragment_count {self.fragment_count}",
            )
        late = [o for o in self.fragment_offsets if o >= self.sync_every_steps]
        _require(
            not late,
            f"Welcome.fragment_offsets {late[:4]} are not below sync_every_steps {self.sync_every_steps}",
        )


@dataclass(frozen=True)
class Progress(_Body):
    """Learner -> syncer: the local step and, per fragment, the version the learner holds and
    the steps and tokens since it last received that fragment."""

    KIND: ClassVar[Kind] = Kind.PROGRESS
    step: int
    held_versions: tuple[int, ...]
    fragment_steps: tuple[int, ...]
    fragment_tokens: tuple[int, ...]
    clock: dict[str, int]
    # Per fragment, of the tokens counted since it received that version, those trained under the
    # version before and carried over it (docs/protocol.md "Progress carried over a merge"). Empty:
    # none carried.
    fragment_carried: tuple[int, ...] = ()

    def _check(self) -> None:
        _require(
            not self.fragment_carried or len(self.fragment_carried) == len(self.held_versions),
            f"Progress.fragment_carried has {len(self.fragment_carried)} entries but held_versions"
            f" has {len(self.held_versions)}",
        )
        _require(
            all(0 <= c <= t for c, t in zip(self.fragment_carried, self.fragment_tokens)),
            "Progress.fragment_carried must lie in [0, fragment_tokens]",
        )
        for name in ("fragment_steps", "fragment_tokens"):
            _require(
                len(getattr(self, name)) == len(self.held_versions),
                f"Progress.{name} has {len(getattr(self, name))} entries but held_versions"
                f" has {len(self.held_versions)}",
            )


@dataclass(frozen=True)
class Push(_Body):
    """Learner -> syncer, bulk: the compressed outer gradient of one fragment, base_version - theta,
    computed at the learner's `step` (one with step mod sync_every_steps == fragment_offsets[fragment]);
    `steps` and `tokens` count its training since it received `base_version`. The syncer decides
    which round the push joins (protocol 2)."""

    KIND: ClassVar[Kind] = Kind.PUSH
    fragment: int
    step: int
    base_version: int
    steps: int
    tokens: int
    codec: CodecName
    block: int
    element_count: int
    clock: dict[str, int]
    payload: memoryview = field(repr=False)  # bulk bytes; repr would print an address

    def _check(self) -> None:
        _require(self.block >= 1, "Push.block must be at least 1")
        _check_dense_payload("Push", self.codec, self.element_count, self.payload)


@dataclass(frozen=True)
class Init(_Body):
    """Learner -> syncer, bulk: initial fp32 (little-endian) parameters of one fragment, sent
    when the syncer holds no state."""

    KIND: ClassVar[Kind] = Kind.INIT
    fragment: int
    element_count: int
    clock: dict[str, int]
    payload: memoryview = field(repr=False)  # bulk bytes; repr would print an address

    def _check(self) -> None:
        _check_dense_payload("Init", CodecName.FP32, self.element_count, self.payload)


@dataclass(frozen=True)
class Update(_Body):
    """Syncer -> learner, bulk: a new version of one fragment (broadcast). Whole (fp32 or bf16 values,
    `base_version` and `block` left out), or the delta onto the published copy of `base_version`
    (docs/protocol.md, "Delta broadcast"): int4 in blocks of `block`, or bf16 / fp32 values."""

    KIND: ClassVar[Kind] = Kind.UPDATE
    fragment: int
    version: int
    codec: CodecName
    element_count: int
    clock: dict[str, int]
    payload: memoryview = field(repr=False)  # bulk bytes; repr would print an address
    # Optional (protocol 2; omitted for a whole fragment): the version the delta applies onto, and the
    # values per scale of a block codec.
    base_version: int | None = None
    block: int = 0
    # Optional (protocol 3; omitted at 0): the syncer's global step when it sent the update. A learner
    # behind it moves its push schedule up to it (docs/protocol.md, "Version 3").
    global_step: int = 0

    def _check(self) -> None:
        _require(
            self.codec in UPDATE_CODECS,
            f"Update.codec must be one of {sorted(UPDATE_CODECS)}, got {self.codec.value!r}",
        )
        if self.base_version is not None:
            _require(
                self.base_version < self.version,
                f"Update.base_version {self.base_version} must be below version {self.version}",
            )
        if self.codec.is_block:
            _require(self.base_version is not None, f"a whole Update cannot be {self.codec.value}")
            _require(
                self.block >= 2 and self.block % 2 == 0 and self.element_count % self.block == 0,
                f"Update.block {self.block} must be even and divide element_count {self.element_count}",
            )
            want = self.codec.body_bytes(self.element_count, self.block)
            _require(
                len(self.payload) == want,
                f"Update payload has {len(self.payload)} bytes; {self.codec.value} x {self.element_count}"
                f" elements in blocks of {self.block} needs {want}",
            )
        else:
            _require(self.block == 0, f"Update.block must be 0 for {self.codec.value}, got {self.block}")
            _check_dense_payload("Update", self.codec, self.element_count, self.payload)


@dataclass(frozen=True)
class Error(_Body):
    """Either direction: something was rejected. A fatal error is followed by closing."""

    KIND: ClassVar[Kind] = Kind.ERROR
    code: ErrorCode
    text: str
    fatal: bool


@dataclass(frozen=True)
class Bye(_Body):
    """Either direction: a clean goodbye before closing."""

    KIND: ClassVar[Kind] = Kind.BYE
    reason: str


@dataclass(frozen=True)
class Marker(_Body):
    """Syncer -> learner: a consistent snapshot `snapshot` has started (net.snapshot). The learner
    records its local state at its next step boundary and sends it back as `LocalState`."""

    KIND: ClassVar[Kind] = Kind.MARKER
    snapshot: int
    clock: dict[str, int]


@dataclass(frozen=True)
class LocalState(_Body):
    """Learner -> syncer, bulk: the learner's state recorded on the marker of `snapshot`, after
    every push it sent before (so it also closes the learner -> syncer channel of the snapshot)."""

    KIND: ClassVar[Kind] = Kind.LOCAL_STATE
    snapshot: int
    sha256: str
    clock: dict[str, int]
    payload: memoryview = field(repr=False)

    def _check(self) -> None:
        _require(
            re.fullmatch(r"[0-9a-f]{64}", self.sha256) is not None, "LocalState.sha256 must be 64 lowercase hex digits"
        )


Message = Hello | Welcome | Progress | Push | Init | Update | Error | Bye | Marker | LocalState

CLASS_OF_KIND: dict[Kind, type[Message]] = {
    cls.KIND: cls for cls in (Hello, Welcome, Progress, Push, Init, Update, Error, Bye, Marker, LocalState)
}
BULK_KINDS = frozenset({Kind.PUSH, Kind.INIT, Kind.UPDATE, Kind.LOCAL_STATE})
LEARNER_KINDS = frozenset({Kind.HELLO, Kind.PROGRESS, Kind.PUSH, Kind.INIT, Kind.ERROR, Kind.BYE, Kind.LOCAL_STATE})
SYNCER_KINDS = frozenset({Kind.WELCOME, Kind.UPDATE, Kind.ERROR, Kind.BYE, Kind.MARKER})


def message_meta(message: Message) -> bytes:
    """The message's fields except the payload, as JSON with sorted keys (canonical bytes)."""
    optional = _optional_defaults(type(message))
    body = {
        name: getattr(message, name)
        for name in _meta_names(type(message))
        if name not in optional or getattr(message, name) != optional[name]
    }  # an optional field at its default is left out, so older peers read the message unchanged
    return orjson.dumps(body, option=orjson.OPT_SORT_KEYS)


def message_from_meta(kind: Kind, meta: bytes | memoryview, payload: memoryview) -> Message:
    """Build the message of `kind` from its JSON fields and payload; `ValueError` if the JSON
    is not an object with exactly the kind's fields, correctly typed and consistent."""
    cls = CLASS_OF_KIND[kind]
    obj = orjson.loads(meta)  # JSONDecodeError is a ValueError
    if type(obj) is not dict:
        raise ValueError(f"{cls.__name__} body must be a JSON object, got {_show(obj)}")
    expected = _meta_names(cls)
    missing = sorted(set(expected) - obj.keys() - _optional_defaults(cls).keys())
    unknown = sorted(obj.keys() - set(expected))
    if missing or unknown:
        raise ValueError(
            f"{cls.__name__} body: missing fields {missing[:8]}, unknown fields {[_show(k) for k in unknown[:8]]}"
        )
    if "payload" in _field_hints(cls):
        obj["payload"] = payload
    elif len(payload) != 0:
        raise ValueError(f"{cls.__name__} carries no payload, got {len(payload)} bytes")
    return cls(**obj)


@functools.cache
def _field_hints(cls: type) -> dict[str, object]:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in fields(cls)}


@functools.cache
def _optional_defaults(cls: type) -> dict[str, object]:
    """Fields added after the first protocol version: they have a default and may be absent."""
    return {f.name: f.default for f in fields(cls) if f.default is not MISSING}


@functools.cache
def _meta_names(cls: type) -> tuple[str, ...]:
    return tuple(name for name in _field_hints(cls) if name != "payload")


@functools.cache
def _field_plan(cls: type) -> tuple[tuple[str, str, Callable[[str, object], object]], ...]:
    """(field, its name in error texts, its normaliser) for every field of `cls`: worked out once
    per kind, since every message sent or received runs it (and error texts are built only on
    failure for the same reason)."""
    return tuple((name, f"{cls.__name__}.{name}", _normaliser(name, hint)) for name, hint in _field_hints(cls).items())


def _normaliser(name: str, hint: object) -> Callable[[str, object], object]:
    """The function that checks a value against the annotation `hint` and returns it in its
    canonical form (tuple for a list, enum member for its value, byte memoryview for a buffer)."""
    if hint is int:
        return _check_int
    if hint is bool:
        return _check_bool
    if hint is str:
        return _check_str
    if hint is memoryview:
        return _byte_view
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        return functools.partial(_enum_member, enum_type=hint)
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is types.UnionType and args == (int, type(None)):
        return _check_optional_int
    if origin is tuple and args == (int, Ellipsis):
        return _check_int_tuple
    if origin is dict and args == (str, int):
        return _clock
    raise AssertionError(f"{name}: no rule for annotation {hint!r}")


def _check_bool(where: str, value: object) -> bool:
    if type(value) is not bool:
        raise ValueError(f"{where} must be a bool, got {_show(value)}")
    return value


def _check_str(where: str, value: object) -> str:
    if type(value) is not str:
        raise ValueError(f"{where} must be a str, got {_show(value)}")
    return value


def _check_optional_int(where: str, value: object) -> int | None:
    return None if value is None else _check_int(where, value)


def _check_int_tuple(where: str, value: object) -> tuple[int, ...]:
    if type(value) not in (list, tuple):
        raise ValueError(f"{where} must be a list of ints, got {_show(value)}")
    for i, item in enumerate(value):
        if type(item) is not int or not 0 <= item <= INT_MAX:
            _check_int(f"{where}[{i}]", item)  # raises, naming the entry
    return tuple(value)


def _check_int(where: str, value: object) -> int:
    # bool and IntEnum are ints to Python but not on this wire
    if type(value) is not int or not 0 <= value <= INT_MAX:
        raise ValueError(f"{where} must be an int in [0, 2**53), got {_show(value)}")
    return value


def _clock(where: str, value: object) -> dict[str, int]:
    if type(value) is not dict:
        raise ValueError(f"{where} must be an object of str to int, got {_show(value)}")
    if len(value) > vclock.ENTRIES_MAX:
        raise ValueError(f"{where} has {len(value)} entries, above the limit of {vclock.ENTRIES_MAX}")
    for key in value:
        _check_name(f"{where} key", key)
        _check_int(f"{where}[{key!r}]", value[key])
    return dict(value)  # a copy: the sender's dict may change after the message is built


def _check_name(where: str, name: object) -> None:
    if type(name) is not str or NAME_RE.fullmatch(name) is None:
        raise ValueError(f"{where} must be 1 to {vclock.NAME_CHARS_MAX} printable ASCII characters, got {_show(name)}")


def _enum_member(where: str, value: object, *, enum_type: type[enum.Enum]) -> enum.Enum:
    if isinstance(value, enum_type):
        return value
    wire_type = int if issubclass(enum_type, int) else str
    allowed = [m.value for m in enum_type]
    if type(value) is not wire_type or value not in allowed:
        raise ValueError(f"{where} must be one of {allowed}, got {_show(value)}")
    return enum_type(value)


def _byte_view(where: str, value: object) -> memoryview:
    try:
        view = memoryview(value)  # type: ignore[arg-type]
    except TypeError:
        raise ValueError(f"{where} must be a bytes-like buffer, got {type(value).__name__}") from None
    _require(view.c_contiguous, f"{where} must be a C-contiguous buffer")
    if view.format != "B" or view.ndim != 1:
        view = view.cast("B")  # numpy arrays of any dtype and shape become flat bytes
    return view.toreadonly()


def _check_dense_payload(kind: str, codec: CodecName, element_count: int, payload: memoryview) -> None:
    width = codec.dense_bytes
    if width is None:
        return
    _require(
        len(payload) == width * element_count,
        f"{kind} payload has {len(payload)} bytes; {codec.value} x {element_count} elements"
        f" needs {width * element_count}",
    )


def _check_digest(where: str, digest: str) -> None:
    _require(
        DIGEST_RE.fullmatch(digest) is not None,
        f"{where} must be 8 to 128 lowercase hex digits, got {_show(digest)}",
    )


def _require(condition: bool, text: str) -> None:
    if not condition:
        raise ValueError(text)


def _show(value: object) -> str:
    """A bounded repr: error texts quote peer input, which may be huge."""
    text = repr(value)
    return text if len(text) <= SHOWN_CHARS_MAX else text[: SHOWN_CHARS_MAX - 3] + "..."
