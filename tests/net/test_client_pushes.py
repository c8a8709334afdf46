"""A push the client cannot queue is refused visibly: False, counted, logged; never silently lost."""

import logging

import numpy as np

from ddiloco.core import codec
from ddiloco.core.events import Push
from ddiloco.core.layout import TensorSpec
from ddiloco.net.client import ClientConfig, SyncerClient

TENSORS = (TensorSpec("w", (256,), "float32", False),)


def push(step: int) -> Push:
    return Push(1, 0, step, 0, 1, 64, codec.parse(codec.encode(np.zeros(256, np.float32), "int4")))


def test_a_full_push_queue_refuses_and_counts(caplog):
    client = SyncerClient(ClientConfig(url="ws://127.0.0.1:1/ws", name="a", tensors=TENSORS, pushes_queued_max=2))
    with caplog.at_level(logging.WARNING, logger="ddiloco.client"):
        accepted = [client.queue_push(push(r)) for r in range(1, 5)]
    assert accepted == [True, True, False, False]
    assert client.pushes_dropped == 2
    assert "push of fragment 0 at step 3 dropped" in caplog.text


def test_a_push_the_threaded_client_accepted_is_never_dropped_on_its_thread():
    """ThreadedClient.push counts the queue on the caller's thread and says True; messages handed to
    the network thread before the push (a learner's initial fragments, sent just before its first
    push) must not make that thread drop it: the hook booked it as sent, and its progress was lost."""
    import threading

    from ddiloco.net.client import ThreadedClient

    tc = ThreadedClient(ClientConfig(url="ws://127.0.0.1:9/ws", name="a", tensors=TENSORS, pushes_queued_max=2))
    try:
        gate = threading.Event()
        tc._loop.call_soon_threadsafe(gate.wait, 10)  # the network thread holds still while we hand over
        tc.init(0, b"x" * 64)
        tc.init(1, b"y" * 64)
        assert tc.push(push(1)) is True  # the caller's count: nothing queued yet
        gate.set()
        done = threading.Event()
        tc._loop.call_soon_threadsafe(done.set)
        assert done.wait(10)
        assert tc.pushes_dropped == 0
        assert [type(m).__name__ for _, m in tc.client._bulk] == ["InitInfo", "InitInfo", "Push"]
        assert tc.push(push(2)) is False  # a push the count refuses is refused at once, and counted
        assert done.wait(10)
    finally:
        tc.close()
