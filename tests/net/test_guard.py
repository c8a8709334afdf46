"""Slow peers at the real daemon's door (net.guard): raw sockets on 127.0.0.1 that send half of
something and then nothing are closed within their bound; too many from one address are refused."""

from __future__ import annotations

import asyncio
import base64
import os

import pytest

from ddiloco.core import syncer
from ddiloco.core.config import SyncerConfig
from ddiloco.net.guard import GuardLimits, _FrameBounds
from ddiloco.net.server import ServerConfig, SyncerServer

TOKEN = "test-token-0123456789abcdef"
LIMITS = GuardLimits(handshake_s_max=0.3, frame_s_max=0.3, connections_per_address_max=8)
WAIT_S_MAX = 20.0  # how long a test waits for a close that is due after 0.3 s (a loaded machine)


@pytest.fixture
async def daemon(tmp_path):
    server = SyncerServer(
        syncer.new_state(SyncerConfig(num_fragments=2, period=2)),
        ServerConfig(port=0, auth_token=TOKEN, checkpoint_dir=tmp_path / "ckpt", guard=LIMITS),
    )
    await server.start()
    yield server
    await server.stop(checkpoint=False)


async def closed_by_peer(reader: asyncio.StreamReader) -> bytes:
    """Everything the daemon sends until it closes the connection (raises on a timeout: never closed)."""
    return await asyncio.wait_for(reader.read(), WAIT_S_MAX)


def upgrade_request(port: int) -> bytes:
    key = base64.b64encode(os.urandom(16)).decode()
    return (
        f"GET /ws HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
        f"Sec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\nAuthorization: Bearer {TOKEN}\r\n\r\n"
    ).encode()


async def test_half_an_http_request_is_closed_after_handshake_s_max(daemon):
    reader, writer = await asyncio.open_connection("127.0.0.1", daemon.port)
    writer.write(b"GET /status HTTP/1.1\r\nHost: 127.0.0.1\r\n")  # and never the blank line
    await writer.drain()
    assert await closed_by_peer(reader) == b""
    assert daemon.guard.closed == {"handshake_s_max": 1}
    writer.close()


async def test_a_websocket_that_sends_a_frame_header_only_is_closed_after_frame_s_max(daemon):
    reader, writer = await asyncio.open_connection("127.0.0.1", daemon.port)
    writer.write(upgrade_request(daemon.port))
    await writer.drain()
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), WAIT_S_MAX)
    assert head.startswith(b"HTTP/1.1 101")
    writer.write(bytes([0x82, 0x80 | 126, 0x10, 0x00]) + os.urandom(4) + b"x" * 100)  # 100 of 4096 bytes
    await writer.drain()
    await closed_by_peer(reader)
    assert daemon.guard.closed == {"frame_s_max": 1}
    writer.close()


async def test_an_idle_websocket_and_a_served_request_are_left_alone(daemon):
    """Complete frames and complete requests meet no deadline: only a partial one does."""
    reader, writer = await asyncio.open_connection("127.0.0.1", daemon.port)
    writer.write(upgrade_request(daemon.port))
    await writer.drain()
    await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), WAIT_S_MAX)
    mask = os.urandom(4)
    writer.write(bytes([0x89, 0x80 | 4]) + mask + bytes(b ^ mask[i % 4] for i, b in enumerate(b"ping")))
    await writer.drain()
    pong = await asyncio.wait_for(reader.readexactly(6), WAIT_S_MAX)  # the daemon answers a whole frame
    assert pong[0] == 0x8A and pong[2:] == b"ping"
    http_reader, http_writer = await asyncio.open_connection("127.0.0.1", daemon.port)
    http_writer.write(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
    answer = await closed_by_peer(http_reader)
    assert answer.startswith(b"HTTP/1.1 200")
    # A partial one after them is still closed: the guard is armed, and it is the only one it closed.
    http_reader, http_writer = await asyncio.open_connection("127.0.0.1", daemon.port)
    http_writer.write(b"GET /st")
    await closed_by_peer(http_reader)
    assert daemon.guard.closed == {"handshake_s_max": 1}
    assert not writer.is_closing() and not reader.at_eof()  # the idle websocket is still open
    for w in (writer, http_writer):
        w.close()


async def test_connections_beyond_the_limit_per_address_are_refused_with_429(daemon, caplog):
    held = [await asyncio.open_connection("127.0.0.1", daemon.port) for _ in range(LIMITS.connections_per_address_max)]
    reader, writer = await asyncio.open_connection("127.0.0.1", daemon.port)
    answer = await closed_by_peer(reader)
    assert answer.startswith(b"HTTP/1.1 429 Too Many Requests") and b"too many connections from 127.0.0.1" in answer
    assert daemon.guard.refused == 1 and "connections_per_address_max" in caplog.text
    for _, w in held:
        w.close()
    writer.close()


def test_frame_bounds_follow_headers_of_every_length_across_any_split():
    frames = [
        bytes([0x82, 0x80 | 5]) + b"mask" + b"hello",
        bytes([0x82, 0x80 | 126, 0x01, 0x00]) + b"mask" + b"y" * 256,
        bytes([0x82, 0x80 | 127]) + (70_000).to_bytes(8, "big") + b"mask" + b"z" * 70_000,
        bytes([0x8A, 0x00]),
    ]  # an empty unmasked pong
    stream = b"".join(frames)
    ends = set()
    at = 0
    for f in frames:
        at += len(f)
        ends.add(at)
    for chunk in (1, 3, 7, 1000, len(stream)):
        bounds = _FrameBounds()
        for i in range(0, len(stream), chunk):
            bounds.feed(stream[i : i + chunk], now=float(i))
            assert bounds.inside == (i + chunk not in ends and i + chunk < len(stream)), (chunk, i)
        assert not bounds.inside
