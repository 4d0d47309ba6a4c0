"""Small local operations in one thread: the last peer to arrive computes every result.

Under the ``auto`` strategy an operation of at most ``INLINE_BYTES`` skips the schedule and
its thread barriers: the last arriving peer reduces the inputs in peer order (a centralized
reduction), runs the global part if there is one, and hands every peer its own copy. Every
peer's result is a copy of the same array, so they are bitwise identical.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import numpy as np

from burncoll.backends.base import Array, combine
from burncoll.local.calls import Call
from burncoll.ops import OpKind, ReduceOp
from burncoll.strategies import Auto
from burncoll.strategies.auto import INLINE_BYTES
from burncoll.strategies.layout import block_rows, row_layout

if TYPE_CHECKING:
    from burncoll.local.server import LocalServer, OpState

__all__ = ["inline_results", "wants_inline"]

_FIELD = {
    OpKind.ALL_REDUCE: "local_all_reduce_strategy",
    OpKind.REDUCE_SCATTER: "local_all_reduce_strategy",
    OpKind.ALL_GATHER: "local_all_reduce_strategy",
    OpKind.REDUCE: "local_reduce_strategy",
    OpKind.BROADCAST: "local_broadcast_strategy",
}


def _nbytes(server: LocalServer, call: Call) -> int:
    if call.array is None:
        return 0
    from burncoll.dtypes import dtype_from_name

    return math.prod(call.shape or ()) * dtype_from_name(call.dtype or "uint8").itemsize


def wants_inline(server: LocalServer, calls: list[Call]) -> bool:
    """True when ``auto`` asks for the inline path for this operation."""
    call = calls[0]
    name = _FIELD.get(call.kind)
    if name is None or not isinstance(server.config.strategy(name), Auto):
        return False
    if server.link is not None and call.kind is not OpKind.ALL_REDUCE:
        return False
    size = max(_nbytes(server, c) for c in calls)
    return size <= INLINE_BYTES


def _reduce_all(server: LocalServer, calls: list[Call], op: ReduceOp) -> Array:
    backend = server.backend
    device = server.devices[0]
    acc = backend.copy(backend.flatten(backend.to_device(calls[0].array, device)))
    for c in calls[1:]:
        other = backend.flatten(backend.to_device(c.array, device))
        acc = combine(backend, op, acc, other, acc)
    return acc


def _copies(server: LocalServer, x: Array, calls: list[Call] | None = None) -> list[Array]:
    """A copy of ``x`` per peer: into the peer's ``out=`` array when it passed one."""
    backend = server.backend
    outs = [c.out for c in calls] if calls is not None else [None] * server.size
    return [backend.copy(backend.reshape(backend.to_device(x, d), backend.shape(out)), out=out)
            if out is not None else backend.copy(backend.to_device(x, d))
            for d, out in zip(server.devices, outs, strict=True)]


def inline_results(server: LocalServer, state: OpState, deadline: float) -> list[Array | None]:
    """Every local peer's result, computed in this thread."""
    calls = state.complete_calls()
    call = calls[0]
    backend = server.backend
    kind = call.kind
    shape = call.shape or ()
    if kind is OpKind.BROADCAST:
        root = next(c for c in calls if c.peer_id == call.root)
        return _copies(server, root.array)
    if kind is OpKind.ALL_GATHER:
        rows = backend.concat_rows([backend.to_device(c.array, server.devices[0])
                                    for c in calls])
        return _copies(server, rows)
    op = call.reduce_op or ReduceOp.SUM
    flat = _reduce_all(server, calls, op)
    if server.link is not None:
        from burncoll.local.compose import _global_op

        host = backend.to_host(flat)
        if not host.flags.writeable:
            host = np.array(host, copy=True)
        server.link.all_reduce(_global_op(server, state, deadline), host)
        flat = backend.from_host(host, call.dtype or "float32", (host.size,), server.devices[0])
    total = backend.reshape(flat, shape)
    if op is ReduceOp.MEAN:
        total = backend.scale(total, server.world_size)
    if kind is OpKind.REDUCE:
        results: list[Array | None] = [None] * server.size
        root_index = server.index_of[call.root if call.root is not None else -1]
        results[root_index] = backend.copy(backend.to_device(total, server.devices[root_index]))
        return results
    if kind is OpKind.REDUCE_SCATTER:
        layout = row_layout(shape, server.size)
        flat_total = backend.flatten(total)
        out: list[Array | None] = []
        for i, (a, b) in enumerate(layout):
            rows = block_rows(shape, server.size, i)
            block = backend.slice(flat_total, a, b)
            out.append(backend.reshape(backend.copy(backend.to_device(block, server.devices[i])),
                                       (rows, *shape[1:])))
        return out
    return list(_copies(server, total, calls if kind is OpKind.ALL_REDUCE else None))
