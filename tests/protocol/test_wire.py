"""The frame codec (``burncoll/protocol/wire.py``): round trips, rejections and fuzzing."""

from __future__ import annotations

import json
import struct

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from burncoll.dtypes import SUPPORTED_DTYPES
from burncoll.errors import ProtocolError
from burncoll.ops import OpKind, ReduceOp
from burncoll.protocol.wire import (
    CONTROL_LIMIT,
    FIXED_HEADER_BYTES,
    MAX_NDIM,
    DataHeader,
    Frame,
    FrameType,
    decode,
    encode_control,
    encode_data_header,
)


def _header(
    op_kind: OpKind, dtype: str | None, shape: tuple[int, ...], **fields: int
) -> DataHeader:
    values = {"session": 7, "seq": 2**40 + 3, "root": -1, "src": 3, "round": 9, "channel": 2}
    values |= {"chunk": 5, "offset": 128, "chunk_bytes": 4096} | fields
    reduce_op = ReduceOp.SUM if op_kind in (OpKind.ALL_REDUCE, OpKind.REDUCE) else None
    return DataHeader(op_kind=op_kind, reduce_op=reduce_op, dtype=dtype, shape=shape, **values)


def _frame(header: DataHeader, payload: bytes) -> bytes:
    return encode_data_header(header, len(payload)) + payload


def _reencoded(frame: Frame) -> bytes:
    assert frame.header is not None
    return encode_data_header(frame.header, len(frame.payload)) + bytes(frame.payload)


@pytest.mark.parametrize("ndim", range(9))
@pytest.mark.parametrize("op_kind", list(OpKind))
def test_data_headers_round_trip_for_every_op_dtype_and_ndim(op_kind: OpKind, ndim: int) -> None:
    shape = tuple(range(2, 2 + ndim))
    payload = bytes(range(100))
    for dtype in [*SUPPORTED_DTYPES, None]:
        header = _header(op_kind, dtype, shape)
        frame = decode(_frame(header, payload))
        assert frame.frame_type is FrameType.DATA and frame.control is None
        assert frame.header == header
        assert bytes(frame.payload) == payload


@pytest.mark.parametrize("reduce_op", [*ReduceOp, None])
def test_every_reduce_op_and_extreme_field_values_round_trip(reduce_op: ReduceOp | None) -> None:
    header = DataHeader(
        session=2**64 - 1,
        seq=0,
        op_kind=OpKind.REDUCE_SCATTER,
        reduce_op=reduce_op,
        dtype="bfloat16",
        shape=(0, 2**63, 1),
        root=-(2**63),
        src=2**31 - 1,
        round=2**16 - 1,
        channel=2**16 - 1,
        chunk=2**32 - 1,
        offset=0,
        chunk_bytes=0,
    )
    assert decode(_frame(header, b"")).header == header


def test_control_frames_round_trip() -> None:
    message = {"type": "register", "node": 3, "peers": [1, 2], "addr": "10.0.0.1:5000", "ok": True}
    frame = decode(encode_control(message, session=42))
    assert frame.frame_type is FrameType.CONTROL and frame.header is None
    assert frame.control == message


def test_decode_accepts_any_bytes_like_object() -> None:
    raw = encode_control({"type": "x"})
    for buffer in (raw, bytearray(raw), memoryview(raw)):
        assert decode(buffer).control == {"type": "x"}


def _corrupt(raw: bytes, offset: int, fmt: str, value: int) -> bytes:
    out = bytearray(raw)
    struct.pack_into(fmt, out, offset, value)
    return bytes(out)


_VALID = _frame(_header(OpKind.ALL_REDUCE, "float32", (4,)), bytes(16))


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        (b"", "shorter than the header"),
        (_VALID[: FIXED_HEADER_BYTES - 1], "shorter than the header"),
        (b"XX" + _VALID[2:], "bad magic"),
        (_corrupt(_VALID, 2, "<B", 9), "version 9"),
        (_corrupt(_VALID, 3, "<B", 7), "unknown frame type"),
        (_corrupt(_VALID, 20, "<B", 99), "unknown operation"),
        (_corrupt(_VALID, 21, "<B", 99), "unknown reduce op"),
        (_corrupt(_VALID, 22, "<B", 99), "unknown dtype"),
        (_corrupt(_VALID, 23, "<B", MAX_NDIM + 1), "ndim"),
        (_VALID + b"extra", "announces"),
        (_VALID[:-1], "announces"),
        (_corrupt(_VALID, 52, "<Q", 8), "overruns its chunk"),
        (encode_control({"type": "x"})[:-1] + b"!", "not valid JSON"),
        (encode_control({"kind": "x"}), "string 'type'"),
    ],
)
def test_malformed_frames_raise_protocol_error_saying_why(raw: bytes, message: str) -> None:
    with pytest.raises(ProtocolError, match=message):
        decode(raw)


def _control_frame_with_body(body: bytes) -> bytes:
    template = encode_control({"type": "x"})
    header = bytearray(template[:FIXED_HEADER_BYTES])
    struct.pack_into("<QQ", header, 52, len(body), len(body))
    return bytes(header) + body


@pytest.mark.parametrize(
    "body",
    [
        pytest.param(b"[" * 100_000 + b"]" * 100_000, id="deeply-nested"),
        pytest.param(b'{"type": "x", "n": ' + b"9" * 5000 + b"}", id="huge-integer"),
        pytest.param(b"\xff\xfe\x00", id="not-utf8"),
        pytest.param(b"[1, 2]", id="not-an-object"),
    ],
)
def test_hostile_control_bodies_raise_protocol_error(body: bytes) -> None:
    with pytest.raises(ProtocolError):
        decode(_control_frame_with_body(body))


def test_oversized_control_messages_are_refused_both_ways() -> None:
    with pytest.raises(ProtocolError):
        encode_control({"type": "x", "blob": "a" * CONTROL_LIMIT})
    with pytest.raises(ProtocolError):
        decode(_control_frame_with_body(b" " * (CONTROL_LIMIT + 1)))


def test_too_many_dimensions_cannot_be_encoded() -> None:
    with pytest.raises(ProtocolError):
        encode_data_header(_header(OpKind.BROADCAST, "int8", (1,) * (MAX_NDIM + 1)), 0)


def _check_decode_is_total(raw: bytes) -> None:
    """``decode`` raises ProtocolError or returns a frame that encodes back consistently."""
    try:
        frame = decode(raw)
    except ProtocolError:
        return
    if frame.frame_type is FrameType.DATA:
        assert _reencoded(frame) == raw
    else:
        assert frame.control is not None
        again = decode(encode_control(frame.control)).control
        assert json.dumps(again, sort_keys=True) == json.dumps(frame.control, sort_keys=True)


_FUZZ = settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@_FUZZ
@given(st.binary(max_size=400))
def test_decode_of_arbitrary_bytes_never_raises_anything_else(raw: bytes) -> None:
    _check_decode_is_total(raw)


@_FUZZ
@given(st.binary(min_size=FIXED_HEADER_BYTES - 8, max_size=300))
def test_decode_of_arbitrary_bytes_behind_a_valid_magic_and_version(tail: bytes) -> None:
    _check_decode_is_total(b"BC\x01" + tail)


_shapes = st.lists(st.integers(0, 2**64 - 1), max_size=8).map(tuple)
_headers = st.builds(
    DataHeader,
    session=st.integers(0, 2**64 - 1),
    seq=st.integers(0, 2**64 - 1),
    op_kind=st.sampled_from(OpKind),
    reduce_op=st.sampled_from([*ReduceOp, None]),
    dtype=st.sampled_from([*SUPPORTED_DTYPES, None]),
    shape=_shapes,
    root=st.integers(-(2**63), 2**63 - 1),
    src=st.integers(-(2**31), 2**31 - 1),
    round=st.integers(0, 2**16 - 1),
    channel=st.integers(0, 2**16 - 1),
    chunk=st.integers(0, 2**32 - 1),
    offset=st.just(0),
    chunk_bytes=st.integers(64, 2**40),
)
_json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=10),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=5), inner),
    max_leaves=10,
)
_controls = st.dictionaries(st.text(max_size=8), _json_values, max_size=4).map(
    lambda d: {**d, "type": "fuzz"}
)
_valid_frames = st.one_of(
    st.tuples(_headers, st.binary(max_size=64)).map(lambda hp: _frame(*hp)),
    _controls.map(encode_control),
)


@st.composite
def _damaged(draw: st.DrawFn) -> bytes:
    """A valid frame with some bytes flipped, then maybe truncated or extended."""
    raw = bytearray(draw(_valid_frames))
    for _ in range(draw(st.integers(0, 4))):
        index = draw(st.integers(0, len(raw) - 1))
        raw[index] ^= draw(st.integers(1, 255))
    cut = draw(st.sampled_from(["none", "truncate", "extend"]))
    if cut == "truncate":
        del raw[draw(st.integers(0, len(raw))) :]
    elif cut == "extend":
        raw += draw(st.binary(min_size=1, max_size=16))
    return bytes(raw)


@_FUZZ
@given(_valid_frames)
def test_valid_frames_decode_and_encode_back(raw: bytes) -> None:
    frame = decode(raw)
    _check_decode_is_total(raw)
    assert frame.frame_type in (FrameType.DATA, FrameType.CONTROL)


@_FUZZ
@given(_damaged())
def test_damaged_frames_raise_only_protocol_error(raw: bytes) -> None:
    _check_decode_is_total(raw)
