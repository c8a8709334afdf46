"""Event tapes on disk (net.recording): records and payloads written, read back, torn or corrupt files."""

import struct

import numpy as np
import pytest

from ddiloco.core import codec, syncer
from ddiloco.core import tape as tapes
from ddiloco.core.config import SyncerConfig
from ddiloco.core.events import Disconnect, Join, Progress, Push
from ddiloco.core.layout import TensorSpec
from ddiloco.core.vclock import VClock
from ddiloco.net import recording

TENSORS = (TensorSpec("w", (8, 16)),)


def small_tape(directory, options=tapes.TapeOptions(), close=True):
    state = syncer.new_state(SyncerConfig(num_fragments=1, period=2))
    w = recording.TapeWriter.create(directory, state, "test", options)
    clock = VClock()
    payload = codec.parse(codec.encode(np.linspace(-1, 1, 128, dtype=np.float32), "int4"))
    events = [
        Join(1, "a", TENSORS, syncer.PROTOCOL_VERSION),
        Progress(1, 1, (0,), (1,), (64,)),
        Push(1, 0, 1, 0, 1, 64, payload),
        Disconnect(1, "killed"),
    ]
    for i, e in enumerate(events):
        clock = clock.merge({"a": i}).tick("syncer")
        w.event(e, 0.5 * i, clock)
    if close:
        w.close(state)
    else:
        w.abandon()
    return events


def test_records_read_back_in_order_with_clock_now_and_payload(tmp_path):
    events = small_tape(tmp_path)
    tape = recording.read(tmp_path)
    assert tape.header["format"] == tapes.FORMAT and tape.header["start"]["kind"] == "empty"
    assert tape.header["config"]["num_fragments"] == 1
    assert tape.close["events"] == 4 and tape.torn is None
    decoded = [tapes.decode_event(tape, r) for r in tape.events]
    assert [type(e) for e, _, _ in decoded] == [type(e) for e in events]
    join, _, clock = decoded[0]
    assert join == events[0] and clock == {"syncer": 1}
    push, now, clock = decoded[2]
    assert now == 1.0 and clock == {"a": 2, "syncer": 3}
    assert np.array_equal(push.payload.decode(), events[2].payload.decode())
    assert push.payload.codec is codec.Codec.INT4
    assert decoded[1][0] == events[1]  # tuples come back as tuples


def test_a_tape_never_overwrites_another(tmp_path):
    small_tape(tmp_path)
    with pytest.raises(tapes.TapeError, match="exists already"):
        small_tape(tmp_path)


def test_truncated_mid_record_is_a_torn_tail_that_is_cut(tmp_path):
    small_tape(tmp_path, close=False)
    path = tmp_path / tapes.TAPE_FILE
    whole = recording.read(tmp_path)
    path.write_bytes(path.read_bytes()[:-7])
    tape = recording.read(tmp_path)
    assert "torn tail" in tape.torn and len(tape.events) == len(whole.events) - 1
    assert path.stat().st_size > tape.good_bytes  # reading alone changes nothing
    recording.read(tmp_path, cut=True)
    assert path.stat().st_size == tape.good_bytes
    again = recording.read(tmp_path)
    assert again.torn is None and len(again.events) == len(whole.events) - 1


def test_a_partial_record_header_is_a_torn_tail(tmp_path):
    small_tape(tmp_path, close=False)
    path = tmp_path / tapes.TAPE_FILE
    path.write_bytes(path.read_bytes() + b"\x05\x00\x00")
    assert "3 bytes of a record header" in recording.read(tmp_path).torn


def test_a_flipped_byte_in_the_last_record_is_a_torn_tail(tmp_path):
    small_tape(tmp_path)
    path = tmp_path / tapes.TAPE_FILE
    raw = bytearray(path.read_bytes())
    raw[-3] ^= 0x20
    path.write_bytes(bytes(raw))
    tape = recording.read(tmp_path)
    assert "fails its checksum" in tape.torn and tape.close is None and len(tape.events) == 4


def _offsets(path):
    data, off, out = path.read_bytes(), 16, []
    while off < len(data):
        (length,) = struct.unpack_from("<I", data, off)
        out.append(off)
        off += 12 + length
    return out


@pytest.mark.parametrize("where", ["body", "length"])
def test_a_flipped_byte_mid_file_is_an_error_naming_the_offset(tmp_path, where):
    small_tape(tmp_path)
    path = tmp_path / tapes.TAPE_FILE
    offsets = _offsets(path)
    victim = offsets[2]  # the second event record
    raw = bytearray(path.read_bytes())
    raw[victim + (20 if where == "body" else 1)] ^= 0x01
    path.write_bytes(bytes(raw))
    with pytest.raises(tapes.TapeError, match=f"offset {victim}"):
        recording.read(tmp_path)


def test_foreign_or_empty_files_are_refused(tmp_path):
    (tmp_path / tapes.TAPE_FILE).write_bytes(b"PK\x03\x04" + b"\0" * 40)
    with pytest.raises(tapes.TapeError, match="not a ddiloco tape"):
        recording.read(tmp_path)
    with pytest.raises(tapes.TapeError, match="cannot read tape"):
        recording.read(tmp_path / "missing")


def test_payloads_are_stored_once_by_content_and_checked_on_load(tmp_path):
    small_tape(tmp_path)
    tape = recording.read(tmp_path)
    (stored,) = (tmp_path / tapes.PAYLOAD_DIR).iterdir()
    assert recording.load_payload(tmp_path, stored.name)
    stored.write_bytes(stored.read_bytes()[:-1] + b"\xff")
    with pytest.raises(tapes.PayloadMismatch, match="tampered"):
        tapes.decode_event(tape, tape.events[2])
    stored.unlink()
    with pytest.raises(tapes.TapeError, match="not kept"):
        tapes.decode_event(tape, tape.events[2])


def test_records_above_the_limit_are_refused_before_writing(tmp_path):
    state = syncer.new_state(SyncerConfig(num_fragments=1))
    w = recording.TapeWriter.create(tmp_path, state, "test", tapes.TapeOptions(record_bytes_max=1024))
    size = (tmp_path / tapes.TAPE_FILE).stat().st_size
    many = tuple(TensorSpec(f"t{i:04d}", (1,)) for i in range(100))
    with pytest.raises(tapes.TapeError, match="record_bytes_max"):
        w.event(Join(1, "a", many, 1), 0.0, VClock())
    assert (tmp_path / tapes.TAPE_FILE).stat().st_size == size
    with pytest.raises(ValueError, match="fsync"):
        tapes.TapeOptions(fsync_every_records=0)


def test_unknown_event_kinds_name_themselves(tmp_path):
    small_tape(tmp_path)
    tape = recording.read(tmp_path)
    record = dict(tape.events[0], kind="Teleport")
    with pytest.raises(tapes.TapeError, match="Teleport"):
        tapes.decode_event(tape, record)


def _rewrite(directory, edit):
    """The tape with its records passed through `edit` (well framed: only the content is wrong)."""
    tape = recording.read(directory)
    records = edit([tape.header, *tape.records, tape.close])
    with open(directory / tapes.TAPE_FILE, "wb") as fh:
        fh.write(tapes.preamble(tapes.MAGIC))
        fh.writelines(tapes.framed(r) for r in records)


@pytest.mark.parametrize(
    "edit, match",
    [
        (lambda rs: [rs[0], *rs[2:]], "index 1, expected 0"),  # an event record lost
        (lambda rs: [rs[0], {k: v for k, v in rs[1].items() if k != "now"}, *rs[2:]], "'now'"),
        (lambda rs: [rs[0], dict(rs[1], type="teleport"), *rs[2:]], "no known type"),
        (lambda rs: [{k: v for k, v in rs[0].items() if k != "start"}, *rs[1:]], "'start'"),
    ],
)
def test_well_framed_records_of_the_wrong_shape_are_refused_by_offset(tmp_path, edit, match):
    small_tape(tmp_path)
    _rewrite(tmp_path, edit)
    with pytest.raises(tapes.TapeError, match=match):
        recording.read(tmp_path)
