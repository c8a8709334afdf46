"""`ddiloco syncer --standby`: a hot standby takes a killed syncer's place, as a user runs it."""

import json
import re
import signal
import subprocess
import sys
import time
import urllib.request

WAIT_S_MAX = 120  # bound of every wait below (a loaded machine imports slowly)


def _syncer(tmp_path, *extra):
    return subprocess.Popen(
        [sys.executable, "-m", "ddiloco.cli", "syncer", "--auth-token-file", str(tmp_path / "token"), *extra],
        stderr=subprocess.PIPE,
        text=True,
    )


def _read_until(proc, pattern, lines):
    """Lines of `proc`'s log until one matches `pattern` (bounded); returns the match."""
    deadline = time.monotonic() + WAIT_S_MAX
    while time.monotonic() < deadline:
        line = proc.stderr.readline()
        if not line:
            break
        lines.append(line)
        m = re.search(pattern, line)
        if m:
            return m
    proc.kill()
    raise AssertionError(f"no line matched {pattern!r}:\n" + "".join(lines))


def _status(port):
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/status", timeout=10) as r:
        return json.loads(r.read())


def test_a_second_syncer_on_a_directory_in_use_is_refused_in_one_line(tmp_path, start_syncer, another_runs_checkpoint):
    another_runs_checkpoint(tmp_path / "ck")
    first, _, _ = start_syncer(tmp_path, "--resume", str(tmp_path / "ck"))
    try:
        second = subprocess.run(
            [sys.executable, "-m", "ddiloco.cli", "syncer", "--port", "0", "--resume", str(tmp_path / "ck")],
            capture_output=True,
            text=True,
            timeout=WAIT_S_MAX,
        )
        assert second.returncode == 2 and "Traceback" not in second.stderr
        assert f"another syncer (pid {first.pid} on " in second.stderr and "--standby" in second.stderr
    finally:
        first.send_signal(signal.SIGTERM)
        assert first.wait(30) == 0


def test_a_standby_serves_in_place_of_a_killed_syncer_from_its_newest_checkpoint(
    tmp_path, start_syncer, another_runs_checkpoint
):
    from ddiloco.net import store

    another_runs_checkpoint(tmp_path / "ck")  # 500 merges of run aaaa...
    primary, port, _ = start_syncer(tmp_path, "--resume", str(tmp_path / "ck"))
    lines: list[str] = []
    standby = _syncer(tmp_path, "--port", str(port), "--resume", str(tmp_path / "ck"), "--standby")
    try:
        _read_until(standby, r"standby for .*: kernels loaded in", lines)
        assert _status(port)["merges"] == 500  # still the primary's
        primary.send_signal(signal.SIGKILL)
        primary.wait(30)
        _read_until(standby, r"standby: took over", lines)
        _read_until(standby, rf"listening on 127\.0\.0\.1:{port}\b", lines)
        status = _status(port)
        assert status["merges"] == 500
        # what the standby resumed is the run it stood by for; its checkpoints continue that run
        standby.send_signal(signal.SIGTERM)
        assert standby.wait(30) == 0
        state, newest = store.newest_valid(tmp_path / "ck")
        assert store.run_of(newest) == "aaaaaaaaaaaaaaaa" and state.merges == 500
    finally:
        for proc in (primary, standby):
            if proc.poll() is None:
                proc.kill()
                proc.wait(30)


def test_a_standby_needs_the_directory_it_stands_by_for(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "ddiloco.cli", "syncer", "--standby", "--checkpoint-dir", str(tmp_path / "ck")],
        capture_output=True,
        text=True,
        timeout=WAIT_S_MAX,
    )
    assert out.returncode == 2 and "standby needs resume DIR" in out.stderr and "Traceback" not in out.stderr
