"""The lane (net.lane): frames' data on a plain TCP connection beside the websocket.

The reassembler's side with the lane's bytes put in place by hand; then the real daemon on 127.0.0.1
with real clients, one on a lane and one without, and hostile peers on the lane's port.
"""

from __future__ import annotations

import asyncio
import socket
import subprocess
import sys
from dataclasses import replace

import aiohttp
import numpy as np
import pytest

from ddiloco.core import codec, syncer
from ddiloco.core.config import SyncerConfig
from ddiloco.core.events import Push
from ddiloco.core.layout import TensorSpec
from ddiloco.net import lane, session, wire
from ddiloco.net.client import ClientConfig, SyncerClient
from ddiloco.net.messages import ErrorCode
from ddiloco.net.server import ServerConfig, SyncerServer

from ..waiting import until

TOKEN = "test-token-0123456789abcdef"
SMALL = wire.WireLimits(frame_bytes_max=1024)  # every push is several frames
EVERY_FRAME = lane.LaneLimits(data_bytes_min=1)  # every frame's data on the lane, control frames too
TENSORS = (TensorSpec("embed", (64, 8), embedding=True), TensorSpec("w", (8, 32)), TensorSpec("head", (8, 16)))


# ---- the reassembler's side ------------------------------------------------------------------------


def _message():
    """A push message as the client builds it, of several frames."""
    values = np.random.default_rng(0).standard_normal(8192).astype(np.float32)
    encoded = codec.parse(codec.encode(values, "int4"))
    frames = session.bulk_frames(Push(1, 0, 7, 3, 1, 64, encoded), 9, SMALL, {"learner-0": 1})
    return frames, bytes(encoded.body)


def _on_lane(reassembler: wire.Reassembler, frame, prefix: bytes | None = None, data: bytes | None = None):
    """`frame` delivered as its header alone plus its data behind a prefix, as the lane delivers it."""
    header, body = bytes(frame[: wire.HEADER_BYTES]), bytes(frame[wire.HEADER_BYTES :]) if data is None else data
    fields = wire.HEADER.unpack_from(header)
    chunk = reassembler.lane_chunk(header, prefix or wire.LANE_PREFIX.pack(fields[4], fields[5], len(body)))
    at = 0
    for view in chunk.views:
        view[:] = body[at : at + len(view)]
        at += len(view)
    return reassembler.lane_end(chunk)


@pytest.mark.parametrize("pattern", ["all", "alternate", "last"])
def test_frames_whose_data_came_on_the_lane_make_the_message_whole_frames_make(pattern):
    frames, body = _message()
    assert len(frames) > 3
    reference = wire.Reassembler(SMALL)
    whole = [reference.feed(f) for f in frames][-1]
    reassembler = wire.Reassembler(SMALL)
    out = None
    for i, frame in enumerate(frames):
        lane_it = pattern == "all" or (pattern == "alternate" and i % 2) or (pattern == "last" and i == len(frames) - 1)
        out = _on_lane(reassembler, frame) if lane_it else reassembler.feed(frame)
        assert (out is None) == (i < len(frames) - 1)
    assert out == whole
    assert bytes(out.payload) == body
    assert reassembler.messages_in_flight == 0


def test_a_single_frame_message_may_come_on_the_lane():
    values = np.arange(64, dtype=np.float32)
    frames = session.bulk_frames(Push(1, 0, 1, 0, 1, 64, codec.parse(codec.encode(values, "fp32"))), 3, SMALL, {})
    assert len(frames) == 1
    out = _on_lane(wire.Reassembler(SMALL), frames[0])
    assert out == wire.Reassembler(SMALL).feed(frames[0])


def test_a_lane_out_of_step_with_the_headers_breaks_the_connection():
    frames, _ = _message()
    reassembler = wire.Reassembler(SMALL)
    fields = wire.HEADER.unpack_from(frames[0])
    wrong = wire.LANE_PREFIX.pack(fields[4] + 1, fields[5], len(frames[0]) - wire.HEADER_BYTES)
    with pytest.raises(wire.WireError) as caught:
        _on_lane(reassembler, frames[0], prefix=wrong)
    assert caught.value.code == ErrorCode.BAD_FRAME and caught.value.fatal
    assert "the lane carries message" in caught.value.text
    with pytest.raises(wire.WireError, match="unusable after an earlier error"):
        reassembler.feed(frames[0])


def test_a_changed_byte_on_the_lane_fails_the_checksum():
    frames, _ = _message()
    reassembler = wire.Reassembler(SMALL)
    data = bytearray(frames[1][wire.HEADER_BYTES :])
    data[17] ^= 0x10
    reassembler.feed(frames[0])
    with pytest.raises(wire.WireError) as caught:
        _on_lane(reassembler, frames[1], data=bytes(data))
    assert caught.value.code == ErrorCode.CHECKSUM and caught.value.fatal
    assert reassembler.messages_in_flight == 0  # its memory released at once


def test_a_lane_frame_above_the_frame_limit_is_refused_before_anything_is_allocated():
    frames, _ = _message()
    fields = wire.HEADER.unpack_from(frames[0])
    huge = wire.LANE_PREFIX.pack(fields[4], fields[5], 2**31)
    reassembler = wire.Reassembler(SMALL)
    with pytest.raises(wire.WireError) as caught:
        reassembler.lane_chunk(bytes(frames[0][: wire.HEADER_BYTES]), huge)
    assert caught.value.code == ErrorCode.OVERSIZED
    assert reassembler.messages_in_flight == 0 and reassembler.bytes_in_flight == 0


def test_a_header_alone_where_there_is_no_lane_is_a_frame_without_data():
    frames, _ = _message()
    with pytest.raises(wire.WireError, match="its header alone, whose data would come on a lane") as caught:
        wire.Reassembler(SMALL).feed(bytes(frames[0][: wire.HEADER_BYTES]))
    assert caught.value.code == ErrorCode.BAD_FRAME and caught.value.fatal


@pytest.mark.parametrize("text", [None, "", "zz" * 16, "ab" * 15, "ab" * 17])
def test_a_lane_offer_that_is_not_32_hex_characters_is_no_offer(text):
    assert lane.parse_token(text) is None


def test_a_token_is_32_hex_characters_of_16_random_bytes():
    a, b = lane.new_token(), lane.new_token()
    assert a != b and len(lane.parse_token(a)) == 16


# ---- the real daemon --------------------------------------------------------------------------------


async def _daemon(tmp_path, lane_port=0, limits=EVERY_FRAME) -> SyncerServer:
    config = SyncerConfig(num_fragments=2, period=2)
    server_config = ServerConfig(port=0, auth_token=TOKEN, wire=SMALL, lane_port=lane_port, lane=limits)
    server = SyncerServer(syncer.new_state(config), server_config)
    await server.start()
    return server


class _Learner:
    """The real client, pushing random outer gradients of the fragments due at each step."""

    def __init__(self, server: SyncerServer, name: str, on_lane: bool, seed: int, ca_file=None):
        url = f"{'wss' if ca_file else 'ws'}://127.0.0.1:{server.port}/ws"
        config = ClientConfig(url=url, name=name, tensors=TENSORS, token=TOKEN, wire=SMALL, ca_file=ca_file)
        self.client = SyncerClient(replace(config, lane=on_lane, lane_limits=EVERY_FRAME))
        self.rng = np.random.default_rng(seed)
        self.task = asyncio.create_task(self.client.run())
        # (fragment, version, the version a delta applies onto or -1) -> the payload received
        self.updates: dict[tuple[int, int, int], bytes] = {}

    async def join(self) -> None:
        await asyncio.wait_for(self.client.welcomed.wait(), 10)
        w = self.client.inbox.welcome
        self.sizes = [
            -(-max(128, sum(int(np.prod(s)) for _, s, _, _ in f)) // 128) * 128 for f in w.layout["fragments"]
        ]
        self.versions = [0 if w.needs_init else -1] * len(self.sizes)
        self.step = w.global_step
        if w.needs_init:
            for p, n in enumerate(self.sizes):
                self.client.queue_init(p, codec.encode(self.rng.standard_normal(n).astype(np.float32), "fp32"))

    def turn(self) -> None:
        for p, chain in list(self.client.inbox.updates.items()):
            for update in chain:
                self.updates[(p, update.version, update.base_version)] = bytes(update.encoded.body)
            self.versions[p] = chain[-1].version
        self.client.inbox.updates.clear()
        if min(self.versions) < 0:
            return
        self.step += 1
        n = len(self.sizes)
        self.client.queue_progress(session.ProgressInfo(self.step, tuple(self.versions), (1,) * n, (64,) * n))
        w = self.client.inbox.welcome
        learner = w.learner
        for p, t in enumerate(w.offsets):
            if self.step % w.period == t:
                vec = self.rng.standard_normal(self.sizes[p]).astype(np.float32) * 0.01
                push = Push(learner, p, self.step, self.versions[p], 1, 64, codec.parse(codec.encode(vec, "int4")))
                self.client.queue_push(push)


async def _train(server: SyncerServer, learners: list[_Learner], merges: int) -> None:
    for learner in learners:
        await learner.join()
    deadline = asyncio.get_running_loop().time() + 30
    while server.state.merges < merges:
        assert asyncio.get_running_loop().time() < deadline, f"{server.state.merges} merges in 30 s"
        for learner in learners:
            learner.turn()
        await asyncio.sleep(0.02)
    await asyncio.sleep(0.3)
    for learner in learners:
        learner.turn()


async def test_every_frame_on_the_lane_trains_as_the_websocket_does_and_delivers_the_same_bytes(tmp_path):
    server = await _daemon(tmp_path)
    a = _Learner(server, "a", on_lane=True, seed=1)
    b = _Learner(server, "b", on_lane=False, seed=2)
    try:
        await _train(server, [a, b], merges=6)
        assert a.client.lanes_attached == 1 and b.client.lanes_attached == 0
        lanes = {c.learner: c.lane is not None for c in server.sessions.conns.values()}
        assert sorted(lanes.values()) == [False, True]
        m = server.metrics
        assert m.lane_bytes_in > 0 and m.lane_bytes_out > 0
        assert m.lane_bytes_in < m.bytes_in and m.lane_bytes_out < m.bytes_out  # b's bytes, and the headers
        assert not m.wire_errors
        # The versions both received, one over its lane and one over its websocket: the same bytes.
        common = a.updates.keys() & b.updates.keys()
        assert len(common) >= 4
        assert all(a.updates[k] == b.updates[k] for k in common)
    finally:
        for learner in (a, b):
            await learner.client.close()
        await server.stop(checkpoint=False)


async def test_a_daemon_without_a_lane_says_so_and_its_learners_keep_the_websocket(tmp_path):
    server = await _daemon(tmp_path, lane_port=None)
    a = _Learner(server, "a", on_lane=True, seed=1)
    try:
        async with aiohttp.ClientSession() as http, http.get(f"http://127.0.0.1:{server.port}/lane") as answer:
            assert answer.status == 404
        await _train(server, [a], merges=2)
        assert a.client.lanes_attached == 0
        assert server.metrics.lane_bytes_in == 0 and server.metrics.lane_bytes_out == 0
    finally:
        await a.client.close()
        await server.stop(checkpoint=False)


def _connect(port: int) -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), timeout=5)


def _answer(sock: socket.socket) -> tuple[bytes, int] | None:
    data = b""
    while len(data) < lane.LANE_ANSWER.size:
        piece = sock.recv(lane.LANE_ANSWER.size - len(data))
        if not piece:
            return None
        data += piece
    return lane.LANE_ANSWER.unpack(data)


async def test_hostile_peers_on_the_lane_port_are_refused_and_the_daemon_goes_on(tmp_path):
    limits = lane.LaneLimits(data_bytes_min=1, handshake_s_max=0.5, handshakes_max=4)
    server = await _daemon(tmp_path, limits=limits)
    port = server.sessions.lanes.port
    loop = asyncio.get_running_loop()
    try:
        # a token nobody offered
        def unknown():
            with _connect(port) as s:
                s.sendall(lane.LANE_HELLO.pack(lane.LANE_MAGIC, lane.LANE_VERSION, bytes(16)))
                return _answer(s)

        assert await loop.run_in_executor(None, unknown) == (lane.LANE_MAGIC, lane.UNKNOWN_TOKEN)

        # garbage, and another lane version
        def garbage(hello):
            with _connect(port) as s:
                s.sendall(hello)
                return _answer(s)

        assert await loop.run_in_executor(None, garbage, b"GET / HTTP/1.1\r\nHost: example.org\r\n\r\n") == (
            lane.LANE_MAGIC,
            lane.BAD_HELLO,
        )
        other = lane.LANE_HELLO.pack(lane.LANE_MAGIC, lane.LANE_VERSION + 1, bytes(16))
        assert await loop.run_in_executor(None, garbage, other) == (lane.LANE_MAGIC, lane.BAD_HELLO)

        # silent peers: each closed after the handshake limit; more than handshakes_max at once are
        # closed at once
        def silent(count):
            socks = [_connect(port) for _ in range(count)]
            try:
                return [_answer(s) for s in socks]
            finally:
                for s in socks:
                    s.close()

        assert await loop.run_in_executor(None, silent, 6) == [None] * 6
        # and a learner still gets its lane and trains
        a = _Learner(server, "a", on_lane=True, seed=1)
        try:
            await _train(server, [a], merges=2)
            assert a.client.lanes_attached == 1
        finally:
            await a.client.close()
    finally:
        await server.stop(checkpoint=False)


async def test_a_lane_that_sends_what_its_headers_did_not_announce_closes_that_connection_only(tmp_path):
    server = await _daemon(tmp_path)
    b = _Learner(server, "b", on_lane=False, seed=2)
    token = lane.new_token()
    url = f"ws://127.0.0.1:{server.port}/ws"
    headers = {"Authorization": f"Bearer {TOKEN}", lane.LANE_HEADER: token}
    try:
        await b.join()
        async with aiohttp.ClientSession() as http, http.ws_connect(url, headers=headers, max_msg_size=0) as ws:
            opened = await asyncio.to_thread(
                lane.open_lane, "127.0.0.1", server.sessions.lanes.port, token, EVERY_FRAME
            )
            try:
                hello = session.hello_frames("evil", TENSORS, 1, SMALL, {}, "")
                await ws.send_bytes(bytes(hello[0][: wire.HEADER_BYTES]))  # its header on the websocket ...
                await asyncio.to_thread(
                    opened._sock.sendall, wire.LANE_PREFIX.pack(99, 0, 10) + bytes(10)
                )  # ... not its data
                closing = await asyncio.wait_for(ws.receive(), 10)
                while closing.type == aiohttp.WSMsgType.BINARY:  # the error frame, then the close
                    closing = await asyncio.wait_for(ws.receive(), 10)
                assert closing.type in (aiohttp.WSMsgType.CLOSE, aiohttp.WSMsgType.CLOSED)
            finally:
                opened.close()
        await until(lambda: server.metrics.wire_errors.get("bad_frame", 0) == 1)
        await _train(server, [b], merges=2)  # the other learner trains on
    finally:
        await b.client.close()
        await server.stop(checkpoint=False)


# ---- TLS: a syncer that serves TLS serves its lane with it ----------------------------------------


async def test_over_tls_the_lane_is_tls_too_and_a_plain_hello_gets_nothing(tmp_path, self_signed_cert):
    cert, key = self_signed_cert
    config = SyncerConfig(num_fragments=2, period=2)
    server_config = ServerConfig(port=0, auth_token=TOKEN, wire=SMALL, lane=EVERY_FRAME, tls_cert=cert, tls_key=key)
    server = SyncerServer(syncer.new_state(config), server_config)
    await server.start()
    a = _Learner(server, "a", on_lane=True, seed=1, ca_file=cert)
    try:
        await _train(server, [a], merges=3)
        assert a.client.lanes_attached == 1
        assert server.metrics.lane_bytes_in > 0 and server.metrics.lane_bytes_out > 0

        def plain_hello():  # the lane's hello in the clear, to a port that speaks TLS
            with _connect(server.sessions.lanes.port) as s:
                s.sendall(lane.LANE_HELLO.pack(lane.LANE_MAGIC, lane.LANE_VERSION, bytes(16)))
                try:
                    return _answer(s)
                except OSError:
                    return None

        assert await asyncio.get_running_loop().run_in_executor(None, plain_hello) is None
        await _train(server, [a], merges=server.state.merges + 2)  # the learner on its lane goes on
    finally:
        await a.client.close()
        await server.stop(checkpoint=False)


def test_a_lane_blocked_on_a_silent_peer_does_not_hold_the_process_at_exit():
    # A learner stopped with Ctrl-C while its lane waits for data: the process ends at once, not
    # after the lane's stall limit (here a minute).
    script = """
import asyncio, socket
from ddiloco.net import lane
server = socket.create_server(("127.0.0.1", 0))
b = socket.create_connection(server.getsockname())
a, _ = server.accept()
async def main():
    opened = lane.Lane(a, lane.LaneLimits(stall_s_max=60))
    waiting = asyncio.create_task(opened._receiver.run(opened._fill, memoryview(bytearray(10))))
    await asyncio.sleep(0.3)
    waiting.cancel()
asyncio.run(main())
print("ended")
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=30)
    assert done.returncode == 0 and done.stdout.strip() == "ended", done.stderr


async def test_a_daemon_stops_at_once_while_a_lane_waits_for_data_its_header_announced(tmp_path):
    # A learner sent a header and died before its data: its connection's reader waits on the lane.
    # Stopping the daemon closes the lane, so the stop does not wait out the lane's stall limit.
    server = await _daemon(tmp_path, limits=lane.LaneLimits(data_bytes_min=1, stall_s_max=120))
    token = lane.new_token()
    headers = {"Authorization": f"Bearer {TOKEN}", lane.LANE_HEADER: token}
    async with aiohttp.ClientSession() as http:
        ws = await http.ws_connect(f"ws://127.0.0.1:{server.port}/ws", headers=headers, max_msg_size=0)
        limits = lane.LaneLimits(stall_s_max=120)
        opened = await asyncio.to_thread(lane.open_lane, "127.0.0.1", server.sessions.lanes.port, token, limits)
        hello = session.hello_frames("silent", TENSORS, 1, SMALL, {}, "")
        await ws.send_bytes(bytes(hello[0][: wire.HEADER_BYTES]))  # its data never comes
        await asyncio.sleep(0.5)
        await asyncio.wait_for(server.stop(checkpoint=False), 60)  # a hang detector, half the stall limit
        opened.close()
        await ws.close()
