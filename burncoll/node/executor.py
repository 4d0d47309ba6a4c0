"""The global executor: pumps one node's walk of a schedule over its connections.

Participants are node indices. What to send, what to receive, in which order, and what each
received part must be is decided without I/O by :class:`~burncoll.node.walk.Walk`; this module
only performs its requests on the node's event loop -- a :class:`SendPart` is sent, a
:class:`ReceivePart` is awaited in the mailbox (with the memory it may be received into
offered meanwhile) and its frame fed back, an :class:`AwaitChunk` waits until another transfer
of the walk progresses on that chunk -- and fails the session, on every node, with the error a
walk raises for a frame that breaks the rules.

A walk whose chunks all fit in one part runs its transfers one after the other (no task is
created); otherwise every transfer runs at once, as its own task, so sends and receives
overlap and each received part is reduced (or copied) while the next one travels. Rounds are
not synchronised between nodes: frames are matched by ``(seq, channel, round, src, chunk)``.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence

from burncoll.errors import CollectiveError, CollectiveTimeout
from burncoll.levels import GlobalOp, HostArray
from burncoll.node.mailbox import PART_BYTES, Receives
from burncoll.node.ports import Ports
from burncoll.node.walk import PLACE_MIN_BYTES, ReceivePart, SendPart, Transfer, Walk, receives
from burncoll.protocol.checks import Check, header_check, timed_out
from burncoll.protocol.wire import Frame, encode_data_header
from burncoll.strategies import Schedule

__all__ = ["PART_BYTES", "GlobalExecutor"]

#: Waiters of a pipelined walk, by the chunk whose progress they await.
_Waiting = dict[int, list[asyncio.Future[None]]]


class GlobalExecutor:
    """Runs one node's side of global schedules (on the node's event loop)."""

    def __init__(self, service: Ports) -> None:
        self.service = service

    @property
    def me(self) -> int:
        return self.service.node_index

    def describe(self, node: int) -> str:
        nodes = self.service.nodes
        return nodes[node].describe() if 0 <= node < len(nodes) else f"node {node}"

    def checker(self, op: GlobalOp) -> Check:
        """``check(header)``: the error of a frame that is not of this node's call ``op``
        (see :func:`~burncoll.protocol.checks.header_check`), or ``None``."""
        return header_check(op, self.me, self.describe)

    def receives(self, op: GlobalOp, schedule: Schedule, chunks: Sequence[HostArray | None],
                 channel: int = 0) -> Receives:
        """What this node receives when it walks ``schedule`` over ``chunks`` (as :meth:`run`
        is given them): for :meth:`Mailbox.expect <burncoll.node.mailbox.Mailbox.expect>`
        when the operation starts."""
        return receives(op, schedule, self.me, chunks, channel, PART_BYTES)

    async def run(
        self, op: GlobalOp, schedule: Schedule, chunks: list[HostArray | None],
        channel: int = 0, dtype: str | None = None, shape: tuple[int, ...] | None = None,
        out: list[HostArray | None] | None = None,
    ) -> tuple[str | None, tuple[int, ...]]:
        """Walk ``schedule`` over ``chunks`` (flat host arrays; ``None`` = not held yet), in
        place or into ``out`` (see :class:`~burncoll.node.walk.Walk`). Returns the dtype and
        shape carried by the frames (the root's, for a broadcast receiver)."""
        walk = Walk(op, schedule, self.me, chunks, check=self.checker(op),
                    describe=self.describe, out=out, channel=channel,
                    session=self.service.session or 0, dtype=dtype, shape=shape,
                    part_bytes=PART_BYTES, place_min_bytes=PLACE_MIN_BYTES)
        if walk.steps and walk.pipelined:
            await self._pipelined(walk)
        elif walk.steps:
            waiting: _Waiting = {}
            for transfer in walk.transfers():
                await self._pump(op, transfer, waiting)
        return walk.finish()

    async def _pipelined(self, walk: Walk) -> None:
        """Every transfer of ``walk`` at once, each as a task; the first failure ends them all."""
        waiting: _Waiting = {}

        def changed(chunk: int) -> None:
            for waiter in waiting.pop(chunk, ()):
                if not waiter.done():
                    waiter.set_result(None)

        tasks = [asyncio.ensure_future(self._pump(walk.op, transfer, waiting))
                 for transfer in walk.transfers(changed)]
        try:
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
            for task in done:
                if not task.cancelled() and task.exception() is not None:
                    raise task.exception()  # type: ignore[misc]
        finally:
            for task in tasks:
                if not task.done():
                    task.cancel()

    async def _pump(self, op: GlobalOp, transfer: Transfer, waiting: _Waiting) -> None:
        """Perform the requests of ``transfer`` until it is done."""
        service = self.service
        reply: Frame | None = None
        while True:
            try:
                request = transfer.send(reply)
            except StopIteration:
                return
            except CollectiveError as error:  # a frame broke the rules: every node fails
                service.fail(error)
                raise
            reply = None
            if isinstance(request, SendPart):
                payload = request.payload
                await service.send(request.dst, [
                    encode_data_header(request.header, payload.nbytes), payload])
            elif isinstance(request, ReceivePart):
                reply = await self._receive(op, request)
            else:
                waiter = asyncio.get_running_loop().create_future()
                waiting.setdefault(request.chunk, []).append(waiter)
                await waiter

    async def _receive(self, op: GlobalOp, request: ReceivePart) -> Frame:
        """The frame ``request`` asks for, received straight into its place if it offers one
        and the part has not come yet."""
        mailbox, key, place = self.service.mailbox, request.key, request.place
        if place is not None:
            mailbox.offer_place(key, request.offset, place)
        try:
            return await mailbox.get(key, op.deadline,
                                     lambda: self.timeout_error(op, key[3], key[2]))
        finally:  # unused if the part came before it was offered, or never came
            if place is not None:
                mailbox.withdraw_place(key, request.offset)

    def timeout_error(self, op: GlobalOp, src: int, r: int) -> CollectiveTimeout:
        """The error for a frame from node ``src`` that did not come in time."""
        return timed_out(op, self.describe, self.me, src, r, self.service.timeout,
                         time.monotonic())
