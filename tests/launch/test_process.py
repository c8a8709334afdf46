"""`ddiloco.launch.process`: private files, a supervised child, and a child that dies with its supervisor."""

import os
import signal
import stat
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from ddiloco.launch.process import LaunchError, PrivateDir, Supervised

# A child that says it is ready, then waits; on SIGTERM it notes it in a file and exits 0.
CHILD = textwrap.dedent("""
    import pathlib, signal, sys
    out = pathlib.Path(sys.argv[1])
    def stop(*_):
        out.write_text("terminated")
        sys.exit(0)
    signal.signal(signal.SIGTERM, stop)
    print("child ready", flush=True)
    while True:
        signal.pause()
""")

# A supervisor of that child that reports the child's pid, then waits to be killed.
SUPERVISOR = textwrap.dedent("""
    import sys, threading
    from pathlib import Path
    from ddiloco.launch.process import Supervised
    child = Supervised([sys.executable, "-c", sys.argv[1], sys.argv[2]], Path(sys.argv[3]))
    child.start()
    child.wait_for_line("child ready", 60)
    print(child.proc.pid, flush=True)
    threading.Event().wait()
""")


def _until(predicate, timeout_s, what):
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def _alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as fh:  # a zombie is not alive (its parent has not reaped it yet)
        return fh.read().rsplit(")", 1)[1].split()[0] != "Z"


def test_private_files_are_the_owners_alone_and_go_away_on_close():
    private = PrivateDir()
    path = private.write("token", "secret-value\n")
    assert stat.S_IMODE(private.path.stat().st_mode) == 0o700 and stat.S_IMODE(path.stat().st_mode) == 0o600
    assert path.read_text() == "secret-value\n"
    with pytest.raises(FileExistsError):
        private.write("token", "again")  # never silently replaced
    with pytest.raises(ValueError, match="plain name"):
        private.write("../escape", "x")
    private.close()
    assert not private.path.exists()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_a_child_gets_sigterm_when_its_supervisor_is_killed(tmp_path):
    out = tmp_path / "child-out"
    supervisor = subprocess.Popen(
        [sys.executable, "-c", SUPERVISOR, CHILD, str(out), str(tmp_path / "child.log")],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        child_pid = int(supervisor.stdout.readline())
        assert _alive(child_pid) and not out.exists()
        supervisor.send_signal(signal.SIGKILL)
        _until(out.exists, 60, "the orphaned child's SIGTERM")
        assert out.read_text() == "terminated"
        _until(lambda: not _alive(child_pid), 60, "the child's exit")
    finally:
        supervisor.kill()
        supervisor.wait()


def test_stop_is_a_clean_sigterm_and_not_reported_as_a_failure(tmp_path):
    exits = []
    child = Supervised(
        [sys.executable, "-c", CHILD, str(tmp_path / "out")], tmp_path / "logs" / "c.log", on_exit=exits.append
    )
    child.start()
    assert child.wait_for_line(r"child (\w+)", 60).group(1) == "ready"
    assert child.stop() == 0 and (tmp_path / "out").read_text() == "terminated"
    assert exits == []  # asked for: not a fault


def test_an_unasked_exit_is_reported_and_the_log_keeps_every_run(tmp_path):
    log = tmp_path / "c.log"
    exited = threading.Event()
    codes = []
    failing = Supervised(
        [sys.executable, "-c", "print('about to fail', flush=True); raise SystemExit(3)"],
        log,
        on_exit=lambda code: (codes.append(code), exited.set()),
    )
    failing.start()
    assert exited.wait(60) and codes == [3]
    with pytest.raises(LaunchError, match=r"exited with 3 before it was ready; see .*c\.log"):
        failing.wait_for_line("never printed", 60)
    assert "about to fail" in failing.run_output(1 << 16)
    second = Supervised([sys.executable, "-c", "print('second run', flush=True)"], log)
    second.start()
    second.wait_for_line("second run", 60)
    assert "about to fail" not in second.run_output(1 << 16)  # this run's lines only
    text = log.read_text()
    assert text.count("---- ") == 2 and "about to fail" in text and "second run" in text
