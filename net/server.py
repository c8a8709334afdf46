"""The syncer daemon: the aiohttp server around the sans-I/O core.

Threads and order. Every event, from any connection or timer, goes through one bounded queue into
one core task, which calls `core.syncer.handle` on a single-thread executor: the core sees events in
one total order (what the event tape records), its state is only ever touched by that one thread,
and the kernels it runs release the GIL, so the event loop keeps reading sockets while a fragment
is merged. The effects that come back are carried out on the event loop: frames queued on the
connections, timers armed, checkpoints written (on the core thread, so the arrays are not mutated
while they are written).

HTTP: `/healthz`, `/metrics` (Prometheus), `/status` (JSON), `/` (a small live page), `POST
/checkpoint` and `POST /snapshot` (a consistent snapshot of syncer, learners and messages in flight,
net.snapshot; token required). `/ws` is the learners' websocket; with a token configured the upgrade
is refused with 401 unless `Authorization: Bearer <token>` matches.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import logging
import signal
import time
import weakref
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import orjson
from aiohttp import WSMsgType, web

from ddiloco.core import syncer as core
from ddiloco.core import tape as tapes
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
from ddiloco.core.vclock import VClock, VClockError
from ddiloco.net import messages as msg
from ddiloco.net.messages import LEARNER_KINDS  # `msg` is also a websocket message's name below
from ddiloco.net import session, store, wire
from ddiloco.net import snapshot as snapshots
from ddiloco.net.auth import bearer_matches
from ddiloco.net.connection import Connection, QueueLimits, SlowPeerError
from ddiloco.net.telemetry import Metrics, render_prometheus, status_document

log = logging.getLogger("ddiloco.syncer")

CLOSE_FLUSH_S_MAX = 1.0  # how long a closing connection may take to send the error that explains it
SYNCER_CLOCK_NAME = "syncer"  # the syncer's entry in every vector clock


@dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 0  # 0: any free port
    auth_token: str | None = None
    checkpoint_dir: Path | None = None
    checkpoints_kept: int = store.CHECKPOINTS_KEPT_DEFAULT
    events_queued_max: int = 4096
    heartbeat_s: float = 20.0  # websocket ping interval; a peer silent for half of it is closed
    queues: QueueLimits = field(default_factory=QueueLimits)
    wire: wire.WireLimits = field(default_factory=wire.WireLimits)
    snapshot_dir: Path | None = None  # where consistent snapshots go (net.snapshot); None: none taken
    snapshot_every_s: float = 0.0  # 0: only on request
    snapshot_wait_s_max: float = snapshots.WAIT_S_MAX_DEFAULT
    snapshots_kept: int = snapshots.SNAPSHOTS_KEPT_DEFAULT

    def __post_init__(self) -> None:
        if self.snapshot_every_s < 0 or self.snapshot_wait_s_max <= 0 or self.snapshots_kept < 1:
            raise ValueError("snapshot_every_s must be >= 0, snapshot_wait_s_max and snapshots_kept positive")
        if self.snapshot_every_s and self.snapshot_dir is None:
            raise ValueError("snapshot_every_s needs a snapshot_dir")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if self.events_queued_max < 1 or self.heartbeat_s <= 0 or self.checkpoints_kept < 1:
            raise ValueError("events_queued_max, heartbeat_s and checkpoints_kept must be positive")


class FrameSet:
    """The frames of one version of one fragment update, shared by every connection sending it."""

    __slots__ = ("version", "frames", "__weakref__")

    def __init__(self, version: int, frames: list):
        self.version, self.frames = version, frames

    def __iter__(self):
        return iter(self.frames)


@dataclass
class _SnapshotStart:
    """Queued like an event: the cut falls exactly between the events before it and after it."""

    reason: str
    done: asyncio.Future


@dataclass
class _LocalStateIn:
    learner: int
    snapshot: int
    data: bytes
    sha256: str


@dataclass
class _SnapshotTimeout:
    snapshot: int


def use_uvloop() -> None:
    """Run the event loops made from here on with uvloop, the syncer's loop; a platform without
    it keeps asyncio's own, which works too."""
    try:
        import uvloop
    except ImportError:
        return
    asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())


class SyncerServer:
    """The daemon. `await start()`, then `port` is known; `await stop()` ends it cleanly."""

    def __init__(
        self,
        state: core.SyncerState,
        config: ServerConfig,
        clock: Callable[[], float] = time.monotonic,
        tape: tapes.TapeWriter | None = None,
    ):
        self.state = state
        # The syncer's vector clock lives here in the shell, not in the core state: no decision of the
        # core depends on it, so the core, `state_hash` and the checkpoint format stay as they are, and
        # the tape records it beside each event. Only the core thread replaces it (an immutable value).
        self.vclock = VClock()
        self.tape = tape  # records every event the core handles, when given
        self.config = config
        self.clock = clock
        self.metrics = Metrics()
        self.started_at = clock()
        self._events: asyncio.Queue | None = None
        self._core = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ddiloco-core")
        self._conns: dict[int, Connection] = {}
        self._background: set[asyncio.Task] = set()
        self._frame_sets: weakref.WeakValueDictionary[int, FrameSet] = weakref.WeakValueDictionary()
        self._by_learner: dict[int, Connection] = {}
        self._conn_ids = itertools.count(1)
        self._message_ids = itertools.count(1)
        self._tasks: asyncio.TaskGroup | None = None
        self._runner: web.AppRunner | None = None
        self._stopping: asyncio.Event | None = None
        self.port: int | None = None
        self.core_seconds = 0.0  # wall time spent inside handle(), for the bench
        self._snapshot: snapshots.Snapshot | None = None  # being taken; touched on the core thread only
        self._snapshot_waiters: list[asyncio.Future] = []
        self._snapshot_ids = itertools.count(1)

    # ---- lifecycle ------------------------------------------------------------------------------

    def app(self) -> web.Application:
        app = web.Application(client_max_size=1 << 20)
        app.router.add_get("/ws", self._ws)
        app.router.add_get("/healthz", self._healthz)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/status", self._status)
        app.router.add_get("/", self._page)
        app.router.add_post("/checkpoint", self._checkpoint_now)
        app.router.add_post("/snapshot", self._snapshot_now)
        return app

    async def start(self) -> int:
        self._events = asyncio.Queue(self.config.events_queued_max)
        self._stopping = asyncio.Event()
        self._core_task = asyncio.create_task(self._core_loop(), name="ddiloco-core-loop")
        self._runner = web.AppRunner(self.app(), handle_signals=False, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.config.host, self.config.port)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]  # the port the OS chose for port 0
        if self.config.snapshot_every_s:
            self._spawn(self._snapshot_timer())
        log.info("syncer listening on %s:%d", self.config.host, self.port)
        return self.port

    async def stop(self, *, checkpoint: bool = True) -> None:
        """Close every connection, drain the core, write a last checkpoint."""
        if self._stopping is None or self._stopping.is_set():
            return
        self._stopping.set()
        for conn in list(self._conns.values()):
            conn.closed = True
            conn.wake.set()
            await conn.ws.close(code=1001, message=b"syncer shutting down")
        await self._events.put(None)
        await self._core_task
        if self._snapshot is not None:
            log.warning("snapshot %d abandoned: the syncer is stopping", self._snapshot.ident)
            await asyncio.get_running_loop().run_in_executor(self._core, snapshots.abandon, self._snapshot)
            self._snapshot = None
        if self.tape is not None:
            await asyncio.get_running_loop().run_in_executor(self._core, self._tape, lambda t: t.close(self.state))
        for task in list(self._background):  # the connections are closed already: nothing left to do
            task.cancel()
        await asyncio.gather(*self._background, return_exceptions=True)
        if checkpoint and self.config.checkpoint_dir and self.state.holds_parameters:
            await asyncio.get_running_loop().run_in_executor(self._core, self._write_checkpoint, "shutdown")
        await self._runner.cleanup()
        self._core.shutdown(wait=True)

    async def serve_forever(self) -> None:
        """Run until SIGTERM or SIGINT, then stop with a checkpoint."""
        loop = asyncio.get_running_loop()
        done = asyncio.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, done.set)
        await self.start()
        await done.wait()
        log.info("signal received: writing a last checkpoint and stopping")
        await self.stop()

    # ---- the core loop --------------------------------------------------------------------------

    async def submit(self, event: Event) -> None:
        await self._events.put(event)

    async def _core_loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            item = await self._events.get()
            if item is None:
                return
            if isinstance(item, (_SnapshotStart, _LocalStateIn, _SnapshotTimeout)):
                await self._snapshot_step(item)
                continue
            # A queued item is an event, or (event, the clock its learner message carried).
            event, carried = item if isinstance(item, tuple) else (item, None)
            started = time.perf_counter()
            now = self.clock()
            try:
                self.state, effects = await loop.run_in_executor(self._core, self._step, event, carried, now)
            except Exception:  # a bug in the core: log it loudly and stop, never limp on
                log.exception("syncer core failed on %s", type(event).__name__)
                raise
            spent = time.perf_counter() - started
            self.core_seconds += spent
            merged = False
            for effect in effects:
                merged |= isinstance(effect, Merged)
                await self._carry_out(effect)
            if merged:
                self.metrics.merge_kernel_s += spent
                await self._events.put(MergeCost(spent))

    def _step(self, event: Event, carried: dict[str, int] | None, now: float):
        """On the core thread: advance the syncer's clock, tape the event, run the core, tape its merges.
        Recording only reads: the core gets the same event and `now` with or without a tape."""
        try:
            clock = self.vclock.merge(carried or {})
        except VClockError as exc:
            log.warning("not merging a learner's clock into the syncer's: %s", exc)
            clock = self.vclock
        self.vclock = clock.tick(SYNCER_CLOCK_NAME)
        index = self._tape(lambda t: t.event(event, now, self.vclock))
        if self._snapshot is not None:  # taken after the cut, before the learner's local state: in flight
            try:
                snapshots.record_inflight(self._snapshot, event)
            except OSError as exc:
                log.error("snapshot %d abandoned: %s", self._snapshot.ident, exc)
                snapshots.abandon(self._snapshot)
                self._snapshot = None
        state, effects = core.handle(self.state, event, now)
        if index is not None:
            self._tape(lambda t: t.checks(index, state, effects))
        return state, effects

    def _tape(self, write):
        """Run one tape write; a tape that cannot be written stops recording, loudly, never the syncer."""
        if self.tape is None:
            return None
        try:
            return write(self.tape)
        except (tapes.TapeError, OSError) as exc:
            log.error("event tape stopped, the run goes on unrecorded from here: %s", exc)
            tape, self.tape = self.tape, None
            try:
                tape.abandon()
            except OSError:
                pass  # the disk already failed the write above; that error is the one logged
            return None

    async def _carry_out(self, effect) -> None:
        if isinstance(effect, (SendWelcome, SendRequest, SendError)):
            conn = self._conn_for(effect)
            if conn is not None:
                if isinstance(effect, SendWelcome):
                    conn.learner = effect.learner
                    self._by_learner[effect.learner] = conn
                frames = session.frames_for(effect, next(self._message_ids), self.config.wire, self.vclock.as_dict())
                self._queue(conn, frames, bulk=False)
        elif isinstance(effect, SendUpdate):
            # Encoded lazily, when a connection gets to it, from the newest version (see FrameSet).
            build = functools.partial(self._update_frames_async, effect.fragment)
            for learner in effect.learners:
                conn = self._by_learner.get(learner)
                if conn is not None:
                    self._queue(conn, build, bulk=True, key=effect.fragment)
        elif isinstance(effect, ArmTimer):
            delay = max(0.0, effect.at - self.clock())
            asyncio.get_running_loop().call_later(delay, self._fire, TimerFired(effect.fragment, effect.round))
        elif isinstance(effect, Drop):
            conn = self._by_learner.get(effect.learner) if effect.learner is not None else self._conns.get(effect.conn)
            if conn is not None:
                await self._close(conn, effect.reason)
        elif isinstance(effect, WriteCheckpoint):
            if self.config.checkpoint_dir:
                await asyncio.get_running_loop().run_in_executor(self._core, self._write_checkpoint, effect.reason)
        elif isinstance(effect, Merged):
            self.metrics.merges += 1
            self.metrics.grace_s_last = effect.grace_s
            self.metrics.observe_round(effect.round_s)
        elif isinstance(effect, Log):
            log.log(logging.WARNING if effect.level == "warning" else logging.INFO, effect.text)

    async def _update_frames_async(self, fragment: int) -> "FrameSet":
        return await asyncio.get_running_loop().run_in_executor(self._core, self._update_frames, fragment)

    def _update_frames(self, fragment: int) -> "FrameSet":
        """The frames of the current version of `fragment`. Runs on the core thread, between two
        events, so the fragment is not being merged into meanwhile. Connections sending the same
        version share one FrameSet; it is freed when the last of them has sent it."""
        version = self.state.fragments[fragment].version
        cached = self._frame_sets.get(fragment)
        if cached is not None and cached.version == version:
            return cached
        codec, version, values = core.update_values(self.state, fragment)
        frames = FrameSet(
            version,
            session.update_frames(fragment, version, codec, values, next(self._message_ids), self.config.wire, self.vclock.as_dict()),
        )
        self._frame_sets[fragment] = frames
        return frames

    def _fire(self, event: TimerFired) -> None:
        if not self._stopping.is_set():
            try:
                self._events.put_nowait(event)
            except asyncio.QueueFull:
                # Never lose a timer: hand it to a task that waits for room.
                self._spawn(self._events.put(event))

    def _spawn(self, coro) -> None:
        """A small follow-up task, tracked until done (awaited at stop, its failure logged)."""
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._finished)

    def _finished(self, task: asyncio.Task) -> None:
        self._background.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("background task failed: %r", task.exception())

    def _conn_for(self, effect) -> Connection | None:
        if getattr(effect, "conn", None) is not None:
            return self._conns.get(effect.conn)
        return self._by_learner.get(effect.learner)

    def _queue(self, conn: Connection, frames, *, bulk: bool, key: object = None) -> None:
        try:
            if bulk:
                conn.send_bulk(frames, key)
            else:
                conn.send_control(frames)
        except SlowPeerError as exc:
            self.metrics.dropped_slow += 1
            log.warning("dropping learner %s: it does not read (%s)", conn.learner, exc)
            self._spawn(self._close(conn, f"slow peer: {exc}"))

    def _write_checkpoint(self, reason: str) -> None:
        """Runs on the core thread, between two events."""
        try:
            written = store.write(self.config.checkpoint_dir, self.state, self.config.checkpoints_kept)
        except store.StoreError as exc:
            self.metrics.checkpoint_failures += 1
            log.error("%s", exc)
            return
        self.metrics.checkpoints += 1
        log.info("checkpoint %s (%d bytes, %s)", written.path.name, written.bytes, reason)

    # ---- websockets -----------------------------------------------------------------------------

    async def _ws(self, request: web.Request) -> web.StreamResponse:
        if not bearer_matches(request.headers.get("Authorization"), self.config.auth_token):
            self.metrics.count(self.metrics.wire_errors, "unauthorized")
            log.warning("refused websocket from %s: missing or wrong token", request.remote)
            raise web.HTTPUnauthorized(text="missing or wrong bearer token\n")
        if self._stopping.is_set():
            raise web.HTTPServiceUnavailable(text="syncer shutting down\n")
        ws = web.WebSocketResponse(max_msg_size=self.config.wire.max_msg_size, heartbeat=self.config.heartbeat_s)
        await ws.prepare(request)
        conn = Connection(next(self._conn_ids), ws, self.config.queues, sent=self._count_sent)
        self._conns[conn.conn_id] = conn
        reassembler = wire.Reassembler(self.config.wire, accepted=LEARNER_KINDS)  # refused before any buffer
        writer = asyncio.create_task(self._write(conn), name=f"ddiloco-writer-{conn.conn_id}")
        try:
            async for msg in ws:
                if msg.type is not WSMsgType.BINARY:
                    if msg.type is WSMsgType.TEXT:
                        await self._refuse(conn, wire.WireError(wire.ErrorCode.BAD_FRAME, "text frames are not part of the protocol"))
                        break
                    continue
                self.metrics.bytes_in += len(msg.data)
                self.metrics.frames_in += 1
                if not await self._on_frame(conn, reassembler, msg.data):
                    break
        finally:
            writer.cancel()
            await self._forget(conn, "connection closed")
        return ws

    async def _write(self, conn: Connection) -> None:
        try:
            await conn.write_loop()
        except SlowPeerError as exc:
            self.metrics.dropped_slow += 1
            log.warning("dropping learner %s: %s", conn.learner, exc)
            conn.closed = True
            await conn.ws.close(code=1008, message=b"slow peer")
        except (ConnectionError, RuntimeError) as exc:  # the socket went away under the writer
            log.info("connection %d: writer stopped: %s", conn.conn_id, exc)
            conn.closed = True

    async def _on_frame(self, conn: Connection, reassembler: "wire.Reassembler", data: bytes) -> bool:
        """Decode one frame; False when the connection must close."""
        try:
            message = reassembler.feed(data)
            if message is None:
                return True
            if isinstance(message, msg.LocalState) and conn.learner is not None:
                await self._events.put(_LocalStateIn(conn.learner, message.snapshot, bytes(message.payload), message.sha256))
                return True
            event = session.event_for(message, conn.conn_id, conn.learner, self.state.layout)
        except wire.WireError as exc:
            return await self._refuse(conn, exc)
        except session.SessionError as exc:
            return await self._refuse(conn, exc.as_wire_error())
        if event is None:
            return True
        if isinstance(event, Disconnect):  # a goodbye: the learner is gone, and says why
            await self._forget(conn, event.reason)
            return False
        await self._events.put((event, message.clock))
        return True

    async def _refuse(self, conn: Connection, exc: "wire.WireError") -> bool:
        """Bad input: an error frame, a log line, a metric; the daemon and its state are untouched."""
        code = exc.code.name.lower() if hasattr(exc.code, "name") else str(exc.code)
        self.metrics.count(self.metrics.wire_errors, code)
        log.warning("learner %s (connection %d): %s", conn.learner, conn.conn_id, exc)
        frames = session.error_frames(exc, next(self._message_ids), self.config.wire)
        try:
            conn.send_control(frames)
        except SlowPeerError:
            pass  # it is being closed anyway
        fatal = session.is_fatal(exc)
        if fatal:
            await self._close(conn, str(exc))
        return not fatal

    async def _close(self, conn: Connection, reason: str) -> None:
        if conn.closed:
            return
        await conn.flush_control(CLOSE_FLUSH_S_MAX)
        conn.closed = True
        conn.wake.set()
        await conn.ws.close(code=1008, message=reason[:120].encode())

    async def _forget(self, conn: Connection, reason: str) -> None:
        conn.closed = True
        self._conns.pop(conn.conn_id, None)
        if conn.learner is not None and self._by_learner.get(conn.learner) is conn:
            del self._by_learner[conn.learner]
            if not self._stopping.is_set():
                await self._events.put(Disconnect(conn.learner, reason))

    # ---- HTTP -----------------------------------------------------------------------------------

    def _count_sent(self, frame_bytes: int) -> None:
        self.metrics.bytes_out += frame_bytes
        self.metrics.frames_out += 1

    def _authorized(self, request: web.Request) -> bool:
        return self.config.auth_token is not None and bearer_matches(request.headers.get("Authorization"), self.config.auth_token)

    async def _healthz(self, request: web.Request) -> web.Response:
        if self._core_task.done():  # the core stopped on a bug: the daemon no longer syncs anything
            raise web.HTTPServiceUnavailable(text="the syncer core has stopped\n")
        return web.Response(text="ok\n")

    async def _metrics(self, request: web.Request) -> web.Response:
        return web.Response(text=render_prometheus(self.metrics, self.state), content_type="text/plain", charset="utf-8")

    async def _status(self, request: web.Request) -> web.Response:
        doc = status_document(self.state, self.metrics, self.clock(), self.clock() - self.started_at)
        return web.Response(body=orjson.dumps(doc), content_type="application/json")

    async def _checkpoint_now(self, request: web.Request) -> web.Response:
        if not self._authorized(request):
            raise web.HTTPUnauthorized(text="this endpoint changes state: bearer token required\n")
        if not self.config.checkpoint_dir:
            raise web.HTTPConflict(text="no checkpoint directory configured\n")
        if not self.state.holds_parameters:
            raise web.HTTPConflict(text="the syncer holds no parameters yet: nothing to checkpoint\n")
        await asyncio.get_running_loop().run_in_executor(self._core, self._write_checkpoint, "requested over HTTP")
        return web.Response(text="checkpoint written\n")

    async def _snapshot_now(self, request: web.Request) -> web.Response:
        """Take a consistent snapshot; answers when it is complete, with its manifest's summary."""
        if not self._authorized(request):
            raise web.HTTPUnauthorized(text="this endpoint writes state: bearer token required\n")
        done = asyncio.get_running_loop().create_future()
        await self._events.put(_SnapshotStart("requested over HTTP", done))
        try:
            result = await asyncio.wait_for(done, self.config.snapshot_wait_s_max + 30)
        except snapshots.SnapshotError as exc:
            raise web.HTTPConflict(text=f"{exc}\n") from None
        return web.Response(body=orjson.dumps(result), content_type="application/json")

    async def _snapshot_timer(self) -> None:
        while not self._stopping.is_set():
            await asyncio.sleep(self.config.snapshot_every_s)
            if self._snapshot is None and self.state.holds_parameters and self._by_learner:
                done = asyncio.get_running_loop().create_future()
                done.add_done_callback(lambda f: f.exception())  # a failure is logged where it happens
                await self._events.put(_SnapshotStart("timer", done))

    async def _snapshot_step(self, item) -> None:
        """Start a snapshot, take a learner's local state, or give up waiting (net.snapshot)."""
        loop = asyncio.get_running_loop()
        if isinstance(item, _SnapshotStart):
            if item.done.done():
                return
            problem = (
                "no snapshot directory configured" if self.config.snapshot_dir is None
                else "the syncer holds no parameters yet" if not self.state.holds_parameters
                else f"snapshot {self._snapshot.ident} is still being taken" if self._snapshot is not None else None
            )
            if problem:
                item.done.set_exception(snapshots.SnapshotError(f"no snapshot: {problem}"))
                return
            learners = {i: self.state.learners[i].name for i in self._by_learner if i in self.state.learners}
            ident = next(self._snapshot_ids)
            try:
                self._snapshot = await loop.run_in_executor(
                    self._core, snapshots.begin, self.config.snapshot_dir, ident, self.state, learners,
                    self.vclock.as_dict(), self.clock(),
                )
            except snapshots.SnapshotError as exc:
                log.error("%s", exc)
                item.done.set_exception(exc)
                return
            self._snapshot_waiters.append(item.done)
            log.info("snapshot %d started (%s): syncer state recorded, markers to %d learners", ident, item.reason, len(learners))
            for learner in learners:
                frames = session.marker_frames(ident, next(self._message_ids), self.config.wire, self.vclock.as_dict())
                self._queue(self._by_learner[learner], frames, bulk=False)
            loop.call_later(self.config.snapshot_wait_s_max, lambda: self._fire_snapshot(_SnapshotTimeout(ident)))
        snap = self._snapshot
        if snap is None or getattr(item, "snapshot", snap.ident) != snap.ident:
            if isinstance(item, _LocalStateIn):
                log.warning("learner %d: a local state for snapshot %d, which is not being taken", item.learner, item.snapshot)
            return
        if isinstance(item, _LocalStateIn):
            problem = await loop.run_in_executor(self._core, snapshots.local_state, snap, item.learner, item.data, item.sha256)
            if problem:
                log.warning("snapshot %d: %s", snap.ident, problem)
        if snapshots.complete(snap) or isinstance(item, _SnapshotTimeout):
            await self._finish_snapshot(snap)

    async def _finish_snapshot(self, snap: snapshots.Snapshot) -> None:
        self._snapshot = None
        waiters, self._snapshot_waiters = self._snapshot_waiters, []
        try:
            path = await asyncio.get_running_loop().run_in_executor(
                self._core, snapshots.finish, snap, self.clock(), self.config.snapshots_kept
            )
        except snapshots.SnapshotError as exc:
            log.error("%s", exc)
            snapshots.abandon(snap)
            for w in waiters:
                if not w.done():
                    w.set_exception(exc)
            return
        result = {"snapshot": snap.ident, "directory": str(path), "learners": len(snap.states),
                  "inflight": len(snap.inflight), "left_out": {str(k): v for k, v in snap.left_out.items()}}
        log.info("snapshot %d complete: %s (%d learners, %d messages in flight, %d left out)",
                 snap.ident, path.name, len(snap.states), len(snap.inflight), len(snap.left_out))
        for w in waiters:
            if not w.done():
                w.set_result(result)

    def _fire_snapshot(self, item: _SnapshotTimeout) -> None:
        if not self._stopping.is_set():
            self._spawn(self._events.put(item))

    async def _page(self, request: web.Request) -> web.Response:
        return web.Response(text=_PAGE, content_type="text/html")


_PAGE = """<!doctype html><meta charset="utf-8"><title>ddiloco syncer</title>
<style>body{font:14px monospace;margin:2em}td,th{padding:2px 10px;text-align:left}</style>
<h1>ddiloco syncer</h1><div id="s">loading...</div>
<script>
async function tick(){
  const s = await (await fetch('status')).json();
  let h = `<p>global step ${s.global_step} &middot; merges ${s.merges} &middot; up ${s.uptime_s}s</p>`;
  h += '<table><tr><th>learner</th><th>status</th><th>step</th><th>seen</th></tr>';
  for (const l of s.learners) h += `<tr><td>${l.id} ${l.name}</td><td>${l.status}</td><td>${l.step}</td><td>${l.last_seen_s_ago}s ago</td></tr>`;
  h += '</table><table><tr><th>fragment</th><th>version</th></tr>';
  for (const f of s.fragments) h += `<tr><td>${f.index}</td><td>${f.version}</td></tr>`;
  h += '</table><h3>last decisions</h3>';
  for (const d of s.decisions.slice(-8).reverse()) h += `<div>fragment ${d.fragment} v${d.version}: ${d.reason}</div>`;
  h += `<h3>tokens</h3><pre>${JSON.stringify(s.ledger)}</pre>`;
  document.getElementById('s').innerHTML = h;
}
tick(); setInterval(tick, 1000);
</script>
"""
