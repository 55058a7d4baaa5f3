"""The frame codec: round trips in every chunking, zero-copy large frames, hostile input."""

from __future__ import annotations

import ctypes

import json
import struct

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from statetier.protocol.errors import ERRORS_BY_CODE, FrameTooLarge, MalformedFrame, ProtocolError, UnsupportedProtocol
from statetier.protocol.frames import (DEFAULT_MAX_FRAME, FLAG_ERROR, HEADER_SIZE, PROTOCOL_VERSIONS, Frame,
                                       FrameDecoder, Op, encode_frame, encode_frame_bytes, error_frame, hello_frame,
                                       hello_ok_frame, negotiate, raise_for_error)

FAST = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
SLOW = settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])

json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=10),
    lambda inner: st.lists(inner, max_size=3)
    | st.dictionaries(st.text(max_size=5), inner, max_size=3),
    max_leaves=8,
)


@st.composite
def frames(draw, max_data: int = 300) -> Frame:
    op = draw(st.sampled_from(Op))
    flags = FLAG_ERROR if op is Op.ERROR else draw(st.sampled_from([0, FLAG_ERROR]))
    return Frame(
        op=op,
        request_id=draw(st.integers(0, 2**64 - 1)),
        meta=draw(st.dictionaries(st.text(max_size=8), json_values, max_size=4)),
        data=draw(st.binary(max_size=max_data)),
        flags=flags,
    )


def split(blob: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({0, len(blob), *(c % (len(blob) + 1) for c in cuts)})
    return [blob[a:b] for a, b in zip(points, points[1:])]


def feed_chunks(decoder: FrameDecoder, chunks: list[bytes]) -> list[Frame]:
    out: list[Frame] = []
    for chunk in chunks:
        out += decoder.feed(chunk)
    return out


def receive_into(decoder: FrameDecoder, blob: bytes, recv_sizes: list[int]) -> list[Frame]:
    """Drive get_buffer/buffer_updated like asyncio's BufferedProtocol with short reads."""
    out: list[Frame] = []
    pos, turn = 0, 0
    while pos < len(blob):
        buf = decoder.get_buffer(-1)
        assert len(buf) > 0 and not buf.readonly
        want = recv_sizes[turn % len(recv_sizes)] if recv_sizes else len(blob)
        n = min(len(buf), want, len(blob) - pos)
        buf[:n] = blob[pos : pos + n]
        out += decoder.buffer_updated(n)
        pos, turn = pos + n, turn + 1
    return out


def raw_frame(length=None, op=1, flags=0, reserved=0, meta=b"{}", data=b"", meta_len=None):
    """A frame built by hand, so that any field can be wrong (request_id is 1)."""
    meta_len = len(meta) if meta_len is None else meta_len
    length = 16 + len(meta) + len(data) if length is None else length
    return struct.pack("<IBBHQI", length, op, flags, reserved, 1, meta_len) + meta + data


# -- round trips ------------------------------------------------------------------------


@FAST
@given(batch=st.lists(frames(), min_size=1, max_size=4))
def test_frames_round_trip_fed_whole_and_byte_by_byte(batch):
    blob = b"".join(encode_frame_bytes(f) for f in batch)
    assert FrameDecoder().feed(blob) == batch
    decoder = FrameDecoder()
    assert feed_chunks(decoder, [blob[i : i + 1] for i in range(len(blob))]) == batch
    assert decoder.feed(b"") == []


@FAST
@given(
    batch=st.lists(frames(), min_size=1, max_size=4),
    cuts=st.lists(st.integers(0, 10**6), max_size=12),
)
def test_frames_round_trip_in_any_chunking(batch, cuts):
    blob = b"".join(encode_frame_bytes(f) for f in batch)
    assert feed_chunks(FrameDecoder(), split(blob, cuts)) == batch


@FAST
@given(
    batch=st.lists(frames(), min_size=1, max_size=4),
    sizes=st.lists(st.integers(1, 64), max_size=8),
)
def test_frames_round_trip_through_get_buffer(batch, sizes):
    blob = b"".join(encode_frame_bytes(f) for f in batch)
    assert receive_into(FrameDecoder(), blob, sizes) == batch


AROUND_THRESHOLD = st.sampled_from([0, 65_000, 65_513, 65_514, 65_515, 200_000])


@SLOW
@given(
    sizes=st.lists(AROUND_THRESHOLD, min_size=1, max_size=4),
    cuts=st.lists(st.integers(0, 10**6), max_size=8),
    recv=st.lists(st.integers(1, 300_000), max_size=4),
)
def test_frames_around_the_large_frame_threshold(sizes, cuts, recv):
    # With meta "{}" a frame is 22 + data bytes: 65_514 is the last small one.
    batch = [Frame(Op.PUT, i + 1, {}, bytes([i]) * n) for i, n in enumerate(sizes)]
    blob = b"".join(encode_frame_bytes(f) for f in batch)
    assert feed_chunks(FrameDecoder(), split(blob, cuts)) == batch
    assert receive_into(FrameDecoder(), blob, recv) == batch


def test_several_frames_in_one_feed_and_a_partial_tail():
    batch = [
        hello_frame(tenant="t1", token="s3cret"),
        Frame(Op.PUT, 7, {"kind": "ssm", "layer": 3}, b"\x00\x01payload"),
        Frame(Op.REPLY, 7, {"ok": True}),
    ]
    blob = b"".join(encode_frame_bytes(f) for f in batch)
    decoder = FrameDecoder()
    assert decoder.feed(blob + blob[:5]) == batch
    assert decoder.feed(blob[5:]) == batch


def test_large_frame_is_received_into_its_own_buffer_without_copy():
    payload = bytes(range(256)) * (5 * 1024 * 1024 // 256)
    frame = Frame(Op.PUT, 42, {"state_id": "ab" * 16}, payload)
    head, data = encode_frame(frame)
    assert data is payload  # encode does not copy the payload either
    decoder = FrameDecoder()
    assert decoder.feed(head[:HEADER_SIZE]) == []
    buf = decoder.get_buffer(-1)
    body = buf.obj
    assert len(buf) == len(body) == len(head) - HEADER_SIZE + len(payload)  # exactly this frame
    meta_len = len(head) - HEADER_SIZE
    buf[:meta_len] = head[HEADER_SIZE:]
    assert decoder.buffer_updated(meta_len) == []
    buf = decoder.get_buffer(-1)
    assert buf.obj is body and len(buf) == len(payload)
    buf[:] = payload
    (received,) = decoder.buffer_updated(len(payload))
    assert isinstance(received.data, memoryview)
    assert received.data.obj is body
    assert received.data == payload
    assert received == frame


def test_large_frame_fed_whole_lands_in_a_body_buffer_not_the_scratch():
    payload = b"\xa5" * (5 * 1024 * 1024)
    frame = Frame(Op.LOAD, 3, {}, payload)
    (received,) = FrameDecoder().feed(encode_frame_bytes(frame))
    assert isinstance(received.data.obj, ctypes.Array)  # recycled memory (protocol.recycled), from 1 MiB
    assert len(received.data.obj) == len(payload)  # an empty meta takes no bytes
    small = Frame(Op.LOAD, 4, {}, b"\x5a" * (512 * 1024))  # large (> 64 KiB), below the recycled size
    (received_small,) = FrameDecoder().feed(encode_frame_bytes(small))
    assert isinstance(received_small.data.obj, bytearray) and received_small == small
    assert received == frame


def test_encode_flattens_typed_views_and_omits_empty_data():
    words = memoryview(bytearray(b"\x01\x00\x02\x00")).cast("H")
    head, data = encode_frame(Frame(Op.PUT, 1, {}, words))
    assert data.format == "B" and bytes(data) == b"\x01\x00\x02\x00"
    assert FrameDecoder().feed(head + bytes(data))[0].data == b"\x01\x00\x02\x00"
    assert encode_frame(Frame(Op.PING, 1, {})) == [raw_frame(op=int(Op.PING), meta=b"")]


def test_wire_layout_is_little_endian_as_documented():
    blob = encode_frame_bytes(Frame(Op.PUT, 0x0102030405060708, {"a": 1}, b"xyz"))
    assert blob == (
        bytes([26, 0, 0, 0])  # length: 16 + 7 + 3
        + bytes([10, 0, 0, 0])  # opcode PUT, flags, reserved
        + bytes([8, 7, 6, 5, 4, 3, 2, 1])  # request_id
        + bytes([7, 0, 0, 0])  # meta_len
        + b'{"a":1}xyz'
    )


# -- limits and malformed input ---------------------------------------------------------


def test_oversized_length_prefix_fails_before_the_body_arrives():
    decoder = FrameDecoder(max_frame_size=1024 * 1024)
    with pytest.raises(FrameTooLarge) as info:
        decoder.feed(struct.pack("<I", 2 * 1024 * 1024))  # 4 bytes: nothing more is awaited
    assert info.value.detail == {"size": 2 * 1024 * 1024 + 4, "limit": 1024 * 1024}
    with pytest.raises(FrameTooLarge):
        decoder.feed(b"")
    with pytest.raises(FrameTooLarge):
        FrameDecoder().feed(b"\xff\xff\xff\xff")


def test_size_limit_counts_the_whole_frame():
    exact = Frame(Op.PUT, 1, {}, b"x" * 80)  # 20 + 0 (no meta) + 80 = 100 bytes
    assert len(encode_frame_bytes(exact)) == 100
    assert FrameDecoder(max_frame_size=100).feed(encode_frame_bytes(exact)) == [exact]
    with pytest.raises(FrameTooLarge):
        FrameDecoder(max_frame_size=99).feed(encode_frame_bytes(exact))
    with pytest.raises(FrameTooLarge):
        encode_frame(exact, max_frame_size=99)
    with pytest.raises(FrameTooLarge):
        encode_frame(Frame(Op.PUT, 1, {}, bytes(DEFAULT_MAX_FRAME)))


@pytest.mark.parametrize(
    "blob",
    [
        pytest.param(raw_frame(length=15) + bytes(20), id="length-shorter-than-header"),
        pytest.param(raw_frame(flags=0x04), id="unknown-flag"),
        pytest.param(raw_frame(flags=0x80), id="high-flag"),
        pytest.param(raw_frame(reserved=1), id="reserved-not-zero"),
        pytest.param(raw_frame(op=0), id="opcode-zero"),
        pytest.param(raw_frame(op=99), id="opcode-unknown"),
        pytest.param(raw_frame(op=int(Op.ERROR)), id="error-op-without-error-flag"),
        pytest.param(raw_frame(meta=b"{}", meta_len=3), id="meta-len-overruns-frame"),
        pytest.param(raw_frame(meta=b"{nope"), id="meta-not-json"),
        pytest.param(raw_frame(meta=b'{"a":"\xff"}'), id="meta-not-utf8"),
        pytest.param(raw_frame(meta='{"a":1}'.encode("utf-16")), id="meta-utf16"),
        pytest.param(raw_frame(meta=b"[1,2]"), id="meta-array"),
        pytest.param(raw_frame(meta=b'"str"'), id="meta-string"),
        pytest.param(raw_frame(meta=b'{"a":NaN}'), id="meta-nan"),
        pytest.param(raw_frame(meta=b'{"a":1,"a":2}'), id="meta-duplicate-key"),
        pytest.param(raw_frame(meta=b"[" * 50_000), id="meta-nested-too-deep"),
        pytest.param(raw_frame(meta=b'{"a":' + b"[" * 100_000), id="large-meta-nested-too-deep"),
    ],
)
def test_malformed_frame_poisons_the_decoder(blob):
    decoder = FrameDecoder()
    good = encode_frame_bytes(Frame(Op.PING, 9, {}))
    with pytest.raises(MalformedFrame):
        decoder.feed(good + blob)
    for _ in range(2):
        with pytest.raises(MalformedFrame, match="earlier error"):
            decoder.feed(good)
    with pytest.raises(MalformedFrame):
        decoder.get_buffer(-1)


def test_header_errors_are_raised_before_the_body_arrives():
    decoder = FrameDecoder()
    with pytest.raises(MalformedFrame, match="opcode"):
        decoder.feed(raw_frame(op=250, meta=b"{}", data=bytes(1_000_000))[:HEADER_SIZE])


@pytest.mark.parametrize(
    "frame",
    [
        pytest.param(Frame(99, 1, {}), id="unknown-op"),
        pytest.param(Frame(Op.PING, -1, {}), id="negative-request-id"),
        pytest.param(Frame(Op.PING, 2**64, {}), id="request-id-over-u64"),
        pytest.param(Frame(Op.PING, 1, {}, flags=4), id="unknown-flag"),
        pytest.param(Frame(Op.ERROR, 1, {}), id="error-without-flag"),
        pytest.param(Frame(Op.PING, 1, [1]), id="meta-not-dict"),
        pytest.param(Frame(Op.PING, 1, {1: "a"}), id="meta-int-key"),
        pytest.param(Frame(Op.PING, 1, {"a": object()}), id="meta-not-json"),
        pytest.param(Frame(Op.PING, 1, {"a": float("nan")}), id="meta-nan"),
    ],
)
def test_unencodable_frames_are_refused(frame):
    with pytest.raises(MalformedFrame):
        encode_frame(frame)


def test_buffer_updated_beyond_the_lent_view_is_misuse():
    decoder = FrameDecoder()
    with pytest.raises(RuntimeError):
        decoder.buffer_updated(1)
    assert len(decoder.get_buffer(-1)) > 0
    assert decoder.buffer_updated(0) == []


# -- fuzz -------------------------------------------------------------------------------


def decode_hostile(blob: bytes, cuts: list[int], max_frame_size: int):
    """Decode until the end or the first error; any error but a ProtocolError escapes."""
    decoder, out = FrameDecoder(max_frame_size=max_frame_size), []
    try:
        for chunk in split(blob, cuts):
            out += decoder.feed(chunk)
    except ProtocolError as exc:
        with pytest.raises(type(exc)):
            decoder.feed(b"\x00")
        return out, exc
    return out, None


header_like_prefixes = st.builds(
    lambda length, op, flags, meta_len: struct.pack("<IBBHQI", length, op, flags, 0, 5, meta_len),
    st.integers(0, 300),
    st.sampled_from([*map(int, Op), 0, 255]),
    st.sampled_from([0, 1, 2]),
    st.integers(0, 300),
)


@FAST
@given(
    valid=st.lists(frames(max_data=40), max_size=3),
    prefix=st.one_of(st.just(b""), header_like_prefixes),
    garbage=st.binary(max_size=300),
    cuts=st.lists(st.integers(0, 10**6), max_size=10),
)
def test_hostile_bytes_only_raise_protocol_errors(valid, prefix, garbage, cuts):
    blob = b"".join(encode_frame_bytes(f) for f in valid) + prefix + garbage
    decoded, error = decode_hostile(blob, cuts, max_frame_size=256)
    assert decoded[: len(valid)] == valid[: len(decoded)]  # valid frames come out unchanged
    if error is None:
        assert len(decoded) >= len(valid)


@FAST
@given(
    frame=frames(max_data=40),
    at=st.integers(0, 10**6),
    value=st.integers(0, 255),
    cuts=st.lists(st.integers(0, 10**6), max_size=6),
)
def test_a_flipped_byte_decodes_or_raises_a_protocol_error(frame, at, value, cuts):
    original = encode_frame_bytes(frame)
    blob = bytearray(original)
    blob[at % len(blob)] = value
    decoded, error = decode_hostile(bytes(blob), cuts, max_frame_size=DEFAULT_MAX_FRAME)
    if bytes(blob) == original:
        assert (decoded, error) == ([frame], None)


# -- handshake and errors ---------------------------------------------------------------


def test_hello_carries_versions_and_fields():
    frame = hello_frame(tenant="acme", token="t0k")
    meta = {"versions": list(PROTOCOL_VERSIONS), "tenant": "acme", "token": "t0k"}
    assert frame == Frame(Op.HELLO, 0, meta)
    (received,) = FrameDecoder().feed(encode_frame_bytes(frame))
    version = negotiate(received.meta["versions"])
    assert version == 3
    assert hello_ok_frame(version) == Frame(Op.HELLO_OK, 0, {"version": 3})


def test_negotiate_picks_the_highest_common_version():
    assert negotiate([1, 2, 3], supported=(1, 2)) == 2
    assert negotiate([5, 1], supported=(1,)) == 1
    with pytest.raises(UnsupportedProtocol):
        negotiate([2, 3], supported=(1,))
    with pytest.raises(UnsupportedProtocol):
        negotiate([])


@pytest.mark.parametrize("offered", [None, "1", 1, [1.0], ["1"], [True], {"1": 1}])
def test_negotiate_refuses_malformed_offers(offered):
    with pytest.raises(MalformedFrame):
        negotiate(offered)


@pytest.mark.parametrize(
    "cls", sorted(ERRORS_BY_CODE.values(), key=lambda c: c.code), ids=lambda c: c.__name__
)
def test_error_frame_round_trip_rebuilds_the_class(cls):
    frame = error_frame(17, cls("slot 3 was reused"))
    assert frame.is_error and frame.op is Op.ERROR
    assert frame.meta == {"code": cls.code, "message": "slot 3 was reused", "reason": cls.reason}
    (received,) = FrameDecoder().feed(encode_frame_bytes(frame))
    with pytest.raises(cls) as info:
        raise_for_error(received)
    assert type(info.value) is cls
    assert info.value.message == "slot 3 was reused"


def test_raise_for_error_ignores_ordinary_frames():
    assert raise_for_error(Frame(Op.REPLY, 1, {"code": 402, "message": "x"})) is None


@pytest.mark.parametrize(
    "meta",
    [
        {},
        {"code": "402", "message": "x"},
        {"code": 402},
        {"code": True, "message": "x"},
        {"code": 402, "message": 5},
    ],
)
def test_raise_for_error_refuses_garbage_error_meta(meta):
    with pytest.raises(MalformedFrame):
        raise_for_error(Frame(Op.ERROR, 1, meta, flags=FLAG_ERROR))


def test_unknown_error_code_becomes_internal_error():
    from statetier.protocol.errors import InternalError

    with pytest.raises(InternalError, match="unknown error code 9999"):
        raise_for_error(Frame(Op.ERROR, 1, {"code": 9999, "message": "?"}, flags=FLAG_ERROR))


def test_meta_json_is_compact():
    head = encode_frame_bytes(Frame(Op.STATS, 1, {"a": [1, 2], "b": "é"}))
    assert head[HEADER_SIZE:] == json.dumps({"a": [1, 2], "b": "é"}, separators=(",", ":")).encode()


@pytest.mark.parametrize("meta", [b'{"token":"\\udc80"}', b'{"a":["ok",{"\\ud800x":1}]}', b'{"s":"\\uDFFF"}'])
def test_meta_with_a_lone_surrogate_escape_is_a_malformed_frame(meta: bytes):
    raw = struct.pack("<IBBHQI", 16 + len(meta), int(Op.HELLO), 0, 0, 1, len(meta)) + meta
    with pytest.raises(MalformedFrame, match="surrogate"):
        FrameDecoder().feed(raw)


def test_meta_with_a_surrogate_pair_escape_is_text():
    meta = b'{"s":"\\ud83d\\ude00"}'
    raw = struct.pack("<IBBHQI", 16 + len(meta), int(Op.HELLO), 0, 0, 1, len(meta)) + meta
    (frame,) = FrameDecoder().feed(raw)
    assert frame.meta == {"s": "\U0001F600"}
