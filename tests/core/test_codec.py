import re
import struct

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ddiloco.core import codec
from ddiloco.core.codec import Codec, CodecError


def gaussian(n, seed=0):
    return np.random.default_rng(seed).standard_normal(n).astype(np.float32)


@pytest.mark.parametrize("name", [c.value for c in Codec])
def test_round_trip_and_header(name):
    x = gaussian(1024)
    payload = codec.encode(x, name)
    enc = codec.parse(payload, elements=1024)
    assert enc.codec.value == name and enc.elements == 1024
    y = enc.decode()
    rel = np.sqrt(np.mean((y - x) ** 2) / np.mean(x**2))
    bound = {"fp32": 0.0, "bf16": 0.005, "int4": 0.13, "int2": 0.8, "int1": 0.9}[name]
    assert rel <= bound, rel
    assert len(payload) == codec.HEADER_BYTES + Codec(name).body_bytes(1024, 128 if Codec(name).is_block else 0)


@pytest.mark.parametrize("name", [c.value for c in Codec])
def test_an_encoded_value_is_a_view_over_its_body_and_its_header_is_the_encoders(name):
    payload = codec.encode(gaussian(512, 2), name)
    enc = codec.parse(payload)
    assert enc.body.readonly and bytes(enc.body) == payload[codec.HEADER_BYTES :]
    assert enc.header() + bytes(enc.body) == payload
    again = codec.from_body(name, enc.block, enc.elements, enc.body)  # what the syncer makes of a wire body
    assert np.shares_memory(again.data, enc.data)
    np.testing.assert_array_equal(again.decode(), enc.decode())


@pytest.mark.parametrize("name", [c.value for c in Codec])
def test_fused_paths_match_decode(name):
    x = gaussian(512, 1)
    enc = codec.parse(codec.encode(x, name))
    y = enc.decode().astype(np.float64)
    acc = np.full(512, 0.5, dtype=np.float32)
    enc.accumulate_into(acc, 0.25)
    np.testing.assert_allclose(acc, 0.5 + 0.25 * y, rtol=1e-5, atol=1e-6)
    offsets = np.array([0, 100, 300, 500], dtype=np.int64)
    sumsq = enc.segment_sumsq(offsets)
    want = [np.sum(y[a:b] ** 2) for a, b in zip(offsets, offsets[1:])]
    np.testing.assert_allclose(sumsq, want, rtol=1e-5)
    norms = np.sqrt(sumsq)
    acc = np.zeros(512, dtype=np.float32)
    enc.rda_accumulate_into(acc, 2.0, offsets, norms)
    for i, (a, b) in enumerate(zip(offsets, offsets[1:])):
        np.testing.assert_allclose(acc[a:b], 2.0 * y[a:b] / norms[i], rtol=1e-5, atol=1e-6)
    assert not acc[500:].any()
    assert enc.all_finite()


def test_parse_is_zero_copy():
    payload = bytearray(codec.encode(gaussian(256), "fp32"))
    enc = codec.parse(payload)
    assert np.shares_memory(enc.data, np.frombuffer(payload, dtype=np.uint8))


def test_encode_refuses_nan_and_bad_lengths():
    x = gaussian(256)
    x[3] = np.nan
    with pytest.raises(CodecError, match="NaN"):
        codec.encode(x, "int4")
    with pytest.raises(CodecError, match="multiple of the block"):
        codec.encode(gaussian(200), "int4")
    with pytest.raises(CodecError, match="1-D float32"):
        codec.encode(gaussian(256).astype(np.float64), "fp32")
    with pytest.raises(CodecError, match="unknown codec"):
        codec.encode(gaussian(256), "int3")


def test_non_finite_payload_detected():
    x = gaussian(256)
    raw = bytearray(codec.encode(x, "fp32"))
    raw[codec.HEADER_BYTES : codec.HEADER_BYTES + 4] = np.float32(np.inf).tobytes()
    assert not codec.parse(raw).all_finite()
    raw = bytearray(codec.encode(x, "int4"))
    raw[codec.HEADER_BYTES : codec.HEADER_BYTES + 4] = np.float32(np.nan).tobytes()  # first scale
    assert not codec.parse(raw).all_finite()


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda b: b[:10], "shorter than"),
        (lambda b: b"XXXX" + b[4:], "magic"),
        (lambda b: b[:5] + bytes([99]) + b[6:], "unknown codec id"),
        (lambda b: b[:-1], "body"),
        (lambda b: b + b"\0", "body"),
    ],
)
def test_parse_refuses_malformed(mutate, message):
    payload = codec.encode(gaussian(256), "int4")
    with pytest.raises(CodecError, match=message):
        codec.parse(mutate(payload))


@pytest.mark.parametrize("name", ["int4", "int2", "int1"])
def test_negative_block_scale_is_refused_at_parse(name):
    # it passed all_finite, then the merge kernel refused it and the syncer core stopped (ddiloco fuzz)
    raw = bytearray(codec.encode(gaussian(256), name))
    raw[codec.HEADER_BYTES : codec.HEADER_BYTES + 4] = np.float32(-0.5).tobytes()  # first scale
    with pytest.raises(CodecError, match="negative block scale"):
        codec.parse(raw)
    raw[codec.HEADER_BYTES : codec.HEADER_BYTES + 4] = np.float32(-0.0).tobytes()  # a zero scale, sign and all
    assert codec.parse(raw).all_finite()


def test_parse_refuses_unexpected_size():
    with pytest.raises(CodecError, match="expected 512"):
        codec.parse(codec.encode(gaussian(256), "int4"), elements=512)


# The payload header, written out here from the layout table in core/codec.py's docstring rather than
# taken from the module, so that the tests below check parse against the specification, not against itself.
HEADER = struct.Struct("<4sBBHIQI")  # magic, format, codec id, reserved, block, elements, body bytes
IDENTS = {1: "fp32", 2: "bf16", 3: "int4", 4: "int2", 5: "int1"}
CODES_PER_BYTE = {"int4": 2, "int2": 4, "int1": 8}


def body_bytes(name: str, n: int, block: int) -> int:
    if name == "fp32":
        return 4 * n
    if name == "bf16":
        return 2 * n
    return 4 * (n // block) + n // CODES_PER_BYTE[name]


def expected(buf: bytes, elements: int | None = None) -> str | tuple[str, int, int]:
    """What parse must do with `buf`: the regex its CodecError must match (the first check that
    fails, in the order of the specification), or (codec, block, elements) of the payload it accepts."""
    if len(buf) < 24:
        return "shorter than the 24-byte codec header"
    magic, fmt, ident, reserved, block, n, size = HEADER.unpack_from(buf)
    if magic != b"DDCF":
        return "bad codec magic"
    if fmt != 1 or reserved != 0:
        return "is not format 1"
    if ident not in IDENTS:
        return f"unknown codec id {ident}"
    name = IDENTS[ident]
    if size != len(buf) - 24:
        return f"header says the body has {size} bytes"
    if n > 2**31 - 1:
        return "above the limit"
    if elements is not None and n != elements:
        return f"expected {elements}"
    if name in CODES_PER_BYTE:
        multiple = max(2, CODES_PER_BYTE[name])
        if block <= 0 or block % multiple or block > 1 << 20:
            return f"block must be a positive multiple of {multiple}"
        if n % block:
            return "is not a multiple of the block"
    elif block != 0:
        return f"declares block {block}, expected 0"
    if size != body_bytes(name, n, block):
        return f"needs a {body_bytes(name, n, block)}-byte body"
    if block and (np.frombuffer(buf, np.float32, n // block, 24) < 0).any():
        return "negative block scale"  # the quantizers never write one (a NaN is all_finite's to refuse)
    return name, block, n


def check_parse(buf: bytes, elements: int | None = None) -> None:
    want = expected(buf, elements)
    if isinstance(want, str):
        with pytest.raises(CodecError, match=re.escape(want)):
            codec.parse(buf, elements=elements)
        return
    enc = codec.parse(buf, elements=elements)
    name, block, n = want
    assert (enc.codec.value, enc.block, enc.elements) == (name, block, n)
    # the views cover the body exactly: scales first, then the codes (block codecs) or the values
    body = buf[24:]
    nscales = 4 * (n // block) if block else 0
    assert (b"" if enc.scales is None else enc.scales.tobytes()) == body[:nscales]
    assert enc.data.tobytes() == body[nscales:]
    assert (enc.scales is None) == (block == 0)


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=200))
def test_parse_refuses_garbage_with_the_reason(data):
    check_parse(data)


FAULTS = (
    "none",
    "magic",
    "format",
    "reserved",
    "codec id",
    "block",
    "elements",
    "declared size",
    "short body",
    "long body",
    "receiver expects another size",
)


@st.composite
def near_valid_payloads(draw):
    """A valid payload (random body bytes) with at most one fault put into it, and the size the
    receiver expects (None: any)."""
    ident = draw(st.sampled_from(sorted(IDENTS)))
    name = IDENTS[ident]
    multiple = max(2, CODES_PER_BYTE.get(name, 1))
    block = multiple * draw(st.integers(1, 16)) if name in CODES_PER_BYTE else 0
    n = (block or 1) * draw(st.integers(0, 8))
    valid_block, valid_n = block, n
    magic, fmt, reserved, size = b"DDCF", 1, 0, body_bytes(name, n, block)
    elements = draw(st.sampled_from([None, n]))
    fault = draw(st.sampled_from(FAULTS))
    if fault == "magic":
        magic = draw(st.binary(min_size=4, max_size=4))
    elif fault == "format":
        fmt = draw(st.integers(0, 255))
    elif fault == "reserved":
        reserved = draw(st.integers(0, 2**16 - 1))
    elif fault == "codec id":
        ident = draw(st.integers(0, 255))
    elif fault == "block":
        block = draw(st.integers(0, 2**32 - 1))
    elif fault == "elements":
        n = draw(st.integers(0, 2**64 - 1))
    elif fault == "declared size":
        size = draw(st.integers(0, 2**32 - 1))
    elif fault == "receiver expects another size":
        elements = draw(st.integers(0, 2**40))
    # the body is that of the valid payload, one byte short or long (its header then telling the truth)
    body_len = max(0, body_bytes(name, valid_n, valid_block) + {"short body": -1, "long body": 1}.get(fault, 0))
    body = draw(st.binary(min_size=body_len, max_size=body_len))
    if fault in ("short body", "long body"):
        size = body_len
    return HEADER.pack(magic, fmt, ident, reserved, block, n, size) + body, elements


@settings(max_examples=400, deadline=None)
@given(near_valid_payloads())
def test_parse_accepts_exactly_the_payloads_the_specification_allows(case):
    buf, elements = case
    check_parse(buf, elements)


@pytest.mark.parametrize("name", [c.value for c in Codec])
def test_every_encoded_payload_is_one_the_specification_accepts(name):
    payload = codec.encode(gaussian(256), name, 32)
    assert expected(payload, 256) == (name, 32 if Codec(name).is_block else 0, 256)
    check_parse(payload, 256)


def test_error_feedback_carries_what_was_lost():
    x = gaussian(1024, 3) * 0.01
    state = codec.feedback_init(1024)
    total_sent = np.zeros(1024, dtype=np.float64)
    for _ in range(20):
        payload, state = codec.encode_with_feedback(x, state, "int1")
        total_sent += codec.parse(payload).decode()
    # with feedback, what was sent over 20 rounds tracks 20 x the true vector up to one residual
    np.testing.assert_allclose(total_sent + state.residual, 20 * x.astype(np.float64), rtol=1e-4, atol=1e-5)
    plain = 20 * codec.parse(codec.encode(x, "int1")).decode()
    assert np.linalg.norm(total_sent - 20 * x) < 0.5 * np.linalg.norm(plain - 20 * x)


@pytest.mark.parametrize("name", [c.value for c in Codec])
@pytest.mark.parametrize("feedback", [False, True])
def test_encode_delta_is_encode_of_the_difference(name, feedback):
    # int4 takes the one-pass kernel; every codec gives the bytes (and residual) of the plain path,
    # with or without the thread pool
    n = 1 << 17
    base, theta = gaussian(n, 3), gaussian(n, 4)
    state = codec.FeedbackState(gaussian(n, 5) * np.float32(0.01)) if feedback else None
    for parallel in (True, False):
        payload, new_state = codec.encode_delta(base, theta, state, name, parallel=parallel)
        if feedback:
            want, want_state = codec.encode_with_feedback(base - theta, state, name, parallel=parallel)
            np.testing.assert_array_equal(new_state.residual, want_state.residual)
        else:
            want = codec.encode(base - theta, name, parallel=parallel)
            assert new_state is None
        assert payload == want


def test_encode_delta_refuses_what_encode_refuses():
    base = gaussian(256)
    theta = base.copy()
    theta[7] = np.inf
    with pytest.raises(CodecError, match="NaN or Inf"):
        codec.encode_delta(base, theta, codec.feedback_init(256), "int4")
    with pytest.raises(CodecError, match="shape"):
        codec.encode_delta(base, base[:128], None, "int4")
    with pytest.raises(CodecError, match="not a multiple of the block"):
        codec.encode_delta(gaussian(200), gaussian(200), None, "int4")
