"""The learner's side of the wire: an asyncio client, and a thread-backed facade for training loops.

`SyncerClient` keeps one websocket to the syncer: it says hello, reconnects with capped exponential
backoff when the connection drops (a syncer that restarts only means no merges for a while), and
sorts what arrives into an inbox: the welcome, fragment updates (every one of
a fragment, in order: a delta applies onto the version before it; a whole copy supersedes what came
before it) and errors. Outgoing control messages (progress) go before bulk
frames (pushes), and every queue is bounded.

`ThreadedClient` runs a `SyncerClient` on its own event loop in a background thread, so a training
loop calls plain methods that never wait on the network.

Fatal answers (wrong token, a layout or protocol version the syncer does not accept) stop the
client with `SyncerRefused`; they are not retried.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import math
import random
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

import aiohttp

from ddiloco.core.events import Push
from ddiloco.core.layout import TensorSpec
from ddiloco.core.vclock import VClock, VClockError
from ddiloco.errors import FaultError, UserError
from ddiloco.net import lane, session, tls, wire
from ddiloco.net.lane import LaneLimits
from ddiloco.net.messages import SYNCER_KINDS

log = logging.getLogger("ddiloco.client")


PROGRESS_INTERVAL_S_MAX = 5.0  # beyond this the syncer's view of the step lags too far behind
CLOSE_DRAIN_S_MAX = 30.0  # a learner that is stopping does not wait on a stuck syncer for longer
CLOSE_GRACE_S = 1.0  # after the drain time, this long for the goodbye and the close handshake
# Updates of one fragment waiting for the training loop. A delta chain cannot be cut short, so a loop
# that falls this far behind drops the connection: the rejoin brings every fragment whole
# (docs/protocol.md, "Delta broadcast").
UPDATES_QUEUED_MAX = 64


class SyncerRefused(UserError, RuntimeError):
    """The syncer refused this learner for good (auth, layout, protocol); retrying cannot help."""


class MalformedMessage(FaultError, ValueError):
    """A syncer message that frames correctly but does not make sense (a welcome whose layout or
    peer list does not parse, a payload of the wrong size): that connection is dropped and the
    client reconnects, as after any other fault of the connection."""


class UpdatesBehind(FaultError, RuntimeError):
    """The training loop left UPDATES_QUEUED_MAX updates of one fragment untaken: the connection is
    dropped, and the rejoin brings every fragment whole."""


class ClientConfigError(UserError, ValueError):
    """A client setting that cannot work (a syncer URL that is not a websocket one, a bad interval)."""


@dataclass(frozen=True)
class ClientConfig:
    url: str  # ws://host:port/ws, or wss:// for a syncer serving TLS
    name: str
    tensors: tuple[TensorSpec, ...]
    token: str | None = None
    # wss://: trust only the CA certificate(s) in this PEM file (a self-signed syncer, a private CA);
    # None: the system's CAs (net.tls)
    ca_file: Path | None = None
    peer_url: str = ""  # advertised in the hello: where this learner serves its state (net.peer)
    reconnect_s_min: float = 0.05
    reconnect_s_max: float = 5.0
    # A syncer that welcomed this client and then went away is most likely restarting (a crash, a
    # deploy: back within seconds): for this long after losing it, the backoff grows to at most
    # rejoin_s_max, so the learner is back within about that of the syncer (not up to 1.5 x
    # reconnect_s_max later, as after a long outage); failed connects to a refusing port are cheap.
    rejoin_s_max: float = 0.25
    rejoin_window_s: float = 30.0
    connect_timeout_s: float = 10.0
    heartbeat_s: float = 20.0  # websocket ping interval; a syncer silent for half of it is gone
    progress_queued_max: int = 64  # coalesced beyond this: only the newest progress matters
    # `ThreadedClient.progress` forwards a report at once when its step is one where a round opens
    # (the welcome's schedule: the syncer opens rounds on the steps it hears of, so these are the
    # reports it needs on time) or when the held versions changed (after the last report under the
    # old versions: the ledger's count of the tokens trained under them). Other reports go at most
    # once per this many seconds, the newest one held back when the interval ends: a heartbeat of
    # the step count for the syncer's view (the counters only grow, so a newer report says all an
    # older one did). Each report forwarded costs this thread, and the syncer, CPU that a training
    # step on shared cores then lacks (`ddiloco bench learner`). 0: every report is forwarded.
    progress_interval_s: float = 0.5
    pushes_queued_max: int = 2  # outer gradients waiting to go out (one in flight per fragment)
    # On close, what is queued (the last progress report, pushes the syncer may still merge) goes
    # out before the goodbye, for at most this long; then the connection closes whatever is left.
    close_drain_s: float = 2.0
    wire: wire.WireLimits = field(default_factory=wire.WireLimits)
    # Offer a lane (net.lane: bulk frames' data on a TCP connection beside the websocket, over TLS
    # for a wss:// syncer) to a syncer that has one.
    lane: bool = True
    lane_limits: LaneLimits = field(default_factory=LaneLimits)

    def __post_init__(self) -> None:
        if not self.url.startswith(("ws://", "wss://")):
            raise ClientConfigError(f"syncer URL must start with ws:// or wss://, got {self.url!r}")
        if self.ca_file is not None and not self.url.startswith("wss://"):
            raise ClientConfigError(f"a TLS CA file only applies to a wss:// syncer URL, got {self.url!r}")
        if not 0 < self.reconnect_s_min <= self.reconnect_s_max:
            raise ClientConfigError("need 0 < reconnect_s_min <= reconnect_s_max")
        if self.rejoin_s_max <= 0 or self.rejoin_window_s < 0:
            raise ClientConfigError("need rejoin_s_max > 0 and rejoin_window_s >= 0")
        if not 0 <= self.progress_interval_s <= PROGRESS_INTERVAL_S_MAX:
            raise ClientConfigError(
                f"progress_interval_s must lie in [0, {PROGRESS_INTERVAL_S_MAX}], got {self.progress_interval_s}"
            )
        if not 0 <= self.close_drain_s <= CLOSE_DRAIN_S_MAX:
            raise ClientConfigError(f"close_drain_s must lie in [0, {CLOSE_DRAIN_S_MAX}], got {self.close_drain_s}")


@dataclass
class Inbox:
    """What has arrived; read and emptied by the training loop."""

    welcome: session.WelcomeInfo | None = None
    updates: dict[int, list] = field(default_factory=dict)  # fragment -> its session.UpdateInfo, in order
    errors: deque = field(default_factory=lambda: deque(maxlen=64))
    connects: int = 0
    welcomes: int = 0  # how many welcomes so far: a new one means a rejoin or a request for init
    markers: deque = field(default_factory=lambda: deque(maxlen=16))  # snapshot ids (net.snapshot)
    # What arrived after a marker the training loop has not taken yet: held back until it has
    # recorded its local state, so that the state never reflects a message sent after the cut.
    held: deque = field(default_factory=deque)
    # Items delivered so far, held ones included: a training loop that finds it unchanged since its
    # last take has nothing to take, and skips the round trip to the network thread.
    deliveries: int = 0


class Calm(NamedTuple):
    """`ThreadedClient.calm`: while `inbox.deliveries == deliveries` and `clock() < report_by`, no
    call of the hook that opens no round has anything to take or a report to hand over."""

    inbox: Inbox
    deliveries: int
    clock: Callable[[], float]
    report_by: float


def check_progress(progress: session.ProgressInfo) -> None:
    """A report the wire can carry, checked where it is handed over: held versions are >= 0
    (docs/protocol.md; a learner that does not hold a fragment yet reports once it does). Caught
    only in the writer, it would end the connection's task and leave the learner unconnected."""
    if any(v < 0 for v in progress.versions):
        raise ValueError(
            f"a progress report holds versions >= 0 only, got {progress.versions}: report once every "
            "fragment is held (a sharded learner sends 0 for another shard's fragment it lacks)"
        )


class SyncerClient:
    def __init__(self, config: ClientConfig, rng: random.Random | None = None):
        self.config = config
        # Made once, here: a CA file that cannot be used fails the start, not every reconnect.
        self._ssl = tls.client_context(config.ca_file) if config.url.startswith("wss://") else None
        self.inbox = Inbox()
        # The inbox is filled on the loop's thread and emptied by `take_inbox` on the training
        # thread's, each under this lock: taking costs the training thread no wake-up of the loop
        # (a write to its self-pipe, and the GIL handed to it for as long as it runs).
        self.inbox_lock = threading.RLock()
        self.refused: SyncerRefused | None = None
        self.connected = asyncio.Event()
        self.welcomed = asyncio.Event()
        self.settled = threading.Event()  # welcomed at least once, or refused: for other threads
        self._progress: deque = deque(maxlen=config.progress_queued_max)
        self._bulk: deque = deque()
        self._bulk_reports = 0  # progress reports among the bulk messages (queue_progress, queue_local_state)
        self._bulk_sending = False  # the writer is between the frames of a bulk message
        self._reported_versions: tuple[int, ...] | None = None  # those of the last report queued
        self._wake = asyncio.Event()
        self._closed = asyncio.Event()  # set by close: the client is stopping
        self._ids = iter(range(1, 1 << 62))
        self._drain_until = 0.0  # on the loop's clock, set by close
        self._serving: asyncio.Future | None = None  # the current connection, cancelled if close overruns
        self._rng = rng or random.Random(0)  # jitter of the backoff only
        self._lost_at: float | None = None  # on the loop's clock: when a welcomed connection was lost
        self.last_error: str | None = None
        # Told of each fragment update as it lands in the inbox, on the loop's thread (it must not
        # block): the hook starts decoding it before the training loop takes it (learner.background).
        self.on_update: Callable[[session.UpdateInfo], None] | None = None
        self._behind: int | None = None  # a fragment whose update chain overflowed (UpdatesBehind)
        self.bytes_out = 0
        self._lane: asyncio.Task | None = None  # this connection's lane: being opened, or a Lane or None
        self.lanes_attached = 0  # connections that had a lane (tests, the bench)
        self.pushes_dropped = 0  # pushes refused for a full queue (the next push of the fragment carries their tokens)
        # This learner's vector clock (docs/replay.md): ticked before every message sent, merged with
        # the clock of every message received. Kept across reconnects: it is the process's clock.
        self.clock = VClock()

    # ---- used by the training side (from the client's loop) -------------------------------------

    # `welcomes`: how many welcomes the caller had seen when it made the message (None: send it
    # whatever happened since). A message made before the caller saw the latest welcome belongs to
    # the previous session: sent now, it would speak for the new learner id with the old one's
    # versions and tokens (turning live a learner that holds nothing, booking tokens twice), so the
    # writer drops it.

    def queue_progress(self, progress: session.ProgressInfo, welcomes: int | None = None) -> None:
        """Reports go ahead of bulk messages, except one of newer held versions while a bulk message
        waits or is being sent, and every report after it until it went out: that one closes the
        learner's windows of the versions before (core.ledger), so a push computed from them, sent
        before it, must reach the syncer before it, or the push's tokens would be booked lost."""
        check_progress(progress)
        behind = self._bulk_reports > 0 or (
            bool(self._bulk or self._bulk_sending) and progress.versions != self._reported_versions
        )
        self._reported_versions = progress.versions
        if not behind:
            self._progress.append((welcomes, progress))
        elif self._bulk and self._is_same_report(self._bulk[-1], welcomes, progress):
            self._bulk[-1] = (welcomes, progress)  # the newer report of the same versions stands for both
        else:
            self._bulk.append((welcomes, progress))
            self._bulk_reports += 1
        self._wake.set()

    @staticmethod
    def _is_same_report(queued: tuple, welcomes: int | None, progress: session.ProgressInfo) -> bool:
        old_welcomes, old = queued
        return isinstance(old, session.ProgressInfo) and old_welcomes == welcomes and old.versions == progress.versions

    def queue_push(self, push: Push, welcomes: int | None = None, *, admitted: bool = False) -> bool:
        """False when the push queue is full: the push is dropped, counted in `pushes_dropped` and
        logged (the caller keeps its counters and tries next time). `admitted`: the caller was told
        already that the push is queued (ThreadedClient counts it against the limit on its own
        thread), so it is queued whatever the queue holds by now. Dropped there, its progress was
        lost: the hook had booked it as sent, and its next push starts after it (found with an init
        message handed to this thread between the count and the push: the first push of a learner
        that had just sent its initial fragments)."""
        if not admitted and self.pushes_queued() >= self.config.pushes_queued_max:
            self.dropped(push)
            return False
        self._bulk.append((welcomes, push))
        self._wake.set()
        return True

    def pushes_queued(self) -> int:
        """Bulk messages waiting to go out, not counting the progress reports among them."""
        return len(self._bulk) - self._bulk_reports

    def dropped(self, push: Push) -> None:
        """Count a push refused for a full queue; logged at the 1st, 10th, 100th... so that a learner
        far faster than its link says so without a line per push."""
        self.pushes_dropped += 1
        if math.log10(self.pushes_dropped).is_integer():
            log.warning(
                "push of fragment %d at step %d dropped: %d messages already queued (%d pushes dropped so far)",
                push.fragment,
                push.step,
                self.pushes_queued(),
                self.pushes_dropped,
            )

    def queue_init(self, fragment: int, payload: bytes, welcomes: int | None = None) -> None:
        self._bulk.append((welcomes, session.InitInfo(fragment, payload)))
        self._wake.set()

    def queue_local_state(self, item: session.LocalStateInfo, welcomes: int | None = None) -> None:
        """After the pushes and progress reports already queued (the channel's order is what makes
        the snapshot consistent: the reports go into the bulk queue ahead of it), and never refused
        for a full queue: the snapshot waits for it. Reports queued later wait until it is sent."""
        while self._progress:
            self._bulk.append(self._progress.popleft())
            self._bulk_reports += 1
        self._bulk.append((welcomes, item))
        self._wake.set()

    def _current(self, welcomes: int | None) -> bool:
        return welcomes is None or welcomes == self.inbox.welcomes

    async def close(self) -> None:
        """Stop: what is queued goes out first (ClientConfig.close_drain_s), then a goodbye."""
        self._drain_until = asyncio.get_running_loop().time() + self.config.close_drain_s
        self._closed.set()
        self._wake.set()
        self.welcomed.set()  # a writer still waiting for this connection's welcome has nothing to send
        # A send already under way when close came has no deadline of its own (a stalled syncer):
        # the connection is cancelled when the drain and the goodbye have had their time.
        asyncio.get_running_loop().call_later(self.config.close_drain_s + CLOSE_GRACE_S, self._abort)

    @property
    def _closing(self) -> bool:
        return self._closed.is_set()

    def _abort(self) -> None:
        if self._serving is not None and not self._serving.done():
            log.warning("closing: the syncer connection did not finish in time; cut")
            self._serving.cancel()

    # ---- the connection loop --------------------------------------------------------------------

    async def run(self) -> None:
        """Connect, serve, reconnect with capped exponential backoff until closed or refused."""
        delay = self.config.reconnect_s_min
        while not self._closing:
            welcomes = self.inbox.welcomes
            try:
                self._serving = asyncio.ensure_future(self._serve_once())
                await self._serving
                delay = self.config.reconnect_s_min
            except asyncio.CancelledError:
                if not (self._closing and self._serving.cancelled()):
                    raise
                return
            except SyncerRefused as exc:
                self.refused = exc
                self.welcomed.set()  # wake anyone waiting for a welcome that will never come
                self.settled.set()
                # Not logged as an error here: the training side raises it (wait_welcome, then any
                # call), and the same line twice reads as two problems.
                log.debug("refused: %s", exc)
                return
            except (TimeoutError, aiohttp.ClientError, OSError) as exc:
                delay = self._backoff(delay, welcomes, exc)
                log.info("syncer connection failed (%s); retrying in about %.2f s", self.last_error, delay)
            except (wire.WireError, MalformedMessage, UpdatesBehind) as exc:  # not the network
                delay = self._backoff(delay, welcomes, exc)
                log.warning("dropping the syncer connection: %s; retrying in about %.2f s", self.last_error, delay)
            self.connected.clear()
            if self._closing:
                return
            now = asyncio.get_running_loop().time()
            if self.inbox.welcomes > welcomes:
                self._lost_at = now
            try:  # the backoff, cut short by close
                await asyncio.wait_for(self._closed.wait(), delay * (0.5 + self._rng.random()))
            except TimeoutError:
                pass
            rejoining = self._lost_at is not None and now - self._lost_at < self.config.rejoin_window_s
            cap = self.config.reconnect_s_max
            if rejoining:
                cap = min(cap, self.config.rejoin_s_max)
            delay = max(self.config.reconnect_s_min, min(delay * 2, cap))

    def _backoff(self, delay: float, welcomes: int, exc: BaseException) -> float:
        """Note the failure; the backoff before the next attempt. A connection that was welcomed
        worked: its loss is a new outage, retried after the shortest delay again, not after the
        long one that an earlier outage had grown to."""
        self.last_error = f"{type(exc).__name__}: {exc}"
        return self.config.reconnect_s_min if self.inbox.welcomes > welcomes else delay

    async def _serve_once(self) -> None:
        headers = {"Authorization": f"Bearer {self.config.token}"} if self.config.token else {}
        token = lane.new_token() if self.config.lane else None
        if token is not None:
            headers[lane.LANE_HEADER] = token
        timeout = aiohttp.ClientTimeout(total=None, connect=self.config.connect_timeout_s)
        async with aiohttp.ClientSession(timeout=timeout) as http:
            try:
                ws = await http.ws_connect(
                    self.config.url,
                    headers=headers,
                    max_msg_size=self.config.wire.max_msg_size,
                    heartbeat=self.config.heartbeat_s,
                    ssl=self._ssl if self._ssl is not None else True,
                )
            except aiohttp.WSServerHandshakeError as exc:
                if exc.status == 401:
                    raise SyncerRefused(f"syncer at {self.config.url} refused the token (HTTP 401)") from exc
                raise
            except aiohttp.ClientSSLError as exc:
                if tls.is_certificate_error(exc):  # configuration, not the network: retrying cannot mend it
                    trust = (
                        f"the CA in {self.config.ca_file}"
                        if self.config.ca_file
                        else "the system's CAs (give a CA file)"
                    )
                    raise SyncerRefused(
                        f"the certificate of the syncer at {self.config.url} is not trusted by {trust}: {exc}"
                    ) from exc
                raise
            if token is not None:
                self._lane = asyncio.create_task(self._open_lane(http, headers, token))
            try:
                await self._serve_connected(ws)
            finally:
                await self._close_lane()

    async def _serve_connected(self, ws: aiohttp.ClientWebSocketResponse) -> None:
        async with ws:
            self.inbox.connects += 1
            self.connected.set()
            hello = session.hello_frames(
                self.config.name,
                self.config.tensors,
                next(self._ids),
                self.config.wire,
                self._tick(),
                self.config.peer_url,
            )
            for frame in hello:
                await ws.send_bytes(frame)
            # The protocol: nothing after the hello until the welcome (the syncer has no learner
            # id for this connection before then). The reader sets `welcomed`.
            self.welcomed.clear()
            writer = asyncio.create_task(self._write_loop(ws, self.inbox.welcomes))
            # A writer that fails (a bug: a message that does not encode) must not leave a
            # connection that reads but never sends: close it, and the failure surfaces below.
            writer.add_done_callback(
                lambda t: t.cancelled() or t.exception() is None or asyncio.ensure_future(ws.close())
            )
            try:
                await self._read_loop(ws)
            finally:
                writer.cancel()
                try:
                    await writer
                except (asyncio.CancelledError, ConnectionError, aiohttp.ClientError):
                    pass

    async def _open_lane(self, http: aiohttp.ClientSession, headers: dict, token: str) -> lane.Lane | None:
        """This connection's lane, or None where the syncer has none or it cannot be had (the
        websocket then carries everything; said once, at info)."""
        try:
            opened = await lane.dial(http, self.config.url, headers, token, self.config.lane_limits, self._ssl)
        except (aiohttp.ClientError, OSError, ValueError, KeyError, TypeError) as exc:  # LaneError too
            log.info("no lane, everything on the websocket: %s", exc)
            return None
        self.lanes_attached += opened is not None
        return opened

    def _lane_now(self) -> lane.Lane | None:
        """The lane, when it is open already (the writer never waits for one)."""
        task = self._lane
        return task.result() if task is not None and task.done() and not task.cancelled() else None

    async def _lane_for(self, frame: bytes) -> lane.Lane | None:
        """The lane a received frame needs: a header alone is a lane frame, which the syncer sends
        once the lane is attached, possibly before this side has read the lane's answer."""
        if len(frame) == wire.HEADER_BYTES and self._lane is not None:
            return await asyncio.shield(self._lane)
        return self._lane_now()

    async def _close_lane(self) -> None:
        task, self._lane = self._lane, None
        if task is None:
            return
        if not task.done():
            task.cancel()
        try:
            opened = await task
        except asyncio.CancelledError:
            return
        if opened is not None:
            opened.close()

    async def _read_loop(self, ws: aiohttp.ClientWebSocketResponse) -> None:
        reassembler = wire.Reassembler(self.config.wire, accepted=SYNCER_KINDS)
        async for msg in ws:  # until the connection closes: on close, after the writer's goodbye
            if msg.type is not aiohttp.WSMsgType.BINARY:
                continue
            message = await self._decode(reassembler, msg.data)
            if message is not None:
                self._merge_clock(getattr(message, "clock", None))
                try:
                    view = session.client_view(message)
                except ValueError as exc:  # the session's checks, and orjson's on the welcome's JSON
                    raise MalformedMessage(f"the syncer sent a malformed {type(message).__name__}: {exc}") from exc
                self._deliver(view)
                if self._behind is not None:
                    fragment, self._behind = self._behind, None
                    raise UpdatesBehind(
                        f"{UPDATES_QUEUED_MAX} updates of fragment {fragment} wait for the training loop: "
                        "rejoining for whole copies"
                    )
        if self._closing:
            return
        raise ConnectionError(f"closed by syncer (code {ws.close_code})")

    async def _decode(self, reassembler: wire.Reassembler, frame: bytes) -> object:
        """A frame's message, if it completes one. A syncer whose frames carry a protocol version
        this client does not decode is another release of the protocol: refused, not retried."""
        try:
            return (await lane.receive_frame(reassembler, frame, await self._lane_for(frame)))[0]
        except wire.WireError as exc:
            if exc.code == wire.ErrorCode.PROTOCOL_VERSION:
                raise SyncerRefused(f"syncer at {self.config.url} speaks another protocol version: {exc.text}") from exc
            raise

    def _tick(self) -> dict[str, int]:
        self.clock = self.clock.tick(self.config.name)
        return self.clock.as_dict()

    def _merge_clock(self, carried: dict[str, int] | None) -> None:
        if not carried:
            return
        try:
            self.clock = self.clock.merge(carried)
        except VClockError as exc:  # the syncer's clock outgrew the limit: ours stays as it was
            log.warning("not merging the syncer's clock: %s", exc)

    def _deliver(self, item: object) -> None:
        with self.inbox_lock:
            self._deliver_locked(item)

    def _deliver_locked(self, item: object) -> None:
        self.inbox.deliveries += 1
        if self.inbox.markers and isinstance(item, (session.UpdateInfo, session.MarkerInfo)):
            self.inbox.held.append(item)
            return
        if isinstance(item, session.WelcomeInfo):
            self.inbox.welcome = item
            self.inbox.welcomes += 1
            self.welcomed.set()
            self.settled.set()
        elif isinstance(item, session.UpdateInfo):
            chain = self.inbox.updates.setdefault(item.fragment, [])
            if item.whole:
                chain.clear()  # what came before is superseded: the learner starts again from this copy
            elif len(chain) >= UPDATES_QUEUED_MAX:
                chain.clear()  # nothing after the gap applies: the reader drops the connection
                self._behind = item.fragment
                return
            chain.append(item)
            if self.on_update is not None:
                self.on_update(item)
        elif isinstance(item, session.MarkerInfo):
            self.inbox.markers.append(item.snapshot)
        elif isinstance(item, session.ErrorInfo):
            self.inbox.errors.append(item)
            if item.fatal:
                raise SyncerRefused(f"the syncer at {self.config.url} refused this learner ({item.code}): {item.text}")

    def take_inbox(self) -> tuple[dict, list, list[int], tuple[int, session.WelcomeInfo | None], int]:
        """What arrived since the last call, taken out on the calling thread: (updates by fragment,
        errors, snapshot markers, (welcomes so far, the latest welcome), deliveries counted). What
        arrived after a marker is delivered again, for the next call (held again behind a later marker)."""
        with self.inbox_lock:
            box = self.inbox
            updates, errors, markers = dict(box.updates), list(box.errors), list(box.markers)
            box.updates.clear()
            box.errors.clear()
            box.markers.clear()
            held = list(box.held)
            box.held.clear()
            for item in held:
                self._deliver_locked(item)
            # Re-delivered held items counted above: the next call comes back here for them.
            return updates, errors, markers, (box.welcomes, box.welcome), box.deliveries - len(held)

    async def _write_loop(self, ws: aiohttp.ClientWebSocketResponse, welcomes_before: int) -> None:
        await self.welcomed.wait()  # this connection's welcome, a refusal, or close
        if self.refused is not None:
            return
        if self.inbox.welcomes == welcomes_before:  # closed before the welcome: nothing may be sent
            await ws.close()
            return
        bulk_frames: deque = deque()
        sending_local_state = False  # bulk_frames hold a local state's frames
        self._bulk_sending = False  # (a connection before this one may have ended mid-message)
        while True:
            queued = self._progress or self._bulk or bulk_frames
            if self._closing and (not queued or self._drain_left() == 0):
                break
            if not queued:
                self._wake.clear()
                await self._wake.wait()
                continue
            # Progress goes ahead of bulk frames, except past a local state (a consistent snapshot,
            # net.snapshot): a report of a step after the learner's cut must not reach the syncer
            # before the state of the cut, or the snapshot would hold a message from after it.
            if self._progress and not (sending_local_state or self._local_state_queued()):
                welcomes, item = self._progress.popleft()
                if not self._current(welcomes):
                    continue
                frames = session.progress_frames(item, next(self._ids), self.config.wire, self._tick())
            elif bulk_frames:
                frames = [bulk_frames.popleft()]
                sending_local_state = sending_local_state and bool(bulk_frames)
            else:  # reports held back behind a push or a local state are in the bulk: something is there
                welcomes, item = self._bulk.popleft()
                self._bulk_reports -= isinstance(item, session.ProgressInfo)
                if not self._current(welcomes):
                    continue
                if isinstance(item, session.ProgressInfo):  # behind a push, or made before a local state
                    frames = session.progress_frames(item, next(self._ids), self.config.wire, self._tick())
                else:
                    bulk_frames.extend(session.bulk_frames(item, next(self._ids), self.config.wire, self._tick()))
                    sending_local_state = isinstance(item, session.LocalStateInfo) and bool(bulk_frames)
                    continue
            self._bulk_sending = bool(bulk_frames)
            for frame in frames:
                await self._send(ws, frame)
        self._bulk_sending = False
        for frame in session.bye_frames("stopping", next(self._ids), self.config.wire):
            await self._send(ws, frame)
        await ws.close()

    def _local_state_queued(self) -> bool:
        return any(isinstance(item, session.LocalStateInfo) for _, item in self._bulk)

    def _drain_left(self) -> float:
        return max(0.0, self._drain_until - asyncio.get_running_loop().time())

    async def _send(self, ws: aiohttp.ClientWebSocketResponse, frame) -> None:
        """Send one frame; while closing, only within what is left of the drain time (a frame cut
        short then does not matter: the connection closes right after)."""
        if not self._closing:
            await lane.send_frame(ws, self._lane_now(), frame)
        else:
            try:
                await asyncio.wait_for(lane.send_frame(ws, self._lane_now(), frame), self._drain_left())
            except TimeoutError:
                self._drain_until = 0.0  # nothing more goes out
                return
        self.bytes_out += len(frame)


def _new_loop() -> asyncio.AbstractEventLoop:
    """The client thread's event loop: uvloop's where installed, else asyncio's own.

    Why it matters to the training thread: a report or push handed over wakes the loop
    (`call_soon_threadsafe`). asyncio's loop writes to its wake-up socket with the GIL released, so
    the woken loop thread takes the GIL at once and the training thread gets it back only when the
    loop has done its work and waits again: measured 195-227 us per wake-up on the hook's call
    (`ddiloco bench learner --synthetic-step-ms 2`, 364 wake-ups in 1200 steps). uvloop wakes its
    loop with the GIL held, so the loop's work waits for the training thread to let go of the GIL,
    which it does while it waits for its devices."""
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


class ThreadedClient:
    """A `SyncerClient` on a background thread with its own event loop.

    Every method is safe to call from the training thread and returns at once. `clock` (seconds,
    monotonic) paces progress reports (ClientConfig.progress_interval_s)."""

    def __init__(self, config: ClientConfig, clock: Callable[[], float] = time.monotonic):
        self._loop = _new_loop()
        self._clock = clock
        self._interval_s = config.progress_interval_s
        # The newest progress report held back, (welcomes, report): a deque of one, since its
        # append and popleft are atomic between this thread and the loop's.
        self._held: deque = deque(maxlen=1)
        self._forwarded_at = float("-inf")  # on `clock`, by the training thread
        self._forwarded_versions: tuple[int, ...] | None = None
        self._reported_step: int | None = None  # the step of the last report handed over
        self._flush_armed = False  # on the loop: a timer will forward what is held
        self._client: SyncerClient | None = None
        self._ready = threading.Event()
        self._welcomes_seen = 0  # welcomes the caller has seen: stamps what it sends (see queue_progress)
        self._welcome: session.WelcomeInfo | None = None  # the latest the caller has seen: its round schedule
        self._markers: list[int] = []  # collected by `take`, given out by `take_markers`
        self._taken: tuple[int, tuple] | None = None  # (inbox deliveries, welcomes) as of the last `take`
        self._failed: BaseException | None = None  # the client could not be made (a CA file that is unusable)
        # Pushes handed to the loop and not yet in its queue: with the queue's length, what `push`
        # decides a full queue by, on the caller's thread, so that the hook knows at once
        self._handed = 0
        self._handed_lock = threading.Lock()
        # Set by the client's thread as it ends: read at every call of the hook, where
        # Thread.is_alive (a lock taken and given back) cost more than the rest of `take`.
        self._stopped = False
        self._thread = threading.Thread(target=self._main, args=(config,), name="ddiloco-client", daemon=True)
        self._thread.start()
        self._ready.wait()
        if self._failed is not None:
            self._thread.join()
            raise self._failed

    def _main(self, config: ClientConfig) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            self._client = SyncerClient(config)
        except Exception as exc:  # noqa: BLE001 - handed to the constructor's caller, which raises it
            self._failed = exc
            self._loop.close()
            return
        finally:
            self._ready.set()
        try:
            self._loop.run_until_complete(self._client.run())
        finally:
            self._loop.close()
            self._stopped = True

    @property
    def client(self) -> SyncerClient:
        return self._client

    def wait_welcome(self, timeout_s: float) -> session.WelcomeInfo:
        """Block until the syncer has welcomed us (start-up only); raises on refusal or timeout."""
        if not self._client.settled.wait(timeout_s):
            raise TimeoutError(
                f"no welcome from the syncer within {timeout_s} s (last error: {self._client.last_error})"
            )
        self._raise_refused()
        fut = asyncio.run_coroutine_threadsafe(self._welcome_now(), self._loop)
        self._welcomes_seen, welcome = fut.result()
        self._welcome = welcome
        return welcome

    @property
    def welcomes_seen(self) -> int:
        """The welcomes handed to the caller so far (by `wait_welcome` and `take`)."""
        return self._welcomes_seen

    @property
    def connected(self) -> bool:
        """Whether the websocket is up now (read across threads: a hint, for what to skip sending)."""
        return self._client.connected.is_set()

    async def _welcome_now(self) -> tuple[int, session.WelcomeInfo | None]:
        return self._client.inbox.welcomes, self._client.inbox.welcome

    def progress(self, item: session.ProgressInfo) -> None:
        """Report progress: at once on a step where a round opens or under new held versions,
        otherwise at most once per interval (most steps then cost no wake-up of that thread at all)."""
        self._check()
        check_progress(item)
        now = self._clock()
        due = self._opens_round(item.step)
        self._reported_step = item.step
        if not due and item.versions == self._forwarded_versions and now - self._forwarded_at < self._interval_s:
            self._held.append((self._welcomes_seen, item, now))
            return
        held = self._take_held()
        if held is not None and held[1].versions != item.versions:
            # The last report under the old versions, then this one: in order, and with one wake-up
            # of the loop (each costs the training thread a trip through the GIL).
            self._loop.call_soon_threadsafe(self._forward_two, held[0], held[1], self._welcomes_seen, item)
        else:
            self._loop.call_soon_threadsafe(self._forward, self._welcomes_seen, item)
        self._forwarded_at, self._forwarded_versions = now, item.versions

    def holds_report(self, step: int) -> bool:
        """Whether `progress` would hold back, not forward, a report of `step` (or of any computed
        step before it) under the versions of the report handed over last, and no snapshot marker
        waits for the hook (`take_markers`): the hook's calls that only count then hand over no
        report at all (learner.sync). Such a report would have been superseded by the next one
        anyway, unless the loop stops calling for a whole interval: the timer then sends the report
        held, of the last call that reported, a few steps older."""
        return (
            not self._markers
            and self._forwarded_versions is not None
            and not self._opens_round(step)
            and self._clock() - self._forwarded_at < self._interval_s
        )

    def calm(self) -> Calm | None:
        """What keeps `holds_report` true after this call, where it holds now: nothing arrives (the
        inbox's deliveries stay as of the last `take`) and the report interval does not end (the
        clock stays below `report_by`). A hook that knows its rounds' steps itself skips asking at
        each call until either changes (learner.sync's quiet calls). None where a report would go
        out, a marker waits, or the client was refused or stopped."""
        client = self._client
        if (
            self._taken is None
            or client is None
            or self._markers
            or self._forwarded_versions is None
            or self._stopped
            or client.refused is not None
        ):
            return None
        return Calm(client.inbox, self._taken[0], self._clock, self._forwarded_at + self._interval_s)

    def _opens_round(self, step: int) -> bool:
        return self._welcome is not None and self._welcome.opens_round(step, self._reported_step)

    def _take_held(self) -> tuple[int, session.ProgressInfo, float] | None:
        try:
            return self._held.popleft()
        except IndexError:
            return None

    def _forward_two(
        self, welcomes: int, item: session.ProgressInfo, then_welcomes: int, then: session.ProgressInfo
    ) -> None:
        self._forward(welcomes, item)
        self._forward(then_welcomes, then)

    def _forward(self, welcomes: int, item: session.ProgressInfo) -> None:
        """On the loop: queue a report, and watch for one held back meanwhile."""
        self._client.queue_progress(item, welcomes)
        self._arm_flush(self._interval_s)

    def _arm_flush(self, delay_s: float) -> None:
        if self._interval_s > 0 and not self._flush_armed:
            self._flush_armed = True
            self._loop.call_later(delay_s, self._flush_held)

    def _flush_held(self) -> None:
        """On the loop: a report held back for a whole interval goes out (the training loop has
        not called since, or steps more slowly than the interval); a younger one is left to be
        superseded by the next call, and looked at again when it would be that old."""
        self._flush_armed = False
        try:
            age = self._clock() - self._held[0][2]
        except IndexError:
            return  # nothing held: the next report forwarded arms the timer again
        if age < self._interval_s:
            self._arm_flush(self._interval_s - age)
            return
        held = self._take_held()  # this one, or a newer one put there since: the newest either way
        if held is not None:
            self._forward(held[0], held[1])

    @property
    def pushes_dropped(self) -> int:
        """Pushes the network thread refused for a full queue (SyncerClient.queue_push)."""
        return self._client.pushes_dropped

    def push(self, item: Push) -> bool:
        """Queued on the network thread, or False at once when its queue is full (counted in
        `pushes_dropped`, logged): the hook then pushes that progress with its next push. The push
        crosses to that thread as it is (one hand-off, nothing copied): its writer copies the payload
        into the frames (net.session.bulk_frames)."""
        return self._push(item, self._welcomes_seen)

    def sender(self) -> Callable[[Push], bool]:
        """`push` for another thread (the hook's background thread sends a push as soon as its bytes
        exist): the push belongs to the session of now, so one handed over after a new welcome is
        dropped with the old session's messages, as `push` called now would have been."""
        return functools.partial(self._push, welcomes=self._welcomes_seen)

    def _push(self, item: Push, welcomes: int) -> bool:
        self._check()
        client = self._client
        with self._handed_lock:
            if client.pushes_queued() + self._handed >= client.config.pushes_queued_max:
                full = True
            else:
                full, self._handed = False, self._handed + 1
        if full:
            self._loop.call_soon_threadsafe(client.dropped, item)
            return False
        self._loop.call_soon_threadsafe(self._hand_over, item, welcomes)
        return True

    def _hand_over(self, item: Push, welcomes: int) -> None:
        with self._handed_lock:
            self._handed -= 1
        self._client.queue_push(item, welcomes, admitted=True)

    def init(self, fragment: int, payload: bytes) -> None:
        self._check()
        self._loop.call_soon_threadsafe(self._client.queue_init, fragment, payload, self._welcomes_seen)

    def local_state(self, snapshot: int, data: bytes) -> None:
        self._check()
        self._loop.call_soon_threadsafe(
            self._client.queue_local_state, session.LocalStateInfo(snapshot, data), self._welcomes_seen
        )

    def watch_updates(self, on_update: Callable[[session.UpdateInfo], None]) -> None:
        """Have `on_update` called with each fragment update as it arrives, on the client's thread,
        before the training loop takes it (`take`); it must return at once."""
        assert self._client is not None  # made before the constructor returned
        self._client.on_update = on_update

    def take_markers(self) -> list[int]:
        """Snapshot markers (net.snapshot) that the last `take` collected, each given out once."""
        got, self._markers = self._markers, []
        return got

    def take(self) -> tuple[dict, list, tuple[int, session.WelcomeInfo | None]]:
        """(updates by fragment (each a list in arrival order), errors) that arrived since the last
        call, and (number of welcomes so far, the latest welcome)."""
        self._check()
        if self._taken is not None and self._taken[0] == self._client.inbox.deliveries:
            # Nothing arrived since (most steps): not even the inbox's lock is taken.
            return {}, [], self._taken[1]
        updates, errors, markers, welcome, deliveries = self._client.take_inbox()
        self._markers += markers  # handed out by `take_markers`, after this take
        self._taken = (deliveries, welcome)
        self._welcomes_seen = welcome[0]
        self._welcome = welcome[1] or self._welcome
        return updates, errors, welcome

    def _check(self) -> None:
        """A refused client has no loop left to talk to: say why, every time it is used."""
        self._raise_refused()
        if self._stopped:
            raise RuntimeError(f"the syncer client has stopped (last error: {self._client.last_error})")

    def _raise_refused(self) -> None:
        """The refusal, raised here as a new exception: the one raised on the client's thread would
        carry that thread's frames into the caller's traceback, around a message that is all it needs."""
        refused = self._client.refused
        if refused is not None:
            raise type(refused)(*refused.args) from None

    def close(self, timeout_s: float = CLOSE_DRAIN_S_MAX + 5.0) -> None:
        """Stop the client: the newest progress report held back goes out with what is queued
        (`SyncerClient.close`); waits for the thread at most `timeout_s`."""
        if self._thread.is_alive():
            held = self._take_held()

            def closing() -> None:
                if self.refused is not None:
                    return  # `run` has returned: nothing to drain, and a task started now would never run
                if held is not None:
                    self._client.queue_progress(held[1], held[0])
                asyncio.ensure_future(self._client.close())

            try:
                self._loop.call_soon_threadsafe(closing)
            except RuntimeError:
                # The thread ended by itself (a refusal) between the check and the call: its loop
                # is closed and there is nothing left to drain.
                pass
            self._thread.join(timeout_s)

    @property
    def refused(self) -> SyncerRefused | None:
        return self._client.refused
