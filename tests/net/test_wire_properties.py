"""Property tests of the wire: round trips of every kind through small frames, interleaving, and a
fuzzed decoder that only ever raises WireError and never returns a corrupted message."""

import dataclasses
import json
import struct
import zlib

import numpy as np
import orjson
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ddiloco.net.messages import (
    BULK_KINDS,
    INT_MAX,
    Bye,
    CodecName,
    Error,
    ErrorCode,
    Hello,
    Init,
    Kind,
    Message,
    Progress,
    Push,
    Update,
    Welcome,
    message_meta,
)
from ddiloco.net.wire import PROTOCOL_VERSION, Reassembler, WireError, WireLimits, encode

FAST = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
CONTROL_BYTES = 512
LIMITS_BIG = WireLimits(control_bytes_max=CONTROL_BYTES, frame_bytes_max=1 << 16, message_bytes_max=1 << 16)

counts = st.integers(0, INT_MAX)
small_counts = st.integers(0, 10**6)
names = st.text(st.characters(min_codepoint=0x20, max_codepoint=0x7E), min_size=1, max_size=8)  # printable ASCII
digests = st.text("0123456789abcdef", min_size=8, max_size=32)
clocks = st.dictionaries(names, counts, max_size=3)
count_lists = st.lists(counts, max_size=4).map(tuple)


@st.composite
def welcomes(draw: st.DrawFn) -> Welcome:
    fragment_count = draw(st.integers(1, 4))
    every = draw(st.integers(1, 50))
    return Welcome(
        learner_id=draw(counts),
        layout_digest=draw(digests),
        fragment_count=fragment_count,
        versions=tuple(draw(st.lists(counts, min_size=fragment_count, max_size=fragment_count))),
        sync_every_steps=every,
        fragment_offsets=tuple(
            draw(st.lists(st.integers(0, every - 1), min_size=fragment_count, max_size=fragment_count))
        ),
        global_step=draw(counts),
        codec=draw(st.sampled_from(CodecName)),
        codec_block=draw(st.integers(1, 4096)),
        clock=draw(clocks),
        needs_init=draw(st.booleans()),
        layout_json=draw(st.text(max_size=30)),
    )


@st.composite
def progresses(draw: st.DrawFn) -> Progress:
    versions = draw(count_lists)
    same_length = st.lists(counts, min_size=len(versions), max_size=len(versions)).map(tuple)
    return Progress(
        step=draw(counts),
        held_versions=versions,
        fragment_steps=draw(same_length),
        fragment_tokens=(tokens := draw(same_length)),
        clock=draw(clocks),
        fragment_carried=draw(st.one_of(st.just(()), st.tuples(*(st.integers(0, t) for t in tokens)))),
    )


@st.composite
def pushes(draw: st.DrawFn) -> Push:
    codec = draw(st.sampled_from(CodecName))
    count = draw(st.integers(0, 1500))
    size = count * codec.dense_bytes if codec.dense_bytes else draw(st.integers(0, 3000))
    return Push(
        fragment=draw(small_counts),
        step=draw(counts),
        base_version=draw(counts),
        steps=draw(counts),
        tokens=draw(counts),
        codec=codec,
        block=draw(st.integers(1, 4096)),
        element_count=count,
        clock=draw(clocks),
        payload=draw(st.binary(min_size=size, max_size=size)),
    )


@st.composite
def inits(draw: st.DrawFn) -> Init:
    values = draw(st.lists(st.floats(width=32), max_size=600))
    return Init(
        fragment=draw(small_counts),
        element_count=len(values),
        clock=draw(clocks),
        payload=np.array(values, dtype="<f4"),
    )


@st.composite
def updates(draw: st.DrawFn) -> Update:
    codec = draw(st.sampled_from([CodecName.FP32, CodecName.BF16, CodecName.INT4]))
    version = draw(st.integers(1, 2**53 - 1))
    if codec is CodecName.INT4:  # a delta: int4 blocks onto an older version
        block = draw(st.sampled_from([2, 8, 128]))
        count = block * draw(st.integers(0, 8))
        size = codec.body_bytes(count, block)
        base, block = draw(st.integers(0, version - 1)), block
    else:  # a whole copy, or a dense delta
        count = draw(st.integers(0, 1000))
        size = count * codec.dense_bytes
        base, block = draw(st.one_of(st.none(), st.integers(0, version - 1))), 0
    return Update(
        fragment=draw(small_counts),
        version=version,
        codec=codec,
        element_count=count,
        clock=draw(clocks),
        payload=draw(st.binary(min_size=size, max_size=size)),
        base_version=base,
        block=block,
    )


controls = st.one_of(
    st.builds(
        Hello,
        name=names,
        layout_digest=digests,
        shard=counts,
        resume_learner_id=st.none() | counts,
        held_versions=count_lists,
        clock=clocks,
        tensors_json=st.text(max_size=30),
    ),
    welcomes(),
    progresses(),
    st.builds(Error, code=st.sampled_from(ErrorCode), text=st.text(max_size=40), fatal=st.booleans()),
    st.builds(Bye, reason=st.text(max_size=40)),
)
bulks = st.one_of(pushes(), inits(), updates())
messages = st.one_of(controls, bulks)
# frames from smaller than a control message (whose meta is then chunked) to a few of them
small_limits = st.builds(
    WireLimits,
    frame_bytes_max=st.integers(128, 48 + 3 * CONTROL_BYTES),
    control_bytes_max=st.just(CONTROL_BYTES),
    message_bytes_max=st.just(1 << 16),
    messages_in_flight_max=st.just(2),
)


@FAST
@given(message=messages, limits=small_limits, message_id=st.integers(0, 2**64 - 1))
def test_every_kind_round_trips_through_small_frames(message: Message, limits: WireLimits, message_id: int) -> None:
    frames = encode(message, message_id=message_id, limits=limits)
    assert all(len(f) <= limits.frame_bytes_max for f in frames)
    reassembler = Reassembler(limits)
    results = [reassembler.feed(bytes(f)) for f in frames]
    assert results[:-1] == [None] * (len(frames) - 1)
    assert results[-1] == message
    assert reassembler.messages_in_flight == 0


@FAST
@given(first=bulks, second=bulks, control=controls, limits=small_limits, data=st.data())
def test_interleaved_frames_of_three_messages_reassemble(
    first: Message, second: Message, control: Message, limits: WireLimits, data: st.DataObject
) -> None:
    # a control message longer than a frame is in flight too: room for all three
    limits = dataclasses.replace(limits, messages_in_flight_max=3)
    queues = [encode(m, message_id=i, limits=limits) for i, m in enumerate([first, second, control])]
    expected_by_id = {0: first, 1: second, 2: control}
    reassembler = Reassembler(limits)
    done = []
    while any(queues):
        # any interleaving that keeps each message's own chunks in order
        which = data.draw(st.sampled_from([i for i, q in enumerate(queues) if q]))
        result = reassembler.feed(bytes(queues[which].pop(0)))
        if result is not None:
            done.append((which, result))
    assert sorted(i for i, _ in done) == [0, 1, 2]
    for which, result in done:
        assert result == expected_by_id[which]


def _valid_frames(message: Message, limits: WireLimits) -> list[bytes]:
    return [bytes(f) for f in encode(message, message_id=3, limits=limits)]


def _feed_all(reassembler: Reassembler, frames: list[bytes]) -> list[Message]:
    out = []
    for frame in frames:
        result = reassembler.feed(frame)
        if result is not None:
            out.append(result)
    return out


@FAST
@given(junk=st.binary(max_size=600))
def test_random_bytes_raise_wire_error(junk: bytes) -> None:
    for frame in (junk, b"DDLC\x01" + junk):
        reassembler = Reassembler(LIMITS_BIG)
        try:
            reassembler.feed(frame)
        except WireError as error:
            assert error.code in {ErrorCode.BAD_FRAME, ErrorCode.CHECKSUM, ErrorCode.PROTOCOL_VERSION}
        else:
            raise AssertionError(f"random frame {frame[:20]!r}... was accepted")


@FAST
@given(message=messages, limits=small_limits, data=st.data())
def test_truncated_frames_raise_wire_error(message: Message, limits: WireLimits, data: st.DataObject) -> None:
    frames = _valid_frames(message, limits)
    which = data.draw(st.integers(0, len(frames) - 1))
    cut = data.draw(st.integers(0, len(frames[which]) - 1))
    frames[which] = frames[which][:cut]
    reassembler = Reassembler(limits)
    try:
        _feed_all(reassembler, frames)
    except WireError as error:
        assert error.code in {ErrorCode.BAD_FRAME, ErrorCode.CHECKSUM}
    else:
        raise AssertionError(f"frame {which} cut at {cut} bytes was accepted")


@FAST
@given(message=messages, limits=small_limits, data=st.data())
def test_bit_flips_never_yield_a_corrupted_message(message: Message, limits: WireLimits, data: st.DataObject) -> None:
    frames = _valid_frames(message, limits)
    which = data.draw(st.integers(0, len(frames) - 1))
    corrupt = bytearray(frames[which])
    flips = data.draw(st.lists(st.integers(0, 8 * len(corrupt) - 1), min_size=1, max_size=3, unique=True))
    for bit in flips:
        corrupt[bit // 8] ^= 1 << (bit % 8)
    frames[which] = bytes(corrupt)
    try:
        decoded = _feed_all(Reassembler(limits), frames)
    except WireError:
        return
    # crc32 detects every error of up to three bits in frames this small, so nothing may come out
    raise AssertionError(f"bits {flips} of frame {which} flipped, decoder returned {decoded}")


# The documented header (docs/protocol.md), restated here so the fuzzer can write frames whose
# checksum is right but whose fields are anything at all.
DOC_HEADER = struct.Struct("<4sBBHQIIQQII")


def _sealed(
    kind: int,
    message_id: int,
    index: int,
    count: int,
    offset: int,
    payload_bytes: int,
    meta_bytes: int,
    data: bytes,
    flags: int = 0,
) -> bytes:
    head = DOC_HEADER.pack(
        b"DDLC", PROTOCOL_VERSION, kind, flags, message_id, index, count, offset, payload_bytes, meta_bytes, 0
    )[:44]
    return head + struct.pack("<I", zlib.crc32(data, zlib.crc32(head))) + data


u32 = st.integers(0, 2**32 - 1)
u64 = st.integers(0, 2**64 - 1)
sealed_frames = st.builds(
    _sealed,
    kind=st.integers(0, 255),
    message_id=st.integers(0, 3) | u64,
    index=st.integers(0, 3) | u32,
    count=st.integers(0, 4) | u32,
    offset=st.integers(0, 600) | u64,
    payload_bytes=st.integers(0, 2000) | u64,
    meta_bytes=st.integers(0, 600) | u32,
    data=st.binary(max_size=700) | st.sampled_from([b'{"reason":"x"}', b"{}", b"[]", b"null"]),
    flags=st.just(0) | st.integers(0, 2**16 - 1),
)


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=False) | st.text(max_size=6),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=6,
)


@st.composite
def nearly_valid_frames(draw: st.DrawFn) -> bytes:
    """A frame with a right checksum whose body is a real message's JSON with one field dropped,
    retyped or added, and whose header fields are consistent unless one is drawn otherwise."""
    message = draw(messages)
    fields = orjson.loads(message_meta(message))
    key = draw(st.sampled_from(sorted(fields)) if fields else st.just("extra"))
    mutation = draw(st.sampled_from(["keep", "drop", "retype", "add", "replace_body"]))
    if mutation == "drop":
        fields.pop(key, None)
    elif mutation == "retype":
        fields[key] = draw(json_values)
    elif mutation == "add":
        fields[draw(st.text(min_size=1, max_size=6))] = draw(json_values)
    # the standard library writes integers of any size, which orjson refuses to
    meta = json.dumps(draw(json_values) if mutation == "replace_body" else fields).encode()
    payload = bytes(message.payload) if message.KIND in BULK_KINDS else b""
    payload = payload[: draw(st.integers(0, len(payload)))] if draw(st.booleans()) else payload
    data = meta + payload
    header = {
        "kind": message.KIND,
        "message_id": draw(st.integers(0, 3)),
        "index": 0,
        "count": 1,
        "offset": 0,
        "payload_bytes": len(payload),
        "meta_bytes": len(meta),
    }
    wrong = draw(
        st.sampled_from([None, None, None, "kind", "index", "count", "offset", "payload_bytes", "meta_bytes", "data"])
    )
    if wrong == "data":
        data = data[: draw(st.integers(0, len(data)))]
    elif wrong is not None:
        header[wrong] = draw(st.integers(0, 255) if wrong == "kind" else u32)
    return _sealed(data=data, **header)


@settings(max_examples=400, deadline=None)
@given(frames=st.lists(sealed_frames | nearly_valid_frames(), min_size=1, max_size=4))
def test_frames_with_valid_checksums_and_any_fields_fail_cleanly(frames: list[bytes]) -> None:
    limits = WireLimits(control_bytes_max=CONTROL_BYTES, frame_bytes_max=1 << 16, message_bytes_max=1 << 16)
    reassembler = Reassembler(limits)
    for frame in frames:
        try:
            result = reassembler.feed(frame)
        except WireError as error:
            assert isinstance(error.code, ErrorCode)
            continue
        # whatever comes out is a valid message of the declared kind that survives a round trip
        if result is not None:
            assert result.KIND == DOC_HEADER.unpack_from(frame)[2]
            (frame_again,) = encode(result, message_id=0, limits=limits)
            assert Reassembler(limits).feed(bytes(frame_again)) == result


@FAST
@given(payload_bytes=st.integers(4097, 2**64 - 1), count=st.integers(1, 2**32 - 1))
def test_huge_declared_lengths_are_refused_before_allocating(payload_bytes: int, count: int) -> None:
    limits = WireLimits(control_bytes_max=CONTROL_BYTES, frame_bytes_max=2048, message_bytes_max=4096)
    meta = b'{"fragment":0}'
    frame = _sealed(Kind.INIT, 1, 0, count, 0, payload_bytes, len(meta), meta + b"x" * 100)
    reassembler = Reassembler(limits)
    try:
        reassembler.feed(frame)
    except WireError as error:
        assert error.code == ErrorCode.OVERSIZED
    else:
        raise AssertionError("a frame declaring a huge payload was accepted")
    assert reassembler.bytes_in_flight == 0


HEADER_FIELDS = {  # name: (offset, struct format) from docs/protocol.md
    "kind": (5, "<B"),
    "message_id": (8, "<Q"),
    "chunk_index": (16, "<I"),
    "chunk_count": (20, "<I"),
    "chunk_offset": (24, "<Q"),
    "payload_bytes": (32, "<Q"),
    "meta_bytes": (40, "<I"),
}


@settings(max_examples=150, deadline=None)
@given(message=messages, limits=small_limits, data=st.data())
def test_resealed_header_changes_never_yield_a_wrong_message(
    message: Message, limits: WireLimits, data: st.DataObject
) -> None:
    frames = _valid_frames(message, limits)
    which = data.draw(st.integers(0, len(frames) - 1))
    name = data.draw(st.sampled_from(sorted(HEADER_FIELDS)))
    offset, fmt = HEADER_FIELDS[name]
    original = struct.unpack_from(fmt, frames[which], offset)[0]
    bits = 8 * struct.calcsize(fmt)
    value = data.draw(
        st.sampled_from([original + 1, original - 1, 0, 2**bits - 1]).filter(
            lambda v: 0 <= v < 2**bits and v != original
        )
    )
    frame = bytearray(frames[which])
    struct.pack_into(fmt, frame, offset, value)
    struct.pack_into("<I", frame, 44, zlib.crc32(frame[48:], zlib.crc32(frame[:44])))
    frames[which] = bytes(frame)
    try:
        decoded = _feed_all(Reassembler(limits), frames)
    except WireError:
        return
    # a message can be left incomplete (a larger chunk count); only a changed message id can
    # go unnoticed, and then the message is still the right one
    assert decoded == ([message] if name == "message_id" else [])
