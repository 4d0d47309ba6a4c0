"""Communicator groups: :meth:`Groups.split` (MPI's ``Comm.Split``) and :meth:`Groups.group`
(torch's ``new_group``), which :class:`~burncoll.Communicator` inherits.

A group is a new collective over some of the parent's peers (docs/operations.md, "Groups"):
its peers are numbered 0 .. n-1 (its ``peer_id`` is its ``rank``) and it inherits the parent's
config. Making one is collective over the parent, as docs/architecture.md ("Groups") describes:
one ``all_gather_object`` of every peer's input, node and a nonce, so every peer computes the
same groups and errors; a group spanning nodes gets an orchestrator from its rank 0 (announced
by a second ``all_gather_object``), closed with the group's collective on its node, or with
the parent's if the group failed or was never built.
"""

from __future__ import annotations

import contextlib
import itertools
import numbers
import secrets
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TypeVar

import numpy as np

from burncoll.comm import objects
from burncoll.comm.core import CommunicatorCore
from burncoll.comm.registry import REGISTRY
from burncoll.config import CollectiveConfig
from burncoll.config.values import parse_host_port
from burncoll.errors import ProtocolError, TransportError, UsageError
from burncoll.local.rendezvous import Rendezvous
from burncoll.orchestration.orchestrator import Orchestrator, start_orchestrator

__all__ = ["Groups"]

#: Seconds the host of a group's orchestrator waits, when closing it, for the ``finished``
#: messages still on their way to the group's other nodes.
_DRAIN_SECONDS = 5.0
#: How much of a value that is not an int an error message shows.
_SHOWN = 60


C = TypeVar("C", bound="Groups")


class Groups(CommunicatorCore):
    """:meth:`split` and :meth:`group`: new communicators over some of this one's peers."""

    #: For a communicator made by :meth:`split` or :meth:`group`: the parent rank of each of
    #: its ranks (``parent_ranks[r]`` is group rank ``r``); ``None`` for one from ``register``.
    parent_ranks: tuple[int, ...] | None = None

    def split(self: C, color: int | None, key: int | None = None) -> C | None:
        """A communicator over the peers that pass the same ``color`` (MPI's ``Comm.Split``).

        Collective: every peer of this communicator calls it, in the same order as its other
        operations. ``color``: an int >= 0, or ``None`` to join no group (MPI_UNDEFINED;
        returns ``None``). The group's peers are ranked by ``(key, rank)``; ``key`` defaults
        to this peer's rank, which keeps the parent's order. In the group, ``peer_id`` equals
        ``rank`` (0 .. n-1) and roots are group ranks; ``parent_ranks`` maps them back. The
        group may span nodes and has its own operations, timeouts and ``finish()`` (call it
        on every group too; its orchestrator, if it has one, closes then).
        A bad color or key on any peer raises the same :class:`~burncoll.UsageError` on every
        peer, naming each peer's value.
        """
        seen = _gather(self, "split", [_wire(color), _wire(self.rank if key is None else key)])
        return _make(self, _split_groups(seen.inputs), seen, "split")

    def group(self: C, ranks: Sequence[int]) -> C | None:
        """A communicator over the peers of ``ranks`` (a list, tuple, range or NumPy array of
        ranks of this communicator), as ``torch.distributed.new_group``; ``None`` on the peers
        not listed.

        Collective: every peer of this communicator calls it with the same list (the same
        ranks, listed in the same order, without duplicates), in the same order as its other
        operations; to make several groups, every peer calls it once for each. As torch
        does, the group is ordered by parent rank: its rank ``r`` is the ``r``-th smallest
        of ``ranks``, whatever order they were listed in; ``parent_ranks`` maps group ranks
        back. In the group ``peer_id`` equals ``rank`` and roots are group ranks. Peers that
        pass different lists, a rank out of range or twice, raise the same
        :class:`~burncoll.UsageError` on every peer, naming what each peer passed.
        """
        mine: object = _wire(ranks)
        if isinstance(ranks, list | tuple | range | np.ndarray):
            mine = [_wire(r) for r in itertools.islice(ranks, self.world_size + 1)]
        seen = _gather(self, "group", mine)
        return _make(self, [_group_members(seen.inputs, self.world_size)], seen, "group")


# -- what every peer passed ---------------------------------------------------------------------
@dataclass(frozen=True)
class _Seen:
    """Every parent peer's input, node and nonce, in parent rank order, as every peer got them."""

    inputs: list[object]
    nodes: list[int]
    nonces: list[str]


def _wire(value: object) -> object:
    """An int (NumPy's too) or ``None`` as itself; anything else as what names it, so that
    every peer can send its input and every peer can show it."""
    if value is None or (isinstance(value, numbers.Integral) and not isinstance(value, bool)
                         and -(2**63) <= int(value) < 2**63):
        return None if value is None else int(value)
    return {"type": type(value).__name__, "repr": repr(value)[:_SHOWN]}


def _show(value: object) -> str:
    if isinstance(value, dict):
        return f"{value.get('repr')} ({value.get('type')})"
    if isinstance(value, list):
        return "[" + ", ".join(_show(v) for v in value) + "]"
    return repr(value)


def _gather(comm: Groups, label: str, mine: object) -> _Seen:
    """Every parent peer's input (one all-gather); peers that called different things (one
    split, another group) raise the same error."""
    got = comm._all_gather_record(objects.payload(
        [label, mine, min(comm._server.peer_ids), secrets.token_hex(8)]), "all_gather_object")
    rows = []
    for item in got:
        if not (isinstance(item, list) and len(item) == 4 and isinstance(item[0], str)
                and isinstance(item[2], int) and isinstance(item[3], str)):
            raise ProtocolError(f"{label}: a peer sent a malformed membership record")
        rows.append(item)
    labels = {row[0] for row in rows}
    if len(labels) > 1:
        called = "; ".join(f"rank {r} called {row[0]}" for r, row in enumerate(rows))
        raise UsageError(f"split/group: every peer must make the same call, in the same "
                         f"order; {called}")
    return _Seen([row[1] for row in rows], [row[2] for row in rows], [row[3] for row in rows])


def _split_groups(inputs: list[object]) -> list[list[int]]:
    """The groups of a split, each its parent ranks in group-rank order (by color)."""
    bad, colors, keys = [], [], []
    for rank, item in enumerate(inputs):
        color, key = item if isinstance(item, list) and len(item) == 2 else (item, item)
        if color is not None and not (isinstance(color, int) and color >= 0):
            bad.append(f"rank {rank} passed color={_show(color)}")
        if not isinstance(key, int):
            bad.append(f"rank {rank} passed key={_show(key)}")
        colors.append(color)
        keys.append(key)
    if bad:
        raise UsageError("split: color must be an int >= 0, or None to join no group, and key "
                         "an int or None; " + "; ".join(bad))
    by_color: dict[int, list[int]] = {}
    for rank, color in enumerate(colors):
        if isinstance(color, int):
            by_color.setdefault(color, []).append(rank)
    return [sorted(members, key=lambda r: (keys[r], r))
            for _, members in sorted(by_color.items())]


def _ranks_problem(ranks: object, world: int) -> str | None:
    if not isinstance(ranks, list):
        return "not a list of ranks"
    if not ranks:
        return "no rank at all"
    if any(not isinstance(r, int) for r in ranks):
        return "not all ints"
    outside = [r for r in ranks if not 0 <= r < world]
    if outside:
        return f"{_show(outside)} out of range"
    twice = sorted({r for r in ranks if ranks.count(r) > 1})
    return f"{_show(twice)} listed twice" if twice else None


def _group_members(inputs: list[object], world: int) -> list[int]:
    """The parent ranks of ``group(ranks)``, sorted, once every peer's list checks out."""
    problems = [f"rank {rank} passed {_show(ranks)}: {why}" for rank, ranks in enumerate(inputs)
                if (why := _ranks_problem(ranks, world)) is not None]
    if problems:
        raise UsageError(f"group: ranks must list distinct ranks of this communicator, "
                         f"0 to {world - 1}; " + "; ".join(problems))
    passed: dict[str, list[int]] = {}
    for rank, ranks in enumerate(inputs):
        passed.setdefault(_show(ranks), []).append(rank)
    if len(passed) > 1:
        shown = "; ".join(f"rank(s) {', '.join(map(str, who))} passed {what}"
                          for what, who in passed.items())
        raise UsageError(f"group: every peer must pass the same ranks; {shown}")
    first = inputs[0]
    return sorted(r for r in first if isinstance(r, int)) if isinstance(first, list) else []


# -- making the group ------------------------------------------------------------------------
def _make(comm: C, groups: list[list[int]], seen: _Seen, label: str) -> C | None:
    """This peer's group among ``groups`` (``None`` if in none), every parent peer taking part
    in handing out the orchestrators' addresses."""
    mine = next((g for g in groups if comm.rank in g), None)
    spanning = [g for g in groups if len({seen.nodes[r] for r in g}) > 1]
    address, hosted = None, None
    if spanning:
        address, hosted = _share_address(comm, mine if mine in spanning else None, seen, label)
    if mine is None:
        return None
    return _join(comm, mine, seen, address, hosted, label)


class _Hosted:
    """A group's orchestrator that this peer started, and the group's rendezvous here."""

    def __init__(self, orchestrator: Orchestrator) -> None:
        self.orchestrator = orchestrator
        self._server: weakref.ref[Rendezvous] | None = None

    def adopt(self, server: Rendezvous) -> None:
        """The group is built: its orchestrator ends with its node's collective."""
        self._server = weakref.ref(server)
        REGISTRY.on_close(server, self.close)

    def close(self) -> None:
        with contextlib.suppress(Exception):  # best effort: the group is over
            self.orchestrator.close(drain=_DRAIN_SECONDS)

    def close_unless_live(self) -> None:
        """At the parent's close: close the orchestrator unless its group is still up (its
        own close will)."""
        server = self._server() if self._server is not None else None
        if server is None or server.failure is not None:
            self.close()


def _node_host(config: CollectiveConfig) -> str:
    host, _ = parse_host_port(config.node_address or "127.0.0.1", "node_address", default_port=0)
    return host


def _share_address(comm: Groups, mine: list[int] | None, seen: _Seen, label: str
                   ) -> tuple[str | None, _Hosted | None]:
    """The address of the orchestrator of this peer's group (which its rank 0 starts on its
    node), through an all-gather over the parent that every parent peer joins."""
    hosted, error, record = None, None, None
    if mine is not None and mine[0] == comm.rank:
        cfg = comm.config
        try:
            hosted = _Hosted(start_orchestrator(
                _node_host(cfg), 0, cfg.transport, cfg.auth_token, timeout=cfg.timeout,
                tls_cert=cfg.tls_cert, tls_key=cfg.tls_key, tls_ca=cfg.tls_ca, tls=cfg.tls,
                integrity=cfg.integrity, insecure=cfg.insecure,
                expected_nodes=len({seen.nodes[r] for r in mine})))
            REGISTRY.on_close(comm._server, hosted.close_unless_live)
            record = ["ok", hosted.orchestrator.address]
        except Exception as exc:  # the others must not wait for an address
            error, record = exc, ["error", f"{type(exc).__name__}: {exc}"]
    try:
        got = comm._all_gather_record(objects.payload(record), "all_gather_object")
    except BaseException:
        if hosted is not None:
            hosted.close()
        raise
    if error is not None:
        raise error
    if mine is None:
        return None, None
    entry = got[mine[0]]
    if not (isinstance(entry, list) and len(entry) == 2 and entry[0] == "ok"
            and isinstance(entry[1], str)):
        raise TransportError(f"{label}: rank {mine[0]}, the first of this group, could not "
                             f"start the group's orchestrator: {_show(entry)}")
    return entry[1], hosted


def _join(comm: C, members: list[int], seen: _Seen, address: str | None,
          hosted: _Hosted | None, label: str) -> C:
    """Register this peer in the group's collective; its communicator there."""
    nodes = list(dict.fromkeys(seen.nodes[r] for r in members))
    here = seen.nodes[comm.rank]
    try:
        cfg = comm.config.replace(
            num_devices=sum(1 for r in members if seen.nodes[r] == here),
            num_nodes=len(nodes), node_rank=nodes.index(here),
            global_address=address if len(nodes) > 1 else None,
            node_address=_bracketed(_node_host(comm.config)) if len(nodes) > 1 else None,
            data_service_port=None, host_orchestrator=False,
            group=f"{label}:{seen.nonces[members[0]]}")
        server, index = REGISTRY.join(members.index(comm.rank), comm.device, cfg)
    except BaseException:
        if hosted is not None:
            hosted.close()
        raise
    if hosted is not None:
        hosted.adopt(server)
    made = type(comm)(server, index, comm.device)
    made.parent_ranks = tuple(members)
    return made


def _bracketed(host: str) -> str:
    return f"[{host}]" if ":" in host else host
