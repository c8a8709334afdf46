"""Checkpoint files on disk: one run's checkpoints, written atomically, every failure surfaced.

A checkpoint is written through net.files (temporary file, fsync, rename, directory fsync), so a
crash leaves the old set of checkpoints or the new one, never a torn file under a final name.

Runs. Every checkpoint belongs to a run: a random id drawn when a syncer starts fresh and kept when
it resumes (`run_of(path)` of the checkpoint it resumed from). The id is in the file's name and in
its manifest (core.checkpoint). A directory that holds another run's checkpoints is refused to a
fresh run (`CheckpointStore.open` raises StoreError) unless the caller passes `overwrite`: then the
other runs' checkpoints are removed once this run's first checkpoint is durably written, not
before, so a crash in between loses nothing. Without this, a fresh syncer pointed at an old run's
directory would have its own checkpoints pruned at once by the old run's higher merge counts.

Names: `ckpt-<run>-<seq:09d>-<merges:012d>-<sha256[:16]>.safetensors`. `seq` counts the run's
writes in this directory (one more than the run's highest there), so within a run "newest" is "written
last", whatever the merge count or the hash. Pruning keeps the `keep` newest of this run and never
touches another run's checkpoint nor one newer than the checkpoint just written. Checkpoints named
the format-1 way (`ckpt-<merges:012d>-<seq:06d>-<sha>.ddck`, before runs) are read as the run
`LEGACY_RUN`, ordered by merges then sequence.

Health. `CheckpointStore.health` is a `Health` value: when the last checkpoint was written (the
injected clock's time), its name, merge count and fragment versions, and the last failure's text and
time with the number of failures since the last success. `Health.ok` is False while the latest attempt
failed; `Health.as_dict()` is JSON for the daemon's `/status` and `/healthz` (a failing store makes
the syncer unhealthy: its next crash would lose every merge since the last good checkpoint).
"""

from __future__ import annotations

import logging
import re
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

from ddiloco.core import checkpoint
from ddiloco.core.syncer import SyncerState
from ddiloco.errors import FaultError
from ddiloco.net import files

__all__ = [
    "CHECKPOINTS_KEPT_DEFAULT",
    "LEGACY_RUN",
    "NO_RUN",
    "CheckpointStore",
    "Health",
    "StoreError",
    "Written",
    "checkpoint_name",
    "new_run_id",
    "newest_valid",
    "run_of",
    "runs_in",
]

log = logging.getLogger("ddiloco.syncer")

RUN_HEX_CHARS = 16
NO_RUN = "0" * RUN_HEX_CHARS  # a checkpoint of no run (a snapshot's): resuming from it starts a new run
LEGACY_RUN = "legacy"  # checkpoints written before runs existed
SEQUENCE_MAX = 999_999_999  # nine digits in the name
CHECKPOINTS_KEPT_DEFAULT = 3
SUFFIX = ".safetensors"
_NAME = re.compile(rf"^ckpt-([0-9a-f]{{{RUN_HEX_CHARS}}})-(\d{{9}})-(\d{{12}})-([0-9a-f]{{16}})\.safetensors$")
_LEGACY_NAME = re.compile(r"^ckpt-(\d{12})-(\d{6})-([0-9a-f]{16})\.ddck$")


class StoreError(FaultError, RuntimeError):
    """A checkpoint could not be written, none could be read, or the directory belongs to another
    run; the message says why (a failed write's `__cause__` is the net.files.FileError, errno included)."""

    what_to_do = "check that the checkpoint directory exists, is writable and its disk has room"


@dataclass(frozen=True)
class Written:
    path: Path
    bytes: int
    sha256: str
    run: str
    seq: int


@dataclass(frozen=True)
class Health:
    """How checkpointing goes: a value, replaced after every attempt."""

    written_at: float | None = None  # the clock's time of the last checkpoint written
    written: str | None = None  # its file name
    merges: int | None = None
    versions: tuple[int, ...] = ()
    error: str | None = None  # the last failure's text (kept after a later success, for the record)
    error_at: float | None = None
    failures_since_written: int = 0

    @property
    def ok(self) -> bool:
        return self.failures_since_written == 0

    def as_dict(self) -> dict:
        return {
            "ok": self.ok,
            "written_at": self.written_at,
            "written": self.written,
            "merges": self.merges,
            "versions": list(self.versions),
            "error": self.error,
            "error_at": self.error_at,
            "failures_since_written": self.failures_since_written,
        }


@dataclass(frozen=True, order=True)
class _Found:
    """A checkpoint file in a directory; orders by run, then write order within the run."""

    run: str
    seq: int
    merges: int
    path: Path = field(compare=False)


def new_run_id(token_hex: Callable[[int], str] = secrets.token_hex) -> str:
    """A fresh run id (randomness injected: tests pass their own)."""
    run = token_hex(RUN_HEX_CHARS // 2)
    assert re.fullmatch(f"[0-9a-f]{{{RUN_HEX_CHARS}}}", run) and run != NO_RUN, f"bad run id {run!r}"
    return run


def checkpoint_name(run: str, seq: int, merges: int, sha256: str) -> str:
    if not 1 <= seq <= SEQUENCE_MAX:
        raise StoreError(f"checkpoint sequence {seq} is outside [1, {SEQUENCE_MAX}]: start a new run")
    return f"ckpt-{run}-{seq:09d}-{merges:012d}-{sha256[:16]}{SUFFIX}"


def run_of(path: Path | str) -> str | None:
    """The run a checkpoint file belongs to, from its name (None: not a checkpoint's name)."""
    found = _parse(Path(path))
    return None if found is None else found.run


def runs_in(directory: Path | str) -> dict[str, int]:
    """run id -> number of its checkpoints in `directory`."""
    out: dict[str, int] = {}
    for found in _found(Path(directory)):
        out[found.run] = out.get(found.run, 0) + 1
    return out


class CheckpointStore:
    """One run's checkpoints in one directory. Not thread-safe: the syncer's core thread owns it."""

    def __init__(self, directory: Path, run: str, *, keep: int, clock: Callable[[], float], overwrite: bool):
        if keep < 1:
            raise ValueError(f"keep must be at least 1, got {keep}")
        self.directory = Path(directory)
        self.run = run
        self.keep = keep
        self.clock = clock
        self.health = Health()
        self._overwrite_pending = overwrite  # other runs' checkpoints go once ours is durable

    @classmethod
    def open(
        cls,
        directory: Path | str,
        run: str | None = None,
        *,
        overwrite: bool = False,
        keep: int = CHECKPOINTS_KEPT_DEFAULT,
        clock: Callable[[], float] = time.time,
        new_id: Callable[[], str] = new_run_id,
    ) -> CheckpointStore:
        """The store of run `run` in `directory`: None for a fresh run (its id from `new_id`); the run
        of a resumed checkpoint otherwise. Resuming from NO_RUN or LEGACY_RUN (a snapshot's, or a
        checkpoint from before runs) starts a new run that adopts those files (it never removes them).
        Raises StoreError when the directory holds checkpoints of other runs and none of this run,
        unless `overwrite`."""
        directory = Path(directory)
        adopted = run if run in (NO_RUN, LEGACY_RUN) else None
        if run is None or adopted:
            run = new_id()
        try:
            runs = runs_in(directory)
        except OSError as exc:
            raise StoreError(str(exc)) from exc
        others = {r: n for r, n in runs.items() if r not in (run, adopted)}
        if others and run not in runs and not overwrite:
            listing = ", ".join(f"run {r} ({n} checkpoint{'s' if n != 1 else ''})" for r, n in sorted(others.items()))
            raise StoreError(
                f"{directory} holds checkpoints of another run: {listing}. Resume that run (--resume {directory}), "
                "pick another directory, or pass --overwrite to start a new run there (the other run's "
                "checkpoints are deleted once this run's first checkpoint is written)"
            )
        return cls(directory, run, keep=keep, clock=clock, overwrite=overwrite and bool(others))

    def write(self, state: SyncerState) -> Written:
        """Write a checkpoint of `state`; then prune. Raises StoreError (and records it in `health`)
        when it is not written; a failed prune is only logged: the checkpoint is safe."""
        now = self.clock()
        try:
            written = self._write(state)
        except (OSError, StoreError) as exc:
            text = f"checkpoint not written: {exc}"
            self.health = replace(
                self.health, error=text, error_at=now, failures_since_written=self.health.failures_since_written + 1
            )
            raise StoreError(text) from exc
        self.health = replace(
            self.health,
            written_at=now,
            written=written.path.name,
            merges=state.merges,
            versions=tuple(f.version for f in state.fragments),
            failures_since_written=0,
        )
        try:
            self._prune(written)
        except OSError as exc:
            log.warning("checkpoint %s written, but older ones were not pruned: %s", written.path.name, exc)
        return written

    def _write(self, state: SyncerState) -> Written:
        chunks = checkpoint.to_chunks(state, run=self.run)
        sha = checkpoint.content_hash(chunks)
        files.make_directory(self.directory, what="create checkpoint directory")
        seq = 1 + max((f.seq for f in _found(self.directory) if f.run == self.run), default=0)
        final = self.directory / checkpoint_name(self.run, seq, state.merges, sha)
        size = files.write_atomic(final, chunks, what="write checkpoint")
        return Written(final, size, sha, self.run, seq)

    def _prune(self, written: Written) -> None:
        found = _found(self.directory)
        # Only this run's, and only older than what was just written (a newer one can exist only if
        # another process writes as this run: never delete what it wrote).
        older = sorted((f for f in found if f.run == self.run and f.seq < written.seq), reverse=True)
        for old in older[self.keep - 1 :]:
            files.remove(old.path, what="prune checkpoint")
        if self._overwrite_pending:
            for other in (f for f in found if f.run != self.run):
                files.remove(other.path, what="remove the overwritten run's checkpoint")
                log.info("removed %s of the overwritten run %s", other.path.name, other.run)
            self._overwrite_pending = False


def newest_valid(directory: Path | str) -> tuple[SyncerState, Path]:
    """The state in the newest checkpoint of `directory` that reads back intact, and its path
    (`run_of(path)` is the run to continue). Corrupt ones are skipped with a warning. Newest: of the
    run written to last (file times decide between runs, write order within one). Never falls back
    to another run's checkpoint: raises StoreError when the newest run has none intact."""
    directory = Path(directory)
    if not directory.is_dir():
        raise StoreError(f"checkpoint directory {directory} does not exist")
    try:
        found = _found(directory)
    except OSError as exc:
        raise StoreError(str(exc)) from exc
    if not found:
        raise StoreError(f"no checkpoint in {directory}")
    run = max(found, key=lambda f: (_mtime(f.path), f.run != LEGACY_RUN, f.seq)).run
    for f in sorted((f for f in found if f.run == run), reverse=True):
        try:
            state = checkpoint.restore(f.path.read_bytes())
        except (checkpoint.CheckpointError, OSError) as exc:
            log.warning("skipping checkpoint %s: %s", f.path.name, exc)
            continue
        return state, f.path
    others = sorted({f.run for f in found} - {run})
    raise StoreError(
        f"no valid checkpoint of run {run} in {directory}"
        + (f" (not falling back to another run's: {', '.join(others)})" if others else "")
    )


def _parse(path: Path) -> _Found | None:
    m = _NAME.match(path.name)
    if m:
        return _Found(m.group(1), int(m.group(2)), int(m.group(3)), path)
    m = _LEGACY_NAME.match(path.name)
    if m:  # ordered by merges, then sequence: one number that sorts the same way
        return _Found(LEGACY_RUN, int(m.group(1)) * 1_000_000 + int(m.group(2)), int(m.group(1)), path)
    return None


def _found(directory: Path) -> list[_Found]:
    """The checkpoints in `directory` (none when it does not exist); a FileError when it cannot be listed."""
    try:
        return [f for f in map(_parse, directory.iterdir()) if f is not None]
    except (FileNotFoundError, NotADirectoryError):
        return []
    except OSError as exc:
        raise files.FileError("list checkpoint directory", directory, exc) from exc


def _mtime(path: Path) -> int:
    try:
        return path.stat().st_mtime_ns
    except OSError:
        return -1
