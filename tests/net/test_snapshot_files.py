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
    taker = snapshots.Taker(tmp_path)
    snap = taker.start(state, {1: "a", 2: "b"}, {"syncer": 3}, now=10.0)
    assert not list(tmp_path.glob("snap-*")), "nothing is visible as a snapshot before it is complete"
    assert taker.local_state(1, snap.ident, b"state of a", sha(b"state of a"), now=11.0) == (None, None)
    problem, outcome = taker.local_state(2, snap.ident, b"state of b", sha(b"other"), now=12.5)
    assert problem.startswith("learner 2: local state hashes") and outcome.error is None
    path = outcome.summary["directory"]
    manifest = snapshots.read(path)
    assert manifest == outcome.manifest
    assert manifest["learners"]["1"]["name"] == "a" and manifest["seconds"] == 2.5
    assert "damaged in transit" in manifest["left_out"]["2"]
    resumed, ckpt = store.newest_valid(path)
    assert syncer.state_hash(resumed) == syncer.state_hash(state) and store.run_of(ckpt) == store.NO_RUN


def test_only_the_newest_complete_snapshots_are_kept(tmp_path):
    taker = snapshots.Taker(tmp_path, kept=2)
    for i in range(3):
        snap = taker.start(small_state(), {}, {}, now=float(i))
        assert taker.timeout(snap.ident, now=i + 0.5).error is None
    assert sorted(p.name[-6:] for p in tmp_path.glob("snap-*")) == ["000002", "000003"]


def test_a_learner_state_the_disk_cannot_take_is_left_out_with_the_reason(disk):
    taker = snapshots.Taker(disk.path)
    snap = taker.start(small_state(), {1: "a", 2: "b"}, {}, now=0.0)
    disk.fill()
    big = b"\x01" * (300 << 10)  # more than the whole disk
    problem, outcome = taker.local_state(1, snap.ident, big, sha(big), now=0.5)
    assert "disk full (ENOSPC)" in problem and outcome is None
    disk.free()
    problem, outcome = taker.local_state(2, snap.ident, b"b", sha(b"b"), now=1.0)
    assert problem is None and outcome.error is None
    manifest = snapshots.read(outcome.summary["directory"])
    assert list(manifest["learners"]) == ["2"]
    assert "could not be written (disk full (ENOSPC))" in manifest["left_out"]["1"]
