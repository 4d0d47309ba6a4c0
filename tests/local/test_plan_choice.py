"""Which plan the one decision (:func:`burncoll.local.plans.choose.choose`) picks.

The expected plans below were derived by reading the paths as they were before the decision
moved into one function -- ``compose.prepare`` and ``execute`` (link / sharded / single local
peer), ``wants_inline`` (``auto``, at most ``INLINE_BYTES``, across nodes only the all-reduce),
``wants_fused`` (one node, 2+ peers, NumPy, ``auto``, not the mean of integers) and the node
link's ``_exchanges`` (global ``auto``, at most ``exchange_limit(nodes, one_host)`` bytes per
node, per shard when sharded; a barrier as a 0-byte exchange) -- not by calling the function.

The global route of each plan (the exchange, or the strategy of the global schedule) is what
the node link used to resolve itself, by hand from ``strategies/auto.py``: the operation's own
config field (``global_all_reduce_strategy`` for an all-reduce, reduce-scatter, all-gather and
barrier), and under ``auto`` ``tree:2`` up to 64 KiB and ``ring`` past it, by the size the node
was handed: the node's array (each shard when sharded) for an all-reduce, its whole array for a
reduce and a reduce-scatter, and 0 bytes for a barrier, a broadcast and an all-gather.

The rows marked ``route:`` (issue 30, stage 6) were derived by hand from the rules the node
level applied at run time before the route moved into ``choose``: the shared mail's capacity
test (a 512 KiB payload), the lanes' one user (channel 0), the segments' usability test (3+
nodes, channel 0, at most ``MOST_PIECES`` pieces, a set-up every node agreed to), and the
compressed wire format (always a schedule).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest

import burncoll
from burncoll.backends import get_backend
from burncoll.backends.base import Backend
from burncoll.levels import Exchange, HostGather, HostReduce, Medium
from burncoll.local.calls import Call
from burncoll.local.plans.across_nodes import (
    GlobalAllGather,
    GlobalBarrier,
    GlobalBroadcast,
    GlobalReduce,
    GlobalReduceScatter,
    ReduceGlobalBroadcast,
)
from burncoll.local.plans.barrier import LocalBarrier
from burncoll.local.plans.choose import OpPlan, choose, plan_key
from burncoll.local.plans.fused import Fused
from burncoll.local.plans.hierarchical_ring import HierarchicalRing
from burncoll.local.plans.inline import Inline
from burncoll.local.plans.out_of_place import OutOfPlace
from burncoll.local.plans.scheduled import LocalSchedule
from burncoll.local.world import World
from burncoll.node.membership import NodeInfo, number_hosts
from burncoll.ops import OpKind, ReduceOp
from burncoll.strategies import ByHost, Centralized, Doubling, Ring, Tree
from burncoll.strategies.auto import MOST_PIECES, PIECE_BYTES

MiB = 1 << 20
KiB = 1 << 10
C, R, T, T3, D = Centralized(), Ring(), Tree(2), Tree(3), Doubling()
#: The exchange on the member connections, on the lanes, in the host mail; the host reduction;
#: the host gather.
X, XL, XH, H, G = (Exchange(Medium.CONNECTIONS), Exchange(Medium.LANE), Exchange(Medium.HOST),
                   HostReduce(), HostGather())
AR, RED, BC, RS, AG, BAR = (OpKind.ALL_REDUCE, OpKind.REDUCE, OpKind.BROADCAST,
                            OpKind.REDUCE_SCATTER, OpKind.ALL_GATHER, OpKind.BARRIER)


def one_node(devices: int) -> World:
    return World.of(range(devices), None)


def nodes(layout: list[int], node: int = 0, sharded: bool = False,
          one_host: bool = False, segments: bool = False, hosts: tuple[int, ...] = (),
          lanes: bool = False, mail: bool = True) -> World:
    """Node ``node`` of nodes with ``layout[n]`` local peers each (peer ids in node order),
    on hosts of their own unless ``one_host`` or ``hosts`` (each node's host); ``lanes``:
    every node uses lanes; ``segments``: one host, lanes, and the host memory mapped at join
    (with its mail unless ``mail`` is false: a processor without ordered stores)."""
    ids = [list(range(sum(layout[:n]), sum(layout[:n + 1]))) for n in range(len(layout))]
    return World(peer_ids=tuple(ids[node]), all_peer_ids=tuple(range(sum(layout))),
                 num_nodes=len(layout), node_index=node,
                 node_of={p: n for n, peers in enumerate(ids) for p in peers}, sharded=sharded,
                 one_host=one_host or segments, hosts=hosts, lanes=lanes or segments,
                 host_memory=segments, host_mail=segments and mail)


@dataclass(frozen=True)
class Case:
    """One operation: each peer passes ``nbytes`` of ``dtype`` (with ``rows``: ``rows[i]``
    rows of ``nbytes`` each on local peer ``i``); broadcast receivers pass ``None``."""

    kind: OpKind
    nbytes: int = 16
    dtype: str = "float32"
    op: ReduceOp | None = None
    root: int | None = None
    rows: tuple[int, ...] | None = None
    strategies: dict[str, Any] = field(default_factory=dict)
    backend: str = "numpy"
    compression: str | None = None

    def calls(self, world: World) -> list[Call]:
        itemsize = np.dtype(self.dtype).itemsize
        calls = []
        for i, pid in enumerate(world.peer_ids):
            shape: tuple[int, ...] | None = (self.nbytes // itemsize,)
            if self.rows is not None:
                shape = (self.rows[i], self.nbytes // itemsize)
            if self.kind is OpKind.BARRIER or (self.kind is OpKind.BROADCAST
                                               and pid != self.root):
                shape = None
            array = None if shape is None else np.broadcast_to(np.zeros((), self.dtype), shape)
            op = self.op if self.op is not None or self.kind not in (AR, RED, RS) else (
                ReduceOp.SUM)
            calls.append(Call(pid, self.kind, op, self.root, array,
                              None if shape is None else self.dtype, shape,
                              compression=self.compression))
        return calls

    def config(self) -> burncoll.CollectiveConfig:
        return burncoll.CollectiveConfig(num_devices=1, **self.strategies)


def _local(name: str) -> dict[str, Any]:
    return {"local_all_reduce_strategy": name, "local_reduce_strategy": name,
            "local_broadcast_strategy": name}


RING = _local("ring")
GLOBAL_RING: dict[str, Any] = {"global_all_reduce_strategy": "ring"}
GLOBAL_DOUBLING: dict[str, Any] = {"global_all_reduce_strategy": "doubling"}

CASES: list[tuple[str, Case, World, OpPlan]] = [
    # -- one node: inline up to INLINE_BYTES under auto, for every operation but a barrier
    ("small all_reduce", Case(AR), one_node(4), Inline()),
    ("all_reduce of exactly INLINE_BYTES", Case(AR, MiB), one_node(4), Inline()),
    ("small all_reduce, one peer", Case(AR), one_node(1), Inline()),
    ("small reduce", Case(RED, root=2), one_node(4), Inline()),
    ("small broadcast (receivers pass None)", Case(BC, MiB, root=3), one_node(4), Inline()),
    ("small reduce_scatter", Case(RS, rows=(4,) * 4), one_node(4), Inline()),
    ("small all_gather", Case(AG, 8, rows=(1, 2, 3)), one_node(3), Inline()),
    ("small mean of integers", Case(AR, dtype="int32", op=ReduceOp.MEAN), one_node(2),
     Inline()),
    ("small all_reduce, local ring", Case(AR, strategies=RING), one_node(4),
     LocalSchedule(AR, R)),
    ("small reduce: its own field decides", Case(
        RED, root=0, strategies={"local_all_reduce_strategy": "ring"}), one_node(2), Inline()),
    ("small all_reduce: its own field decides", Case(
        AR, strategies={"local_reduce_strategy": "ring", "local_broadcast_strategy": "tree"}),
     one_node(2), Inline()),
    # -- one node past the inline size: fused for NumPy all-reduces under auto
    ("all_reduce one byte past INLINE_BYTES", Case(AR, MiB + 4), one_node(4), Fused()),
    ("large all_reduce, 2 peers", Case(AR, 8 * MiB, "float64"), one_node(2), Fused()),
    ("large mean of floats", Case(AR, 2 * MiB, "float16", ReduceOp.MEAN), one_node(3),
     Fused()),
    ("large mean of integers", Case(AR, 2 * MiB, "int32", ReduceOp.MEAN), one_node(3),
     LocalSchedule(AR, C)),
    ("large all_reduce, one peer", Case(AR, 2 * MiB), one_node(1), LocalSchedule(AR, C)),
    ("large all_reduce, JAX", Case(AR, 2 * MiB, backend="jax"), one_node(4),
     LocalSchedule(AR, C)),
    ("large all_reduce, torch CPU tensors", Case(AR, 2 * MiB, "float16", backend="torch"),
     one_node(4), Fused()),
    ("large mean of integers, torch", Case(AR, 2 * MiB, "int64", ReduceOp.MEAN,
                                           backend="torch"), one_node(2), LocalSchedule(AR, C)),
    ("large all_reduce, local ring", Case(AR, 2 * MiB, strategies=RING), one_node(4),
     LocalSchedule(AR, R)),
    ("large all_reduce, local tree", Case(AR, 2 * MiB, strategies=_local("tree:3")),
     one_node(4), LocalSchedule(AR, Tree(3))),
    # -- one node, other operations past the inline size: their local schedule
    ("large reduce", Case(RED, 2 * MiB, root=2), one_node(4), LocalSchedule(RED, C, 2)),
    ("large reduce, local tree", Case(RED, 2 * MiB, root=1, strategies=_local("tree")),
     one_node(4), LocalSchedule(RED, T, 1)),
    ("large broadcast", Case(BC, 2 * MiB, root=3), one_node(4), LocalSchedule(BC, C, 3)),
    ("large broadcast, local ring", Case(BC, 2 * MiB, root=0, strategies=RING), one_node(2),
     LocalSchedule(BC, R, 0)),
    ("large reduce_scatter", Case(RS, MiB, rows=(2,) * 4), one_node(4),
     LocalSchedule(RS, C)),
    ("all_gather: the largest array decides", Case(AG, MiB // 2, "uint8", rows=(1, 3)),
     one_node(2), LocalSchedule(AG, C)),
    ("barrier", Case(BAR), one_node(4), LocalBarrier()),
    ("barrier, local ring", Case(BAR, strategies=RING), one_node(4), LocalBarrier()),
    # -- several nodes: only the all-reduce is inline (and never with one local peer: its
    #    array goes out as it is); the exchange up to exchange_limit, then the global
    #    all-reduce strategy (auto: tree:2 up to 64 KiB, ring past it)
    ("2x2 small all_reduce", Case(AR), nodes([2, 2]), Inline(X)),
    ("2x2 small all_reduce, global ring", Case(AR, strategies=GLOBAL_RING), nodes([2, 2]),
     Inline(R)),
    ("3 nodes, 256 KiB all_reduce", Case(AR, 256 * KiB), nodes([1, 1, 1]), OutOfPlace(X)),
    ("3 nodes, 256 KiB + 4 all_reduce", Case(AR, 256 * KiB + 4), nodes([1, 1, 1]),
     OutOfPlace(R)),
    ("4 nodes, past the 4-node limit", Case(AR, 128 * KiB + 4), nodes([1] * 4), OutOfPlace(R)),
    ("4 nodes of one host, 512 KiB: the exchange", Case(AR, 512 * KiB),
     nodes([1] * 4, one_host=True), OutOfPlace(X)),
    ("4 nodes of one host, past 512 KiB", Case(AR, 512 * KiB + 4),
     nodes([1] * 4, 3, one_host=True), OutOfPlace(R)),
    ("3 nodes of one host keep the 3-node limit", Case(AR, 256 * KiB + 4),
     nodes([1] * 3, one_host=True), OutOfPlace(R)),
    # -- node processes of one host sharing host memory: past the exchange, the host
    #    reduction (on channel 0, under a global auto, uncompressed); never for a barrier;
    #    their exchanges on channel 0 in the host mail up to 512 KiB, then on the lanes
    ("4 nodes sharing segments, 64 KiB: the exchange", Case(AR, 64 * KiB),
     nodes([1] * 4, segments=True), OutOfPlace(XH)),
    ("4 nodes sharing segments, past 64 KiB", Case(AR, 64 * KiB + 4),
     nodes([1] * 4, 2, segments=True), OutOfPlace(H)),
    ("3 nodes sharing segments, 128 KiB: the exchange", Case(AR, 128 * KiB),
     nodes([1] * 3, segments=True), OutOfPlace(XH)),
    ("6 nodes sharing segments, past 64 KiB", Case(AR, 64 * KiB + 8, "float64"),
     nodes([1] * 6, 5, segments=True), OutOfPlace(H)),
    ("2 nodes sharing segments: the mail to 512 KiB", Case(AR, 512 * KiB),
     nodes([1, 1], segments=True), OutOfPlace(XH)),
    ("2 nodes sharing segments, past 512 KiB", Case(AR, 512 * KiB + 8, "float64"),
     nodes([1, 1], segments=True), OutOfPlace(H)),
    ("3 nodes sharing segments, past 128 KiB", Case(AR, 128 * KiB + 8, "float64"),
     nodes([1] * 3, segments=True), OutOfPlace(H)),
    ("2 nodes sharing segments, 2 MiB", Case(AR, 2 * MiB + 8, "float64"),
     nodes([1, 1], segments=True), OutOfPlace(H)),
    ("sharing segments, compressed: the schedule", Case(AR, 4 * MiB, compression="bf16"),
     nodes([1] * 3, segments=True), OutOfPlace(R)),
    ("sharing segments, global ring: the ring", Case(AR, 4 * MiB, strategies=GLOBAL_RING),
     nodes([1] * 3, segments=True), OutOfPlace(R)),
    ("2x1x1 sharing segments, inline past the exchange", Case(AR, 128 * KiB + 4),
     nodes([2, 1, 1], segments=True), Inline(H)),
    ("2x1x1 sharing segments, past the inline size", Case(AR, 2 * MiB),
     nodes([2, 1, 1], segments=True), ReduceGlobalBroadcast(C, C, 0, H)),
    ("2x2x2 sharing segments, small: inline, exchanged", Case(AR),
     nodes([2, 2, 2], segments=True), Inline(XH)),
    ("sharded sharing segments: only channel 0", Case(AR, 8 * MiB, strategies=RING),
     nodes([2, 2, 2], sharded=True, segments=True), HierarchicalRing(R, (H, R))),
    ("sharded sharing segments: the other channels keep the one-host exchange",
     Case(AR, MiB, strategies=RING), nodes([4] * 4, 1, sharded=True, segments=True),
     HierarchicalRing(R, (H, X, X, X))),
    ("3 nodes sharing segments, barrier", Case(BAR), nodes([1] * 3, segments=True),
     GlobalBarrier(XH)),
    ("5 nodes use the 4-node limit", Case(AR, 128 * KiB), nodes([1] * 5), OutOfPlace(X)),
    ("5 nodes, past the 4-node limit", Case(AR, 128 * KiB + 8, "float64"), nodes([1] * 5),
     OutOfPlace(R)),
    ("9 nodes use the 8-node limit", Case(AR, 32 * KiB), nodes([1] * 9, 4), OutOfPlace(X)),
    ("9 nodes, past the 8-node limit: a tree up to 64 KiB", Case(AR, 32 * KiB + 2, "int16"),
     nodes([1] * 9), OutOfPlace(T)),
    ("9 nodes, exactly 64 KiB: still the tree", Case(AR, 64 * KiB), nodes([1] * 9, 8),
     OutOfPlace(T)),
    ("9 nodes, past 64 KiB: the ring", Case(AR, 64 * KiB + 4), nodes([1] * 9), OutOfPlace(R)),
    ("9 nodes, global tree:3", Case(AR, 32 * KiB, strategies={
        "global_all_reduce_strategy": "tree:3"}), nodes([1] * 9), OutOfPlace(T3)),
    ("2x2 large all_reduce within the exchange", Case(AR, 2 * MiB), nodes([2, 2]),
     ReduceGlobalBroadcast(C, C, 0, X)),
    ("2x2 all_reduce past the exchange", Case(AR, 2 * MiB + 4), nodes([2, 2], 1),
     ReduceGlobalBroadcast(C, C, 0, R)),
    ("2x2 all_reduce past the exchange, global tree:3", Case(AR, 2 * MiB + 4, strategies={
        "global_all_reduce_strategy": "tree:3"}), nodes([2, 2]),
     ReduceGlobalBroadcast(C, C, 0, T3)),
    ("2x2 all_reduce, global centralized", Case(AR, 2 * MiB, strategies={
        "global_all_reduce_strategy": "centralized"}), nodes([2, 2]),
     ReduceGlobalBroadcast(C, C, 0, C)),
    ("2x2 all_reduce: the other global fields do not decide", Case(AR, 4 * MiB, strategies={
        "global_reduce_strategy": "centralized", "global_broadcast_strategy": "tree:3"}),
     nodes([2, 2]), ReduceGlobalBroadcast(C, C, 0, R)),
    ("2x2 all_reduce, local tree / broadcast ring", Case(AR, strategies={
        "local_all_reduce_strategy": "tree", "local_broadcast_strategy": "ring"}),
     nodes([2, 2]), ReduceGlobalBroadcast(T, R, 0, X)),
    ("2x2 large all_reduce, JAX", Case(AR, 4 * MiB, backend="jax"), nodes([2, 2]),
     ReduceGlobalBroadcast(C, C, 0, R)),
    # -- a single local peer: its input is the node's reduction, read in place
    ("1+1 small all_reduce: not inline", Case(AR), nodes([1, 1]), OutOfPlace(X)),
    ("1+1 large all_reduce", Case(AR, 2 * MiB), nodes([1, 1]), OutOfPlace(X)),
    ("1+1 all_reduce past the exchange", Case(AR, 2 * MiB + 4), nodes([1, 1]),
     OutOfPlace(R)),
    ("1+1 small all_reduce, local tree", Case(AR, strategies=_local("tree")), nodes([1, 1]),
     OutOfPlace(X)),
    ("1+1 all_reduce, global centralized", Case(AR, 2 * MiB, strategies={
        **_local("tree"), "global_all_reduce_strategy": "centralized"}), nodes([1, 1]),
     OutOfPlace(C)),
    ("8 nodes of 1, 48 KiB: a tree past the exchange", Case(AR, 48 * KiB, strategies=_local(
        "tree")), nodes([1] * 8), OutOfPlace(T)),
    ("1+2, the single peer's node", Case(AR, 3 * MiB), nodes([1, 2], 0), OutOfPlace(R)),
    ("1+2, the other node", Case(AR, 3 * MiB), nodes([1, 2], 1),
     ReduceGlobalBroadcast(C, C, 0, R)),
    ("sharded, one peer per node", Case(AR, 4 * MiB, strategies=RING),
     nodes([1, 1], sharded=True), OutOfPlace(R)),
    # -- sharded: each shard's path by its own size (the first shard holds one more)
    ("sharded small all_reduce", Case(AR, strategies=RING), nodes([2, 2], sharded=True),
     HierarchicalRing(R, (X, X))),
    ("sharded, shards straddle the limit", Case(AR, 4 * MiB + 4, strategies=RING),
     nodes([2, 2], sharded=True), HierarchicalRing(R, (R, X))),
    ("sharded, 3 shards past the limit", Case(AR, 7 * MiB, strategies=RING),
     nodes([3, 3], 1, sharded=True), HierarchicalRing(R, (R, R, R))),
    ("sharded, global ring", Case(AR, strategies={**RING, **GLOBAL_RING}),
     nodes([2, 2], sharded=True), HierarchicalRing(R, (R, R))),
    ("sharded, global tree:3", Case(AR, 8 * MiB, strategies={
        **RING, "global_all_reduce_strategy": "tree:3"}), nodes([2, 2], sharded=True),
     HierarchicalRing(R, (T3, T3))),
    ("8 nodes sharded, shards straddle the 8-node limit", Case(AR, 64 * KiB + 4,
                                                               strategies=RING),
     nodes([2] * 8, sharded=True), HierarchicalRing(R, (T, X))),
    ("8 nodes sharded, shards straddle 64 KiB", Case(AR, 128 * KiB + 4, strategies=RING),
     nodes([2] * 8, 3, sharded=True), HierarchicalRing(R, (R, T))),
    # -- several hosts with several node processes on some: past the exchange, auto's
    #    schedules are composed by host, with auto's strategy for as many hosts
    ("2 hosts x 2 nodes, 128 KiB: the exchange", Case(AR, 128 * KiB),
     nodes([1] * 4, hosts=(0, 0, 1, 1)), OutOfPlace(X)),
    ("2 hosts x 2 nodes, past the exchange: the ring by host", Case(AR, 128 * KiB + 4),
     nodes([1] * 4, 2, hosts=(0, 0, 1, 1)), OutOfPlace(ByHost((0, 0, 1, 1), R))),
    ("interleaved hosts: by host", Case(AR, MiB), nodes([1] * 4, hosts=(0, 1, 0, 1)),
     OutOfPlace(ByHost((0, 1, 0, 1), R))),
    ("9 nodes on 3 hosts, 48 KiB: a tree among the hosts", Case(AR, 48 * KiB),
     nodes([1] * 9, hosts=(0, 0, 0, 1, 1, 1, 2, 2, 2)),
     OutOfPlace(ByHost((0, 0, 0, 1, 1, 1, 2, 2, 2), T))),
    ("2 hosts x 2 nodes, global ring: the flat ring", Case(AR, MiB, strategies=GLOBAL_RING),
     nodes([1] * 4, hosts=(0, 0, 1, 1)), OutOfPlace(R)),
    ("a host per node: the flat ring", Case(AR, MiB), nodes([1] * 4, hosts=(0, 1, 2, 3)),
     OutOfPlace(R)),
    ("one host: no composition", Case(AR, MiB), nodes([1] * 4, one_host=True,
                                                      hosts=(0, 0, 0, 0)), OutOfPlace(R)),
    ("2 hosts x 2 nodes of 2 peers, past the exchange", Case(AR, 4 * MiB),
     nodes([2] * 4, 1, hosts=(0, 0, 1, 1)),
     ReduceGlobalBroadcast(C, C, 0, ByHost((0, 0, 1, 1), R))),
    ("2 hosts, sharded: each shard by host", Case(AR, 4 * MiB, strategies=RING),
     nodes([2] * 4, sharded=True, hosts=(0, 0, 1, 1)),
     HierarchicalRing(R, (ByHost((0, 0, 1, 1), R),) * 2)),
    ("2 hosts, reduce", Case(RED, MiB, root=3), nodes([1] * 4, hosts=(0, 0, 1, 1)),
     GlobalReduce(C, 0, 3, ByHost((0, 0, 1, 1), R))),
    ("2 hosts, broadcast", Case(BC, MiB, root=0), nodes([1] * 4, hosts=(0, 0, 1, 1)),
     GlobalBroadcast(C, 0, 0, ByHost((0, 0, 1, 1), T))),
    ("2 hosts, barrier: the exchange", Case(BAR), nodes([1] * 4, hosts=(0, 0, 1, 1)),
     GlobalBarrier(X)),
    # -- other operations across nodes (never inline, never exchanged): their own global field;
    #    a reduce and a reduce-scatter by the node's whole array, the others by 0 bytes
    ("2x2 small reduce, root here", Case(RED, root=1), nodes([2, 2]),
     GlobalReduce(C, 1, 0, T)),
    ("2x2 reduce, root elsewhere", Case(RED, 2 * MiB, root=3), nodes([2, 2]),
     GlobalReduce(C, 0, 1, R)),
    ("2x2 reduce of exactly 64 KiB", Case(RED, 64 * KiB, root=0), nodes([2, 2]),
     GlobalReduce(C, 0, 0, T)),
    ("2x2 reduce past 64 KiB", Case(RED, 64 * KiB + 4, root=0), nodes([2, 2]),
     GlobalReduce(C, 0, 0, R)),
    ("2x2 reduce on node 1, root 3", Case(RED, root=3, strategies=RING), nodes([2, 2], 1),
     GlobalReduce(R, 1, 1, T)),
    ("2x2 reduce: its own global field decides", Case(RED, 2 * MiB, root=0, strategies={
        "global_all_reduce_strategy": "centralized", "global_reduce_strategy": "tree:3"}),
     nodes([2, 2]), GlobalReduce(C, 0, 0, T3)),
    ("2x2 reduce: not the all-reduce field", Case(RED, root=0, strategies=GLOBAL_RING),
     nodes([2, 2]), GlobalReduce(C, 0, 0, T)),
    ("sharded reduce", Case(RED, root=0, strategies=RING), nodes([2, 2], sharded=True),
     GlobalReduce(R, 0, 0, T)),
    ("2x2 small broadcast, root here", Case(BC, root=1), nodes([2, 2]),
     GlobalBroadcast(C, 1, 0, T)),
    ("2x2 broadcast, root elsewhere", Case(BC, root=2, strategies=RING), nodes([2, 2]),
     GlobalBroadcast(R, 0, 1, T)),
    ("2x2 large broadcast: a tree whatever its size", Case(BC, 4 * MiB, root=0),
     nodes([2, 2]), GlobalBroadcast(C, 0, 0, T)),
    ("2x2 broadcast, global centralized", Case(BC, root=0, strategies={
        "global_broadcast_strategy": "centralized", "global_all_reduce_strategy": "ring"}),
     nodes([2, 2], 1), GlobalBroadcast(C, 0, 0, C)),
    ("2x2 small reduce_scatter", Case(RS, rows=(4, 4)), nodes([2, 2]),
     GlobalReduceScatter(C, 0, T)),
    ("2x2 reduce_scatter of exactly 64 KiB", Case(RS, 32 * KiB, rows=(2, 2)), nodes([2, 2]),
     GlobalReduceScatter(C, 0, T)),
    ("2x2 reduce_scatter past 64 KiB", Case(RS, 32 * KiB + 4, rows=(2, 2)), nodes([2, 2]),
     GlobalReduceScatter(C, 0, R)),
    ("2x2 reduce_scatter, the all-reduce field", Case(RS, rows=(4, 4), strategies={
        "global_all_reduce_strategy": "tree:3", "global_reduce_strategy": "ring"}),
     nodes([2, 2]), GlobalReduceScatter(C, 0, T3)),
    ("sharded reduce_scatter", Case(RS, rows=(4, 4), strategies=RING),
     nodes([2, 2], sharded=True), GlobalReduceScatter(R, 0, T)),
    ("2x2 small all_gather: the broadcast field", Case(AG, rows=(1, 2), strategies={
        "local_all_reduce_strategy": "ring"}), nodes([2, 2]), GlobalAllGather(C, T)),
    ("2x2 all_gather, local broadcast tree", Case(AG, rows=(1, 2), strategies={
        "local_broadcast_strategy": "tree"}), nodes([2, 2]), GlobalAllGather(T, T)),
    ("2x2 large all_gather: a tree whatever its size", Case(AG, 2 * MiB, rows=(2, 2)),
     nodes([2, 2]), GlobalAllGather(C, T)),
    ("2x2 all_gather, global ring: the all-reduce field", Case(AG, rows=(1, 2), strategies={
        **GLOBAL_RING, "global_broadcast_strategy": "centralized"}), nodes([2, 2]),
     GlobalAllGather(C, R)),
    ("2x2 barrier", Case(BAR), nodes([2, 2]), GlobalBarrier(X)),
    ("9 nodes barrier", Case(BAR), nodes([1] * 9), GlobalBarrier(X)),
    ("1+1 barrier, global ring", Case(BAR, strategies=GLOBAL_RING), nodes([1, 1]),
     GlobalBarrier(R)),
    ("3 nodes barrier, global tree", Case(BAR, strategies={
        "global_all_reduce_strategy": "tree"}), nodes([2, 1, 2], 2), GlobalBarrier(T)),
    ("2x2 barrier, global tree:3", Case(BAR, strategies={
        "global_all_reduce_strategy": "tree:3", "global_broadcast_strategy": "ring"}),
     nodes([2, 2]), GlobalBarrier(T3)),
    # -- the whole route (derived by hand from the rules, not by calling choose): the medium
    #    of an exchange is the host mail (host memory with its mail, channel 0, a payload of
    #    at most MAIL_BYTES = 512 KiB), else the lanes (lanes, channel 0), else the member
    #    connections; the host reduction needs host memory, 3+ nodes, channel 0, global auto,
    #    no compression and at most MOST_PIECES pieces of PIECE_BYTES = 32 MiB
    ("route: 4 nodes with lanes, 8 B", Case(AR, 8), nodes([1] * 4, lanes=True),
     OutOfPlace(XL)),
    ("route: 4 nodes with lanes, 128 KiB", Case(AR, 128 * KiB), nodes([1] * 4, 1, lanes=True),
     OutOfPlace(XL)),
    ("route: 4 nodes with lanes, past 128 KiB", Case(AR, 128 * KiB + 4),
     nodes([1] * 4, lanes=True), OutOfPlace(R)),
    ("route: 4 nodes without lanes, 8 B", Case(AR, 8), nodes([1] * 4), OutOfPlace(X)),
    ("route: 4 nodes of one host whose set-up failed: the lanes to 512 KiB",
     Case(AR, 512 * KiB), nodes([1] * 4, one_host=True, lanes=True), OutOfPlace(XL)),
    ("route: 4 nodes of one host whose set-up failed, past 512 KiB: the ring",
     Case(AR, 512 * KiB + 4), nodes([1] * 4, 2, one_host=True, lanes=True), OutOfPlace(R)),
    ("route: host memory, 8 B in the mail", Case(AR, 8), nodes([1] * 4, 3, segments=True),
     OutOfPlace(XH)),
    ("route: host memory without its mail (no ordered stores): the lanes", Case(AR, 8),
     nodes([1] * 4, segments=True, mail=False), OutOfPlace(XL)),
    ("route: host memory without its mail, past 64 KiB: the host reduction",
     Case(AR, 64 * KiB + 4), nodes([1] * 4, segments=True, mail=False), OutOfPlace(H)),
    ("route: 2 nodes of one host, exactly 512 KiB in the mail", Case(AR, 512 * KiB),
     nodes([1, 1], segments=True), OutOfPlace(XH)),
    ("route: 2 nodes of one host, past 512 KiB: the host reduction", Case(AR, 512 * KiB + 4),
     nodes([1, 1], 1, segments=True), OutOfPlace(H)),
    ("route: a mean of integers in the mail (the sum travels in its dtype)",
     Case(AR, 512 * KiB, "int32", ReduceOp.MEAN), nodes([1, 1], segments=True),
     OutOfPlace(XH)),
    ("route: 2x2 with lanes, small: inline, on the lanes", Case(AR), nodes([2, 2], lanes=True),
     Inline(XL)),
    ("route: 2x2 of one host, 2 MiB: reduced, then the host reduction", Case(AR, 2 * MiB),
     nodes([2, 2], segments=True), ReduceGlobalBroadcast(C, C, 0, H)),
    ("route: exactly MOST_PIECES pieces: the host reduction",
     Case(AR, MOST_PIECES * PIECE_BYTES), nodes([1] * 3, segments=True), OutOfPlace(H)),
    ("route: more pieces than a round number holds: the ring",
     Case(AR, MOST_PIECES * PIECE_BYTES + 4), nodes([1] * 3, segments=True), OutOfPlace(R)),
    # -- compressed: never an exchange nor the host reduction (its wire format is the walk's)
    ("route: compressed 16 B with host memory: the tree", Case(AR, 16, compression="bf16"),
     nodes([1] * 4, segments=True), OutOfPlace(T)),
    ("route: compressed 16 B with lanes: the tree", Case(AR, 16, compression="fp16"),
     nodes([1] * 4, lanes=True), OutOfPlace(T)),
    ("route: compressed, 2x2 inline: the tree", Case(AR, 16, compression="bf16"),
     nodes([2, 2], lanes=True), Inline(T)),
    ("route: compressed and sharded: every channel's schedule",
     Case(AR, 256 * KiB, compression="bf16", strategies=RING),
     nodes([2, 2, 2], sharded=True, segments=True), HierarchicalRing(R, (R, R))),
    # -- channels >= 1: never the lanes nor the mail (they have one user: channel 0)
    ("route: sharded with lanes, small: channel 1 on the connections",
     Case(AR, strategies=RING), nodes([2, 2], sharded=True, lanes=True),
     HierarchicalRing(R, (XL, X))),
    ("route: sharded with host memory, small: the mail, then the connections",
     Case(AR, strategies=RING), nodes([2, 2, 2], sharded=True, segments=True),
     HierarchicalRing(R, (XH, X))),
    ("route: sharded with host memory, 4 shards of 128 KiB",
     Case(AR, 512 * KiB, strategies=RING), nodes([4] * 4, 2, sharded=True, segments=True),
     HierarchicalRing(R, (H, X, X, X))),
    ("route: sharded without lanes: the connections everywhere", Case(AR, strategies=RING),
     nodes([3, 3], sharded=True), HierarchicalRing(R, (X, X, X))),
    # -- a barrier: a 0-byte exchange on the medium, or the configured schedule
    ("route: barrier with host memory: the mail", Case(BAR), nodes([1, 1], segments=True),
     GlobalBarrier(XH)),
    ("route: barrier with host memory without its mail: the lanes", Case(BAR),
     nodes([1] * 3, segments=True, mail=False), GlobalBarrier(XL)),
    ("route: barrier with lanes", Case(BAR), nodes([2, 2], lanes=True), GlobalBarrier(XL)),
    ("route: barrier with host memory, global ring", Case(BAR, strategies=GLOBAL_RING),
     nodes([1] * 3, segments=True), GlobalBarrier(R)),
    # -- many nodes (issue 32): from DOUBLING_NODES = 16 (44 of one host) the small all-reduces
    #    and the barriers take the recursive doubling instead of the exchange and the tree, up
    #    to DOUBLING_BYTES = 64 KiB (the exchange's limit where the host reduction follows)
    ("route: 8 nodes, 8 B: still the exchange", Case(AR, 8), nodes([1] * 8, lanes=True),
     OutOfPlace(XL)),
    ("route: 16 nodes, 8 B: the doubling", Case(AR, 8), nodes([1] * 16, 5, lanes=True),
     OutOfPlace(D)),
    ("route: 16 nodes, 64 KiB: the doubling", Case(AR, 64 * KiB), nodes([1] * 16),
     OutOfPlace(D)),
    ("route: 16 nodes, past 64 KiB: the ring", Case(AR, 64 * KiB + 4), nodes([1] * 16),
     OutOfPlace(R)),
    ("route: 8 nodes of one host, 8 B: the exchange in the mail", Case(AR, 8),
     nodes([1] * 8, segments=True), OutOfPlace(XH)),
    ("route: 15 nodes of one host, 8 B: the exchange in the mail", Case(AR, 8),
     nodes([1] * 15, segments=True), OutOfPlace(XH)),
    ("route: 16 nodes of one host, 8 B: the host gather", Case(AR, 8),
     nodes([1] * 16, segments=True), OutOfPlace(G)),
    ("route: 16 nodes of one host without the mail, 8 B: the lanes", Case(AR, 8),
     nodes([1] * 16, segments=True, mail=False), OutOfPlace(XL)),
    ("route: 511 nodes of one host, 8 B: still the host gather", Case(AR, 8),
     nodes([1] * 511, segments=True), OutOfPlace(G)),
    ("route: 512 nodes of one host, 8 B: the host gather", Case(AR, 8),
     nodes([1] * 512, 43, segments=True), OutOfPlace(G)),
    ("route: 512 nodes of one host without the mail, 8 B: the doubling", Case(AR, 8),
     nodes([1] * 512, 43, segments=True, mail=False), OutOfPlace(D)),
    ("route: 64 nodes of one host, 32 KiB: the host gather", Case(AR, 32 * KiB),
     nodes([1] * 64, segments=True), OutOfPlace(G)),
    ("route: 64 nodes of one host, past 32 KiB: the host reduction", Case(AR, 32 * KiB + 4),
     nodes([1] * 64, segments=True), OutOfPlace(H)),
    ("route: 16 nodes, 2 peers each, small: inline, then the doubling", Case(AR),
     nodes([2] * 16), Inline(D)),
    ("route: 16 nodes, compressed: the tree", Case(AR, 16, compression="bf16"),
     nodes([1] * 16), OutOfPlace(T)),
    ("route: barrier of 16 nodes: the doubling", Case(BAR), nodes([1] * 16, lanes=True),
     GlobalBarrier(D)),
    ("route: barrier of 15 nodes of one host: the mail", Case(BAR),
     nodes([1] * 15, segments=True), GlobalBarrier(XH)),
    ("route: barrier of 16 nodes of one host: the host gather", Case(BAR),
     nodes([1] * 16, segments=True), GlobalBarrier(G)),
    ("route: barrier of 64 nodes of one host: the host gather", Case(BAR),
     nodes([1] * 64, segments=True), GlobalBarrier(G)),
    ("route: barrier of 512 nodes of one host: the host gather", Case(BAR),
     nodes([1] * 512, segments=True), GlobalBarrier(G)),
    ("route: barrier of 512 nodes of one host without the mail: the doubling", Case(BAR),
     nodes([1] * 512, segments=True, mail=False), GlobalBarrier(D)),
    ("route: configured, 2 nodes, 8 B", Case(AR, 8, strategies=GLOBAL_DOUBLING),
     nodes([1, 1], lanes=True), OutOfPlace(D)),
]


def test_a_compressed_all_reduce_refuses_a_configured_doubling() -> None:
    case, world = Case(AR, 16, compression="bf16", strategies=GLOBAL_DOUBLING), nodes([1] * 4)
    with pytest.raises(burncoll.UsageError, match=r"compressed.*'doubling'.*'tree'"):
        choose(case.calls(world), world, _backend("numpy"), case.config())


def _backend(name: str) -> Backend:
    if name != "numpy":
        pytest.importorskip(name)
    return get_backend(name)


@pytest.mark.parametrize(("case", "world", "expected"), [c[1:] for c in CASES],
                         ids=[c[0] for c in CASES])
def test_the_decision_picks_the_plan(case: Case, world: World, expected: OpPlan) -> None:
    calls = case.calls(world)
    if case.backend != "numpy":
        calls = [_on(_backend(case.backend), c) for c in calls]
    assert choose(calls, world, _backend(case.backend), case.config()) == expected


def test_the_plan_cache_never_joins_calls_the_decision_tells_apart() -> None:
    """``prepare`` keeps each node's plans by ``plan_key`` (the node's world, backend and
    config never change): two calls on one node that ``choose`` plans differently must never
    share a key. Every case above, grouped by node, checks it."""
    planned: dict[tuple[object, ...], tuple[str, OpPlan]] = {}
    for name, case, world, expected in CASES:
        if case.backend != "numpy":
            continue
        node = (repr(world), case.backend, repr(sorted(case.strategies.items())))
        key = (*node, plan_key(case.calls(world)))
        if key in planned:
            other, plan = planned[key]
            assert plan == expected, f"{name!r} would take the cached plan of {other!r}"
        planned[key] = (name, expected)
    keys_per_node = Counter(key[:3] for key in planned)
    assert max(keys_per_node.values()) > 1  # the cases do share nodes


def _on(backend: Backend, call: Call) -> Call:
    array: Any = None if call.array is None else backend.from_host(
        np.zeros(call.array.shape, call.array.dtype).reshape(-1), call.dtype or "float32",
        call.shape or (), backend.devices(1)[0])
    return Call(call.peer_id, call.kind, call.reduce_op, call.root, array, call.dtype,
                call.shape)


def test_an_all_gather_of_scalars_is_refused_unless_inline() -> None:
    world = one_node(2)
    scalar = [Call(p, AG, None, None, np.float32(1), "float32", ()) for p in world.peer_ids]
    assert choose(scalar, world, _backend("numpy"), burncoll.CollectiveConfig()) == Inline()
    for config, where in ((burncoll.CollectiveConfig(**RING), world),
                          (burncoll.CollectiveConfig(), nodes([2, 2]))):
        with pytest.raises(burncoll.UsageError, match="at least one dimension"):
            choose(scalar, where, _backend("numpy"), config)


def test_the_hosts_of_a_session_are_known_only_when_every_node_announced_one() -> None:
    """``NodeLink.hosts``: numbered in node order from the table's host ids; with one node
    whose host is unknown (``shared_memory: false``), nothing is composed by host."""
    a, b = "a" * 32, "b" * 32
    table = [NodeInfo(i, "10.0.0.1", 1000 + i, (i,), host_id=h)
             for i, h in enumerate([b, b, a, b, a])]
    assert number_hosts(table) == (0, 0, 1, 0, 1)
    assert number_hosts([*table[:4], NodeInfo(4, "10.0.0.2", 9, (4,))]) == ()
    case = Case(AR, MiB)
    unknown = nodes([1] * 4)  # hosts=()
    assert choose(case.calls(unknown), unknown, get_backend("numpy"), case.config()) == (
        OutOfPlace(R))
