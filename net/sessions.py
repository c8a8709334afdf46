"""The learners' websockets on the daemon's side, and the shell's link to them.

The event loop owns the connections: it reads frames, reassembles messages and queues them for the
core thread (net.items.Incoming), and writes what the core sends. `Sessions` is also the link of the
shell (net.shell.Link), whose methods run on the core thread: the frames are built there, between
two events (an update's values are copied into its frames while the fragment cannot change), and
handed to the event loop once (`call_soon_threadsafe`).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import Callable

import numpy as np
from aiohttp import WSMsgType, web

from ddiloco.core.events import Log, Merged, SendWelcome
from ddiloco.core.syncer import SyncerState
from ddiloco.net import lane, session, wire
from ddiloco.net import messages as msg
from ddiloco.net.auth import bearer_matches
from ddiloco.net.budget import ByteBudget
from ddiloco.net.checkpoints import Checkpoints
from ddiloco.net.connection import Connection, SlowPeerError
from ddiloco.net.core_loop import CoreLoop
from ddiloco.net.guard import Guard
from ddiloco.net.items import Closed, Incoming, Opened, Wake
from ddiloco.net.messages import LEARNER_KINDS
from ddiloco.net.recorder import Recorder
from ddiloco.net.shell import Control
from ddiloco.net.telemetry import Metrics

__all__ = ["Sessions"]

log = logging.getLogger("ddiloco.syncer")
CLOSE_FLUSH_S_MAX = 1.0  # how long a closing connection may take to send the error that explains it


class Sessions:
    def __init__(
        self,
        config,
        metrics: Metrics,
        core: CoreLoop,
        recorder: Recorder,
        checkpoints: Checkpoints,
        clock: Callable[[], float],
        spawn: Callable,
        stopping: Callable[[], bool],
        guard: Guard | None = None,
    ):
        self.config, self.metrics, self.core, self.guard = config, metrics, core, guard
        self.recorder, self.checkpoints, self.clock = recorder, checkpoints, clock
        self._spawn, self._stopping = spawn, stopping
        self.conns: dict[int, Connection] = {}  # the event loop's: touched on that thread only
        self._conn_ids = itertools.count(1)
        self._message_ids = itertools.count(1)
        self.loop: asyncio.AbstractEventLoop | None = None
        self._outbox: list[Callable[[], None]] = []  # the core thread's, handed over by `flush`
        # what the readers hold in messages the core has not handled yet (the event loop's)
        self.inbound = ByteBudget(config.inbound_bytes_queued_max)
        self.lanes: lane.LaneListener | None = None  # the server's, when it has a lane port
        self.lane_offers: dict[bytes, Connection] = {}  # token -> the websocket that offered it

    def message_id(self) -> int:
        return next(self._message_ids)

    # ---- the event loop's side ----------------------------------------------------------------

    async def serve(self, request: web.Request) -> web.StreamResponse:
        if not bearer_matches(request.headers.get("Authorization"), self.config.auth_token):
            self.metrics.count(self.metrics.wire_errors, "unauthorized")
            log.warning("refused websocket from %s: missing or wrong token", request.remote)
            raise web.HTTPUnauthorized(text="missing or wrong bearer token\n")
        if self._stopping():
            raise web.HTTPServiceUnavailable(text="syncer shutting down\n")
        ws = web.WebSocketResponse(max_msg_size=self.config.wire.max_msg_size, heartbeat=self.config.heartbeat_s)
        if self.guard is not None:
            self.guard.upgrading(request)  # frame deadlines from here (net.guard)
        await ws.prepare(request)
        conn = Connection(next(self._conn_ids), ws, self.config.queues, sent=self._count_sent)
        self.conns[conn.conn_id] = conn
        offer = self._offer_lane(conn, request.headers.get(lane.LANE_HEADER))
        await self.core.submit(Opened(conn.conn_id))
        reassembler = wire.Reassembler(self.config.wire, accepted=LEARNER_KINDS)  # refused before any buffer
        pending_bytes = 0  # of the message being reassembled
        writer = asyncio.create_task(self._write(conn), name=f"ddiloco-writer-{conn.conn_id}")
        try:
            async for frame in ws:
                if frame.type is not WSMsgType.BINARY:
                    if frame.type is WSMsgType.TEXT:
                        exc = wire.WireError(wire.ErrorCode.BAD_FRAME, "text frames are not part of the protocol")
                        if self.refuse(conn.conn_id, exc):
                            await self.shut(conn, str(exc))
                        break
                    continue
                try:
                    message, frame_bytes = await lane.receive_frame(reassembler, frame.data, conn.lane)
                except wire.WireError as exc:
                    pending_bytes = 0
                    if self.refuse(conn.conn_id, exc):
                        await self.shut(conn, str(exc))  # the error frame goes out before the close
                        break
                    continue
                except lane.LaneError as exc:
                    log.warning("learner %s (connection %d): %s", conn.learner, conn.conn_id, exc)
                    break
                self.metrics.bytes_in += frame_bytes
                self.metrics.lane_bytes_in += frame_bytes - len(frame.data)
                self.metrics.frames_in += 1
                pending_bytes += frame_bytes
                if message is not None:
                    nbytes, pending_bytes = pending_bytes, 0
                    await self.inbound.take(nbytes)  # waits while the core is that far behind
                    await self.core.submit(Incoming(conn.conn_id, message, nbytes))
                    if isinstance(message, msg.Bye):  # a goodbye: the learner is gone, and says why
                        break
        finally:
            writer.cancel()
            conn.closed = True
            self.conns.pop(conn.conn_id, None)
            if offer is not None and self.lane_offers.get(offer) is conn:
                del self.lane_offers[offer]
            _close_lane(conn)
            if not self._stopping():
                await self.core.submit(Closed(conn.conn_id, "connection closed"))
        return ws

    def _offer_lane(self, conn: Connection, header: str | None) -> bytes | None:
        """Keep the token of the lane this websocket's learner offers (net.lane), where the daemon
        has a lane: the key its lane connection must present."""
        token = lane.parse_token(header)
        if header is None or self.lanes is None:
            return None
        if token is None or token in self.lane_offers:
            log.info("connection %d: lane offer ignored (not 32 hex characters, or a token in use)", conn.conn_id)
            return None
        self.lane_offers[token] = conn
        return token

    def attach_lane(self, token: bytes, sock) -> bool:
        """The lane listener's: give the connection that offered `token` its lane."""
        conn = self.lane_offers.pop(token, None)
        if conn is None or conn.closed:
            return False
        conn.lane = lane.Lane(sock, self.lanes.limits)
        # Before the welcome as a rule (the learner opens it as soon as its websocket is up): the
        # connection has no learner id yet, and the line names the connection only.
        who = (
            f"learner {conn.learner} (connection {conn.conn_id})"
            if conn.learner is not None
            else f"connection {conn.conn_id}"
        )
        log.info("%s: lane attached", who)
        return True

    async def _write(self, conn: Connection) -> None:
        try:
            await conn.write_loop()
        except SlowPeerError as exc:
            self.metrics.dropped_slow += 1
            log.warning("dropping learner %s: %s", conn.learner, exc)
            conn.closed = True
            await conn.ws.close(code=1008, message=b"slow peer")
        except lane.LaneError as exc:  # the lane's bytes are lost: the connection cannot go on
            log.warning("learner %s (connection %d): %s", conn.learner, conn.conn_id, exc)
            conn.closed = True
            await conn.ws.close(code=1011, message=b"lane failed")
        except (ConnectionError, RuntimeError) as exc:  # the socket went away under the writer
            log.info("connection %d: writer stopped: %s", conn.conn_id, exc)
            conn.closed = True

    def refuse(self, conn_id: int, exc: wire.WireError) -> bool:
        """Bad input: an error frame, a log line, a metric; the daemon and its state are untouched.
        True when the error is fatal: the caller closes the connection."""
        conn = self.conns.get(conn_id)
        if conn is None:
            return False
        code = exc.code.name.lower() if hasattr(exc.code, "name") else str(exc.code)
        self.metrics.count(self.metrics.wire_errors, code)
        log.warning("learner %s (connection %d): %s", conn.learner, conn.conn_id, exc)
        try:
            conn.send_control(session.error_frames(exc, self.message_id(), self.config.wire))
        except SlowPeerError:
            pass  # it is being closed anyway
        return session.is_fatal(exc)

    def refuse_message(self, conn_id: int, exc: wire.WireError) -> None:
        """A message the core thread found out of place or malformed (session.SessionError)."""
        conn = self.conns.get(conn_id)
        if conn is not None and self.refuse(conn_id, exc):
            self._spawn(self.shut(conn, str(exc)))

    async def shut(self, conn: Connection, reason: str) -> None:
        if conn.closed:
            return
        await conn.flush_control(CLOSE_FLUSH_S_MAX)
        conn.closed = True
        conn.wake.set()
        _close_lane(conn)
        await conn.ws.close(code=1008, message=reason[:120].encode())

    async def close_all(self) -> None:
        for conn in list(self.conns.values()):
            conn.closed = True
            conn.wake.set()
            _close_lane(conn)
            await conn.ws.close(code=1001, message=b"syncer shutting down")

    def _queue(self, conn_id: int, frames, *, bulk: bool, key: object = None, learner: int | None = None) -> None:
        conn = self.conns.get(conn_id)
        if conn is None or conn.closed:
            return
        if learner is not None:
            conn.learner = learner
        try:
            if bulk:
                conn.send_bulk(frames, key)
            else:
                conn.send_control(frames)
        except SlowPeerError as exc:
            self.metrics.dropped_slow += 1
            log.warning("dropping learner %s: it does not read (%s)", conn.learner, exc)
            self._spawn(self.shut(conn, f"slow peer: {exc}"))

    def _close_by_id(self, conn_id: int, reason: str) -> None:
        conn = self.conns.get(conn_id)
        if conn is not None:
            self._spawn(self.shut(conn, reason))

    def _arm(self, at: float, token: int) -> None:
        self.loop.call_later(max(0.0, at - self.clock()), self._fire, Wake(token))

    def _fire(self, item: Wake) -> None:
        if not self._stopping() and not self.core.submit_nowait(item):
            self._spawn(self.core.submit(item))  # never lose a timer: a task waits for room

    def _count_sent(self, frame_bytes: int, lane_bytes: int) -> None:
        self.metrics.bytes_out += frame_bytes
        self.metrics.lane_bytes_out += lane_bytes
        self.metrics.frames_out += 1

    # ---- the shell's link: called on the core thread ----------------------------------------

    def handled(self, item: object) -> None:
        """The core handled `item` (called on the core thread): its bytes return to the budget."""
        if isinstance(item, Incoming) and item.nbytes:
            # With what the step sends, in the same crossing (`flush`, which follows every item): a
            # crossing of its own cost a wake-up of the loop per message.
            nbytes = item.nbytes
            self.post(lambda: self.inbound.give_back(nbytes))

    def post(self, fn: Callable[[], None]) -> None:
        """Run `fn` on the event loop after this core step (what one step sends goes out together)."""
        self._outbox.append(fn)

    def flush(self) -> None:
        """Hand what this core step sends to the event loop, in one crossing, in the core's order."""
        if self._outbox:
            outbox, self._outbox = self._outbox, []
            self.loop.call_soon_threadsafe(_run_all, outbox)

    def send(self, conn: int, effect: Control) -> None:
        frames = session.frames_for(effect, self.message_id(), self.config.wire, self.recorder.vclock.as_dict())
        learner = effect.learner if isinstance(effect, SendWelcome) else None
        self.post(lambda: self._queue(conn, frames, bulk=False, learner=learner))

    def send_update(
        self,
        conns: tuple[int, ...],
        fragment: int,
        codec: str,
        version: int,
        values: np.ndarray,
        base_version: int = -1,
        block: int = 0,
        global_step: int = 0,
    ) -> None:
        # One set of frames per call, shared by every connection. A whole copy replaces a queued
        # whole copy of the fragment that has not started to go out (net.connection); a delta is
        # never replaced nor replaces (each one applies onto the one before it): a reader too slow
        # for the chain fills its bulk queue, is dropped and gets whole copies when it rejoins.
        frames = session.update_frames(
            fragment,
            version,
            codec,
            values,
            self.message_id(),
            self.config.wire,
            self.recorder.vclock.as_dict(),
            base_version=base_version,
            block=block,
            global_step=global_step,
        )
        key = fragment if base_version < 0 else None

        def queue() -> None:
            for conn in conns:
                self._queue(conn, frames, bulk=True, key=key)

        self.post(queue)

    def send_marker(self, conn: int, snapshot: int) -> None:
        frames = session.marker_frames(snapshot, self.message_id(), self.config.wire, self.recorder.vclock.as_dict())
        self.post(lambda: self._queue(conn, frames, bulk=False))

    def close(self, conn: int, reason: str) -> None:
        self.post(lambda: self._close_by_id(conn, reason))

    def wake(self, at: float, token: int) -> None:
        self.post(lambda: self._arm(at, token))

    def write_checkpoint(self, state: SyncerState, reason: str) -> None:
        self.checkpoints.write(state, reason)

    def merged(self, effect: Merged) -> None:
        self.metrics.observe_merged(effect, self.clock())

    def log(self, effect: Log) -> None:
        log.log(logging.WARNING if effect.level == "warning" else logging.INFO, effect.text)


def _close_lane(conn: Connection) -> None:
    """Close `conn`'s lane, if it has one: a reader or writer blocked on it returns at once (a closing
    connection must not wait out the lane's stall limit)."""
    if conn.lane is not None:
        conn.lane.close()


def _run_all(fns: list[Callable[[], None]]) -> None:
    for fn in fns:
        fn()
