"""``Fused``: large one-node all-reduces of host arrays under ``auto``. Every thread takes a
share of the elements, reduces it across all inputs and writes it into every peer's result.

A schedule moves chunks between per-peer buffers round by round, with a thread barrier per
round and a pass over memory per step. When the peers' arrays all live in this process's
memory (the NumPy backend), one pass is enough: peer ``i`` reduces the elements
``[a_i, b_i)`` of every input with :func:`~burncoll.reduction.reduce_into`, a cache-sized
block at a time, in peer order (``x0 op x1 op ... op x(d-1)``, the same order as the inline
path), and copies each block into every peer's result while it is still in cache. (torch
CPU tensors too: their NumPy views are their memory.) Memory traffic is the minimum for an
out-of-place all-reduce (read every input once, write every result once), the threads work
in parallel (NumPy releases the GIL), and there is a single barrier, at the end, so that no
peer returns (and lets its caller modify its input) while another still reads it.

Every peer's result holds the same bits. Used by ``auto`` above
:data:`~burncoll.strategies.auto.INLINE_BYTES`; see the README's crossover table.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from burncoll.backends.base import Array
from burncoll.backends.numpy import host_memory
from burncoll.backends.pool import fresh
from burncoll.levels import HostArray
from burncoll.local.plans.phases import peer_call
from burncoll.local.rendezvous import OpState, Rendezvous
from burncoll.ops import ReduceOp
from burncoll.reduction import reduce_into
from burncoll.strategies.layout import even_layout

__all__ = ["Fused", "FusedBuffers"]


@dataclass(frozen=True, slots=True)
class Fused:
    """One pass over host memory, every peer reducing its share of the elements."""

    def prepare(self, rv: Rendezvous, state: OpState) -> FusedBuffers:
        """Flat views of every input and a fresh result per peer (untouched: each thread's
        first write faults in its own share of the pages)."""
        inputs: list[HostArray] = []
        outputs: list[HostArray] = []
        for c in state.complete_calls():
            host = host_memory(rv.backend, c.array)
            if host is None:  # pragma: no cover - chosen for host arrays
                raise RuntimeError("the fused all-reduce needs host arrays")
            x = np.ascontiguousarray(host).reshape(-1)
            inputs.append(x)
            # the caller's out= (x itself, in place, is safe: a block of x is read before it
            # is written, by the one thread that owns the block)
            out = host_memory(rv.backend, c.out)
            outputs.append(fresh(x.size, x.dtype) if out is None else out.reshape(-1))
        return FusedBuffers(rv, state, inputs, outputs)


@dataclass(frozen=True, slots=True)
class FusedBuffers:
    """Every peer's flat input and flat result."""

    rv: Rendezvous
    state: OpState
    inputs: list[HostArray]
    outputs: list[HostArray]

    def run(self, index: int, deadline: float) -> Array:
        """Peer ``index``'s share of the work, then the barrier; returns its result."""
        rv, inputs, outputs = self.rv, self.inputs, self.outputs
        call = peer_call(self.state, index)
        start, stop = even_layout(inputs[0].size, rv.size)[index]
        reduce_into(call.reduce_op or ReduceOp.SUM, [x[start:stop] for x in inputs],
                    outputs[0][start:stop], divisor=rv.world_size,
                    copies=[out[start:stop] for out in outputs[1:]])
        rv.sync(self.state, index, deadline, "all_reduce")
        if call.out is not None:
            return call.out
        result: HostArray = outputs[index].reshape(call.shape or ())
        if isinstance(call.array, np.ndarray):
            return result
        # a torch CPU tensor's: a tensor over the same memory
        return rv.backend.from_host(result, call.dtype or "", result.shape, rv.devices[index])
