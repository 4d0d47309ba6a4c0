"""``Auto``: pick Centralized, Tree or Ring per operation from the array size and the world.

The choice is data (:data:`CROSSOVERS`), measured with ``burncoll bench`` on a 2-core machine
(see the README's crossover table); re-measure on other hardware. At the local level ``auto``
also runs small operations *inline*: the last peer to arrive computes every peer's result in
one pass (a centralized reduction without the thread barriers of a schedule).

These are the thresholds; the one place that applies them to an operation (inline, fused,
the exchange and its medium, the host reduction, and the strategies of its local and global
phases) is :func:`burncoll.local.plans.choose.choose`.
"""

from __future__ import annotations

from dataclasses import dataclass

from burncoll.strategies.base import Strategy
from burncoll.strategies.centralized import Centralized
from burncoll.strategies.ring import Ring
from burncoll.strategies.schedule import Schedule
from burncoll.strategies.tree import Tree

__all__ = ["CROSSOVERS", "DOUBLING_BYTES", "DOUBLING_NODES", "DOUBLING_NODES_ONE_HOST",
           "EXCHANGE_BYTES", "EXCHANGE_BYTES_ONE_HOST", "EXCHANGE_BYTES_SEGMENTS", "GATHER_NODES",
           "INLINE_BYTES", "MAIL_BYTES", "MOST_PIECES", "PIECE_BYTES", "SEGMENT_NODES", "Auto",
           "doubling_limit", "exchange_limit", "resolve"]

#: Local operations of at most this many bytes run inline in one thread under ``auto``.
INLINE_BYTES = 1 << 20

#: Global all-reduces of at most this many bytes (per node) run as a one-round exchange under
#: ``auto``: every node sends its array to every other node and reduces all of them itself
#: (:mod:`burncoll.node.exchange`). Indexed by the number of nodes; larger worlds use the last.
EXCHANGE_BYTES: dict[int, int] = {2: 2 << 20, 3: 256 << 10, 4: 128 << 10, 8: 32 << 10}
#: The same when every node runs on one host (their large messages go through shared memory,
#: where sending the whole array to every node costs copies, not link time): 4 node processes
#: of one host exchanged 256-512 KiB in 0.6-0.9x the ring's time (docs/performance.md).
EXCHANGE_BYTES_ONE_HOST: dict[int, int] = {**EXCHANGE_BYTES, 4: 512 << 10}
#: Past the exchange, node processes of one host all-reduce through their shared memory from
#: this many nodes (``levels.HostReduce``): between 2 of them, 1-4 MiB took 0.25-0.45x the
#: time of the exchange on the lanes and 8-64 MiB 0.7-0.85x the ring's (docs/performance.md).
SEGMENT_NODES = 2
#: The exchange's limits where the host reduction takes over past it: it costs a copy in, a
#: copy out and two rounds of empty messages, and beats the exchange from 256 KiB among 3
#: node processes and from 128 KiB among 4 (CPU per operation, docs/performance.md); between
#: 2, past the host mail's :data:`MAIL_BYTES`.
EXCHANGE_BYTES_SEGMENTS: dict[int, int] = {**EXCHANGE_BYTES, 2: 512 << 10, 3: 128 << 10,
                                           4: 64 << 10}
#: The largest piece of an array that the host reduction moves at once (its data slot's
#: size): two rounds of messages per piece, so larger pieces wait less (4 node processes,
#: 256 MiB: ~400 ms against ~420 with 8 MiB; docs/performance.md), for 48 MiB of shared memory
#: a node.
PIECE_BYTES = 32 << 20
#: The most pieces of one host reduction: piece ``p`` takes rounds ``3 + 2p`` and ``4 + 2p``
#: of a u16 (1 and 2 were the set-up's); a larger array takes the strategy.
MOST_PIECES = (2**16 - 1 - 3) // 2
#: The largest payload an exchange sends through the host mail (a slot holds it and the
#: longest header): the largest exchange of one host's node processes that share their
#: host memory (larger ones take the host reduction).
MAIL_BYTES = 512 << 10


def exchange_limit(world: int, one_host: bool = False, host_reduce: bool = False) -> int:
    """The largest all-reduce (bytes per node) that ``auto`` exchanges among ``world`` nodes
    (``one_host``: all of them on one host, sharing memory; ``host_reduce``: and their host
    reduction takes over past it, from :data:`SEGMENT_NODES` nodes)."""
    table = EXCHANGE_BYTES_ONE_HOST if one_host else EXCHANGE_BYTES
    if one_host and host_reduce and world >= SEGMENT_NODES:
        table = EXCHANGE_BYTES_SEGMENTS
    fitting = [limit for w, limit in table.items() if w <= world]
    return fitting[-1] if fitting else 0


#: From this many node processes of one host, ``auto``'s exchanges in the host mail (small
#: all-reduces and barriers) take the host gather instead (``levels.HostGather``: node 0 reads
#: every node's message and posts the result, ``2 (N - 1)`` messages read in all against the
#: exchange's ``N (N - 1)``): on a host of few cores, the exchange's reads are most of its
#: work as N grows. Measured on 2 cores (``benchmarks/scale.py``, 8 B, alternated, medians of
#: 3): 16 node processes 1.30 against 1.70 ms, 32 2.71 against 4.10, 64 9.7 against 16.9; at
#: 8 a tie, at 3-4 the exchange's one round well ahead (docs/scale.md).
GATHER_NODES = 16
#: From this many nodes, ``auto``'s small all-reduces and its barriers take the recursive
#: doubling (:class:`~burncoll.strategies.doubling.Doubling`: ``log2 N`` rounds of one message
#: in and one out a node) instead of the one-round exchange (``N - 1`` each way) and the tree:
#: where the cost model, calibrated on loopback, puts the crossover with one node per host
#: (docs/scale.md: the exchange stays faster at 8 nodes, the doubling from 16 -- from 32 in
#: one of two runs).
DOUBLING_NODES = 16
#: The same among the node processes of one host, whose exchange goes through the host mail
#: and whose nodes share the host's cores, so each of the doubling's rounds waits for a
#: partner to be scheduled: at 64 node processes of one 2-core host the exchange took 11.9 ms
#: for 8 B against the doubling's 56-63 ms (``benchmarks/scale.py``, alternated). Their work,
#: ``N (N - 1)`` messages against about ``N log2 N``, would close that 5x gap near 512 nodes
#: (an extrapolation: nothing past 64 was measured; docs/scale.md). Where the host mail serves,
#: the host gather comes first (:data:`GATHER_NODES`): this counts only without it.
DOUBLING_NODES_ONE_HOST = 512
#: The largest all-reduce (bytes per node) that takes the doubling past its number of nodes,
#: where no host reduction takes over sooner: the tree's limit (the model puts the doubling
#: ahead of the tree at every size, and of the ring up to ~1 MiB at 16 nodes).
DOUBLING_BYTES = 64 << 10


def doubling_limit(world: int, one_host: bool = False, host_reduce: bool = False) -> int:
    """The largest all-reduce (bytes per node) that ``auto`` runs as the recursive doubling
    among ``world`` nodes (0 for none; arguments as :func:`exchange_limit`'s): past it, the
    host reduction where it serves, else the tree or the ring."""
    if world < (DOUBLING_NODES_ONE_HOST if one_host else DOUBLING_NODES):
        return 0
    return exchange_limit(world, one_host, host_reduce) if host_reduce else DOUBLING_BYTES

#: level -> ((largest size in bytes, strategy), ...): the first row whose size is >= the
#: operation's wins; the last row has no limit.
CROSSOVERS: dict[str, tuple[tuple[int | None, Strategy], ...]] = {
    # On 2 cores the threads of a schedule cannot run in parallel for long, and one
    # reduction pass at the root beats the ring's 2(N-1) barrier rounds at every size.
    "local": ((None, Centralized()),),
    "global": ((64 << 10, Tree(2)), (None, Ring())),
}


@dataclass(frozen=True)
class Auto(Strategy):
    """Chooses per operation; as a plain schedule source it behaves as Ring (all-reduce,
    reduce-scatter, all-gather) and Tree(2) (reduce, broadcast)."""

    @property
    def spec(self) -> str:
        return "auto"

    def choose(self, level: str, nbytes: int, world: int) -> Strategy:
        """The concrete strategy for an operation of ``nbytes`` among ``world`` participants."""
        return next(strategy for limit, strategy in CROSSOVERS[level]  # the last row: no limit
                    if limit is None or nbytes <= limit)

    def reduce(self, world: int, root: int) -> Schedule:
        return Tree(2).reduce(world, root)

    def broadcast(self, world: int, root: int) -> Schedule:
        return Tree(2).broadcast(world, root)

    def all_reduce(self, world: int) -> Schedule:
        return Ring().all_reduce(world)

    def reduce_scatter(self, world: int, owners: tuple[int, ...]) -> Schedule:
        return Ring().reduce_scatter(world, owners)

    def all_gather(self, world: int, owners: tuple[int, ...]) -> Schedule:
        return Ring().all_gather(world, owners)


def resolve(strategy: Strategy, level: str, nbytes: int, world: int) -> Strategy:
    """``strategy`` itself, or what :class:`Auto` picks for this operation."""
    if isinstance(strategy, Auto):
        return strategy.choose(level, nbytes, world)
    return strategy
