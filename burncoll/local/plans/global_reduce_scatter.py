"""``GlobalReduceScatter``: a reduce-scatter across nodes. The local peers reduce to the
node's leader, the leaders reduce-scatter across the nodes (each node receives the blocks of
its own peers' ranks), and every local peer takes its block from the leader's."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from burncoll.backends.base import Array
from burncoll.levels import HostArray
from burncoll.local.plans.phases import (
    LocalReduce,
    finish_reduce,
    global_op,
    link_of,
    peer_call,
)
from burncoll.local.rendezvous import OpState, Rendezvous
from burncoll.strategies import Strategy
from burncoll.strategies.layout import block_rows, row_layout

__all__ = ["GlobalReduceScatter", "GlobalReduceScatterRun"]


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
