"""After authentication, a member's parts are held to the schedule (issue 11, item 3).

The mailbox alone (frames built with the real wire encoding): parts that overlap, skip, come
out of order, come twice or change their chunk's size are refused; a started operation
refuses keys and sizes it does not receive; frames of operations not started are bounded,
and the reader of a real connection stops reading past the bound (backpressure) instead of
hoarding. The executor over an in-memory data service: a receiver allocates nothing on a
header's word that its dtype and shape do not support, a corrupted pipelined transfer fails
every node with a ProtocolError (never a wrong result), and an all-gather of arrays of
different lengths still works (its headers carry each chunk's rows). Real sockets: without
a token, member connections need the session's secret, and ``hello`` must name the session.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import pytest

import burncoll
import burncoll.node.executor as executor_module
import burncoll.protocol.checks as checks_module
from burncoll.errors import AuthenticationError, ProtocolError
from burncoll.levels import GlobalOp
from burncoll.node.data_service import DataService
from burncoll.node.executor import PART_BYTES, GlobalExecutor
from burncoll.node.held import HELD_BYTES, HELD_ITEMS
from burncoll.node.mailbox import Mailbox, Receives
from burncoll.node.membership import NodeInfo
from burncoll.node.placement import place
from burncoll.ops import OpKind, ReduceOp
from burncoll.protocol.checks import expected_bytes
from burncoll.protocol.wire import DataHeader, Frame, decode, encode_control, encode_data_header
from burncoll.strategies import Ring, Strategy, Tree
from burncoll.strategies.layout import even_layout
from burncoll.transport import get_transport
from burncoll.transport.auth import authenticate_client
from tests.node.test_out_of_place import _MemoryService

SEQ = 4


def header(**fields: Any) -> DataHeader:
    base = DataHeader(
        session=7, seq=SEQ, op_kind=OpKind.ALL_REDUCE, reduce_op=ReduceOp.SUM,
        dtype="float64", shape=(1000,), root=-1, src=1, round=0, channel=0, chunk=0,
        offset=0, chunk_bytes=8000,
    )
    return dataclasses.replace(base, **fields)


def frame(payload_len: int, **fields: Any) -> Frame:
    """A DATA frame through the real wire encoding."""
    h = header(**fields)
    return decode(encode_data_header(h, payload_len) + bytes(payload_len))


def receives(totals: dict[tuple[int, int, int, int, int], int | None],
             part_bytes: int = PART_BYTES, channel: int = 0) -> Receives:
    return Receives(SEQ, channel, totals, part_bytes=part_bytes)


def no_check(h: DataHeader) -> None:
    return None


KEY = (SEQ, 0, 0, 1, 0)
TWO_PARTS = PART_BYTES + 4096


# -- the schedule of one chunk, started or not ---------------------------------------------


@pytest.mark.parametrize("started", [True, False], ids=["started", "not-started"])
@pytest.mark.parametrize(
    ("parts", "why"),
    [
        ([(0, PART_BYTES), (PART_BYTES // 2, 4096)], "overlapping a part already received"),
        ([(PART_BYTES, 4096)], "out of order: byte 0 comes next"),
        ([(0, PART_BYTES), (0, PART_BYTES)], "twice"),
        ([(0, PART_BYTES), (PART_BYTES + 8, 4088)], "out of order"),
        ([(0, PART_BYTES), (PART_BYTES, 4096), (PART_BYTES, 4096)], "twice"),
    ],
    ids=["overlap", "second-first", "duplicate", "gap", "after-complete"],
)
def test_parts_off_the_schedule_are_refused(started: bool, parts: list[tuple[int, int]],
                                            why: str) -> None:
    box = Mailbox()
    if started:
        box.expect(no_check, receives({KEY: TWO_PARTS}))
    with pytest.raises(ProtocolError, match=why):
        for offset, size in parts:
            box.put(frame(size, offset=offset, chunk_bytes=TWO_PARTS))


def test_a_chunk_that_changes_size_midway_is_refused() -> None:
    box = Mailbox()
    box.put(frame(PART_BYTES, chunk_bytes=TWO_PARTS))
    with pytest.raises(ProtocolError, match="after parts of a chunk of"):
        box.put(frame(4096, offset=PART_BYTES, chunk_bytes=TWO_PARTS + 8))


def test_a_zero_byte_chunk_comes_once() -> None:
    box = Mailbox()
    box.expect(no_check, receives({KEY: 0}))
    box.put(frame(0, chunk_bytes=0))
    with pytest.raises(ProtocolError, match="twice"):
        box.put(frame(0, chunk_bytes=0))


@pytest.mark.parametrize(
    ("fields", "size", "why"),
    [
        ({"round": 5}, 8000, "does not receive in that operation"),
        ({"src": 2}, 8000, "does not receive in that operation"),
        ({"chunk_bytes": 1_400_000_000}, 8000, "announcing a chunk of 1400000000 bytes where "
                                               "this node expects 8000"),
        ({}, 4000, "of 4000 bytes where the schedule has 8000"),
    ],
    ids=["round", "sender", "huge-chunk-bytes", "short-part"],
)
def test_a_started_operation_refuses_what_it_does_not_receive(
    fields: dict[str, Any], size: int, why: str
) -> None:
    box = Mailbox()
    box.expect(no_check, receives({KEY: 8000}))
    with pytest.raises(ProtocolError, match=why):
        box.put(frame(size, **fields))


def test_frames_that_came_early_are_checked_when_the_operation_starts() -> None:
    """Held before the start, the frame is checked for order only; at the start, against
    what the operation receives: the session fails, naming the sender."""
    box = Mailbox(describe=lambda node: f"node {node} (the sender)")
    failures: list[BaseException] = []
    box.on_error = failures.append
    assert box.put(frame(8000, round=3))  # held: no such round, but not known yet
    box.expect(no_check, receives({KEY: 8000}))
    assert len(failures) == 1 and isinstance(failures[0], ProtocolError), failures
    assert "node 1 (the sender)" in str(failures[0])
    assert "does not receive in that operation" in str(failures[0])


def test_good_parts_are_taken_in_order_started_or_not() -> None:
    box = Mailbox()
    assert box.put(frame(PART_BYTES, chunk_bytes=TWO_PARTS))  # held
    box.expect(no_check, receives({KEY: TWO_PARTS}))
    assert box.budget.held == (0, 0)
    assert not box.put(frame(4096, offset=PART_BYTES, chunk_bytes=TWO_PARTS))

    async def take() -> list[int]:
        got = []
        for _ in range(2):
            f = await box.get(KEY, time.monotonic() + 1, lambda: TimeoutError())
            assert f.header is not None
            got.append(f.header.offset)
        return got

    assert asyncio.run(take()) == [0, PART_BYTES]


def test_frames_of_a_finished_operation_are_refused() -> None:
    box = Mailbox()
    box.expect(no_check, receives({KEY: 8000}))
    box.done(SEQ)
    box.expect(no_check, Receives(SEQ + 1, 0, {}))
    with pytest.raises(ProtocolError, match="after that operation was over"):
        box.put(frame(8000))



def test_a_skipped_lane_refuses_its_frames_and_checks_them_first() -> None:
    """An operation run on the lanes (``skip``): a frame of its channel 0 arriving on a member
    connection is compared with the call (another call: the mismatch is reported), then
    refused; its other channels and the next operation are received as before."""
    box = Mailbox()
    assert box.skip(SEQ, no_check)
    with pytest.raises(ProtocolError, match="does not receive in that operation"):
        box.put(frame(8000))
    assert box.put(frame(8000, channel=1))  # held for channel 1, not started yet
    box.done(SEQ)
    assert box.skip(SEQ + 1, lambda h: ProtocolError("another call"))
    assert not box.put(frame(8000, seq=SEQ + 1))
    assert str(box.error) == "another call"


def test_a_skip_with_frames_of_its_lane_here_is_left_to_the_loop() -> None:
    box = Mailbox()
    box.put(frame(8000))  # before this node started the operation
    assert not box.skip(SEQ, no_check) and box.current == -1
    assert box.skip(SEQ + 1, no_check) and box.current == SEQ + 1  # (another lane's)
    box.fail(ProtocolError("over"))
    assert not box.skip(SEQ + 2, no_check)

# -- the budget for operations not started --------------------------------------------------


def test_frames_held_for_operations_not_started_are_bounded_in_count() -> None:
    box = Mailbox()
    for i in range(HELD_ITEMS):
        assert not box.budget.crowded
        # distinct keys (rounds) of one future operation, one 8-byte part each
        assert box.put(frame(8, seq=SEQ + 1, round=i % 60000, chunk=i // 60000, chunk_bytes=8))
    assert box.budget.crowded and box.budget.held == (HELD_ITEMS, 8 * HELD_ITEMS)
    # the operation starts: its frames stop counting (and are checked: all expected here)
    totals: dict[tuple[int, int, int, int, int], int | None] = {
        (SEQ + 1, 0, i % 60000, 1, i // 60000): 8 for i in range(HELD_ITEMS)}
    box.expect(no_check, Receives(SEQ + 1, 0, totals))
    assert not box.budget.crowded and box.budget.held == (0, 0) and box.error is None


def test_frames_held_for_operations_not_started_are_bounded_in_bytes() -> None:
    box = Mailbox()
    parts = HELD_BYTES // PART_BYTES
    total = (parts + 2) * PART_BYTES
    for i in range(parts):
        assert not box.budget.crowded
        last = frame(PART_BYTES, seq=SEQ + 2, offset=i * PART_BYTES, chunk_bytes=total)
        box.put(last)
    assert box.budget.crowded and box.budget.held == (parts, HELD_BYTES)

    async def drained_after_start() -> bool:
        waiting = asyncio.ensure_future(box.budget.drained(lambda: box.holds(last.header)))
        await asyncio.sleep(0.05)
        blocked = not waiting.done()
        box.expect(no_check, Receives(SEQ + 2, 0, {(SEQ + 2, 0, 0, 1, 0): total}))
        await asyncio.wait_for(waiting, 1)
        return blocked

    assert asyncio.run(drained_after_start())


def test_frames_of_a_lane_that_never_started_are_dropped_when_the_node_moves_on() -> None:
    """Channel 3 of operation SEQ never starts here: when the node starts a later operation,
    what was held for it is forgotten, and the budget is free again."""
    box = Mailbox()
    box.expect(no_check, receives({KEY: 8000}))
    box.put(frame(8000, channel=3))
    assert box.budget.held == (1, 8000)
    box.expect(no_check, Receives(SEQ + 1, 0, {}))
    assert box.budget.held == (0, 0)


def test_a_failure_wakes_a_paused_reader() -> None:
    box = Mailbox()
    for i in range(HELD_ITEMS):
        last = frame(0, seq=SEQ + 1, round=i % 60000, chunk=i // 60000, chunk_bytes=0)
        box.put(last)

    async def run() -> None:
        waiting = asyncio.ensure_future(box.budget.drained(lambda: box.holds(last.header)))
        await asyncio.sleep(0.02)
        assert not waiting.done()
        box.fail(ProtocolError("over"))
        await asyncio.wait_for(waiting, 1)

    asyncio.run(run())


# -- the executor: sizes before allocation ---------------------------------------------------


def _op(kind: OpKind, dtype: str | None, shape: tuple[int, ...], root: int = -1,
        reduce_op: ReduceOp | None = None, timeout: float = 5.0, seq: int = SEQ) -> GlobalOp:
    now = time.monotonic()
    return GlobalOp(seq=seq, kind=kind, reduce_op=reduce_op, dtype=dtype, shape=shape,
                    root=root, deadline=now + timeout, started=now)


class _Service(_MemoryService):
    timeout = 5.0


def _services(world: int) -> list[_Service]:
    services = [_Service(i, world) for i in range(world)]
    for s in services:
        s.others = services  # type: ignore[assignment]
    return services


def test_a_broadcast_receiver_expects_the_size_the_shape_gives() -> None:
    services = _services(2)
    ex = GlobalExecutor(services[0])  # type: ignore[arg-type]
    op = _op(OpKind.BROADCAST, None, (), root=1)
    schedule = Tree(2).broadcast(2, 1)
    box = services[0].mailbox
    box.expect(ex.checker(op), ex.receives(op, schedule, [None] * schedule.num_chunks))
    bcast = {"op_kind": OpKind.BROADCAST, "reduce_op": None, "root": 1, "shape": (1000,)}
    with pytest.raises(ProtocolError, match="where this node expects 8000"):
        box.put(frame(8000, chunk_bytes=1_400_000_000, **bcast))


@pytest.mark.parametrize(
    ("shape", "why"),
    [((1 << 40,), "more than this machine's memory"),
     ((1 << 63, 0), "which no array can have"),
     (((1 << 64) - 1,), "which no array can have"),
     ((1 << 62, 1 << 62, 0), "which no array can have")],
    ids=["8-TiB", "dim-over-int64", "u64-max", "empty-but-too-big"],
)
def test_a_broadcast_of_an_impossible_array_is_a_protocol_error(
    shape: tuple[int, ...], why: str
) -> None:
    op = _op(OpKind.BROADCAST, None, (), root=1)
    h = header(op_kind=OpKind.BROADCAST, reduce_op=None, root=1, shape=shape)
    with pytest.raises(ProtocolError, match=why):
        expected_bytes(op, 1, h)


def test_a_dtype_this_node_cannot_hold_is_a_protocol_error(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """bfloat16 on a node without ml_dtypes (a test double makes dtype_from_name refuse it):
    a ProtocolError naming the part, not the UsageError meant for a local caller."""
    def refuse(name: str) -> Any:
        raise burncoll.UsageError(f"dtype {name} needs ml_dtypes")

    monkeypatch.setattr(checks_module, "dtype_from_name", refuse)
    op = _op(OpKind.BROADCAST, None, (), root=1)
    h = header(op_kind=OpKind.BROADCAST, reduce_op=None, root=1, dtype="bfloat16")
    with pytest.raises(ProtocolError, match="cannot receive"):
        expected_bytes(op, 1, h)


def test_an_allocation_that_fails_is_a_protocol_error(monkeypatch: pytest.MonkeyPatch) -> None:
    """A claim this machine's memory check lets through (a test double says the machine has
    2**62 bytes) but no allocation can satisfy: a ProtocolError, not a bare MemoryError."""
    monkeypatch.setattr(checks_module, "memory_bytes", lambda: 1 << 62)
    services = _services(2)
    op = _op(OpKind.BROADCAST, None, (), root=1)
    schedule = Tree(2).broadcast(2, 1)
    whole = 1 << 58  # elements of uint8: 256 PiB
    bcast = {"op_kind": OpKind.BROADCAST, "reduce_op": None, "root": 1, "dtype": "uint8",
             "shape": (whole,), "chunk_bytes": whole}

    async def receiver() -> BaseException | None:
        ex = GlobalExecutor(services[0])  # type: ignore[arg-type]
        chunks: list[np.ndarray | None] = [None] * schedule.num_chunks
        services[0].mailbox.expect(ex.checker(op), ex.receives(op, schedule, chunks))
        services[0].mailbox.put(frame(PART_BYTES, **bcast))
        try:
            await ex.run(op, schedule, chunks)
        except burncoll.CollectiveError as exc:
            return exc
        return None

    error = asyncio.run(receiver())
    assert isinstance(error, ProtocolError), error
    assert "cannot allocate" in str(error) and "node 1" in str(error)


# -- the executor: a corrupted pipelined transfer fails every node -----------------------------


class _Corrupting(_Service):
    """Node 1's test double: rewrites its parts of chunks of several parts as ``mode`` says
    (``overlap``: the second part moved half a part back; ``out_of_order``: the first part
    sent after the second)."""

    mode = ""

    def __init__(self, index: int, world: int) -> None:
        super().__init__(index, world)
        self._held: dict[tuple[int, int, int], bytes] = {}

    async def send(self, node: int, parts: Sequence[Any]) -> None:
        raw = b"".join(bytes(p) for p in parts)
        h = decode(raw).header
        part = executor_module.PART_BYTES
        if h is None or h.chunk_bytes <= part:
            await super().send(node, parts)
            return
        size = len(raw) - len(encode_data_header(h, 0))
        where = (node, h.round, h.chunk)
        if self.mode == "overlap" and h.offset == part:
            moved = dataclasses.replace(h, offset=h.offset // 2)
            await super().send(node, [encode_data_header(moved, size), raw[len(raw) - size:]])
        elif self.mode == "out_of_order" and h.offset == 0:
            self._held[where] = raw  # sent after the next part
        elif self.mode == "out_of_order" and where in self._held:
            held = self._held.pop(where)
            await super().send(node, parts)
            await super().send(node, [held])
        else:
            await super().send(node, parts)


@pytest.mark.parametrize("mode", ["overlap", "out_of_order"])
@pytest.mark.parametrize("strategy", [Ring(), Tree(2)], ids=lambda s: s.spec)
def test_a_corrupted_pipelined_transfer_fails_every_node(
    monkeypatch: pytest.MonkeyPatch, mode: str, strategy: Strategy
) -> None:
    """Tiny parts (a pipelined walk): node 1 overlaps or swaps two parts of each chunk it
    sends. The first node to receive one, and every node still running, raises a
    ProtocolError naming node 1; a node that finished before holds the exact sum: no wrong
    result anywhere."""
    monkeypatch.setattr(executor_module, "PART_BYTES", 64)
    world = 3
    services: list[_Service] = [_Service(0, world), _Corrupting(1, world), _Service(2, world)]
    services[1].mode = mode  # type: ignore[attr-defined]
    for s in services:
        s.others = services  # type: ignore[assignment]
    x = [np.arange(301, dtype=np.float64) * (i + 1) for i in range(world)]
    timeout = 10.0
    op = _op(OpKind.ALL_REDUCE, "float64", (301,), reduce_op=ReduceOp.SUM, timeout=timeout)
    schedule = strategy.all_reduce(world)
    layout = even_layout(301, schedule.num_chunks)

    async def node(i: int) -> Any:
        ex = GlobalExecutor(services[i])  # type: ignore[arg-type]
        chunks: list[np.ndarray | None] = [x[i][a:b] for a, b in layout]
        services[i].mailbox.expect(ex.checker(op), ex.receives(op, schedule, chunks))
        await ex.run(op, schedule, chunks)
        return x[i]

    async def every_node() -> list[Any]:
        return list(await asyncio.gather(*(node(i) for i in range(world)),
                                         return_exceptions=True))

    started = time.monotonic()
    results = asyncio.run(every_node())
    assert time.monotonic() - started < timeout / 2, "refused at once, not by the timeout"
    want = np.sum(np.stack([np.arange(301, dtype=np.float64) * (i + 1) for i in range(world)]),
                  axis=0)
    assert any(isinstance(r, ProtocolError) for r in results), results
    for r in results:
        if isinstance(r, np.ndarray):  # a node that finished before the failure: exact
            np.testing.assert_array_equal(r, want)
            continue
        assert isinstance(r, ProtocolError), r
        assert "node 1" in str(r), r
        assert ("overlapping" in str(r)) if mode == "overlap" else ("out of order" in str(r))


def test_an_all_gather_of_different_lengths_carries_each_chunks_rows(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Peers of an all-gather may hold different numbers of rows: each chunk's header carries
    its own, the receiver allocates exactly that, and the result is the concatenation."""
    monkeypatch.setattr(executor_module, "PART_BYTES", 96)  # pipelined, several parts
    world = 3
    services = _services(world)
    arrays = [np.arange(rows * 4, dtype=np.float64).reshape(rows, 4) + 100 * i
              for i, rows in enumerate([3, 0, 11])]
    op = _op(OpKind.ALL_GATHER, "float64", (4,))

    async def node(i: int) -> list[Any]:
        ex = GlobalExecutor(services[i])  # type: ignore[arg-type]
        schedule = Ring().all_gather(world, tuple(range(world)))
        chunks: list[np.ndarray | None] = [
            arrays[i].reshape(-1) if r == i else None for r in range(world)]
        services[i].mailbox.expect(ex.checker(op), ex.receives(op, schedule, chunks))
        await ex.run(op, schedule, chunks)
        return chunks

    async def every_node() -> list[Any]:
        return list(await asyncio.gather(*(node(i) for i in range(world))))

    want = np.concatenate([a.reshape(-1) for a in arrays])
    for i, chunks in enumerate(asyncio.run(every_node())):
        np.testing.assert_array_equal(np.concatenate([c.reshape(-1) for c in chunks]), want)
        for r, chunk in enumerate(chunks):  # a received chunk has the rows its header gave
            assert r == i or chunk.shape == arrays[r].shape, (i, r, chunk.shape)


# -- real sockets: the session's secret, hello, backpressure ----------------------------------


async def _pair(secret: str | None, token: str | None = None
                ) -> tuple[DataService, DataService]:
    """Two data services of one session on 127.0.0.1 (tcp), connected."""
    services = [DataService(get_transport("tcp"), "127.0.0.1", 0, token, 5.0)
                for _ in range(2)]
    for s in services:
        await s.start()
    nodes = [NodeInfo(i, "127.0.0.1", s.port, (i,)) for i, s in enumerate(services)]
    for i, s in enumerate(services):
        s.set_session(77, i, nodes, secret=secret)
    deadline = time.monotonic() + 5
    await asyncio.gather(*(s.connect_all(deadline) for s in services))
    return services[0], services[1]


async def _close(*services: DataService) -> None:
    await asyncio.gather(*(s.close() for s in services))


def test_without_a_token_a_stranger_cannot_pose_as_a_member() -> None:
    """No token configured: members authenticate with the session's secret. A stranger who
    knows neither the token nor the secret is refused before it can say hello."""
    secret = "ab" * 32

    async def run() -> BaseException | None:
        a, b = await _pair(secret)
        try:
            conn = await get_transport("tcp").connect("127.0.0.1", a.port)
            try:
                await authenticate_client(conn, None, 5.0)
            except AuthenticationError as exc:
                return exc
            finally:
                await conn.close()
            return None
        finally:
            await _close(a, b)

    assert isinstance(asyncio.run(run()), AuthenticationError)


def test_a_hello_without_the_session_is_dropped() -> None:
    """Even past authentication (here: a process that holds the secret), a hello that does not
    name the session is dropped; the node sends it nothing."""
    secret = "cd" * 32

    async def run() -> bool:
        a, b = await _pair(secret)
        try:
            conn = await get_transport("tcp").connect("127.0.0.1", a.port)
            try:
                conn = await authenticate_client(conn, secret, 5.0)
                await conn.send([encode_control({"type": "hello", "node": 1}, 77)])
                try:
                    await asyncio.wait_for(conn.recv(), 1.0)
                except burncoll.TransportError:
                    return True  # dropped
                except TimeoutError:
                    return False
                return False
            finally:
                await conn.close()
        finally:
            await _close(a, b)

    assert asyncio.run(run())


def test_a_reader_stops_reading_past_the_held_budget(monkeypatch: pytest.MonkeyPatch) -> None:
    """Node 1 sends 32 parts of an operation node 0 has not started, with a budget of 4 parts:
    node 0 holds at most the budget and one part more (its reader paused), then, once it
    starts the operation, receives every part, in order."""
    part = 64 << 10
    monkeypatch.setattr(executor_module, "PART_BYTES", part)
    parts, seq = 32, 9
    total = parts * part

    async def run() -> tuple[int, list[int]]:
        a, b = await _pair("ef" * 32)
        a.mailbox.budget.bytes = 4 * part
        try:
            most = 0
            h = header(session=77, seq=seq, chunk_bytes=total, shape=(total // 8,))
            payload = bytes(part)

            async def flood() -> None:
                for i in range(parts):
                    hi = dataclasses.replace(h, offset=i * part)
                    await b.send(0, [encode_data_header(hi, part), payload])

            sending = asyncio.ensure_future(flood())
            for _ in range(40):
                await asyncio.sleep(0.01)
                most = max(most, a.mailbox.budget.held[1])
            await sending
            await asyncio.sleep(0.05)
            most = max(most, a.mailbox.budget.held[1])
            key = (seq, 0, 0, 1, 0)
            a.mailbox.expect(no_check, Receives(seq, 0, {key: total}, part_bytes=part))
            offsets = []
            for _ in range(parts):
                f = await a.mailbox.get(key, time.monotonic() + 5, lambda: TimeoutError())
                assert f.header is not None
                offsets.append(f.header.offset)
            assert a.mailbox.error is None
            return most, offsets
        finally:
            await _close(a, b)

    most, offsets = asyncio.run(run())
    assert most <= 5 * part, most
    assert offsets == [i * part for i in range(parts)]


def test_only_a_part_in_the_senders_own_name_lands_in_place() -> None:
    """A member cannot start writing another node's part straight into the receiver's memory:
    the placer of node 2's connection refuses a header in node 1's name."""
    service = DataService(get_transport("tcp"), "127.0.0.1", 0, None, 5.0)
    nodes = [NodeInfo(i, "127.0.0.1", 1 + i, (i,)) for i in range(3)]
    service.set_session(7, 0, nodes, secret="ab" * 32)
    memory = memoryview(bytearray(PART_BYTES))
    service.mailbox.offer_place(KEY, 0, memory)  # KEY: node 1's part
    first = memoryview(encode_data_header(header(chunk_bytes=PART_BYTES), PART_BYTES))
    size = len(first) + PART_BYTES
    assert place(service.mailbox, service.session, 2, first, size) is None
    placed = place(service.mailbox, service.session, 1, first, size)
    assert placed is not None and placed[1] is memory


def test_array_data_on_the_connection_this_node_sends_on_fails_the_session() -> None:
    """Array data comes only on the connection the receiver dialed; a member sending it on the
    other one (where it could race the real part) fails the session with a ProtocolError."""
    async def run() -> BaseException | None:
        a, b = await _pair("ab" * 32)
        try:
            wrong_way = b.connections.dialed[0]  # b receives on it; a sends on it
            h = header(session=77, src=1, seq=0)
            await wrong_way.send([encode_data_header(h, 8), bytes(8)])
            async with asyncio.timeout(5):
                while a.mailbox.error is None:
                    await asyncio.sleep(0.01)
            return a.mailbox.error
        finally:
            await _close(a, b)

    error = asyncio.run(run())
    assert isinstance(error, ProtocolError), error
    assert "the connection this node sends on" in str(error)
