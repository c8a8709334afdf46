"""A snapshot's files (net.snapshot) on a real file system: written whole, read back checked, and a
learner state the disk cannot take is left out with the reason instead of stopping the syncer."""

import hashlib

import numpy as np

from ddiloco.core import syncer
from ddiloco.core.config import SyncerConfig
from ddiloco.core.layout import TensorSpec, build_layout
from ddiloco.net import snapshot as snapshots
from ddiloco.net import store


def small_state() -> syncer.SyncerState:
    layout = build_layout([TensorSpec("w", (4, 8)), TensorSpec("b", (8,))], 2)
    params = [np.arange(f.padded_size, dtype=np.float32) for f in layout.fragments]
    return syncer.new_state(SyncerConfig(num_fragments=2, period=2, quorum=1), layout, params)


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def test_a_snapshot_is_written_whole_and_its_syncer_state_resumes(tmp_path):
    state = small_state()
    snap = snapshots.begin(tmp_path, 1, state, {1: "a", 2: "b"}, {"syncer": 3}, now=10.0)
    assert snapshots.local_state(snap, 1, b"state of a", sha(b"state of a")) is None
    assert snapshots.local_state(snap, 2, b"state of b", sha(b"other")).startswith("learner 2: local state hashes")
    path = snapshots.finish(snap, now=12.5)
    manifest = snapshots.read(path)
    assert manifest["learners"]["1"]["name"] == "a" and manifest["seconds"] == 2.5
    assert "damaged in transit" in manifest["left_out"]["2"]
    resumed, ckpt = store.newest_valid(path)
    assert syncer.state_hash(resumed) == syncer.state_hash(state) and store.run_of(ckpt) == store.NO_RUN


def test_a_learner_state_the_disk_cannot_take_is_left_out_with_the_reason(disk):
    snap = snapshots.begin(disk.path, 1, small_state(), {1: "a"}, {}, now=0.0)
    disk.fill()
    big = b"\x01" * (300 << 10)  # more than the whole disk
    problem = snapshots.local_state(snap, 1, big, sha(big))
    assert "disk full (ENOSPC)" in problem
    disk.free()
    manifest = snapshots.read(snapshots.finish(snap, now=1.0))
    assert manifest["learners"] == {} and "could not be written (disk full (ENOSPC))" in manifest["left_out"]["1"]
