"""The one-round all-reduce for small arrays: every node sends its whole buffer to every other.

A Ring all-reduce of ``n`` nodes takes ``2(n-1)`` rounds, a Tree(2) one ``2 log2 n``; for an
array of a few kilobytes each round costs a network latency and moves almost nothing. Here
every node sends its buffer to every other node at once (one round, ``n-1`` messages of the
whole array each) and reduces the ``n`` buffers itself, always in node order
(``x0 op x1 op ... op x(n-1)``), so every node computes the bitwise-identical result that a
schedule's "reduce once, then copy" guarantees. ``auto`` uses it up to
:data:`~burncoll.strategies.auto.EXCHANGE_BYTES` per node.

Frames are ordinary DATA frames (round 0, chunk 0, one part), so the mailbox matches them and
compares every header with this node's call exactly as for a schedule. The calling peer thread
may send its frames itself (:func:`exchange_parts`, ``DataService.send_now``) before it hands
the rest to the event loop: small messages then leave without waking the loop first.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import TYPE_CHECKING

import numpy as np

from burncoll.dtypes import dtype_from_name
from burncoll.errors import UsageError
from burncoll.levels import GlobalOp, HostArray
from burncoll.node.receives import FrameKey, Receives
from burncoll.ops import ReduceOp
from burncoll.protocol.checks import Check
from burncoll.protocol.wire import DataHeader, Frame, encode_data_header
from burncoll.reduction import reduce_into

if TYPE_CHECKING:
    from burncoll.node.executor import GlobalExecutor
    from burncoll.node.ports import Ports

__all__ = [
    "exchange_all_reduce",
    "exchange_keys",
    "exchange_parts",
    "exchange_receives",
    "payload_bytes",
    "reduce_in_node_order",
    "require_separate_out",
    "watched_arrays",
]

def exchange_parts(service: Ports, op: GlobalOp, buf: HostArray,
                   channel: int) -> list[bytes | memoryview]:
    """The message this node sends every other node: a DATA header and ``buf``'s bytes."""
    raw = payload_bytes(buf)
    header = encode_data_header(DataHeader(
        session=service.session or 0, seq=op.seq, op_kind=op.kind, reduce_op=op.reduce_op,
        dtype=op.dtype, shape=op.shape, root=op.root, src=service.node_index, round=0,
        channel=channel, chunk=0, offset=0, chunk_bytes=raw.nbytes,
    ), raw.nbytes)
    return [header, raw]


def payload_bytes(buf: HostArray) -> memoryview:
    """``buf``'s bytes as a flat view (a copy only when ``buf`` is not contiguous)."""
    return memoryview(np.ascontiguousarray(buf).view(np.uint8))  # type: ignore[arg-type]


def exchange_receives(service: Ports, op: GlobalOp, buf: HostArray,
                      channel: int) -> Receives:
    """What this node receives in the exchange (for ``Mailbox.expect``): from every other
    node, one part of exactly ``buf``'s size."""
    totals = dict[FrameKey, int | None].fromkeys(exchange_keys(service, op, channel),
                                                 buf.nbytes)
    return Receives(op.seq, channel, totals, part_bytes=max(buf.nbytes, 1))


def exchange_keys(service: Ports, op: GlobalOp, channel: int) -> list[FrameKey]:
    """The key of the frame this node receives from every other node."""
    return [(op.seq, channel, 0, n.index, 0)
            for n in service.nodes if n.index != service.node_index]


def reduce_in_node_order(op: GlobalOp, me: int, nodes: int, buf: HostArray,
                         received: Mapping[int, HostArray], out: HostArray) -> None:
    """``out = x0 op x1 op ...`` over the ``nodes`` nodes in node order, ``buf`` being this
    node's ``x`` and ``received`` every other node's: every node computes the same bits."""
    operands = [buf if i == me else received[i] for i in range(nodes)]
    reduce_into(op.reduce_op or ReduceOp.SUM, operands, out)


def watched_arrays(op: GlobalOp, buf: HostArray, check: Check,
                   frames: Mapping[FrameKey, Frame]) -> dict[int, HostArray] | None:
    """The other nodes' arrays in ``frames`` (a :class:`~burncoll.node.watch.Watch`'s), or
    ``None`` when any frame is not exactly what this node's call expects (the event loop then
    reports it, as :func:`exchange_all_reduce` does)."""
    dtype = dtype_from_name(op.dtype or "uint8")
    received: dict[int, HostArray] = {}
    for key, frame in frames.items():
        h = frame.header
        if h is None or check(h) is not None or not _whole_buffer(h, frame, buf):
            return None
        received[key[3]] = np.frombuffer(frame.payload, dtype=dtype)
    return received


def _whole_buffer(h: DataHeader, frame: Frame, buf: HostArray) -> bool:
    """Whether ``frame`` carries exactly one buffer of ``buf``'s size, from its first byte."""
    return h.chunk_bytes == buf.nbytes and len(frame.payload) == buf.nbytes and not h.offset


async def exchange_all_reduce(executor: GlobalExecutor, op: GlobalOp, buf: HostArray,
                              out: HostArray, channel: int = 0,
                              sent_to: frozenset[int] = frozenset(),
                              parts: list[bytes | memoryview] | None = None,
                              taken: Mapping[FrameKey, Frame] | None = None) -> None:
    """All-reduce ``buf`` (only read) into ``out`` among every node in one round; the nodes
    in ``sent_to`` already have this node's message (``parts``, when the caller built it),
    and ``taken`` holds frames a watch already took from the mailbox."""
    service = executor.service
    me = executor.me
    others = [n.index for n in service.nodes if n.index != me]
    if parts is None:
        parts = exchange_parts(service, op, buf, channel)
    sends = [asyncio.ensure_future(service.send(dst, parts))
             for dst in others if dst not in sent_to]
    try:
        received = await _receive_all(executor, op, buf, channel, others, taken or {})
        await asyncio.gather(*sends)
    finally:
        for task in sends:
            if not task.done():
                task.cancel()
            elif not task.cancelled():
                task.exception()  # retrieved: the session's failure is what is raised
    reduce_in_node_order(op, me, len(service.nodes), buf, received, out)


async def _receive_all(executor: GlobalExecutor, op: GlobalOp, buf: HostArray, channel: int,
                       others: list[int], taken: Mapping[FrameKey, Frame]
                       ) -> dict[int, HostArray]:
    service = executor.service
    check = executor.checker(op)
    dtype = dtype_from_name(op.dtype or "uint8")
    received: dict[int, HostArray] = {}
    for src in others:
        key = (op.seq, channel, 0, src, 0)
        frame = taken.get(key)
        if frame is None:
            frame = await service.mailbox.get(
                key, op.deadline,
                lambda src=src: executor.timeout_error(op, src, 0))  # type: ignore[misc]
        h = frame.header
        assert h is not None  # the mailbox holds DATA frames only
        error = check(h)
        if error is not None:
            service.fail(error)
            raise error
        if not _whole_buffer(h, frame, buf):
            raise executor.fail_protocol(op, h, "a buffer of the wrong size")
        received[src] = np.frombuffer(frame.payload, dtype=dtype)
    return received


def require_separate_out(buf: HostArray, out: HostArray) -> None:
    """``out`` must be a separate flat array like ``buf``: the executor writes chunk views of
    it while still reading the same chunks of ``buf``."""
    if out.dtype != buf.dtype or out.shape != buf.shape or buf.ndim != 1:
        raise UsageError(f"all_reduce: out {out.dtype}{list(out.shape)} does not match the "
                         f"flat input {buf.dtype}{list(buf.shape)}")
    if not (out.flags.c_contiguous and out.flags.writeable):
        raise UsageError("all_reduce: out must be C-contiguous and writable")
    if np.may_share_memory(buf, out):
        raise UsageError("all_reduce: out must not overlap the input")
