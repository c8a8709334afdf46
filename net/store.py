"""Checkpoint files on disk: atomic writes, newest-valid resume, bounded retention.

A checkpoint is written to a temporary file in the same directory, fsynced, renamed into place
(atomic on POSIX) and the directory fsynced, so a crash leaves either the old set of checkpoints or
the new one, never a torn file under a final name. Names sort in the order the checkpoints were
written and carry the content hash: `ckpt-<merges:012d>-<seq:06d>-<sha256[:16]>.ddck`. The sequence
number breaks ties between checkpoints of the same merge count (learners leaving change the state
without a merge), so "newest" never depends on a hash.
"""

from __future__ import annotations

import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path

from ddiloco.core import checkpoint
from ddiloco.core.syncer import SyncerState
from ddiloco.errors import FaultError

log = logging.getLogger("ddiloco.syncer")

_NAME = re.compile(r"^ckpt-(\d{12})-(\d{6})-([0-9a-f]{16})\.ddck$")
SEQUENCE_MAX = 999_999  # six digits in the name (a million checkpoints without a merge between them)
CHECKPOINTS_KEPT_DEFAULT = 3


class StoreError(FaultError, RuntimeError):
    """A checkpoint could not be written or none could be read; the message says why."""

    what_to_do = "check that the checkpoint directory exists, is writable and its disk has room"


@dataclass(frozen=True)
class Written:
    path: Path
    bytes: int
    sha256: str


def write(directory: Path, state: SyncerState, keep: int = CHECKPOINTS_KEPT_DEFAULT) -> Written:
    """Write a checkpoint of `state` atomically; keep the newest `keep` checkpoints."""
    directory = Path(directory)
    chunks = checkpoint.to_chunks(state)
    sha = checkpoint.content_hash(chunks)
    final = directory / f"ckpt-{state.merges:012d}-{_next_sequence(directory, state.merges):06d}-{sha[:16]}.ddck"
    tmp = directory / f".{final.name}.tmp-{os.getpid()}"
    size = 0
    try:
        directory.mkdir(parents=True, exist_ok=True)
        with open(tmp, "wb") as fh:
            for c in chunks:
                fh.write(c)
                size += len(c) if isinstance(c, bytes) else c.nbytes
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, final)
        _fsync_dir(directory)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        # A full disk or a read-only directory loses this checkpoint, never an older one.
        raise StoreError(f"cannot write checkpoint {final}: {exc.strerror or exc}") from exc
    _prune(directory, keep)
    return Written(final, size, sha)


def newest_valid(directory: Path) -> tuple[SyncerState, Path]:
    """The state in the newest checkpoint of `directory` that reads back intact; corrupt ones are
    skipped with a warning. Raises StoreError when there is none."""
    directory = Path(directory)
    if not directory.is_dir():
        raise StoreError(f"checkpoint directory {directory} does not exist")
    for path in sorted(_checkpoints(directory), reverse=True):
        try:
            state = checkpoint.restore(path.read_bytes())
        except (checkpoint.CheckpointError, OSError, ValueError) as exc:
            log.warning("skipping checkpoint %s: %s", path.name, exc)
            continue
        return state, path
    raise StoreError(f"no valid checkpoint in {directory}")


def _checkpoints(directory: Path) -> list[Path]:
    if not directory.is_dir():
        return []
    return [p for p in directory.iterdir() if _NAME.match(p.name)]


def _next_sequence(directory: Path, merges: int) -> int:
    """One more than the newest checkpoint's sequence number when it has the same merge count."""
    newest = max(_checkpoints(directory), default=None, key=lambda p: p.name)
    if newest is None:
        return 1
    m = _NAME.match(newest.name)
    if int(m.group(1)) != merges:
        return 1
    return min(int(m.group(2)) + 1, SEQUENCE_MAX)


def _prune(directory: Path, keep: int) -> None:
    for old in sorted(_checkpoints(directory), reverse=True)[keep:]:
        old.unlink(missing_ok=True)


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
