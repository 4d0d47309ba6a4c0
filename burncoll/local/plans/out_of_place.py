"""``OutOfPlace``: the all-reduce of a node with a single local peer, across the nodes.

Its input already is the node's local reduction, and its result needs no local broadcast.
The in-place compositions first copy the input into a working buffer (a whole extra pass over
the data) so that the network reduction cannot modify it. Here the link only reads the input
-- the caller's own array on NumPy, a host view or copy on JAX and CuPy, possibly read-only --
and writes the result into a fresh array (or the caller's ``out=``). With one peer per node
this is the same global schedule on the same channel as the sharded and unsharded
compositions, so nodes with more peers still match it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from burncoll.backends.base import Array
from burncoll.backends.numpy import host_memory
from burncoll.backends.pool import fresh
from burncoll.levels import GlobalOp, HostArray, Route
from burncoll.local.calls import Call
from burncoll.local.plans.phases import finish_reduce, flat_input, global_op, link_of
from burncoll.local.rendezvous import OpState, Rendezvous
from burncoll.ops import ReduceOp

__all__ = ["OutOfPlace", "OutOfPlaceRun"]


@dataclass(slots=True)
class OutOfPlace:
    """``route``: the global all-reduce's, the one-round exchange or a schedule."""

    route: Route
    #: Every operation of the plan (kept per signature) as the nodes see it but for its
    #: number and deadline (:meth:`GlobalOp.fingerprint`), from the first one prepared.
    fingerprint: tuple[Any, ...] = field(default=(), compare=False, repr=False)

    def prepare(self, rv: Rendezvous, state: OpState) -> OutOfPlaceRun:
        if not self.fingerprint:
            self.fingerprint = global_op(state, 0.0).fingerprint()
        return OutOfPlaceRun(self, rv, state)


class OutOfPlaceRun:
    """One operation of an :class:`OutOfPlace` plan (a plain class: one is made per call)."""

    __slots__ = ("plan", "rv", "state")

    def __init__(self, plan: OutOfPlace, rv: Rendezvous, state: OpState) -> None:
        self.plan = plan
        self.rv = rv
        self.state = state

    def run(self, index: int, deadline: float) -> Array:
        rv, state = self.rv, self.state
        call = state.calls[index]
        assert call is not None, "the peer arrived with it"
        gop = GlobalOp._make((state.seq, *self.plan.fingerprint, deadline, state.started))
        if call.out is not None:
            x_host, out_host = host_memory(rv.backend, call.array), host_memory(rv.backend,
                                                                                call.out)
            if x_host is not None and out_host is not None:  # (NumPy, torch CPU tensors)
                self._into(call, gop, x_host, out_host)
                return call.out
        if isinstance(call.array, np.ndarray):  # host memory (NumPy): no backend round trip
            x = np.asarray(call.array)  # (a subclass's reshape may keep its dimensions)
            flat = x.reshape(-1)
            out = fresh(flat.size, flat.dtype)
            link_of(rv).all_reduce(gop, flat, out=out, route=self.plan.route, fresh=True)
            if x.ndim != 1:
                out = out.reshape(x.shape)
            return out if call.reduce_op is not ReduceOp.MEAN else finish_reduce(
                rv, out, call.reduce_op)
        host = rv.backend.to_host(flat_input(rv, call))
        if not host.flags.c_contiguous:  # pragma: no cover - flatten gives C order
            host = np.ascontiguousarray(host)
        out = fresh(host.size, host.dtype)  # (no page faults when the last result is gone)
        link_of(rv).all_reduce(gop, host, out=out, route=self.plan.route, fresh=True)
        result = rv.backend.from_host(out, call.dtype or "float32", call.shape or (),
                                      rv.devices[0])
        return finish_reduce(rv, result, call.reduce_op)

    def _into(self, call: Call, gop: GlobalOp, x: HostArray, out: HostArray) -> None:
        """The caller's ``out=`` on host memory (``out``: its NumPy view): the network result
        goes straight into it (in place when the caller's ``out`` is its ``x``); a mean is
        divided there too (``out`` is a float array)."""
        link, route = link_of(self.rv), self.plan.route
        flat_out = np.asarray(out).reshape(-1)  # (np.matrix: reshape keeps two dimensions)
        if call.out is call.array:
            link.all_reduce(gop, flat_out, route=route)
        else:
            link.all_reduce(gop, np.asarray(x).reshape(-1), out=flat_out, route=route)
        if call.reduce_op is ReduceOp.MEAN:
            np.divide(flat_out, self.rv.world_size, out=flat_out)
