"""Golden bytes of the wire format: the encoder's output must not change by accident.

DDILOCO_WRITE_GOLDEN=1 rewrites the files in tests/net/golden/ on purpose; the run then fails
saying so, and a second run without the variable must pass. The header layout is also checked
field by field against docs/protocol.md, with struct, independently of the encoder.
"""

import os
import struct
import zlib
from pathlib import Path

import numpy as np
import orjson
import pytest

from ddiloco.net.messages import (
    Bye,
    CodecName,
    Error,
    ErrorCode,
    Hello,
    Init,
    Progress,
    Push,
    Update,
    Welcome,
)
from ddiloco.net.wire import Reassembler, WireLimits, encode

GOLDEN_DIR = Path(__file__).parent / "golden"
WRITE_GOLDEN = os.environ.get("DDILOCO_WRITE_GOLDEN") == "1"
SMALL = WireLimits(frame_bytes_max=512, control_bytes_max=256, message_bytes_max=4096)
DIGEST = "3f1c9a7e0b2d4c6e8f1a3b5c7d9e0f21"
CLOCK = {"learner-0": 12, "syncer": 40}


def _codes(count: int) -> bytes:
    return bytes((7 * i + 3) % 256 for i in range(count))


# name -> (message, message id, limits); payloads are fixed little-endian bytes
CASES = {
    "hello_fresh": (
        Hello(
            name="tpu-a",
            layout_digest=DIGEST,
            shard=0,
            resume_learner_id=None,
            held_versions=(),
            clock={},
            tensors_json='[["w",[4,4],"float32",false]]',
        ),
        0,
        WireLimits(),
    ),
    "hello_resume": (
        Hello(
            name="tpu-b",
            layout_digest=DIGEST,
            shard=3,
            resume_learner_id=5,
            held_versions=(4, 4, 3),
            clock=CLOCK,
            tensors_json="[]",
        ),
        1,
        WireLimits(),
    ),
    "welcome": (
        Welcome(
            learner_id=5,
            layout_digest=DIGEST,
            fragment_count=3,
            versions=(4, 4, 3),
            sync_every_steps=24,
            fragment_offsets=(0, 8, 16),
            global_step=1000,
            codec=CodecName.INT4,
            codec_block=128,
            clock=CLOCK,
            needs_init=False,
            layout_json='{"fragments":3}',
        ),
        0,
        WireLimits(),
    ),
    "progress": (
        Progress(
            step=1001,
            held_versions=(4, 4, 3),
            fragment_steps=(1, 9, 17),
            fragment_tokens=(4096, 36864, 69632),
            clock=CLOCK,
        ),
        2,
        WireLimits(),
    ),
    # a control message longer than one frame: the meta itself is chunked
    "welcome_chunked": (
        Welcome(
            learner_id=1,
            layout_digest=DIGEST,
            fragment_count=24,
            versions=tuple(range(24)),
            sync_every_steps=24,
            fragment_offsets=tuple(range(24)),
            global_step=0,
            codec=CodecName.INT4,
            codec_block=128,
            clock={},
            needs_init=True,
            layout_json='{"fragments":24}',
        ),
        6,
        WireLimits(frame_bytes_max=160, control_bytes_max=1024, message_bytes_max=4096),
    ),
    "push_int4": (
        Push(
            fragment=2,
            step=41,
            base_version=3,
            steps=24,
            tokens=98304,
            codec=CodecName.INT4,
            block=128,
            element_count=256,
            clock=CLOCK,
            payload=_codes(136),
        ),
        3,
        WireLimits(),
    ),
    "push_fp32_chunked": (
        Push(
            fragment=0,
            step=7,
            base_version=1,
            steps=24,
            tokens=1000,
            codec=CodecName.FP32,
            block=128,
            element_count=300,
            clock=CLOCK,
            payload=np.linspace(-1, 1, 300, dtype="<f4"),
        ),
        4,
        SMALL,
    ),
    "init": (
        Init(fragment=1, element_count=4, clock={}, payload=np.array([0.5, -2.0, 3.25, 0.0], dtype="<f4")),
        5,
        WireLimits(),
    ),
    "update_bf16": (
        Update(
            fragment=1,
            version=5,
            codec=CodecName.BF16,
            element_count=6,
            clock=CLOCK,
            global_step=57,
            payload=_codes(12),
        ),
        10,
        WireLimits(),
    ),
    # protocol 2: the int4 delta of version 6 onto the published copy of version 5 (8 elements in
    # blocks of 4: two float32 scales, then four bytes of codes); protocol 3: with the global step
    "update_delta_int4": (
        Update(
            fragment=1,
            version=6,
            codec=CodecName.INT4,
            element_count=8,
            clock=CLOCK,
            global_step=60,
            payload=np.array([0.5, 0.25], dtype="<f4").tobytes() + _codes(4),
            base_version=5,
            block=4,
        ),
        13,
        WireLimits(),
    ),
    "error": (Error(code=ErrorCode.STALE, text="fragment 2: base version 3, current 4", fatal=False), 11, WireLimits()),
    "bye": (Bye(reason="training finished"), 12, WireLimits()),
}


def _frames(name: str) -> list[bytes]:
    message, message_id, limits = CASES[name]
    return [bytes(f) for f in encode(message, message_id=message_id, limits=limits)]


def _read_golden(name: str) -> list[bytes]:
    lines = (GOLDEN_DIR / f"{name}.hex").read_text().split()
    return [bytes.fromhex(line) for line in lines]


@pytest.mark.parametrize("name", sorted(CASES))
def test_encoding_matches_golden_bytes(name: str) -> None:
    frames = _frames(name)
    path = GOLDEN_DIR / f"{name}.hex"
    if WRITE_GOLDEN:
        GOLDEN_DIR.mkdir(exist_ok=True)
        path.write_text("".join(f.hex() + "\n" for f in frames))
        pytest.fail(f"rewrote {path.name} because DDILOCO_WRITE_GOLDEN=1; rerun without it")
    assert frames == _read_golden(name)


@pytest.mark.parametrize("name", sorted(CASES))
def test_golden_bytes_decode_to_the_message(name: str) -> None:
    message, _, limits = CASES[name]
    reassembler = Reassembler(limits)
    results = [reassembler.feed(frame) for frame in _read_golden(name)]
    assert results[:-1] == [None] * (len(results) - 1)
    assert results[-1] == message


def _unpack_documented_header(frame: bytes) -> dict:
    """Header fields at the offsets docs/protocol.md gives, read one by one."""
    return {
        "magic": frame[0:4],
        "version": frame[4],
        "kind": frame[5],
        "flags": struct.unpack_from("<H", frame, 6)[0],
        "message_id": struct.unpack_from("<Q", frame, 8)[0],
        "chunk_index": struct.unpack_from("<I", frame, 16)[0],
        "chunk_count": struct.unpack_from("<I", frame, 20)[0],
        "chunk_offset": struct.unpack_from("<Q", frame, 24)[0],
        "payload_bytes": struct.unpack_from("<Q", frame, 32)[0],
        "meta_bytes": struct.unpack_from("<I", frame, 40)[0],
        "crc32": struct.unpack_from("<I", frame, 44)[0],
    }


def test_push_header_and_body_match_the_document() -> None:
    (frame,) = _read_golden("push_int4")
    header = _unpack_documented_header(frame)
    assert header["magic"] == b"DDLC"
    assert header["version"] == 3
    assert header["kind"] == 5  # push, per the kind table (4, the request of protocol 1, is retired)
    assert header["flags"] == 0
    assert header["message_id"] == 3
    assert (header["chunk_index"], header["chunk_count"], header["chunk_offset"]) == (0, 1, 0)
    assert header["payload_bytes"] == 136
    assert header["meta_bytes"] % 8 == 0
    assert len(frame) == 48 + header["meta_bytes"] + 136
    assert header["crc32"] == zlib.crc32(frame[:44] + frame[48:])
    meta = orjson.loads(frame[48 : 48 + header["meta_bytes"]])
    assert meta["step"] == 41 and meta["base_version"] == 3 and "round" not in meta


def test_chunked_push_headers_match_the_document() -> None:
    frames = _read_golden("push_fp32_chunked")
    headers = [_unpack_documented_header(f) for f in frames]
    payload_bytes = 300 * 4
    meta_bytes = headers[0]["meta_bytes"]
    assert len(frames) == -(-(meta_bytes + payload_bytes) // (512 - 48))
    offset = 0
    for index, (frame, header) in enumerate(zip(frames, headers, strict=True)):
        assert header["kind"] == 5  # push
        assert (header["chunk_index"], header["chunk_count"]) == (index, len(frames))
        assert header["chunk_offset"] == offset
        assert header["payload_bytes"] == payload_bytes
        assert header["meta_bytes"] == meta_bytes
        assert header["crc32"] == zlib.crc32(frame[:44] + frame[48:])
        assert len(frame) <= 512
        offset += len(frame) - 48
    assert offset == meta_bytes + payload_bytes
    body = b"".join(f[48:] for f in frames)
    assert body[meta_bytes:] == np.linspace(-1, 1, 300, dtype="<f4").tobytes()
    assert orjson.loads(body[:meta_bytes])["element_count"] == 300


def test_single_frame_payload_starts_8_byte_aligned() -> None:
    (frame,) = _read_golden("push_int4")
    header = _unpack_documented_header(frame)
    start = 48 + header["meta_bytes"]
    assert start % 8 == 0
    assert frame[start:] == _codes(136)


def test_an_update_carries_the_syncers_global_step_from_version_3_on() -> None:
    (frame,) = _read_golden("update_delta_int4")
    header = _unpack_documented_header(frame)
    assert header["version"] == 3 and header["kind"] == 7
    meta = orjson.loads(frame[48 : 48 + header["meta_bytes"]])
    assert meta["global_step"] == 60 and meta["base_version"] == 5
