"""Consistent snapshots (net.snapshot): taken during a run by `POST /snapshot` with the real daemon
and two training learners on 127.0.0.1, checked for consistency and integrity, and restored: a new
syncer from the snapshot's state and learners from their local states, training on from the cut."""

import json
import threading
import urllib.error
import urllib.request
from pathlib import Path

import jax
import numpy as np
import pytest

from ddiloco.core import checkpoint
from ddiloco.core.syncer import LearnerStatus, state_hash
from ddiloco.learner.sync import DilocoSync, SyncConfig
from ddiloco.learner.tree import leaf_path
from ddiloco.net import peer, store
from ddiloco.net import snapshot as snapshots
from ddiloco.reference import data
from ddiloco.reference import model as reference

from .conftest import TOKEN

MODEL = reference.ModelConfig(d_model=16, n_layers=1, n_heads=2, d_ff=32, seq=16)
TRAIN = reference.TrainConfig(lr=1e-3, warmup_steps=2, total_steps=100_000)


class Learner:
    """The reference model and AdamW on a thread, synchronised by the real hook and client."""

    def __init__(self, url, name, index, restore_from=None):
        self.stop, self.steps, self.error = threading.Event(), 0, None
        self.params = reference.init_params(MODEL, jax.random.PRNGKey(index))
        self.opt_state = reference.make_optimizer(TRAIN).init(self.params)
        self.sync = DilocoSync.connect(self.params, SyncConfig(url=url, name=name, token=TOKEN))
        if restore_from is not None:
            self.params, self.opt_state = self.sync.restore(self.params, self.opt_state, restore_from)
        self.start_params = self.params
        self.index = index
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self):
        try:
            train_step = reference.make_train_step(MODEL, reference.make_optimizer(TRAIN))
            stream = data.batches(
                data.Shard(self.index, 2).slice(data.train_bytes()), 2, MODEL.seq, np.random.default_rng(self.index)
            )
            params, opt_state = self.params, self.opt_state
            while not self.stop.is_set():
                x, y = next(stream)
                params, opt_state, _ = train_step(params, opt_state, x, y)
                params = self.sync.step(params, tokens=2 * MODEL.seq, opt_state=opt_state)
                self.steps += 1
                self.stop.wait(0.005)
        except BaseException as exc:  # reported by the test, not lost with the thread
            self.error = exc

    def close(self):
        self.stop.set()
        self.thread.join(30)
        self.sync.close()
        assert self.error is None, self.error


def _post(url, token=TOKEN):
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    req = urllib.request.Request(f"{url}/snapshot", method="POST", headers=headers)
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read())


def _live(s, count):
    return s.wait_for(
        f"{count} live learners", lambda st: sum(r.status is LearnerStatus.LIVE for r in st.learners.values()) >= count
    )


@pytest.fixture
def snapshot_run(threaded_syncer, tmp_path):
    s = threaded_syncer(num_fragments=2, period=4, quorum=1, server={"snapshot_dir": tmp_path / "snaps"})
    learners = [Learner(s.url, f"learner-{i}", i) for i in range(2)]
    try:
        _live(s, 2)
        s.wait_for("merges", lambda st: st.merges >= 4)
        result = _post(s.http)
        s.wait_for("merges after the snapshot", lambda st: st.merges >= result_merges(result) + 2)
    finally:
        for lr in learners:
            lr.close()
    return result, tmp_path


def result_merges(result):
    return snapshots.read(result["directory"])["merges"]


def test_a_snapshot_taken_during_training_is_a_consistent_cut(snapshot_run):
    result, _ = snapshot_run
    assert result["learners"] == 2 and result["left_out"] == {}
    manifest = snapshots.read(result["directory"])
    state = checkpoint.restore((Path(result["directory"]) / manifest["syncer"]).read_bytes())
    assert state_hash(state) == manifest["syncer_state_hash"]
    assert [f.version for f in state.fragments] == manifest["versions"]
    for entry in manifest["learners"].values():
        snap = peer.decode_snapshot((Path(result["directory"]) / entry["file"]).read_bytes())
        held = snap.meta["versions"]
        # Consistent: a learner never holds a version the syncer had not made at the cut. It may hold
        # an older one (the newer one was in flight on the syncer -> learner channel).
        assert all(0 <= v <= w for v, w in zip(held, manifest["versions"])), (held, manifest["versions"])
        assert set(snap.meta["sync"]) >= {"steps", "tokens"} and entry["name"] in ("learner-0", "learner-1")
        assert all(f"sync/base/{q}" in snap.arrays for q in range(2))
    for message in manifest["inflight"]:  # channel state: from the two learners, after the cut
        assert (
            message["kind"] in ("Progress", "Push", "InitFragment") and str(message["learner"]) in manifest["learners"]
        )
        if message["kind"] == "Push":
            assert message["fields"]["base_version"] <= manifest["versions"][message["fields"]["fragment"]]


def test_a_damaged_snapshot_file_is_named(snapshot_run):
    result, _ = snapshot_run
    manifest = snapshots.read(result["directory"])
    victim = Path(result["directory"]) / next(iter(manifest["learners"].values()))["file"]
    raw = bytearray(victim.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    victim.write_bytes(bytes(raw))
    with pytest.raises(snapshots.SnapshotError, match=victim.name):
        snapshots.read(result["directory"])


def test_the_system_restarts_from_a_snapshot_and_trains_on(snapshot_run, threaded_syncer):
    result, _ = snapshot_run
    directory = Path(result["directory"])
    manifest = snapshots.read(directory)
    state, _ = store.newest_valid(directory)  # what `ddiloco syncer --resume SNAPSHOT_DIR` reads
    s = threaded_syncer(state)
    learners = []
    try:
        for i in range(2):
            local = snapshots.local_state_of(directory, manifest, f"learner-{i}")
            learners.append(Learner(s.url, f"learner-{i}", i, restore_from=local))
            saved = peer.decode_snapshot(local)
            for keys, leaf in jax.tree_util.tree_flatten_with_path(learners[-1].start_params)[0]:
                # bit for bit the parameters the learner had at the cut
                np.testing.assert_array_equal(np.asarray(leaf), saved.arrays["params/" + leaf_path(keys)])
            assert learners[-1].sync.step_count == saved.meta["step"]
        _live(s, 2)
        s.wait_for("merges from the restored cut", lambda st: st.merges >= manifest["merges"] + 3)
        versions = s.read(lambda st: [f.version for f in st.fragments])
        assert all(v > w for v, w in zip(versions, manifest["versions"]))
    finally:
        for lr in learners:
            lr.close()


def test_snapshot_needs_the_token_and_a_directory(threaded_syncer):
    s = threaded_syncer(num_fragments=2, period=4)
    with pytest.raises(urllib.error.HTTPError) as unauthorized:
        _post(s.http, token=None)
    assert unauthorized.value.code == 401
    with pytest.raises(urllib.error.HTTPError) as conflict:
        _post(s.http)
    assert conflict.value.code == 409 and b"no snapshot directory" in conflict.value.read()
