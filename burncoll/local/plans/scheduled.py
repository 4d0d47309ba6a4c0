"""``LocalSchedule``: an operation on one node, walked through a local strategy's schedule.

Each peer owns a :class:`~burncoll.local.buffers.ChunkBuffer` over the schedule's chunks;
every round the peers apply the steps into their own buffer, then meet at a barrier.
"""

from __future__ import annotations

from dataclasses import dataclass

from burncoll.backends.base import Array
from burncoll.local.buffers import ChunkBuffer
from burncoll.local.plans import phases
from burncoll.local.plans.phases import (
    StepIndex,
    count,
    finish_reduce,
    first_call,
    flat_input,
    new_buffers,
    peer_call,
    walk,
)
from burncoll.local.rendezvous import OpState, Rendezvous
from burncoll.ops import OpKind
from burncoll.strategies import Strategy
from burncoll.strategies.layout import block_rows, even_layout, row_layout, sizes_layout

__all__ = ["LocalSchedule", "LocalScheduleRun"]


@dataclass(frozen=True, slots=True)
class LocalSchedule:
    """``kind`` on one node by ``strategy``; ``root``: the root's local index (broadcast,
    reduce), else ``None``."""

    kind: OpKind
    strategy: Strategy
    root: int | None = None

    def prepare(self, rv: Rendezvous, state: OpState) -> LocalScheduleRun:
        if self.kind is OpKind.BROADCAST:
            return self._broadcast(rv, state)
        if self.kind is OpKind.ALL_GATHER:
            return self._all_gather(rv, state)
        call = first_call(state)
        dtype, shape, d = call.dtype or "float32", call.shape or (), rv.size
        if self.kind is OpKind.REDUCE_SCATTER:
            steps = phases.reduce_scatter_steps(self.strategy, d)
            layout = row_layout(shape, d)
        else:
            if self.kind is OpKind.ALL_REDUCE:
                steps = phases.all_reduce_steps(self.strategy, d)
            else:
                steps = phases.reduce_steps(self.strategy, d, self._root())
            layout = even_layout(count(shape), steps.schedule.num_chunks)
        return LocalScheduleRun(self, rv, state, steps,
                                new_buffers(rv, state, dtype, layout, True), None)

    def _root(self) -> int:
        if self.root is None:  # pragma: no cover - chosen with a root
            raise RuntimeError(f"{self.kind.label} without a root")
        return self.root

    def _broadcast(self, rv: Rendezvous, state: OpState) -> LocalScheduleRun:
        root = self._root()
        root_call = state.calls[root]
        if root_call is None or root_call.array is None or root_call.dtype is None:
            raise RuntimeError("broadcast root has no array")  # validated in the API
        steps = phases.broadcast_steps(self.strategy, rv.size, root)
        layout = even_layout(count(root_call.shape), steps.schedule.num_chunks)
        buffers = [
            ChunkBuffer(rv.backend, rv.devices[i], root_call.dtype, layout,
                        flat_input(rv, root_call) if c is root_call else None)
            for i, c in enumerate(state.calls)
        ]
        return LocalScheduleRun(self, rv, state, steps, buffers, root_call.shape)

    def _all_gather(self, rv: Rendezvous, state: OpState) -> LocalScheduleRun:
        calls = state.complete_calls()
        call = calls[0]
        trailing = (call.shape or ())[1:]
        row = count(trailing)
        sizes = [(c.shape or (0,))[0] * row for c in calls]
        steps = phases.all_gather_steps(self.strategy, rv.size)
        buffers = new_buffers(rv, state, call.dtype or "float32", sizes_layout(sizes), False)
        for i, c in enumerate(calls):
            buffers[i].assign(i, flat_input(rv, c))
        rows = sum(sizes) // row if row else sum((c.shape or (0,))[0] for c in calls)
        return LocalScheduleRun(self, rv, state, steps, buffers, (rows, *trailing))


@dataclass(frozen=True, slots=True)
class LocalScheduleRun:
    """The schedule, every peer's buffer, and the result's shape where it is not the
    caller's (a broadcast receiver's, an all-gather's)."""

    plan: LocalSchedule
    rv: Rendezvous
    state: OpState
    steps: StepIndex
    buffers: list[ChunkBuffer]
    shape: tuple[int, ...] | None

    def run(self, index: int, deadline: float) -> Array | None:
        rv, kind = self.rv, self.plan.kind
        call = peer_call(self.state, index)
        walk(rv, self.state, index, deadline, self.steps, self.buffers, call.reduce_op,
             kind.label)
        backend = rv.backend
        mine = self.buffers[index]
        if kind is OpKind.REDUCE and index != self.plan.root:
            return None
        if kind is OpKind.REDUCE_SCATTER:
            shape = call.shape or ()
            block = backend.copy(mine.chunk(index))
            rows = block_rows(shape, rv.size, index)
            return finish_reduce(rv, backend.reshape(block, (rows, *shape[1:])),
                                 call.reduce_op)
        shape = self.shape if self.shape is not None else call.shape or ()
        return finish_reduce(rv, backend.reshape(mine.result(), tuple(shape)), call.reduce_op)
