"""The global walk without sockets or an event loop (:mod:`burncoll.node.walk`).

A simulator runs the walk of every node of a world in memory: each node's :class:`Walk`
yields its requests, a :class:`SendPart` becomes a frame (its bytes copied as they leave) in
the destination's queue and its real :class:`Mailbox`, which holds every part to the schedule
that node registered with :func:`receives`; a :class:`ReceivePart` is answered when its frame
is there -- straight into the memory it offered when the frame came after the offer, as a
transport places it -- and an :class:`AwaitChunk` once the chunk changed. The transfers run in
a random (seeded) order, so only the pipeline's part-by-part order keeps the result right.
Every strategy, world sizes 2 to 9, every root, every operation, sizes smaller than the world
and sizes of several parts, in the sequential and the pipelined walk; results are compared
with NumPy float64 references computed independently.
"""

from __future__ import annotations

import dataclasses
import random
import re
import time
from collections import deque
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from burncoll import compression
from burncoll.errors import MismatchError, ProtocolError
from burncoll.levels import GlobalOp, HostArray
from burncoll.node.mailbox import FrameKey, Mailbox
from burncoll.node.places import ReducePlace
from burncoll.node.walk import AwaitChunk, ReceivePart, SendPart, Transfer, Walk, receives
from burncoll.ops import OpKind, ReduceOp
from burncoll.protocol.checks import header_check
from burncoll.protocol.wire import DataHeader, Frame, FrameType
from burncoll.strategies import ByHost, Centralized, Doubling, Ring, Schedule, Strategy, Tree
from burncoll.strategies.layout import even_layout, sizes_layout

STRATEGIES: list[Strategy] = [Centralized(), Tree(2), Tree(3), Ring(), Doubling()]
WORLDS = range(2, 10)
#: Bytes per part: 3 float64 (chunks of several parts: the pipelined walk), or enough for
#: every chunk here (the sequential walk).
SMALL_PARTS, ONE_PART = 24, 1 << 20
#: Parts over 8 bytes are offered a place to be received into.
PLACE_MIN = 8
#: How often a transfer that could move is left behind for a pass (speeds vary at random).
SKIP = 0.25


def describe(node: int) -> str:
    return f"node {node}"


def _op(kind: OpKind, reduce_op: ReduceOp | None = None, dtype: str | None = "float64",
        shape: tuple[int, ...] = (), root: int = -1) -> GlobalOp:
    return GlobalOp(seq=5, kind=kind, reduce_op=reduce_op, dtype=dtype, shape=shape,
                    root=root, deadline=1e9, started=0.0)


class _Node:
    """One node of the simulated world: its walk, transfers, inbox and mailbox."""

    def __init__(self, me: int, walk: Walk, schedule: Schedule, op: GlobalOp) -> None:
        self.me, self.walk = me, walk
        self.versions: dict[int, int] = {}
        self.transfers = deque(walk.transfers(self._changed))
        #: id(transfer) -> its request (none yet: not started), and the version of the chunk
        #: an AwaitChunk waits on
        self.pending: dict[int, Any] = {}
        self.waits: dict[int, int] = {}
        self.queues: dict[FrameKey, deque[Frame]] = {}
        self.mailbox = Mailbox(describe, clock=lambda: 0.0)
        self.mailbox.on_error = self._fail
        self.mailbox.expect(header_check(op, me, describe),
                            receives(op, schedule, me, walk.chunks, walk.channel,
                                     walk.part_bytes))

    def _changed(self, chunk: int) -> None:
        self.versions[chunk] = self.versions.get(chunk, 0) + 1

    def _fail(self, error: BaseException) -> None:
        raise error

    def active(self) -> list[Transfer]:
        """The transfers that may run now: all of them when pipelined, else the first."""
        return list(self.transfers) if self.walk.pipelined else list(self.transfers)[:1]

    def deliver(self, frame: Frame) -> None:
        """A frame arrives: into the memory its receiver offered, if it did; a borrowed one
        (lent by its transport, as the shared-memory ring does) as the mailbox settled it."""
        h = frame.header
        assert h is not None
        key = (h.seq, h.channel, h.round, h.src, h.chunk)
        self.mailbox.put(frame)  # raises ProtocolError for a part off the schedule
        if frame.borrowed:
            frame = self.mailbox._frames[key][-1]
            assert not frame.borrowed
        else:
            memory = self.mailbox.take_place(key, h.offset, len(frame.payload))
            if memory is not None:
                memory[:] = frame.payload
                frame = dataclasses.replace(frame, payload=memory, placed=True)
        self.queues.setdefault(key, deque()).append(frame)


class _World:
    """Every node's walk of one schedule, run to the end in memory."""

    def __init__(self, nodes: list[_Node], seed: int) -> None:
        self.nodes = nodes
        self.rng = random.Random(seed)

    def run(self) -> None:
        while any(node.transfers for node in self.nodes):
            moved = skipped = False
            for node in self._shuffled(self.nodes):
                for transfer in self._shuffled(node.active()):
                    if self.rng.random() < SKIP:  # a slow moment: others get ahead
                        skipped = True
                        continue
                    moved |= self._step(node, transfer)
            assert moved or skipped, "the walks are stuck (every transfer waits)"

    def _shuffled(self, items: list[Any]) -> list[Any]:
        """``items`` rotated and maybe reversed at random (cheaper than a shuffle, and every
        item still comes first now and then)."""
        k = self.rng.randrange(len(items)) if items else 0
        items = items[k:] + items[:k]
        return items[::-1] if self.rng.random() < 0.5 else items

    def _step(self, node: _Node, transfer: Transfer) -> bool:
        """Answer ``transfer``'s request if it can be; ``True`` if it moved."""
        key = id(transfer)
        request = node.pending.get(key)
        reply: Frame | None = None
        if isinstance(request, ReceivePart):
            queue = node.queues.get(request.key)
            if not queue:
                return False
            reply = queue.popleft()
            if request.place is not None:
                node.mailbox.withdraw_place(request.key, request.offset)
        elif (isinstance(request, AwaitChunk)
              and node.versions.get(request.chunk, 0) == node.waits[key]):
            return False
        self._resume(node, transfer, reply)
        return True

    def _resume(self, node: _Node, transfer: Transfer, reply: Frame | None) -> None:
        key = id(transfer)
        try:
            request = transfer.send(reply)
        except StopIteration:
            node.transfers.remove(transfer)
            return
        node.pending[key] = request
        if isinstance(request, SendPart):  # sent now: the bytes as the request finds them
            lent = self.rng.random() < 0.5  # or lent, and the transport's memory reused at once
            payload = bytearray(request.payload)
            self.nodes[request.dst].deliver(Frame(FrameType.DATA, request.header,
                                                  memoryview(payload), None, borrowed=lent))
            if lent:
                payload[:] = b"\xa5" * len(payload)
        elif isinstance(request, AwaitChunk):
            node.waits[key] = node.versions.get(request.chunk, 0)
        elif isinstance(request, ReceivePart) and request.place is not None:
            node.mailbox.offer_place(request.key, request.offset, request.place)


def simulate(schedule: Schedule, ops: list[GlobalOp], chunks: list[list[HostArray | None]],
             part_bytes: int, outs: list[list[HostArray | None]] | None = None,
             seed: int = 0) -> list[Walk]:
    """Walk ``schedule`` on every node (node ``i``: ``ops[i]`` over ``chunks[i]``)."""
    walks = [Walk(ops[i], schedule, i, chunks[i], check=header_check(ops[i], i, describe),
                  describe=describe, out=outs[i] if outs is not None else None, session=3,
                  part_bytes=part_bytes, place_min_bytes=PLACE_MIN)
             for i in range(schedule.world)]
    nodes = [_Node(i, walks[i], schedule, ops[i]) for i in range(schedule.world)]
    _World(nodes, seed).run()
    for node in nodes:
        assert node.mailbox.error is None
        assert not any(node.queues.values()), "a frame was sent that nobody received"
    return walks


def _inputs(world: int, size: int, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng([world, size, seed])
    return [rng.integers(-8, 9, size).astype(np.float64) + rng.random(size) for _ in range(world)]


def _cases() -> Iterator[tuple[Strategy, int]]:
    for strategy in STRATEGIES:
        for world in WORLDS:
            yield strategy, world
    for world in WORLDS:  # composed by host: 2 hosts in halves, interleaved, 3 hosts unequal
        for hosts in dict.fromkeys([tuple(2 * i // world for i in range(world)),
                                    tuple(i % 2 for i in range(world)),
                                    tuple(min(i // 2, 2) for i in range(world))]):
            yield ByHost(hosts, Ring() if world % 2 else Tree(2)), world


def _sizes(world: int) -> list[tuple[int, int]]:
    """``(elements, part_bytes)``: fewer elements than nodes, one each, several parts each
    (pipelined), and the same in one part each (sequential)."""
    return [(1, SMALL_PARTS), (world - 1, SMALL_PARTS), (4 * world + 3, SMALL_PARTS),
            (4 * world + 3, ONE_PART)]


def _rooted_sizes(world: int, root: int) -> list[tuple[int, int]]:
    """One of :func:`_sizes` per root (in turn: every size comes with several roots)."""
    return [_sizes(world)[(root + world) % 4]]


_REFERENCES = {ReduceOp.SUM: np.sum, ReduceOp.MAX: np.max}


@pytest.mark.parametrize("reduce_op", [ReduceOp.SUM, ReduceOp.MAX])
def test_all_reduce_in_place_and_out_of_place(reduce_op: ReduceOp) -> None:
    for strategy, world in _cases():
        schedule = strategy.all_reduce(world)
        sizes = _sizes(world) if reduce_op is ReduceOp.SUM else _sizes(world)[1:3]
        for size, part in sizes:
            xs = _inputs(world, size, reduce_op)
            want = _REFERENCES[reduce_op](np.stack(xs), axis=0)
            layout = even_layout(size, schedule.num_chunks)
            op = _op(OpKind.ALL_REDUCE, reduce_op, shape=(size,))
            bufs = [x.copy() for x in xs]
            simulate(schedule, [op] * world, [[b[a:z] for a, z in layout] for b in bufs], part,
                     seed=size)
            outs = [np.full(size, np.nan) for _ in range(world)]
            for x in xs:
                x.flags.writeable = False  # out of place: the input is only read
            simulate(schedule, [op] * world, [[x[a:z] for a, z in layout] for x in xs], part,
                     outs=[[o[a:z] for a, z in layout] for o in outs], seed=size + 1)
            for node in range(world):
                where = (strategy.spec, world, size, node)
                np.testing.assert_allclose(bufs[node], want, rtol=1e-12, atol=1e-9,
                                           err_msg=str(where))
                assert bufs[node].tobytes() == bufs[0].tobytes(), where  # bitwise everywhere
                assert outs[node].tobytes() == bufs[node].tobytes(), where


@pytest.mark.parametrize("kind", ["bf16", "fp16"])
def test_compressed_all_reduce_ends_bitwise_identical_on_every_node(kind: str) -> None:
    """Every node keeps the 16-bit values it sent and no more -- a chunk it reduced last is
    rounded as it is sent, part by part; one it never sends, at the end -- so every node's
    result is the same, every value a 16-bit one, within the documented error bound."""
    for strategy, world in _cases():
        if strategy.exchanges:
            continue  # its partners round differently: choose() refuses it with compression
        schedule = strategy.all_reduce(world)
        for size, part in _sizes(world):
            xs = [x.astype(np.float32) for x in _inputs(world, size, 7)]
            ref = np.sum(np.stack(xs).astype(np.float64), axis=0)
            bound = compression.error_bound(kind, world, np.sum(np.abs(np.stack(xs)), axis=0))
            layout = even_layout(size, schedule.num_chunks)
            op = _op(OpKind.ALL_REDUCE, ReduceOp.SUM, "float32", (size,),
                     compression.root_code(kind))
            bufs = [x.copy() for x in xs]
            simulate(schedule, [op] * world, [[b[a:z] for a, z in layout] for b in bufs],
                     part // 2, seed=size)
            outs = [np.full(size, np.nan, np.float32) for _ in range(world)]
            for x in xs:
                x.flags.writeable = False  # out of place: the input is only read
            simulate(schedule, [op] * world, [[x[a:z] for a, z in layout] for x in xs],
                     part // 2, outs=[[o[a:z] for a, z in layout] for o in outs], seed=size)
            for node in range(world):
                where = (kind, strategy.spec, world, size, node)
                for got in (bufs[node], outs[node]):
                    assert got.tobytes() == bufs[0].tobytes(), where
                    narrow = compression.decode(compression.encode(got, kind), kind)
                    assert narrow.tobytes() == got.tobytes(), where  # 16-bit values only
                    assert (np.abs(got - ref) <= bound).all(), where


def test_reduce_to_every_root() -> None:
    for strategy, world in _cases():
        for root in range(world):
            schedule = strategy.reduce(world, root)
            for size, part in _rooted_sizes(world, root):
                xs = _inputs(world, size, root)
                layout = even_layout(size, schedule.num_chunks)
                bufs = [x.copy() for x in xs]
                op = _op(OpKind.REDUCE, ReduceOp.SUM, shape=(size,), root=root)
                simulate(schedule, [op] * world, [[b[a:z] for a, z in layout] for b in bufs],
                         part, seed=root)
                np.testing.assert_allclose(bufs[root], np.sum(np.stack(xs), axis=0),
                                           rtol=1e-12, atol=1e-9,
                                           err_msg=str((strategy.spec, world, root)))


def test_broadcast_from_every_root() -> None:
    """Receivers hold nothing and call without an array: they allocate each chunk from its
    first header and learn the root's dtype and shape. (Data differ from case to case: a
    buffer allocated on receipt must not happen to hold the right bytes already.)"""
    for case, (strategy, world) in enumerate(_cases()):
        for root in range(world):
            schedule = strategy.broadcast(world, root)
            for size, part in _rooted_sizes(world, root):
                x = _inputs(1, size, 16 * case + root)[0]
                layout = even_layout(size, schedule.num_chunks)
                chunks: list[list[HostArray | None]] = [
                    [x[a:z] for a, z in layout] if i == root else [None] * len(layout)
                    for i in range(world)]
                ops = [_op(OpKind.BROADCAST, shape=(size,), root=root) if i == root
                       else _op(OpKind.BROADCAST, dtype=None, root=root) for i in range(world)]
                walks = simulate(schedule, ops, chunks, part, seed=root)
                for i, walk in enumerate(walks):
                    where = (strategy.spec, world, root, size, i)
                    assert walk.finish() == ("float64", (size,)), where
                    got = np.concatenate([c for c in chunks[i] if c is not None])
                    np.testing.assert_array_equal(got, x, err_msg=str(where))


def test_reduce_scatter_to_the_owners() -> None:
    for strategy, world in _cases():
        owners = tuple(range(world))
        schedule = strategy.reduce_scatter(world, owners)
        for size, part in _sizes(world):
            xs = _inputs(world, size, 7)
            want = np.sum(np.stack(xs), axis=0)
            layout = even_layout(size, len(owners))
            bufs = [x.copy() for x in xs]
            op = _op(OpKind.REDUCE_SCATTER, ReduceOp.SUM, shape=(size,))
            simulate(schedule, [op] * world, [[b[a:z] for a, z in layout] for b in bufs], part)
            for c, (a, z) in enumerate(layout):
                np.testing.assert_allclose(bufs[owners[c]][a:z], want[a:z], rtol=1e-12,
                                           atol=1e-9, err_msg=str((strategy.spec, world, size, c)))


def test_all_gather_of_different_lengths() -> None:
    """Each node owns one chunk of its own number of rows (zero included); every node ends
    with all of them, allocated from their headers."""
    for strategy, world in _cases():
        owners = tuple(range(world))
        schedule = strategy.all_gather(world, owners)
        for rows, part in ((1, SMALL_PARTS), (4, SMALL_PARTS), (4, ONE_PART)):
            arrays = [np.arange((rows + i % 3 - 1) * 2, dtype=np.float64) + 100 * i
                      for i in range(world)]
            chunks: list[list[HostArray | None]] = [
                [arrays[c] if owners[c] == i else None for c in range(world)]
                for i in range(world)]
            op = _op(OpKind.ALL_GATHER, shape=(2,))
            simulate(schedule, [op] * world, chunks, part, seed=rows)
            for i in range(world):
                got = [c for c in chunks[i] if c is not None]
                assert len(got) == world, (strategy.spec, world, i)
                np.testing.assert_array_equal(np.concatenate([g.reshape(-1) for g in got]),
                                              np.concatenate(arrays))
                # a received chunk has the rows its header gave: (rows, 2)
                assert all(g.shape == (a.size // 2, 2) for g, a in zip(got, arrays, strict=True)
                           if g is not a)


def test_barrier_moves_empty_chunks() -> None:
    for strategy, world in _cases():
        schedule = strategy.all_reduce(world)
        chunks: list[list[HostArray | None]] = [
            [np.empty(0, np.uint8) for _ in range(schedule.num_chunks)] for _ in range(world)]
        simulate(schedule, [_op(OpKind.BARRIER, dtype=None)] * world, chunks, SMALL_PARTS)


def test_the_walk_and_the_mailbox_read_no_clock(monkeypatch: pytest.MonkeyPatch) -> None:
    """Time is the caller's: a whole pipelined walk runs with the clock unreadable."""
    schedule = Ring().all_reduce(3)
    xs = _inputs(3, 40, 0)
    layout = even_layout(40, schedule.num_chunks)
    op = _op(OpKind.ALL_REDUCE, ReduceOp.SUM, shape=(40,))

    def no_clock() -> float:
        raise AssertionError("the clock was read")

    with monkeypatch.context() as patch:
        patch.setattr(time, "monotonic", no_clock)
        patch.setattr(time, "time", no_clock)
        simulate(schedule, [op] * 3, [[x[a:z] for a, z in layout] for x in xs], SMALL_PARTS)
    np.testing.assert_allclose(xs[0], xs[2])


def test_requests_of_a_sequential_walk() -> None:
    """Node 1 of a two-node ring all-reduce of one part per chunk: round by round, a round's
    send before its receive; the chunk reduced in the first round is sent on in the second,
    and the copy of the other chunk is offered its place (the reduce, a reduction into its
    place: for a part its transport lends)."""
    schedule = Ring().all_reduce(2)
    op = _op(OpKind.ALL_REDUCE, ReduceOp.SUM, shape=(2,))
    buf = np.array([1.0, 2.0])
    walk = Walk(op, schedule, 1, [buf[:1], buf[1:]], check=header_check(op, 1, describe),
                describe=describe, part_bytes=8, place_min_bytes=0)
    assert not walk.pipelined
    requests: list[Any] = []
    for transfer in walk.transfers():
        request = next(transfer)
        requests.append(request)
        if isinstance(request, SendPart):
            assert request.dst == 0
            request = dataclasses.replace(request, payload=memoryview(bytes(request.payload)))
            requests[-1] = request
        reply = _frame(request.key, np.array([10.0])) if isinstance(request, ReceivePart) else None
        with pytest.raises(StopIteration):
            transfer.send(reply)
    assert [type(r).__name__ for r in requests] == [
        "SendPart", "ReceivePart", "SendPart", "ReceivePart"]
    reduced, copied = requests[1].key[4], requests[3].key[4]
    assert isinstance(requests[1].place, ReducePlace)  # REDUCE, then COPY
    assert isinstance(requests[3].place, memoryview)
    assert requests[2].header.chunk == reduced and requests[2].header.round == 1
    assert np.frombuffer(requests[2].payload).tolist() == [[1.0, 2.0][reduced] + 10]
    assert buf[reduced] == [1.0, 2.0][reduced] + 10 and buf[copied] == 10.0


def _frame(key: FrameKey, payload: np.ndarray, **fields: Any) -> Frame:
    seq, channel, r, src, chunk = key
    h = dict(session=3, seq=seq, op_kind=OpKind.ALL_REDUCE, reduce_op=ReduceOp.SUM,
             dtype="float64", shape=(2,), root=-1, src=src, round=r, channel=channel,
             chunk=chunk, offset=0, chunk_bytes=payload.nbytes)
    h.update(fields)
    # built directly, not decoded: the wire's own checks would refuse some of these first
    return Frame(FrameType.DATA, DataHeader(**h), memoryview(payload.tobytes()), None)


@pytest.mark.parametrize(("fields", "error", "why"), [
    ({"offset": 8}, ProtocolError, "where the schedule has byte 0"),
    ({"chunk_bytes": 16}, ProtocolError, "announcing a chunk of 16 bytes where this node "
                                         "expects 8"),
    ({"reduce_op": ReduceOp.MAX}, MismatchError, "called all_reduce(float64[2], op=max)"),
])
def test_a_frame_off_the_rules_raises_naming_its_sender(
    fields: dict[str, Any], error: type[Exception], why: str
) -> None:
    """The walk raises (the executor then fails the session): the error names node 0."""
    schedule = Ring().all_reduce(2)
    op = _op(OpKind.ALL_REDUCE, ReduceOp.SUM, shape=(2,))
    buf = np.array([1.0, 2.0])
    walk = Walk(op, schedule, 1, [buf[:1], buf[1:]], check=header_check(op, 1, describe),
                describe=describe, part_bytes=8)
    receive = walk.transfers()[1]
    request = next(receive)
    assert isinstance(request, ReceivePart)
    with pytest.raises(error, match=re.escape(why)) as info:
        receive.send(_frame(request.key, np.array([10.0]), **fields))
    assert "node 0" in str(info.value)
    assert buf.tolist() == [1.0, 2.0], "nothing of the bad part was used"


def test_the_simulator_holds_parts_to_the_receivers_registration() -> None:
    """The simulator itself: a schedule whose chunks do not match the layout's sizes on
    another node is caught by the receiver's registration (the mailbox)."""
    schedule = Centralized().all_reduce(2)
    op = _op(OpKind.ALL_REDUCE, ReduceOp.SUM, shape=(4,))
    a, b = np.zeros(4), np.zeros(4)
    chunks: list[list[HostArray | None]] = [
        [a[x:y] for x, y in sizes_layout([4])], [b[x:y] for x, y in sizes_layout([3])]]
    with pytest.raises(ProtocolError):
        simulate(schedule, [op, op], chunks, SMALL_PARTS)
