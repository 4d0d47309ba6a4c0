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

from burncoll.backends.dtypes import dtype_from_name, dtype_name
from burncoll.errors import CollectiveError, CollectiveTimeout, MismatchError
from burncoll.local.link import GlobalOp, HostArray
from burncoll.node.data_service import DataService
from burncoll.ops import OpKind, ReduceOp
from burncoll.strategies import Action, Schedule, Step
from burncoll.transport.wire import DataHeader, encode_data_header

__all__ = ["PART_BYTES", "GlobalExecutor"]

#: Largest payload of one frame; bigger chunks travel in several parts.
PART_BYTES = 4 << 20

_UFUNCS: dict[ReduceOp, Any] = {
    ReduceOp.SUM: np.add,
    ReduceOp.MEAN: np.add,
    ReduceOp.MAX: np.maximum,
    ReduceOp.MIN: np.minimum,
    ReduceOp.PROD: np.multiply,
}


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
    ) -> tuple[str | None, tuple[int, ...]]:
        """Walk ``schedule`` over ``chunks`` (flat host arrays; ``None`` = not held yet).

        COPY into a ``None`` chunk allocates it from the incoming size (all_gather,
        broadcast receivers). Returns the dtype and shape carried by the frames (the
        root's, for a broadcast receiver).
        """
        learned: list[Any] = [dtype if dtype is not None else op.dtype,
                              shape if shape is not None else op.shape]
        for r, round_ in enumerate(schedule.rounds):
            sends = [s for s in round_ if s.src == self.me]
            recvs = [s for s in round_ if s.dst == self.me]
            if not sends and not recvs:
                continue
            tasks = [self._send(op, r, channel, s, chunks, learned) for s in sends]
            tasks.append(self._receive_all(op, r, channel, recvs, chunks, learned))
            await asyncio.gather(*tasks)
        return learned[0], tuple(learned[1])

    async def _send(self, op: GlobalOp, r: int, channel: int, step: Step,
                    chunks: list[HostArray | None], learned: list[Any]) -> None:
        data = chunks[step.chunk]
        if data is None:
            raise RuntimeError(f"chunk {step.chunk} sent before it was received")
        raw = memoryview(np.ascontiguousarray(data).view(np.uint8))  # type: ignore[arg-type]
        total = raw.nbytes
        parts = max(1, math.ceil(total / PART_BYTES))
        for p in range(parts):
            start = p * PART_BYTES
            payload = raw[start:min(start + PART_BYTES, total)]
            header = DataHeader(
                session=self.service.session or 0, seq=op.seq, op_kind=op.kind,
                reduce_op=op.reduce_op, dtype=learned[0], shape=tuple(learned[1]),
                root=op.root, src=self.me, round=r, channel=channel, chunk=step.chunk,
                offset=start, chunk_bytes=total,
            )
            await self.service.send(step.dst, [encode_data_header(header, payload.nbytes),
                                               payload])

    async def _receive_all(self, op: GlobalOp, r: int, channel: int, steps: Sequence[Step],
                           chunks: list[HostArray | None], learned: list[Any]) -> None:
        for step in steps:
            await self._receive(op, r, channel, step, chunks, learned)

    async def _receive(self, op: GlobalOp, r: int, channel: int, step: Step,
                       chunks: list[HostArray | None], learned: list[Any]) -> None:
        key = (op.seq, channel, r, step.src, step.chunk)
        got = 0
        total = -1
        target = chunks[step.chunk]
        while got < total or total < 0:
            frame = await self.service.mailbox.get(
                key, op.deadline, lambda: self.timeout_error(op, step.src, r))
            h = frame.header
            if h is None:  # pragma: no cover - the mailbox holds DATA frames only
                continue
            error = self.checker(op)(h)
            if error is not None:
                self.service.fail(error)
                raise error
            if total < 0:
                total = h.chunk_bytes
                learned[0], learned[1] = h.dtype, h.shape
                target = self._prepare_target(op, step, chunks, h, total)
            dtype = dtype_from_name(h.dtype or "uint8")
            if h.offset % dtype.itemsize or len(frame.payload) % dtype.itemsize:
                raise self._fail_protocol(op, h, "a part not aligned to its dtype")
            incoming = np.frombuffer(frame.payload, dtype=dtype)
            start = h.offset // dtype.itemsize
            if target is None:  # pragma: no cover - prepared above
                raise RuntimeError("no target")
            region = target[start:start + incoming.size]
            if region.size != incoming.size:
                raise self._fail_protocol(op, h, "a part beyond the end of its chunk")
            if step.action is Action.REDUCE and op.reduce_op is not None:
                _UFUNCS[op.reduce_op](region, incoming, out=region)
            else:
                region[...] = incoming
            got += len(frame.payload)
            if total == 0:
                break

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

    def _fail_protocol(self, op: GlobalOp, h: DataHeader, what: str) -> CollectiveError:
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
            f"{op.deadline - op.started:.3g} s) on {self.service.nodes[self.me].describe()}, "
            f"waiting for {node.describe()} in round {r + 1}"
        )


def host_dtype_name(x: HostArray) -> str:
    return dtype_name(x.dtype)
