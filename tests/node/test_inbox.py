"""Point-to-point messages from other nodes, at the node level (issue #14 item 1).

The inbox alone, fed frames through the real wire encoding as a member holding the token could
send them: good messages (one part, several parts, empty, 0-d) are assembled and taken in
order per key; hostile headers -- a wrong number, a rank on the wrong node, parts out of order
or overlapping, a size that does not match the shape, a shape no machine holds -- raise
ProtocolError and nothing else, before anything is allocated. Held messages are bounded, a
take ends by its deadline, a failure wakes every waiter. The outbox refuses forged, repeated
and out-of-order acknowledgements, and the acknowledgement message is decoded field by field.
Real sockets: a reader stops reading past the held budget (backpressure) at a message
boundary, and a hostile frame or acknowledgement fails the session naming the sender.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
import tracemalloc
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from burncoll.errors import CollectiveTimeout, ProtocolError
from burncoll.node.held import HeldBudget
from burncoll.node.inbox import Inbox
from burncoll.node.p2p_outbox import Outbox, message_parts
from burncoll.ops import OpKind, ReduceOp
from burncoll.protocol.control import encode
from burncoll.protocol.fields import MalformedMessage
from burncoll.protocol.members import P2PAck, decode_member
from burncoll.protocol.wire import DataHeader, Frame, decode, encode_control, encode_data_header
from tests.node.test_part_checks import _close, _pair

#: Ranks 0 and 1 live on this node (0), ranks 2 and 3 on node 1 (which sends).
RANK_NODES = (0, 0, 1, 1)
SRC, DST, TAG = 2, 1, 5
PART = 64


def inbox(**kwargs: Any) -> Inbox:
    box = Inbox(part_bytes=PART, **kwargs)
    box.join(0, RANK_NODES)
    return box


def header(**fields: Any) -> DataHeader:
    base = DataHeader(
        session=7, seq=0, op_kind=OpKind.P2P, reduce_op=None, dtype="float64", shape=(4,),
        root=DST, src=1, round=0, channel=TAG, chunk=SRC, offset=0, chunk_bytes=32)
    return dataclasses.replace(base, **fields)


def frame(payload: bytes | int, **fields: Any) -> Frame:
    """A DATA frame through the real wire encoding (``payload``: bytes, or a length)."""
    data = bytes(payload) if isinstance(payload, int) else payload
    return decode(encode_data_header(header(**fields), len(data)) + data)


def parts_of(x: np.ndarray, seq: int = 0, src: int = SRC, dst: int = DST, tag: int = TAG
             ) -> list[Frame]:
    """The frames a sending node makes of ``x`` (the real sender's cutting)."""
    return [decode(b"".join(bytes(p) for p in parts))
            for parts in message_parts(7, 1, (src, dst, tag), seq, x, part_bytes=PART)]


def take(box: Inbox, key: tuple[int, int, int] = (SRC, DST, TAG), seconds: float = 2.0
         ) -> np.ndarray:
    async def run() -> np.ndarray:
        message = await box.take(key, time.monotonic() + seconds,
                                 lambda: CollectiveTimeout("timed out"))
        return message.array()
    return asyncio.run(run())


# -- good messages ----------------------------------------------------------------------------
@pytest.mark.parametrize("x", [
    np.arange(4, dtype=np.float64),
    np.arange(100, dtype=np.int32).reshape(5, 20),  # 400 bytes: 7 parts of 64
    np.array(3 + 4j, np.complex128),  # 0-d
    np.zeros((0, 3), np.float16),  # empty: one part of 0 bytes
    np.array([True, False, True]),
], ids=["one-part", "parts", "0-d", "empty", "bool"])
def test_a_message_is_assembled_from_its_parts(x: np.ndarray) -> None:
    box = inbox()
    frames = parts_of(x)
    assert len(frames) == max(1, -(-x.nbytes // PART))
    done = [box.put(f, 1) for f in frames]
    assert done == [False] * (len(frames) - 1) + [True]
    assert box.budget.held == (1, x.nbytes)
    got = take(box)
    assert got.dtype == x.dtype and got.shape == x.shape and got.flags.writeable
    np.testing.assert_array_equal(got, x)
    assert box.budget.held == (0, 0)


def test_messages_are_taken_in_order_per_key_and_tags_are_independent() -> None:
    box = inbox()
    sent = {(tag, seq): np.full(3, 10 * tag + seq) for tag in (0, 1) for seq in range(3)}
    for seq in range(3):  # interleaved tags
        for tag in (1, 0):
            (f,) = parts_of(sent[(tag, seq)], seq=seq, tag=tag)
            assert box.put(f, 1)
    for tag, seq in [(1, 0), (0, 0), (0, 1), (1, 1), (1, 2), (0, 2)]:
        np.testing.assert_array_equal(take(box, (SRC, DST, tag)), sent[(tag, seq)])


def test_waiting_receives_of_one_key_get_the_messages_in_the_order_they_waited() -> None:
    async def run() -> list[float]:
        box = inbox()
        key = (SRC, DST, TAG)
        deadline = time.monotonic() + 5
        takes = [asyncio.ensure_future(box.take(key, deadline, lambda: CollectiveTimeout("t")))
                 for _ in range(3)]
        await asyncio.sleep(0)
        for seq in range(3):
            (f,) = parts_of(np.full(2, float(seq)), seq=seq)
            box.put(f, 1)
        return [float((await t).array()[0]) for t in takes]

    assert asyncio.run(run()) == [0.0, 1.0, 2.0]


def test_a_take_ends_by_its_deadline_and_a_failure_wakes_every_waiter() -> None:
    async def run() -> tuple[BaseException, BaseException]:
        box = inbox()
        with pytest.raises(CollectiveTimeout, match="nobody sent"):
            await box.take((SRC, DST, 0), time.monotonic() + 0.05,
                           lambda: CollectiveTimeout("nobody sent"))
        waiting = asyncio.ensure_future(
            box.take((SRC, DST, 1), time.monotonic() + 5, lambda: CollectiveTimeout("t")))
        await asyncio.sleep(0.01)
        box.fail(ProtocolError("the session failed"))
        woken = await asyncio.gather(waiting, return_exceptions=True)
        later = await asyncio.gather(box.take((SRC, DST, 1), time.monotonic() + 5,
                                              lambda: CollectiveTimeout("t")),
                                     return_exceptions=True)
        assert not box.put(parts_of(np.ones(2))[0], 1)  # ignored once failed
        return woken[0], later[0]

    woken, later = asyncio.run(run())
    assert isinstance(woken, ProtocolError) and isinstance(later, ProtocolError)


def test_held_messages_are_bounded() -> None:
    box = inbox(budget=HeldBudget(items=100, nbytes=256))
    x = np.zeros(12)  # 96 bytes, two parts
    for seq in range(3):
        first, second = parts_of(x, seq=seq)
        assert not box.put(first, 1) and not box.budget.crowded
        assert box.put(second, 1)
        assert box.budget.crowded == (seq == 2)
    assert box.budget.held == (3, 288)

    async def drained_after_a_take() -> bool:
        assert second.header is not None
        waiting = asyncio.ensure_future(box.budget.drained(lambda: box.holds(second.header)))
        await asyncio.sleep(0.01)
        assert not waiting.done()
        await box.take((SRC, DST, TAG), time.monotonic() + 1, lambda: CollectiveTimeout("t"))
        await asyncio.wait_for(waiting, 1)
        return not box.budget.crowded

    assert asyncio.run(drained_after_a_take())
    box.budget.items = 1  # the count bounds empty messages
    (empty,) = parts_of(np.zeros(0), seq=0, tag=9)
    assert box.put(empty, 1) and box.budget.crowded


# -- hostile frames ---------------------------------------------------------------------------
HOSTILE: dict[str, tuple[list[tuple[int, dict[str, Any]]], str]] = {
    "seq not the next": ([(32, {"seq": 1})], "message #0 of that rank and tag comes next"),
    "dst on the sending node": ([(32, {"root": 2})], "not a peer of this node"),
    "dst not a rank": ([(32, {"root": -1})], "not a peer of this node"),
    "dst far off": ([(32, {"root": 2**40})], "not a peer of this node"),
    "src on this node": ([(32, {"chunk": 0})], "not one of its peers"),
    "src not a rank": ([(32, {"chunk": 99})], "not one of its peers"),
    "a round": ([(32, {"round": 3})], "a point-to-point message has neither"),
    "a reduce op": ([(32, {"reduce_op": ReduceOp.SUM})], "a point-to-point message has neither"),
    "no dtype": ([(32, {"dtype": None})], "without a dtype"),
    "size not the shape's": ([(32, {"chunk_bytes": 40, "shape": (4,)})],
                             "announcing 40 bytes for an array float64[4] of 32"),
    "first part not at 0": ([(32, {"offset": 8, "chunk_bytes": 40, "shape": (5,)})],
                            "a message starts at byte 0"),
    "first part short": ([(16, {"chunk_bytes": 32})], "where the message's first part has 32"),
    "huge shape": ([(0, {"shape": (2**40, 2**40), "chunk_bytes": 2**83 % 2**64})],
                   "which no array can have"),
    "more than memory": ([(0, {"shape": (2**28,), "chunk_bytes": 2**31})],
                         "more than this machine's memory"),
    "a part skips ahead": ([(64, {"shape": (20,), "chunk_bytes": 160}),
                            (32, {"shape": (20,), "chunk_bytes": 160, "offset": 128})],
                           "out of order: byte 64 comes next"),
    "a part overlaps": ([(64, {"shape": (20,), "chunk_bytes": 160}),
                         (64, {"shape": (20,), "chunk_bytes": 160, "offset": 0})],
                        "out of order: byte 64 comes next"),
    "a middle part short": ([(64, {"shape": (20,), "chunk_bytes": 160}),
                             (32, {"shape": (20,), "chunk_bytes": 160, "offset": 64})],
                            "of 32 bytes where the message has 64"),
    "header changes midway": ([(64, {"shape": (20,), "chunk_bytes": 160}),
                               (64, {"shape": (40,), "dtype": "float32", "chunk_bytes": 160,
                                     "offset": 64})], "with another header"),
    "another message midway": ([(64, {"shape": (20,), "chunk_bytes": 160}),
                                (32, {"channel": 6})], "before the rest of message"),
    "a message repeated": ([(32, {}), (32, {})], "message #1 of that rank and tag comes next"),
}


@pytest.mark.parametrize("name", list(HOSTILE))
def test_hostile_frames_are_protocol_errors_before_any_allocation(name: str) -> None:
    frames, words = HOSTILE[name]
    box = inbox(memory=2**30)
    decoded = [frame(size, **fields) for size, fields in frames]
    tracemalloc.start()
    try:
        for f in decoded[:-1]:
            box.put(f, 1)
        tracemalloc.reset_peak()
        with pytest.raises(ProtocolError, match="sent ") as info:
            box.put(decoded[-1], 1)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert words in str(info.value)
    assert peak < 64 << 10, peak  # nothing allocated on the hostile header's word


def test_frames_from_a_node_that_hosts_no_rank_are_refused() -> None:
    box = inbox()
    (f,) = parts_of(np.ones(4))
    with pytest.raises(ProtocolError, match="not one of its peers"):
        box.put(f, 2)  # in rank 2's name, but node 2 does not host it
    unjoined = Inbox()
    with pytest.raises(ProtocolError):
        unjoined.put(f, 1)


@settings(max_examples=300, deadline=None)
@given(seq=st.integers(0, 3), root=st.integers(-2, 5), chunk=st.integers(0, 5),
       channel=st.integers(0, 2**16 - 1), round_=st.integers(0, 2),
       dtype=st.sampled_from([None, "float64", "bool", "complex64", "int8"]),
       shape=st.lists(st.integers(0, 2**40), max_size=4), offset=st.integers(0, 100),
       chunk_bytes=st.integers(0, 2**20), size=st.integers(0, 80))
def test_any_header_is_taken_or_a_protocol_error(
        seq: int, root: int, chunk: int, channel: int, round_: int, dtype: str | None,
        shape: list[int], offset: int, chunk_bytes: int, size: int) -> None:
    box = inbox(memory=2**24)
    box.put(parts_of(np.arange(20.0))[0], 1)  # a message under way, sometimes continued
    try:
        f = frame(size, seq=seq, root=root, chunk=chunk, channel=channel, round=round_,
                  dtype=dtype, shape=tuple(shape), offset=offset, chunk_bytes=chunk_bytes)
    except ProtocolError:
        return  # the wire itself refused it
    with contextlib.suppress(ProtocolError):  # nothing else may come out
        box.put(f, 1)


# -- acknowledgements -------------------------------------------------------------------------
def test_acknowledgements_must_be_of_the_oldest_message_awaited_from_that_node() -> None:
    async def run() -> list[str | None]:
        box = Outbox()
        key = (0, 2, TAG)
        seq0, first = box.open(key, 1)
        seq1, second = box.open(key, 1)
        assert (seq0, seq1) == (0, 1)
        for ack, node, words in [
            (P2PAck(2, *key, 0), 2, "not waiting for"),  # node 2 was not sent it
            (P2PAck(1, *key, 0), 2, "in the name of node 1"),
            (P2PAck(1, *key, 1), 1, "not waiting for"),  # out of order
            (P2PAck(1, 0, 3, TAG, 0), 1, "not waiting for"),
            (P2PAck(1, 0, 2, TAG + 1, 0), 1, "not waiting for"),
        ]:
            with pytest.raises(ProtocolError, match=words):
                box.took(ack, node)
        box.took(P2PAck(1, *key, 0), 1)
        with pytest.raises(ProtocolError, match="repeated"):
            box.took(P2PAck(1, *key, 0), 1)
        box.took(P2PAck(1, *key, 1, "its recv(out=...) takes float32[2]"), 1)
        return [await first, await second]

    assert asyncio.run(run()) == [None, "its recv(out=...) takes float32[2]"]


@pytest.mark.parametrize(("fields", "words"), [
    ({"tag": 2**16}, "tag must be an int in [0, 65535]"),
    ({"tag": True}, "tag must be"),
    ({"seq": -1}, "seq must be"),
    ({"src": "0"}, "src must be"),
    ({"dst": 2**32}, "dst must be"),
    ({"node": None}, "node must be"),
    ({"refused": ""}, "refused must be a non-empty string"),
    ({"refused": "x" * 1001}, "at most 1000 characters"),
    ({"refused": 3}, "refused must be"),
])
def test_a_malformed_acknowledgement_is_refused_field_by_field(
        fields: dict[str, Any], words: str) -> None:
    good = P2PAck(1, 0, 2, 3, 4, "why").to_json()
    assert decode_member(decode(encode(P2PAck(1, 0, 2, 3, 4, "why")))) == P2PAck(
        1, 0, 2, 3, 4, "why")
    with pytest.raises(MalformedMessage, match=words.replace("[", r"\[").replace("]", r"\]")):
        decode_member(decode(encode_control({**good, **fields})))


# -- real sockets -----------------------------------------------------------------------------
def test_a_reader_stops_at_a_message_boundary_past_the_held_budget() -> None:
    """Node 1 sends 24 messages of 3 parts (96 KiB each) that no recv takes yet, with a
    budget of 4 messages: node 0 holds at most the budget and one message more (its reader
    paused), never part of a message beyond; once received, every message comes, in order."""
    part = 32 << 10
    count = 24

    async def run() -> tuple[int, list[int]]:
        a, b = await _pair("cd" * 32)
        a.inbox.part_bytes = part
        a.inbox.budget.bytes = 4 * 3 * part
        try:
            most = 0
            key = (1, 0, TAG)  # rank 1 on node 1 to rank 0 on node 0

            async def flood() -> None:
                for seq in range(count):
                    x = np.full(3 * part // 8, float(seq))
                    for parts in message_parts(77, 1, key, seq, x, part_bytes=part):
                        await b.send(0, parts)

            sending = asyncio.ensure_future(flood())
            for _ in range(40):
                await asyncio.sleep(0.01)
                most = max(most, a.inbox.budget.held[1])
            got = []
            for _ in range(count):
                message = await a.inbox.take(key, time.monotonic() + 5,
                                             lambda: CollectiveTimeout("t"))
                got.append(int(message.array()[0]))
            await asyncio.wait_for(sending, 5)
            assert a.mailbox.error is None
            return most, got
        finally:
            await _close(a, b)

    most, got = asyncio.run(run())
    assert most <= 5 * 3 * part and most % (3 * part) == 0, most
    assert got == list(range(count))


@pytest.mark.parametrize("hostile", ["wrong seq", "wrong connection", "forged ack"])
def test_a_hostile_member_fails_the_session_naming_it(hostile: str) -> None:
    async def run() -> BaseException | None:
        a, b = await _pair("ef" * 32)
        try:
            if hostile == "forged ack":
                await b.send(0, [encode(P2PAck(1, 0, 1, 0, 0), 77)])
            else:
                (parts,) = message_parts(77, 1, (1, 0, 0), 3 if hostile == "wrong seq" else 0,
                                         np.ones(2))
                conn = b.connections.dialed[0] if hostile == "wrong connection" else None
                await (conn.send(parts) if conn is not None else b.send(0, parts))
            async with asyncio.timeout(5):
                while a.mailbox.error is None:
                    await asyncio.sleep(0.01)
            return a.mailbox.error
        finally:
            await _close(a, b)

    error = asyncio.run(run())
    assert isinstance(error, ProtocolError), error
    assert "node 1" in str(error)
    words = {"wrong seq": "message #0 of that rank and tag comes next",
             "wrong connection": "the connection this node sends on",
             "forged ack": "not waiting for"}[hostile]
    assert words in str(error), error
