"""The global walk without I/O: one node's side of a schedule, as requests to send and receive.

The strategies make schedules without I/O; this module walks one without it too, so that every
rule of the walk -- which steps this node runs and in what order, how a chunk is cut into parts,
how the parts of one chunk are ordered between the steps that touch it, where a received part
goes, what each part must be, how it is reduced -- can be tested without a socket or an event
loop (``tests/node/test_walk.py`` runs every node of a world in memory). The asyncio executor
(:mod:`burncoll.node.executor`) only pumps it: it performs the requests and feeds the frames
back.

Each step of this node becomes a *transfer*: a generator that yields requests --
:class:`SendPart` (one DATA frame to a node), :class:`ReceivePart` (the next frame of a key,
answered with that frame; it may offer the memory the part goes to, so the transport receives
it there) and :class:`AwaitChunk` (nothing to do until another transfer progresses on that
chunk) -- and returns when its step is done. It reduces or copies each received part itself
(compute, not I/O), and raises the :class:`~burncoll.CollectiveError` of a frame that breaks
the rules (a :class:`~burncoll.MismatchError` or a :class:`~burncoll.ProtocolError` naming the
sender): the session must then fail on every node.

When every chunk this node holds fits in one part, the transfers run one after the other, in
walk order (round by round, a round's sends before its receives: a send reads the chunk as the
round found it). Otherwise they all run at once, ordered part by part (:class:`Pipeline`): a
chunk received in one round is forwarded part by part as its parts are reduced, instead of
after the whole round. Every received part is held to the schedule before a byte of it is used
(see :mod:`burncoll.node.mailbox`): at the byte where the previous one ended, ``part_bytes``
long (the last one the rest), so every byte of a receive buffer is written exactly once before
it is read. No clock is read here: deadlines belong to whoever waits.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass

import numpy as np

from burncoll.compression import WIRE_ITEMSIZE, encode, quantize, wire_values
from burncoll.dtypes import dtype_from_name
from burncoll.errors import CollectiveError, ProtocolError
from burncoll.levels import GlobalOp, HostArray
from burncoll.node.mailbox import PART_BYTES, FrameKey, Receives
from burncoll.node.pipeline import Pipeline
from burncoll.node.places import Place, ReducePlace
from burncoll.node.step_buffers import copy_unwritten, step_buffers, wire_settled
from burncoll.ops import ROW_KINDS, ReduceOp
from burncoll.protocol.checks import Check, expected_bytes, part_of, protocol_error
from burncoll.protocol.wire import DataHeader, Frame
from burncoll.reduction import reduce_into
from burncoll.strategies import Action, Schedule, Step

__all__ = [
    "PLACE_MIN_BYTES",
    "AwaitChunk",
    "ReceivePart",
    "Request",
    "SendPart",
    "Transfer",
    "Walk",
    "receives",
]

#: Parts received straight into their place must be larger than this (smaller ones are
#: parsed out of the transport's scratch buffer and copied).
PLACE_MIN_BYTES = 64 << 10


@dataclass(frozen=True, slots=True)
class SendPart:
    """Send ``payload`` to node ``dst``: one DATA frame headed by ``header``."""

    dst: int
    header: DataHeader
    payload: memoryview


@dataclass(frozen=True, slots=True)
class ReceivePart:
    """Answer with the next frame of ``key``, the part at byte ``offset`` of its chunk.
    ``place``: where that part goes, when it may be received straight there (offer it to the
    mailbox while waiting, withdraw it after: the part may have come before)."""

    key: FrameKey
    offset: int
    place: Place | None


@dataclass(frozen=True, slots=True)
class AwaitChunk:
    """Nothing to do until another transfer of this walk progresses on chunk ``chunk``."""

    chunk: int


Request = SendPart | ReceivePart | AwaitChunk
#: One step of this node: yields requests, is answered with the frame a ReceivePart asked
#: for (``None`` otherwise), returns when the step is done.
Transfer = Generator[Request, Frame | None, None]


def _unwatched(chunk: int) -> None:
    """No one waits for progress: the transfers run one after the other."""


def receives(op: GlobalOp, schedule: Schedule, me: int, chunks: Sequence[HostArray | None],
             channel: int = 0, part_bytes: int = PART_BYTES) -> Receives:
    """What node ``me`` receives when it walks ``schedule`` over ``chunks``: for
    :meth:`Mailbox.expect <burncoll.node.mailbox.Mailbox.expect>` when the operation starts.
    A chunk not held yet (``None``) is sized from its first header (:func:`expected_bytes`)."""
    totals: dict[FrameKey, int | None] = {}
    wire = op.compression is not None  # 16-bit values on the wire
    for r, round_ in enumerate(schedule.rounds):
        for s in round_:
            if s.dst == me and s.src != me:
                chunk = chunks[s.chunk]
                totals[(op.seq, channel, r, s.src, s.chunk)] = (
                    None if chunk is None else
                    chunk.size * WIRE_ITEMSIZE if wire else chunk.nbytes)
    num_chunks = schedule.num_chunks
    return Receives(op.seq, channel, totals, lambda h: expected_bytes(op, num_chunks, h),
                    part_bytes)


class Walk:
    """Node ``me``'s side of ``schedule`` over ``chunks`` (flat host arrays; ``None`` = not
    held yet: a COPY into it allocates it from the incoming size -- all-gather, broadcast
    receivers).

    ``out`` (one array per chunk, sized as ``chunks``) makes the walk out of place: ``chunks``
    are only read and the result is written to ``out`` (see
    :func:`~burncoll.node.step_buffers.step_buffers`); a chunk no step of this node writes is
    copied over by :meth:`finish`. ``dtype`` and ``shape`` are what the frames carry until a
    received frame says otherwise (a broadcast receiver learns the root's). ``check`` compares
    every received header with this node's call;
    ``describe`` names a node in errors.
    """

    def __init__(self, op: GlobalOp, schedule: Schedule, me: int,
                 chunks: list[HostArray | None], *, check: Check,
                 describe: Callable[[int], str], out: list[HostArray | None] | None = None,
                 channel: int = 0, session: int = 0, dtype: str | None = None,
                 shape: tuple[int, ...] | None = None, part_bytes: int = PART_BYTES,
                 place_min_bytes: int = PLACE_MIN_BYTES) -> None:
        self.op, self.me, self.channel, self.session = op, me, channel, session
        self.num_chunks = schedule.num_chunks
        self.chunks, self.out = chunks, out
        self.check, self.describe = check, describe
        self.part_bytes, self.place_min_bytes = part_bytes, place_min_bytes
        #: The array the frames carry (learned from the first received frame, but for an
        #: all-gather, whose headers carry each chunk's own).
        self.dtype = dtype if dtype is not None else op.dtype
        self.shape = shape if shape is not None else op.shape
        # Per round, sends before receives: a send reads the chunk as the round found it.
        self.steps = sorted(((r, s) for r, round_ in enumerate(schedule.rounds) for s in round_
                             if me in (s.src, s.dst)), key=lambda rs: (rs[0], rs[1].src != me))
        self.pipelined = any(c is not None and c.nbytes > part_bytes for c in chunks)
        #: A compressed all-reduce's wire format: parts, offsets and sizes then count its
        #: 16-bit values, and received values are widened before they are combined.
        self.wire = op.compression
        #: (compressed) The sends that keep the values they send, and the chunks that end
        #: holding 16-bit values without a pass over them (``wire_settled``).
        self._write_back, self._settled = (
            wire_settled(self.steps, me, out is not None) if self.wire else (set(), set()))

    def transfers(self, changed: Callable[[int], None] = _unwatched) -> list[Transfer]:
        """This node's steps as transfers, in walk order. Run them one after the other, or,
        when :attr:`pipelined`, all at once: ``changed(chunk)`` is then called whenever a
        transfer progresses on ``chunk`` (wake those that await it)."""
        pipe = Pipeline(changed) if self.pipelined else None
        transfers: list[Transfer] = []
        buffers = step_buffers(self.steps, self.me, self.chunks, self.out)
        for i, ((r, s), (read, write)) in enumerate(zip(self.steps, buffers, strict=True)):
            sends, keeps = s.src == self.me, i in self._write_back
            slot = pipe.add(s.chunk, writes=keeps or not sends) if pipe is not None else 0
            transfers.append(self._send(r, s, read, pipe, slot, keeps) if sends
                             else self._receive(r, s, read, write, pipe, slot))
        return transfers

    def finish(self) -> tuple[str | None, tuple[int, ...]]:
        """Once every transfer is done: the dtype and shape the frames carried (the root's,
        for a broadcast receiver); out of place, the chunks no step wrote are copied over.
        Compressed, every chunk ends holding 16-bit values (``wire_settled``)."""
        if self.out is not None:
            copy_unwritten(self.steps, self.me, self.chunks, self.out)
        if self.wire is not None:
            final = self.out if self.out is not None else self.chunks
            for c, chunk in enumerate(final):
                if chunk is not None and c not in self._settled:
                    quantize(chunk, self.wire)
        return self.dtype, tuple(self.shape)

    def _send(self, r: int, step: Step, chunks: Sequence[HostArray | None],
              pipe: Pipeline | None, slot: int, keeps: bool = False) -> Transfer:
        """Send chunk ``step.chunk`` of ``chunks`` (the buffer this step reads), part by part;
        ``keeps``: a compressed send writes the 16-bit values it sends back into the chunk.

        An all-gather's header carries the chunk's own shape (its rows, then the call's
        trailing shape): the receiver allocates the chunk from it."""
        op, c = self.op, step.chunk
        if pipe is not None:
            while chunks[c] is None:  # allocated by an earlier receive into it
                yield AwaitChunk(c)
        data = chunks[c]
        if data is None:
            raise RuntimeError(f"chunk {c} sent before it was received")
        flat = np.ascontiguousarray(data).reshape(-1)
        raw = memoryview(flat.view(np.uint8))  # type: ignore[arg-type]
        total = raw.nbytes if self.wire is None else flat.size * WIRE_ITEMSIZE
        shape = tuple(self.shape)
        if op.kind in ROW_KINDS:  # the rows the array has (it may hold no elements)
            row = math.prod(shape)
            rows = data.shape[0] if data.ndim == len(shape) + 1 else (
                data.size // row if row else 0)
            shape = (rows, *shape)
        start = 0
        while True:
            end = min(start + self.part_bytes, total)
            if pipe is not None:
                while not pipe.ready(c, slot, end):
                    yield AwaitChunk(c)
            if self.wire is None:
                payload = raw[start:end]
            else:
                values = flat[start // WIRE_ITEMSIZE:end // WIRE_ITEMSIZE]
                narrow = encode(values, self.wire)
                if keeps:  # (a view of the chunk: chunks are contiguous)
                    np.copyto(values, wire_values(narrow, self.wire))
                payload = memoryview(narrow.view(np.uint8))  # type: ignore[arg-type]
            yield SendPart(step.dst, DataHeader(
                session=self.session, seq=op.seq, op_kind=op.kind, reduce_op=op.reduce_op,
                dtype=self.dtype, shape=shape, root=op.root, src=self.me, round=r,
                channel=self.channel, chunk=c, offset=start, chunk_bytes=total,
            ), payload)
            if pipe is not None:
                pipe.advance(c, slot, end)
            start = end
            if start >= total:
                break
        if pipe is not None:
            pipe.finish(c, slot)

    def _receive(self, r: int, step: Step, read: Sequence[HostArray | None],
                 write: list[HostArray | None], pipe: Pipeline | None, slot: int) -> Transfer:
        """Receive chunk ``step.chunk`` part by part into ``write``; a REDUCE combines each
        part with the same bytes of ``read`` (``write`` itself when in place).

        Each part must be the next one of the chunk's schedule -- at the byte where the
        previous one ended, ``part_bytes`` long or the rest -- so that every byte is written
        once before the pipeline lets a later step read it."""
        c = step.chunk
        key = (self.op.seq, self.channel, r, step.src, c)
        reduce_op = self.op.reduce_op if step.action is Action.REDUCE else None
        got, total = 0, -1
        target, source = write[c], read[c]
        while got < total or total < 0:
            place: Place | None = None
            if target is not None and self.wire is None:
                room = yield from self._room(c, target, got, pipe, slot)
                if reduce_op is None or room is None:
                    place = room
                elif source is not None:  # a REDUCE is offered a reduction, never raw memory
                    a, b = got // target.itemsize, (got + len(room)) // target.itemsize
                    place = ReducePlace(reduce_op, source[a:b], target[a:b], len(room))
            frame = yield ReceivePart(key, got, place)
            assert frame is not None  # a ReceivePart is answered with its frame
            h = frame.header
            if h is None:  # pragma: no cover - the mailbox holds DATA frames only
                continue
            error = self.check(h)
            if error is not None:
                raise error
            if total < 0:
                total = h.chunk_bytes
                if self.op.kind not in ROW_KINDS:  # (an all-gather's is the chunk's own)
                    self.dtype, self.shape = h.dtype, h.shape
                target = self._target(c, write, h)
                source = read[c]  # allocated just now when in place
                if pipe is not None:
                    pipe.touched(c)
            if target is None or source is None:  # pragma: no cover - prepared above
                raise RuntimeError("no target")
            size = len(frame.payload)
            itemsize = target.dtype.itemsize if self.wire is None else WIRE_ITEMSIZE
            self._check_part(h, got, size, total, itemsize)
            start, stop = got // itemsize, (got + size) // itemsize
            if pipe is not None:
                while not pipe.ready(c, slot, got + size):
                    yield AwaitChunk(c)
            self._apply(frame, reduce_op, source[start:stop], target[start:stop])
            got += size
            if pipe is not None:
                pipe.advance(c, slot, got)
            if total == 0:
                break
        if (self.op.kind in ROW_KINDS and target is not None and target.ndim == 1
                and h is not None and math.prod(h.shape) == target.size):
            write[c] = target.reshape(h.shape)  # the rows its header gave (a view, no copy)
        if pipe is not None:
            pipe.finish(c, slot)

    def _apply(self, frame: Frame, reduce_op: ReduceOp | None, source: HostArray,
               target: HostArray) -> None:
        """Put one received part where it goes: combined with ``source`` into ``target`` (a
        REDUCE), or copied there (a part received in place is there already); a compressed
        all-reduce's 16-bit values are widened as they are combined (no decoded copy)."""
        if frame.placed:  # combined or copied as it came (never a compressed part)
            return
        part = (np.frombuffer(frame.payload, target.dtype) if self.wire is None
                else wire_values(np.frombuffer(frame.payload, np.uint16), self.wire))
        if reduce_op is not None:
            reduce_into(reduce_op, (source, part), target)
        else:
            np.copyto(target, part)

    def _room(self, c: int, target: HostArray, got: int, pipe: Pipeline | None,
              slot: int) -> Generator[Request, Frame | None, memoryview | None]:
        """Where the next part may be received straight into ``target`` (no copy out of a
        receive buffer; a REDUCE makes it a :class:`ReducePlace`, for a part its transport
        lends), once every earlier step on those bytes is done with them; ``None`` for a part
        too small to be worth it (or no part left)."""
        end = min(got + self.part_bytes, target.nbytes)
        if end - got <= self.place_min_bytes:
            return None  # small parts are read into the transport's scratch buffer anyway
        if pipe is not None:
            while not pipe.ready(c, slot, end):
                yield AwaitChunk(c)
        raw = memoryview(target.view(np.uint8)).cast("B")  # type: ignore[arg-type]
        return raw[got:end]

    def _check_part(self, h: DataHeader, got: int, size: int, total: int,
                    itemsize: int) -> None:
        """The part ``h`` of ``size`` bytes must be the next one of its chunk's schedule."""
        want = min(self.part_bytes, total - got)
        if h.offset != got or size != want or h.chunk_bytes != total:
            raise self._protocol(
                h, f"{part_of(h)} of {size} bytes (of a chunk of {h.chunk_bytes}) where the "
                f"schedule has byte {got}, {want} bytes (of {total}): parts overlap, come out "
                "of order or are cut otherwise")
        if size % itemsize:
            raise self._protocol(h, "a part not aligned to its dtype")

    def _target(self, c: int, chunks: list[HostArray | None], h: DataHeader) -> HostArray:
        """The buffer chunk ``c`` is received into, once ``h`` (its first part) says its size:
        the chunk's own buffer, which must be that size, or one allocated for it when the size
        is the one ``h``'s dtype and shape give (:func:`expected_bytes`)."""
        target = chunks[c]
        try:
            expected = (target.size * WIRE_ITEMSIZE if target is not None and self.wire
                        else target.nbytes if target is not None
                        else expected_bytes(self.op, self.num_chunks, h))
        except ProtocolError as exc:
            raise self._protocol(h, str(exc).removeprefix("sent ")) from None
        if h.chunk_bytes != expected:
            raise self._protocol(h, f"{part_of(h)} announcing a chunk of {h.chunk_bytes} bytes "
                                 f"where this node expects {expected}")
        if target is None:
            dtype = dtype_from_name(h.dtype or "uint8")
            try:
                target = np.empty(expected // dtype.itemsize, dtype=dtype)
            except (MemoryError, ValueError) as exc:
                raise self._protocol(
                    h, f"a chunk of {expected} bytes ({h.dtype}{list(h.shape)}) that this "
                    f"node cannot allocate ({type(exc).__name__}: {exc})") from None
            chunks[c] = target
        return target

    def _protocol(self, h: DataHeader, what: str) -> CollectiveError:
        return protocol_error(self.op, self.describe, h, what)

