"""`ddiloco syncer` as a user runs it: a real process, its log, its HTTP endpoints, SIGTERM."""

import json
import signal
import subprocess
import sys
import urllib.request

import pytest


def test_syncer_process_serves_and_stops_on_sigterm(tmp_path, start_syncer):
    proc, port, lines = start_syncer(tmp_path, "--quorum", "2", "--fragments", "3")
    try:
        first = json.loads(lines[0].split("config ", 1)[1])  # the resolved config is the first log line
        assert first["quorum"] == 2 and first["num_fragments"] == 3
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=5) as r:
            assert r.read() == b"ok\n"
        status = subprocess.run(
            [sys.executable, "-m", "ddiloco.cli", "status", f"http://127.0.0.1:{port}"], capture_output=True, text=True, timeout=60
        )
        assert status.returncode == 0 and json.loads(status.stdout)["config"]["quorum"] == 2
        req = urllib.request.Request(f"http://127.0.0.1:{port}/checkpoint", method="POST")
        with pytest.raises(urllib.error.HTTPError) as info:
            urllib.request.urlopen(req, timeout=5)
        assert info.value.code == 401  # changing state needs the token
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0


@pytest.mark.parametrize(
    "args, message",
    [
        (["--quorum", "0"], "quorum must be an integer"),
        (["--merge", "median"], "invalid choice"),
        (["--resume", "does-not-exist"], "cannot resume"),
    ],
)
def test_bad_flags_get_one_clear_line(tmp_path, args, message):
    out = subprocess.run([sys.executable, "-m", "ddiloco.cli", "syncer", *args], capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert out.returncode == 2
    assert message in out.stderr and "Traceback" not in out.stderr


def _another_runs_checkpoint(directory):
    import numpy as np
    from ddiloco.core import syncer
    from ddiloco.core.config import SyncerConfig
    from ddiloco.core.layout import TensorSpec, build_layout
    from ddiloco.net import store

    layout = build_layout([TensorSpec("w", (4, 8)), TensorSpec("b", (8,))], 2)
    state = syncer.new_state(SyncerConfig(num_fragments=2), layout, [np.ones(f.padded_size, np.float32) for f in layout.fragments])
    state.merges = 500
    return store.CheckpointStore.open(directory, new_id=lambda: "aaaaaaaaaaaaaaaa").write(state).path


def test_a_fresh_run_refuses_another_runs_checkpoint_dir_unless_told(tmp_path, start_syncer):
    old = _another_runs_checkpoint(tmp_path / "ck")
    out = subprocess.run([sys.executable, "-m", "ddiloco.cli", "syncer", "--port", "0", "--checkpoint-dir", str(tmp_path / "ck")],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert "holds checkpoints of another run: run aaaaaaaaaaaaaaaa" in out.stderr and "--overwrite" in out.stderr
    proc, _, lines = start_syncer(tmp_path, "--overwrite")
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(30) == 0
    # no parameters, so no checkpoint of the new run: the old run's stays until one is written
    assert old.exists()


def test_resume_continues_the_same_run(tmp_path, start_syncer):
    from ddiloco.net import store

    old = _another_runs_checkpoint(tmp_path / "ck")
    proc, _, lines = start_syncer(tmp_path, "--resume", str(tmp_path / "ck"))
    assert any("checkpoints of run aaaaaaaaaaaaaaaa" in line for line in lines)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(30) == 0  # with a last checkpoint, of the same run
    state, newest = store.newest_valid(tmp_path / "ck")
    assert newest != old and store.run_of(newest) == "aaaaaaaaaaaaaaaa" and state.merges == 500
