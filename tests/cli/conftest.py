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
