"""One `ddiloco` command supervised inside a long-lived host process (a Ray actor, for example).

The command runs as a child process whose output goes to a log file (appended to across restarts,
so one file tells a learner's whole story). Three rules make a supervisor that can itself be killed
at any moment safe:

- The child dies with its supervisor: on Linux it asks the kernel for SIGTERM when the thread that
  started it goes away (`PR_SET_PDEATHSIG`), so a supervisor killed with SIGKILL leaves no orphan
  syncer holding the port or orphan learner pushing for a learner id that is gone. SIGTERM is what
  the commands treat as "stop cleanly": the syncer writes a last checkpoint, a learner says goodbye.
- Secrets reach the child as files only its owner may read, in a directory only its owner may enter
  (`PrivateDir`), never on a command line that `ps` shows to every user of the machine.
- A child that exits on its own, unasked, is a fault of the supervisor's unit: `on_exit` decides
  what follows (the Ray actors end their own process, and Ray's restart policy starts them again).
"""

from __future__ import annotations

import ctypes
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from ddiloco.errors import FaultError

__all__ = ["LaunchError", "PrivateDir", "Supervised", "ddiloco_command"]

STOP_S_MAX = 60.0  # a child that has not exited this long after SIGTERM is killed
LOG_LINE_BYTES_MAX = 1 << 16  # a line read while waiting for a pattern is cut at this length
_PR_SET_PDEATHSIG = 1  # linux/prctl.h


class LaunchError(FaultError, RuntimeError):
    """A command could not be started, or did not come up; the message says why and where its log is."""


def ddiloco_command(subcommand: str, args: Sequence[str]) -> list[str]:
    """The argv of `ddiloco SUBCOMMAND ARGS...` with this interpreter (the one the package is installed in)."""
    return [sys.executable, "-m", "ddiloco.cli", subcommand, *args]


class PrivateDir:
    """A temporary directory only this user may enter (mode 0700), holding files only this user may
    read (mode 0600, set when the file is created, never wider for an instant). Removed by `close`."""

    def __init__(self, prefix: str = "ddiloco-") -> None:
        self.path = Path(tempfile.mkdtemp(prefix=prefix))  # mkdtemp: mode 0700

    def write(self, name: str, data: bytes | str) -> Path:
        if "/" in name or name in ("", ".", ".."):
            raise ValueError(f"a private file's name is a plain name, got {name!r}")
        path = self.path / name
        raw = data.encode() if isinstance(data, str) else data
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as fh:
            fh.write(raw)
        return path

    def close(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)


# Looked up here, in the parent: between fork and exec the child of a process with many threads (a
# Ray worker) must not load libraries or take locks another thread may have held at the fork.
_PRCTL = ctypes.CDLL(None, use_errno=True).prctl if sys.platform.startswith("linux") else None


def _die_with_parent() -> None:  # pragma: no cover - runs in the child between fork and exec
    """Ask the kernel for SIGTERM when the starting thread dies (Linux only; elsewhere a no-op)."""
    if _PRCTL is not None:
        _PRCTL(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)


class Supervised:
    """One child command, its log file, and a watcher thread that reports an unasked exit.

    `start` returns once the child runs; `wait_for_line` waits for a line of its log matching a
    pattern (the syncer's "listening on"); `stop` sends SIGTERM and waits. `on_exit(returncode)` is
    called from the watcher thread when the child exits and no `stop` asked for it.
    """

    def __init__(
        self,
        argv: Sequence[str],
        log_path: Path,
        on_exit: Callable[[int], None] | None = None,
        env: dict[str, str] | None = None,
    ) -> None:
        self.argv = list(argv)
        self.log_path = Path(log_path)
        self.on_exit = on_exit
        self.env = env
        self.proc: subprocess.Popen | None = None
        self._stopping = False
        self._log_start = 0  # where this run's output begins in the (appended) log

    def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            log.write(f"---- {time.strftime('%Y-%m-%d %H:%M:%S')} starting: {' '.join(self.argv[2:])}\n".encode())
            log.flush()
            self._log_start = log.tell()  # after the header: its command line is not the child's output
            try:
                self.proc = subprocess.Popen(
                    self.argv,
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    env=self.env,
                    preexec_fn=_die_with_parent,
                )  # noqa: PLW1509 - see _PRCTL
            except OSError as exc:
                raise LaunchError(f"cannot start {self.argv[:4]}: {exc}") from exc
        threading.Thread(target=self._watch, name=f"ddiloco-watch-{self.proc.pid}", daemon=True).start()

    def _watch(self) -> None:
        code = self.proc.wait()
        if not self._stopping and self.on_exit is not None:
            self.on_exit(code)

    @property
    def returncode(self) -> int | None:
        return None if self.proc is None else self.proc.poll()

    def run_output(self, bytes_max: int) -> str:
        """The last `bytes_max` bytes this run wrote to its log, as text."""
        with open(self.log_path, "rb") as log:
            size = log.seek(0, os.SEEK_END)
            log.seek(max(self._log_start, size - bytes_max))
            return log.read().decode(errors="replace")

    def wait_for_line(self, pattern: str, timeout_s: float) -> re.Match:
        """The first match of `pattern` in a line this run wrote to its log; LaunchError if the child
        exits first or `timeout_s` passes (polls the file: the child writes it, not a pipe to us)."""
        regex = re.compile(pattern)
        deadline = time.monotonic() + timeout_s
        with open(self.log_path, "rb") as log:
            log.seek(self._log_start)
            pending = b""
            while True:
                chunk = log.readline(LOG_LINE_BYTES_MAX)
                if chunk:
                    pending += chunk
                    if not chunk.endswith(b"\n") and len(pending) < LOG_LINE_BYTES_MAX:
                        continue  # a line still being written
                    match = regex.search(pending.decode(errors="replace"))
                    pending = b""
                    if match:
                        return match
                    continue
                if self.returncode is not None:
                    raise LaunchError(
                        f"{' '.join(self.argv[2:4])} exited with {self.returncode} before it was ready; "
                        f"see {self.log_path}"
                    )
                if time.monotonic() > deadline:
                    raise LaunchError(f"{' '.join(self.argv[2:4])} not ready within {timeout_s} s; see {self.log_path}")
                time.sleep(0.1)  # nothing new in the file yet: poll it again

    def stop(self, timeout_s: float = STOP_S_MAX) -> int | None:
        """SIGTERM (the commands' clean stop), then SIGKILL after `timeout_s`; the exit code."""
        self._stopping = True
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode
