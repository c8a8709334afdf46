"""Event tapes on disk: the writers and readers of the files whose format core.tape defines.

A tape is a directory: the record file (`tape.ddtp` for the syncer, `learner.ddtp` for a learner:
learner.tape) and `payloads/<sha256>`, the content-addressed payload store. The syncer's core thread
owns a `TapeWriter` (net.server); a learner's training thread owns its `LearnerTapeWriter`.

Durability: records are appended and flushed one by one; the file and the payloads written since are
fsynced every `fsync_every_records` records or `fsync_every_bytes` bytes and at close. A payload is
stored (net.files: temporary name, rename) before the record that names it; its fsync is batched
with the record file's, the cost of one fsync per push being too high on the syncer's core thread.
Every failure to write is a TapeError naming the path and the cause (net.files).
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any, BinaryIO

from ddiloco.core import events as ev
from ddiloco.core import tape as tapes
from ddiloco.core.syncer import SyncerState
from ddiloco.core.tape import (
    PAYLOAD_BYTES_MAX,
    PAYLOAD_DIR,
    TAPE_FILE,
    PayloadMismatch,
    TapeError,
    TapeOptions,
)
from ddiloco.core.vclock import VClock
from ddiloco.net import files

__all__ = ["RecordWriter", "TapeWriter", "load_payload", "open_record_file", "read", "read_record_file"]


class RecordWriter:
    """Framed JSON records appended to one new file, payloads in a content-addressed store beside
    it (the syncer's tape, and a learner's: `learner.tape`). Not thread-safe: one thread owns it."""

    def __init__(self, directory: Path, fh: BinaryIO, options: TapeOptions):
        self.directory = directory
        self.options = options
        self.events = 0
        self._fh = fh
        self._since_sync = (0, 0)  # records, bytes
        self._unsynced_payloads: list[Path] = []

    def abandon(self) -> None:
        """Close the file without a close record (the run did not end cleanly)."""
        if not self._fh.closed:
            try:
                self.sync()
            finally:
                self._fh.close()

    def sync(self) -> None:
        try:
            for path in self._unsynced_payloads:
                files.fsync_file(path)
            if self._unsynced_payloads:
                files.fsync_directory(self.directory / PAYLOAD_DIR)
            self._unsynced_payloads.clear()
            self._fh.flush()
            os.fsync(self._fh.fileno())
        except OSError as exc:
            raise TapeError(f"cannot sync tape {self.directory}: {files.describe(exc)}") from exc
        self._since_sync = (0, 0)

    def _value(self, value: Any) -> Any:
        """An event field as JSON, its payloads stored (or, with `keep_payloads` off, only hashed)."""
        return tapes.encode_value(value, self._payload_ref)

    def _payload_ref(self, parts: list) -> str:
        return self._store(parts) if self.options.keep_payloads else tapes.sha256_of(parts)

    def _store(self, parts: list) -> str:
        """Write `parts` into the payload store under their sha256 (before any record names it)."""
        sha = tapes.sha256_of(parts)
        final = self.directory / PAYLOAD_DIR / sha
        if final.exists():
            return sha
        size = sum(memoryview(p).nbytes for p in parts)
        if size > PAYLOAD_BYTES_MAX:
            raise TapeError(f"payload of {size} bytes is above the limit of {PAYLOAD_BYTES_MAX}")
        try:  # the temporary name carries the pid: writers in other processes may race to the same name
            files.write_atomic(final, parts, what=f"store payload {sha[:16]}", sync=False)
        except files.FileError as exc:
            raise TapeError(str(exc)) from exc
        self._unsynced_payloads.append(final)
        return sha

    def _append(self, record: dict) -> None:
        data = tapes.framed(record, self.options.record_bytes_max)
        try:
            self._fh.write(data)
            self._fh.flush()
        except OSError as exc:
            raise TapeError(f"cannot append to tape {self.directory}: {files.describe(exc)}") from exc
        records, nbytes = self._since_sync
        self._since_sync = (records + 1, nbytes + len(data))
        if (
            self._since_sync[0] >= self.options.fsync_every_records
            or self._since_sync[1] >= self.options.fsync_every_bytes
        ):
            self.sync()


class TapeWriter(RecordWriter):
    """Appends records to a new syncer tape. The syncer's core thread owns it."""

    @classmethod
    def create(
        cls, directory: Path | str, state: SyncerState, source: str = "", options: TapeOptions = TapeOptions()
    ) -> TapeWriter:
        """Start a tape for a syncer about to run from `state` (it must not have handled events yet
        for this run). `source` says where the state came from, for the header."""
        directory = Path(directory)
        writer = cls(directory, open_record_file(directory, TAPE_FILE, tapes.MAGIC), options)
        writer._append(tapes.header_record(state, source, options.keep_payloads, writer._store))
        writer.sync()
        return writer

    def event(self, event: ev.Event, now: float, clock: VClock) -> int:
        """Record one event before the core handles it; returns its index on the tape."""
        index = self.events
        self._append(tapes.event_record(index, event, now, clock, self._payload_ref))
        self.events += 1
        return index

    def checks(self, index: int, state: SyncerState, effects: Iterable[ev.Effect]) -> None:
        """After the core handled event `index`: one check record per merge it made."""
        for record in tapes.check_records(index, state, effects):
            self._append(record)

    def close(self, state: SyncerState) -> None:
        self._append(tapes.close_record(self.events, state))
        self.sync()
        self._fh.close()


def open_record_file(directory: Path, name: str, magic: bytes) -> BinaryIO:
    """A new record file `name` in `directory` (and its payload store), its preamble written."""
    path = directory / name
    try:
        files.make_directory(directory / PAYLOAD_DIR, what="create tape directory")
        fh = open(path, "xb")  # never append to or overwrite another run's tape
        fh.write(tapes.preamble(magic))
    except FileExistsError:
        raise TapeError(f"{path} exists already: a tape records one run, pick a new directory") from None
    except OSError as exc:
        raise TapeError(f"cannot create tape {path}: {files.describe(exc)}") from exc
    return fh


def read(directory: Path | str, *, cut: bool = False) -> tapes.Tape:
    """Read a syncer tape, its payloads from its store. A torn tail is reported in `torn` (and
    truncated from the file when `cut`); corruption anywhere else raises TapeError naming the offset."""
    directory = Path(directory)
    parsed, good, torn = read_record_file(directory / TAPE_FILE, tapes.MAGIC, cut=cut)
    return tapes.tape_of(directory, parsed, good, torn, stored=lambda sha, where: load_payload(directory, sha, where))


def read_record_file(path: Path, magic: bytes, *, cut: bool = False) -> tuple[list[tuple[int, dict]], int, str | None]:
    """(offset, JSON record) of every intact record of a file written by `RecordWriter`, where
    they end, and the torn-tail note (the tail truncated from the file when `cut`)."""
    try:
        size = path.stat().st_size
        if size > tapes.TAPE_BYTES_MAX:
            raise TapeError(f"{path} has {size} bytes, above the limit of {tapes.TAPE_BYTES_MAX}")
        data = path.read_bytes()
    except OSError as exc:
        raise TapeError(f"cannot read tape {path}: {files.describe(exc)}") from exc
    records, good, torn = tapes.parse_records(data, magic, str(path))
    if torn is not None and cut:
        try:
            with open(path, "r+b") as fh:
                fh.truncate(good)
                fh.flush()
                os.fsync(fh.fileno())
        except OSError as exc:
            raise TapeError(f"cannot cut the torn tail of {path}: {files.describe(exc)}") from exc
    return records, good, torn


def load_payload(directory: Path | str, sha: str, where: str = "tape") -> bytes:
    """The stored bytes named `sha`, checked against their name."""
    path = Path(directory) / PAYLOAD_DIR / str(sha)
    try:
        body = path.read_bytes()
    except FileNotFoundError:
        raise TapeError(
            f"{where}: payload {str(sha)[:16]} was not kept in {PAYLOAD_DIR}/ (recorded without payloads, or deleted)"
        ) from None
    except OSError as exc:
        raise TapeError(f"{where}: cannot read payload {str(sha)[:16]}: {files.describe(exc)}") from exc
    got = hashlib.sha256(body).hexdigest()
    if got != sha:
        raise PayloadMismatch(where, str(sha), got)
    return body
