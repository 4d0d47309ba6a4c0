"""Large local all-reduces on host memory under ``auto``: every thread takes a share of the
elements, reduces it across all inputs and writes it into every peer's result.

A schedule moves chunks between per-peer buffers round by round, with a thread barrier per
round and a pass over memory per step. When the peers' arrays all live in this process's
memory (the NumPy backend), one pass is enough: peer ``i`` reduces the elements
``[a_i, b_i)`` of every input, a cache-sized block at a time, in peer order
(``x0 op x1 op ... op x(d-1)``, the same order as the inline path), and copies each block
into every peer's result while it is still in cache. Memory traffic is the minimum for an
out-of-place all-reduce (read every input once, write every result once), the threads work
in parallel (NumPy releases the GIL), and there is a single barrier, at the end, so that no
peer returns (and lets its caller modify its input) while another still reads it.

Every peer's result holds the same bits. Used by ``auto`` above
:data:`~burncoll.strategies.auto.INLINE_BYTES`; see the README's crossover table.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from burncoll.backends.numpy import NumpyBackend, host_ufunc
from burncoll.dtypes import is_inexact
from burncoll.local.calls import Call
from burncoll.ops import OpKind, ReduceOp
from burncoll.strategies import Auto
from burncoll.strategies.layout import even_layout

if TYPE_CHECKING:
    from burncoll.local.server import LocalServer, OpState

__all__ = ["BLOCK_BYTES", "prepare_fused", "run_fused", "wants_fused"]

#: Elements are reduced and copied in blocks of about this size (fits a core's L2 cache).
BLOCK_BYTES = 256 << 10

def wants_fused(server: LocalServer, calls: list[Call]) -> bool:
    """True for a one-node all-reduce of host arrays under ``auto`` (the caller has ruled
    out the inline path)."""
    call = calls[0]
    if call.kind is not OpKind.ALL_REDUCE or server.link is not None or server.size < 2:
        return False
    if not isinstance(server.backend, NumpyBackend):
        return False
    if not isinstance(server.config.strategy("local_all_reduce_strategy"), Auto):
        return False
    arrays = [c.array for c in calls]
    if not all(isinstance(a, np.ndarray) for a in arrays):
        return False
    # MEAN of integers becomes float64: the general path does that conversion
    return call.reduce_op is not ReduceOp.MEAN or is_inexact(
        arrays[0].dtype)  # type: ignore[union-attr]


def prepare_fused(server: LocalServer, state: OpState) -> None:
    """Flat views of every input and a fresh result per peer (untouched: each thread's
    first write faults in its own share of the pages)."""
    inputs = []
    for c in state.calls:
        assert c is not None and isinstance(c.array, np.ndarray)
        inputs.append(np.ascontiguousarray(c.array).reshape(-1))
    outputs = []
    for c, x in zip(state.calls, inputs, strict=True):
        assert c is not None
        # the caller's out= (x itself, in place, is safe: a block of x is read before it is
        # written, by the one thread that owns the block)
        outputs.append(c.out.reshape(-1) if isinstance(c.out, np.ndarray) else np.empty_like(x))
    state.shared["fused"] = (inputs, outputs)


def run_fused(server: LocalServer, state: OpState, index: int, deadline: float,
              call: Call) -> np.ndarray[Any, Any]:
    """Peer ``index``'s share of the work, then the barrier; returns its result."""
    inputs, outputs = state.shared["fused"]
    start, stop = even_layout(inputs[0].size, server.size)[index]
    op = call.reduce_op or ReduceOp.SUM
    ufunc = host_ufunc(op)
    step = max(1, BLOCK_BYTES // inputs[0].itemsize)
    first, rest = outputs[0], outputs[1:]
    for a in range(start, stop, step):
        b = min(a + step, stop)
        acc = first[a:b]
        ufunc(inputs[0][a:b], inputs[1][a:b], out=acc)
        for x in inputs[2:]:
            ufunc(acc, x[a:b], out=acc)
        if op is ReduceOp.MEAN:
            np.divide(acc, server.world_size, out=acc)
        for out in rest:
            out[a:b] = acc
    server.sync(state, index, deadline, "all_reduce")
    if isinstance(call.out, np.ndarray):
        return call.out
    result: np.ndarray[Any, Any] = outputs[index].reshape(call.shape or ())
    return result
