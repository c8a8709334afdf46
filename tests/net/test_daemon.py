"""The real syncer server on 127.0.0.1 (a free port) with real clients over loopback websockets."""

from __future__ import annotations

import asyncio
import os
import struct

import aiohttp
import aiohttp.web
import numpy as np
import pytest

from ddiloco.core import codec, syncer
from ddiloco.core.checksum import crc32
from ddiloco.core.config import SyncerConfig
from ddiloco.core.events import Push
from ddiloco.core.layout import TensorSpec
from ddiloco.core.syncer import STALENESS_MAX
from ddiloco.net import messages as msg
from ddiloco.net import session, store, wire
from ddiloco.net.client import ClientConfig, SyncerClient, SyncerRefused
from ddiloco.net.server import ServerConfig, SyncerServer

from ..waiting import steps_until, until

TOKEN = "test-token-0123456789abcdef"
TENSORS = (
    TensorSpec("embed", (64, 8), embedding=True),
    TensorSpec("blocks/0/w", (8, 32)),
    TensorSpec("blocks/1/w", (8, 32)),
    TensorSpec("head", (8, 16)),
)
SMALL = wire.WireLimits(frame_bytes_max=1024)  # small frames: every push is several frames


class Syncer:
    def __init__(self, tmp_path, **cfg):
        cfg.setdefault("num_fragments", 2)
        cfg.setdefault("period", 2)
        self.config = SyncerConfig(**cfg)
        self.dir = tmp_path / "ckpt"
        self.server = None

    async def start(self, state=None, wire_limits=SMALL, port=0, run_id=None):
        state = state or syncer.new_state(self.config)
        config = ServerConfig(port=port, auth_token=TOKEN, checkpoint_dir=self.dir, wire=wire_limits, run_id=run_id)
        self.server = SyncerServer(state, config)
        await self.server.start()
        return self.server

    @property
    def ws_url(self):
        return f"ws://127.0.0.1:{self.server.port}/ws"

    @property
    def http(self):
        return f"http://127.0.0.1:{self.server.port}"


class Learner:
    """A minimal learner over the real client: pushes small random outer gradients of the fragments
    due at its step (the welcome's schedule; protocol 2: nobody asks)."""

    def __init__(self, url, name, tensors=TENSORS, token=TOKEN, seed=0, ca_file=None):
        self.client = SyncerClient(
            ClientConfig(url=url, name=name, tensors=tensors, token=token, wire=SMALL, ca_file=ca_file)
        )
        self.rng = np.random.default_rng(seed)
        self.versions = None
        self.step = 0
        self.task = asyncio.create_task(self.client.run())

    async def welcome(self):
        await asyncio.wait_for(self.client.welcomed.wait(), 10)
        if self.client.refused:
            raise self.client.refused
        w = self.client.inbox.welcome
        self.layout = w.layout
        self.sizes = [
            -(-max(128, sum(int(np.prod(shape)) for _, shape, _, _ in frag)) // 128) * 128
            for frag in w.layout["fragments"]
        ]
        self.versions = [-1] * len(self.sizes)
        self.step = w.global_step  # a (re)joining learner continues the syncer's step count
        if w.needs_init:
            for p, n in enumerate(self.sizes):
                self.client.queue_init(p, codec.encode(self.rng.standard_normal(n).astype(np.float32), "fp32"))
            self.versions = [0] * len(self.sizes)
        return w

    def absorb(self):
        box = self.client.inbox
        for p, chain in list(box.updates.items()):
            self.versions[p] = chain[-1].version
        box.updates.clear()

    def tick(self, tokens=64):
        self.absorb()
        self.step += 1
        n = len(self.sizes)
        if min(self.versions) >= 0:  # as a learner does: it reports once it holds every fragment
            self.client.queue_progress(session.ProgressInfo(self.step, tuple(self.versions), (1,) * n, (tokens,) * n))

    def due(self):
        """The fragments due at this learner's step (none while it does not hold every fragment)."""
        w = self.client.inbox.welcome
        if min(self.versions) < 0:
            return []
        return [p for p, t in enumerate(w.offsets) if self.step % w.period == t]

    def answer(self):
        for p in self.due():
            vec = self.rng.standard_normal(self.sizes[p]).astype(np.float32) * 0.01
            learner = self.client.inbox.welcome.learner
            push = Push(learner, p, self.step, self.versions[p], 1, 64, codec.parse(codec.encode(vec, "int4")))
            self.client.queue_push(push)

    async def stop(self):
        await self.client.close()
        self.task.cancel()
        try:
            await self.task
        except (asyncio.CancelledError, Exception):
            pass


async def train(server, learners, steps):
    for _ in range(steps):
        for lr in learners:
            lr.tick()
        await asyncio.sleep(0.01)
        for lr in learners:
            lr.answer()
        await asyncio.sleep(0.01)


async def train_until(server, learners, merges):
    """Train step by step until the daemon has merged `merges` times (bounded, never a fixed count)."""
    await steps_until(lambda: train(server, learners, 1), lambda: server.state.merges >= merges, f"{merges} merges")


async def two_learners(s):
    a = Learner(s.ws_url, "a", seed=1)
    wa = await a.welcome()
    assert wa.needs_init
    b = Learner(s.ws_url, "b", seed=2)
    wb = await b.welcome()
    assert not wb.needs_init
    await until(lambda: s.server.state.holds_parameters, what="initial parameters")
    await until(lambda: len(b.client.inbox.updates) == 2, what="recovery updates")
    return a, b


async def test_learners_join_init_and_merge_over_real_sockets(tmp_path):
    s = Syncer(tmp_path)
    await s.start()
    a, b = await two_learners(s)
    await train(s.server, [a, b], 12)
    await until(lambda: s.server.state.merges >= 4, what="merges")
    assert s.server.state.init_source == "learner 1"
    async with aiohttp.ClientSession() as http:
        status = await (await http.get(f"{s.http}/status")).json()
        metrics = await (await http.get(f"{s.http}/metrics")).text()
        answer = await http.get(f"{s.http}/healthz")
        health = await answer.json()
    assert answer.status == 200 and health["status"] == "ok" and health["reasons"] == []
    assert health["core"]["running"] and health["checkpoint"]["ok"]
    assert status["checkpoint"] == {**status["checkpoint"], "ok": True, "error": None} and "core" in status
    assert {l["status"] for l in status["learners"]} == {"live"}
    assert status["merges"] >= 4 and all(f["version"] >= 1 for f in status["fragments"])
    assert any("merged" in d["reason"] for d in status["decisions"])
    assert "ddiloco_merges_total" in metrics and 'ddiloco_round_seconds_bucket{le="+Inf"}' in metrics
    merged = next(
        float(line.split()[1]) for line in metrics.splitlines() if line.startswith("ddiloco_pushes_merged_total")
    )
    assert s.server.metrics.merges <= merged <= s.server.metrics.pushes_merged  # a round merges one push or more
    # every byte the learners received was counted as sent (welcomes, requests, the broadcasts)
    sent = next(float(line.split()[1]) for line in metrics.splitlines() if line.startswith("ddiloco_sent_bytes_total"))
    assert 0 < sent <= s.server.metrics.bytes_out  # (the learners go on meanwhile)
    assert s.server.metrics.bytes_out >= sum(c.bytes_out for c in s.server.sessions.conns.values())
    s.server.state.ledger.check()
    await a.stop()
    await b.stop()
    await s.server.stop()


async def test_wrong_or_missing_token_is_refused_before_upgrade(tmp_path):
    s = Syncer(tmp_path)
    await s.start()
    async with aiohttp.ClientSession() as http:
        for headers in ({}, {"Authorization": "Bearer wrong-token-0123456789"}):
            with pytest.raises(aiohttp.WSServerHandshakeError) as info:
                await http.ws_connect(s.ws_url, headers=headers)
            assert info.value.status == 401
    bad = Learner(s.ws_url, "x", token="not-the-token-0123456789")
    with pytest.raises(SyncerRefused, match="401"):
        await bad.welcome()
    await bad.stop()
    await s.server.stop()


async def test_layout_mismatch_is_a_clear_fatal_error(tmp_path):
    s = Syncer(tmp_path)
    await s.start()
    a, b = await two_learners(s)
    other = TENSORS[:-1] + (TensorSpec("head", (8, 17)),)
    c = Learner(s.ws_url, "c", tensors=other)
    with pytest.raises(SyncerRefused, match="bad_layout.*head"):
        await c.welcome()
    for lr in (a, b, c):
        await lr.stop()
    await s.server.stop()


async def raw_socket(s):
    http = aiohttp.ClientSession()
    ws = await http.ws_connect(s.ws_url, headers={"Authorization": f"Bearer {TOKEN}"}, max_msg_size=SMALL.max_msg_size)
    return http, ws


async def next_error(ws):
    reassembler = wire.Reassembler(SMALL)
    while True:
        m = await asyncio.wait_for(ws.receive(), 20)
        assert m.type is aiohttp.WSMsgType.BINARY, m
        message = reassembler.feed(m.data)
        if isinstance(message, msg.Error):
            return message


@pytest.mark.parametrize(
    "garbage",
    [b"", b"\x00" * 7, os.urandom(100), b"DDLC" + os.urandom(60)],
)
async def test_garbage_frames_get_an_error_frame_and_touch_nothing(tmp_path, garbage):
    s = Syncer(tmp_path)
    await s.start()
    # Garbage first, while nothing else moves the state (learners' reports and grace timers in
    # flight would change the hash on their own); then learners show the daemon still serves.
    before = syncer.state_hash(s.server.state)
    http, ws = await raw_socket(s)
    await ws.send_bytes(garbage)
    err = await next_error(ws)
    assert err.code in (msg.ErrorCode.BAD_FRAME, msg.ErrorCode.CHECKSUM, msg.ErrorCode.PROTOCOL_VERSION)
    await ws.close()
    await http.close()
    assert syncer.state_hash(s.server.state) == before
    assert sum(s.server.metrics.wire_errors.values()) >= 1
    a, b = await two_learners(s)
    await train(s.server, [a, b], 8)
    await until(lambda: s.server.state.merges > 0, what="merges after garbage")
    await a.stop()
    await b.stop()
    await s.server.stop()


async def test_learner_dying_half_way_through_a_push(tmp_path):
    s = Syncer(tmp_path)
    await s.start()
    a, b = await two_learners(s)
    vec = np.ones(a.sizes[0], dtype=np.float32)
    push = Push(3, 0, 1, 0, 1, 64, codec.parse(codec.encode(vec, "fp32")))
    frames = session.bulk_frames(push, 99, SMALL)
    assert len(frames) > 2
    # a third learner says hello, sends the first half of a push, and dies
    http, ws = await raw_socket(s)
    for f in session.hello_frames("c", TENSORS, 1, SMALL):
        await ws.send_bytes(bytes(f))
    await until(lambda: 3 in s.server.state.learners, what="third learner joined")
    before = syncer.state_hash(s.server.state)
    for f in frames[: len(frames) // 2]:
        await ws.send_bytes(bytes(f))
    await ws.close()
    await http.close()
    await until(lambda: s.server.state.learners[3].status is syncer.LearnerStatus.GONE, what="c gone")
    assert syncer.state_hash(s.server.state) == before  # nothing half-received reached the core
    await train(s.server, [a, b], 6)
    await until(lambda: s.server.state.merges >= 2, what="merges after the death")
    s.server.state.ledger.check()
    await a.stop()
    await b.stop()
    await s.server.stop()


async def test_push_too_stale_rejected_with_reason(tmp_path):
    s = Syncer(tmp_path)
    await s.start()
    a, b = await two_learners(s)
    state = s.server.state
    while max(f.version for f in state.fragments) <= STALENESS_MAX:  # bounded by `until` below
        await train(s.server, [a, b], 2)
        await until(lambda: state.merges >= 1, what="merges")
    frag = next(p for p, f in enumerate(state.fragments) if f.version > STALENESS_MAX)
    me = a.client.inbox.welcome.learner
    vec = np.zeros(a.sizes[frag], dtype=np.float32)
    a.client.inbox.updates.clear()
    a.client.queue_push(Push(me, frag, a.step, 0, 1, 64, codec.parse(codec.encode(vec, "int4"))))
    await until(lambda: any(e.code == "stale" for e in a.client.inbox.errors), what="stale error")
    err = next(e for e in a.client.inbox.errors if e.code == "stale")
    assert "base version 0 is" in err.text and "versions behind" in err.text
    # every version was sent to it as merged (whether a whole copy follows: tests/core/test_syncer.py)
    assert state.learners[me].addressed[frag] == state.fragments[frag].version
    await a.stop()
    await b.stop()
    await s.server.stop()


async def test_resume_from_checkpoint_to_identical_state_and_resume_of_resume(tmp_path):
    s = Syncer(tmp_path, checkpoint_every_merges=2)
    await s.start()
    a, b = await two_learners(s)
    await train(s.server, [a, b], 10)
    await until(lambda: s.server.state.merges >= 4, what="merges")
    await a.stop()
    await b.stop()
    await s.server.stop()  # writes a last checkpoint
    final = syncer.state_hash(s.server.state)
    resumed, path = store.newest_valid(s.dir)
    assert syncer.state_hash(resumed) == final
    # the resumed syncer serves again; learners reconnect and merging continues from there
    s2 = Syncer(tmp_path)
    s2.dir = s.dir
    merges_before = resumed.merges
    await s2.start(resumed, run_id=store.run_of(path))  # the same run goes on in the same directory
    c = Learner(s2.ws_url, "c", seed=5)
    assert not (await c.welcome()).needs_init
    await until(lambda: len(c.client.inbox.updates) == 2, what="recovery")
    versions_before = [f.version for f in resumed.fragments]
    await train(s2.server, [c], 8)
    await until(lambda: s2.server.state.merges > merges_before, what="merges after resume")
    assert any(f.version > v for f, v in zip(s2.server.state.fragments, versions_before))
    await c.stop()
    await s2.server.stop()
    again, _ = store.newest_valid(s.dir)
    assert syncer.state_hash(again) == syncer.state_hash(s2.server.state)


async def test_corrupt_newest_checkpoint_is_skipped(tmp_path, caplog):
    s = Syncer(tmp_path, checkpoint_every_merges=1)
    await s.start()
    a, b = await two_learners(s)
    await train(s.server, [a, b], 6)
    await until(lambda: s.server.metrics.checkpoints >= 2, what="two checkpoints")
    await a.stop()
    await b.stop()
    await s.server.stop(checkpoint=False)
    files = sorted(s.dir.glob("ckpt-*.safetensors"))
    newest = files[-1]
    data = bytearray(newest.read_bytes())
    data[len(data) // 2] ^= 0xFF
    newest.write_bytes(bytes(data))
    state, path = store.newest_valid(s.dir)
    assert path == files[-2]
    assert "skipping checkpoint" in caplog.text


async def test_learner_that_does_not_read_is_dropped_not_buffered(tmp_path):
    from ddiloco.net.connection import QueueLimits

    s = Syncer(tmp_path)
    state = syncer.new_state(s.config)
    s.server = SyncerServer(
        state,
        ServerConfig(
            port=0, auth_token=TOKEN, checkpoint_dir=s.dir, wire=SMALL, queues=QueueLimits(bulk_messages_queued_max=1)
        ),
    )
    await s.server.start()
    a = Learner(s.ws_url, "a", seed=1)
    await a.welcome()
    await until(lambda: s.server.state.holds_parameters, what="init")
    # a joining learner is owed one update per fragment at once: two bulk messages, one allowed
    http, ws = await raw_socket(s)
    for f in session.hello_frames("slow", TENSORS, 1, SMALL):
        await ws.send_bytes(bytes(f))
    await until(lambda: s.server.metrics.dropped_slow == 1, what="the slow learner dropped")
    await until(lambda: s.server.state.learners[2].status is syncer.LearnerStatus.GONE, what="slow learner gone")
    await ws.close()
    await http.close()
    await a.stop()
    await s.server.stop()


async def test_threaded_client_for_synchronous_training_loops(tmp_path):
    from ddiloco.net.client import ThreadedClient

    s = Syncer(tmp_path)
    await s.start()
    loop = asyncio.get_running_loop()
    cfg = ClientConfig(url=s.ws_url, name="sync", tensors=TENSORS, token=TOKEN, wire=SMALL)
    tc = await loop.run_in_executor(None, ThreadedClient, cfg)
    try:
        welcome = await loop.run_in_executor(None, tc.wait_welcome, 10.0)
        assert welcome.needs_init and welcome.learner == 1
        sizes = [f.padded_size for f in s.server.state.layout.fragments]
        for p, n in enumerate(sizes):
            tc.init(p, codec.encode(np.full(n, 0.5, dtype=np.float32), "fp32"))
        await until(lambda: s.server.state.holds_parameters, what="init through the thread")
        tc.progress(session.ProgressInfo(1, (0, 0), (1, 1), (10, 10)))
        await until(lambda: s.server.state.global_step == 1, what="progress through the thread")
        assert s.server.state.fragments[1].open is not None  # step 1 opens fragment 1's round
        vec = np.full(sizes[1], 0.01, dtype=np.float32)
        tc.push(Push(1, 1, 1, 0, 1, 10, codec.parse(codec.encode(vec, "int4"))))
        await until(lambda: s.server.state.fragments[1].version == 1, what="a push through the thread, merged")
        _, errors, (welcomes, _) = await loop.run_in_executor(None, tc.take)
        assert welcomes == 1 and not errors
    finally:
        await loop.run_in_executor(None, tc.close)
        await s.server.stop()


async def test_threaded_client_drops_what_was_made_before_the_caller_saw_a_new_welcome(tmp_path):
    # After a reconnect the learner has a new id; a progress report the training loop made in the
    # old session (before it took the new welcome) must not speak for the new learner.
    from ddiloco.net.client import ThreadedClient

    s = Syncer(tmp_path)
    await s.start()
    loop = asyncio.get_running_loop()
    cfg = ClientConfig(url=s.ws_url, name="sync", tensors=TENSORS, token=TOKEN, wire=SMALL, reconnect_s_min=0.01)
    tc = await loop.run_in_executor(None, ThreadedClient, cfg)
    try:
        await loop.run_in_executor(None, tc.wait_welcome, 10.0)
        sizes = [f.padded_size for f in s.server.state.layout.fragments]
        for p, n in enumerate(sizes):
            tc.init(p, codec.encode(np.full(n, 0.5, dtype=np.float32), "fp32"))
        await until(lambda: s.server.state.holds_parameters, what="init through the thread")
        conn = next(iter(s.server.sessions.conns.values()))
        await s.server.sessions.shut(conn, "test: drop the connection")
        await until(lambda: 2 in s.server.state.learners, what="rejoined as learner 2")
        await until(lambda: tc.client.inbox.welcomes == 2, what="the client holds the second welcome")
        # Made in session 1, so dropped: were it sent, learner 2 would be at step 100 and the report
        # of step 6 below would be ignored as an older one.
        tc.progress(session.ProgressInfo(100, (0, 0), (100, 100), (1000, 1000)))
        _, _, (welcomes, welcome) = await loop.run_in_executor(None, tc.take)
        assert welcomes == 2 and welcome.learner == 2
        tc.progress(session.ProgressInfo(6, (0, 0), (1, 1), (10, 10)))  # made in session 2: sent
        await until(lambda: s.server.state.learners[2].step == 6, what="the new session's progress")
        assert s.server.state.ledger.totals.get("lost", 0) == 0
    finally:
        await loop.run_in_executor(None, tc.close)
        await s.server.stop()


async def test_wrong_url_reports_the_last_error(tmp_path):
    from ddiloco.net.client import ThreadedClient

    loop = asyncio.get_running_loop()
    cfg = ClientConfig(url="ws://127.0.0.1:9/ws", name="lost", tensors=TENSORS, token=TOKEN, reconnect_s_max=0.1)
    tc = await loop.run_in_executor(None, ThreadedClient, cfg)
    try:
        with pytest.raises(TimeoutError, match="no welcome from the syncer.*last error"):
            await loop.run_in_executor(None, tc.wait_welcome, 1.0)
    finally:
        await loop.run_in_executor(None, tc.close)


class FakeSyncer:
    """A websocket server on 127.0.0.1 that answers every hello with `reply(frame)` (frames to
    send back): a syncer that misbehaves on purpose, to see what the client makes of it."""

    def __init__(self, reply):
        self.reply, self.connections = reply, 0

    async def _ws(self, request):
        ws = aiohttp.web.WebSocketResponse()
        await ws.prepare(request)
        self.connections += 1
        async for m in ws:
            if m.type is aiohttp.WSMsgType.BINARY:
                for frame in self.reply(m.data):
                    await ws.send_bytes(bytes(frame))
        return ws

    async def __aenter__(self):
        app = aiohttp.web.Application()
        app.router.add_get("/ws", self._ws)
        self.runner = aiohttp.web.AppRunner(app)
        await self.runner.setup()
        site = aiohttp.web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"ws://127.0.0.1:{site._server.sockets[0].getsockname()[1]}/ws"
        return self

    async def __aexit__(self, *exc):
        await self.runner.cleanup()


def _welcome(layout_json: str) -> msg.Welcome:
    return msg.Welcome(
        learner_id=1,
        layout_digest="0" * 64,
        fragment_count=2,
        versions=(0, 0),
        sync_every_steps=2,
        fragment_offsets=(0, 1),
        global_step=0,
        codec=msg.CodecName.INT4,
        codec_block=64,
        clock={},
        needs_init=False,
        layout_json=layout_json,
    )


@pytest.mark.parametrize("version", [1, 2])
async def test_a_learner_of_an_older_protocol_is_refused_with_both_versions_named(tmp_path, version):
    s = Syncer(tmp_path)
    await s.start()
    before = syncer.state_hash(s.server.state)
    http, ws = await raw_socket(s)
    (frame,) = session.hello_frames("old", TENSORS, 1, SMALL)
    old = bytearray(frame)
    # the header's version byte: a learner of the release before the delta broadcast (1), or before
    # updates carried the global step (2)
    old[4] = version
    crc = crc32(bytes(old[wire.HEADER_BYTES :]), crc32(bytes(old[: wire.CRC_OFFSET])))
    struct.pack_into("<I", old, wire.CRC_OFFSET, crc)  # an intact frame, as that release sealed it
    await ws.send_bytes(bytes(old))
    err = await next_error(ws)
    assert err.code == msg.ErrorCode.PROTOCOL_VERSION
    assert f"protocol version {version} is not understood" in err.text and "[3]" in err.text
    await ws.close()
    await http.close()
    assert syncer.state_hash(s.server.state) == before and not s.server.state.learners
    await s.server.stop()


async def test_a_syncer_of_another_protocol_version_is_refused_not_retried():
    def reply(_hello):
        frame = bytearray(wire.encode(_welcome("[]"), message_id=1, limits=SMALL)[0])
        frame[4] = wire.PROTOCOL_VERSION + 1  # the header's version byte: a later release of the protocol
        return [frame]

    async with FakeSyncer(reply) as fake:
        client = SyncerClient(
            ClientConfig(
                url=fake.url,
                name="a",
                tensors=TENSORS,
                token=TOKEN,
                wire=SMALL,
                reconnect_s_min=0.01,
                reconnect_s_max=0.02,
            )
        )
        await asyncio.wait_for(client.run(), 10)  # returns: refused for good
    assert isinstance(client.refused, SyncerRefused)
    assert "another protocol version" in str(client.refused) and f"version {wire.PROTOCOL_VERSION + 1}" in str(
        client.refused
    )
    assert fake.connections == 1


async def test_a_malformed_welcome_drops_the_connection_and_the_client_reconnects():
    async with FakeSyncer(lambda _hello: wire.encode(_welcome("{not json"), message_id=1, limits=SMALL)) as fake:
        client = SyncerClient(
            ClientConfig(
                url=fake.url,
                name="a",
                tensors=TENSORS,
                token=TOKEN,
                wire=SMALL,
                reconnect_s_min=0.01,
                reconnect_s_max=0.02,
            )
        )
        task = asyncio.ensure_future(client.run())
        try:
            await until(lambda: fake.connections >= 3, what="reconnects after the malformed welcome")
            assert not task.done() and client.refused is None and client.inbox.welcome is None
            assert "MalformedMessage" in client.last_error and "malformed Welcome" in client.last_error
        finally:
            await client.close()
            await asyncio.wait_for(task, 10)


async def test_close_sends_what_is_queued_then_says_goodbye(tmp_path, caplog):
    caplog.set_level("INFO", logger="ddiloco.syncer")
    s = Syncer(tmp_path, quorum=2)
    await s.start()
    a, b = await two_learners(s)
    state = s.server.state
    try:
        b.tick()  # b reports the versions it holds: live from here
        await until(lambda: state.learners[2].status.value == "live", what="b live")
        a.tick()  # step 2 opens a round that expects both
        (fragment,) = a.due()
        await until(lambda: state.fragments[fragment].open is not None, what="the round")
        assert state.fragments[fragment].open.asked == (1, 2)
        # a's push, then a progress report, then close: all in one go, nothing sent yet
        a.answer()
        a.tick()
        await a.client.close()
        await asyncio.wait_for(a.task, 10)  # the client ends by itself once it has said goodbye
        await until(lambda: state.learners[1].status.value == "gone", what="a gone")
        assert state.learners[1].step == a.step  # the last report arrived
        assert 1 in state.fragments[fragment].open.pushes  # and so did the push: it waits for b
        assert "gone: bye: stopping" in caplog.text
        b.step = a.step - 1  # b pushes the same fragment (it is one step behind a's last report)
        b.answer()  # b delivers: the round merges both, a's tokens with it
        await until(lambda: state.fragments[fragment].version == 1, what="the merge with a's push")
        assert state.decisions[-1].outcome == "merged" and state.ledger.totals["merged"] == 2 * 64
        state.ledger.check()
    finally:
        await b.stop()
        await s.server.stop()


async def test_backoff_starts_short_again_after_a_connection_that_worked(tmp_path, caplog):
    import socket

    caplog.set_level("INFO", logger="ddiloco.client")
    with socket.socket() as sock:  # a free port, with no syncer on it yet
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    client = SyncerClient(
        ClientConfig(
            url=f"ws://127.0.0.1:{port}/ws",
            name="a",
            tensors=TENSORS,
            token=TOKEN,
            wire=SMALL,
            reconnect_s_min=0.01,
            reconnect_s_max=0.16,
        )
    )
    task = asyncio.ensure_future(client.run())
    retries = lambda: [r.getMessage() for r in caplog.records if "retrying in about" in r.getMessage()]
    await until(lambda: len(retries()) >= 6, what="retries against a syncer that is not there")
    assert "about 0.16 s" in retries()[-1]  # grown to the cap
    s = Syncer(tmp_path)
    await s.start(port=port)
    try:
        await until(lambda: client.inbox.welcomes == 1, what="the welcome")
        before = len(retries())
    finally:
        await s.server.stop()
    await until(lambda: len(retries()) > before, what="the retry after the syncer went away")
    assert "about 0.01 s" in retries()[before]  # a new outage: the short delay again
    await client.close()
    await asyncio.wait_for(task, 10)


# ---- TLS (net.tls) ------------------------------------------------------------------------------------


async def _tls_syncer(tmp_path, cert, key):
    state = syncer.new_state(SyncerConfig(num_fragments=2, period=2))
    config = ServerConfig(auth_token=TOKEN, checkpoint_dir=tmp_path / "ckpt", wire=SMALL, tls_cert=cert, tls_key=key)
    server = SyncerServer(state, config)
    await server.start()
    return server


async def test_tls_learners_join_over_wss_and_their_pushes_merge(tmp_path, self_signed_cert):
    cert, key = self_signed_cert
    server = await _tls_syncer(tmp_path, cert, key)
    url = f"wss://127.0.0.1:{server.port}/ws"
    a = Learner(url, "a", seed=1, ca_file=cert)
    assert (await a.welcome()).needs_init
    b = Learner(url, "b", seed=2, ca_file=cert)
    await b.welcome()
    await until(lambda: server.state.holds_parameters, what="initial parameters")
    await train(server, [a, b], 12)
    await until(lambda: server.state.merges >= 2, what="merges over wss")
    import ssl

    context = ssl.create_default_context(cafile=str(cert))
    async with aiohttp.ClientSession() as http:
        status = await (await http.get(f"https://127.0.0.1:{server.port}/status", ssl=context)).json()
        with pytest.raises(aiohttp.ClientError):  # plain http:// to a TLS port gets no answer it can read
            await http.get(f"http://127.0.0.1:{server.port}/healthz")
    assert status["merges"] >= 2 and {l["status"] for l in status["learners"]} == {"live"}
    await a.stop()
    await b.stop()
    await server.stop()


async def test_tls_a_client_without_the_ca_is_refused_with_a_clear_error_not_retried(tmp_path, self_signed_cert):
    cert, key = self_signed_cert
    server = await _tls_syncer(tmp_path, cert, key)
    url = f"wss://127.0.0.1:{server.port}/ws"
    stranger = Learner(url, "x")  # trusts the system's CAs only, which never signed this certificate
    with pytest.raises(SyncerRefused, match="certificate of the syncer .* is not trusted by the system's CAs"):
        await stranger.welcome()
    assert stranger.client.inbox.connects == 0 and not server.sessions.conns
    await stranger.stop()
    plain = Learner(f"ws://127.0.0.1:{server.port}/ws", "y")  # ws:// to a wss:// syncer: a network fault, retried
    await until(lambda: plain.client.last_error is not None, what="a failed plain connection")
    assert plain.client.refused is None and plain.client.inbox.connects == 0
    await plain.stop()
    await server.stop()


async def test_tls_unusable_files_are_refused_with_their_names(tmp_path, self_signed_cert):
    cert, key = self_signed_cert
    from ddiloco.net.tls import TlsConfigError

    with pytest.raises(ValueError, match="give both or neither"):
        ServerConfig(tls_cert=cert)
    with pytest.raises(TlsConfigError, match="No such file or directory"):
        await _tls_syncer(tmp_path, cert, tmp_path / "missing.key")
    with pytest.raises(TlsConfigError, match="cannot be used together"):
        await _tls_syncer(tmp_path, key, cert)  # swapped
    with pytest.raises(TlsConfigError, match="holds no usable certificate"):
        SyncerClient(ClientConfig(url="wss://127.0.0.1:1/ws", name="z", tensors=TENSORS, ca_file=key))
    from ddiloco.net.client import ThreadedClient

    with pytest.raises(
        TlsConfigError, match="No such file or directory"
    ):  # raised to the caller, from the client's thread
        ThreadedClient(
            ClientConfig(url="wss://127.0.0.1:1/ws", name="z", tensors=TENSORS, ca_file=tmp_path / "none.pem")
        )
    with pytest.raises(ValueError, match="only applies to a wss://"):
        ClientConfig(url="ws://127.0.0.1:1/ws", name="z", tensors=TENSORS, ca_file=cert)


async def test_a_lost_syncer_is_retried_at_most_rejoin_s_max_apart_for_the_rejoin_window(tmp_path, caplog):
    caplog.set_level("INFO", logger="ddiloco.client")
    s = Syncer(tmp_path)
    await s.start()
    client = SyncerClient(
        ClientConfig(
            url=s.ws_url,
            name="a",
            tensors=TENSORS,
            token=TOKEN,
            wire=SMALL,
            reconnect_s_min=0.01,
            rejoin_s_max=0.04,
            reconnect_s_max=5.0,
        )
    )
    task = asyncio.ensure_future(client.run())
    await until(lambda: client.inbox.welcomes == 1, what="the welcome")
    await s.server.stop()  # a syncer that was just reachable goes away (a restart)
    retries = lambda: [r.getMessage() for r in caplog.records if "retrying in about" in r.getMessage()]
    await until(lambda: len(retries()) >= 8, what="retries against the syncer that went away")
    delays = [float(m.split("retrying in about ")[1].split()[0]) for m in retries()]
    assert max(delays) == 0.04  # grown to rejoin_s_max, never towards reconnect_s_max
    await client.close()
    await asyncio.wait_for(task, 10)


# ---- faults: one learner's failure is that learner's; the core's own stops the daemon ------------


def fail_on(monkeypatch, exc_type, should_fail):
    """Fault injection: core.handle raises `exc_type` for the events `should_fail(state, event)` picks."""
    real = syncer.handle
    hits = []

    def handle(state, event, now):
        if should_fail(state, event):
            hits.append(event)
            raise exc_type(f"injected fault on {type(event).__name__}")
        return real(state, event, now)

    monkeypatch.setattr(syncer, "handle", handle)
    return hits


def of_learner(name, kind):
    def pick(state, event):
        rec = state.learners.get(getattr(event, "learner", None))
        return type(event).__name__ == kind and rec is not None and rec.name == name

    return pick


async def test_a_learner_whose_event_fails_is_dropped_with_an_internal_error_and_the_others_go_on(
    tmp_path, caplog, monkeypatch
):
    caplog.set_level("INFO", logger="ddiloco.syncer")
    s = Syncer(tmp_path)
    await s.start()
    a, b = await two_learners(s)
    c = Learner(s.ws_url, "c", seed=3)
    await c.welcome()
    c_id = c.client.inbox.welcome.learner
    await until(lambda: len(c.client.inbox.updates) == 2, what="c's recovery updates")
    hits = fail_on(monkeypatch, RuntimeError, of_learner("c", "Progress"))
    c.tick()
    await until(lambda: any(e.code == "internal" for e in c.client.inbox.errors), what="c's internal error")
    err = next(e for e in c.client.inbox.errors if e.code == "internal")
    assert err.fatal and "RuntimeError: injected fault on Progress" in err.text and "Progress" in err.text
    await until(lambda: s.server.state.learners[c_id].status is syncer.LearnerStatus.GONE, what="c dropped")
    line = next(r for r in caplog.records if r.levelname == "ERROR" and "injected fault" in r.getMessage())
    assert f"learner {c_id} (connection" in line.getMessage() and "Progress" in line.getMessage()
    assert line.exc_info is not None  # the traceback, on the same record
    await c.stop()
    merges = s.server.state.merges
    await train(s.server, [a, b], 8)
    await until(lambda: s.server.state.merges > merges, what="merges after c's fault")
    assert s.server.core.running and s.server.failure is None and len(hits) >= 1
    s.server.state.ledger.check()
    for lr in (a, b):
        await lr.stop()
    await s.server.stop()


async def test_an_assertion_in_the_core_stops_the_daemon_without_checkpointing_the_half_changed_state(
    tmp_path, caplog, monkeypatch
):
    s = Syncer(tmp_path, checkpoint_every_merges=1)
    state = syncer.new_state(s.config)
    s.server = SyncerServer(state, ServerConfig(port=0, auth_token=TOKEN, checkpoint_dir=s.dir, wire=SMALL))
    serving = asyncio.ensure_future(s.server.serve_forever())
    await until(lambda: s.server.port is not None, what="listening")
    a, b = await two_learners(s)
    await train(s.server, [a, b], 6)
    await until(lambda: s.server.metrics.checkpoints >= 1, what="a checkpoint")
    fail_on(monkeypatch, AssertionError, of_learner("a", "Progress"))  # an invariant, on a learner's event
    a.tick()
    from ddiloco.net.server import CoreFailed

    with pytest.raises(CoreFailed, match="AssertionError: injected fault on Progress"):
        await asyncio.wait_for(serving, 20)
    assert not s.server.core.running
    assert "no last checkpoint: the core failed inside an event" in caplog.text
    written = s.server.metrics.checkpoints
    newest, _ = store.newest_valid(s.dir)  # the last good state, written between two events
    assert newest.merges <= s.server.state.merges
    with pytest.raises(OSError):  # not half-alive: nothing listens any more
        await asyncio.open_connection("127.0.0.1", s.server.port)
    assert s.server.metrics.checkpoints == written
    for lr in (a, b):
        await lr.stop()


async def test_a_failing_timer_stops_the_daemon_with_a_last_checkpoint_of_the_whole_state(tmp_path, monkeypatch):
    s = Syncer(tmp_path)
    await s.start()
    a, b = await two_learners(s)
    await train(s.server, [a, b], 6)
    await until(lambda: s.server.state.merges >= 1, what="merges")

    def fire(token, now):  # an item no learner sent fails before the core sees it: the state is whole
        raise RuntimeError("injected fault on a timer")

    monkeypatch.setattr(s.server.shell, "fire", fire)
    await train(s.server, [a, b], 4)  # rounds arm grace timers, merges their merge costs
    await until(lambda: s.server.failure is not None, what="the timer's fault")
    assert "Wake: RuntimeError: injected fault on a timer" in str(s.server.failure)
    await until(lambda: s.server._stopped.is_set(), what="the daemon stopped")
    newest, _ = store.newest_valid(s.dir)
    assert syncer.state_hash(newest) == syncer.state_hash(s.server.state)  # the last checkpoint is of it
    for lr in (a, b):
        await lr.stop()


# ---- health: /healthz says what is wrong ----------------------------------------------------------


async def health_of(s):
    async with aiohttp.ClientSession() as http:
        answer = await http.get(f"{s.http}/healthz")
        return answer.status, await answer.json()


async def test_healthz_fails_while_the_core_completes_nothing_and_recovers_after(tmp_path):
    import threading

    s = Syncer(tmp_path)
    state = syncer.new_state(s.config)
    s.server = SyncerServer(
        state, ServerConfig(port=0, auth_token=TOKEN, checkpoint_dir=s.dir, wire=SMALL, core_stall_s_max=0.2)
    )
    await s.server.start()
    assert (await health_of(s))[0] == 200
    release = threading.Event()
    stuck = asyncio.ensure_future(s.server.core.call(lambda: release.wait(30)))  # a core stuck in a lock
    try:
        verdicts = []

        async def failing():
            verdicts.append(await health_of(s))
            return verdicts[-1][0] == 503

        deadline = asyncio.get_running_loop().time() + 20
        while not await failing():
            assert asyncio.get_running_loop().time() < deadline, verdicts[-1]
            await asyncio.sleep(0.05)
        doc = verdicts[-1][1]
        assert doc["status"] == "failing" and "core_stall_s_max 0.2 s" in doc["reasons"][0]
        # The stall is the time since an item last completed; the stuck item may have started a
        # little after that on a loaded machine, so its own busy time may be shorter.
        core = doc["core"]
        assert core["running"] and core["busy_s"] is not None and core["since_completed_s"] > 0.2, core
    finally:
        release.set()
        await stuck
    code, doc = await health_of(s)
    assert code == 200 and doc["status"] == "ok" and doc["core"]["busy_s"] is None
    await s.server.stop()


async def test_healthz_is_degraded_while_checkpoints_fail_and_status_says_why(tmp_path, disk):
    s = Syncer(tmp_path)
    s.dir = disk.path / "ckpt"
    await s.start()
    a = Learner(s.ws_url, "a", seed=1)
    await a.welcome()
    await until(lambda: s.server.state.holds_parameters, what="initial parameters")
    headers = {"Authorization": f"Bearer {TOKEN}"}
    async with aiohttp.ClientSession() as http:
        assert (await http.post(f"{s.http}/checkpoint", headers=headers)).status == 200
        code, doc = await health_of(s)
        assert code == 200 and doc["status"] == "ok" and doc["checkpoint"]["age_s"] >= 0
        disk.read_only()
        failed = await http.post(f"{s.http}/checkpoint", headers=headers)
        assert failed.status == 507
        code, doc = await health_of(s)
        assert code == 200 and doc["status"] == "degraded"
        assert "checkpoint not written" in doc["reasons"][0] and "read-only" in doc["reasons"][0].lower()
        assert doc["checkpoint"]["ok"] is False and doc["checkpoint"]["failures_since_written"] == 1
        assert doc["checkpoint"]["written"] is not None  # the last good one is still named, with its age
        status = await (await http.get(f"{s.http}/status")).json()
        assert status["checkpoint"]["error"] == doc["checkpoint"]["error"] and status["core"]["running"]
    await a.stop()
    await s.server.stop(checkpoint=False)
