"""The peer snapshot endpoint on 127.0.0.1: format, auth, limits; and the hello/welcome peer fields."""

import threading

import ml_dtypes
import numpy as np
import pytest

from ddiloco.core import events as ev
from ddiloco.net import messages as msg
from ddiloco.net import peer, session, wire

TOKEN = "peer-test-token-0123456789"


def arrays():
    return {
        "params/w": np.arange(12, dtype=np.float32).reshape(3, 4),
        "params/h": np.ones((2, 2), dtype=ml_dtypes.bfloat16),
        "opt/0": np.array(7, dtype=np.int32),
    }


def test_snapshot_round_trip_keeps_dtypes_shapes_and_meta():
    snap = peer.decode_snapshot(peer.encode_snapshot({"step": 5}, arrays()))
    assert snap.meta == {"step": 5}
    for name, arr in arrays().items():
        assert snap.arrays[name].dtype == arr.dtype
        np.testing.assert_array_equal(snap.arrays[name], arr)


@pytest.mark.parametrize(
    "damage, match",
    [
        (lambda b: b[:100] + bytes([b[100] ^ 1]) + b[101:], "hash does not match"),
        (lambda b: b[:-40], "hash does not match"),
        (lambda b: b"x" * 10, "too short"),
    ],
)
def test_a_corrupt_snapshot_is_rejected_with_a_clear_error(damage, match):
    data = peer.encode_snapshot({"step": 5}, arrays())
    with pytest.raises(peer.PeerError, match=match):
        peer.decode_snapshot(damage(data))


def test_a_snapshot_with_a_lying_manifest_is_rejected():
    import hashlib
    import struct

    manifest = b'{"meta":{},"arrays":[{"name":"a","dtype":"float32","shape":[1000],"offset":0,"nbytes":4000}]}'
    body = struct.pack("<8sQ", peer.MAGIC, len(manifest)) + manifest + b"\0" * 8
    with pytest.raises(peer.PeerError, match="outside the snapshot"):
        peer.decode_snapshot(body + hashlib.sha256(body).digest())


class Loop:
    """Plays the training loop: publishes a snapshot whenever the server asks, until stopped."""

    def __init__(self, box, data):
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, args=(box, data), daemon=True)
        self.thread.start()

    def _run(self, box, data):
        while not self.stop.wait(0.005):
            if box.wanted:
                box.publish(data)

    def close(self):
        self.stop.set()
        self.thread.join(5)


@pytest.fixture
def served():
    box = peer.SnapshotBox()
    server = peer.PeerServer(box, peer.PeerConfig(token=TOKEN, snapshot_wait_s_max=0.5))
    data = peer.encode_snapshot({"step": 3}, arrays())
    yield box, server, data
    server.close()


def test_the_endpoint_serves_the_loops_snapshot(served):
    box, server, data = served
    loop = Loop(box, data)
    try:
        snap = peer.fetch_snapshot(server.url, TOKEN, 10, 1 << 20)
    finally:
        loop.close()
    assert snap.meta == {"step": 3} and server.served == 1
    np.testing.assert_array_equal(snap.arrays["params/w"], arrays()["params/w"])


def test_a_wrong_token_is_refused(served):
    _, server, _ = served
    with pytest.raises(peer.PeerError, match="HTTP 401"):
        peer.fetch_snapshot(server.url, "wrong-token-0123456789", 10, 1 << 20)
    assert server.served == 0


def test_an_oversized_snapshot_is_rejected(served):
    box, server, data = served
    loop = Loop(box, data)
    try:
        with pytest.raises(peer.PeerError, match="above snapshot_bytes_max"):
            peer.fetch_snapshot(server.url, TOKEN, 10, len(data) - 1)
    finally:
        loop.close()


def test_a_loop_that_never_publishes_gets_503_not_a_hang(served):
    _, server, _ = served
    with pytest.raises(peer.PeerError, match="HTTP 503"):  # snapshot_wait_s_max ends the wait
        peer.fetch_snapshot(server.url, TOKEN, 10, 1 << 20)


def test_an_unreachable_peer_is_a_peer_error():
    box = peer.SnapshotBox()
    server = peer.PeerServer(box, peer.PeerConfig())
    url = server.url
    server.close()
    with pytest.raises(peer.PeerError, match="cannot fetch"):
        peer.fetch_snapshot(url, None, 5, 1 << 20)


def _round_trip(m):
    reassembler = wire.Reassembler(wire.WireLimits())
    out = [reassembler.feed(f) for f in wire.encode(m, message_id=1, limits=wire.WireLimits())]
    return out[-1]


def test_hello_carries_the_peer_url_and_leaves_it_out_when_empty():
    frames = session.hello_frames("a", (), 1, wire.WireLimits(), {}, peer_url="http://10.0.0.2:4000/snapshot")
    got = wire.Reassembler(wire.WireLimits()).feed(frames[0])
    assert got.peer_url == "http://10.0.0.2:4000/snapshot"
    assert session.event_for(got, 7, None, None).peer_url == "http://10.0.0.2:4000/snapshot"
    plain = msg.Hello(
        name="a", layout_digest="0" * 64, shard=0, resume_learner_id=None, held_versions=(), clock={}, tensors_json="[]"
    )
    assert b"peer_url" not in msg.message_meta(plain)  # an older syncer reads the hello unchanged
    assert _round_trip(plain).peer_url == ""
    with pytest.raises(ValueError, match="http"):
        msg.Hello(
            name="a",
            layout_digest="0" * 64,
            shard=0,
            resume_learner_id=None,
            held_versions=(),
            clock={},
            tensors_json="[]",
            peer_url="file:///etc/passwd",
        )


def test_welcome_lists_the_peers():
    layout = {"fragments": [{}, {}], "block": 64}
    effect = ev.SendWelcome(1, 3, layout, "ab" * 32, (4, 5), 100, False, ((1, "http://h:1/snapshot", (4, 5)),))
    (frame,) = session.frames_for(effect, 1, wire.WireLimits())
    welcome = session.client_view(wire.Reassembler(wire.WireLimits()).feed(frame))
    assert welcome.peers == (session.PeerInfo(1, "http://h:1/snapshot", (4, 5)),)
    no_peers = ev.SendWelcome(1, 3, layout, "ab" * 32, (4, 5), 100, False)
    (frame,) = session.frames_for(no_peers, 1, wire.WireLimits())
    assert b"peers_json" not in frame
    assert session.client_view(wire.Reassembler(wire.WireLimits()).feed(frame)).peers == ()
    assert session.parse_peers("[[1, 2]]") == ()  # malformed: no peers, the learner falls back
