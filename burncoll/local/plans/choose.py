"""The one decision of an operation's path: :func:`choose` returns its typed plan.

Every choice that depends on the operation, the world or the backend is made here, once, in
the last peer to arrive, before any data moves: ``auto``'s inline and fused paths at the local
level (:data:`~burncoll.strategies.auto.INLINE_BYTES`), the composition with the other nodes
(sharded, reduce -> global -> broadcast, a single local peer), each local phase's strategy,
and each global part's whole route (:data:`~burncoll.levels.Route`): whether a global
all-reduce or barrier runs as the one-round exchange
(:func:`~burncoll.strategies.auto.exchange_limit`) and on which medium (the host mail up to
:data:`~burncoll.strategies.auto.MAIL_BYTES` on channel 0 -- its host gather from
:data:`~burncoll.strategies.auto.GATHER_NODES` node processes --, else the lanes on channel
0, else the member connections), as the recursive doubling among many nodes
(:func:`~burncoll.strategies.auto.doubling_limit`), as the host reduction, or otherwise which
strategy's schedule (``auto``'s tree or ring by size). Its inputs are the call and the
capabilities every node agreed at join (:class:`~burncoll.local.world.World`), so every node
computes the same route; the node then only executes it.

The plan kinds, by when they are chosen (first match):

- :class:`Inline` -- ``auto`` and at most ``INLINE_BYTES``: on one node any operation but a
  barrier, across nodes an all-reduce of a node with several local peers.
- :class:`Fused` -- a one-node all-reduce of host arrays (NumPy, torch CPU tensors) under
  ``auto``, 2+ local peers, not the mean of integers.
- :class:`LocalBarrier` / :class:`GlobalBarrier` -- a barrier on one node / across nodes.
- :class:`LocalSchedule` -- any other operation on one node.
- :class:`OutOfPlace` -- an all-reduce across nodes of a node with a single local peer (of
  any size: its array is the node's reduction already, and goes out as it is).
- :class:`HierarchicalRing` -- an all-reduce across nodes that all run a local ring over as
  many devices (sharded).
- :class:`ReduceGlobalBroadcast` -- any other all-reduce across nodes.
- :class:`GlobalReduce`, :class:`GlobalReduceScatter`, :class:`GlobalBroadcast`,
  :class:`GlobalAllGather` -- those operations across nodes.

Before all of these, whatever the strategies: :class:`Personal` -- gather, scatter, all-to-all,
scan and exscan, and a reduce-scatter given explicit counts, on one node or across nodes
(direct schedules: each block straight to the node that needs it).
"""

from __future__ import annotations

import math
import operator
from collections.abc import Sequence

from burncoll.backends.base import Backend
from burncoll.backends.numpy import host_memory
from burncoll.config import CollectiveConfig
from burncoll.dtypes import ITEMSIZES, dtype_from_name, is_inexact
from burncoll.errors import UsageError
from burncoll.levels import Exchange, HostGather, HostReduce, Medium, Route
from burncoll.local.calls import ARGUMENTS, Call
from burncoll.local.plans.across_nodes import (
    GlobalAllGather,
    GlobalBarrier,
    GlobalBroadcast,
    GlobalReduce,
    GlobalReduceScatter,
    ReduceGlobalBroadcast,
)
from burncoll.local.plans.barrier import LocalBarrier
from burncoll.local.plans.fused import Fused
from burncoll.local.plans.hierarchical_ring import HierarchicalRing
from burncoll.local.plans.inline import Inline
from burncoll.local.plans.out_of_place import OutOfPlace
from burncoll.local.plans.personal import PERSONAL_KINDS, Personal
from burncoll.local.plans.scheduled import LocalSchedule
from burncoll.local.rendezvous import OpState, Prepared, Rendezvous
from burncoll.local.world import World
from burncoll.ops import OpKind, ReduceOp
from burncoll.strategies import Auto, Strategy, resolve
from burncoll.strategies.auto import (
    GATHER_NODES,
    INLINE_BYTES,
    MAIL_BYTES,
    MOST_PIECES,
    PIECE_BYTES,
    SEGMENT_NODES,
    doubling_limit,
    exchange_limit,
)
from burncoll.strategies.by_host import ByHost
from burncoll.strategies.doubling import Doubling
from burncoll.strategies.layout import even_layout

__all__ = ["OpPlan", "choose", "plan_key", "prepare"]

OpPlan = (
    Inline | Fused | LocalBarrier | LocalSchedule | GlobalBarrier | OutOfPlace
    | HierarchicalRing | ReduceGlobalBroadcast | GlobalReduce | GlobalReduceScatter
    | GlobalBroadcast | GlobalAllGather | Personal
)

#: The config field of each operation's local strategy (a barrier has none).
_LOCAL_FIELD = {
    OpKind.ALL_REDUCE: "local_all_reduce_strategy",
    OpKind.REDUCE_SCATTER: "local_all_reduce_strategy",
    OpKind.ALL_GATHER: "local_all_reduce_strategy",
    OpKind.REDUCE: "local_reduce_strategy",
    OpKind.BROADCAST: "local_broadcast_strategy",
}

#: The config field of each operation's global strategy.
_GLOBAL_FIELD = {
    OpKind.ALL_REDUCE: "global_all_reduce_strategy",
    OpKind.REDUCE_SCATTER: "global_all_reduce_strategy",
    OpKind.ALL_GATHER: "global_all_reduce_strategy",
    OpKind.REDUCE: "global_reduce_strategy",
    OpKind.BROADCAST: "global_broadcast_strategy",
}


#: Plans kept per node (past that, the cache starts over).
_PLANS_KEPT = 64


def prepare(rv: Rendezvous, state: OpState) -> Prepared:
    """Choose the plan of ``state``'s operation and prepare it (in the last peer to arrive).

    A training loop repeats a few operations: the plan of a signature already seen on this
    node is taken from ``rv.plans`` (the world, backend and config never change there)."""
    calls = state.complete_calls()
    key = plan_key(calls)
    plan = rv.plans.get(key)
    if plan is None:
        plan = choose(calls, rv.world, rv.backend, rv.config)
        if len(rv.plans) >= _PLANS_KEPT:
            rv.plans.clear()
        rv.plans[key] = plan
    return plan.prepare(rv, state)


_ARRAY = operator.itemgetter(4)


def plan_key(calls: Sequence[Call]) -> tuple[object, ...]:
    """Everything of ``calls`` that :func:`choose` looks at (their arrays only by type), made
    without a Python call per call."""
    return (tuple(map(ARGUMENTS, calls)), tuple(map(type, map(_ARRAY, calls))))


def choose(calls: Sequence[Call], world: World, backend: Backend,
           config: CollectiveConfig) -> OpPlan:
    """The plan of the operation every one of ``calls`` (one per local peer, matching) asks
    for, on this node of ``world``, with ``backend`` and ``config``'s strategies."""
    call = calls[0]
    if call.kind in PERSONAL_KINDS or call.counts is not None:
        return Personal()
    nbytes = max(_nbytes(c) for c in calls)
    if _inline(call, world, config, nbytes):
        return Inline(_route(config, world, nbytes, call.compression is not None)
                      if world.multi_node else None)
    if _fused(calls, world, backend, config):
        return Fused()
    if call.kind is OpKind.BARRIER:
        if world.multi_node:
            return GlobalBarrier(_barrier_route(config, world))
        return LocalBarrier()
    if call.kind is OpKind.ALL_GATHER and not call.shape:
        raise UsageError("all_gather needs arrays with at least one dimension")
    if not world.multi_node:
        root = _leader(world, call.root) if call.kind in (OpKind.BROADCAST,
                                                          OpKind.REDUCE) else None
        return LocalSchedule(call.kind, _local(config, _LOCAL_FIELD[call.kind], nbytes, world),
                             root)
    return _across_nodes(call, world, config, nbytes)


def _nbytes(call: Call) -> int:
    if call.array is None:
        return 0
    return math.prod(call.shape or ()) * ITEMSIZES[call.dtype or "uint8"]


def _inline(call: Call, world: World, config: CollectiveConfig, nbytes: int) -> bool:
    """``auto`` runs small operations inline; across nodes only the all-reduce."""
    field = _LOCAL_FIELD.get(call.kind)
    if field is None or not isinstance(config.strategy(field), Auto):
        return False
    if world.multi_node and (call.kind is not OpKind.ALL_REDUCE or world.size == 1):
        return False  # one peer: OutOfPlace sends its array as it is, with no local copy
    return nbytes <= INLINE_BYTES


def _fused(calls: Sequence[Call], world: World, backend: Backend,
           config: CollectiveConfig) -> bool:
    """A one-node all-reduce of host arrays under ``auto`` (past the inline size)."""
    call = calls[0]
    if call.kind is not OpKind.ALL_REDUCE or world.multi_node or world.size < 2:
        return False
    if not isinstance(config.strategy("local_all_reduce_strategy"), Auto):
        return False
    if any(host_memory(backend, c.array) is None for c in calls):
        return False  # (NumPy arrays and torch CPU tensors are host memory)
    # MEAN of integers becomes float64: the general path does that conversion
    return call.reduce_op is not ReduceOp.MEAN or is_inexact(dtype_from_name(call.dtype or ""))


def _exchanges(config: CollectiveConfig, world: World, nbytes: int, host_reduce: bool) -> bool:
    """Whether ``auto`` runs a global all-reduce of ``nbytes`` (per node) as an exchange
    (``host_reduce``: the host reduction takes over past it)."""
    return (isinstance(config.strategy("global_all_reduce_strategy"), Auto)
            and world.num_nodes > 1
            and nbytes <= exchange_limit(world.num_nodes, world.one_host, host_reduce))


def _doubles(config: CollectiveConfig, world: World, nbytes: int, host_reduce: bool) -> bool:
    """Whether ``auto`` runs a global all-reduce of ``nbytes`` (per node) as the recursive
    doubling: many nodes, small arrays (:func:`~burncoll.strategies.auto.doubling_limit`)."""
    limit = doubling_limit(world.num_nodes, world.one_host, host_reduce)
    return isinstance(config.strategy("global_all_reduce_strategy"), Auto) and limit > 0 and (
        nbytes <= limit)


def _host_reduces(config: CollectiveConfig, world: World, channel: int) -> bool:
    """Whether ``auto``'s all-reduces past the exchange on ``channel`` go through the host
    memory: channel 0, node processes of one host that mapped it at join."""
    return (world.host_memory and world.num_nodes >= SEGMENT_NODES and channel == 0
            and isinstance(config.strategy("global_all_reduce_strategy"), Auto))


def _medium(world: World, nbytes: int, channel: int) -> Medium:
    """What carries an exchange of ``nbytes`` per node on ``channel``: the host mail where it
    fits, else the lanes (both channel 0 only: they have one user), else the connections."""
    if channel:
        return Medium.CONNECTIONS
    if world.host_mail and nbytes <= MAIL_BYTES:
        return Medium.HOST
    return Medium.LANE if world.lanes else Medium.CONNECTIONS


def _gathers(world: World, nbytes: int, channel: int) -> bool:
    """Whether ``auto``'s exchange of ``nbytes`` per node on ``channel`` is the host gather
    (node 0 reads every node's message, the others its result): in the host mail, among
    :data:`~burncoll.strategies.auto.GATHER_NODES` node processes or more -- at any number of
    them, before the doubling too (fewer messages, and rounds)."""
    return world.num_nodes >= GATHER_NODES and _medium(world, nbytes, channel) is Medium.HOST


def _global(config: CollectiveConfig, kind: OpKind, nbytes: int, world: World) -> Strategy:
    """The global strategy of ``kind`` for ``nbytes`` (``auto`` resolved by that size).

    ``nbytes`` is what the node is handed: the node's whole array for a reduce and a
    reduce-scatter, its array (or shard) for an all-reduce, and 0 for a barrier, a broadcast
    (a receiver does not know the size) and an all-gather. Under ``auto``, when several hosts
    run several node processes (some host more than one), the schedule is composed by host
    (:class:`~burncoll.strategies.by_host.ByHost`): ``auto``'s strategy among the hosts."""
    configured = config.strategy(_GLOBAL_FIELD[kind])
    hosts = len(set(world.hosts))
    if isinstance(configured, Auto) and 1 < hosts < world.num_nodes:
        return ByHost(world.hosts, resolve(configured, "global", nbytes, hosts))
    return resolve(configured, "global", nbytes, world.num_nodes)


def _route(config: CollectiveConfig, world: World, nbytes: int, compressed: bool = False,
           channel: int = 0) -> Route:
    """The exchange on its medium (or its host gather), the host reduction, or the global
    all-reduce schedule's strategy, for ``nbytes`` per node on ``channel``. A compressed
    all-reduce always takes a schedule (its 16-bit wire format is the walk's); the host
    reduction serves ``auto``'s all-reduces past the exchange on channel 0 among the node
    processes of one host (no wire: nothing to compress), of at most :data:`MOST_PIECES`
    pieces."""
    host_reduce = not compressed and _host_reduces(config, world, channel)
    exchanges = not compressed and _exchanges(config, world, nbytes, host_reduce)
    if exchanges and _gathers(world, nbytes, channel):
        return HostGather()
    if not compressed and _doubles(config, world, nbytes, host_reduce):
        return Doubling()
    if exchanges:
        return Exchange(_medium(world, nbytes, channel))
    if host_reduce and -(-nbytes // PIECE_BYTES) <= MOST_PIECES:
        return HostReduce()
    strategy = _global(config, OpKind.ALL_REDUCE, nbytes, world)
    if compressed and strategy.exchanges:
        raise UsageError(
            f"a compressed all-reduce cannot take global_all_reduce_strategy={strategy.spec!r}: "
            "the two nodes of a doubling round would round their 16-bit values apart and end "
            "with different results; configure 'auto', 'tree', 'tree:K', 'ring' or "
            "'centralized', or all-reduce without compression")
    return strategy


def _barrier_route(config: CollectiveConfig, world: World) -> Exchange | HostGather | Strategy:
    """A barrier is a 0-byte all-reduce: under ``auto`` the exchange of empty messages (or
    their host gather), or from :data:`~burncoll.strategies.auto.DOUBLING_NODES` the recursive
    doubling."""
    auto = isinstance(config.strategy("global_all_reduce_strategy"), Auto)
    if auto and _gathers(world, 0, 0):
        return HostGather()
    if _doubles(config, world, 0, False):
        return Doubling()
    if auto:
        return Exchange(_medium(world, 0, 0))
    return _global(config, OpKind.ALL_REDUCE, 0, world)


def _local(config: CollectiveConfig, field: str, nbytes: int, world: World) -> Strategy:
    """The local strategy of ``field`` for this operation (``auto`` resolved by its size)."""
    return resolve(config.strategy(field), "local", nbytes, world.size)


def _leader(world: World, root: int | None) -> int:
    """The local index that talks to other nodes: the root if it is here, else index 0."""
    index = None if root is None else world.local_index(root)
    return 0 if index is None else index


def _root_node(world: World, call: Call) -> int:
    return world.node_of[-1 if call.root is None else call.root]


def _across_nodes(call: Call, world: World, config: CollectiveConfig, nbytes: int) -> OpPlan:
    kind = call.kind
    if kind is OpKind.ALL_REDUCE:
        return _all_reduce_across_nodes(call, world, config, nbytes)
    if kind is OpKind.BROADCAST:
        return GlobalBroadcast(_local(config, "local_broadcast_strategy", nbytes, world),
                               _leader(world, call.root), _root_node(world, call),
                               _global(config, kind, 0, world))
    if kind is OpKind.ALL_GATHER:
        return GlobalAllGather(_local(config, "local_broadcast_strategy", nbytes, world),
                               _global(config, kind, 0, world))
    if kind is OpKind.REDUCE:
        return GlobalReduce(_local(config, "local_reduce_strategy", nbytes, world),
                            _leader(world, call.root), _root_node(world, call),
                            _global(config, kind, nbytes, world))
    return GlobalReduceScatter(_local(config, "local_all_reduce_strategy", nbytes, world), 0,
                               _global(config, kind, nbytes, world))


def _all_reduce_across_nodes(call: Call, world: World, config: CollectiveConfig,
                             nbytes: int) -> OpPlan:
    local = _local(config, "local_all_reduce_strategy", nbytes, world)
    compressed = call.compression is not None
    if world.size == 1:
        return OutOfPlace(_route(config, world, nbytes, compressed))
    if world.sharded:
        itemsize = ITEMSIZES[call.dtype or "uint8"]
        shards = even_layout(math.prod(call.shape or ()), world.size)
        return HierarchicalRing(local, tuple(_route(config, world, (b - a) * itemsize,
                                                    compressed, channel)
                                             for channel, (a, b) in enumerate(shards)))
    return ReduceGlobalBroadcast(local, _local(config, "local_broadcast_strategy", nbytes, world),
                                 0, _route(config, world, nbytes, compressed))
