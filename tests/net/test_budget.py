"""net.budget: what the syncer's readers hold in messages the core has not handled, in bytes. The
budget alone, then the real daemon on 127.0.0.1 with its core stalled and a real client pushing."""

from __future__ import annotations

import asyncio
import threading

import numpy as np
import pytest

from ddiloco.core import codec, syncer
from ddiloco.core.config import SyncerConfig
from ddiloco.core.events import Push
from ddiloco.net.budget import ByteBudget
from ddiloco.net.server import ServerConfig, SyncerServer

from ..waiting import until
from .test_daemon import SMALL, TOKEN, Learner


async def test_a_take_past_the_limit_waits_for_bytes_given_back():
    budget = ByteBudget(100)
    await budget.take(60)
    waiting = asyncio.create_task(budget.take(50))
    await asyncio.sleep(0.05)
    assert not waiting.done() and budget.used == 60 and budget.waits == 1
    budget.give_back(30)  # still 80 > 100 - 50 would not fit: 30 + 50 = 80 fits
    await asyncio.wait_for(waiting, 5)
    assert budget.used == 80


async def test_a_message_larger_than_the_budget_goes_through_alone():
    budget = ByteBudget(100)
    await asyncio.wait_for(budget.take(500), 5)  # nothing taken: it goes, never refused
    assert budget.used == 500
    waiting = asyncio.create_task(budget.take(1))
    await asyncio.sleep(0.05)
    assert not waiting.done()
    budget.give_back(500)
    await asyncio.wait_for(waiting, 5)


def test_a_budget_must_be_positive():
    with pytest.raises(ValueError, match="positive"):
        ByteBudget(0)
    with pytest.raises(ValueError, match="inbound_bytes_queued_max"):
        ServerConfig(inbound_bytes_queued_max=0)


async def test_a_stalled_core_holds_at_most_the_budget_and_the_readers_wait(tmp_path):
    """With the core busy (stalled here), a learner's pushes stop at the budget: read and queued up
    to it, the rest left on the socket. Once the core goes on, every push is handled, in order."""
    limit = 4096
    server = SyncerServer(
        syncer.new_state(SyncerConfig(num_fragments=2, period=2)),
        ServerConfig(port=0, auth_token=TOKEN, checkpoint_dir=tmp_path, wire=SMALL, inbound_bytes_queued_max=limit),
    )
    await server.start()
    a = Learner(f"ws://127.0.0.1:{server.port}/ws", "a", seed=1)
    gate = threading.Event()
    stall = None
    try:
        await a.welcome()
        await until(lambda: server.state.holds_parameters, what="initial parameters")
        a.tick()
        me = a.client.inbox.welcome.learner
        await until(lambda: server.state.learners[me].status is syncer.LearnerStatus.LIVE, what="a live")
        stall = asyncio.create_task(server.core.call(lambda: gate.wait(60)))
        budget, pushes = server.sessions.inbound, 0
        push_bytes = len(codec.encode(np.zeros(a.sizes[0], np.float32), "int4"))
        while budget.waits == 0 or pushes * push_bytes < 2 * limit:
            assert pushes < 1000, "the readers never waited"
            vec = a.rng.standard_normal(a.sizes[0]).astype(np.float32) * 0.01
            payload = codec.parse(codec.encode(vec, "int4"))
            # counters since the version held: each push is an increment over the one before
            push = Push(me, 0, a.step + pushes + 1, a.versions[0], pushes + 1, 64 * (pushes + 1), payload)
            if a.client.queue_push(push):  # the client's own queue takes two at a time
                pushes += 1
            await asyncio.sleep(0.005)
        await asyncio.sleep(0.2)  # nothing more gets in while the core stands still
        assert budget.used <= limit
        gate.set()
        await stall
        await until(lambda: budget.used == 0 and server.core.empty(), what="every push handled")
        assert server.state.learners[me].pushed[0] == (a.versions[0], pushes, 64 * pushes)  # the last one
    finally:
        gate.set()
        if stall is not None:
            await stall
        await a.stop()
        await server.stop(checkpoint=False)
