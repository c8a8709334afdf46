"""The syncer's shell without sockets: a virtual clock, a hub around the core, a learner transport.

`Hub` is the link of the same `net.shell.Shell` the daemon runs the core in (the tables, the
timers, the merge-cost feedback are the shell's), at virtual times on a `VirtualLoop`, with a
modelled latency and bandwidth each way.
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

from ddiloco.core import syncer as core
from ddiloco.core.events import Disconnect, Event, Merged, Push
from ddiloco.net import session, wire
from ddiloco.net.client import ClientConfig, SyncerClient, SyncerRefused
from ddiloco.net.shell import Control, Shell

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
    open: bool = True
    up_free_at: float = 0.0  # per-direction FIFO: a message never overtakes one sent before it
    down_free_at: float = 0.0
    up: wire.Reassembler = field(default_factory=lambda: wire.Reassembler(wire.WireLimits()))
    down: wire.Reassembler = field(default_factory=lambda: wire.Reassembler(wire.WireLimits()))


class Hub:
    """The syncer at virtual times: `net.shell.Shell` around the core, this hub its link (frames
    with a modelled latency and bandwidth each way, timers on the virtual loop, no files)."""

    def __init__(self, state: core.SyncerState, loop: VirtualLoop, network: NetworkModel):
        self.loop, self.network = loop, network
        self.shell = Shell(state, self, merge_cost=lambda _spent: (network.merge_s, 0.0))
        self.limits = wire.WireLimits()
        self._conns: dict[int, _Conn] = {}
        self._conn_ids = itertools.count(1)
        self._message_ids = itertools.count(1)
        self.merges: list[Merged] = []
        self.merge_times: list[float] = []
        self.bytes_down = 0

    @property
    def state(self) -> core.SyncerState:
        return self.shell.state

    # the learner side calls these

    def connect(self, transport: InProcessTransport) -> _Conn:
        conn = _Conn(next(self._conn_ids), transport)
        self._conns[conn.id] = conn
        self.shell.opened(conn.id)
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
                event = session.event_for(message, conn.id, self.shell.learner_on(conn.id), self.state.layout)
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
        self.shell.handle(event, self.loop.now)

    # the shell's link (net.shell.Link)

    def send(self, conn_id: int, effect: Control) -> None:
        self._send_down(self._conns[conn_id], session.frames_for(effect, next(self._message_ids), self.limits))

    def send_update(
        self,
        conns: tuple[int, ...],
        fragment: int,
        codec: str,
        version: int,
        values,
        base_version: int = -1,
        block: int = 0,
        global_step: int = 0,
    ) -> None:
        # Copied into frames now, between two core calls (as the daemon does); the merge cost delays them.
        frames = session.update_frames(
            fragment,
            version,
            codec,
            values,
            next(self._message_ids),
            self.limits,
            base_version=base_version,
            block=block,
            global_step=global_step,
        )
        for conn_id in conns:
            self._send_down(self._conns[conn_id], frames, extra_s=self.network.merge_s)

    def close(self, conn_id: int, reason: str) -> None:
        conn = self._conns.get(conn_id)
        if conn is not None:
            conn.transport.dropped()
            self._forget(conn, reason)

    def wake(self, at: float, token: int) -> None:
        self.loop.at(at, lambda: self.shell.fire(token, self.loop.now))

    def write_checkpoint(self, state: core.SyncerState, reason: str) -> None:
        pass  # no files in an in-process run

    def merged(self, effect: Merged) -> None:
        self.merges.append(effect)
        self.merge_times.append(self.loop.now)

    def log(self, effect) -> None:
        pass

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
        self.shell.closed(conn.id, reason, self.loop.now)


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
        self.pushes_dropped = 0  # refused for a full queue, as the client counts them

    @property
    def refused(self) -> SyncerRefused | None:
        return self._client.refused

    @property
    def inbox(self):
        return self._client.inbox

    def connect(self) -> None:
        self._conn, self._welcomed = self.hub.connect(self), False
        frames = session.hello_frames(
            self._client.config.name, self._client.config.tensors, next(self._ids), self.hub.limits
        )
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
        if self._client._behind is not None:  # UPDATES_QUEUED_MAX untaken: rejoin for whole copies, as the client does
            self._client._behind = None
            self.hang_up()
            self.hub.loop.at(self.hub.loop.now + self.hub.network.latency_s, self.connect)
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
            if isinstance(item, Push):
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

    def push(self, item: Push) -> bool:
        self._check()
        if sum(isinstance(b, Push) for b in self._bulk) >= PUSHES_QUEUED_MAX:
            self.pushes_dropped += 1  # as the client: a full push queue refuses; the next push carries its progress
            return False
        self._bulk.append(item)
        return True

    def init(self, fragment: int, payload: bytes) -> None:
        self._check()
        self._bulk.append(session.InitInfo(fragment, payload))

    def take(self) -> tuple[dict, list, tuple[int, session.WelcomeInfo | None]]:
        self._check()
        box = self.inbox
        updates, errors = dict(box.updates), list(box.errors)
        box.updates.clear()
        box.errors.clear()
        return updates, errors, (box.welcomes, box.welcome)

    def take_markers(self) -> list[int]:
        return []  # the runner takes no consistent snapshots

    def local_state(self, snapshot: int, data: bytes) -> None:
        raise AssertionError("the in-process transport hands out no snapshot markers, so no local state is sent")

    def close(self) -> None:
        self.hang_up()

    def _check(self) -> None:
        if self.refused is not None:
            raise self.refused
