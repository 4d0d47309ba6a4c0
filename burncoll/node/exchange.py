"""The one-round all-reduce for small arrays, on the event loop over the member connections.

A Ring all-reduce of ``n`` nodes takes ``2(n-1)`` rounds, a Tree(2) one ``2 log2 n``; for an
array of a few kilobytes each round costs a network latency and moves almost nothing. In the
exchange every node sends its buffer to every other node at once (one round, ``n-1`` messages
of the whole array each) and reduces the ``n`` buffers itself in node order: the protocol is
:class:`~burncoll.protocol.exchange.ExchangeCore`'s, without I/O. ``auto`` uses it up to
:data:`~burncoll.strategies.auto.EXCHANGE_BYTES` per node.

This module is the core's driver on the event loop (sessions without caller sockets: QUIC,
TLS, integrity tags, ``caller_sockets: false``; and channels >= 1): the messages are
ordinary DATA frames (round 0, chunk 0, one part) sent with ``DataService.send``, so the
mailbox matches them and compares every header with this node's call as for a schedule
(:func:`exchange_receives` is what it registers), and the core checks each again before its
payload is reduced. The caller sockets and the shared mail drive the same core from the
calling thread (:mod:`burncoll.node.lane_exchange`).
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

import numpy as np

from burncoll.errors import UsageError
from burncoll.levels import GlobalOp, HostArray
from burncoll.node.receives import FrameKey, Receives
from burncoll.protocol.exchange import ExchangeCore

if TYPE_CHECKING:
    from burncoll.node.executor import GlobalExecutor
    from burncoll.node.ports import Ports

__all__ = [
    "ExchangeCores",
    "exchange_all_reduce",
    "exchange_receives",
    "require_separate_out",
]

#: Cores kept per node (past that, the cache starts over).
_CORES_KEPT = 64


class ExchangeCores:
    """This node's :class:`ExchangeCore` of each operation signature, built once."""

    def __init__(self, executor: GlobalExecutor) -> None:
        self._executor = executor
        self._cores: dict[tuple[object, ...], ExchangeCore] = {}

    def of(self, op: GlobalOp, nbytes: int, channel: int = 0) -> ExchangeCore:
        """The core of ``op`` with ``nbytes`` per node on ``channel`` (in the link's one
        session, known by the time the first operation runs)."""
        key = ExchangeCore.signature(op, nbytes, channel)
        core = self._cores.get(key)
        if core is None:
            if len(self._cores) >= _CORES_KEPT:
                self._cores.clear()
            executor = self._executor
            core = self._cores[key] = ExchangeCore(
                op, nbytes, me=executor.me, nodes=len(executor.service.nodes),
                session=executor.service.session or 0, describe=executor.describe,
                channel=channel)
        return core


def exchange_receives(service: Ports, op: GlobalOp, buf: HostArray,
                      channel: int) -> Receives:
    """What this node receives in the exchange (for ``Mailbox.expect``): from every other
    node, one part of exactly ``buf``'s size."""
    keys = [(op.seq, channel, 0, n.index, 0)
            for n in service.nodes if n.index != service.node_index]
    totals = dict[FrameKey, int | None].fromkeys(keys, buf.nbytes)
    return Receives(op.seq, channel, totals, part_bytes=max(buf.nbytes, 1))


async def exchange_all_reduce(executor: GlobalExecutor, core: ExchangeCore, op: GlobalOp,
                              buf: HostArray, out: HostArray) -> None:
    """All-reduce ``buf`` (only read) into ``out`` among every node in one round, on
    ``core``'s channel (its lane started in the mailbox: :func:`exchange_receives`)."""
    service = executor.service
    message = core.message(op.seq, buf)
    sends = [asyncio.ensure_future(service.send(dst, message)) for dst in core.others]
    try:
        received = await _receive_all(executor, core, op)
        await asyncio.gather(*sends)
    finally:
        for task in sends:
            if not task.done():
                task.cancel()
            elif not task.cancelled():
                task.exception()  # retrieved: the session's failure is what is raised
    core.reduce(op, buf, received, out)


async def _receive_all(executor: GlobalExecutor, core: ExchangeCore, op: GlobalOp
                       ) -> dict[int, HostArray]:
    service = executor.service
    check = executor.checker(op)
    received: dict[int, HostArray] = {}
    for src in core.others:
        frame = await service.mailbox.get(
            (op.seq, core.channel, 0, src, 0), op.deadline,
            lambda src=src: executor.timeout_error(op, src, 0))  # type: ignore[misc]
        h = frame.header
        assert h is not None  # the mailbox holds DATA frames only
        error = core.check_header(op, check, src, h, len(frame.payload),
                                  where="on its member connection")
        if error is not None:
            service.fail(error)
            raise error
        received[src] = np.frombuffer(frame.payload, dtype=core.dtype)
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
