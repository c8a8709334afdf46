"""What the client sends, in which order, as a real websocket server on 127.0.0.1 receives it."""

import asyncio

import numpy as np
from aiohttp import web

from ddiloco.core import codec
from ddiloco.core.events import Push, SendWelcome
from ddiloco.net import messages as msg
from ddiloco.net import session, wire
from ddiloco.net.client import ClientConfig, SyncerClient

LIMITS = wire.WireLimits()
DEADLINE_S = 30.0


async def _recording_syncer(received: list, got: asyncio.Event, want: int):
    """A websocket server that welcomes one learner and records the kinds of the messages it sends."""

    async def handle(request: web.Request) -> web.WebSocketResponse:
        ws = web.WebSocketResponse(max_msg_size=0)
        await ws.prepare(request)
        reassembler = wire.Reassembler(LIMITS)
        welcomed = False
        async for frame in ws:
            m = reassembler.feed(frame.data)
            if m is None:
                continue
            received.append((m.KIND, m.step) if isinstance(m, msg.Progress) else m.KIND)
            if isinstance(m, msg.Hello) and not welcomed:
                welcomed = True
                effect = SendWelcome(1, 1, {"fragments": [{}, {}], "block": 128}, "ab" * 32, (0, 0), 0, False)
                for out in session.frames_for(effect, 1, LIMITS):
                    await ws.send_bytes(out)
            if len(received) >= want:
                got.set()
        return ws

    app = web.Application()
    app.router.add_get("/ws", handle)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    return runner, f"ws://127.0.0.1:{port}/ws"


async def test_progress_queued_after_a_local_state_waits_for_it():
    """A report of a step after a learner's snapshot cut must not reach the syncer before the local
    state of the cut (the snapshot would hold a message from after the cut): progress, which
    otherwise goes ahead of bulk frames, waits behind a queued local state."""
    received: list = []
    got = asyncio.Event()
    runner, url = await _recording_syncer(received, got, want=4)
    client = SyncerClient(ClientConfig(url=url, name="a", tensors=(), progress_interval_s=0.0))
    try:
        # Queued before the connection is up, in the hook's order: the state at the cut, then the
        # report of the next step; a report queued before the cut goes ahead of both.
        client.queue_progress(session.ProgressInfo(1, (0, 0), (1, 1), (8, 8)))
        client.queue_local_state(session.LocalStateInfo(7, b"state at the cut"))
        client.queue_progress(session.ProgressInfo(2, (0, 0), (2, 2), (16, 16)))
        task = asyncio.create_task(client.run())
        await asyncio.wait_for(got.wait(), DEADLINE_S)
        kinds = [r[0] if isinstance(r, tuple) else r for r in received]
        assert kinds[:4] == [msg.Kind.HELLO, msg.Kind.PROGRESS, msg.Kind.LOCAL_STATE, msg.Kind.PROGRESS], received
    finally:
        await client.close()
        task.cancel()
        await runner.cleanup()


async def test_a_report_of_newer_versions_does_not_overtake_a_push_sent_before_it():
    """Progress goes ahead of pushes, except a report that the learner holds a newer version: it
    closes the learner's window of the version before on the syncer (core.ledger), so the push
    computed from that version, handed over before it, must arrive first, or its tokens would be
    booked lost. Later reports of the same versions wait behind it too (the newest standing for
    the others); a report of unchanged versions still goes ahead."""
    received: list = []
    got = asyncio.Event()
    runner, url = await _recording_syncer(received, got, want=5)
    client = SyncerClient(ClientConfig(url=url, name="a", tensors=(), progress_interval_s=0.0))
    payload = codec.parse(codec.encode(np.zeros(256, np.float32), "int4"))
    try:
        client.queue_progress(session.ProgressInfo(1, (0, 0), (1, 1), (8, 8)))
        client.queue_push(Push(1, 0, 1, 0, 1, 8, payload))
        client.queue_progress(session.ProgressInfo(2, (0, 0), (2, 2), (16, 16)))  # unchanged: ahead
        client.queue_progress(session.ProgressInfo(3, (1, 0), (0, 3), (0, 24)))  # newer: behind the push
        client.queue_progress(session.ProgressInfo(4, (1, 0), (1, 4), (8, 32)))  # stands for step 3's
        task = asyncio.create_task(client.run())
        await asyncio.wait_for(got.wait(), DEADLINE_S)
        progress = msg.Kind.PROGRESS
        want = [msg.Kind.HELLO, (progress, 1), (progress, 2), msg.Kind.PUSH, (progress, 4)]
        assert received[:5] == want, received
        assert client.pushes_queued() == 0 and client.pushes_dropped == 0
    finally:
        await client.close()
        task.cancel()
        await runner.cleanup()
