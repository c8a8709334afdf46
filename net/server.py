"""The syncer daemon: the aiohttp server around the one shell (net.shell) and the sans-I/O core.

Composed of one module per concern: the core loop (net.core_loop: one queue of typed items,
net.items, handled on one thread), the websocket sessions and the shell's link (net.sessions), the
HTTP endpoints (net.http), recording (net.recorder: vector clock and event tape), checkpoints
(net.checkpoints) and consistent snapshots (net.snapshot.Taker). This module wires them and says
what the core thread does with each item. After each item the core thread publishes a frozen view
of the state (net.telemetry.SyncerView) that /status and /metrics read.

HTTP: `/healthz`, `/metrics` (Prometheus), `/status` (JSON), `/` (a small live page), `POST
/checkpoint` and `POST /snapshot` (a consistent snapshot of syncer, learners and messages in flight,
net.snapshot; token required). `/ws` is the learners' websocket; with a token configured the upgrade
is refused with 401 unless `Authorization: Bearer <token>` matches. Every connection goes through a
guard (net.guard): a deadline for its HTTP request, one for each websocket frame, a limit per address.

Faults: no single message from any peer may take the daemon down.

- An exception while the core thread handles one learner's item (translating its message, the
  core's `handle` of its event, the shell routing the effects) is that learner's error: one ERROR
  line with the learner, the connection, the kind and the traceback; the learner gets an `internal`
  error frame with the exception's text and is disconnected (a Disconnect reaches the core, which
  stops waiting for it); the core serves the others on.
- A broken invariant is the core's own failure and stops the daemon: an AssertionError anywhere,
  an exception on an item no learner sent (a timer, a merge cost, a snapshot step), or a learner's
  fault after which the core's token ledger no longer balances. The daemon closes every connection,
  writes a last checkpoint only of a state that is whole, and ends with `CoreFailed` (exit status 1).
  Whole: the core completed its last event and the failure came after (in routing its effects, in
  a snapshot step). A failure inside `core.handle` may leave the state half-changed (the core updates
  its fragments in place, and copying tens of millions of floats per event to keep the one before
  is not affordable): that state is never checkpointed, and the newest checkpoint already on disk,
  written between two events, is the last good state a restart resumes from.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import ssl
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from aiohttp import web

from ddiloco.core import syncer as core
from ddiloco.core.events import Disconnect
from ddiloco.core.vclock import VClock
from ddiloco.net import messages as msg
from ddiloco.net import recording, session, store, tls, wire
from ddiloco.net import snapshot as snapshots
from ddiloco.net.checkpoints import Checkpoints
from ddiloco.net.connection import QueueLimits
from ddiloco.net.core_loop import CoreFailed, CoreLoop
from ddiloco.net.guard import Guard, GuardLimits
from ddiloco.net.http import routes
from ddiloco.net.items import (
    Closed,
    CoreItem,
    Incoming,
    Opened,
    SnapshotStart,
    SnapshotTimeout,
    Wake,
)
from ddiloco.net.lane import LaneLimits, LaneListener
from ddiloco.net.recorder import SYNCER_CLOCK_NAME, Recorder
from ddiloco.net.sessions import Sessions
from ddiloco.net.shell import Shell
from ddiloco.net.telemetry import Metrics, SyncerView, view_of

__all__ = ["CORE_STALL_S_MAX_DEFAULT", "SYNCER_CLOCK_NAME", "CoreFailed", "ServerConfig", "SyncerServer", "use_uvloop"]

log = logging.getLogger("ddiloco.syncer")
ERROR_TEXT_CHARS_MAX = 500  # of an exception's text sent to the learner it concerns (the log has all of it)
# Under load, the view (/status, /metrics, the page) is at most this old (net.server._refresh_view).
VIEW_REFRESH_S = 0.1
CORE_STALL_S_MAX_DEFAULT = 30.0  # a core that completes nothing this long while work waits is unhealthy


@dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 0  # 0: any free port
    auth_token: str | None = None
    checkpoint_dir: Path | None = None
    checkpoints_kept: int = store.CHECKPOINTS_KEPT_DEFAULT
    run_id: str | None = None  # the run the checkpoints belong to (net.store): None for a fresh run, kept on resume
    checkpoint_overwrite: bool = False  # a fresh run may take a directory holding another run's checkpoints
    events_queued_max: int = 4096
    # the bytes of learners' messages read and not yet handled by the core (net.budget): past it the
    # readers wait, and the learners' sockets with them
    inbound_bytes_queued_max: int = 256 << 20
    heartbeat_s: float = 20.0  # websocket ping interval; a peer silent for half of it is closed
    queues: QueueLimits = field(default_factory=QueueLimits)
    wire: wire.WireLimits = field(default_factory=wire.WireLimits)
    snapshot_dir: Path | None = None  # where consistent snapshots go (net.snapshot); None: none taken
    snapshot_every_s: float = 0.0  # 0: only on request
    snapshot_wait_s_max: float = snapshots.WAIT_S_MAX_DEFAULT
    snapshots_kept: int = snapshots.SNAPSHOTS_KEPT_DEFAULT
    # PEM files: with both, the daemon serves https:// and wss:// only (net.tls)
    tls_cert: Path | None = None
    tls_key: Path | None = None
    # /healthz fails when the core has completed no item this long while items wait (a merge of the
    # largest fragments takes well under a second; 30 s is a core that is stuck, not busy)
    core_stall_s_max: float = CORE_STALL_S_MAX_DEFAULT
    guard: GuardLimits = field(default_factory=GuardLimits)  # slow peers and connections per address
    # The lane (net.lane): bulk frames' data on a TCP port beside the websockets (with TLS where the
    # daemon serves it), 0: any free port (a learner asks GET /lane). None: no lane, everything on
    # the websockets.
    lane_port: int | None = 0
    lane: LaneLimits = field(default_factory=LaneLimits)

    def __post_init__(self) -> None:
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("tls_cert and tls_key go together: give both or neither")
        if self.core_stall_s_max <= 0:
            raise ValueError(f"core_stall_s_max must be positive, got {self.core_stall_s_max}")
        if self.snapshot_every_s < 0 or self.snapshot_wait_s_max <= 0 or self.snapshots_kept < 1:
            raise ValueError("snapshot_every_s must be >= 0, snapshot_wait_s_max and snapshots_kept positive")
        if self.snapshot_every_s and self.snapshot_dir is None:
            raise ValueError("snapshot_every_s needs a snapshot_dir")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if self.lane_port is not None and not 0 <= self.lane_port <= 65535:
            raise ValueError(f"lane_port must be in [0, 65535] or None, got {self.lane_port}")
        if self.events_queued_max < 1 or self.heartbeat_s <= 0 or self.checkpoints_kept < 1:
            raise ValueError("events_queued_max, heartbeat_s and checkpoints_kept must be positive")
        if self.inbound_bytes_queued_max < 1:
            raise ValueError(f"inbound_bytes_queued_max must be positive, got {self.inbound_bytes_queued_max}")


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
        tape: recording.TapeWriter | None = None,
    ):
        self.config = config
        self.clock = clock
        self.metrics = Metrics()
        self.started_at = clock()
        self.recorder = Recorder(tape)
        # Raises StoreError at once when the directory belongs to another run (net.store).
        checkpoint_store = (
            None
            if config.checkpoint_dir is None
            else store.CheckpointStore.open(
                config.checkpoint_dir,
                config.run_id,
                overwrite=config.checkpoint_overwrite,
                keep=config.checkpoints_kept,
            )
        )
        self.checkpoints = Checkpoints(checkpoint_store, self.metrics)
        self.snapshots = snapshots.Taker(config.snapshot_dir, config.snapshots_kept)
        self.core: CoreLoop[CoreItem] = CoreLoop(self._on_item, config.events_queued_max, clock)
        self.guard = Guard(config.guard)
        self.failure: CoreFailed | None = None  # set when the core failed and the daemon stopped on it
        self._in_core = False  # between `before` and `observe`: inside core.handle, the state may be half-changed
        self._stopped: asyncio.Event | None = None
        self._watch: asyncio.Task | None = None
        self._listener: asyncio.AbstractServer | None = None
        self._stopping = False
        self._background: set[asyncio.Task] = set()
        self._snapshot_waiters: list[asyncio.Future] = []  # the event loop's
        # Set once the first stage of the kernels' warm-up has run (None: no warm-up).
        self.warmed_up: threading.Event | None = None
        self._loading = False  # the current event began before the warm-up's first stage was done
        self.sessions = Sessions(
            config,
            self.metrics,
            self.core,
            self.recorder,
            self.checkpoints,
            clock,
            self._spawn,
            lambda: self._stopping,
            self.guard,
        )
        self.shell = Shell(
            state,
            self.sessions,
            merge_cost=self._merge_cost,
            stopwatch=time.perf_counter,
            before=self._before,
            observe=self._after,
        )
        # What the HTTP handlers read, replaced by the core thread (`_refresh_view`)
        self.view: SyncerView = view_of(state)
        self._view_at = float("-inf")
        self._runner: web.AppRunner | None = None
        self.port: int | None = None

    @property
    def state(self) -> core.SyncerState:
        """The core thread's state (tests and the bench read it; the HTTP handlers read `view`)."""
        return self.shell.state

    @property
    def vclock(self) -> VClock:
        """The syncer's vector clock (replaced by the core thread after each event)."""
        return self.recorder.vclock

    @property
    def tape(self) -> recording.TapeWriter | None:
        return self.recorder.tape

    @tape.setter
    def tape(self, tape: recording.TapeWriter | None) -> None:
        """Set before `start`: a tape is opened once the checkpoint directory has been accepted."""
        assert self._runner is None, "the tape is set before the daemon starts"
        self.recorder.tape = tape

    @property
    def core_seconds(self) -> float:
        """Wall time spent inside handle(), for the bench."""
        return self.shell.core_s

    # ---- lifecycle ------------------------------------------------------------------------------

    def app(self) -> web.Application:
        app = web.Application(client_max_size=1 << 20, middlewares=[self.guard.middleware])
        app.add_routes(routes(self))
        return app

    async def start(self) -> int:
        # Made before anything starts: a certificate that cannot be used fails the start, never a handshake.
        ssl_context = tls.server_context(self.config.tls_cert, self.config.tls_key) if self.config.tls_cert else None
        loop = asyncio.get_running_loop()
        self.sessions.loop = loop
        self._stopped = asyncio.Event()
        self.core.start()
        self._watch = loop.create_task(self._stop_on_core_failure(), name="ddiloco-core-watch")
        self._runner = web.AppRunner(self.app(), handle_signals=False, access_log=None)
        await self._runner.setup()
        # Our own listener rather than a TCPSite: every connection's protocol is wrapped by the guard.
        self._listener = await loop.create_server(
            self.guard.wrap(self._runner.server),
            self.config.host,
            self.config.port,
            reuse_address=True,
            ssl=ssl_context,
        )
        self.port = self._listener.sockets[0].getsockname()[1]  # the port the OS chose for port 0
        self._start_lanes(ssl_context)
        if self.config.snapshot_every_s:
            self._spawn(self._snapshot_timer())
        log.info(
            "syncer listening on %s:%d%s", self.config.host, self.port, " (TLS: https, wss)" if ssl_context else ""
        )
        return self.port

    def _start_lanes(self, tls_context: ssl.SSLContext | None) -> None:
        if self.config.lane_port is None:
            return
        # A port that cannot be had fails the start as the websocket's port does (OSError).
        lanes = LaneListener(
            self.config.host, self.config.lane_port, self.config.lane, self.sessions.attach_lane, tls=tls_context
        )
        lanes.start()
        self.sessions.lanes = lanes
        log.info("lanes on %s:%d%s", self.config.host, lanes.port, " (TLS)" if tls_context is not None else "")

    async def stop(self, *, checkpoint: bool = True) -> None:
        """Close every connection, drain the core, write a last checkpoint (after a core failure: only
        of a state that is whole, see the module's docstring)."""
        if self._runner is None or self._stopping:
            return
        self._stopping = True
        if self._watch is not None and self._watch is not asyncio.current_task():
            self._watch.cancel()
        self._listener.close()  # no new connection from here on
        if self.sessions.lanes is not None:
            await self.sessions.lanes.close()
        await self.sessions.close_all()
        await self.core.stop()
        if self.core.failure is None:  # the last items may have come with the stop queued behind them
            self.view = await self.core.run_after_stop(lambda: view_of(self.shell.state))
        if self.core.failure is not None and self._in_core:
            checkpoint = False
            log.critical(
                "no last checkpoint: the core failed inside an event and its state may be half-changed; "
                "the newest checkpoint on disk is the last good state"
            )
        abandoned = await self.core.run_after_stop(self.snapshots.abandon)
        if abandoned is not None:
            log.warning("snapshot %d abandoned: the syncer is stopping", abandoned)
        self._answer_snapshot(snapshots.SnapshotError("the syncer stopped before the snapshot was complete"))
        await self.core.run_after_stop(lambda: self.recorder.close(self.state))
        for task in list(self._background):  # the connections are closed already: nothing left to do
            task.cancel()
        await asyncio.gather(*self._background, return_exceptions=True)
        if checkpoint and self.config.checkpoint_dir and self.state.holds_parameters:
            await self.core.run_after_stop(lambda: self.checkpoints.write(self.state, "shutdown"))
        await self._runner.cleanup()
        await self._listener.wait_closed()
        self.core.close()
        self._stopped.set()

    async def serve_forever(self, warmup: Sequence[Callable[[], None]] = ()) -> None:
        """Run until SIGTERM or SIGINT, then stop with a checkpoint. Raises CoreFailed when the core
        failed (the daemon has stopped by then). `warmup` (the kernels' loading, net.warmup) runs
        after the daemon listens, on a thread of its own (`start_warmup`)."""
        loop = asyncio.get_running_loop()
        signalled = asyncio.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, signalled.set)
        await self.start()
        if warmup:
            self.start_warmup(warmup)
        waits = [asyncio.ensure_future(signalled.wait()), asyncio.ensure_future(self._stopped.wait())]
        await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        for w in waits:
            w.cancel()
        if signalled.is_set() and self.failure is None:
            log.info("signal received: writing a last checkpoint and stopping")
        await self.stop()
        await self._stopped.wait()  # a stop begun by the core's failure
        if self.failure is not None:
            raise self.failure

    def start_warmup(self, stages: Sequence[Callable[[], None]]) -> threading.Thread:
        """Run the warm-up's stages in order on a thread of its own, while the core thread serves.
        A restarted syncer's learners reconnect meanwhile: nothing the core thread does waits for the
        warm-up (a hello's welcome and the resumed fragments need no kernel, and progress opens the
        rounds). A merge that comes before its kernels are loaded loads them itself (numba's compiler
        lock makes it wait for the one the warm-up is loading); the cost it reports is then capped at
        the syncer's estimate (`_merge_cost`), so loading kernels never widens the grace window."""
        assert self.warmed_up is None, "the warm-up runs once"
        warmed_up = self.warmed_up = threading.Event()

        def run() -> None:
            started = time.perf_counter()
            try:
                for i, stage in enumerate(stages):
                    stage()
                    if i == 0:
                        log.info("kernels warmed up in %.2f s", time.perf_counter() - started)
                        warmed_up.set()
                if len(stages) > 1:
                    log.info("all kernels warmed up in %.2f s", time.perf_counter() - started)
            except Exception as exc:  # a bug in the warm-up: the kernels then load at their first call
                log.error("kernel warm-up failed: %s: %s", type(exc).__name__, exc, exc_info=exc)
            finally:
                warmed_up.set()

        thread = threading.Thread(target=run, name="ddiloco-warmup", daemon=True)
        thread.start()
        return thread

    async def _stop_on_core_failure(self) -> None:
        failure = await self.core.failed()
        log.critical("stopping the daemon: %s", failure)
        self.failure = failure
        await self.stop()

    # ---- on the core thread -----------------------------------------------------------------------

    def _on_item(self, item: CoreItem) -> None:
        """What the core thread does with each queued item; then it publishes the view. A learner's
        item that fails is that learner's fault; any other failure escapes to the core loop (it stops)."""
        now = self.clock()
        try:
            self._dispatch(item, now)
        except AssertionError:
            raise  # a broken invariant, whoever's event it was
        except Exception as exc:
            if not isinstance(item, (Incoming, Opened, Closed)):
                raise  # a timer, a merge cost, a snapshot step: the core's own
            self._learner_fault(item, exc, now)
        finally:
            self.sessions.handled(item)
        self._in_core = False
        self._refresh_view(now)
        self.sessions.flush()

    def _refresh_view(self, now: float) -> None:
        """Take the view after an item when nothing else is queued for the core (so an idle daemon
        always shows its latest state), and under load at least every VIEW_REFRESH_S. Taken after
        every item it costs O(learners x fragments) per message: 1.4 ms at 256 learners of 16
        fragments, which a daemon that many learners report to could not afford."""
        if self.core.empty() or now - self._view_at >= VIEW_REFRESH_S:
            self.view = view_of(self.shell.state)
            self._view_at = now

    def _learner_fault(self, item: Incoming | Opened | Closed, exc: Exception, now: float) -> None:
        """One learner's item failed: log it with its traceback, drop that learner, go on."""
        conn = item.conn
        learner = self.shell.learner_on(conn)
        kind = type(item.message).__name__ if isinstance(item, Incoming) else type(item).__name__
        log.error(
            "learner %s (connection %d): handling its %s failed, dropping it: %s: %s",
            learner,
            conn,
            kind,
            type(exc).__name__,
            exc,
            exc_info=exc,
        )
        self.metrics.count(self.metrics.wire_errors, "internal")
        error = wire.WireError(
            msg.ErrorCode.INTERNAL,
            f"the syncer failed on this learner's {kind}: {type(exc).__name__}: {exc}"[:ERROR_TEXT_CHARS_MAX],
        )
        self.sessions.post(lambda: self.sessions.refuse_message(conn, error))
        if not isinstance(item, Closed):  # (a Closed item has taken the learner off the tables already)
            self.shell.closed(conn, f"internal error: {type(exc).__name__}", now)
        if self._in_core:  # the core raised half-way through the event: its books must still balance
            self.shell.state.ledger.check()

    def _dispatch(self, item: CoreItem, now: float) -> None:
        if isinstance(item, Incoming):
            self._incoming(item, now)
        elif isinstance(item, Opened):
            self.shell.opened(item.conn)
        elif isinstance(item, Closed):
            if not self._stopping:  # at stop no Disconnect reaches the core: the learners come back
                self.shell.closed(item.conn, item.reason, now)
        elif isinstance(item, Wake):
            self.shell.fire(item.token, now)
        elif isinstance(item, SnapshotStart):
            self._start_snapshot(item, now)
        else:
            assert isinstance(item, SnapshotTimeout), item
            self._snapshot_ended(self.snapshots.timeout(item.snapshot, now))

    def _incoming(self, item: Incoming, now: float) -> None:
        message, learner = item.message, self.shell.learner_on(item.conn)
        if isinstance(message, msg.LocalState):
            if learner is not None:
                problem, outcome = self.snapshots.local_state(
                    learner, message.snapshot, bytes(message.payload), message.sha256, now
                )
                if problem:
                    log.warning("%s", problem)
                self._snapshot_ended(outcome)
            return
        try:
            event = session.event_for(message, item.conn, learner, self.shell.state.layout)
        except session.SessionError as exc:
            wire_error = exc.as_wire_error()
            self.sessions.post(lambda: self.sessions.refuse_message(item.conn, wire_error))
            return
        if isinstance(event, Disconnect):  # a goodbye: the learner is gone, and says why
            self.shell.closed(item.conn, event.reason, now)
        elif event is not None:
            self.recorder.carried = message.clock
            self.shell.handle(event, now)

    def _before(self, event, now: float) -> None:
        self._loading = self.warmed_up is not None and not self.warmed_up.is_set()
        self.recorder.before(event, now)
        problem = self.snapshots.record(event)  # after the cut, before the learner's local state: in flight
        if problem:
            log.error("%s", problem)
        self._in_core = True  # core.handle runs next

    def _after(self, event, effects, state: core.SyncerState, now: float) -> None:
        self._in_core = False  # the core completed the event: its state is whole again
        self.recorder.after(event, effects, state, now)

    def _merge_cost(self, spent_s: float) -> tuple[float, float]:
        self.metrics.merge_kernel_s += spent_s
        self.metrics.merge_kernel_last_s = spent_s
        estimate = self.shell.state.timing.sync_s
        if self._loading and estimate is not None:
            # The event began before the warm-up's first stage was done: its time may be mostly the
            # loading of kernels, which says nothing of the next merges (the grace window's sync time).
            return min(spent_s, estimate), 0.0
        return spent_s, 0.0

    def _start_snapshot(self, item: SnapshotStart, now: float) -> None:
        state = self.shell.state
        learners = {i: state.learners[i].name for i in self.shell.conn_of if i in state.learners}
        try:
            snap = self.snapshots.start(state, learners, self.recorder.vclock.as_dict(), now)
        except snapshots.SnapshotError as exc:
            log.error("%s", exc)
            error = exc  # (the name `exc` is gone after the except block; the lambda runs later)
            self.sessions.post(lambda: _settle(item.done, None, error))
            return
        log.info(
            "snapshot %d started (%s): syncer state recorded, markers to %d learners",
            snap.ident,
            item.reason,
            len(learners),
        )
        self.sessions.post(lambda: self._snapshot_waiters.append(item.done))
        for learner in learners:
            self.sessions.send_marker(self.shell.conn_of[learner], snap.ident)
        self.sessions.post(lambda: self._arm_snapshot_timeout(snap.ident))

    def _snapshot_ended(self, outcome: snapshots.Outcome | None) -> None:
        if outcome is None:
            return
        if outcome.error is not None:
            log.error("%s", outcome.error)
            error = outcome.error
            self.sessions.post(lambda: self._answer_snapshot(error))
            return
        r = outcome.summary
        log.info(
            "snapshot %d complete: %s (%d learners, %d messages in flight, %d left out)",
            r["snapshot"],
            Path(r["directory"]).name,
            r["learners"],
            r["inflight"],
            len(r["left_out"]),
        )
        self.sessions.post(lambda: self._answer_snapshot(None, r))

    # ---- on the event loop --------------------------------------------------------------------------

    def _answer_snapshot(self, error: Exception | None, result: dict | None = None) -> None:
        waiters, self._snapshot_waiters = self._snapshot_waiters, []
        for w in waiters:
            _settle(w, result, error)

    def _arm_snapshot_timeout(self, ident: int) -> None:
        def due() -> None:
            if not self._stopping:
                self._spawn(self.core.submit(SnapshotTimeout(ident)))

        asyncio.get_running_loop().call_later(self.config.snapshot_wait_s_max, due)

    async def _snapshot_timer(self) -> None:
        while not self._stopping:
            await asyncio.sleep(self.config.snapshot_every_s)
            if self.view.holds_parameters and self.sessions.conns:
                done = asyncio.get_running_loop().create_future()
                done.add_done_callback(lambda f: f.exception())  # a failure is logged where it happens
                await self.core.submit(SnapshotStart("timer", done))

    def _spawn(self, coro) -> None:
        """A small follow-up task, tracked until done (awaited at stop, its failure logged)."""
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._finished)

    def _finished(self, task: asyncio.Task) -> None:
        self._background.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("background task failed: %r", task.exception())


def _settle(future: asyncio.Future, result: object, error: Exception | None) -> None:
    if future.done():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)
