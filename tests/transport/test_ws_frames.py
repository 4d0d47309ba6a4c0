"""RFC 6455 framing without a socket (:mod:`burncoll.transport.ws_frames`).

Every expectation comes from an independent reference: headers built by hand with
:mod:`struct` from the RFC's layout (section 5.2), masking done byte by byte in plain Python
(section 5.3).
"""

from __future__ import annotations

import os
import struct

import pytest

from burncoll.errors import ProtocolError
from burncoll.transport.ws_frames import (
    CLOSE_NORMAL,
    CLOSE_PROTOCOL,
    CLOSE_TOO_BIG,
    CLOSE_UNSUPPORTED,
    MAX_CONTROL_PAYLOAD,
    OP_BINARY,
    OP_CLOSE,
    OP_CONTINUATION,
    OP_PING,
    OP_PONG,
    OP_TEXT,
    FrameError,
    FrameHeader,
    FrameReader,
    close_payload,
    encode_frame,
    frame_header,
    mask_in_place,
    parse_close,
    unmasked,
)

REMOTE = "10.0.0.7:4242"
LIMIT = 1 << 20
KEY = bytes((0x37, 0xFA, 0x21, 0x3D))


# -- the reference -------------------------------------------------------------------------------


def reference_header(opcode: int, size: int, key: bytes | None = None, fin: bool = True,
                     encoding: int | None = None) -> bytes:
    """RFC 6455 section 5.2 by hand: ``encoding`` 7, 16 or 64 forces a length encoding (the
    shortest one when ``None``)."""
    first = (0x80 if fin else 0) | opcode
    flag = 0x80 if key is not None else 0
    if encoding is None:
        encoding = 7 if size <= 125 else 16 if size <= 0xFFFF else 64
    if encoding == 7:
        head = struct.pack("!BB", first, flag | size)
    elif encoding == 16:
        head = struct.pack("!BBH", first, flag | 126, size)
    else:
        head = struct.pack("!BBQ", first, flag | 127, size)
    return head + (key or b"")


def reference_mask(data: bytes, key: bytes) -> bytes:
    """Section 5.3: octet i XOR octet i mod 4 of the key."""
    return bytes(b ^ key[i % 4] for i, b in enumerate(data))


def reader(server: bool = True, limit: int = LIMIT) -> FrameReader:
    """A reader on the server side (masked frames in) unless told, refusals naming REMOTE."""
    frames = FrameReader(server=server, limit=limit)
    frames.remote = REMOTE
    return frames


def header(raw: bytes, frames: FrameReader | None = None) -> FrameHeader | None:
    """``raw``'s header as a reader sees it (a fresh server-side one unless given)."""
    return (frames or reader()).header(memoryview(raw))


def refusal(raw: bytes, frames: FrameReader | None = None) -> FrameError:
    """The refusal of the frame ``raw`` begins with."""
    with pytest.raises(FrameError) as caught:
        header(raw, frames)
    assert isinstance(caught.value, ProtocolError)
    return caught.value


def frames_of(data: bytes, frames: FrameReader) -> list[tuple[FrameHeader, bytes]]:
    """Bytes in, frames out (checked header and unmasked payload), for whole frames end to
    end; each data frame is added to ``frames``' message in progress."""
    out = []
    view = memoryview(data)
    while view:
        head = frames.header(view)
        assert head is not None, "a truncated frame"
        fin, opcode, key, size, length = head
        body = view[length:length + size]
        assert len(body) == size, "a truncated payload"
        payload = bytes(unmasked(body, key))
        out.append((head, payload))
        if opcode < OP_CLOSE:
            frames.add(payload, fin)
        view = view[length + size:]
    return out


# -- lengths ---------------------------------------------------------------------------------------

#: (payload size, the encoding the shortest form uses) at and around every boundary.
LENGTHS = [(0, 7), (1, 7), (125, 7), (126, 16), (127, 16), (65535, 16), (65536, 64),
           (1 << 32, 64), ((1 << 63) - 1, 64)]


@pytest.mark.parametrize(("size", "encoding"), LENGTHS)
@pytest.mark.parametrize("key", [None, KEY], ids=["unmasked", "masked"])
def test_every_length_encoding_is_written_in_its_shortest_form(
        size: int, encoding: int, key: bytes | None) -> None:
    expected = reference_header(OP_BINARY, size, key, encoding=encoding)
    assert frame_header(OP_BINARY, size, key) == expected
    assert len(expected) == {7: 2, 16: 4, 64: 10}[encoding] + (4 if key else 0)


@pytest.mark.parametrize(("size", "encoding"), LENGTHS)
@pytest.mark.parametrize("key", [None, KEY], ids=["unmasked", "masked"])
@pytest.mark.parametrize("fin", [True, False])
def test_every_length_encoding_is_parsed(size: int, encoding: int, key: bytes | None,
                                         fin: bool) -> None:
    raw = reference_header(OP_BINARY, size, key, fin=fin, encoding=encoding)
    frames = reader(server=key is not None, limit=1 << 64)
    assert header(raw + b"payload bytes follow", frames) == (fin, OP_BINARY, key, size, len(raw))


@pytest.mark.parametrize(("size", "encoding"), LENGTHS)
@pytest.mark.parametrize("key", [None, KEY], ids=["unmasked", "masked"])
def test_a_header_cut_short_asks_for_more_bytes(size: int, encoding: int,
                                                key: bytes | None) -> None:
    raw = reference_header(OP_BINARY, size, key, encoding=encoding)
    frames = reader(server=key is not None, limit=1 << 64)
    for cut in range(len(raw)):
        assert header(raw[:cut], frames) is None, cut
    assert header(raw, frames) is not None


@pytest.mark.parametrize(("size", "encoding"), [(5, 16), (5, 64), (125, 64), (65535, 64)])
def test_non_minimal_lengths_are_accepted(size: int, encoding: int) -> None:
    """The RFC asks senders for the shortest form; the size limit, not the encoding, is what
    protects a receiver, so a longer form is read as what it says."""
    raw = reference_header(OP_BINARY, size, KEY, encoding=encoding)
    assert header(raw) == (True, OP_BINARY, KEY, size, len(raw))


def test_a_64_bit_length_with_its_top_bit_set_is_over_any_limit() -> None:
    raw = struct.pack("!BBQ", 0x80 | OP_BINARY, 0x80 | 127, 1 << 63) + KEY
    error = refusal(raw, reader(limit=(1 << 63) - 1))
    assert error.code == CLOSE_TOO_BIG
    assert f"({1 << 63} bytes announced" in str(error)


@pytest.mark.parametrize("size", [LIMIT, LIMIT + 1])
def test_the_size_limit_counts_the_whole_message(size: int) -> None:
    raw = reference_header(OP_BINARY, size, KEY)
    if size <= LIMIT:
        assert header(raw) is not None
        return
    error = refusal(raw)
    assert error.code == CLOSE_TOO_BIG
    assert str(error) == (f"message from {REMOTE} exceeds the size limit ({size} bytes "
                          f"announced, limit {LIMIT})")


def test_a_continuation_counts_the_fragments_before_it() -> None:
    raw = reference_header(OP_CONTINUATION, 100, KEY)
    frames = reader()
    assert frames.add(bytes(LIMIT - 100), fin=False) is None
    assert header(raw, frames) == (True, OP_CONTINUATION, KEY, 100, len(raw))
    frames = reader()
    frames.add(bytes(LIMIT - 99), fin=False)
    error = refusal(raw, frames)
    assert error.code == CLOSE_TOO_BIG and f"({LIMIT + 1} bytes announced" in str(error)


# -- masking ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("size", [0, 1, 3, 4, 7, 8, 9, 15, 16, 17, 1000, 65537])
@pytest.mark.parametrize("offset", [0, 1, 3])
def test_masking_matches_the_byte_by_byte_definition(size: int, offset: int) -> None:
    key = os.urandom(4)
    data = os.urandom(size)
    buffer = bytearray(offset) + bytearray(data)  # an unaligned start as well
    mask_in_place(memoryview(buffer)[offset:], key)
    assert bytes(buffer[offset:]) == reference_mask(data, key)
    mask_in_place(memoryview(buffer)[offset:], key)  # the same operation unmasks
    assert bytes(buffer[offset:]) == data


def test_unmasked_copies_a_masked_payload_and_leaves_an_unmasked_one_alone() -> None:
    data = os.urandom(300)
    masked = reference_mask(data, KEY)
    source = memoryview(bytearray(masked))
    assert bytes(unmasked(source, KEY)) == data
    assert bytes(source) == masked  # the received bytes are left as they came
    plain = memoryview(data)
    assert unmasked(plain, None) is plain


# -- whole frames ----------------------------------------------------------------------------------


@pytest.mark.parametrize("size", [0, 125, 126, 65535, 65536])
@pytest.mark.parametrize("key", [None, KEY], ids=["unmasked", "masked"])
def test_encode_frame_joins_the_parts_and_masks_them(size: int, key: bytes | None) -> None:
    data = os.urandom(size)
    parts = [data[:size // 3], memoryview(data)[size // 3:size // 2], bytearray(data[size // 2:])]
    frame = bytes(encode_frame(OP_BINARY, parts, key))
    payload = reference_mask(data, key) if key is not None else data
    assert frame == reference_header(OP_BINARY, size, key) + payload
    [((fin, opcode, got_key, got_size, _), got)] = frames_of(frame, reader(key is not None))
    assert (fin, opcode, got_key, got_size, got) == (True, OP_BINARY, key, size, data)


def test_a_fragmented_message_with_a_ping_between_its_frames() -> None:
    """Section 5.4: control frames may come between the fragments of a message."""
    pieces = [os.urandom(n) for n in (10, 200, 70_000)]
    stream = b"".join([
        reference_header(OP_BINARY, 10, KEY, fin=False) + reference_mask(pieces[0], KEY),
        reference_header(OP_PING, 4, KEY) + reference_mask(b"ping", KEY),
        reference_header(OP_CONTINUATION, 200, KEY, fin=False) + reference_mask(pieces[1], KEY),
        reference_header(OP_CONTINUATION, 70_000, KEY) + reference_mask(pieces[2], KEY),
    ])
    frames = reader()
    got = frames_of(stream, frames)
    assert [(head[:2], payload) for head, payload in got] == [
        ((False, OP_BINARY), pieces[0]), ((True, OP_PING), b"ping"),
        ((False, OP_CONTINUATION), pieces[1]), ((True, OP_CONTINUATION), pieces[2])]
    assert frames.fragments is None and frames.message_bytes == 0  # the message was joined


def test_fragments_are_counted_and_joined_at_the_last() -> None:
    frames = reader()
    assert frames.fragments is None
    assert frames.add(b"ab", fin=False) is None
    assert frames.add(memoryview(b""), fin=False) is None  # empty fragments count too
    assert frames.fragments == [b"ab", b""] and frames.message_bytes == 2
    assert frames.add(b"cde", fin=True) == b"abcde"
    assert frames.fragments is None and frames.message_bytes == 0
    assert frames.add(b"x", fin=True) == b"x"


@pytest.mark.parametrize(("in_message", "opcode"), [(False, OP_CONTINUATION),
                                                    (True, OP_BINARY)])
def test_a_broken_fragment_sequence_is_refused(in_message: bool, opcode: int) -> None:
    frames = reader()
    if in_message:
        frames.add(b"first", fin=False)
    error = refusal(reference_header(opcode, 3, KEY), frames)
    assert error.code == CLOSE_PROTOCOL
    assert str(error) == f"{REMOTE} broke a fragmented message's sequence"


# -- control frames --------------------------------------------------------------------------------


@pytest.mark.parametrize("opcode", [OP_CLOSE, OP_PING, OP_PONG])
def test_control_frames_up_to_125_bytes_pass_even_inside_a_message(opcode: int) -> None:
    raw = reference_header(opcode, MAX_CONTROL_PAYLOAD, KEY)
    assert MAX_CONTROL_PAYLOAD == 125
    assert header(raw) == (True, opcode, KEY, 125, len(raw))
    frames = reader()
    frames.add(bytes(LIMIT), fin=False)
    assert header(raw, frames) is not None  # not counted against the message around it


@pytest.mark.parametrize("opcode", [OP_CLOSE, OP_PING, OP_PONG])
@pytest.mark.parametrize(("size", "fin"), [(126, True), (65536, True), (0, False)])
def test_an_oversized_or_fragmented_control_frame_is_refused(opcode: int, size: int,
                                                             fin: bool) -> None:
    error = refusal(reference_header(opcode, size, KEY, fin=fin))
    assert error.code == CLOSE_PROTOCOL
    assert str(error) == f"{REMOTE} sent a fragmented or oversized control frame"


def test_close_payloads_round_trip() -> None:
    assert close_payload(CLOSE_TOO_BIG, "too big") == struct.pack("!H", 1009) + b"too big"
    assert parse_close(memoryview(struct.pack("!H", 1002) + b"why")) == (1002, "why")
    assert parse_close(memoryview(b"")) == (CLOSE_NORMAL, "")
    assert parse_close(memoryview(struct.pack("!H", 1000) + b"\xff")) == (1000, "\ufffd")
    long = close_payload(CLOSE_PROTOCOL, "x" * 500)
    assert len(long) == 2 + 120 and len(long) <= MAX_CONTROL_PAYLOAD
    frame = encode_frame(OP_CLOSE, [long], KEY)
    [(_, payload)] = frames_of(bytes(frame), reader())
    assert parse_close(memoryview(payload)) == (CLOSE_PROTOCOL, "x" * 120)


# -- other refusals --------------------------------------------------------------------------------


@pytest.mark.parametrize("rsv", [0x40, 0x20, 0x10, 0x70])
def test_reserved_bits_are_refused(rsv: int) -> None:
    raw = bytes((0x80 | rsv | OP_BINARY, 0x80 | 3)) + KEY + b"abc"
    error = refusal(raw)
    assert error.code == CLOSE_PROTOCOL
    assert str(error) == f"{REMOTE} set reserved bits (no extension was negotiated)"


@pytest.mark.parametrize("opcode", [0x3, 0x4, 0x5, 0x6, 0x7, 0xB, 0xC, 0xD, 0xE, 0xF])
def test_unknown_opcodes_are_refused(opcode: int) -> None:
    error = refusal(reference_header(opcode, 0, KEY))
    assert error.code == CLOSE_PROTOCOL
    assert str(error) == f"{REMOTE} sent a frame with reserved opcode {opcode:#x}"


@pytest.mark.parametrize(("server", "key", "word"), [(True, None, "an unmasked"),
                                                     (False, KEY, "a masked")])
def test_masking_in_the_wrong_direction_is_refused(server: bool, key: bytes | None,
                                                   word: str) -> None:
    """Section 5.1: a client masks every frame, a server none."""
    raw = reference_header(OP_BINARY, 3, key)
    error = refusal(raw, reader(server=server))
    assert error.code == CLOSE_PROTOCOL
    assert str(error) == f"{REMOTE} sent {word} frame (RFC 6455 section 5.1)"
    assert header(raw, reader(server=not server)) is not None  # right for the other side


def test_text_messages_are_refused_as_unsupported() -> None:
    error = refusal(reference_header(OP_TEXT, 2, KEY))
    assert error.code == CLOSE_UNSUPPORTED
    assert str(error) == f"{REMOTE} sent a text message; burncoll speaks binary"
