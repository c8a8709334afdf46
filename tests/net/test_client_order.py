"""What the client sends, in which order, as a real websocket server on 127.0.0.1 receives it."""

import asyncio

from aiohttp import web

from ddiloco.core.events import SendWelcome
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
            received.append(m.KIND)
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
        assert received[:4] == [msg.Kind.HELLO, msg.Kind.PROGRESS, msg.Kind.LOCAL_STATE, msg.Kind.PROGRESS], received
    finally:
        await client.close()
        task.cancel()
        await runner.cleanup()
