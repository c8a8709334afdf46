"""Checkpoint files: the newest is the one written last, every failure is surfaced, no run eats another."""

import os
import select
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import aiohttp
import numpy as np
import pytest

from ddiloco.core import syncer
from ddiloco.core.config import SyncerConfig
from ddiloco.core.layout import TensorSpec, build_layout
from ddiloco.net import files, store
from ddiloco.net.server import ServerConfig, SyncerServer

FORMAT1 = Path(__file__).parents[1] / "core" / "golden_checkpoints" / "format1.ddck"
TOKEN = "store-test-token-0123456789"


def small_state(seed: int = 0) -> syncer.SyncerState:
    layout = build_layout([TensorSpec("w", (4, 8)), TensorSpec("b", (8,))], 2)
    rng = np.random.default_rng(seed)
    params = [rng.standard_normal(f.padded_size).astype(np.float32) for f in layout.fragments]
    return syncer.new_state(SyncerConfig(num_fragments=2, period=2, quorum=1), layout, params)


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        self.now += 1.0
        return self.now


def ids(*runs):
    it = iter(runs)
    return lambda: next(it)


def opened(directory, run=None, **kw):
    kw.setdefault("clock", Clock())
    return store.CheckpointStore.open(directory, run, new_id=ids("aaaaaaaaaaaaaaaa", "bbbbbbbbbbbbbbbb"), **kw)


def names(directory):
    return sorted(p.name for p in Path(directory).iterdir() if p.name.startswith("ckpt-"))


def test_newest_is_the_last_written_at_the_same_merge_count(tmp_path):
    # Several checkpoints of one merge count whose hashes sort the other way round: the sequence
    # number in the name, not the hash, decides which one is newest.
    ck = opened(tmp_path, keep=10)
    states = []
    for step in range(6):
        state = small_state()
        state.global_step = step  # a change without a merge (as when learners leave)
        ck.write(state)
        states.append(syncer.state_hash(state))
        newest, path = store.newest_valid(tmp_path)
        assert syncer.state_hash(newest) == states[-1], f"after write {step}: {path.name}"


def test_retention_keeps_the_newest(tmp_path):
    ck = opened(tmp_path, keep=2)
    for step in range(5):
        state = small_state()
        state.global_step = step
        state.merges = 1 if step >= 3 else 0
        written = ck.write(state)
    assert len(names(tmp_path)) == 2
    newest, path = store.newest_valid(tmp_path)
    assert newest.merges == 1 and newest.global_step == 4 and path == written.path
    assert store.run_of(path) == "aaaaaaaaaaaaaaaa" and written.seq == 5


def test_health_records_success_then_failure(disk):
    clock = Clock()
    ck = opened(disk.path / "ck", clock=clock)
    assert ck.health.ok and ck.health.written is None
    state = small_state()
    first = ck.write(state)
    assert ck.health.as_dict() == {
        "ok": True,
        "written_at": 1001.0,
        "written": first.path.name,
        "merges": 0,
        "versions": [0, 0],
        "error": None,
        "error_at": None,
        "failures_since_written": 0,
    }
    disk.read_only()
    state.global_step = 7
    with pytest.raises(store.StoreError):
        ck.write(state)
    assert not ck.health.ok and ck.health.error_at == 1002.0 and ck.health.written == first.path.name


def test_a_full_disk_loses_only_the_new_checkpoint_and_says_so(disk):
    ck = opened(disk.path / "ck")
    first = ck.write(small_state())
    disk.fill()
    later = small_state(seed=1)
    later.merges = 9
    with pytest.raises(store.StoreError) as info:
        ck.write(later)
    text = str(info.value)
    assert text.startswith("checkpoint not written: cannot write checkpoint ") and "disk full (ENOSPC)" in text
    assert isinstance(info.value.__cause__, files.FileError)
    assert ck.health.error == text and ck.health.failures_since_written == 1
    assert names(disk.path / "ck") == [first.path.name]  # no temporary file left, the old one intact
    state, path = store.newest_valid(disk.path / "ck")
    assert path == first.path and state.merges == 0
    disk.free()
    again = ck.write(later)  # space again: checkpointing recovers by itself
    assert ck.health.ok and ck.health.error == text and store.newest_valid(disk.path / "ck")[1] == again.path


def test_a_read_only_directory_is_a_clear_error_never_a_raw_oserror(disk):
    ck = opened(disk.path / "ck")
    first = ck.write(small_state())
    disk.read_only()
    with pytest.raises(store.StoreError, match="read-only file system \\(EROFS\\)") as info:
        ck.write(small_state(seed=2))
    assert "could not be removed" not in str(info.value)  # nothing was created, so nothing to clean up
    assert store.newest_valid(disk.path / "ck")[1] == first.path


def test_a_fresh_run_is_refused_a_directory_of_another_run(tmp_path):
    old = opened(tmp_path, keep=3)
    for merges in range(100, 105):  # a longer run: higher merge counts than the new one will reach
        state = small_state()
        state.merges = merges
        old.write(state)
    before = names(tmp_path)
    with pytest.raises(
        store.StoreError, match="holds checkpoints of another run: run aaaaaaaaaaaaaaaa \\(3 checkpoints\\)"
    ) as info:
        store.CheckpointStore.open(tmp_path, new_id=ids("bbbbbbbbbbbbbbbb"))
    assert "--overwrite" in str(info.value) and "--resume" in str(info.value)
    assert names(tmp_path) == before


def test_overwrite_removes_the_other_run_only_once_its_own_checkpoint_is_durable(tmp_path):
    old = opened(tmp_path)
    state = small_state()
    state.merges = 100
    old.write(state)
    new = store.CheckpointStore.open(tmp_path, overwrite=True, new_id=ids("bbbbbbbbbbbbbbbb"), clock=Clock())
    assert store.runs_in(tmp_path) == {"aaaaaaaaaaaaaaaa": 1}  # nothing removed before the new run has a checkpoint
    written = new.write(small_state(seed=3))
    assert store.runs_in(tmp_path) == {"bbbbbbbbbbbbbbbb": 1}
    assert store.newest_valid(tmp_path)[1] == written.path


def test_pruning_never_touches_another_runs_checkpoints(tmp_path):
    other = tmp_path / "ckpt-cccccccccccccccc-000000007-000000000900-0123456789abcdef.safetensors"
    resumed = opened(tmp_path, "aaaaaaaaaaaaaaaa", keep=2)
    shutil.copy(FORMAT1, other)  # another run's file appears after the run started (copied in by hand)
    for merges in range(5):
        state = small_state()
        state.merges = merges
        resumed.write(state)
    assert other.exists()
    assert store.runs_in(tmp_path) == {"aaaaaaaaaaaaaaaa": 2, "cccccccccccccccc": 1}


def test_resume_keeps_the_run_and_continues_its_sequence_past_a_corrupt_newest(tmp_path):
    ck = opened(tmp_path, keep=5)
    for step in range(3):
        state = small_state()
        state.global_step = step
        ck.write(state)
    newest = Path(tmp_path / names(tmp_path)[-1])
    data = bytearray(newest.read_bytes())
    data[-3] ^= 0xFF
    newest.write_bytes(bytes(data))
    state, path = store.newest_valid(tmp_path)
    assert state.global_step == 1  # the corrupt newest is skipped
    resumed = store.CheckpointStore.open(tmp_path, store.run_of(path), new_id=ids(), clock=Clock())
    state.global_step = 10
    written = resumed.write(state)
    assert written.run == "aaaaaaaaaaaaaaaa" and written.seq == 4
    assert store.newest_valid(tmp_path)[1] == written.path


def test_checkpoints_from_before_runs_are_read_and_adopted_on_resume(tmp_path):
    legacy = tmp_path / "ckpt-000000000017-000001-0123456789abcdef.ddck"
    shutil.copy(FORMAT1, legacy)
    state, path = store.newest_valid(tmp_path)
    assert path == legacy and state.merges == 17 and store.run_of(path) == store.LEGACY_RUN
    with pytest.raises(store.StoreError, match="run legacy"):
        store.CheckpointStore.open(tmp_path, new_id=ids("bbbbbbbbbbbbbbbb"))
    adopting = store.CheckpointStore.open(tmp_path, store.LEGACY_RUN, new_id=ids("bbbbbbbbbbbbbbbb"), clock=Clock())
    written = adopting.write(state)
    assert legacy.exists() and store.newest_valid(tmp_path)[1] == written.path


# The child is a script, not a function of this module: under --import-mode=importlib a spawned
# process cannot import a test module by name.
_WRITE_THEN_HANG_IN_THE_RENAME = """
import signal, sys
import numpy as np
from ddiloco.core import syncer
from ddiloco.core.config import SyncerConfig
from ddiloco.core.layout import TensorSpec, build_layout
from ddiloco.net import files, store

def small_state(seed):
    layout = build_layout([TensorSpec("w", (4, 8)), TensorSpec("b", (8,))], 2)
    rng = np.random.default_rng(seed)
    params = [rng.standard_normal(f.padded_size).astype(np.float32) for f in layout.fragments]
    return syncer.new_state(SyncerConfig(num_fragments=2, period=2, quorum=1), layout, params)

ck = store.CheckpointStore.open(sys.argv[1], "aaaaaaaaaaaaaaaa")
ck.write(small_state(0))

def hang(src, dst):
    print("in the rename", flush=True)
    signal.pause()  # killed here, the new bytes durable under the temporary name only

files.os.replace = hang  # fault injection in the child only
state = small_state(1)
state.merges = 5
ck.write(state)
"""


def test_a_kill_in_the_middle_of_a_write_leaves_the_last_good_checkpoint(tmp_path):
    child = subprocess.Popen(
        [sys.executable, "-c", _WRITE_THEN_HANG_IN_THE_RENAME, str(tmp_path)], stdout=subprocess.PIPE, text=True
    )
    try:
        ready = select.select([child.stdout], [], [], 120)[0]
        assert ready and child.stdout.readline() == "in the rename\n", "the child never reached the rename"
        os.kill(child.pid, signal.SIGKILL)
    finally:
        child.kill()
        child.wait(30)
        child.stdout.close()
    assert child.returncode == -signal.SIGKILL
    stray = [p.name for p in tmp_path.iterdir() if files.TEMPORARY_MARK in p.name]
    assert len(stray) == 1 and (tmp_path / stray[0]).stat().st_size > 0
    state, path = store.newest_valid(tmp_path)
    assert state.merges == 0 and syncer.state_hash(state) == syncer.state_hash(small_state())
    # the run resumes from it and goes on; the stray temporary file is never taken for a checkpoint
    resumed = store.CheckpointStore.open(tmp_path, store.run_of(path))
    assert resumed.write(state).seq == 2


async def test_the_daemon_answers_a_failed_checkpoint_with_an_error(disk):
    state = small_state()
    server = SyncerServer(state, ServerConfig(port=0, auth_token=TOKEN, checkpoint_dir=disk.path / "ck"))
    port = await server.start()
    url, auth = f"http://127.0.0.1:{port}/checkpoint", {"Authorization": f"Bearer {TOKEN}"}
    try:
        async with aiohttp.ClientSession() as http:
            async with http.post(url, headers=auth) as r:
                assert r.status == 200 and server.checkpoints.store.health.written in await r.text()
            disk.read_only()
            async with http.post(url, headers=auth) as r:
                assert r.status == 507 and "read-only file system" in await r.text()
    finally:
        await server.stop()  # the last checkpoint fails too: logged and in the health, not a traceback
    assert not server.checkpoints.store.health.ok and server.checkpoints.store.health.failures_since_written == 2
    assert server.metrics.checkpoint_failures == 2


def test_a_checkpoint_dir_that_is_a_file_is_named_in_the_error(tmp_path):
    (tmp_path / "ck").write_text("not a directory")
    ck = opened(tmp_path / "ck")
    with pytest.raises(store.StoreError, match=f"cannot create checkpoint directory {tmp_path / 'ck'}: File exists"):
        ck.write(small_state())
    with pytest.raises(store.StoreError, match="does not exist"):
        store.newest_valid(tmp_path / "ck")
