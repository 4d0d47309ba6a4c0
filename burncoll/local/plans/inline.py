"""``Inline``: small operations in one thread, the last peer to arrive computes every result.

Under the ``auto`` strategy an operation of at most ``INLINE_BYTES`` skips the schedule and
its thread barriers: the last arriving peer reduces the inputs in peer order (a centralized
reduction), runs the global all-reduce if there is one, and hands every peer its own copy.
Every peer's result is a copy of the same array, so they are bitwise identical.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from burncoll.backends.base import Array, Backend, Device, combine
from burncoll.backends.numpy import CpuDevice, NumpyBackend, host_memory
from burncoll.dtypes import dtype_name
from burncoll.levels import Route
from burncoll.local.calls import Call
from burncoll.local.plans.phases import global_op, link_of
from burncoll.local.rendezvous import OpState, Rendezvous
from burncoll.ops import OpKind, ReduceOp
from burncoll.reduction import reduce_into
from burncoll.strategies.layout import block_rows, row_layout

__all__ = ["Inline", "InlineResults", "inline_results"]

_NUMPY = NumpyBackend()


@dataclass(frozen=True, slots=True)
class Inline:
    """Every result computed at arrival. ``route``: ``None`` on one node; with several,
    the route of the global all-reduce of the node's reduction."""

    route: Route | None = None

    def prepare(self, rv: Rendezvous, state: OpState) -> InlineResults:
        return InlineResults(inline_results(rv, state, self))


class InlineResults(list[Array | None]):
    """Each peer's result, by local index (a list: made without a Python call)."""

    def run(self, index: int, deadline: float) -> Array | None:
        return self[index]


@dataclass(frozen=True, slots=True)
class _Where:
    """The backend the results are computed with, and each local peer's device for it."""

    backend: Backend
    devices: Sequence[Device]


def _reduce_all(on: _Where, calls: list[Call], op: ReduceOp) -> Array:
    backend = on.backend
    if isinstance(backend, NumpyBackend):  # (the host kernel itself: no backend calls)
        operands = [np.asarray(c.array).reshape(-1) for c in calls]
        first = operands[0]  # (np.empty: np.empty_like is a Python call more)
        return reduce_into(op, operands, np.empty(first.size, first.dtype))
    device = on.devices[0]
    acc = backend.copy(backend.flatten(backend.to_device(calls[0].array, device)))
    for c in calls[1:]:
        other = backend.flatten(backend.to_device(c.array, device))
        acc = combine(backend, op, acc, other, acc)
    return acc


def _copies(on: _Where, x: Array, calls: list[Call] | None = None) -> list[Array | None]:
    """A copy of ``x`` per peer: into the peer's ``out=`` array when it passed one."""
    backend = on.backend
    outs = [c.out for c in calls] if calls is not None else [None] * len(on.devices)
    if isinstance(backend, NumpyBackend):  # (NumPy itself: no backend or Python calls per peer)
        host = np.asarray(x)
        copies: list[Array | None] = []
        for out in outs:
            if out is None:
                copies.append(np.array(host))
            else:  # (into the NumPy array ``out``, of as many elements; one dtype: no copyto)
                into = np.asarray(out)
                into[...] = host.reshape(into.shape)
                copies.append(into)
        return copies
    return [backend.copy(backend.reshape(backend.to_device(x, d), backend.shape(out)), out=out)
            if out is not None else backend.copy(backend.to_device(x, d))
            for d, out in zip(on.devices, outs, strict=True)]


def _across_nodes(rv: Rendezvous, on: _Where, state: OpState, flat: Array, route: Route
                  ) -> Array:
    """The global all-reduce of this node's reduction ``flat``."""
    backend = on.backend
    call = state.complete_calls()[0]
    host = backend.to_host(flat)
    if not host.flags.writeable:
        host = np.array(host, copy=True)
    deadline = state.started + rv.config.timeout
    link_of(rv).all_reduce(global_op(state, deadline), host, route=route)
    return backend.from_host(host, call.dtype or "float32", (host.size,), on.devices[0])


def _scattered(on: _Where, total: Array, shape: tuple[int, ...]) -> list[Array | None]:
    backend = on.backend
    flat_total = backend.flatten(total)
    out: list[Array | None] = []
    size = len(on.devices)
    for i, (a, b) in enumerate(row_layout(shape, size)):
        rows = block_rows(shape, size, i)
        block = backend.slice(flat_total, a, b)
        out.append(backend.reshape(backend.copy(backend.to_device(block, on.devices[i])),
                                   (rows, *shape[1:])))
    return out


def inline_results(rv: Rendezvous, state: OpState, plan: Inline) -> list[Array | None]:
    """Every local peer's result, computed in this thread: on the NumPy views of torch CPU
    tensors when those are the arrays (a backend call on tensors costs microseconds of
    conversions; the results become tensors over the same memory)."""
    calls = state.complete_calls()
    views = _host_views(rv, calls)
    if views is None:
        return _results(rv, _Where(rv.backend, rv.devices), state, calls, plan)
    host = _Where(_NUMPY, [CpuDevice(i) for i in range(rv.size)])
    results = _results(rv, host, state, views, plan)
    return [None if r is None else c.out if c.out is not None else rv.backend.from_host(
                r, dtype_name(r.dtype), r.shape, rv.devices[i])
            for i, (r, c) in enumerate(zip(results, calls, strict=True))]


def _host_views(rv: Rendezvous, calls: list[Call]) -> list[Call] | None:
    """``calls`` with the NumPy views of their arrays and ``out=``, when another backend's
    arrays all live in host memory (torch CPU tensors); else ``None``."""
    if isinstance(rv.backend, NumpyBackend):
        return None
    views = []
    for c in calls:
        array, out = host_memory(rv.backend, c.array), host_memory(rv.backend, c.out)
        if (array is None) != (c.array is None) or (out is None) != (c.out is None):
            return None
        views.append(c._replace(array=array, out=out))
    return views


def _results(rv: Rendezvous, on: _Where, state: OpState, calls: list[Call], plan: Inline
             ) -> list[Array | None]:
    call = calls[0]
    backend = on.backend
    kind = call.kind
    shape = call.shape or ()
    if kind is OpKind.BROADCAST:
        root = next(c for c in calls if c.peer_id == call.root)
        return _copies(on, root.array)
    if kind is OpKind.ALL_GATHER:
        return _copies(on, backend.concat_rows([backend.to_device(c.array, on.devices[0])
                                                 for c in calls]))
    op = call.reduce_op or ReduceOp.SUM
    flat = _reduce_all(on, calls, op)
    if plan.route is not None:
        flat = _across_nodes(rv, on, state, flat, plan.route)
    total = backend.reshape(flat, shape)
    if op is ReduceOp.MEAN:
        total = backend.scale(total, rv.world_size)
    if kind is OpKind.REDUCE:
        results: list[Array | None] = [None] * rv.size
        root_index = rv.index_of[call.root if call.root is not None else -1]
        results[root_index] = backend.copy(backend.to_device(total, on.devices[root_index]))
        return results
    if kind is OpKind.REDUCE_SCATTER:
        return _scattered(on, total, shape)
    return _copies(on, total, calls if kind is OpKind.ALL_REDUCE else None)
