"""The tape's format, pure: records to bytes and back, payloads through a store passed in, no file."""

import hashlib

import numpy as np
import pytest

from ddiloco.core import codec, syncer
from ddiloco.core import tape as tapes
from ddiloco.core.config import SyncerConfig
from ddiloco.core.events import Join, Log, Merged, Push
from ddiloco.core.layout import TensorSpec, build_layout
from ddiloco.core.vclock import VClock

TENSORS = (TensorSpec("w", (8, 16)),)


class MemoryStore:
    """A payload store in a dict, the way the format sees any store: parts in, sha256 out."""

    def __init__(self):
        self.bodies = {}

    def __call__(self, parts):
        body = b"".join(bytes(p) for p in parts)
        sha = hashlib.sha256(body).hexdigest()
        self.bodies[sha] = body
        return sha

    def stored(self, sha, where):
        if sha not in self.bodies:
            raise tapes.TapeError(f"{where}: no payload {sha[:16]}")
        return self.bodies[sha]


def tape_bytes(store, events, state):
    records = [tapes.header_record(state, "test", True, store)]
    records += [tapes.event_record(i, e, 0.25 * i, VClock().tick("syncer"), store) for i, e in enumerate(events)]
    records.append(tapes.close_record(len(events), state))
    return tapes.preamble(tapes.MAGIC) + b"".join(tapes.framed(r) for r in records)


def some_events():
    payload = codec.parse(codec.encode(np.linspace(-1, 1, 128, dtype=np.float32), "int4"))
    return [Join(1, "a", TENSORS, syncer.PROTOCOL_VERSION), Push(1, 0, 1, 0, 1, 64, payload)]


def test_records_round_trip_through_bytes_and_a_store_in_memory():
    store, events = MemoryStore(), some_events()
    state = syncer.new_state(SyncerConfig(num_fragments=1, period=2))
    parsed, good, torn = tapes.parse_records(tape_bytes(store, events, state), tapes.MAGIC, "memory")
    tape = tapes.tape_of("memory", parsed, good, torn, stored=store.stored)
    assert torn is None and tape.close["events"] == 2 and len(store.bodies) == 1
    decoded = [tapes.decode_event(tape, r)[0] for r in tape.events]
    assert decoded[0] == events[0]
    assert np.array_equal(decoded[1].payload.decode(), events[1].payload.decode())


def test_a_cut_short_byte_string_is_a_torn_tail_not_an_error():
    state = syncer.new_state(SyncerConfig(num_fragments=1, period=2))
    data = tape_bytes(MemoryStore(), some_events(), state)
    parsed, good, torn = tapes.parse_records(data[:-5], tapes.MAGIC, "memory")
    assert "torn tail" in torn and good < len(data) - 5
    assert [r["type"] for _, r in parsed] == ["header", "event", "event"]


def test_a_tape_read_without_its_store_says_so():
    store, events = MemoryStore(), some_events()
    state = syncer.new_state(SyncerConfig(num_fragments=1, period=2))
    parsed, good, torn = tapes.parse_records(tape_bytes(store, events, state), tapes.MAGIC, "memory")
    tape = tapes.tape_of("memory", parsed, good, torn)
    with pytest.raises(tapes.TapeError, match="not at hand"):
        tapes.decode_event(tape, tape.events[1])
    regenerated = tapes.Tape(
        tape.directory, tape.header, tape.records, tape.close, None, good, payloads=dict(store.bodies)
    )
    assert tapes.decode_event(regenerated, regenerated.events[1])[0].payload.elements == 128


def test_only_merges_make_check_records_and_they_hash_the_new_values():
    layout = build_layout([TensorSpec("w", (4, 8)), TensorSpec("b", (8,))], 2)
    params = [np.full(f.padded_size, 0.5, np.float32) for f in layout.fragments]
    state = syncer.new_state(SyncerConfig(num_fragments=2, period=2), layout, params)
    effects = [Log("info", "merged"), Merged(1, 3, (1,), (1.0,), 0.0, 0.1)]
    (record,) = tapes.check_records(7, state, effects)
    assert record == {
        "type": "check",
        "i": 7,
        "fragment": 1,
        "version": state.fragments[1].version,
        "sha256": hashlib.sha256(state.fragments[1].theta.tobytes()).hexdigest(),
        "published": hashlib.sha256(state.fragments[1].published.tobytes()).hexdigest(),
    }  # no delta: this state never merged (a real merge's record names its delta's hash too)
    with pytest.raises(tapes.TapeError, match="non-finite"):
        tapes.encode_value(float("nan"), MemoryStore())
