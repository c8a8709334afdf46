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
