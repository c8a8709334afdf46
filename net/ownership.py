"""One syncer per checkpoint directory: an exclusive lock held for the life of the process.

Two syncers writing checkpoints of one run into one directory would interleave their sequence numbers
and prune each other's files; a second syncer started by mistake (a restart while the old process
still runs) is refused instead. The lock is an advisory `flock` on `<dir>/.syncer.lock`: the kernel
releases it the moment its holder exits, however it exits (SIGKILL included), so nothing stale is
left behind to clean up, and a waiting process learns of the exit at once. That is what a hot
standby (`ddiloco syncer --standby`) waits on.

The lock file holds the holder's pid and host, for the message a refused syncer prints.
"""

from __future__ import annotations

import fcntl
import os
import socket
from pathlib import Path
from typing import Self

from ddiloco.errors import UserError
from ddiloco.net import files

__all__ = ["LOCK_NAME", "DirectoryHeld", "DirectoryLock"]

LOCK_NAME = ".syncer.lock"
HOLDER_BYTES_MAX = 256  # what is read of the lock file for the message


class DirectoryHeld(UserError, RuntimeError):
    """Another syncer holds the checkpoint directory."""


class DirectoryLock:
    """The exclusive lock of one checkpoint directory; `release` (or the process's exit) frees it."""

    def __init__(self, directory: Path, fd: int) -> None:
        self.directory = directory
        self._fd: int | None = fd

    @classmethod
    def acquire(cls, directory: Path | str, *, wait: bool = False) -> DirectoryLock:
        """Lock `directory` (created if missing). Without `wait`, raises DirectoryHeld at once when
        another process holds it; with `wait`, blocks until the holder exits."""
        directory = Path(directory)
        files.make_directory(directory, what="create checkpoint directory")
        path = directory / LOCK_NAME
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        except OSError as exc:
            raise files.FileError("open the lock file", path, exc) from exc
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
            _record_holder(fd)
        except BlockingIOError:
            holder = _holder(fd)
            os.close(fd)
            raise DirectoryHeld(
                f"another syncer ({holder}) holds {directory}: stop it first, use another directory, "
                "or start this one with --standby to take over when it exits"
            ) from None
        except OSError as exc:  # a full or read-only disk: said once, with the path, and no descriptor left open
            os.close(fd)
            raise files.FileError("lock the checkpoint directory", path, exc) from exc
        except BaseException:
            os.close(fd)
            raise
        return cls(directory, fd)

    @property
    def held(self) -> bool:
        return self._fd is not None

    def release(self) -> None:
        """Free the lock (idempotent). Closing the descriptor releases the flock."""
        if self._fd is not None:
            fd, self._fd = self._fd, None
            os.close(fd)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def _record_holder(fd: int) -> None:
    text = f"pid {os.getpid()} on {socket.gethostname()}\n".encode()
    os.ftruncate(fd, 0)
    os.pwrite(fd, text, 0)


def _holder(fd: int) -> str:
    try:
        text = os.pread(fd, HOLDER_BYTES_MAX, 0).decode("utf-8", "replace").strip()
    except OSError:
        text = ""
    return text or "holder unknown"
