"""The per-learner send queues: control before bulk, bounded, a slow reader is dropped."""

import asyncio

import pytest

from ddiloco.net.connection import Connection, QueueLimits, SlowPeerError


class RecordingSocket:
    """Fault injection around the transport: records frames, can stall like a peer that stops reading."""

    def __init__(self):
        self.sent = []
        self.stalled = asyncio.Event()
        self.release = asyncio.Event()
        self.stall = False

    async def send_bytes(self, frame):
        if self.stall:
            self.stalled.set()
            await self.release.wait()
        self.sent.append(bytes(frame))


async def test_control_frames_overtake_queued_bulk_frames():
    ws = RecordingSocket()
    conn = Connection(1, ws, QueueLimits())
    ws.stall = True
    conn.send_bulk([b"B1", b"B2", b"B3"])
    writer = asyncio.create_task(conn.write_loop())
    await asyncio.wait_for(ws.stalled.wait(), 5)  # the writer is inside the first bulk frame
    conn.send_control([b"C1"])
    conn.send_control([b"C2"])
    ws.stall = False
    ws.release.set()
    while len(ws.sent) < 5:
        await asyncio.sleep(0.001)
    assert ws.sent == [b"B1", b"C1", b"C2", b"B2", b"B3"]
    conn.closed = True
    conn.wake.set()
    await asyncio.wait_for(writer, 5)


def test_queues_are_bounded():
    conn = Connection(1, RecordingSocket(), QueueLimits(control_frames_queued_max=3, bulk_messages_queued_max=2))
    conn.send_control([b"a", b"b"])
    with pytest.raises(SlowPeerError, match="control"):
        conn.send_control([b"c", b"d"])
    assert list(conn.control) == [b"a", b"b"]  # nothing partially queued
    conn.send_bulk([b"x"])
    conn.send_bulk([b"y"])
    with pytest.raises(SlowPeerError, match="bulk"):
        conn.send_bulk([b"z"])
    assert len(conn.bulk) == 2


def test_limits_validated():
    with pytest.raises(ValueError):
        QueueLimits(bulk_messages_queued_max=0)


def test_newer_update_of_a_fragment_replaces_the_queued_one():
    conn = Connection(1, RecordingSocket(), QueueLimits(bulk_messages_queued_max=2))
    conn.send_bulk([b"f0v1"], key=0)
    conn.send_bulk([b"f1v1"], key=1)
    conn.send_bulk([b"f0v2"], key=0)  # replaces, does not count against the limit
    assert [item[1] for item in conn.bulk] == [[b"f0v2"], [b"f1v1"]]


async def test_a_builder_runs_when_its_turn_comes():
    ws = RecordingSocket()
    conn = Connection(1, ws, QueueLimits())
    calls = []

    async def build():
        calls.append(len(ws.sent))  # how much had gone out when the frames were made
        return [b"u1", b"u2"]

    conn.send_bulk([b"a"], key=0)
    conn.send_bulk(build, key=1)
    conn.send_bulk(build, key=1)  # replaces the first builder: built once
    writer = asyncio.create_task(conn.write_loop())
    while len(ws.sent) < 3:
        await asyncio.sleep(0.001)
    assert ws.sent == [b"a", b"u1", b"u2"] and calls == [1]
    conn.closed = True
    conn.wake.set()
    await asyncio.wait_for(writer, 5)


async def test_a_message_already_going_out_is_not_replaced():
    ws = RecordingSocket()
    conn = Connection(1, ws, QueueLimits())
    ws.stall = True
    conn.send_bulk([b"a1", b"a2"], key=0)
    writer = asyncio.create_task(conn.write_loop())
    await asyncio.wait_for(ws.stalled.wait(), 5)  # a1 is on its way
    conn.send_bulk([b"b1"], key=0)
    ws.stall = False
    ws.release.set()
    while len(ws.sent) < 3:
        await asyncio.sleep(0.001)
    assert ws.sent == [b"a1", b"a2", b"b1"]  # the started message finishes whole, then the new one
    conn.closed = True
    conn.wake.set()
    await asyncio.wait_for(writer, 5)


async def test_a_send_that_stalls_too_long_is_a_slow_peer():
    ws = RecordingSocket()
    ws.stall = True
    conn = Connection(1, ws, QueueLimits(send_stall_s_max=0.05))
    conn.send_control([b"x"])
    with pytest.raises(SlowPeerError, match="could not be sent"):
        await asyncio.wait_for(conn.write_loop(), 5)
