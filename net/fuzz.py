"""Fuzzing the syncer daemon: mutated frames from authenticated peers while honest learners train.

`run(config) -> FuzzReport` starts the real daemon (`SyncerServer`, aiohttp on 127.0.0.1, a free
port), two honest learners over the real client that take part normally (rounds merge), and a few
hostile peers. Each hostile peer holds an authenticated websocket, says hello, and sends frames built
from valid messages of every kind (the syncer's kinds too) and then mutated: bit flips with or
without a fixed checksum, header fields and JSON fields set at and beyond their limits (huge,
negative, float, NaN, wrong types), truncation, chunks reordered, dropped or repeated, oversized
declared counts, non-finite payloads, hostile clocks and tensor lists. Half of the hostile sessions
offer and open a lane (net.lane; every frame with data goes on it) and send some of their frames'
data there, as it should go or out of step with the headers: another message's prefix, bytes short
or over, changed bytes, data no header announced. The honest learners use lanes too. After each
batch it checks:

- the core lives: `/healthz` answers ok, an honest learner's progress is handled and a round merges
  an honest push;
- the global state never moves backwards (fragment versions, rounds, global step, merges);
- no update that any peer received holds a non-finite value;
- the process's resident memory stays within `rss_growth_bytes_max` of where it settled;
- nothing was logged as an unhandled error (a handler that raised, a core that failed).

A core that dies is counted, reported with the batch's mutations, and replaced by a fresh daemon so
the run goes on. Every mutation is drawn from one `numpy.random.Generator` seeded with `seed`: the
sequence of frames is the seed's (the daemon's timing is not, so a failure is reproduced by running
the seed again, usually at the same batch).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import os
import resource
import struct
import time
from collections import Counter, deque
from dataclasses import dataclass, field, fields

import aiohttp
import numpy as np
import orjson

from ddiloco.core import codec as codecs
from ddiloco.core import syncer
from ddiloco.core.checksum import crc32
from ddiloco.core.config import SyncerConfig
from ddiloco.core.events import Push
from ddiloco.core.layout import TensorSpec, layout_from_description
from ddiloco.net import lane, session, wire
from ddiloco.net import messages as msg
from ddiloco.net.client import ClientConfig, SyncerClient
from ddiloco.net.server import ServerConfig, SyncerServer

__all__ = ["LANE_MUTATIONS", "FuzzConfig", "FuzzReport", "raw_frames", "run"]

log = logging.getLogger("ddiloco.fuzz")

TOKEN = "fuzz-token-0123456789abcdef"
TENSORS = (
    TensorSpec("embed", (64, 8), embedding=True),
    TensorSpec("blocks/0/w", (8, 32)),
    TensorSpec("blocks/1/w", (8, 32)),
    TensorSpec("head", (8, 16)),
)
# Small frames, so that pushes and updates are several frames and chunking is exercised.
LIMITS = wire.WireLimits(frame_bytes_max=1024, message_bytes_max=1 << 20, control_bytes_max=64 << 10)
HONEST_LEARNERS = 2
HONEST_TICK_S = 0.05
WAIT_S_MAX = 30.0  # how long a check waits for the core to handle an honest event
WELCOME_WAIT_S_MAX = 10.0  # an honest learner's
HOSTILE_WELCOME_WAIT_S_MAX = 2.0  # a hostile peer goes on without its welcome after this (before-hello refusals)
# Every frame with data on a lane, and a lane silent for a second given up (a header whose data never
# comes holds its connection's reader that long, not the daemon's 30 s).
LANES = lane.LaneLimits(data_bytes_min=1, handshake_s_max=2.0, stall_s_max=1.0)
HOSTILE_LANE_SHARE = 0.5  # of hostile sessions that open a lane
LANE_FRAME_SHARE = 0.5  # of a laned hostile session's frames whose data goes on its lane
# Values at and beyond every limit a field has: the wire's 2**53 - 1, the clocks' 2**52, the core's
# 2**62, int64 and uint64, and every JSON type that is not an integer.
_INTERESTING = (
    0,
    1,
    -1,
    7,
    2**31 - 1,
    2**31,
    2**52,
    2**52 + 1,
    2**53 - 1,
    2**53,
    2**62,
    2**62 + 1,
    2**63 - 1,
    2**63,
    2**64 - 1,
    2**64,
    10**30,
    -(2**63),
    1.5,
    -0.0,
    1e308,
    float("nan"),
    float("inf"),
    float("-inf"),
    True,
    False,
    None,
    "",
    "x" * 3000,
    "\u00b2",
    "\u0663",
    "a\nb",
    "\x00",
    [],
    [1, 2],
    [[-1]],
    {},
    {"a": 1},
)
_NAMES = ("syncer", "a", "", "\u00b2", "x" * 300, "a\nb", "learner-0")
_PATHS = ("blocks/\u00b2/w", "blocks/\u0663/w", "", "x" * 600, "a\x00b", "blocks/9/w", "embed", 5, None, ["a"])


@dataclass(frozen=True)
class FuzzConfig:
    """seconds: how long to fuzz (after the daemon is up); frames_max: stop after this many fuzzed
    frames, whichever comes first (0: no frame limit)."""

    seconds: float = 30.0
    seed: int = 0
    frames_max: int = 0
    batch_frames: int = 200  # fuzzed frames between two checks
    hostile_peers: int = 3
    rss_growth_bytes_max: int = 512 << 20

    def __post_init__(self) -> None:
        if not self.seconds > 0 or self.frames_max < 0:
            raise ValueError(f"seconds must be positive and frames_max >= 0, got {self.seconds}, {self.frames_max}")
        if self.batch_frames < 1 or self.hostile_peers < 1 or self.rss_growth_bytes_max < 1:
            raise ValueError("batch_frames, hostile_peers and rss_growth_bytes_max must be positive")
        if type(self.seed) is not int or self.seed < 0:
            raise ValueError(f"seed must be a non-negative int, got {self.seed!r}")


@dataclass
class FuzzReport:
    seed: int
    frames_sent: int = 0
    errors_answered: int = 0  # error messages the daemon sent to hostile peers
    connections: int = 0
    batches: int = 0
    checks_passed: int = 0
    core_deaths: int = 0
    merges: int = 0
    updates_checked: int = 0
    rss_settled_bytes: int = 0
    rss_peak_bytes: int = 0
    mutations: Counter = field(default_factory=Counter)
    error_codes: Counter = field(default_factory=Counter)
    failures: list[str] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return self.core_deaths == 0 and not self.failures

    def as_dict(self) -> dict:
        """The report as JSON-able values."""
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        out["mutations"], out["error_codes"] = dict(self.mutations), dict(self.error_codes)
        return out | {"ok": self.ok}

    def lines(self) -> list[str]:
        codes = ", ".join(f"{k} {v}" for k, v in self.error_codes.most_common())
        out = [
            (
                f"seed {self.seed}: {self.frames_sent} fuzzed frames in {self.seconds:.1f} s over {self.connections}"
                f" hostile connections, {self.batches} batches"
            ),
            f"errors answered: {self.errors_answered} ({codes})",
            f"core deaths: {self.core_deaths}",
            (
                f"checks passed: {self.checks_passed}/{self.batches} (core alive, honest progress handled, a round merged,"
                f" state monotonic, {self.updates_checked} updates finite, memory bounded, no unhandled error)"
            ),
            (
                f"merges: {self.merges}; resident memory settled at {self.rss_settled_bytes >> 20} MiB, peak"
                f" {self.rss_peak_bytes >> 20} MiB"
            ),
            "mutations: " + ", ".join(f"{k} {v}" for k, v in sorted(self.mutations.items())),
        ]
        out += [f"FAILED: {f}" for f in self.failures]
        out.append("OK" if self.ok else "FAILED")
        return out


def run(config: FuzzConfig) -> FuzzReport:
    """Fuzz a fresh daemon for `config.seconds` (or `config.frames_max` frames)."""
    return asyncio.run(_run(config))


# ---- the run ---------------------------------------------------------------------------------------


async def _run(config: FuzzConfig) -> FuzzReport:
    report = FuzzReport(config.seed)
    rng = np.random.default_rng(config.seed)
    errors = _ErrorLog()
    logging.getLogger().addHandler(errors)
    started = time.monotonic()
    try:
        while not _done(config, report, started):
            await _epoch(config, report, rng, errors, started)
    finally:
        logging.getLogger().removeHandler(errors)
    report.seconds = time.monotonic() - started
    return report


def _done(config: FuzzConfig, report: FuzzReport, started: float) -> bool:
    out_of_time = time.monotonic() - started >= config.seconds
    return out_of_time or (config.frames_max > 0 and report.frames_sent >= config.frames_max)


async def _epoch(
    config: FuzzConfig, report: FuzzReport, rng: np.random.Generator, errors: _ErrorLog, started: float
) -> None:
    """One daemon, fuzzed until the time is up or its core dies."""
    server = SyncerServer(
        syncer.new_state(SyncerConfig(num_fragments=2, period=4, quorum=1)),
        ServerConfig(port=0, auth_token=TOKEN, wire=LIMITS, lane=LANES),
    )
    await server.start()
    url = f"ws://127.0.0.1:{server.port}/ws"
    http = aiohttp.ClientSession()
    honest = [_Honest(url, f"honest-{i}", i, server) for i in range(HONEST_LEARNERS)]
    hostile = [_Hostile(url, f"hostile-{i}", http, report) for i in range(config.hostile_peers)]
    try:
        await honest[0].start()
        await _until(lambda: server.state.holds_parameters, "the first learner's initial parameters")
        for h in honest[1:]:
            await h.start()
        pulse = asyncio.create_task(_pulse(honest))
        watch = _Watch(server, honest, hostile, http, config.rss_growth_bytes_max)
        await watch.settle(report)
        while not _done(config, report, started):
            batch: list[str] = []
            for _ in range(config.batch_frames):
                peer = hostile[int(rng.integers(len(hostile)))]
                try:
                    batch.append(await peer.fuzz_once(rng))
                except (aiohttp.ClientConnectorError, aiohttp.WSServerHandshakeError) as exc:
                    # A daemon whose core failed refuses new sessions with 503, then stops listening
                    # (net.server): a death, not a harness error. Any other refusal is the harness's bug.
                    if isinstance(exc, aiohttp.WSServerHandshakeError) and exc.status != 503:
                        raise
                    watch.core_dead = True
                    how = (
                        "refuses new sessions (503)"
                        if isinstance(exc, aiohttp.WSServerHandshakeError)
                        else "stopped listening"
                    )
                    report.failures.append(
                        f"batch {report.batches + 1}: the daemon {how} ({exc}); sent: {', '.join(batch[-20:])}"
                    )
                    report.failures += [f"batch {report.batches + 1}: {record}" for record in errors.records]
                    break
            report.batches += 1
            problems = [] if watch.core_dead else await watch.check(report, errors)
            if problems:
                report.failures += [f"batch {report.batches}: {p}" for p in problems]
                report.failures.append(f"batch {report.batches} sent: {', '.join(batch[-20:])}")
            elif not watch.core_dead:
                report.checks_passed += 1
            if watch.core_dead:
                report.core_deaths += 1
                break
        pulse.cancel()
    finally:
        report.merges += server.state.merges
        for peer in hostile:
            await peer.close()
        for h in honest:
            await h.stop()
        await http.close()
        try:
            await asyncio.wait_for(server.stop(checkpoint=False), 30)
        except Exception as exc:  # noqa: BLE001 -- a dead core re-raises its failure here, counted already
            log.warning("stopping the fuzzed daemon: %r", exc)


async def _until(predicate, what: str, timeout_s: float = WAIT_S_MAX) -> bool:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out waiting for {what}")
        await asyncio.sleep(0.005)
    return True


async def _pulse(honest: list[_Honest]) -> None:
    """The honest learners train: a step, their pushes of the fragments due, again."""
    while True:
        for h in honest:
            h.tick()
            h.answer()
        await asyncio.sleep(HONEST_TICK_S)


# ---- the checks ----------------------------------------------------------------------------------


class _ErrorLog(logging.Handler):
    """Collects every record logged at ERROR or above: an unhandled exception in a request handler
    (aiohttp logs it), a core that failed, a background task that raised."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.records: deque[str] = deque(maxlen=100)

    def emit(self, record: logging.LogRecord) -> None:
        text = record.getMessage()
        if record.exc_info and record.exc_info[1] is not None:
            text += f": {record.exc_info[1]!r}"
        self.records.append(f"{record.name}: {text[:300]}")


class _Watch:
    def __init__(
        self,
        server: SyncerServer,
        honest: list[_Honest],
        hostile: list[_Hostile],
        http: aiohttp.ClientSession,
        rss_growth_bytes_max: int,
    ) -> None:
        self.server, self.honest, self.hostile, self.http = server, honest, hostile, http
        self.rss_growth_bytes_max = rss_growth_bytes_max
        self.core_dead = False
        self.last: tuple | None = None

    async def settle(self, report: FuzzReport) -> None:
        """Wait for the first merge; memory is measured from there."""
        await _until(lambda: self.server.state.merges > 0, "the first merge")
        report.rss_settled_bytes = _rss_bytes()
        self.last = self._progress_marks()

    async def check(self, report: FuzzReport, errors: _ErrorLog) -> list[str]:
        problems = await self._health(errors)
        if problems:
            return problems
        state = self.server.state
        merges = state.merges
        honest = self.honest[0]
        step = honest.tick()
        try:
            await _until(
                lambda: (
                    (honest.learner in state.learners and state.learners[honest.learner].step >= step)
                    or honest.rejoined()
                ),
                "an honest progress report to be handled",
            )
            await _until(lambda: state.merges > merges, "a merge of honest pushes")
        except TimeoutError as exc:
            problems += await self._health(errors) or [str(exc)]
            if self.core_dead:
                return problems
        marks = self._progress_marks()
        back = [
            name
            for name, was, now in zip(("versions", "rounds", "global step", "merges"), self.last, marks)
            if _behind(now, was)
        ]
        if back:
            problems.append(f"global state moved backwards: {back} from {self.last} to {marks}")
        self.last = marks
        bad = [p for p in [*self.honest, *self.hostile] if p.non_finite]
        report.updates_checked = sum(p.updates_checked for p in [*self.honest, *self.hostile])
        if bad:
            problems.append(f"a non-finite update reached {[p.name for p in bad]}")
        rss = _rss_bytes()
        report.rss_peak_bytes = max(report.rss_peak_bytes, rss)
        if rss - report.rss_settled_bytes > self.rss_growth_bytes_max:
            problems.append(f"resident memory grew from {report.rss_settled_bytes >> 20} MiB to {rss >> 20} MiB")
        while errors.records:
            problems.append(f"unhandled error logged: {errors.records.popleft()}")
        return problems

    async def _health(self, errors: _ErrorLog) -> list[str]:
        """[] while /healthz says the core lives; else why it died, from the log."""
        async with self.http.get(f"http://127.0.0.1:{self.server.port}/healthz") as answer:
            if answer.status == 200:
                return []
            self.core_dead = True
            died = [f"core died: /healthz answers {answer.status} {(await answer.text()).strip()}", *errors.records]
            errors.records.clear()
            return died

    def _progress_marks(self) -> tuple:
        state = self.server.state
        return (
            tuple(f.version for f in state.fragments),
            tuple(f.rounds_opened for f in state.fragments),
            state.global_step,
            state.merges,
        )


def _behind(now, was) -> bool:
    if isinstance(now, tuple):
        return any(n < w for n, w in zip(now, was))
    return now < was


def _rss_bytes() -> int:
    """This process's resident memory (the daemon runs in it)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:  # not Linux: the peak is what the OS offers
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


# ---- honest learners ------------------------------------------------------------------------------


class _Honest:
    """A learner over the real client that trains normally: reports its steps, pushes a small outer
    gradient of each fragment due at its step (the welcome's schedule), and checks every update it
    receives."""

    def __init__(self, url: str, name: str, seed: int, server: SyncerServer) -> None:
        self.name = name
        self.client = SyncerClient(
            ClientConfig(
                url=url,
                name=name,
                tensors=TENSORS,
                token=TOKEN,
                wire=LIMITS,
                reconnect_s_min=0.01,
                reconnect_s_max=0.2,
                progress_interval_s=0,
                close_drain_s=0,
                lane_limits=LANES,
            )
        )
        self.rng = np.random.default_rng(10_000 + seed)
        self.server = server
        self.sizes: list[int] = []
        self.versions: list[int] = []
        self.step = 0
        self.learner = -1
        self.welcomes = 0
        self.non_finite = False
        self.updates_checked = 0
        self.task: asyncio.Task | None = None

    async def start(self) -> None:
        self.task = asyncio.create_task(self.client.run())
        await asyncio.wait_for(self.client.welcomed.wait(), WELCOME_WAIT_S_MAX)
        self._welcomed()

    def rejoined(self) -> bool:
        return self.client.inbox.welcomes != self.welcomes

    def _welcomed(self) -> None:
        box = self.client.inbox
        w = box.welcome
        self.welcomes, self.learner = box.welcomes, w.learner
        self.sizes = [f.padded_size for f in layout_from_description(w.layout).fragments]
        self.versions = [-1] * len(self.sizes)
        self.step = max(self.step, w.global_step)
        if w.needs_init:
            for p, n in enumerate(self.sizes):
                self.client.queue_init(p, codecs.encode(self.rng.standard_normal(n).astype(np.float32), "fp32"))
            self.versions = [0] * len(self.sizes)

    def tick(self) -> int:
        """One step (at least the global step: a learner that fell behind a hostile one's reports
        continues from there, as a rejoining one would); returns it."""
        if self.rejoined() and self.client.inbox.welcome is not None:
            self._welcomed()
        box = self.client.inbox
        for p, chain in list(box.updates.items()):
            for u in chain:  # every update that arrived, whole copies and deltas alike
                self.updates_checked += 1
                self.non_finite |= not u.encoded.all_finite()
                self.versions[p] = u.version
        box.updates.clear()
        self.step = max(self.step + 1, self.server.state.global_step + 1)
        if min(self.versions) >= 0:
            n = len(self.sizes)
            self.client.queue_progress(session.ProgressInfo(self.step, tuple(self.versions), (1,) * n, (64,) * n))
        return self.step

    def answer(self) -> None:
        """Push the fragments due at this step (protocol 2: nobody asks)."""
        welcome = self.client.inbox.welcome
        if welcome is None or not self.versions or min(self.versions) < 0:
            return
        for p in (q for q, t in enumerate(welcome.offsets) if self.step % welcome.period == t):
            vec = self.rng.standard_normal(self.sizes[p]).astype(np.float32) * 0.01
            push = Push(0, p, self.step, self.versions[p], 1, 64, codecs.parse(codecs.encode(vec, "int4")))
            self.client.queue_push(push)

    async def stop(self) -> None:
        if self.task is None:
            return
        await self.client.close()
        await asyncio.wait_for(self.task, WAIT_S_MAX)


# ---- hostile peers --------------------------------------------------------------------------------


class _Hostile:
    """An authenticated websocket that sends mutated frames; it reconnects (and says hello) whenever
    the daemon closes it after a fatal error."""

    def __init__(self, url: str, name: str, http: aiohttp.ClientSession, report: FuzzReport) -> None:
        self.url, self.name, self.http, self.report = url, name, http, report
        self.ws: aiohttp.ClientWebSocketResponse | None = None
        self.lane: lane.Lane | None = None  # this session's, when it opened one
        self.reader: asyncio.Task | None = None
        self.ids = 0
        self.welcome: session.WelcomeInfo | None = None
        self.sizes: list[int] = [256, 256]
        self.versions: list[int] = [0, 0]
        self.step = 0
        self.non_finite = False
        self.updates_checked = 0

    async def fuzz_once(self, rng: np.random.Generator) -> str:
        """Send one fuzzed message (one or more frames); its mutation's name."""
        if self.ws is None or self.ws.closed:
            await self._connect(rng)
        label, frames = _fuzzed(rng, self)
        self.report.mutations[label.split(":")[0]] += 1
        for frame in frames:
            if self.ws.closed:
                break
            try:
                if self.lane is not None and len(frame) > wire.HEADER_BYTES and rng.random() < LANE_FRAME_SHARE:
                    self.report.mutations[await self._on_lane(rng, bytes(frame))] += 1
                else:
                    await self.ws.send_bytes(bytes(frame))
            except (ConnectionError, RuntimeError, aiohttp.ClientError):
                break  # closed under us after an earlier fatal error: the next message reconnects
            self.report.frames_sent += 1
        await asyncio.sleep(0)  # let the reader see a close the daemon sent, so the next message reconnects
        return label

    async def _on_lane(self, rng: np.random.Generator, frame: bytes) -> str:
        """Send `frame`'s header on the websocket and its data on the lane, as the protocol says or
        out of step with the header; the label of what was done."""
        fields = wire.HEADER.unpack_from(frame)
        data = frame[wire.HEADER_BYTES :]
        how = LANE_MUTATIONS[int(rng.integers(len(LANE_MUTATIONS)))]
        prefix = wire.LANE_PREFIX.pack(fields[4], fields[5], len(data))
        if how == "lane:other message":
            prefix = wire.LANE_PREFIX.pack((fields[4] + 1 + int(rng.integers(1 << 20))) % 2**64, fields[5], len(data))
        elif how == "lane:short":
            data = data[: int(rng.integers(len(data)))]
        elif how == "lane:over":
            data = data + bytes(int(rng.integers(1, 64)))
        elif how == "lane:changed":
            changed = bytearray(data)
            changed[int(rng.integers(len(changed)))] ^= 1 << int(rng.integers(8))
            data = bytes(changed)
        if how != "lane:no header":
            await self.ws.send_bytes(frame[: wire.HEADER_BYTES])
        try:
            await asyncio.to_thread(self.lane._sock.sendall, prefix + data)
        except OSError:
            pass  # the daemon closed it after an earlier error: the websocket's close follows
        return how

    async def _connect(self, rng: np.random.Generator) -> None:
        await self.close()
        token = lane.new_token() if rng.random() < HOSTILE_LANE_SHARE else None
        headers = {"Authorization": f"Bearer {TOKEN}"} | ({lane.LANE_HEADER: token} if token else {})
        self.ws = await self.http.ws_connect(
            self.url, headers=headers, max_msg_size=LIMITS.max_msg_size, heartbeat=None
        )
        self.report.connections += 1
        self.welcome = None
        if token is not None:
            self.lane = await self._open_lane(token)
        self.reader = asyncio.create_task(self._read(self.ws))
        if rng.random() < 0.85:  # mostly a real session, so the messages after the hello reach the core
            hello = session.hello_frames(self.name, TENSORS, self._id(), LIMITS, {self.name: 1})
            for frame in hello:
                await self.ws.send_bytes(bytes(frame))
            try:
                await _until(
                    lambda: self.welcome is not None or self.ws.closed, "a welcome", HOSTILE_WELCOME_WAIT_S_MAX
                )
            except TimeoutError:
                pass  # the session goes on without it; what follows is refused as before-hello

    async def _open_lane(self, token: str) -> lane.Lane | None:
        try:
            return await lane.dial(self.http, self.url, {}, token, LANES)
        except lane.LaneError as exc:
            self.report.failures.append(f"{self.name}: its lane was refused: {exc}")
            return None

    def _id(self) -> int:
        self.ids += 1
        return self.ids

    async def _read(self, ws: aiohttp.ClientWebSocketResponse) -> None:
        reassembler = wire.Reassembler(LIMITS, accepted=msg.SYNCER_KINDS)
        on_lane = self.lane
        async for frame in ws:
            if frame.type is not aiohttp.WSMsgType.BINARY:
                continue
            try:
                m, _ = await lane.receive_frame(reassembler, frame.data, on_lane)
            except wire.WireError as exc:  # the daemon must only send valid frames
                self.report.failures.append(f"the daemon sent a frame {self.name} cannot read: {exc}")
                return
            except lane.LaneError:
                return  # the daemon closed this session's lane after its own bad bytes
            if m is not None:
                self._take(m)

    def _take(self, m: msg.Message) -> None:
        if isinstance(m, msg.Error):
            self.report.errors_answered += 1
            self.report.error_codes[m.code.name.lower()] += 1
        elif isinstance(m, msg.Welcome):
            self.welcome = session.client_view(m)
            self.sizes = [f.padded_size for f in layout_from_description(self.welcome.layout).fragments]
            self.versions = [max(v, 0) for v in m.versions]
            self.step = max(self.step, m.global_step)
        elif isinstance(m, msg.Update):
            info = session.client_view(m)
            self.updates_checked += 1
            self.non_finite |= not info.encoded.all_finite()
            if m.fragment < len(self.versions):
                self.versions[m.fragment] = m.version

    async def close(self) -> None:
        if self.ws is not None:
            await self.ws.close()
        if self.lane is not None:
            self.lane.close()
            self.lane = None
        if self.reader is not None:
            try:
                await self.reader
            except (ConnectionError, aiohttp.ClientError, asyncio.CancelledError):
                pass


# ---- building fuzzed messages ------------------------------------------------------------------------


# What a laned hostile peer does with one frame's data (`_Hostile._on_lane`): as the protocol says,
# behind another message's prefix, short of or beyond the bytes declared, with a bit changed, or with
# no header on the websocket to announce it.
LANE_MUTATIONS = (
    "lane:as announced",
    "lane:other message",
    "lane:short",
    "lane:over",
    "lane:changed",
    "lane:no header",
)


def _fuzzed(rng: np.random.Generator, peer: _Hostile) -> tuple[str, list[bytes]]:
    """A valid message of a random kind, then one mutation of it: (label, frames)."""
    kind, meta, payload = _valid(rng, peer)
    mutation = _MUTATIONS[int(rng.integers(len(_MUTATIONS)))]
    return mutation(rng, peer, kind, meta, payload)


def _valid(rng: np.random.Generator, peer: _Hostile) -> tuple[msg.Kind, dict, bytes]:
    """(kind, meta as a dict, payload) of a message that is valid, or nearly (a push from the version
    the peer really holds, with the counters it really has)."""
    choice = int(rng.integers(12))
    clock = {peer.name: int(rng.integers(1, 1000))}
    fragment = int(rng.integers(len(peer.sizes)))
    if choice == 0:
        m = msg.Hello(
            name=peer.name,
            layout_digest="0" * 64,
            shard=0,
            resume_learner_id=None,
            held_versions=(),
            clock=clock,
            tensors_json=session.tensors_json(TENSORS),
        )
    elif choice in (1, 2, 3):
        peer.step += int(rng.integers(0, 3))
        n = len(peer.versions)
        m = msg.Progress(
            step=peer.step,
            held_versions=tuple(peer.versions),
            fragment_steps=(1,) * n,
            fragment_tokens=(64,) * n,
            clock=clock,
        )
    elif choice in (4, 5, 6):
        m = _push(rng, peer, fragment, clock)
    elif choice == 7:
        values = rng.standard_normal(peer.sizes[fragment]).astype(np.float32)
        m = msg.Init(fragment=fragment, element_count=values.size, clock=clock, payload=values)
    elif choice == 8:
        data = rng.bytes(int(rng.integers(0, 300)))
        m = msg.LocalState(
            snapshot=int(rng.integers(0, 3)), sha256=hashlib.sha256(data).hexdigest(), clock=clock, payload=data
        )
    elif choice == 9:
        m = (
            msg.Bye(reason="fuzz")
            if rng.random() < 0.5
            else msg.Error(code=msg.ErrorCode.INTERNAL, text="fuzz", fatal=bool(rng.random() < 0.5))
        )
    else:  # the syncer's own kinds, from the wrong side
        m = _syncer_kind(rng, peer, fragment, clock)
    payload = bytes(m.payload) if m.KIND in msg.BULK_KINDS else b""
    return m.KIND, orjson.loads(msg.message_meta(m)), payload


def _push(rng: np.random.Generator, peer: _Hostile, fragment: int, clock: dict) -> msg.Push:
    """A push of `fragment` from the version the peer holds, in a random codec."""
    fragment = fragment % len(peer.sizes)
    name = ("int4", "fp32", "bf16", "int2", "int1")[int(rng.integers(5))]
    vec = rng.standard_normal(peer.sizes[fragment]).astype(np.float32) * 0.01
    encoded = codecs.encode(vec, name)
    parsed = codecs.parse(encoded)
    return msg.Push(
        fragment=fragment,
        step=peer.step,
        base_version=peer.versions[fragment],
        steps=1,
        tokens=64,
        codec=name,
        block=max(parsed.block, 1),
        element_count=parsed.elements,
        clock=clock,
        payload=memoryview(encoded)[codecs.HEADER_BYTES :],
    )


def _syncer_kind(rng: np.random.Generator, peer: _Hostile, fragment: int, clock: dict) -> msg.Message:
    pick = int(rng.integers(1, 4))
    if pick == 1:
        return msg.Marker(snapshot=1, clock=clock)
    if pick == 2:
        values = np.zeros(peer.sizes[fragment], dtype=np.float32)
        return msg.Update(
            fragment=fragment,
            version=1,
            codec="fp32",
            element_count=values.size,
            clock=clock,
            global_step=0,
            payload=values,
        )
    return msg.Welcome(
        learner_id=1,
        layout_digest="0" * 64,
        fragment_count=1,
        versions=(0,),
        sync_every_steps=1,
        fragment_offsets=(0,),
        global_step=0,
        codec="int4",
        codec_block=128,
        clock=clock,
        needs_init=False,
        layout_json="{}",
    )


def raw_frames(kind: int, meta: bytes, payload: bytes, *, message_id: int, limits: wire.WireLimits) -> list[bytearray]:
    """The frames of a message of `kind` whose meta is any bytes (valid JSON or not, fields of any
    value): cut as `wire.encode` cuts a message, each with a correct checksum. What a peer that does
    not go through `net.messages` (a buggy or hostile one) can send."""
    meta = meta + b" " * (-len(meta) % wire.META_ALIGN_BYTES)
    body = meta + payload
    capacity = limits.frame_data_bytes_max
    count = max(1, -(-len(body) // capacity))
    frames = []
    for index in range(count):
        data = body[index * capacity : (index + 1) * capacity]
        frame = bytearray(wire.HEADER_BYTES + len(data))
        wire.HEADER.pack_into(
            frame,
            0,
            wire.MAGIC,
            wire.PROTOCOL_VERSION,
            kind,
            0,
            message_id,
            index,
            count,
            index * capacity,
            len(payload),
            len(meta),
            0,
        )
        frame[wire.HEADER_BYTES :] = data
        _fix_crc(frame)
        frames.append(frame)
    return frames


def _frames(peer: _Hostile, kind: int, meta: bytes, payload: bytes) -> list[bytearray]:
    return raw_frames(kind, meta, payload, message_id=peer._id(), limits=LIMITS)


def _fix_crc(frame: bytearray) -> None:
    if len(frame) >= wire.HEADER_BYTES:
        crc = crc32(bytes(frame[wire.HEADER_BYTES :]), crc32(bytes(frame[: wire.CRC_OFFSET])))
        struct.pack_into("<I", frame, wire.CRC_OFFSET, crc)


def _dumps(meta: object) -> bytes:
    """JSON that orjson would not write: integers beyond 64 bits, NaN and Infinity."""
    return json.dumps(meta, allow_nan=True, separators=(",", ":")).encode()


def _pick(rng: np.random.Generator, values: tuple) -> object:
    return values[int(rng.integers(len(values)))]


# Each mutation: (rng, peer, kind, meta, payload) -> (label, frames).


def _unchanged(rng, peer, kind, meta, payload):
    return f"valid:{kind.name.lower()}", _frames(peer, kind, _dumps(meta), payload)


def _field_value(rng, peer, kind, meta, payload):
    if not meta:
        return _unchanged(rng, peer, kind, meta, payload)
    key = _pick(rng, tuple(sorted(meta)))
    value = _pick(rng, _INTERESTING)
    if isinstance(meta[key], list) and meta[key] and rng.random() < 0.5:
        meta[key][int(rng.integers(len(meta[key])))] = value  # one entry of a list
    else:
        meta[key] = value
    return f"field:{kind.name.lower()}.{key}", _frames(peer, kind, _dumps(meta), payload)


def _clock(rng, peer, kind, meta, payload):
    clock = {_pick(rng, _NAMES): _pick(rng, _INTERESTING) for _ in range(int(rng.integers(1, 4)))}
    if rng.random() < 0.1:
        clock = {f"p{i}": 1 for i in range(5000)}  # above the entry limit (and the control limit)
    meta["clock"] = clock
    return f"clock:{kind.name.lower()}", _frames(peer, kind, _dumps(meta), payload)


def _tensors(rng, peer, kind, meta, payload):
    rows = [[t.path, list(t.shape), t.dtype, t.embedding] for t in TENSORS]
    row = rows[int(rng.integers(len(rows)))]
    part = int(rng.integers(5))
    if part == 0:
        row[0] = _pick(rng, _PATHS)
    elif part == 1:
        row[1] = [_pick(rng, _INTERESTING) for _ in range(int(rng.integers(0, 4)))]
    elif part == 2:
        row[2] = _pick(rng, ("float64", "", 5, None, "bfloat16"))
    elif part == 3:
        row[3] = _pick(rng, _INTERESTING)
    else:
        rows = _pick(rng, ([], {}, "x", [[]], [[1, 2, 3, 4, 5]], [rows[0]] * 2, 7))
    hello = orjson.loads(
        msg.message_meta(
            msg.Hello(
                name=peer.name,
                layout_digest="0" * 64,
                shard=0,
                resume_learner_id=None,
                held_versions=(),
                clock={},
                tensors_json="[]",
            )
        )
    )
    hello["tensors_json"] = _dumps(rows).decode()
    return f"tensors:{('path', 'shape', 'dtype', 'embedding', 'list')[part]}", _frames(
        peer, msg.Kind.HELLO, _dumps(hello), b""
    )


def _structure(rng, peer, kind, meta, payload):
    pick = int(rng.integers(5))
    if pick == 0 and meta:
        del meta[_pick(rng, tuple(sorted(meta)))]
        body = _dumps(meta)
    elif pick == 1:
        meta["unknown_field"] = 1
        body = _dumps(meta)
    elif pick == 2:
        body = _dumps(_pick(rng, ([], 1, "x", None, [meta])))
    elif pick == 3:
        body = _dumps(meta)[: int(rng.integers(0, 40))]  # JSON cut short
    else:
        body = rng.bytes(int(rng.integers(2, 200)))
    return f"structure:{('missing', 'unknown', 'not_object', 'cut_json', 'random')[pick]}", _frames(
        peer, kind, body, payload
    )


def _payload(rng, peer, kind, meta, payload):
    if kind not in msg.BULK_KINDS or not payload:
        payload = rng.bytes(int(rng.integers(1, 64)))  # a payload on a control kind
        return f"payload:on_{kind.name.lower()}", _frames(peer, kind, _dumps(meta), payload)
    data = bytearray(payload)
    pick = int(rng.integers(4))
    if pick == 0 and kind in (msg.Kind.PUSH, msg.Kind.INIT) and meta.get("codec", "fp32") == "fp32":
        values = np.frombuffer(bytes(data), dtype=np.float32).copy()
        values[int(rng.integers(values.size))] = _pick(rng, (np.nan, np.inf, -np.inf))
        data = bytearray(values.tobytes())
    elif pick == 1:
        data = data[: int(rng.integers(len(data)))]
    elif pick == 2:
        data += rng.bytes(int(rng.integers(1, 16)))
    else:
        for i in rng.integers(0, len(data), size=8):
            data[int(i)] = int(rng.integers(256))
    return f"payload:{('non_finite', 'short', 'long', 'garbage')[pick]}", _frames(peer, kind, _dumps(meta), bytes(data))


def _bit_flips(rng, peer, kind, meta, payload):
    frames = _frames(peer, kind, _dumps(meta), payload)
    frame = frames[int(rng.integers(len(frames)))]
    in_header = rng.random() < 0.5
    for _ in range(int(rng.integers(1, 9))):
        at = int(rng.integers(wire.HEADER_BYTES if in_header else len(frame)))
        frame[at] ^= 1 << int(rng.integers(8))
    fixed = rng.random() < 0.7  # mostly with a correct checksum, so the flip reaches the parser
    if fixed:
        _fix_crc(frame)
    return f"bitflip:{'header' if in_header else 'anywhere'}{'+crc' if fixed else ''}", frames


def _header_field(rng, peer, kind, meta, payload):
    frames = _frames(peer, kind, _dumps(meta), payload)
    frame = frames[int(rng.integers(len(frames)))]
    fields = {
        "version": (4, "<B"),
        "kind": (5, "<B"),
        "flags": (6, "<H"),
        "message_id": (8, "<Q"),
        "chunk_index": (16, "<I"),
        "chunk_count": (20, "<I"),
        "chunk_offset": (24, "<Q"),
        "payload_bytes": (32, "<Q"),
        "meta_bytes": (40, "<I"),
    }
    name = _pick(rng, tuple(fields))
    offset, fmt = fields[name]
    top = 2 ** (8 * struct.calcsize(fmt)) - 1
    value = _pick(rng, (0, 1, 2, 3, 11, 12, 255, top, top - 1, 1 << 20, 1 << 30, 2**31))
    struct.pack_into(fmt, frame, offset, min(value, top))
    _fix_crc(frame)
    return f"header:{name}", frames


def _truncate(rng, peer, kind, meta, payload):
    frames = _frames(peer, kind, _dumps(meta), payload)
    i = int(rng.integers(len(frames)))
    frames[i] = frames[i][: int(rng.integers(0, len(frames[i])))]
    fixed = rng.random() < 0.5
    if fixed:
        _fix_crc(frames[i])
    return f"truncate{'+crc' if fixed else ''}", frames


def _sequence(rng, peer, kind, meta, payload):
    """Chunks out of order, repeated, dropped, or the first chunk of a message again and again."""
    if kind in msg.BULK_KINDS:
        payload = payload or rng.bytes(3000)  # several frames
    frames = _frames(peer, kind, _dumps(meta), payload)
    pick = int(rng.integers(4))
    if pick == 0:
        order = rng.permutation(len(frames))
        frames = [frames[int(i)] for i in order]
    elif pick == 1:
        frames = frames + frames[: int(rng.integers(1, len(frames) + 1))]
    elif pick == 2 and len(frames) > 1:
        del frames[int(rng.integers(len(frames)))]
    else:
        frames = [frames[0]] * int(rng.integers(2, 5))  # many messages in flight, by one id
    return f"sequence:{('reorder', 'repeat', 'drop', 'first_again')[pick]}", frames


def _oversized(rng, peer, kind, meta, payload):
    """A first chunk that declares a huge message: refused before anything is reserved."""
    frames = _frames(peer, kind, _dumps(meta), payload or rng.bytes(2000))
    frame = frames[0]
    struct.pack_into("<I", frame, 20, max(2, int(rng.integers(2, 2**32))))  # chunk count
    struct.pack_into("<Q", frame, 32, int(_pick(rng, (2**20, 2**30, 2**40, 2**63, 2**64 - 1))))  # payload bytes
    _fix_crc(frame)
    return "oversized", [frame]


def _counters(rng, peer, kind, meta, payload):
    """A push or a progress whose counters are valid JSON integers at and past every limit."""
    big = (0, 2**52, 2**53 - 1, 2**53, 2**62, 2**62 + 1, 2**63 - 1, 2**63)
    if rng.random() < 0.5:
        push = _push(rng, peer, int(rng.integers(len(peer.sizes))), {})
        kind, meta, payload = push.KIND, orjson.loads(msg.message_meta(push)), bytes(push.payload)
        key = _pick(rng, ("tokens", "steps", "step", "base_version", "fragment", "element_count", "block"))
        meta[key] = _pick(rng, big)
    else:
        n = len(peer.versions)
        meta = {
            "step": peer.step + int(_pick(rng, (1, 10**5, 10**5 + 1, 10**6, 2**53 - 1))),
            "held_versions": list(peer.versions),
            "fragment_steps": [1] * n,
            "fragment_tokens": [64] * n,
            "clock": {},
        }
        key = _pick(rng, ("step", "held_versions", "fragment_steps", "fragment_tokens"))
        if key != "step":
            meta[key] = [int(_pick(rng, big)) for _ in range(n)]
        kind, payload = msg.Kind.PROGRESS, b""
    return f"counters:{kind.name.lower()}.{key}", _frames(peer, kind, _dumps(meta), payload)


_MUTATIONS = (
    _unchanged,
    _unchanged,
    _field_value,
    _field_value,
    _field_value,
    _clock,
    _tensors,
    _structure,
    _payload,
    _bit_flips,
    _bit_flips,
    _header_field,
    _truncate,
    _sequence,
    _oversized,
    _counters,
    _counters,
)
