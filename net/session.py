"""Between the wire and the rest: wire messages <-> core events and effects, and the learner's view.

The wire (`net.messages`, `net.wire`) knows frames and fields; the core knows events and effects;
this module is the one place that maps one onto the other, so neither depends on the other's
vocabulary. Codec payloads travel without their own header (the message carries codec, block and
element count), so nothing is said twice on the wire.

A push is one value all the way (`core.events.Push`, its payload a `core.codec.Encoded`): the learner
makes it, `bulk_frames` writes its fields and its payload's body into the frames (the one copy on the
learner's side), and `event_for` makes it again on the syncer over the reassembled bytes, its learner
the connection's. No header is stripped or rebuilt on the way: the body is what both sides hold.
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass

import orjson

from ddiloco.core import codec as codecs
from ddiloco.core import events as ev
from ddiloco.core import shards, vclock
from ddiloco.core.layout import Layout, LayoutError, TensorSpec
from ddiloco.errors import UserError
from ddiloco.net import messages as msg
from ddiloco.net import wire

PROTOCOL_VERSION = wire.PROTOCOL_VERSION
log = logging.getLogger("ddiloco.session")
TENSORS_JSON_BYTES_MAX = 8 << 20
PEERS_MAX = 64  # peers read from a welcome; the syncer lists far fewer

# core error code -> wire error code
_WIRE_CODE = {
    "bad_layout": msg.ErrorCode.BAD_LAYOUT,
    "bad_shape": msg.ErrorCode.BAD_SHAPE,
    "non_finite": msg.ErrorCode.NON_FINITE,
    "stale": msg.ErrorCode.STALE,
    "late": msg.ErrorCode.LATE,
    "duplicate": msg.ErrorCode.DUPLICATE,
    "unknown_round": msg.ErrorCode.BAD_MESSAGE,
    "not_live": msg.ErrorCode.UNEXPECTED_KIND,
    "bad_counters": msg.ErrorCode.BAD_MESSAGE,
    "protocol_version": msg.ErrorCode.PROTOCOL_VERSION,
    "overloaded": msg.ErrorCode.OVERLOADED,
    "unexpected": msg.ErrorCode.UNEXPECTED_KIND,
    # The fragment index does not fit this syncer: it is another shard's (the text names which).
    "wrong_shard": msg.ErrorCode.BAD_SHAPE,
}


class SessionError(UserError, ValueError):
    """A well-formed message that makes no sense here (wrong kind for the state, bad payload)."""

    def __init__(self, code: msg.ErrorCode, text: str, *, fatal: bool = False):
        super().__init__(text)
        self.code, self.text, self.fatal = code, text, fatal

    def as_wire_error(self) -> wire.WireError:
        return wire.WireError(self.code, self.text, fatal=self.fatal)


# ---- what the learner sees and sends ----------------------------------------------------------------


@dataclass(frozen=True)
class WelcomeInfo:
    learner: int
    layout: dict  # Layout.describe() of the syncer's layout
    digest: str
    versions: tuple[int, ...]
    global_step: int
    needs_init: bool
    peers: tuple[PeerInfo, ...] = ()  # live learners serving their state, by learner id
    period: int = 1  # the round schedule: fragment p's round opens at global steps t, t mod period == offsets[p]
    offsets: tuple[int, ...] = ()
    shard: int = 0  # a sharded syncer (core.shards): this syncer is shard `shard` of `shards`
    shards: int = 1
    # Set only on the welcome a learner's link to every shard makes of theirs (net.sharded): it
    # speaks for the whole syncer, and these are the shards that ask for the initial parameters
    # (needs_init: some shard does). None: the welcome of one syncer, or of one shard.
    init_shards: tuple[int, ...] | None = None

    def opens_round(self, step: int, after: int | None = None) -> bool:
        """Whether some fragment's round opens when the syncer's global step reaches `step`; given
        `after`, at any step in (after, step]: a report of the newest computed step may move on by
        several steps at once (learner.lead)."""
        if after is not None and step <= after:
            return False  # no step reached since: what opened there was told
        if after is None or step - after == 1:
            return step % self.period in self.offsets
        if step - after >= self.period:
            return bool(self.offsets)
        return any(s % self.period in self.offsets for s in range(after + 1, step + 1))

    @property
    def owned(self) -> tuple[int, ...]:
        """The fragments this welcome speaks for: those its syncer owns (every fragment unless it is
        one shard of several), or every fragment for a welcome merged over all shards."""
        if self.init_shards is not None:
            return tuple(range(len(self.versions)))
        return shards.owned(self.shard, self.shards, len(self.versions))

    @property
    def init_fragments(self) -> tuple[int, ...]:
        """The fragments whose initial parameters this learner is asked for, in order."""
        if not self.needs_init:
            return ()
        if self.init_shards is None:
            return self.owned
        return tuple(q for q in range(len(self.versions)) if shards.owner(q, self.shards) in self.init_shards)


@dataclass(frozen=True)
class PeerInfo:
    learner: int
    url: str
    versions: tuple[int, ...]


@dataclass(frozen=True)
class UpdateInfo:
    fragment: int
    version: int
    encoded: codecs.Encoded  # views into the received buffer
    base_version: int = -1  # the version a delta applies onto; -1: the published copy whole
    # The syncer's global step when it sent the update (protocol 3); -1: not told (a tape of an
    # older protocol). A learner behind it moves its schedule up to it (learner.schedule.caught_up).
    global_step: int = -1

    @property
    def whole(self) -> bool:
        return self.base_version < 0


@dataclass(frozen=True)
class ErrorInfo:
    code: str
    text: str
    fatal: bool


@dataclass(frozen=True)
class ProgressInfo:
    step: int
    versions: tuple[int, ...]
    steps: tuple[int, ...]
    tokens: tuple[int, ...]
    carried: tuple[int, ...] = ()  # of `tokens`, those carried over a merge (msg.Progress.fragment_carried)


@dataclass(frozen=True)
class MarkerInfo:
    snapshot: int  # a consistent snapshot started: record the local state at the next step boundary


@dataclass(frozen=True)
class LocalStateInfo:
    snapshot: int
    data: bytes  # the learner's state (learner.sync.DilocoSync.local_state_bytes)


@dataclass(frozen=True)
class InitInfo:
    fragment: int
    payload: bytes  # fp32 codec bytes


def tensors_json(tensors: tuple[TensorSpec, ...]) -> str:
    return orjson.dumps([[t.path, list(t.shape), t.dtype, t.embedding] for t in tensors]).decode()


def parse_tensors(text: str) -> tuple[TensorSpec, ...]:
    """The hello's tensor list, `[[path, shape, dtype, embedding], ...]`, each value of its JSON type
    (nothing is coerced: a number where a path belongs is an error, not a path); TensorSpec checks
    the values."""
    if len(text) > TENSORS_JSON_BYTES_MAX:
        raise SessionError(msg.ErrorCode.OVERSIZED, f"tensor list of {len(text)} bytes is above the limit", fatal=True)
    try:
        rows = orjson.loads(text)
        if type(rows) is not list:
            raise LayoutError(f"the tensor list must be a JSON array, got {type(rows).__name__}")
        return tuple(_tensor(i, row) for i, row in enumerate(rows))
    except (orjson.JSONDecodeError, LayoutError) as exc:
        raise SessionError(msg.ErrorCode.BAD_LAYOUT, f"malformed tensor list in hello: {exc}", fatal=True) from exc


def _tensor(index: int, row: object) -> TensorSpec:
    if type(row) is not list or len(row) != 4:
        raise LayoutError(f"tensor {index} must be [path, shape, dtype, embedding], got {_shown(row)}")
    path, shape, dtype, embedding = row
    if type(shape) is not list or any(type(d) is not int for d in shape):
        raise LayoutError(f"tensor {index}: shape must be a list of integers, got {_shown(shape)}")
    if type(dtype) is not str or type(embedding) is not bool:
        raise LayoutError(f"tensor {index}: dtype must be a string and embedding a bool, got {_shown(row)}")
    return TensorSpec(path, tuple(shape), dtype, embedding)


def parse_peers(text: str) -> tuple[PeerInfo, ...]:
    """The welcome's peer list. A malformed one is logged and read as no peers: the learner then
    recovers from the syncer's fragments, which is always correct (only slower)."""
    if not text:
        return ()
    try:
        rows = orjson.loads(text)
        return tuple(PeerInfo(int(i), str(u), tuple(int(x) for x in v)) for i, u, v in rows[:PEERS_MAX])
    except (orjson.JSONDecodeError, TypeError, ValueError) as exc:
        log.warning("ignoring a malformed peer list in the welcome: %s", exc)
        return ()


def hello_frames(
    name: str,
    tensors: tuple[TensorSpec, ...],
    message_id: int,
    limits: wire.WireLimits,
    clock: dict[str, int] | None = None,
    peer_url: str = "",
) -> list:
    hello = msg.Hello(
        name=name,
        layout_digest="0" * 64,
        shard=0,
        resume_learner_id=None,
        held_versions=(),
        clock=clock or {},
        tensors_json=tensors_json(tensors),
        peer_url=peer_url,
    )
    return wire.encode(hello, message_id=message_id, limits=limits)


def progress_frames(
    p: ProgressInfo, message_id: int, limits: wire.WireLimits, clock: dict[str, int] | None = None
) -> list:
    m = msg.Progress(
        step=p.step,
        fragment_steps=p.steps,
        fragment_tokens=p.tokens,
        clock=clock or {},
        held_versions=p.versions,
        fragment_carried=p.carried if any(p.carried) else (),
    )
    return wire.encode(m, message_id=message_id, limits=limits)


def bulk_frames(
    item: ev.Push | InitInfo | LocalStateInfo,
    message_id: int,
    limits: wire.WireLimits,
    clock: dict[str, int] | None = None,
) -> list:
    """The frames of a bulk message; the payload is copied once, into them (`wire.encode`)."""
    if isinstance(item, ev.Push):
        return wire.encode(push_message(item, clock or {}), message_id=message_id, limits=limits)
    if isinstance(item, LocalStateInfo):
        m = msg.LocalState(
            snapshot=item.snapshot, sha256=hashlib.sha256(item.data).hexdigest(), clock=clock or {}, payload=item.data
        )
        return wire.encode(m, message_id=message_id, limits=limits)
    enc = codecs.parse(item.payload)
    m = msg.Init(fragment=item.fragment, element_count=enc.elements, clock=clock or {}, payload=enc.body)
    return wire.encode(m, message_id=message_id, limits=limits)


def push_message(push: ev.Push, clock: dict[str, int]) -> msg.Push:
    """The wire message of a push: its fields, and its payload's body with the codec, block and size
    beside it (`learner` is not sent: the syncer knows the sender by its connection). The wire's
    block is at least 1; a codec without blocks reads it as 0 (`push_event`)."""
    enc = push.payload
    return msg.Push(
        fragment=push.fragment,
        step=push.step,
        base_version=push.base_version,
        steps=push.steps,
        tokens=push.tokens,
        codec=enc.codec,
        block=max(enc.block, 1),
        element_count=enc.elements,
        clock=clock,
        payload=enc.body,
    )


def push_event(m: msg.Push, learner: int, layout: Layout | None) -> ev.Push:
    """The push again on the syncer, its payload a view over the received bytes; SessionError when the
    fragment does not exist or the payload does not fit it."""
    encoded = _encoded(m.codec.value, m.block, m.element_count, m.payload, _fragment_size(layout, m.fragment))
    return ev.Push(learner, m.fragment, m.step, m.base_version, m.steps, m.tokens, encoded)


def client_view(m: msg.Message) -> object:
    """What a learner makes of a syncer message."""
    if isinstance(m, msg.Welcome):
        layout = orjson.loads(m.layout_json)
        return WelcomeInfo(
            m.learner_id,
            layout,
            m.layout_digest,
            m.versions,
            m.global_step,
            m.needs_init,
            parse_peers(m.peers_json),
            m.sync_every_steps,
            m.fragment_offsets,
            m.shard,
            m.shards,
        )
    if isinstance(m, msg.Update):
        base = -1 if m.base_version is None else m.base_version
        encoded = _encoded(m.codec.value, m.block, m.element_count, m.payload)
        return UpdateInfo(m.fragment, m.version, encoded, base, m.global_step)
    if isinstance(m, msg.Error):
        return ErrorInfo(m.code.name.lower(), m.text, m.fatal)
    if isinstance(m, msg.Marker):
        return MarkerInfo(m.snapshot)
    return None


# ---- what the syncer makes of learner messages ---------------------------------------------------------


def event_for(m: msg.Message, conn: int, learner: int | None, layout: Layout | None) -> ev.Event | None:
    """The core event for a learner message; SessionError when it is out of place or malformed."""
    _check_clock(m)
    if isinstance(m, msg.Hello):
        if learner is not None:
            raise SessionError(msg.ErrorCode.UNEXPECTED_KIND, "a second hello on one connection", fatal=True)
        return ev.Join(conn, m.name, parse_tensors(m.tensors_json), PROTOCOL_VERSION, m.peer_url)
    if learner is None:
        raise SessionError(msg.ErrorCode.UNEXPECTED_KIND, f"{type(m).__name__} before hello", fatal=True)
    if isinstance(m, msg.Progress):
        return ev.Progress(learner, m.step, m.held_versions, m.fragment_steps, m.fragment_tokens, m.fragment_carried)
    if isinstance(m, msg.Push):
        return push_event(m, learner, layout)
    if isinstance(m, msg.Init):
        encoded = _encoded("fp32", 0, m.element_count, m.payload, _fragment_size(layout, m.fragment))
        return ev.InitFragment(learner, m.fragment, encoded)
    if isinstance(m, msg.Bye):
        return ev.Disconnect(learner, f"bye: {m.reason}")
    if isinstance(m, (msg.Error, msg.LocalState)):
        return (
            None  # a learner's complaint (logged by the caller), or a snapshot's (net.snapshot): nothing for the core
        )
    raise SessionError(msg.ErrorCode.UNEXPECTED_KIND, f"learners do not send {type(m).__name__}")


def frames_for(
    effect: ev.Effect, message_id: int, limits: wire.WireLimits, clock: dict[str, int] | None = None
) -> list:
    """The frames carrying a core effect that sends something."""
    if isinstance(effect, ev.SendWelcome):
        frags = effect.layout["fragments"]
        m = msg.Welcome(
            learner_id=effect.learner,
            layout_digest=effect.digest,
            fragment_count=len(frags),
            versions=tuple(max(v, 0) for v in effect.versions),
            sync_every_steps=effect.period,
            fragment_offsets=effect.offsets or tuple(0 for _ in frags),
            global_step=effect.global_step,
            codec="int4",
            codec_block=effect.layout["block"],
            clock=clock or {},
            needs_init=effect.needs_init,
            layout_json=orjson.dumps(effect.layout).decode(),
            peers_json=orjson.dumps([[i, u, list(v)] for i, u, v in effect.peers]).decode() if effect.peers else "",
            shard=effect.shard,
            shards=effect.shards,
        )
    elif isinstance(effect, ev.SendError):
        m = msg.Error(code=_WIRE_CODE[effect.code], text=effect.text, fatal=effect.fatal)
    else:
        raise AssertionError(f"{type(effect).__name__} sends nothing")
    return wire.encode(m, message_id=message_id, limits=limits)


def marker_frames(snapshot: int, message_id: int, limits: wire.WireLimits, clock: dict[str, int] | None = None) -> list:
    return wire.encode(msg.Marker(snapshot=snapshot, clock=clock or {}), message_id=message_id, limits=limits)


def update_frames(
    fragment: int,
    version: int,
    codec: str,
    values,
    message_id: int,
    limits: wire.WireLimits,
    clock: dict[str, int] | None = None,
    base_version: int = -1,
    block: int = 0,
    global_step: int = 0,
) -> list:
    """The frames of one fragment update (values: float32 or bf16 bits, or an int4 codec body;
    copied into the frames). base_version -1: the published copy whole. `global_step`: the
    syncer's when it sends the update."""
    if block:  # a block codec's body: scales and codes, its size in elements from the block
        elements = codecs.Codec(codec).elements_of_body(values.nbytes, block)
    else:
        elements = values.size
    m = msg.Update(
        fragment=fragment,
        version=version,
        codec=codec,
        element_count=elements,
        clock=clock or {},
        global_step=global_step,
        payload=values,
        base_version=None if base_version < 0 else base_version,
        block=block,
    )
    return wire.encode(m, message_id=message_id, limits=limits)


def bye_frames(reason: str, message_id: int, limits: wire.WireLimits) -> list:
    return wire.encode(msg.Bye(reason=reason), message_id=message_id, limits=limits)


def error_frames(exc: wire.WireError, message_id: int, limits: wire.WireLimits) -> list:
    return wire.encode(exc.to_message(), message_id=message_id, limits=limits)


def is_fatal(exc: wire.WireError) -> bool:
    return bool(exc.fatal)


def _shown(value: object) -> str:
    """A bounded repr: the values quoted come from a peer and may be huge."""
    text = repr(value)
    return text if len(text) <= msg.SHOWN_CHARS_MAX else text[: msg.SHOWN_CHARS_MAX - 3] + "..."


def _check_clock(m: msg.Message) -> None:
    """The syncer merges the clock of every learner message into its own: one it could not merge
    is refused here, with the message, rather than dropped in silence later."""
    try:
        vclock.check_mergeable(getattr(m, "clock", {}))
    except vclock.VClockError as exc:
        raise SessionError(msg.ErrorCode.BAD_MESSAGE, f"{type(m).__name__}.clock: {exc}") from exc


def _fragment_size(layout: Layout | None, fragment: int) -> int:
    if layout is None or not 0 <= fragment < layout.num_fragments:
        raise SessionError(msg.ErrorCode.BAD_SHAPE, f"fragment {fragment} does not exist in the syncer's layout")
    return layout.fragments[fragment].padded_size


def _encoded(codec_name: str, block: int, n: int, body: memoryview, expected: int | None = None) -> codecs.Encoded:
    """Views into the reassembled payload (the reassembler hands each message a buffer of its own)."""
    try:
        codec = codecs.parse_codec(codec_name)
        return codecs.from_body(codec, block if codec.is_block else 0, n, body, elements=expected)
    except codecs.CodecError as exc:
        raise SessionError(msg.ErrorCode.BAD_SHAPE, str(exc)) from exc
