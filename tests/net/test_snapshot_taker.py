"""The snapshot protocol (net.snapshot.Taker) driven directly, without sockets or threads: the cut,
the in-flight record of a channel until its local state arrives, the timeout, one at a time."""

import hashlib

import numpy as np
import pytest

from ddiloco.core import codec, syncer
from ddiloco.core.config import SyncerConfig
from ddiloco.core.events import InitFragment, Join, Push
from ddiloco.core.layout import TensorSpec
from ddiloco.net import snapshot as snapshots

TENSORS = (TensorSpec("a", (4, 8)), TensorSpec("b", (16,)))


def initialised_state():
    state = syncer.new_state(SyncerConfig(num_fragments=1, period=2, block=8))
    for conn, name in ((1, "a"), (2, "b")):
        state, _ = syncer.handle(
            state, Join(conn=conn, name=name, tensors=TENSORS, protocol=syncer.PROTOCOL_VERSION), 0.0
        )
    size = state.layout.fragments[0].padded_size
    values = np.arange(size, dtype=np.float32)
    state, _ = syncer.handle(
        state, InitFragment(learner=1, fragment=0, payload=codec.parse(codec.encode(values, "fp32"))), 0.1
    )
    assert state.holds_parameters
    return state


def a_push(state, learner):
    vec = np.full(state.layout.fragments[0].padded_size, 0.01, dtype=np.float32)
    return Push(
        learner=learner,
        fragment=0,
        step=1,
        base_version=0,
        steps=1,
        tokens=10,
        payload=codec.parse(codec.encode(vec, "int4", 8)),
    )


def test_a_snapshot_records_channels_until_each_local_state_and_completes(tmp_path):
    state = initialised_state()
    taker = snapshots.Taker(tmp_path)
    snap = taker.start(state, {1: "a", 2: "b"}, {"syncer": 3}, now=1.0)
    with pytest.raises(snapshots.SnapshotError, match="still being taken"):
        taker.start(state, {1: "a"}, {}, now=1.1)
    assert taker.record(a_push(state, 1)) is None  # in flight on channel 1 -> syncer
    problem, outcome = taker.local_state(1, snap.ident, b"state-a", hashlib.sha256(b"state-a").hexdigest(), now=1.2)
    assert problem is None and outcome is None  # channel 2 still open
    taker.record(a_push(state, 1))  # after learner 1's state: not channel state any more
    problem, outcome = taker.local_state(2, snap.ident, b"state-b", hashlib.sha256(b"state-b").hexdigest(), now=1.3)
    assert problem is None and outcome is not None and outcome.error is None
    assert outcome.summary["learners"] == 2 and outcome.summary["inflight"] == 1
    manifest = snapshots.read(outcome.summary["directory"])
    assert manifest["inflight"][0]["learner"] == 1 and manifest["inflight"][0]["kind"] == "Push"
    assert snapshots.local_state_of(outcome.summary["directory"], manifest, "b") == b"state-b"
    assert taker.taking is None


def test_a_silent_learner_is_left_out_at_the_timeout_and_a_damaged_state_is_refused(tmp_path):
    state = initialised_state()
    taker = snapshots.Taker(tmp_path)
    snap = taker.start(state, {1: "a", 2: "b"}, {}, now=0.0)
    problem, outcome = taker.local_state(1, snap.ident, b"state-a", "0" * 64, now=0.5)
    assert "hashes" in problem and outcome is None
    assert taker.timeout(snap.ident + 1, now=1.0) is None  # not this snapshot's timer
    outcome = taker.timeout(snap.ident, now=2.0)
    assert outcome.error is None and outcome.summary["learners"] == 0
    assert set(outcome.summary["left_out"]) == {"1", "2"}


def test_no_snapshot_without_a_directory_or_parameters(tmp_path):
    with pytest.raises(snapshots.SnapshotError, match="no snapshot directory"):
        snapshots.Taker(None).start(initialised_state(), {}, {}, now=0.0)
    with pytest.raises(snapshots.SnapshotError, match="no parameters"):
        snapshots.Taker(tmp_path).start(syncer.new_state(SyncerConfig(num_fragments=1)), {}, {}, now=0.0)
