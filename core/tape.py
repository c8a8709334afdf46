"""The event tape: every input the syncer core acted on, in order, so that a run can be replayed.

docs/algorithm.md, "Event tape". A tape is a directory:

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
of the fragment's new values, of its published copy and of the broadcast delta's codec body) and at a clean end a "close" record with the final state hash.

Crash safety (net.recording, which writes and reads the files): records are appended and flushed
one by one; the file is fsynced every `fsync_every_records` records or `fsync_every_bytes` bytes and
at close. A payload is written (temp file, rename) before the record that names it. On reading, a
last record that is incomplete, or that ends exactly at the end of the file and fails its checksum,
is a torn tail: it is reported and cut. A bad record anywhere else is corruption, an error naming
its offset.

This module is the format only, pure like the rest of the core: records to bytes and bytes to
records, values to JSON and back. It touches no file: the payload store is a function passed in
(`encode_value`'s `store`, `Tape.stored`), and net.recording supplies the one on disk.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import struct
import typing
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

from ddiloco.core import checkpoint
from ddiloco.core import codec as codecs
from ddiloco.core import events as ev
from ddiloco.core.checksum import crc32
from ddiloco.core.layout import TensorSpec
from ddiloco.core.syncer import SyncerState, state_hash
from ddiloco.core.vclock import VClock
from ddiloco.errors import UserError

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


class TapeError(UserError, ValueError):
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


# ---- records to bytes ------------------------------------------------------------------------------

# Where a payload's bytes go when a record names them: called with the payload's parts, returns their
# sha256 (net.recording stores them in the tape's payload directory first).
PayloadStore = Callable[[list], str]


def preamble(magic: bytes) -> bytes:
    """The first bytes of a record file of kind `magic`."""
    return _PREAMBLE.pack(magic, FORMAT, 0)


def framed(record: dict, record_bytes_max: int = RECORD_BYTES_MAX) -> bytes:
    """One record as it goes into the file: frame header, then the JSON body."""
    body = orjson.dumps(record)
    if len(body) > record_bytes_max:
        raise TapeError(f"{record['type']} record of {len(body)} bytes is above record_bytes_max={record_bytes_max}")
    return _frame(body) + body


def encode_value(value: Any, store: PayloadStore) -> Any:
    """An event field as JSON: payloads by their sha256 (through `store`), tensor specs as lists."""
    if isinstance(value, codecs.Encoded):
        parts = payload_parts(value)
        ref = {
            "codec": value.codec.value,
            "block": value.block,
            "elements": value.elements,
            "bytes": sum(p.nbytes for p in parts),
        }
        ref["sha256"] = store(parts)
        return {"$payload": ref}
    if isinstance(value, TensorSpec):
        return {"$tensor": [value.path, list(value.shape), value.dtype, value.embedding]}
    if isinstance(value, (tuple, list)):
        return [encode_value(v, store) for v in value]
    if isinstance(value, dict):
        return {str(k): encode_value(v, store) for k, v in value.items()}
    if isinstance(value, float) and not math.isfinite(value):
        raise TapeError(f"cannot tape the non-finite value {value!r}")
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise TapeError(f"cannot tape a value of type {type(value).__name__}")


def header_record(state: SyncerState, source: str, keep_payloads: bool, store: PayloadStore) -> dict:
    """The first record of a syncer tape: the config and how the run starts (its initial checkpoint
    goes through `store`). `state` must not have handled events yet for this run."""
    start: dict[str, Any] = {"kind": "empty", "source": source}
    if state.holds_parameters:
        sha = store(checkpoint.to_chunks(state))
        start = {"kind": "checkpoint", "source": source, "sha256": sha, "state_hash": state_hash(state)}
    return {
        "type": "header",
        "format": FORMAT,
        "config": state.config.to_dict(),
        "start": start,
        "keep_payloads": keep_payloads,
    }


def event_record(index: int, event: ev.Event, now: float, clock: VClock, store: PayloadStore) -> dict:
    """The record of event number `index`, written before the core handles it."""
    kind = type(event).__name__
    assert EVENT_KINDS.get(kind) is type(event), f"{kind} is not an event of the core"
    if not math.isfinite(now):
        raise TapeError(f"event {index}: now={now!r} is not finite")
    fields = {f.name: encode_value(getattr(event, f.name), store) for f in dataclasses.fields(event)}
    return {"type": "event", "i": index, "now": now, "clock": clock.as_dict(), "kind": kind, "fields": fields}


def check_records(index: int, state: SyncerState, effects: Iterable[ev.Effect]) -> list[dict]:
    """After the core handled event `index`: one check record per merge it made."""
    return [merge_check(index, state, e.fragment) for e in effects if isinstance(e, ev.Merged)]


def close_record(events: int, state: SyncerState) -> dict:
    return {"type": "close", "events": events, "state_hash": state_hash(state)}


def merge_check(index: int, state: SyncerState, fragment: int) -> dict:
    """The check record of a merge of `fragment` while handling event `index`."""
    frag = state.fragments[fragment]
    digest = hashlib.sha256(memoryview(frag.theta)).hexdigest()
    record = {"type": "check", "i": index, "fragment": fragment, "version": frag.version, "sha256": digest}
    # what the learners reconstruct, and what went out to them (docs/protocol.md, "Delta broadcast")
    record["published"] = hashlib.sha256(memoryview(frag.published)).hexdigest()
    if frag.delta is not None:
        record["delta"] = hashlib.sha256(memoryview(frag.delta.body)).hexdigest()
    return record


def _frame(body: bytes) -> bytes:
    head = struct.pack("<II", len(body), crc32(body))
    return head + struct.pack("<I", crc32(head))


def payload_parts(enc: codecs.Encoded) -> list[memoryview]:
    """The payload's body in the codec's own order (scales, then codes), as `from_body` takes it: the
    bytes the push arrived in (`Encoded.body`), stored as they are."""
    return [enc.body]


def sha256_of(parts: Iterable) -> str:
    h = hashlib.sha256()
    for p in parts:
        h.update(p)
    return h.hexdigest()


# ---- bytes to records ------------------------------------------------------------------------------

# The payload store a tape was read with: (sha256, where, for messages) -> the stored bytes, checked
# against their name (net.recording.load_payload over the tape's payload directory).
StoredPayloads = Callable[[str, str], bytes]


@dataclass(frozen=True)
class Tape:
    directory: Path  # where it was read from (a name for messages: this module opens nothing)
    header: dict
    records: list  # event and check records, in order
    close: dict | None  # None when the run did not end cleanly
    torn: str | None  # what was cut from the tail, if anything
    good_bytes: int  # where the last intact record ends
    # Payload bodies by sha256 that take the place of the store (bytes a full replay regenerated).
    payloads: dict = dataclasses.field(default_factory=dict)
    stored: StoredPayloads | None = None  # the payload store; None: payloads only from `payloads`

    @property
    def events(self) -> list[dict]:
        return [r for r in self.records if r["type"] == "event"]

    def payload(self, sha: str, where: str) -> bytes:
        """The bytes named `sha`: regenerated ones first, then the store's."""
        body = self.payloads.get(sha)
        if body is not None:
            got = hashlib.sha256(body).hexdigest()
            if got != sha:
                raise PayloadMismatch(where, sha, got)
            return body
        if self.stored is None:
            raise TapeError(
                f"{where}: payload {str(sha)[:16]} is not at hand (this tape was read without its payload store)"
            )
        return self.stored(sha, where)


def tape_of(
    directory: Path, parsed: list[tuple[int, dict]], good: int, torn: str | None, stored: StoredPayloads | None = None
) -> Tape:
    """A syncer tape from the records of its file (`parse_records`), each checked for its shape."""
    where = Path(directory) / TAPE_FILE
    records = []
    for offset, record in parsed:
        _check_record(record, offset, sum(1 for r in records if r["type"] == "event"))
        records.append(record)
    if not records or records[0]["type"] != "header":
        raise TapeError(f"{where} has no header record" + (f" ({torn})" if torn else ""))
    header, rest = records[0], records[1:]
    close = rest.pop() if rest and rest[-1]["type"] == "close" else None
    if any(r["type"] in ("header", "close") for r in rest):
        raise TapeError(f"{where}: a header or close record in the middle of the tape")
    return Tape(Path(directory), header, rest, close, torn, good, stored=stored)


def parse_records(data: bytes, magic: bytes, where: str) -> tuple[list[tuple[int, dict]], int, str | None]:
    """(offset, JSON record) of every intact record of a record file's bytes, where they end, and the
    torn-tail note. `where` names the file in errors."""
    if len(data) > TAPE_BYTES_MAX:
        raise TapeError(f"{where} has {len(data)} bytes, above the limit of {TAPE_BYTES_MAX}")
    if len(data) < _PREAMBLE.size:
        raise TapeError(f"{where} is not a ddiloco tape: {len(data)} bytes, shorter than the preamble")
    found, fmt, reserved = _PREAMBLE.unpack_from(data, 0)
    if found != magic:
        raise TapeError(f"{where} is not a ddiloco tape of this kind (magic {found!r})")
    if fmt != FORMAT or reserved != 0:
        raise TapeError(f"{where} is tape format {fmt}; this version reads format {FORMAT}")
    bodies, good, torn = _frames(data, _PREAMBLE.size)
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
        raise TapeError(
            f"event record at offset {offset} has index {record['i']}, expected {events_before}: records are missing"
        )


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
            return (
                out,
                offset,
                f"torn tail at offset {offset}: record of {length} bytes, only {end - offset - _FRAME.size} present, cut",
            )
        body = data[offset + _FRAME.size : stop]
        if crc32(body) != body_crc:
            if stop == end:
                return out, offset, f"torn tail at offset {offset}: the last record fails its checksum, cut"
            raise TapeError(
                f"corrupt record at offset {offset} ({length} bytes): checksum mismatch in the middle of the tape"
            )
        out.append((offset, body))
        offset = stop
    return out, offset, None


def decode_event(tape: Tape, record: dict) -> tuple[ev.Event, float, dict]:
    """(event, now, syncer clock) of an event record, payloads read back from the store."""
    kind = record.get("kind")
    cls = EVENT_KINDS.get(kind)
    if cls is None:
        raise TapeError(
            f"event {record.get('i')}: kind {kind!r} is unknown to this version (known: {sorted(EVENT_KINDS)})"
        )
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
    if ref["sha256"] not in tape.payloads and not tape.header.get("keep_payloads", True):
        raise TapeError(
            f"{where}: this tape was recorded without payloads (hashes only); "
            "only `ddiloco replay --full` of a whole recorded demo can regenerate them"
        )
    body = tape.payload(ref["sha256"], where)  # regenerated ones come from re-executing the learners (demo.replay)
    if len(body) != ref["bytes"]:
        raise TapeError(
            f"{where}: stored payload {ref['sha256'][:16]} has {len(body)} bytes, the record says {ref['bytes']}"
        )
    try:
        return codecs.from_body(ref["codec"], ref["block"], ref["elements"], body)
    except codecs.CodecError as exc:
        raise TapeError(f"{where}: stored payload does not parse: {exc}") from exc
