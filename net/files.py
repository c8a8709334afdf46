"""Durable files: the one way the syncer side writes a file that has to survive a crash.

`write_atomic(path, parts)` writes a temporary file in the same directory (a rename is atomic only
within one file system), fsyncs it, renames it over `path` and fsyncs the directory, so that the
rename itself survives a power cut. A crash at any point leaves the old file or the new one under
`path`, never a torn one. On a failure the temporary file is removed; when that cleanup fails too
(a file system gone read-only refuses the unlink as well), the original error is the one raised and
the cleanup's failure is only added to its text: it must never mask what went wrong first.

Every `OSError` is translated here, once, into `FileError`: an `OSError` (so `except OSError` still
catches it) whose text names the path, what was being done and the cause in words ("disk full",
"read-only file system", "permission denied"), with the errno's name for searching.

The checkpoint store (net.store), the snapshots (net.snapshot) and the event tapes (net.recording)
all write through this module.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Iterable
from pathlib import Path

from ddiloco.errors import FaultError

__all__ = [
    "FileError",
    "cause",
    "describe",
    "fsync_directory",
    "fsync_file",
    "make_directory",
    "remove",
    "temporary_name",
    "write_atomic",
]

# The causes an operator meets in practice, in the words a log line should use.
_CAUSES = {
    errno.ENOSPC: "disk full",
    errno.EDQUOT: "disk quota exceeded",
    errno.EROFS: "read-only file system",
    errno.EACCES: "permission denied",
    errno.EPERM: "operation not permitted",
    errno.ENOENT: "no such file or directory",
    errno.ENOTDIR: "a component of the path is not a directory",
    errno.EISDIR: "is a directory",
    errno.EIO: "input/output error (a failing disk?)",
    errno.EMFILE: "too many open files",
    errno.ENAMETOOLONG: "file name too long",
}
TEMPORARY_MARK = ".tmp-"  # in every temporary file's name: `.<name>.tmp-<pid>`


class FileError(FaultError, OSError):
    """A file operation that failed; `str()` says what, on which path, and why in words."""

    def __init__(self, action: str, path: Path | str, exc: OSError, note: str = ""):
        super().__init__(exc.errno, cause(exc), str(path))
        self.action = action
        self.path = Path(path)
        self.note = note

    def __str__(self) -> str:
        return f"cannot {self.action} {self.path}: {self.strerror}" + (f"; {self.note}" if self.note else "")

    def __reduce__(self):  # picklable (crosses process pools) with its own constructor's arguments
        return (_rebuild, (self.action, str(self.path), self.errno, self.strerror, self.note))


def _rebuild(action: str, path: str, code: int | None, text: str, note: str) -> FileError:
    return FileError(action, path, OSError(code, text), note)


def cause(exc: OSError) -> str:
    """The cause of `exc` in words, with the errno's name: "disk full (ENOSPC)"."""
    if isinstance(exc, FileError):
        return exc.strerror
    words = _CAUSES.get(exc.errno) or exc.strerror or str(exc) or type(exc).__name__
    name = errno.errorcode.get(exc.errno) if exc.errno is not None else None
    return f"{words} ({name})" if name else words


def describe(exc: OSError) -> str:
    """What went wrong, in words: a FileError's whole text (path and cause), another OSError's cause."""
    return str(exc) if isinstance(exc, FileError) else cause(exc)


def temporary_name(path: Path) -> Path:
    """Where `write_atomic` writes before the rename: beside `path`, hidden, one per process."""
    return path.with_name(f".{path.name}{TEMPORARY_MARK}{os.getpid()}")


def write_atomic(
    path: Path | str, parts: Iterable[bytes | bytearray | memoryview], *, what: str = "write", sync: bool = True
) -> int:
    """Write the concatenation of `parts` to `path` atomically and durably; returns the bytes written.
    `sync=False` leaves out both fsyncs, for a caller that batches them (`fsync_file`, then
    `fsync_directory`): the rename is still atomic, only not yet durable.

    Raises FileError (naming `path`, `what` was being done and the cause); the temporary file is gone
    then, unless removing it failed as well, which the error's text says."""
    path = Path(path)
    tmp = temporary_name(path)
    size = 0
    try:
        with open(tmp, "wb") as fh:
            for part in parts:
                size += fh.write(part)
            fh.flush()
            if sync:
                os.fsync(fh.fileno())
        os.replace(tmp, path)
    except OSError as exc:
        raise FileError(what, path, exc, _remove_after_failure(tmp)) from exc
    if not sync:
        return size
    try:
        fsync_directory(path.parent)
    except OSError as exc:  # renamed, but the rename itself may not survive a power cut
        raise FileError(f"{what} (make the rename durable)", path, exc) from exc
    return size


def _remove_after_failure(tmp: Path) -> str:
    """Remove a temporary file after a failed write; returns a note when that fails too (never raises:
    the write's own error is the one to report)."""
    try:
        if os.path.lexists(tmp):  # never created (a read-only directory refuses the open): nothing to clean
            os.unlink(tmp)
    except OSError as exc:
        return f"the temporary file {tmp.name} could not be removed either ({cause(exc)})"
    return ""


def make_directory(directory: Path | str, *, what: str = "create directory") -> None:
    """`mkdir -p`, its failure a FileError."""
    try:
        os.makedirs(directory, exist_ok=True)
    except OSError as exc:
        raise FileError(what, directory, exc) from exc


def remove(path: Path | str, *, what: str = "remove") -> bool:
    """Remove a file; False when it was gone already, a FileError when it cannot be removed."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        return False
    except OSError as exc:
        raise FileError(what, path, exc) from exc
    return True


def fsync_directory(directory: Path | str) -> None:
    """Make the names in `directory` (a rename, a new file) durable."""
    fd = os.open(directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_file(path: Path | str) -> None:
    """Make the contents of a file written elsewhere durable (opened read-only: fsync needs no write)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
