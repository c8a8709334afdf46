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
