import re
import subprocess
import sys
import time

import pytest

from ddiloco.net.auth import write_token_file

TOKEN = "cli-test-token-0123456789"


def _start(tmp_path, *extra, env=None):
    """`ddiloco syncer` in a real process; returns (process, port, log lines so far)."""
    token = tmp_path / "token"
    write_token_file(token, TOKEN)
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "ddiloco.cli",
            "syncer",
            "--port",
            "0",
            "--auth-token-file",
            str(token),
            "--checkpoint-dir",
            str(tmp_path / "ck"),
            *extra,
        ],
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    lines = []
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        line = proc.stderr.readline()
        if not line:
            break
        lines.append(line)
        m = re.search(r"listening on 127\.0\.0\.1:(\d+)", line)
        if m:
            return proc, int(m.group(1)), lines
    proc.kill()
    raise AssertionError("syncer did not start:\n" + "".join(lines))


@pytest.fixture
def start_syncer():
    return _start


def _another_runs_checkpoint(directory):
    """A checkpoint of run aaaa... (500 merges, two small fragments) written into `directory`; its path."""
    import numpy as np

    from ddiloco.core import syncer
    from ddiloco.core.config import SyncerConfig
    from ddiloco.core.layout import TensorSpec, build_layout
    from ddiloco.net import store

    layout = build_layout([TensorSpec("w", (4, 8)), TensorSpec("b", (8,))], 2)
    state = syncer.new_state(
        SyncerConfig(num_fragments=2), layout, [np.ones(f.padded_size, np.float32) for f in layout.fragments]
    )
    state.merges = 500
    return store.CheckpointStore.open(directory, new_id=lambda: "aaaaaaaaaaaaaaaa").write(state).path


@pytest.fixture
def another_runs_checkpoint():
    return _another_runs_checkpoint
