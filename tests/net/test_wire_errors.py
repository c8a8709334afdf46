"""Each way a frame sequence or a message can be wrong, the code it gets, and what the reassembler
is left able to do afterwards."""

import struct
import zlib

import numpy as np
import pytest

from ddiloco.core import vclock
from ddiloco.net.messages import (
    INT_MAX,
    LEARNER_KINDS,
    Bye,
    CodecName,
    Error,
    ErrorCode,
    Hello,
    Init,
    Kind,
    Marker,
    Progress,
    Push,
    Update,
    Welcome,
)
from ddiloco.net.wire import PROTOCOL_VERSION, Reassembler, WireError, WireLimits, encode

LIMITS = WireLimits(frame_bytes_max=48 + 512, control_bytes_max=512, message_bytes_max=1 << 16)
AIOHTTP_MAX_MSG_SIZE = 4 * 1024 * 1024  # aiohttp's default, which rejects a message of this size
DIGEST = "00112233445566778899aabbccddeeff"


def _init(count: int) -> Init:
    return Init(fragment=0, element_count=count, clock={}, payload=np.arange(count, dtype="<f4"))


def _frames(message, message_id: int = 0, limits: WireLimits = LIMITS) -> list[bytes]:
    return [bytes(f) for f in encode(message, message_id=message_id, limits=limits)]


def _sealed(
    kind: int,
    data: bytes,
    *,
    message_id: int = 0,
    index: int = 0,
    count: int = 1,
    offset: int = 0,
    payload_bytes: int = 0,
    meta_bytes: int | None = None,
    version: int = PROTOCOL_VERSION,
) -> bytes:
    """A frame written from the layout in docs/protocol.md, with a correct checksum."""
    meta_bytes = len(data) - payload_bytes if meta_bytes is None else meta_bytes
    head = struct.pack(
        "<4sBBHQIIQQ", b"DDLC", version, kind, 0, message_id, index, count, offset, payload_bytes
    ) + struct.pack("<I", meta_bytes)
    return head + struct.pack("<I", zlib.crc32(data, zlib.crc32(head))) + data


def _error(reassembler: Reassembler, frame: bytes) -> WireError:
    with pytest.raises(WireError) as caught:
        reassembler.feed(frame)
    return caught.value


# ---- limits ---------------------------------------------------------------------------------


def test_default_frame_fits_under_aiohttps_message_limit() -> None:
    assert WireLimits().frame_bytes_max < AIOHTTP_MAX_MSG_SIZE


@pytest.mark.parametrize(
    ("changes", "named"),
    [
        ({"frame_bytes_max": 0}, "frame_bytes_max"),
        ({"messages_in_flight_max": 0}, "messages_in_flight_max"),
        ({"message_bytes_max": True}, "message_bytes_max"),
        ({"control_bytes_max": 100}, "control_bytes_max"),
        ({"frame_bytes_max": 100}, "frame_bytes_max"),
        ({"message_bytes_max": 300, "control_bytes_max": 400}, "message_bytes_max"),
        ({"message_bytes_max": 2**63}, "message_bytes_max"),
    ],
)
def test_bad_limits_are_refused_naming_the_field(changes: dict, named: str) -> None:
    with pytest.raises(ValueError, match=named):
        WireLimits(**changes)


def test_encode_refuses_messages_over_the_limits() -> None:
    with pytest.raises(WireError) as caught:
        encode(Bye(reason="x" * 600), message_id=0, limits=LIMITS)
    assert caught.value.code == ErrorCode.OVERSIZED
    with pytest.raises(WireError) as caught:
        encode(_init(20_000), message_id=0, limits=LIMITS)
    assert caught.value.code == ErrorCode.OVERSIZED
    with pytest.raises(ValueError, match="message_id"):
        encode(Bye(reason=""), message_id=-1, limits=LIMITS)


# ---- message validation ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("build", "named"),
    [
        (lambda: Marker(snapshot=True, clock={}), "Marker.snapshot"),
        (lambda: Marker(snapshot=-1, clock={}), "Marker.snapshot"),
        (lambda: Marker(snapshot=1.0, clock={}), "Marker.snapshot"),
        (lambda: Marker(snapshot=2**63, clock={}), "Marker.snapshot"),
        (lambda: Bye(reason=None), "Bye.reason"),
        (lambda: Error(code=99, text="", fatal=True), "Error.code"),
        (lambda: Error(code=ErrorCode.STALE, text="", fatal=1), "Error.fatal"),
        (
            lambda: Hello(
                name="",
                layout_digest=DIGEST,
                shard=0,
                resume_learner_id=None,
                held_versions=(),
                clock={},
                tensors_json="[]",
            ),
            "Hello.name",
        ),
        (
            lambda: Hello(
                name="a",
                layout_digest="XYZ",
                shard=0,
                resume_learner_id=None,
                held_versions=(),
                clock={},
                tensors_json="[]",
            ),
            "Hello.layout_digest",
        ),
        (
            lambda: Hello(
                name="a",
                layout_digest=DIGEST,
                shard=0,
                resume_learner_id=None,
                held_versions=(1, "2"),
                clock={},
                tensors_json="[]",
            ),
            r"Hello.held_versions\[1\]",
        ),
        (
            lambda: Hello(
                name="a",
                layout_digest=DIGEST,
                shard=0,
                resume_learner_id=None,
                held_versions=(),
                clock={"s": -1},
                tensors_json="[]",
            ),
            "Hello.clock",
        ),
        (
            lambda: Welcome(
                learner_id=0,
                layout_digest=DIGEST,
                fragment_count=2,
                versions=(0,),
                sync_every_steps=4,
                fragment_offsets=(0, 2),
                global_step=0,
                codec="int4",
                codec_block=128,
                clock={},
                needs_init=True,
                layout_json="{}",
            ),
            "Welcome.versions",
        ),
        (
            lambda: Welcome(
                learner_id=0,
                layout_digest=DIGEST,
                fragment_count=2,
                versions=(0, 0),
                sync_every_steps=4,
                fragment_offsets=(0, 4),
                global_step=0,
                codec="int4",
                codec_block=128,
                clock={},
                needs_init=True,
                layout_json="{}",
            ),
            "Welcome.fragment_offsets",
        ),
        (
            lambda: Progress(step=0, held_versions=(0, 0), fragment_steps=(1, 2), fragment_tokens=(1,), clock={}),
            "Progress.fragment_tokens",
        ),
        (
            lambda: Progress(
                step=0,
                held_versions=(0, 0),
                fragment_steps=(1, 2),
                fragment_tokens=(5, 5),
                clock={},
                fragment_carried=(6, 0),
            ),
            "Progress.fragment_carried",
        ),
        (
            lambda: Push(
                fragment=0,
                step=0,
                base_version=0,
                steps=1,
                tokens=1,
                codec="fp32",
                block=128,
                element_count=3,
                clock={},
                payload=b"\0" * 8,
            ),
            "Push payload",
        ),
        (
            lambda: Push(
                fragment=0,
                step=0,
                base_version=0,
                steps=1,
                tokens=1,
                codec="fp8",
                block=128,
                element_count=3,
                clock={},
                payload=b"",
            ),
            "Push.codec",
        ),
        (
            lambda: Update(
                fragment=0, version=1, codec=CodecName.INT2, element_count=2, clock={}, global_step=0, payload=b"\0"
            ),
            "Update.codec",
        ),
        (
            lambda: Update(
                fragment=0, version=1, codec=CodecName.INT4, element_count=2, clock={}, global_step=0, payload=b"\0"
            ),
            "a whole Update cannot be int4",
        ),
        (
            lambda: Update(
                fragment=0, version=1, codec=CodecName.INT4, element_count=4, clock={}, payload=b"\0", base_version=0
            ),
            "Update.block 0 must be even",
        ),
        (
            lambda: Update(
                fragment=0,
                version=1,
                codec=CodecName.INT4,
                element_count=4,
                clock={},
                payload=b"\0" * 5,
                base_version=0,
                block=4,
            ),
            "Update payload has 5 bytes; int4 x 4 elements in blocks of 4 needs 6",
        ),
        (
            lambda: Update(
                fragment=0, version=2, codec=CodecName.FP32, element_count=1, clock={}, payload=b"\0" * 4, block=2
            ),
            "Update.block must be 0 for fp32",
        ),
        (
            lambda: Update(
                fragment=0,
                version=2,
                codec=CodecName.FP32,
                element_count=1,
                clock={},
                payload=b"\0" * 4,
                base_version=2,
            ),
            "Update.base_version 2 must be below version 2",
        ),
        (lambda: Init(fragment=0, element_count=2, clock={}, payload=np.zeros(4)[::2]), "Init.payload"),
        (lambda: Init(fragment=0, element_count=2, clock={}, payload=[0.0, 1.0]), "Init.payload"),
        # the counter limit: 2**53 - 1, far below 2**63, so no tick or sum of counters overflows
        (
            lambda: Push(
                fragment=0,
                step=0,
                base_version=0,
                steps=1,
                tokens=INT_MAX + 1,
                codec="fp32",
                block=128,
                element_count=0,
                clock={},
                payload=b"",
            ),
            r"Push.tokens must be an int in \[0, 2\*\*53\)",
        ),
        (
            lambda: Progress(step=2**63 - 1, held_versions=(), fragment_steps=(), fragment_tokens=(), clock={}),
            "Progress.step",
        ),
        (lambda: Init(fragment=0, element_count=0, clock={"syncer": 2**63 - 1}, payload=b""), "Init.clock"),
        (
            lambda: Hello(
                name="a\nb",
                layout_digest=DIGEST,
                shard=0,
                resume_learner_id=None,
                held_versions=(),
                clock={},
                tensors_json="[]",
            ),
            "Hello.name must be 1 to 256 printable ASCII",
        ),
        (
            lambda: Hello(
                name="x" * 257,
                layout_digest=DIGEST,
                shard=0,
                resume_learner_id=None,
                held_versions=(),
                clock={},
                tensors_json="[]",
            ),
            "Hello.name",
        ),
        (lambda: Init(fragment=0, element_count=0, clock={"\u00b2": 1}, payload=b""), "Init.clock key"),
        (
            lambda: Init(
                fragment=0, element_count=0, clock={f"p{i}": 1 for i in range(vclock.ENTRIES_MAX + 1)}, payload=b""
            ),
            "Init.clock has 4097 entries",
        ),
    ],
)
def test_invalid_messages_cannot_be_built(build, named: str) -> None:
    with pytest.raises(ValueError, match=named):
        build()


def test_messages_normalise_lists_enum_values_and_buffers() -> None:
    progress = Progress(step=1, held_versions=[0, 0], fragment_steps=[1, 2], fragment_tokens=[3, 4], clock={"a": 1})
    assert progress.fragment_steps == (1, 2)
    push = Push(
        fragment=0,
        step=0,
        base_version=0,
        steps=1,
        tokens=1,
        codec="bf16",
        block=1,
        element_count=4,
        clock={},
        payload=np.ones((2, 2), dtype="<u2"),
    )
    assert push.codec is CodecName.BF16
    assert push.payload.readonly and push.payload.format == "B"
    assert bytes(push.payload) == b"\x01\x00" * 4


# ---- frame errors ---------------------------------------------------------------------------


def test_short_frame_bad_magic_and_unknown_version() -> None:
    (frame,) = _frames(Marker(snapshot=1, clock={}))
    assert _error(Reassembler(LIMITS), frame[:47]).code == ErrorCode.BAD_FRAME
    assert _error(Reassembler(LIMITS), b"XXXX" + frame[4:]).code == ErrorCode.BAD_FRAME
    # protocol 1 (a learner that waits for requests), 2 (updates without the global step) and a later release
    for version in (1, 2, 4):
        error = _error(Reassembler(LIMITS), _sealed(Kind.BYE, b'{"reason":""}', version=version))
        assert error.code == ErrorCode.PROTOCOL_VERSION
        assert f"protocol version {version} is not understood" in error.text and "[3]" in error.text


def test_a_kind_4_frame_is_an_unknown_kind_since_protocol_2() -> None:
    """Kind 4 was Request (the syncer asking for a push) until protocol 1; learners now push on their own."""
    reassembler = Reassembler(LIMITS)
    error = _error(reassembler, _sealed(4, b'{"base_version":0,"fragment":0,"round":1}'))
    assert error.code == ErrorCode.UNKNOWN_KIND and "kind 4" in error.text
    assert 4 not in {k.value for k in Kind}
    (good,) = _frames(Marker(snapshot=1, clock={}), message_id=1)
    assert reassembler.feed(good) == Marker(snapshot=1, clock={})  # the session goes on


def test_frame_over_frame_bytes_max_is_oversized() -> None:
    (frame,) = _frames(Bye(reason="x" * 400), limits=WireLimits())
    small = WireLimits(frame_bytes_max=48 + 256, control_bytes_max=256)
    assert _error(Reassembler(small), frame).code == ErrorCode.OVERSIZED


def test_flipped_payload_byte_is_a_checksum_error() -> None:
    frame = bytearray(_frames(_init(10))[0])
    frame[-1] ^= 0x40
    error = _error(Reassembler(LIMITS), bytes(frame))
    assert error.code == ErrorCode.CHECKSUM and error.fatal


@pytest.mark.parametrize(
    "body",
    [
        b'{"snapshot":0}',  # missing field
        b'{"snapshot":0,"clock":{},"x":1}',  # unknown field
        b'{"snapshot":false,"clock":{}}',  # bool for int
        b'{"snapshot":0.0,"clock":{}}',  # float for int
        b'{"snapshot":18446744073709551615,"clock":{}}',  # above 2**63
        b'{"snapshot":null,"clock":{}}',
        b"[0,0,0]",
        b'{"snapshot":0,',  # not JSON
        b'{"snapshot":"\xff"}',  # not UTF-8
    ],
)
def test_body_not_matching_the_schema_is_a_confined_bad_message(body: bytes) -> None:
    reassembler = Reassembler(LIMITS)
    error = _error(reassembler, _sealed(Kind.MARKER, body))
    assert error.code == ErrorCode.BAD_MESSAGE
    assert not error.fatal
    (good,) = _frames(Marker(snapshot=1, clock={"a": 2}), message_id=1)
    assert reassembler.feed(good) == Marker(snapshot=1, clock={"a": 2})


def test_payload_on_a_control_kind_is_refused() -> None:
    body = b'{"reason":"x"}'
    error = _error(Reassembler(LIMITS), _sealed(Kind.BYE, body + b"\0\0", payload_bytes=2))
    assert error.code == ErrorCode.BAD_FRAME and "no payload" in error.text


def test_unknown_kind_in_one_frame_is_confined() -> None:
    reassembler = Reassembler(LIMITS)
    error = _error(reassembler, _sealed(200, b"{}"))
    assert error.code == ErrorCode.UNKNOWN_KIND and not error.fatal
    assert reassembler.feed(_frames(Bye(reason="ok"))[0]) == Bye(reason="ok")


def test_length_field_disagreeing_with_a_lone_frame_is_refused() -> None:
    body = b'{"reason":"x"}'
    error = _error(Reassembler(LIMITS), _sealed(Kind.BYE, body, meta_bytes=len(body) + 5))
    assert error.code == ErrorCode.BAD_FRAME


# ---- chunk sequences ------------------------------------------------------------------------


def test_skipped_chunk_is_fatal_and_poisons_the_connection() -> None:
    frames = _frames(_init(400))
    assert len(frames) >= 3
    reassembler = Reassembler(LIMITS)
    reassembler.feed(frames[0])
    error = _error(reassembler, frames[2])
    assert error.code == ErrorCode.BAD_FRAME and error.fatal
    assert reassembler.messages_in_flight == 0 and reassembler.bytes_in_flight == 0
    later = _error(reassembler, _frames(Bye(reason=""), message_id=5)[0])
    assert later.fatal and "earlier error" in later.text


def test_duplicated_chunk_is_refused() -> None:
    frames = _frames(_init(400))
    reassembler = Reassembler(LIMITS)
    reassembler.feed(frames[0])
    reassembler.feed(frames[1])
    assert _error(reassembler, frames[1]).code == ErrorCode.BAD_FRAME


def test_chunk_with_a_wrong_index_at_the_right_offset_is_refused() -> None:
    frames = _frames(_init(400))
    second = bytearray(frames[1])
    struct.pack_into("<I", second, 16, 2)  # chunk index 2 where 1 is due; offset left right
    struct.pack_into("<I", second, 44, zlib.crc32(second[48:], zlib.crc32(second[:44])))
    reassembler = Reassembler(LIMITS)
    reassembler.feed(frames[0])
    error = _error(reassembler, bytes(second))
    assert error.code == ErrorCode.BAD_FRAME and "expected chunk 1" in error.text


def test_first_chunk_overrunning_its_declared_length_is_refused() -> None:
    meta = b'{"clock":{},"element_count":2,"fragment":0}'
    frame = _sealed(Kind.INIT, meta + bytes(20), count=2, payload_bytes=8, meta_bytes=len(meta))
    error = _error(Reassembler(LIMITS), frame)
    assert error.code == ErrorCode.BAD_FRAME and "overruns" in error.text


def test_chunk_of_a_message_never_started_is_refused() -> None:
    frames = _frames(_init(400))
    assert _error(Reassembler(LIMITS), frames[1]).code == ErrorCode.BAD_FRAME


def test_chunk_disagreeing_with_its_first_chunk_is_refused() -> None:
    first = _frames(_init(400), message_id=1)
    other = _frames(_init(500), message_id=1)
    reassembler = Reassembler(LIMITS)
    reassembler.feed(first[0])
    assert _error(reassembler, other[1]).code == ErrorCode.BAD_FRAME


def test_message_ending_short_of_its_declared_length_is_refused() -> None:
    meta = b'{"clock":{},"element_count":100,"fragment":0}'
    payload = bytes(400)
    reassembler = Reassembler(LIMITS)
    head = meta + payload[:100]
    assert reassembler.feed(_sealed(Kind.INIT, head, count=2, payload_bytes=400, meta_bytes=len(meta))) is None
    tail = _sealed(
        Kind.INIT, payload[100:399], index=1, count=2, offset=len(head), payload_bytes=400, meta_bytes=len(meta)
    )
    error = _error(reassembler, tail)
    assert error.code == ErrorCode.BAD_FRAME and "ended after" in error.text


def test_message_id_reused_while_in_flight_is_refused() -> None:
    reassembler = Reassembler(LIMITS)
    reassembler.feed(_frames(_init(400), message_id=7)[0])
    assert _error(reassembler, _frames(_init(300), message_id=7)[0]).code == ErrorCode.BAD_FRAME


def test_more_messages_in_flight_than_allowed_is_overloaded() -> None:
    reassembler = Reassembler(LIMITS)
    for message_id in (1, 2):
        first = _frames(_init(400), message_id=message_id)[0]
        reassembler.feed(first)
    meta_bytes = struct.unpack_from("<I", first, 40)[0]
    assert reassembler.messages_in_flight == 2
    assert reassembler.bytes_in_flight == 2 * (400 * 4 + meta_bytes)
    error = _error(reassembler, _frames(_init(400), message_id=3)[0])
    assert error.code == ErrorCode.OVERLOADED and error.fatal


def test_meta_split_over_frames_is_decoded_when_complete() -> None:
    body = b'{"reason":"' + b"x" * 20 + b'"}'
    reassembler = Reassembler(LIMITS)
    assert reassembler.feed(_sealed(Kind.BYE, body[:10], count=2, meta_bytes=len(body))) is None
    last = _sealed(Kind.BYE, body[10:], index=1, count=2, offset=10, meta_bytes=len(body))
    assert reassembler.feed(last) == Bye(reason="x" * 20)


def test_bad_meta_split_over_frames_is_fatal() -> None:
    body = b'{"reason":5}'
    reassembler = Reassembler(LIMITS)
    reassembler.feed(_sealed(Kind.BYE, body[:4], count=2, meta_bytes=len(body)))
    last = _sealed(Kind.BYE, body[4:], index=1, count=2, offset=4, meta_bytes=len(body))
    error = _error(reassembler, last)
    assert error.code == ErrorCode.BAD_MESSAGE and error.fatal


def test_multi_frame_message_without_meta_is_refused() -> None:
    frame = _sealed(Kind.INIT, b"\0" * 8, count=2, payload_bytes=16, meta_bytes=0)
    assert _error(Reassembler(LIMITS), frame).code == ErrorCode.BAD_FRAME


def test_aiohttp_size_limit_admits_a_full_frame() -> None:
    # aiohttp refuses a websocket message of max_msg_size bytes or more
    assert LIMITS.max_msg_size > LIMITS.frame_bytes_max


def test_confined_error_leaves_a_bulk_message_in_flight_intact() -> None:
    frames = _frames(_init(400), message_id=1)
    reassembler = Reassembler(LIMITS)
    reassembler.feed(frames[0])
    assert not _error(reassembler, _sealed(Kind.MARKER, b"{}", message_id=2)).fatal
    results = [reassembler.feed(f) for f in frames[1:]]
    assert results[-1] == _init(400)


def test_kinds_not_accepted_are_refused_before_allocating() -> None:
    reassembler = Reassembler(LIMITS, accepted=LEARNER_KINDS)
    update = Update(
        fragment=0, version=1, codec=CodecName.FP32, element_count=400, clock={}, payload=np.zeros(400, dtype="<f4")
    )
    error = _error(reassembler, _frames(update)[0])
    assert error.code == ErrorCode.UNEXPECTED_KIND and error.fatal
    assert reassembler.bytes_in_flight == 0
    marker = Marker(snapshot=0, clock={})
    lone = _error(Reassembler(LIMITS, accepted=LEARNER_KINDS), _frames(marker)[0])
    assert lone.code == ErrorCode.UNEXPECTED_KIND and not lone.fatal


def test_wire_error_becomes_the_error_message_to_send() -> None:
    error = WireError(ErrorCode.CHECKSUM, "crc32 mismatch", fatal=True)
    assert isinstance(error, ValueError)
    assert error.to_message() == Error(code=ErrorCode.CHECKSUM, text="crc32 mismatch", fatal=True)


def test_lone_frame_payload_is_a_view_into_the_frame() -> None:
    (frame,) = _frames(_init(10))
    message = Reassembler(LIMITS).feed(frame)
    assert message.payload.obj is frame
    assert np.array_equal(np.frombuffer(message.payload, dtype="<f4"), np.arange(10))
