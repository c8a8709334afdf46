"""The event tape: every input the syncer core acted on, in order, so that a run can be replayed.

ALGORITHM.md, "Event tape". A tape is a directory:

    tape.ddtp          the append-only tape file (layout below)
    payloads/<sha256>  content-addressed payload store: the raw body of each push or init payload,
                       and the initial checkpoint, named by the sha256 of their bytes

The tape file (little-endian) is an 16-byte preamble, `MAGIC` (8 bytes), the format version (u32),
4 zero bytes, then records. Each record is a 12-byte frame header then its body:

    0   4  body length L (at most RECORD_BYTES_MAX)
    4   4  crc32 of the body
    8   4  crc32 of bytes 0..8 (so a damaged length is never mistaken for a torn tail)
    12  L  body: one JSON object (orjson), its "type" one of header | event | check | close

The first record is the header (the resolved syncer config and how the run started: "empty", or
"checkpoint" naming the initial checkpoint in the payload store and its state hash). Then one
"event" record per event the core handled (its index, `now`, the syncer's vector clock, the event's
kind and fields, payloads by sha256), a "check" record after each merge (fragment, version, sha256
of the fragment's new values) and at a clean end a "close" record with the final state hash.

Crash safety: records are appended and flushed one by one; the file is fsynced every
`fsync_every_records` records or `fsync_every_bytes` bytes and at close. A payload is written (temp
file, rename) before the record that names it. On reading, a last record that is incomplete, or that
ends exactly at the end of the file and fails its checksum, is a torn tail: it is reported and cut.
A bad record anywhere else is corruption, an error naming its offset.

This module does file I/O (a tape is files) but reads no clock and no randomness.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import os
import struct
import typing
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import orjson
from ddiloco.core import checkpoint
from ddiloco.core import codec as codecs
from ddiloco.core import events as ev
from ddiloco.core.checksum import crc32
from ddiloco.core.layout import TensorSpec
from ddiloco.core.syncer import SyncerState, state_hash
from ddiloco.core.vclock import VClock

MAGIC = b"DDTAPE\x00\x01"
FORMAT = 1
TAPE_FILE = "tape.ddtp"
PAYLOAD_DIR = "payloads"
_PREAMBLE = struct.Struct("<8sII")
_FRAME = struct.Struct("<III")
RECORD_BYTES_MAX = 32 << 20  # one record's JSON body: a join's tensor list (8 MiB on the wire) about doubles when taped
PAYLOAD_BYTES_MAX = 1 << 34  # one stored payload (an fp32 fragment of 2^31 values is 8 GiB)
TAPE_BYTES_MAX = 1 << 32  # the tape file a reader takes in (payloads live beside it)
FSYNC_EVERY_RECORDS_DEFAULT = 256
FSYNC_EVERY_BYTES_DEFAULT = 16 << 20

# Every event kind the core knows, by class name (picked up from the union, so a new kind is taped
# as soon as the core handles it).
EVENT_KINDS: dict[str, type] = {cls.__name__: cls for cls in typing.get_args(ev.Event)}


class TapeError(ValueError):
    """A tape that cannot be written or read (corrupt, foreign, missing payload); says which and where."""


class PayloadMismatch(TapeError):
    """A stored payload whose bytes no longer hash to the name the tape gives them."""

    def __init__(self, where: str, expected: str, got: str):
        super().__init__(f"{where}: stored payload {expected[:16]} now hashes to {got[:16]} (tampered or damaged)")
        self.expected, self.got = expected, got


@dataclass(frozen=True)
class TapeOptions:
    keep_payloads: bool = True  # False: payloads are named by hash only and the tape cannot be replayed
    fsync_every_records: int = FSYNC_EVERY_RECORDS_DEFAULT
    fsync_every_bytes: int = FSYNC_EVERY_BYTES_DEFAULT
    record_bytes_max: int = RECORD_BYTES_MAX

    def __post_init__(self) -> None:
        if self.fsync_every_records < 1 or self.fsync_every_bytes < 1:
            raise ValueError("fsync_every_records and fsync_every_bytes must be positive")
        if not 1024 <= self.record_bytes_max <= RECORD_BYTES_MAX:
            raise ValueError(f"record_bytes_max must be in [1024, {RECORD_BYTES_MAX}], got {self.record_bytes_max}")


# ---- writing ----------------------------------------------------------------------------------------


class RecordWriter:
    """Framed JSON records appended to one new file, payloads in a content-addressed store beside
    it (the syncer's tape, and a learner's: `learner.tape`). Not thread-safe: one thread owns it."""

    def __init__(self, directory: Path, fh, options: TapeOptions):
        self.directory = directory
        self.options = options
        self.events = 0
        self._fh = fh
        self._since_sync = (0, 0)  # records, bytes
        self._unsynced_payloads: list[Path] = []

    def abandon(self) -> None:
        """Close the file without a close record (the run did not end cleanly)."""
        if not self._fh.closed:
            self.sync()
            self._fh.close()

    def sync(self) -> None:
        for path in self._unsynced_payloads:
            _fsync_path(path)
        self._unsynced_payloads.clear()
        self._fh.flush()
        os.fsync(self._fh.fileno())
        self._since_sync = (0, 0)

    def _value(self, value: Any) -> Any:
        if isinstance(value, codecs.Encoded):
            parts = payload_parts(value)
            ref = {"codec": value.codec.value, "block": value.block, "elements": value.elements,
                   "bytes": sum(p.nbytes for p in parts)}
            ref["sha256"] = self._store(parts) if self.options.keep_payloads else _sha256(parts)
            return {"$payload": ref}
        if isinstance(value, TensorSpec):
            return {"$tensor": [value.path, list(value.shape), value.dtype, value.embedding]}
        if isinstance(value, (tuple, list)):
            return [self._value(v) for v in value]
        if isinstance(value, dict):
            return {str(k): self._value(v) for k, v in value.items()}
        if isinstance(value, float) and not math.isfinite(value):
            raise TapeError(f"cannot tape the non-finite value {value!r}")
        if value is None or isinstance(value, (bool, int, float, str)):
            return value
        raise TapeError(f"cannot tape a value of type {type(value).__name__}")

    def _store(self, parts: list) -> str:
        """Write `parts` into the payload store under their sha256 (before any record names it)."""
        sha = _sha256(parts)
        final = self.directory / PAYLOAD_DIR / sha
        if final.exists():
            return sha
        size = sum(memoryview(p).nbytes for p in parts)
        if size > PAYLOAD_BYTES_MAX:
            raise TapeError(f"payload of {size} bytes is above the limit of {PAYLOAD_BYTES_MAX}")
        tmp = final.with_name(f".{sha}.{os.getpid()}.tmp")  # writers in other processes may race
        try:
            with open(tmp, "wb") as fh:
                fh.writelines(parts)
            os.replace(tmp, final)
        except OSError as exc:
            tmp.unlink(missing_ok=True)
            raise TapeError(f"cannot store payload {sha[:16]}: {exc.strerror or exc}") from exc
        self._unsynced_payloads.append(final)
        return sha

    def _append(self, record: dict) -> None:
        body = orjson.dumps(record)
        if len(body) > self.options.record_bytes_max:
            raise TapeError(f"{record['type']} record of {len(body)} bytes is above record_bytes_max={self.options.record_bytes_max}")
        self._fh.write(_frame(body))
        self._fh.write(body)
        self._fh.flush()
        records, nbytes = self._since_sync
        self._since_sync = (records + 1, nbytes + _FRAME.size + len(body))
        if self._since_sync[0] >= self.options.fsync_every_records or self._since_sync[1] >= self.options.fsync_every_bytes:
            self.sync()


class TapeWriter(RecordWriter):
    """Appends records to a new syncer tape. The syncer's core thread owns it."""

    @classmethod
    def create(cls, directory: Path | str, state: SyncerState, source: str = "", options: TapeOptions = TapeOptions()) -> TapeWriter:
        """Start a tape for a syncer about to run from `state` (it must not have handled events yet
        for this run). `source` says where the state came from, for the header."""
        directory = Path(directory)
        writer = cls(directory, open_record_file(directory, TAPE_FILE, MAGIC), options)
        start: dict[str, Any] = {"kind": "empty", "source": source}
        if state.holds_parameters:
            chunks = checkpoint.to_chunks(state)
            sha = writer._store(chunks)
            start = {"kind": "checkpoint", "source": source, "sha256": sha, "state_hash": state_hash(state)}
        writer._append({"type": "header", "format": FORMAT, "config": state.config.to_dict(), "start": start,
                        "keep_payloads": options.keep_payloads})
        writer.sync()
        return writer

    def event(self, event: ev.Event, now: float, clock: VClock) -> int:
        """Record one event before the core handles it; returns its index on the tape."""
        kind = type(event).__name__
        assert EVENT_KINDS.get(kind) is type(event), f"{kind} is not an event of the core"
        if not math.isfinite(now):
            raise TapeError(f"event {self.events}: now={now!r} is not finite")
        fields = {f.name: self._value(getattr(event, f.name)) for f in dataclasses.fields(event)}
        index = self.events
        self._append({"type": "event", "i": index, "now": now, "clock": clock.as_dict(), "kind": kind, "fields": fields})
        self.events += 1
        return index

    def checks(self, index: int, state: SyncerState, effects: Iterable[ev.Effect]) -> None:
        """After the core handled event `index`: one check record per merge it made."""
        for effect in effects:
            if isinstance(effect, ev.Merged):
                self._append(merge_check(index, state, effect.fragment))

    def close(self, state: SyncerState) -> None:
        self._append({"type": "close", "events": self.events, "state_hash": state_hash(state)})
        self.sync()
        self._fh.close()


def open_record_file(directory: Path, name: str, magic: bytes) -> Any:
    """A new record file `name` in `directory` (and its payload store), its preamble written."""
    path = directory / name
    try:
        (directory / PAYLOAD_DIR).mkdir(parents=True, exist_ok=True)
        fh = open(path, "xb")  # never append to or overwrite another run's tape
    except FileExistsError:
        raise TapeError(f"{path} exists already: a tape records one run, pick a new directory") from None
    except OSError as exc:
        raise TapeError(f"cannot create tape {path}: {exc.strerror or exc}") from exc
    fh.write(_PREAMBLE.pack(magic, FORMAT, 0))
    return fh


def merge_check(index: int, state: SyncerState, fragment: int) -> dict:
    """The check record of a merge of `fragment` while handling event `index`."""
    frag = state.fragments[fragment]
    digest = hashlib.sha256(memoryview(frag.theta)).hexdigest()
    return {"type": "check", "i": index, "fragment": fragment, "version": frag.version, "sha256": digest}


def _frame(body: bytes) -> bytes:
    head = struct.pack("<II", len(body), crc32(body))
    return head + struct.pack("<I", crc32(head))


def payload_parts(enc: codecs.Encoded) -> list[memoryview]:
    """The payload's body in the codec's own order (scales, then codes), as `from_body` takes it."""
    parts = [] if enc.scales is None else [memoryview(np.ascontiguousarray(enc.scales)).cast("B")]
    return parts + [memoryview(np.ascontiguousarray(enc.data)).cast("B")]


def _sha256(parts: Iterable) -> str:
    h = hashlib.sha256()
    for p in parts:
        h.update(p)
    return h.hexdigest()


def _fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# ---- reading ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Tape:
    directory: Path
    header: dict
    records: list  # event and check records, in order
    close: dict | None  # None when the run did not end cleanly
    torn: str | None  # what was cut from the tail, if anything
    good_bytes: int  # where the last intact record ends
    # Payload bodies by sha256 that take the place of the store (bytes a full replay regenerated).
    payloads: dict = dataclasses.field(default_factory=dict)

    @property
    def events(self) -> list[dict]:
        return [r for r in self.records if r["type"] == "event"]


def read(directory: Path | str, *, cut: bool = False) -> Tape:
    """Read a tape. A torn tail is reported in `torn` (and truncated from the file when `cut`);
    corruption anywhere else raises TapeError naming the offset."""
    directory = Path(directory)
    path = directory / TAPE_FILE
    bodies, good, torn = read_record_file(path, MAGIC, cut=cut)
    records = []
    for offset, record in bodies:
        _check_record(record, offset, sum(1 for r in records if r["type"] == "event"))
        records.append(record)
    if not records or records[0]["type"] != "header":
        raise TapeError(f"{path} has no header record" + (f" ({torn})" if torn else ""))
    header, rest = records[0], records[1:]
    close = rest.pop() if rest and rest[-1]["type"] == "close" else None
    if any(r["type"] in ("header", "close") for r in rest):
        raise TapeError(f"{path}: a header or close record in the middle of the tape")
    return Tape(directory, header, rest, close, torn, good)


def read_record_file(path: Path, magic: bytes, *, cut: bool = False) -> tuple[list[tuple[int, dict]], int, str | None]:
    """(offset, JSON record) of every intact record of a file written by `RecordWriter`, where
    they end, and the torn-tail note (the tail truncated from the file when `cut`)."""
    try:
        size = path.stat().st_size
        if size > TAPE_BYTES_MAX:
            raise TapeError(f"{path} has {size} bytes, above the limit of {TAPE_BYTES_MAX}")
        data = path.read_bytes()
    except OSError as exc:
        raise TapeError(f"cannot read tape {path}: {exc.strerror or exc}") from exc
    if len(data) < _PREAMBLE.size:
        raise TapeError(f"{path} is not a ddiloco tape: {len(data)} bytes, shorter than the preamble")
    found, fmt, reserved = _PREAMBLE.unpack_from(data, 0)
    if found != magic:
        raise TapeError(f"{path} is not a ddiloco tape of this kind (magic {found!r})")
    if fmt != FORMAT or reserved != 0:
        raise TapeError(f"{path} is tape format {fmt}; this version reads format {FORMAT}")
    bodies, good, torn = _frames(data, _PREAMBLE.size)
    if torn is not None and cut:
        with open(path, "r+b") as fh:
            fh.truncate(good)
            fh.flush()
            os.fsync(fh.fileno())
    records = []
    for offset, body in bodies:
        try:
            record = orjson.loads(body)
        except orjson.JSONDecodeError as exc:
            raise TapeError(f"record at offset {offset} passes its checksum but is not JSON: {exc}") from exc
        if not isinstance(record, dict):
            raise TapeError(f"record at offset {offset} is not a JSON object")
        records.append((offset, record))
    return records, good, torn


# The keys each record type must have, and their JSON types.
_REQUIRED = {
    "header": {"format": int, "config": dict, "start": dict},
    "event": {"i": int, "now": (int, float), "clock": dict, "kind": str, "fields": dict},
    "check": {"i": int, "fragment": int, "version": int, "sha256": str},
    "close": {"events": int, "state_hash": str},
}


def _check_record(record: Any, offset: int, events_before: int) -> None:
    """A record that passed its checksum but does not have the shape its type needs is corruption
    by a writer, not by the disk: refuse it by offset rather than fail later on a missing key."""
    kind = record.get("type") if isinstance(record, dict) else None
    if kind not in _REQUIRED:
        raise TapeError(f"record at offset {offset} has no known type")
    for key, types in _REQUIRED[kind].items():
        if not isinstance(record.get(key), types) or isinstance(record.get(key), bool):
            raise TapeError(f"{kind} record at offset {offset}: field {key!r} is missing or of the wrong type")
    if kind == "header" and not isinstance(record["start"].get("kind"), str):
        raise TapeError(f"header at offset {offset}: start has no kind")
    if kind == "event" and record["i"] != events_before:
        raise TapeError(f"event record at offset {offset} has index {record['i']}, expected {events_before}: records are missing")


def _frames(data: bytes, offset: int) -> tuple[list[tuple[int, bytes]], int, str | None]:
    """(offset, body) of every intact record from `offset`, where they end, and a torn-tail note."""
    out = []
    end = len(data)
    while offset < end:
        if end - offset < _FRAME.size:
            return out, offset, f"torn tail at offset {offset}: {end - offset} bytes of a record header, cut"
        length, body_crc, head_crc = _FRAME.unpack_from(data, offset)
        if crc32(data[offset : offset + 8]) != head_crc:
            raise TapeError(f"corrupt record header at offset {offset} (checksum mismatch)")
        if length > RECORD_BYTES_MAX:
            raise TapeError(f"record at offset {offset} claims {length} bytes, above the limit of {RECORD_BYTES_MAX}")
        stop = offset + _FRAME.size + length
        if stop > end:
            return out, offset, f"torn tail at offset {offset}: record of {length} bytes, only {end - offset - _FRAME.size} present, cut"
        body = data[offset + _FRAME.size : stop]
        if crc32(body) != body_crc:
            if stop == end:
                return out, offset, f"torn tail at offset {offset}: the last record fails its checksum, cut"
            raise TapeError(f"corrupt record at offset {offset} ({length} bytes): checksum mismatch in the middle of the tape")
        out.append((offset, body))
        offset = stop
    return out, offset, None


def decode_event(tape: Tape, record: dict) -> tuple[ev.Event, float, dict]:
    """(event, now, syncer clock) of an event record, payloads read back from the store."""
    kind = record.get("kind")
    cls = EVENT_KINDS.get(kind)
    if cls is None:
        raise TapeError(f"event {record.get('i')}: kind {kind!r} is unknown to this version (known: {sorted(EVENT_KINDS)})")
    fields = record["fields"]
    try:
        values = {f.name: _decoded(tape, record, fields[f.name]) for f in dataclasses.fields(cls) if f.name in fields}
        return cls(**values), float(record["now"]), dict(record.get("clock", {}))
    except (TypeError, KeyError, ValueError) as exc:
        if isinstance(exc, TapeError):
            raise
        raise TapeError(f"event {record.get('i')} ({kind}) does not decode: {exc}") from exc


def _decoded(tape: Tape, record: dict, value: Any) -> Any:
    if isinstance(value, list):
        return tuple(_decoded(tape, record, v) for v in value)
    if isinstance(value, dict):
        if "$payload" in value:
            return _payload(tape, record, value["$payload"])
        if "$tensor" in value:
            path, shape, dtype, embedding = value["$tensor"]
            return TensorSpec(path, tuple(shape), dtype, embedding)
        return {k: _decoded(tape, record, v) for k, v in value.items()}
    return value


def _payload(tape: Tape, record: dict, ref: dict) -> codecs.Encoded:
    where = f"event {record.get('i')} ({record.get('kind')})"
    body = tape.payloads.get(ref["sha256"])  # regenerated by re-executing the learners (demo.replay)
    if body is not None:
        got = hashlib.sha256(body).hexdigest()
        if got != ref["sha256"]:
            raise PayloadMismatch(where, ref["sha256"], got)
    elif not tape.header.get("keep_payloads", True):
        raise TapeError(f"{where}: this tape was recorded without payloads (hashes only); "
                        "only `ddiloco replay --full` of a whole recorded demo can regenerate them")
    else:
        body = load_payload(tape.directory, ref["sha256"], where)
    if len(body) != ref["bytes"]:
        raise TapeError(f"{where}: stored payload {ref['sha256'][:16]} has {len(body)} bytes, the record says {ref['bytes']}")
    try:
        return codecs.from_body(ref["codec"], ref["block"], ref["elements"], body)
    except codecs.CodecError as exc:
        raise TapeError(f"{where}: stored payload does not parse: {exc}") from exc


def load_payload(directory: Path, sha: str, where: str = "tape") -> bytes:
    """The stored bytes named `sha`, checked against their name."""
    path = Path(directory) / PAYLOAD_DIR / str(sha)
    try:
        body = path.read_bytes()
    except FileNotFoundError:
        raise TapeError(f"{where}: payload {str(sha)[:16]} was not kept in {PAYLOAD_DIR}/ (recorded without payloads, or deleted)") from None
    except OSError as exc:
        raise TapeError(f"{where}: cannot read payload {str(sha)[:16]}: {exc.strerror or exc}") from exc
    got = hashlib.sha256(body).hexdigest()
    if got != sha:
        raise PayloadMismatch(where, str(sha), got)
    return body
