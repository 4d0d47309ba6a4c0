"""The plans across nodes in which each node's *leader* (one local peer) meets the other
nodes: the local peers meet their leader by a local schedule, and the leaders take part in the
global operation.

* ``GlobalReduce``: the local peers reduce to the leader (the root itself on the root's
  node), and the leaders reduce across the nodes into the root.
* ``GlobalReduceScatter``: the local peers reduce to the leader, the leaders reduce-scatter
  across the nodes (each node receives the blocks of its own peers' ranks), and every local
  peer takes its block from the leader's.
* ``ReduceGlobalBroadcast``: an all-reduce across nodes that do not shard it. The local peers
  reduce to the leader, the leaders all-reduce across the nodes, and each leader broadcasts
  the result back to its local peers.
* ``GlobalBroadcast``: the leader (the root itself on the root's node) takes part in the
  global broadcast, then broadcasts the array to its local peers. Receivers learn the dtype
  and shape from the root's frames.
* ``GlobalAllGather``: local peer 0 gathers every peer's array across the nodes (its node's
  arrays by rank), then broadcasts the whole to its local peers.
* ``GlobalBarrier``: the local peers have arrived; one of them meets the other nodes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from burncoll.backends.base import Array
from burncoll.dtypes import dtype_name
from burncoll.levels import Exchange, GlobalOp, HostArray, HostGather, Route
from burncoll.local.plans.phases import (
    LocalBroadcast,
    LocalReduce,
    broadcast_steps,
    finish_reduce,
    global_op,
    link_of,
    peer_call,
    writable_host,
)
from burncoll.local.rendezvous import OpState, Rendezvous
from burncoll.strategies import Strategy
from burncoll.strategies.layout import block_rows, row_layout

__all__ = ["GlobalAllGather", "GlobalAllGatherRun", "GlobalBarrier", "GlobalBarrierRun",
           "GlobalBroadcast", "GlobalBroadcastRun", "GlobalReduce", "GlobalReduceRun",
           "GlobalReduceScatter", "GlobalReduceScatterRun", "ReduceGlobalBroadcast",
           "ReduceGlobalBroadcastRun"]

#: The local peer that gathers across the nodes (``GlobalAllGather``).
_GATHERER = 0


@dataclass(frozen=True, slots=True)
class GlobalReduce:
    """``strategy``: the local reduce's; ``leader``: the local index that talks to other
    nodes; ``root_node``: the node of the root; ``global_strategy``: the global reduce's."""

    strategy: Strategy
    leader: int
    root_node: int
    global_strategy: Strategy

    def prepare(self, rv: Rendezvous, state: OpState) -> GlobalReduceRun:
        return GlobalReduceRun(self, rv, state, LocalReduce(rv, state, self.strategy,
                                                            self.leader))


@dataclass(frozen=True, slots=True)
class GlobalReduceRun:
    plan: GlobalReduce
    rv: Rendezvous
    state: OpState
    local_reduce: LocalReduce

    def run(self, index: int, deadline: float) -> Array | None:
        rv, plan = self.rv, self.plan
        call = peer_call(self.state, index)
        self.local_reduce.run(index, deadline, call.reduce_op)
        result: Array | None = None
        if index == plan.leader:
            link = link_of(rv)
            host = self.local_reduce.host()
            link.reduce(global_op(self.state, deadline), host, plan.root_node,
                        strategy=plan.global_strategy)
            if plan.root_node == link.node_index:
                result = rv.backend.from_host(host, call.dtype or "float32", call.shape or (),
                                              rv.devices[index])
                result = finish_reduce(rv, result, call.reduce_op)
        rv.sync(self.state, index, deadline, "global reduce")
        return result


@dataclass(frozen=True, slots=True)
class GlobalReduceScatter:
    """``strategy``: the local reduce's; ``leader``: the local index that talks to other
    nodes; ``global_strategy``: the global reduce-scatter's."""

    strategy: Strategy
    leader: int
    global_strategy: Strategy

    def prepare(self, rv: Rendezvous, state: OpState) -> GlobalReduceScatterRun:
        return GlobalReduceScatterRun(self, rv, state, LocalReduce(rv, state, self.strategy,
                                                                   self.leader))


@dataclass(slots=True)
class GlobalReduceScatterRun:
    plan: GlobalReduceScatter
    rv: Rendezvous
    state: OpState
    local_reduce: LocalReduce
    #: The leader's buffer after the global reduce-scatter (set by the leader).
    host: HostArray | None = field(default=None)

    def run(self, index: int, deadline: float) -> Array:
        rv = self.rv
        call = peer_call(self.state, index)
        shape, dtype = call.shape or (), call.dtype or "float32"
        self.local_reduce.run(index, deadline, call.reduce_op)
        layout = row_layout(shape, rv.world_size)
        if index == self.plan.leader:
            link = link_of(rv)
            host = self.local_reduce.host()
            owners = [link.node_of[pid] for pid in rv.world_peer_ids]
            link.reduce_scatter(global_op(self.state, deadline), host, layout, owners,
                                strategy=self.plan.global_strategy)
            self.host = host
        rv.sync(self.state, index, deadline, "global reduce_scatter")
        if self.host is None:  # pragma: no cover - the leader set it before the sync
            raise RuntimeError("reduce_scatter result missing")
        rank = rv.rank_of[rv.peer_ids[index]]
        start, stop = layout[rank]
        rows = block_rows(shape, rv.world_size, rank)
        block = np.array(self.host[start:stop], copy=True)
        out = rv.backend.from_host(block, dtype, (rows, *shape[1:]), rv.devices[index])
        rv.sync(self.state, index, deadline, "local scatter")
        return finish_reduce(rv, out, call.reduce_op)


@dataclass(frozen=True, slots=True)
class ReduceGlobalBroadcast:
    """``reduce``, ``broadcast``: the local phases' strategies; ``leader``: the local index
    that talks to other nodes; ``route``: the global all-reduce's, the one-round
    exchange or a schedule."""

    reduce: Strategy
    broadcast: Strategy
    leader: int
    route: Route

    def prepare(self, rv: Rendezvous, state: OpState) -> ReduceGlobalBroadcastRun:
        return ReduceGlobalBroadcastRun(
            self, rv, state, LocalReduce(rv, state, self.reduce, self.leader),
            LocalBroadcast(rv, state, broadcast_steps(self.broadcast, rv.size, self.leader)))


@dataclass(slots=True)
class ReduceGlobalBroadcastRun:
    plan: ReduceGlobalBroadcast
    rv: Rendezvous
    state: OpState
    local_reduce: LocalReduce
    local_broadcast: LocalBroadcast
    #: The global result, on the leader's device (set by the leader).
    total: Array | None = field(default=None)

    def run(self, index: int, deadline: float) -> Array:
        rv, leader = self.rv, self.plan.leader
        call = peer_call(self.state, index)
        dtype = call.dtype or "float32"
        self.local_reduce.run(index, deadline, call.reduce_op)
        if index == leader:
            host = self.local_reduce.host()
            link_of(rv).all_reduce(global_op(self.state, deadline), host,
                                   route=self.plan.route)
            self.total = rv.backend.from_host(host, dtype, (host.size,), rv.devices[index])
        rv.sync(self.state, index, deadline, "global all_reduce")
        out = self.local_broadcast.run(index, deadline, leader, self.total, dtype, owned=True)
        return finish_reduce(rv, rv.backend.reshape(out, call.shape or ()), call.reduce_op)


@dataclass(frozen=True, slots=True)
class GlobalBroadcast:
    """``strategy``: the local broadcast's; ``leader``: the local index that talks to other
    nodes; ``root_node``: the node of the root; ``global_strategy``: the global broadcast's."""

    strategy: Strategy
    leader: int
    root_node: int
    global_strategy: Strategy

    def prepare(self, rv: Rendezvous, state: OpState) -> GlobalBroadcastRun:
        steps = broadcast_steps(self.strategy, rv.size, self.leader)
        return GlobalBroadcastRun(self, rv, state, LocalBroadcast(rv, state, steps))


@dataclass(slots=True)
class GlobalBroadcastRun:
    plan: GlobalBroadcast
    rv: Rendezvous
    state: OpState
    local_broadcast: LocalBroadcast
    #: What the leader received (or sent): flat on its device, with its dtype and shape.
    flat: Array | None = field(default=None)
    dtype: str = "float32"
    shape: tuple[int, ...] = ()

    def run(self, index: int, deadline: float) -> Array:
        rv, leader = self.rv, self.plan.leader
        if index == leader:
            self._across_nodes(index, global_op(self.state, deadline))
        rv.sync(self.state, index, deadline, "global broadcast")
        out = self.local_broadcast.run(index, deadline, leader, self.flat, self.dtype)
        return rv.backend.reshape(out, self.shape)

    def _across_nodes(self, index: int, gop: GlobalOp) -> None:
        rv, link = self.rv, link_of(self.rv)
        mine = self.state.calls[index]
        send = None
        if self.plan.root_node == link.node_index and mine is not None:
            send = writable_host(rv, rv.backend.flatten(mine.array))
            # the root's shape travels in the frames; receivers adopt it
            gop = GlobalOp(gop.seq, gop.kind, gop.reduce_op, mine.dtype, mine.shape or (),
                           gop.root, gop.deadline, gop.started)
        host = link.broadcast(gop, send, self.plan.root_node,
                              strategy=self.plan.global_strategy)
        self.dtype = dtype_name(host.dtype)
        self.shape = tuple(host.shape)
        self.flat = rv.backend.from_host(np.ascontiguousarray(host).reshape(-1), self.dtype,
                                         (host.size,), rv.devices[index])


@dataclass(frozen=True, slots=True)
class GlobalAllGather:
    """``strategy``: the local broadcast's; ``global_strategy``: the global all-gather's."""

    strategy: Strategy
    global_strategy: Strategy

    def prepare(self, rv: Rendezvous, state: OpState) -> GlobalAllGatherRun:
        steps = broadcast_steps(self.strategy, rv.size, _GATHERER)
        return GlobalAllGatherRun(self, rv, state, LocalBroadcast(rv, state, steps))


@dataclass(slots=True)
class GlobalAllGatherRun:
    plan: GlobalAllGather
    rv: Rendezvous
    state: OpState
    local_broadcast: LocalBroadcast
    #: Every peer's array, concatenated, flat on the gatherer's device, and its shape.
    flat: Array | None = field(default=None)
    shape: tuple[int, ...] = ()

    def run(self, index: int, deadline: float) -> Array:
        rv = self.rv
        call = peer_call(self.state, index)
        dtype = call.dtype or "float32"
        if index == _GATHERER:
            self._across_nodes(index, deadline, dtype)
        rv.sync(self.state, index, deadline, "global all_gather")
        out = self.local_broadcast.run(index, deadline, _GATHERER, self.flat, dtype,
                                       owned=True)
        return rv.backend.reshape(out, self.shape)

    def _across_nodes(self, index: int, deadline: float, dtype: str) -> None:
        rv, backend = self.rv, self.rv.backend
        calls = self.state.complete_calls()
        trailing = (peer_call(self.state, index).shape or ())[1:]
        # each array keeps its rows: the nodes send them in the headers, which is how an
        # array whose rows hold no elements (a zero in its trailing shape) counts them
        mine = {rv.rank_of[c.peer_id]: np.ascontiguousarray(backend.to_host(c.array))
                for c in calls}
        parts = link_of(rv).all_gather(global_op(self.state, deadline), mine,
                                       strategy=self.plan.global_strategy)
        full = np.concatenate([p.reshape(-1) for p in parts]) if parts else np.empty(0)
        self.shape = (sum(p.shape[0] for p in parts), *trailing)
        self.flat = backend.from_host(full, dtype, (full.size,), rv.devices[index])


@dataclass(frozen=True, slots=True)
class GlobalBarrier:
    """``route``: the nodes meet in a one-round exchange, or by that strategy's
    all-reduce schedule."""

    route: Exchange | HostGather | Strategy

    def prepare(self, rv: Rendezvous, state: OpState) -> GlobalBarrierRun:
        return GlobalBarrierRun(self, rv, state)


@dataclass(frozen=True, slots=True)
class GlobalBarrierRun:
    plan: GlobalBarrier
    rv: Rendezvous
    state: OpState

    def run(self, index: int, deadline: float) -> Array | None:
        if index == 0:
            link_of(self.rv).barrier(global_op(self.state, deadline),
                                     route=self.plan.route)
        self.rv.sync(self.state, index, deadline, "global barrier")
        return None
