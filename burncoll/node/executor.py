"""The global executor: walks a schedule among nodes over the data service.

Participants are node indices. A round's sends and receives run concurrently; a received
chunk arrives in parts of at most :data:`PART_BYTES`, and each part is reduced (or copied) as
soon as it arrives, so reduction overlaps the transfer of the next part. Rounds are not
synchronised between nodes: frames are matched by ``(seq, channel, round, src, chunk)``.

Every received header is compared with this node's own call (the fingerprint); a difference
fails the operation on every node with a :class:`~burncoll.MismatchError`.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from burncoll.backends.dtypes import dtype_from_name
from burncoll.backends.numpy import host_ufunc
from burncoll.errors import CollectiveError, CollectiveTimeout, MismatchError
from burncoll.local.link import GlobalOp, HostArray
from burncoll.node.data_service import DataService
from burncoll.node.mailbox import FrameKey
from burncoll.ops import OpKind, ReduceOp
from burncoll.strategies import Action, Schedule, Step
from burncoll.transport.wire import DataHeader, encode_data_header

__all__ = ["PART_BYTES", "GlobalExecutor"]

#: Largest payload of one frame; bigger chunks travel in several parts.
PART_BYTES = 4 << 20
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


class GlobalExecutor:
    """Runs one node's side of global schedules (on the node's event loop)."""

    def __init__(self, service: DataService) -> None:
        self.service = service

    @property
    def me(self) -> int:
        return self.service.node_index

    # -- fingerprints -------------------------------------------------------------------------
    def checker(self, op: GlobalOp) -> Any:
        nodes = self.service.nodes

        def check(h: DataHeader) -> CollectiveError | None:
            if op.kind is OpKind.BROADCAST and h.op_kind is OpKind.BROADCAST:
                same = h.root == op.root
            else:
                same = (h.op_kind, h.reduce_op, h.dtype, h.shape, h.root) == (
                    op.kind, op.reduce_op, op.dtype, op.shape, op.root)
            if same:
                return None
            mine = describe_fingerprint(op.kind, op.reduce_op, op.dtype, op.shape, op.root)
            theirs = describe_fingerprint(h.op_kind, h.reduce_op, h.dtype, h.shape, h.root)
            return MismatchError(
                f"{op.label}: peers called it with different arguments: "
                f"{nodes[self.me].describe()} called {mine}; "
                f"{nodes[h.src].describe() if 0 <= h.src < len(nodes) else h.src} "
                f"called {theirs}"
            )

        return check

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
            if all(c is None or c.nbytes <= PART_BYTES for c in chunks):
                await self._sequential(op, channel, mine, buffers, learned)
            else:
                await self._pipelined(op, channel, mine, buffers, learned)
        if out is not None:
            _copy_unwritten(mine, me, chunks, out)
        return learned[0], tuple(learned[1])

    async def _sequential(self, op: GlobalOp, channel: int, mine: list[tuple[int, Step]],
                          buffers: list[_Buffers], learned: list[Any]) -> None:
        check = self.checker(op)
        for (r, s), (read, write) in zip(mine, buffers, strict=True):
            if s.src == self.me:
                await self._send(op, r, channel, s, read, learned, None, 0)
            else:
                await self._receive(op, r, channel, s, read, write, learned, check, None, 0)

    async def _pipelined(self, op: GlobalOp, channel: int, mine: list[tuple[int, Step]],
                         buffers: list[_Buffers], learned: list[Any]) -> None:
        check = self.checker(op)
        pipe = _Pipeline()
        coros = []
        for (r, s), (read, write) in zip(mine, buffers, strict=True):
            if s.src == self.me:
                slot = pipe.add(s.chunk, writes=False)
                coros.append(self._send(op, r, channel, s, read, learned, pipe, slot))
            else:
                slot = pipe.add(s.chunk, writes=True)
                coros.append(self._receive(op, r, channel, s, read, write, learned, check,
                                           pipe, slot))
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

    async def _send(self, op: GlobalOp, r: int, channel: int, step: Step,
                    chunks: Sequence[HostArray | None], learned: list[Any],
                    pipe: _Pipeline | None, slot: int) -> None:
        """Send chunk ``step.chunk`` of ``chunks`` (the buffer this step reads), part by part."""
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

    async def _receive(self, op: GlobalOp, r: int, channel: int, step: Step,
                       read: Sequence[HostArray | None], write: list[HostArray | None],
                       learned: list[Any], check: Any, pipe: _Pipeline | None, slot: int,
                       ) -> None:
        """Receive chunk ``step.chunk`` part by part into ``write``; a REDUCE combines each
        part with the same bytes of ``read`` (``write`` itself when in place)."""
        key = (op.seq, channel, r, step.src, step.chunk)
        got = 0
        total = -1
        target = write[step.chunk]
        source = read[step.chunk]
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
            error = check(h)
            if error is not None:
                self.service.fail(error)
                raise error
            if total < 0:
                total = h.chunk_bytes
                learned[0], learned[1] = h.dtype, h.shape
                target = self._prepare_target(op, step, write, h, total)
                source = read[step.chunk]  # allocated just now when in place
                dtype = dtype_from_name(h.dtype or "uint8")
                if pipe is not None:
                    pipe.wake(step.chunk)
            payload = frame.payload
            size = len(payload)
            if h.offset % dtype.itemsize or size % dtype.itemsize:
                raise self.fail_protocol(op, h, "a part not aligned to its dtype")
            incoming = np.frombuffer(payload, dtype=dtype)
            start = h.offset // dtype.itemsize
            if target is None or source is None:  # pragma: no cover - prepared above
                raise RuntimeError("no target")
            region = target[start:start + incoming.size]
            if region.size != incoming.size:
                raise self.fail_protocol(op, h, "a part beyond the end of its chunk")
            if pipe is not None:
                await pipe.ready(step.chunk, slot, h.offset + size)
            if ufunc is not None:
                ufunc(source[start:start + incoming.size], incoming, out=region)
            elif not (frame.placed and h.offset == got):
                region[...] = incoming  # (a placed part is there already)
            got += size
            if pipe is not None:
                pipe.advance(step.chunk, slot, h.offset + size)
            if total == 0:
                break
        if pipe is not None:
            pipe.finish(step.chunk, slot)

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

    def _prepare_target(self, op: GlobalOp, step: Step, chunks: list[HostArray | None],
                        h: DataHeader, total: int) -> HostArray:
        target = chunks[step.chunk]
        if target is None:
            dtype = dtype_from_name(h.dtype or "uint8")
            target = np.empty(total // dtype.itemsize, dtype=dtype)
            chunks[step.chunk] = target
        elif target.nbytes != total:
            error = MismatchError(
                f"{op.label}: {self.service.nodes[h.src].describe()} sent chunk {step.chunk} "
                f"of {total} bytes where {target.nbytes} were expected (different shapes)"
            )
            self.service.fail(error)
            raise error
        return target

    def fail_protocol(self, op: GlobalOp, h: DataHeader, what: str) -> CollectiveError:
        """Fail the session: node ``h.src`` sent ``what``."""
        from burncoll.errors import ProtocolError

        error = ProtocolError(
            f"{op.label}: {self.service.nodes[h.src].describe()} sent {what}"
        )
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
