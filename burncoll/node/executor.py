"""The global executor: walks a schedule among nodes over the data service.

Participants are node indices. A round's sends and receives run concurrently; a received
chunk arrives in parts of at most :data:`PART_BYTES`, and each part is reduced (or copied) as
soon as it arrives, so reduction overlaps the transfer of the next part. Rounds are not
synchronised between nodes: frames are matched by ``(seq, channel, round, src, chunk)``.

Every received header is compared with this node's own call (the fingerprint); a difference
fails the operation on every node with a :class:`~burncoll.MismatchError`.

Every received part is held to the schedule before a byte of it is used (see
:mod:`burncoll.node.mailbox`): the parts of a chunk come in order, each at the byte where the
previous one ended and :data:`PART_BYTES` long (the last one the rest), so every byte of a
receive buffer is written exactly once before it is read, and the pipeline's progress is
always what was written. A chunk's size must be the one this node expects: its buffer's, or,
for a chunk allocated on receipt (broadcast receivers, all-gather), the size the header's dtype
and shape give under the operation's layout -- checked before anything is allocated. Anything
else is a :class:`~burncoll.ProtocolError` naming the sender, on every node.
"""

from __future__ import annotations

import asyncio
import functools
import math
import os
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from burncoll.backends.numpy import host_ufunc
from burncoll.dtypes import dtype_from_name
from burncoll.errors import CollectiveError, CollectiveTimeout, MismatchError, ProtocolError
from burncoll.levels import GlobalOp, HostArray
from burncoll.node.data_service import DataService
from burncoll.node.mailbox import PART_BYTES, FrameKey, Receives
from burncoll.ops import OpKind, ReduceOp
from burncoll.strategies import Action, Schedule, Step
from burncoll.strategies.layout import even_layout
from burncoll.transport.wire import DataHeader, encode_data_header

__all__ = ["PART_BYTES", "GlobalExecutor"]

#: Parts received straight into their place must be larger than this (smaller ones are
#: parsed out of the transport's scratch buffer and copied).
_PLACE_MIN_BYTES = 64 << 10

def describe_fingerprint(kind: OpKind, reduce_op: ReduceOp | None, dtype: str | None,
                         shape: tuple[int, ...], root: int) -> str:
    args = []
    if dtype is not None:
        args.append(f"{dtype}{list(shape)}")
    if reduce_op is not None:
        args.append(f"op={reduce_op.label}")
    if root >= 0:
        args.append(f"root={root}")
    return f"{kind.label}({', '.join(args)})"


#: The largest dimension an array may have (numpy's index type).
_MAX_DIM = 2**63 - 1


@functools.cache
def _memory_bytes() -> int:
    """This machine's physical memory: no array received can be larger."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):  # pragma: no cover - not POSIX
        return _MAX_DIM


def _part(h: DataHeader) -> str:
    return f"the part at byte {h.offset} of chunk {h.chunk} (round {h.round + 1})"


class GlobalExecutor:
    """Runs one node's side of global schedules (on the node's event loop)."""

    def __init__(self, service: DataService) -> None:
        self.service = service

    @property
    def me(self) -> int:
        return self.service.node_index

    # -- fingerprints -------------------------------------------------------------------------
    def describe(self, node: int) -> str:
        nodes = self.service.nodes
        return nodes[node].describe() if 0 <= node < len(nodes) else f"node {node}"

    def checker(self, op: GlobalOp) -> Any:
        """``check(header)``: the error of a frame that is not of this node's call ``op``
        (:class:`~burncoll.MismatchError`), or ``None``.

        A broadcast receiver (which calls it without an array) and an all-gather (whose
        peers' arrays differ in length) learn the array from the frames: every later frame
        of the operation (of the chunk, for an all-gather) must then carry the same dtype and
        shape as the first, or it is a :class:`~burncoll.ProtocolError`.
        """
        first: dict[int, tuple[str | None, tuple[int, ...]]] = {}
        gather = op.kind is OpKind.ALL_GATHER

        def check(h: DataHeader) -> CollectiveError | None:
            array: int | None = None
            if op.kind is OpKind.BROADCAST and h.op_kind is OpKind.BROADCAST:
                same, array = h.root == op.root, -1
            elif gather and h.op_kind is OpKind.ALL_GATHER:
                # the header carries the chunk's own shape: its rows, then op.shape
                same = (h.reduce_op, h.dtype, h.shape[1:], len(h.shape), h.root) == (
                    op.reduce_op, op.dtype, op.shape, len(op.shape) + 1, op.root)
                array = h.chunk
            else:
                same = (h.op_kind, h.reduce_op, h.dtype, h.shape, h.root) == (
                    op.kind, op.reduce_op, op.dtype, op.shape, op.root)
            if not same:
                return self._mismatch(op, h)
            if array is not None:
                seen = first.setdefault(array, (h.dtype, h.shape))
                if seen != (h.dtype, h.shape):
                    return ProtocolError(
                        f"{op.label}: {self.describe(h.src)} sent {_part(h)} of an array "
                        f"{h.dtype}{list(h.shape)} after parts of {seen[0]}{list(seen[1])}: "
                        "every frame of one array carries the same dtype and shape")
            return None

        return check

    def _mismatch(self, op: GlobalOp, h: DataHeader) -> MismatchError:
        shape = h.shape[1:] if h.op_kind is OpKind.ALL_GATHER and h.shape else h.shape
        mine = describe_fingerprint(op.kind, op.reduce_op, op.dtype, op.shape, op.root)
        theirs = describe_fingerprint(h.op_kind, h.reduce_op, h.dtype, shape, h.root)
        return MismatchError(
            f"{op.label}: peers called it with different arguments: "
            f"{self.describe(self.me)} called {mine}; {self.describe(h.src)} called {theirs}"
        )

    # -- what this node receives ----------------------------------------------------------------
    def receives(self, op: GlobalOp, schedule: Schedule, chunks: Sequence[HostArray | None],
                 channel: int = 0) -> Receives:
        """What this node receives when it walks ``schedule`` over ``chunks`` (as
        :meth:`run` is given them): for :meth:`Mailbox.expect <burncoll.node.mailbox.
        Mailbox.expect>` when the operation starts."""
        me = self.me
        totals: dict[FrameKey, int | None] = {}
        for r, round_ in enumerate(schedule.rounds):
            for s in round_:
                if s.dst == me and s.src != me:
                    chunk = chunks[s.chunk]
                    totals[(op.seq, channel, r, s.src, s.chunk)] = (
                        None if chunk is None else chunk.nbytes)
        num_chunks = schedule.num_chunks
        return Receives(op.seq, channel, totals,
                        lambda h: self.expected_bytes(op, num_chunks, h), PART_BYTES)

    def expected_bytes(self, op: GlobalOp, num_chunks: int, h: DataHeader) -> int:
        """The size of chunk ``h.chunk`` that this node allocates on receipt, from the dtype
        and shape ``h`` carries: a broadcast's chunk of its even layout over ``num_chunks``,
        or an all-gather's whole chunk. Raises :class:`~burncoll.ProtocolError` (worded
        "sent ...") for an array no node could hold, or an operation that allocates nothing.
        """
        try:
            itemsize = dtype_from_name(h.dtype or "uint8").itemsize
        except CollectiveError as exc:  # a dtype this process cannot hold (no ml_dtypes)
            raise ProtocolError(f"sent {_part(h)} of dtype {h.dtype}, which this node cannot "
                                f"receive: {exc}") from exc
        # numpy's limit on an array's size counts every dimension, zero ones aside
        if math.prod(d for d in h.shape if d) * itemsize > _MAX_DIM:
            raise ProtocolError(f"sent {_part(h)} of an array of shape {list(h.shape)}, which "
                                "no array can have")
        count = math.prod(h.shape)
        if op.kind is OpKind.BROADCAST and h.op_kind is OpKind.BROADCAST and (
                0 <= h.chunk < num_chunks):
            a, b = even_layout(count, num_chunks)[h.chunk]
        elif op.kind is OpKind.ALL_GATHER and h.op_kind is OpKind.ALL_GATHER:
            a, b = 0, count
        else:
            raise ProtocolError(f"sent {_part(h)} of {op.label}, a chunk this node holds no "
                                "buffer for")
        whole = count * itemsize
        if whole > _memory_bytes():
            raise ProtocolError(
                f"sent {_part(h)} of an array {h.dtype}{list(h.shape)} of {whole} bytes, more "
                f"than this machine's memory ({_memory_bytes()} bytes)")
        return (b - a) * itemsize

    # -- the walk -------------------------------------------------------------------------------
    async def run(
        self, op: GlobalOp, schedule: Schedule, chunks: list[HostArray | None],
        channel: int = 0, dtype: str | None = None, shape: tuple[int, ...] | None = None,
        out: list[HostArray | None] | None = None,
    ) -> tuple[str | None, tuple[int, ...]]:
        """Walk ``schedule`` over ``chunks`` (flat host arrays; ``None`` = not held yet).

        COPY into a ``None`` chunk allocates it from the incoming size (all_gather,
        broadcast receivers). Returns the dtype and shape carried by the frames (the
        root's, for a broadcast receiver).

        ``out`` (one array per chunk, sized as ``chunks``) makes the walk out of place:
        ``chunks`` are only read and the result is written to ``out`` (see
        :func:`_step_buffers`); a chunk no step of this node writes is copied over at the end.

        When every chunk this node holds fits in one part, rounds run one after the other
        (sends, then receives: no task is created). Otherwise every step runs at once and is
        ordered per part (:class:`_Pipeline`): a chunk received in one round is forwarded part
        by part as its parts are reduced, instead of after the whole round.
        """
        learned: list[Any] = [dtype if dtype is not None else op.dtype,
                              shape if shape is not None else op.shape]
        me = self.me
        # Per round, sends before receives: a send reads the chunk as the round found it.
        mine = sorted(((r, s) for r, round_ in enumerate(schedule.rounds) for s in round_
                       if s.src == me or s.dst == me), key=lambda rs: (rs[0], rs[1].src != me))
        if mine:
            buffers = _step_buffers(mine, me, chunks, out)
            walk = _Walk(op, channel, schedule.num_chunks, learned, self.checker(op))
            if all(c is None or c.nbytes <= PART_BYTES for c in chunks):
                await self._sequential(walk, mine, buffers)
            else:
                await self._pipelined(walk, mine, buffers)
        if out is not None:
            _copy_unwritten(mine, me, chunks, out)
        return learned[0], tuple(learned[1])

    async def _sequential(self, walk: _Walk, mine: list[tuple[int, Step]],
                          buffers: list[_Buffers]) -> None:
        for (r, s), (read, write) in zip(mine, buffers, strict=True):
            if s.src == self.me:
                await self._send(walk, r, s, read, None, 0)
            else:
                await self._receive(walk, r, s, read, write, None, 0)

    async def _pipelined(self, walk: _Walk, mine: list[tuple[int, Step]],
                         buffers: list[_Buffers]) -> None:
        pipe = _Pipeline()
        coros = []
        for (r, s), (read, write) in zip(mine, buffers, strict=True):
            if s.src == self.me:
                slot = pipe.add(s.chunk, writes=False)
                coros.append(self._send(walk, r, s, read, pipe, slot))
            else:
                slot = pipe.add(s.chunk, writes=True)
                coros.append(self._receive(walk, r, s, read, write, pipe, slot))
        tasks = [asyncio.ensure_future(c) for c in coros]
        try:
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
            for task in done:
                if not task.cancelled() and task.exception() is not None:
                    raise task.exception()  # type: ignore[misc]
        finally:
            for task in tasks:
                if not task.done():
                    task.cancel()

    async def _send(self, walk: _Walk, r: int, step: Step, chunks: Sequence[HostArray | None],
                    pipe: _Pipeline | None, slot: int) -> None:
        """Send chunk ``step.chunk`` of ``chunks`` (the buffer this step reads), part by part.

        An all-gather's header carries the chunk's own shape (its rows, then the call's
        trailing shape): the receiver allocates the chunk from it."""
        op, channel, learned = walk.op, walk.channel, walk.learned
        c = step.chunk
        if pipe is not None:
            while chunks[c] is None:  # allocated by an earlier receive into it
                await pipe.changed(c)
        data = chunks[c]
        if data is None:
            raise RuntimeError(f"chunk {c} sent before it was received")
        raw = memoryview(np.ascontiguousarray(data).view(np.uint8))  # type: ignore[arg-type]
        total = raw.nbytes
        session = self.service.session or 0
        shape = tuple(learned[1])
        if op.kind is OpKind.ALL_GATHER:
            row = math.prod(shape)
            shape = (data.size // row if row else 0, *shape)
        send = self.service.send
        start = 0
        while True:
            end = min(start + PART_BYTES, total)
            if pipe is not None:
                await pipe.ready(c, slot, end)
            header = DataHeader(
                session=session, seq=op.seq, op_kind=op.kind, reduce_op=op.reduce_op,
                dtype=learned[0], shape=shape, root=op.root, src=self.me, round=r,
                channel=channel, chunk=c, offset=start, chunk_bytes=total,
            )
            await send(step.dst, [encode_data_header(header, end - start), raw[start:end]])
            if pipe is not None:
                pipe.advance(c, slot, end)
            start = end
            if start >= total:
                break
        if pipe is not None:
            pipe.finish(c, slot)

    async def _receive(self, walk: _Walk, r: int, step: Step,
                       read: Sequence[HostArray | None], write: list[HostArray | None],
                       pipe: _Pipeline | None, slot: int) -> None:
        """Receive chunk ``step.chunk`` part by part into ``write``; a REDUCE combines each
        part with the same bytes of ``read`` (``write`` itself when in place).

        Each part must be the next one of the chunk's schedule -- at the byte where the
        previous one ended, :data:`PART_BYTES` long or the rest -- so that every byte is
        written once before the pipeline lets a later step read it."""
        op, learned = walk.op, walk.learned
        c = step.chunk
        key = (op.seq, walk.channel, r, step.src, c)
        got = 0
        total = -1
        target = write[c]
        source = read[c]
        dtype: Any = None
        ufunc = host_ufunc(op.reduce_op) if (
            step.action is Action.REDUCE and op.reduce_op is not None) else None
        mailbox = self.service.mailbox
        while got < total or total < 0:
            landed = await self._make_room(key, step, target, ufunc is None, got, pipe, slot)
            frame = await mailbox.get(
                key, op.deadline, lambda: self.timeout_error(op, step.src, r))
            if landed:
                mailbox.unland(key, got)  # unused if the part came before the room was made
            h = frame.header
            if h is None:  # pragma: no cover - the mailbox holds DATA frames only
                continue
            error = walk.check(h)
            if error is not None:
                self.service.fail(error)
                raise error
            if total < 0:
                total = h.chunk_bytes
                if op.kind is not OpKind.ALL_GATHER:  # (an all-gather's is the chunk's own)
                    learned[0], learned[1] = h.dtype, h.shape
                target = self._prepare_target(walk, step, write, h)
                source = read[c]  # allocated just now when in place
                dtype = target.dtype
                if pipe is not None:
                    pipe.wake(c)
            payload = frame.payload
            size = len(payload)
            want = min(PART_BYTES, total - got)
            if h.offset != got or size != want or h.chunk_bytes != total:
                raise self.fail_protocol(
                    op, h, f"{_part(h)} of {size} bytes (of a chunk of {h.chunk_bytes}) where "
                    f"the schedule has byte {got}, {want} bytes (of {total}): parts overlap, "
                    "come out of order or are cut otherwise")
            if size % dtype.itemsize:
                raise self.fail_protocol(op, h, "a part not aligned to its dtype")
            if target is None or source is None:  # pragma: no cover - prepared above
                raise RuntimeError("no target")
            start = got // dtype.itemsize
            count = size // dtype.itemsize
            region = target[start:start + count]
            if pipe is not None:
                await pipe.ready(c, slot, got + size)
            if ufunc is not None:
                incoming = np.frombuffer(payload, dtype=dtype)
                ufunc(source[start:start + count], incoming, out=region)
            elif not frame.placed:  # (a placed part is there already: it was at byte got)
                region[...] = np.frombuffer(payload, dtype=dtype)
            got += size
            if pipe is not None:
                pipe.advance(c, slot, got)
            if total == 0:
                break
        if pipe is not None:
            pipe.finish(c, slot)

    async def _make_room(self, key: FrameKey, step: Step, target: HostArray | None,
                         copy: bool, got: int, pipe: _Pipeline | None, slot: int) -> bool:
        """Let the next part of a COPY step be received straight into its place in ``target``
        (no copy out of a receive buffer): once every earlier step on those bytes is done with
        them, tell the mailbox where the part goes. ``True`` if room was made."""
        if not copy or target is None or got >= target.nbytes:
            return False
        end = min(got + PART_BYTES, target.nbytes)
        if end - got <= _PLACE_MIN_BYTES:
            return False  # small parts are read into the transport's scratch buffer anyway
        if pipe is not None:
            await pipe.ready(step.chunk, slot, end)
        raw = memoryview(target.view(np.uint8)).cast("B")  # type: ignore[arg-type]
        self.service.mailbox.land(key, got, raw[got:end])
        return True

    def _prepare_target(self, walk: _Walk, step: Step, chunks: list[HostArray | None],
                        h: DataHeader) -> HostArray:
        """The buffer chunk ``step.chunk`` is received into, once ``h`` (its first part) says
        its size: the chunk's own buffer, which must be that size, or one allocated for it
        when the size is the one ``h``'s dtype and shape give (:meth:`expected_bytes`)."""
        op = walk.op
        target = chunks[step.chunk]
        try:
            expected = (target.nbytes if target is not None
                        else self.expected_bytes(op, walk.num_chunks, h))
        except ProtocolError as exc:
            raise self.fail_protocol(op, h, str(exc).removeprefix("sent ")) from None
        if h.chunk_bytes != expected:
            raise self.fail_protocol(
                op, h, f"{_part(h)} announcing a chunk of {h.chunk_bytes} bytes where this "
                f"node expects {expected}")
        if target is None:
            dtype = dtype_from_name(h.dtype or "uint8")
            try:
                target = np.empty(expected // dtype.itemsize, dtype=dtype)
            except (MemoryError, ValueError) as exc:
                raise self.fail_protocol(
                    op, h, f"a chunk of {expected} bytes ({h.dtype}{list(h.shape)}) that this "
                    f"node cannot allocate ({type(exc).__name__}: {exc})") from None
            chunks[step.chunk] = target
        return target

    def fail_protocol(self, op: GlobalOp, h: DataHeader, what: str) -> CollectiveError:
        """Fail the session: node ``h.src`` sent ``what``."""
        error = ProtocolError(f"{op.label}: {self.describe(h.src)} sent {what}")
        self.service.fail(error)
        return error

    def timeout_error(self, op: GlobalOp, src: int, r: int) -> CollectiveTimeout:
        """The error for a frame from node ``src`` that did not come in time."""
        elapsed = time.monotonic() - op.started
        node = self.service.nodes[src]
        return CollectiveTimeout(
            f"{op.label} timed out after {elapsed:.1f} s (timeout "
            f"{self.service.timeout:g} s) on {self.service.nodes[self.me].describe()}, "
            f"waiting for {node.describe()} in round {r + 1}"
        )


class _Walk:
    """One :meth:`GlobalExecutor.run`: the operation, its channel, the schedule's number of
    chunks, the array learned from the frames (``[dtype, shape]``), and the fingerprint
    check (one per walk: it remembers the first array a frame carried)."""

    __slots__ = ("channel", "check", "learned", "num_chunks", "op")

    def __init__(self, op: GlobalOp, channel: int, num_chunks: int, learned: list[Any],
                 check: Any) -> None:
        self.op = op
        self.channel = channel
        self.num_chunks = num_chunks
        self.learned = learned
        self.check = check


#: The chunk lists one step reads and writes (a send only reads).
_Buffers = tuple[Sequence[HostArray | None], list[HostArray | None]]


def _step_buffers(mine: list[tuple[int, Step]], me: int, chunks: list[HostArray | None],
                  out: list[HostArray | None] | None) -> list[_Buffers]:
    """Which chunk list each of ``mine`` (in walk order) reads and writes.

    In place, both are ``chunks``. Out of place, chunk ``c`` lives in ``chunks`` (the caller's
    input, never written) until this node's first step that writes it, and in ``out`` from
    that step on: that step combines ``chunks[c]`` with what it receives into ``out[c]``, and
    every later step reads and writes ``out[c]``. This is decided here, once, from the order
    of the steps on ``c`` -- the order :class:`_Pipeline` enforces part by part -- never from
    progress at run time: a pipelined send of ``c`` starts while the receive before it is still
    writing ``c``, and must read ``out`` from its first part on (it waits for each part there).
    """
    if out is None:
        return [(chunks, chunks)] * len(mine)
    written: set[int] = set()
    buffers: list[_Buffers] = []
    for _, s in mine:
        read = out if s.chunk in written else chunks
        buffers.append((read, out))
        if s.src != me:
            written.add(s.chunk)
    return buffers


def _copy_unwritten(mine: list[tuple[int, Step]], me: int, chunks: list[HostArray | None],
                    out: list[HostArray | None]) -> None:
    """Out of place: the chunks no step of this node wrote still hold their value in
    ``chunks`` only (a node that just sends them, or a world of one node)."""
    written = {s.chunk for _, s in mine if s.src != me}
    for c, (src, dst) in enumerate(zip(chunks, out, strict=True)):
        if c not in written and src is not None and dst is not None:
            np.copyto(dst, src)


class _Pipeline:
    """Orders, part by part, the steps of one node that touch the same chunk.

    The steps on a chunk form a sequence in round order; each has a *slot* whose progress is
    the number of the chunk's leading bytes it has finished (parts of a chunk are sent and
    received in order). A step may handle bytes ``[.., end)`` once every earlier step it
    conflicts with (a receive after anything, anything after a receive: reading and writing
    the same bytes) has progressed to ``end``.
    """

    __slots__ = ("_progress", "_waiters", "_writes")

    def __init__(self) -> None:
        self._writes: dict[int, list[bool]] = {}
        self._progress: dict[int, list[float]] = {}
        self._waiters: dict[int, list[asyncio.Future[None]]] = {}

    def add(self, chunk: int, writes: bool) -> int:
        kinds = self._writes.setdefault(chunk, [])
        kinds.append(writes)
        self._progress.setdefault(chunk, []).append(0)
        return len(kinds) - 1

    def _ok(self, chunk: int, slot: int, end: int) -> bool:
        kinds, progress = self._writes[chunk], self._progress[chunk]
        writes = kinds[slot]
        return all(progress[j] >= end for j in range(slot) if writes or kinds[j])

    async def ready(self, chunk: int, slot: int, end: int) -> None:
        while not self._ok(chunk, slot, end):
            await self.changed(chunk)

    def changed(self, chunk: int) -> asyncio.Future[None]:
        waiter = asyncio.get_running_loop().create_future()
        self._waiters.setdefault(chunk, []).append(waiter)
        return waiter

    def wake(self, chunk: int) -> None:
        for waiter in self._waiters.pop(chunk, ()):
            if not waiter.done():
                waiter.set_result(None)

    def advance(self, chunk: int, slot: int, end: int) -> None:
        self._progress[chunk][slot] = end
        self.wake(chunk)

    def finish(self, chunk: int, slot: int) -> None:
        self.advance(chunk, slot, math.inf)  # type: ignore[arg-type]
