"""net.session's push path: the learner's Push value through the real wire encoder and reassembler
and back into the core's Push, the same fields, its payload a view over the received bytes."""

import numpy as np
import pytest

from ddiloco.core import codec
from ddiloco.core import events as ev
from ddiloco.core.layout import TensorSpec, build_layout
from ddiloco.net import messages as msg
from ddiloco.net import session, wire

LAYOUT = build_layout((TensorSpec("w", (16, 32)),), 1, block=128)
SIZE = LAYOUT.fragments[0].padded_size


def learner_push(name: str) -> ev.Push:
    vec = np.linspace(-1, 1, SIZE, dtype=np.float32)
    return ev.Push(7, 0, 3, 2, 4, 512, codec.parse(codec.encode(vec, name)))


def received(frames: list) -> msg.Message:
    reassembler = wire.Reassembler(wire.WireLimits(), accepted=msg.LEARNER_KINDS)
    *rest, last = [reassembler.feed(bytes(f)) for f in frames]
    assert rest == [None] * len(rest) and last is not None
    return last


@pytest.mark.parametrize("name", ["int4", "fp32", "bf16"])
def test_a_push_arrives_as_the_same_value_with_the_connections_learner(name):
    sent = learner_push(name)
    frames = session.bulk_frames(sent, 1, wire.WireLimits(), {"a": 1})
    message = received(frames)
    assert isinstance(message, msg.Push) and bytes(message.payload) == bytes(sent.payload.body)  # no codec header sent
    got = session.event_for(message, conn=5, learner=3, layout=LAYOUT)
    assert isinstance(got, ev.Push)
    assert (got.learner, got.fragment, got.step, got.base_version, got.steps, got.tokens) == (3, 0, 3, 2, 4, 512)
    assert (got.payload.codec, got.payload.block, got.payload.elements) == (
        sent.payload.codec,
        sent.payload.block,
        sent.payload.elements,
    )
    assert bytes(got.payload.body) == bytes(sent.payload.body)
    # a view over the message's payload, not a copy of it
    assert np.shares_memory(got.payload.data, np.frombuffer(message.payload, dtype=np.uint8))
    np.testing.assert_array_equal(got.payload.decode(), sent.payload.decode())


def test_a_push_whose_payload_does_not_fit_the_fragment_is_refused_by_the_session():
    vec = np.zeros(SIZE + 128, dtype=np.float32)
    big = ev.Push(1, 0, 1, 0, 1, 64, codec.parse(codec.encode(vec, "int4")))
    message = received(session.bulk_frames(big, 1, wire.WireLimits()))
    with pytest.raises(session.SessionError, match=f"expected {SIZE}") as raised:
        session.event_for(message, conn=5, learner=3, layout=LAYOUT)
    assert raised.value.code is msg.ErrorCode.BAD_SHAPE
