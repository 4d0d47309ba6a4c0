"""``ByHost``: a strategy composed by host -- inside each host, then between hosts, then inside.

A flat schedule crosses the network wherever two neighbours sit on different hosts; ``ByHost``
keeps the network for the part that needs it, as NCCL's and Open MPI's hierarchical
collectives do. **All-reduce** with every host holding the same ``k >= 2`` nodes: a ring
reduce-scatter inside each host, the ``j``-th nodes of all hosts all-reduce shard ``j`` with the
inner strategy (``k`` at once), a one-round all-gather inside each host: a host sends
``2 (H - 1) / H * S`` bytes, the ring's lower bound among ``H`` hosts. **Everything else**
(hosts of different sizes too) goes through one *leader* per host (its first node; the root on
the root's host): a chain into the leader, the inner strategy among leaders, one round out.
Rings and chains inside a host make each node reduce one sender at a time rather than queue
``k - 2`` arrays. Every chunk's reduction is computed once and copied, so every node ends
bitwise identical. ``hosts[p]`` names participant ``p``'s host (equal integers = same host),
hosts ordered by their first participant. Pure and stdlib-only.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from burncoll.strategies._checks import check_owners, check_root, check_world, drop_empty
from burncoll.strategies.base import Strategy, cached_schedules
from burncoll.strategies.ring import Ring
from burncoll.strategies.schedule import Action, Round, Schedule, Step

__all__ = ["ByHost", "host_groups"]

Groups = tuple[tuple[int, ...], ...]


def host_groups(hosts: Sequence[int]) -> Groups:
    """The participants of each host, ascending; hosts in the order of their first one."""
    members: dict[int, list[int]] = {}
    for p, host in enumerate(hosts):
        members.setdefault(host, []).append(p)
    return tuple(tuple(m) for m in members.values())


def _embed(schedule: Schedule, members: Sequence[int], first_chunk: int = 0) -> list[Round]:
    """``schedule``'s rounds with participant ``i`` as ``members[i]`` and chunk ``c`` as
    ``first_chunk + c``."""
    return [tuple(Step(members[s.src], members[s.dst], first_chunk + s.chunk, s.action)
                  for s in rnd) for rnd in schedule.rounds]


def _side_by_side(parts: Sequence[list[Round]]) -> list[Round]:
    """Schedules over disjoint participants or chunks run at once: their ``r``-th rounds
    joined."""
    depth = max((len(p) for p in parts), default=0)
    return [tuple(s for p in parts if r < len(p) for s in p[r]) for r in range(depth)]


def _to_leaders(groups: Groups, leaders: Sequence[int], chunks: int) -> list[Round]:
    """Every host's sum in its leader: a chain through the host's nodes, last to first, the
    leader last (REDUCE). A chain, not one round: a node receives from one node at a time,
    so nothing waits in its mailbox for the reduction of another sender's part (with the
    walk's pipeline the chain's steps overlap part by part)."""
    chains = [[m for m in reversed(g) if m != lead] + [lead]
              for g, lead in zip(groups, leaders, strict=True)]
    return [tuple(Step(chain[i], chain[i + 1], c, Action.REDUCE) for chain in chains
                  if i < len(chain) - 1 for c in range(chunks))
            for i in range(max(map(len, chains)) - 1)]


def _from_leaders(groups: Groups, leaders: Sequence[int], chunks: int,
                  owners: Sequence[int] = ()) -> Round:
    """Every host's leader copies every chunk to its members (not chunk ``c`` to
    ``owners[c]``, which holds it)."""
    return tuple(Step(lead, m, c, Action.COPY) for g, lead in zip(groups, leaders, strict=True)
                 for m in g if m != lead for c in range(chunks)
                 if not (owners and owners[c] == m))


def _leaders(groups: Groups, root: int | None = None) -> tuple[int, ...]:
    """Each host's first node, but ``root`` on its own host."""
    return tuple(root if root is not None and root in g else g[0] for g in groups)


def _host_of(groups: Groups) -> dict[int, int]:
    return {p: h for h, g in enumerate(groups) for p in g}


def _all_reduce_by_leaders(groups: Groups, world: int, inner: Strategy) -> Schedule:
    leaders = _leaders(groups)
    among = inner.all_reduce(len(groups))
    chunks = among.num_chunks
    return Schedule(world, chunks, drop_empty([
        *_to_leaders(groups, leaders, chunks), *_embed(among, leaders),
        _from_leaders(groups, leaders, chunks)]))


@cached_schedules
@dataclass(frozen=True)
class ByHost(Strategy):
    """``inner`` among the hosts, rounds inside each host before and after it (see the
    module). ``hosts[p]``: participant ``p``'s host; every schedule is for ``len(hosts)``
    participants."""

    hosts: tuple[int, ...]
    inner: Strategy

    @property
    def spec(self) -> str:
        return f"by-host({self.inner.spec})"

    @property
    def exchanges(self) -> bool:
        """The inner strategy's: its rounds run among the hosts' nodes as they are."""
        return self.inner.exchanges

    def _groups(self, world: int) -> Groups:
        check_world(world)
        if len(self.hosts) != world:
            raise ValueError(f"ByHost knows the hosts of {len(self.hosts)} participants, "
                             f"not {world}")
        return host_groups(self.hosts)

    def _rooted(self, world: int, root: int) -> tuple[Groups, tuple[int, ...], int]:
        """The groups, the leaders (``root`` on its host) and the root's host."""
        groups = self._groups(world)
        check_root(world, root)
        return groups, _leaders(groups, root), _host_of(groups)[root]

    def reduce(self, world: int, root: int) -> Schedule:
        groups, leaders, host = self._rooted(world, root)
        among = self.inner.reduce(len(groups), host)
        return Schedule(world, among.num_chunks, drop_empty([
            *_to_leaders(groups, leaders, among.num_chunks), *_embed(among, leaders)]))

    def broadcast(self, world: int, root: int) -> Schedule:
        groups, leaders, host = self._rooted(world, root)
        among = self.inner.broadcast(len(groups), host)
        return Schedule(world, among.num_chunks, drop_empty([
            *_embed(among, leaders), _from_leaders(groups, leaders, among.num_chunks)]))

    def all_reduce(self, world: int) -> Schedule:
        groups = self._groups(world)
        k = len(groups[0])
        if k < 2 or any(len(g) != k for g in groups):
            return _all_reduce_by_leaders(groups, world, self.inner)
        among = self.inner.all_reduce(len(groups))
        width = among.num_chunks
        # node j of every host ends with its host's sum of shard j (chunks j * width ...): a
        # ring inside each host, so a node reduces one other node's part at a time
        inside = Ring().reduce_scatter(k, tuple(j for j in range(k) for _ in range(width)))
        scatter = _side_by_side([_embed(inside, g) for g in groups])
        shards = _side_by_side([_embed(among, [g[j] for g in groups], j * width)
                                for j in range(k)])
        gather = tuple(Step(g[j], g[i], j * width + c, Action.COPY) for g in groups
                       for j in range(k) for i in range(k) if i != j for c in range(width))
        return Schedule(world, k * width, drop_empty([*scatter, *shards, gather]))

    def reduce_scatter(self, world: int, owners: tuple[int, ...]) -> Schedule:
        groups = self._groups(world)
        owners = check_owners(world, owners)
        leaders, host_of = _leaders(groups), _host_of(groups)
        among = self.inner.reduce_scatter(len(groups), tuple(host_of[o] for o in owners))
        # each owner's host leader ends with the chunk; the owner takes it from there
        handed = tuple(Step(leaders[host_of[o]], o, c, Action.COPY)
                       for c, o in enumerate(owners) if o != leaders[host_of[o]])
        return Schedule(world, len(owners), drop_empty([
            *_to_leaders(groups, leaders, len(owners)), *_embed(among, leaders), handed]))

    def all_gather(self, world: int, owners: tuple[int, ...]) -> Schedule:
        groups = self._groups(world)
        owners = check_owners(world, owners)
        leaders, host_of = _leaders(groups), _host_of(groups)
        among = self.inner.all_gather(len(groups), tuple(host_of[o] for o in owners))
        collected = tuple(Step(o, leaders[host_of[o]], c, Action.COPY)
                          for c, o in enumerate(owners) if o != leaders[host_of[o]])
        return Schedule(world, len(owners), drop_empty([
            collected, *_embed(among, leaders),
            _from_leaders(groups, leaders, len(owners), owners)]))
