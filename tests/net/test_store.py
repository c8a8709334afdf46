"""Checkpoint files: the newest is the one written last, also without a merge in between."""

import numpy as np

from ddiloco.core import syncer
from ddiloco.core.config import SyncerConfig
from ddiloco.core.layout import TensorSpec, build_layout
from ddiloco.net import store


def small_state(seed: int = 0) -> syncer.SyncerState:
    layout = build_layout([TensorSpec("w", (4, 8)), TensorSpec("b", (8,))], 2)
    rng = np.random.default_rng(seed)
    params = [rng.standard_normal(f.padded_size).astype(np.float32) for f in layout.fragments]
    return syncer.new_state(SyncerConfig(num_fragments=2, period=2, quorum=1), layout, params)


def test_newest_is_the_last_written_at_the_same_merge_count(tmp_path):
    # Several checkpoints of one merge count whose hashes sort the other way round: the sequence
    # number in the name, not the hash, decides which one is newest.
    states = []
    for step in range(6):
        state = small_state()
        state.global_step = step  # a change without a merge (as when learners leave)
        store.write(tmp_path, state, keep=10)
        states.append(syncer.state_hash(state))
        newest, path = store.newest_valid(tmp_path)
        assert syncer.state_hash(newest) == states[-1], f"after write {step}: {path.name}"


def test_retention_keeps_the_newest(tmp_path):
    for step in range(5):
        state = small_state()
        state.global_step = step
        state.merges = 1 if step >= 3 else 0
        store.write(tmp_path, state, keep=2)
    names = sorted(p.name for p in tmp_path.glob("ckpt-*.ddck"))
    assert len(names) == 2
    newest, _ = store.newest_valid(tmp_path)
    assert newest.merges == 1 and newest.global_step == 4
