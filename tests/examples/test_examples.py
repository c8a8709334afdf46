"""Each example in examples/ against a real `ddiloco syncer` process: it trains a few steps through
the hook, exports the syncer's newest checkpoint and loads it into its own model."""

import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file

from ddiloco.learner import params_file
from ddiloco.net.auth import write_token_file

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
START_S_MAX = 120
RUN_S_MAX = 600


@pytest.fixture
def syncer(tmp_path):
    """A syncer on a free port, as examples/*.py say to start one; yields (url, token file, checkpoint dir)."""
    token = write_token_file(tmp_path / "token", "examples-" + "0123456789abcdef" + "fedcba9876543210")
    log = tmp_path / "syncer.log"
    with open(log, "w") as fh:
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
                str(tmp_path / "ckpt"),
                "--fragments",
                "2",
                "--outer-lr",
                "1",
                "--outer-momentum",
                "0",
            ],
            stdout=fh,
            stderr=subprocess.STDOUT,
        )
    try:
        deadline = time.monotonic() + START_S_MAX
        while not (found := re.search(r"listening on 127\.0\.0\.1:(\d+)", log.read_text())):
            assert proc.poll() is None and time.monotonic() < deadline, "syncer did not start:\n" + log.read_text()
            time.sleep(0.1)  # polling the log for the line that says it listens
        yield f"ws://127.0.0.1:{found.group(1)}/ws", token, tmp_path / "ckpt"
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0, log.read_text()


@pytest.mark.parametrize("example", ["flax_linen.py", "flax_nnx.py", "equinox_mlp.py"])
def test_example_trains_through_a_syncer_and_loads_the_exported_model(syncer, tmp_path, example):
    url, token, ckpt = syncer
    out = tmp_path / "model.safetensors"
    got = subprocess.run(
        [
            sys.executable,
            str(EXAMPLES / example),
            "--url",
            url,
            "--name",
            "ci",
            "--token-file",
            str(token),
            "--steps",
            "60",
            "--checkpoint-dir",
            str(ckpt),
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=RUN_S_MAX,
        check=False,
    )
    assert got.returncode == 0, got.stdout + got.stderr
    initial = float(re.search(r"initial loss (\S+)", got.stdout).group(1))
    exported = float(re.search(r"exported model .*: loss (\S+)", got.stdout).group(1))
    assert exported < 0.8 * initial, got.stdout  # the merged model learned, and it is what was loaded
    tensors = load_file(out)
    assert len(tensors) == 6 and all(v.dtype == np.float32 and np.isfinite(v).all() for v in tensors.values())
    # What was exported is the checkpoint the example asked for, bit for bit (the learner is gone: no merge since).
    state, _ = params_file.read_checkpoint(ckpt)
    assert state.merges > 0
    want = params_file.global_params(state)
    assert sorted(want) == sorted(tensors)
    for name, value in want.items():
        np.testing.assert_array_equal(tensors[name], value, err_msg=name)


def test_each_example_is_short_and_uses_only_the_hook_the_docs_show():
    for path in sorted(EXAMPLES.glob("*.py")):
        text = path.read_text()
        assert len(text.splitlines()) <= 100, path.name
        assert text.count("DilocoSync(") == 1 and text.count("sync.step(") == 1 and text.count("sync.close()") == 1, (
            path.name
        )
    assert {p.name for p in EXAMPLES.glob("*.py")} == {"flax_linen.py", "flax_nnx.py", "equinox_mlp.py"}


def test_an_example_refused_by_the_syncer_says_why_in_one_line(syncer, tmp_path):
    url, _, _ = syncer
    wrong = write_token_file(tmp_path / "wrong", "wrong-" + "0123456789abcdef" + "fedcba9876543210")
    got = subprocess.run(
        [sys.executable, str(EXAMPLES / "flax_linen.py"), "--url", url, "--token-file", str(wrong), "--steps", "1"],
        capture_output=True,
        text=True,
        timeout=RUN_S_MAX,
    )
    assert got.returncode == 2, got.stderr
    assert "Traceback" not in got.stderr and got.stderr.strip().splitlines()[-1].startswith("flax_linen.py: error: ")
