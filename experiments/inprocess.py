"""The syncer's shell without sockets: a virtual clock, a hub around the core, a learner transport.

`Hub` carries out the core's effects as `net.server.SyncerServer` does (a welcome binds the
connection to its learner, updates take the newest values when sent, timers fire, drops close),
but at virtual times on a `VirtualLoop`, with a modelled latency and bandwidth each way.
`InProcessTransport` is what `DilocoSync` talks to instead of a `ThreadedClient`. Both sides encode
every message into the daemon's wire frames and map them with `net.session`, so the learner and
the core see exactly what they see over a websocket; nothing of the protocol is written twice.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


from ddiloco.core import syncer as core
from ddiloco.core.events import (
    ArmTimer,
    Disconnect,
    Drop,
    Event,
    Log,
    MergeCost,
    Merged,
    SendError,
    SendRequest,
    SendUpdate,
    SendWelcome,
    TimerFired,
    WriteCheckpoint,
)
from ddiloco.net import session, wire
from ddiloco.net.client import ClientConfig, SyncerClient, SyncerRefused

EVENTS_MAX = 50_000_000  # a run that handles more than this has a bug (a timer or message loop)
PROGRESS_QUEUED_MAX = 64  # as the client: only the newest progress reports matter
PUSHES_QUEUED_MAX = 2


@dataclass(frozen=True)
class NetworkModel:
    """Latency of one message each way, link bandwidth and the modelled merge time, in virtual s."""

    latency_s: float = 0.05
    bytes_per_s: float = 1e9
    merge_s: float = 0.02  # what the syncer reports as MergeCost after each merge

    def __post_init__(self) -> None:
        for name in ("latency_s", "merge_s"):
            if not (math.isfinite(getattr(self, name)) and getattr(self, name) >= 0):
                raise ValueError(f"{name} must be a non-negative number, got {getattr(self, name)!r}")
        if not (math.isfinite(self.bytes_per_s) and self.bytes_per_s > 0):
            raise ValueError(f"bytes_per_s must be positive, got {self.bytes_per_s!r}")


# ---- the virtual clock ---------------------------------------------------------------------------------


class VirtualLoop:
    """Callbacks at virtual times, run in (time, scheduling order): one order for one seed."""

    def __init__(self) -> None:
        self.now = 0.0
        self._heap: list = []
        self._seq = itertools.count()
        self.handled = 0

    def at(self, t: float, fn: Callable[[], None]) -> None:
        assert t >= self.now - 1e-12, (t, self.now)
        heapq.heappush(self._heap, (max(t, self.now), next(self._seq), fn))

    def run(self, stop: Callable[[], bool]) -> None:
        """Run callbacks until `stop()` or nothing is left."""
        while self._heap and not stop():
            t, _, fn = heapq.heappop(self._heap)
            self.now = t
            self.handled += 1
            assert self.handled <= EVENTS_MAX, "the virtual loop ran away"
            fn()

    def drain(self) -> None:
        self.run(lambda: False)


# ---- the hub: the daemon's shell around the core, without sockets -------------------------------------


@dataclass
class _Conn:
    id: int
    transport: InProcessTransport
    learner: int | None = None
    open: bool = True
    up_free_at: float = 0.0  # per-direction FIFO: a message never overtakes one sent before it
    down_free_at: float = 0.0
    up: wire.Reassembler = field(default_factory=lambda: wire.Reassembler(wire.WireLimits()))
    down: wire.Reassembler = field(default_factory=lambda: wire.Reassembler(wire.WireLimits()))


class Hub:
    """Carries out the core's effects as `net.server.SyncerServer` does, at virtual times."""

    def __init__(self, state: core.SyncerState, loop: VirtualLoop, network: NetworkModel):
        self.state, self.loop, self.network = state, loop, network
        self.limits = wire.WireLimits()
        self._conns: dict[int, _Conn] = {}
        self._by_learner: dict[int, _Conn] = {}
        self._conn_ids = itertools.count(1)
        self._message_ids = itertools.count(1)
        self.merges: list[Merged] = []
        self.merge_times: list[float] = []
        self.bytes_down = 0

    # the learner side calls these

    def connect(self, transport: InProcessTransport) -> _Conn:
        conn = _Conn(next(self._conn_ids), transport)
        self._conns[conn.id] = conn
        return conn

    def send_up(self, conn: _Conn, frames: list) -> None:
        arrive = self._arrival(conn, "up", sum(len(f) for f in frames))
        self.loop.at(arrive, lambda: self._receive(conn, frames))

    def hang_up(self, conn: _Conn) -> None:
        """The learner's side closed (it went down or left): the syncer notices after the latency."""
        if conn.open:
            conn.open = False
            self.loop.at(self.loop.now + self.network.latency_s, lambda: self._forget(conn, "connection closed"))

    # the syncer side

    def _arrival(self, conn: _Conn, direction: str, size: int) -> float:
        attr = f"{direction}_free_at"
        start = max(self.loop.now, getattr(conn, attr))
        setattr(conn, attr, start + size / self.network.bytes_per_s)
        return start + size / self.network.bytes_per_s + self.network.latency_s

    def _receive(self, conn: _Conn, frames: list) -> None:
        if conn.id not in self._conns:
            return  # sent before the connection closed, arrived after: dropped with the socket
        for frame in frames:
            try:
                message = conn.up.feed(frame)
                if message is None:
                    continue
                event = session.event_for(message, conn.id, conn.learner, self.state.layout)
            except wire.WireError as exc:
                self._refuse(conn, exc)
                return
            except session.SessionError as exc:
                self._refuse(conn, exc.as_wire_error())
                return
            if isinstance(event, Disconnect):
                self._forget(conn, event.reason)
                return
            if event is not None:
                self.handle(event)

    def handle(self, event: Event) -> None:
        self.state, effects = core.handle(self.state, event, self.loop.now)
        merged = False
        for effect in effects:
            merged |= isinstance(effect, Merged)
            self._carry_out(effect)
        if merged:
            self.loop.at(self.loop.now, lambda: self.handle(MergeCost(self.network.merge_s)))

    def _carry_out(self, effect: Any) -> None:
        if isinstance(effect, (SendWelcome, SendRequest, SendError)):
            conn = self._conns.get(effect.conn) if getattr(effect, "conn", None) is not None else self._by_learner.get(effect.learner)
            if conn is None:
                return
            if isinstance(effect, SendWelcome):
                conn.learner = effect.learner
                self._by_learner[effect.learner] = conn
            self._send_down(conn, session.frames_for(effect, next(self._message_ids), self.limits))
        elif isinstance(effect, SendUpdate):
            # The values are taken now, between two core calls, and copied into frames (as the daemon does
            # when a connection gets to the update); the merge cost delays them.
            codec, version, values = core.update_values(self.state, effect.fragment)
            frames = session.update_frames(effect.fragment, version, codec, values, next(self._message_ids), self.limits)
            for learner in effect.learners:
                conn = self._by_learner.get(learner)
                if conn is not None:
                    self._send_down(conn, frames, extra_s=self.network.merge_s)
        elif isinstance(effect, ArmTimer):
            self.loop.at(effect.at, lambda: self.handle(TimerFired(effect.fragment, effect.round)))
        elif isinstance(effect, Drop):
            conn = self._by_learner.get(effect.learner) if effect.learner is not None else self._conns.get(effect.conn)
            if conn is not None:
                conn.transport.dropped()
                self._forget(conn, effect.reason)
        elif isinstance(effect, Merged):
            self.merges.append(effect)
            self.merge_times.append(self.loop.now)
        else:
            assert isinstance(effect, (Log, WriteCheckpoint)), effect  # no files in an in-process run

    def _send_down(self, conn: _Conn, frames: list, extra_s: float = 0.0) -> None:
        size = sum(len(f) for f in frames)
        self.bytes_down += size
        arrive = self._arrival(conn, "down", size) + extra_s

        def deliver() -> None:
            if not conn.open:
                return
            for frame in frames:
                message = conn.down.feed(frame)
                if message is not None:
                    conn.transport.deliver(session.client_view(message))

        self.loop.at(arrive, deliver)

    def _refuse(self, conn: _Conn, exc: wire.WireError) -> None:
        self._send_down(conn, session.error_frames(exc, next(self._message_ids), self.limits))
        if session.is_fatal(exc):
            conn.transport.dropped()
            self._forget(conn, str(exc))

    def _forget(self, conn: _Conn, reason: str) -> None:
        conn.open = False
        if self._conns.pop(conn.id, None) is None:
            return
        if conn.learner is not None and self._by_learner.get(conn.learner) is conn:
            del self._by_learner[conn.learner]
            self.handle(Disconnect(conn.learner, reason))


# ---- the learner's transport ---------------------------------------------------------------------------


class InProcessTransport:
    """What `DilocoSync` talks to instead of a `ThreadedClient`: the same methods and the same inbox
    (a `SyncerClient`'s, filled by its own delivery rule). As the client does, it sends nothing on a
    connection before that connection's welcome, and progress goes before bulk payloads; the
    runner calls `flush` after each hook call, which is when the client's writer would run."""

    def __init__(self, hub: Hub, name: str, tensors: tuple):
        self.hub = hub
        self._client = SyncerClient(ClientConfig(url="ws://in-process/ws", name=name, tensors=tensors))
        self._ids = itertools.count(1)
        self._conn: _Conn | None = None
        self._welcomed = False  # on the current connection
        self._progress: list = []
        self._bulk: list = []
        self.step = 0  # the learner's step, set by the runner before each hook call
        self.bytes_up = 0
        self.push_log: list[tuple[int, int]] = []  # (learner step, bytes) of every push sent

    @property
    def refused(self) -> SyncerRefused | None:
        return self._client.refused

    @property
    def inbox(self):
        return self._client.inbox

    def connect(self) -> None:
        self._conn, self._welcomed = self.hub.connect(self), False
        frames = session.hello_frames(self._client.config.name, self._client.config.tensors, next(self._ids), self.hub.limits)
        self.hub.send_up(self._conn, frames)

    def hang_up(self) -> None:
        if self._conn is not None:
            self.hub.hang_up(self._conn)
            self._conn = None

    def dropped(self) -> None:
        """The syncer closed the connection: reconnect (as the client does), unless refused."""
        self._conn = None
        if self.refused is None:
            self.hub.loop.at(self.hub.loop.now + self.hub.network.latency_s, self.connect)

    def deliver(self, item: object) -> None:
        try:
            self._client._deliver(item)
        except SyncerRefused as exc:  # a fatal error frame: refused for good, as on a socket
            self._client.refused = exc
            self.hang_up()
            return
        if isinstance(item, session.WelcomeInfo):
            self._welcomed = True
            self.flush()

    def flush(self) -> None:
        if self._conn is None or not self._conn.open or not self._welcomed:
            return
        for item in self._progress:
            self.hub.send_up(self._conn, session.progress_frames(item, next(self._ids), self.hub.limits))
        for item in self._bulk:
            frames = session.bulk_frames(item, next(self._ids), self.hub.limits)
            if isinstance(item, session.PushInfo):
                size = sum(len(f) for f in frames)
                self.bytes_up += size
                self.push_log.append((self.step, size))
            self.hub.send_up(self._conn, frames)
        self._progress, self._bulk = [], []

    # the interface DilocoSync uses

    def wait_welcome(self, timeout_s: float) -> session.WelcomeInfo:
        if self.refused is not None:
            raise self.refused
        if self.inbox.welcome is None:
            raise TimeoutError("the runner builds a learner's hook only after its welcome has arrived")
        return self.inbox.welcome

    def progress(self, item: session.ProgressInfo) -> None:
        self._check()
        self._progress = (self._progress + [item])[-PROGRESS_QUEUED_MAX:]

    def push(self, item: session.PushInfo) -> None:
        self._check()
        if sum(isinstance(b, session.PushInfo) for b in self._bulk) >= PUSHES_QUEUED_MAX:
            return  # as the client: a full push queue refuses, the next round asks again
        self._bulk.append(item)

    def init(self, fragment: int, payload: bytes) -> None:
        self._check()
        self._bulk.append(session.InitInfo(fragment, payload))

    def take(self) -> tuple[list, dict, list, tuple[int, session.WelcomeInfo | None]]:
        self._check()
        box = self.inbox
        requests, updates, errors = list(box.requests), dict(box.updates), list(box.errors)
        box.requests.clear()
        box.updates.clear()
        box.errors.clear()
        return requests, updates, errors, (box.welcomes, box.welcome)

    def take_markers(self) -> list[int]:
        return []  # the runner takes no consistent snapshots

    def local_state(self, snapshot: int, data: bytes) -> None:
        raise AssertionError("the in-process transport hands out no snapshot markers, so no local state is sent")

    def close(self) -> None:
        self.hang_up()

    def _check(self) -> None:
        if self.refused is not None:
            raise self.refused
