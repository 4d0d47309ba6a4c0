"""Direct schedules: one round, each block sent straight from the node that holds it to the
node that needs it -- the rooted and personalised collectives across nodes.

A gather, scatter or all-to-all moves *different* data to each destination, so a relay only
adds hops: as MPI's linear ``Gatherv``/``Scatterv`` and pairwise ``Alltoallv``, each node sends
and receives exactly its bytes in one round. A ``scan`` sends each rank's array to every node
holding a later rank, which reduces in rank order itself. A reduce-scatter with counts sends
each rank of another node one block, the node's local ranks' blocks already reduced, under the
chunk of the node's first rank. Chunks are indexed by rank, or by ``src * ranks + dst``
(all-to-all); ``owners[r]`` is the node of rank ``r``. Pure and stdlib-only.
"""

from __future__ import annotations

import functools

from burncoll.strategies._checks import check_owners, check_root, drop_empty
from burncoll.strategies.schedule import Action, Round, Schedule, Step

__all__ = ["all_to_all_schedule", "first_ranks", "gather_schedule", "prefix_schedule",
           "reduce_scatter_schedule", "scatter_schedule"]

_CACHE_SIZE = 256


@functools.lru_cache(maxsize=_CACHE_SIZE)
def gather_schedule(nodes: int, owners: tuple[int, ...], root: int) -> Schedule:
    """Every rank's chunk to node ``root`` (chunk ``r`` is rank ``r``'s array)."""
    owners = check_owners(nodes, owners)
    check_root(nodes, root)
    steps: Round = tuple(Step(o, root, c, Action.COPY) for c, o in enumerate(owners)
                         if o != root)
    return Schedule(nodes, len(owners), drop_empty([steps]))


@functools.lru_cache(maxsize=_CACHE_SIZE)
def scatter_schedule(nodes: int, owners: tuple[int, ...], root: int) -> Schedule:
    """Node ``root``'s chunk ``r`` to rank ``r``'s node."""
    owners = check_owners(nodes, owners)
    check_root(nodes, root)
    steps: Round = tuple(Step(root, o, c, Action.COPY) for c, o in enumerate(owners)
                         if o != root)
    return Schedule(nodes, len(owners), drop_empty([steps]))


@functools.lru_cache(maxsize=_CACHE_SIZE)
def all_to_all_schedule(nodes: int, owners: tuple[int, ...]) -> Schedule:
    """Chunk ``s * ranks + d`` (rank ``s``'s block for rank ``d``) from ``s``'s node to
    ``d``'s, by source rank, then destination rank."""
    owners = check_owners(nodes, owners)
    ranks = len(owners)
    steps: Round = tuple(
        Step(owners[s], owners[d], s * ranks + d, Action.COPY)
        for s in range(ranks) for d in range(ranks) if owners[s] != owners[d])
    return Schedule(nodes, ranks * ranks, drop_empty([steps]))


def first_ranks(nodes: int, owners: tuple[int, ...]) -> dict[int, int]:
    """Each node that holds a rank: its first rank (by node, in node order)."""
    first: dict[int, int] = {}
    for r, o in enumerate(owners):
        first.setdefault(o, r)
    return {n: first[n] for n in range(nodes) if n in first}


@functools.lru_cache(maxsize=_CACHE_SIZE)
def reduce_scatter_schedule(nodes: int, owners: tuple[int, ...]) -> Schedule:
    """Chunk ``f * ranks + d`` (node ``n``'s blocks for rank ``d``, combined; ``f`` is
    ``n``'s first rank) from ``n`` to ``d``'s node, for every ``d`` of another node: one
    block per node and rank, whatever the number of ranks a node holds."""
    owners = check_owners(nodes, owners)
    ranks = len(owners)
    steps: Round = tuple(
        Step(n, owners[d], f * ranks + d, Action.COPY)
        for n, f in first_ranks(nodes, owners).items() for d in range(ranks) if owners[d] != n)
    return Schedule(nodes, ranks * ranks, drop_empty([steps]))


@functools.lru_cache(maxsize=_CACHE_SIZE)
def prefix_schedule(nodes: int, owners: tuple[int, ...]) -> Schedule:
    """Rank ``r``'s chunk to every other node that holds a rank after ``r``."""
    owners = check_owners(nodes, owners)
    last = [-1] * nodes
    for r, o in enumerate(owners):
        last[o] = r
    steps: Round = tuple(Step(o, n, c, Action.COPY) for c, o in enumerate(owners)
                         for n in range(nodes) if n != o and last[n] > c)
    return Schedule(nodes, len(owners), drop_empty([steps]))
