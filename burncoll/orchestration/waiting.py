"""The orchestrator's waiting room: who waits with whom, and the sessions they form.

Sans-I/O: the orchestrator (:mod:`burncoll.orchestration.orchestrator`, whose docstring says
who waits with whom and why) reads and sends; this module decides. State is bounded: at most
:data:`MAX_WAITING` registrations and :data:`MAX_WAITING_PEERS` peer ids wait at once, each
join is bounded (:data:`~burncoll.protocol.control.MAX_NODE_PEERS` peer ids,
:data:`~burncoll.protocol.control.MAX_FIELD_BYTES` of fingerprint and of meta), and each
waiting node gets at most :data:`MAX_NOTICES` notices.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field

from burncoll.errors import ConfigError
from burncoll.protocol.control import Join, Notice, Table, TableEntry
from burncoll.protocol.fields import JsonObject, canonical
from burncoll.transport.base import Connection

__all__ = ["MAX_NOTICES", "MAX_WAITING", "MAX_WAITING_PEERS", "Conflict", "Group", "Member",
           "Session", "WaitingRoom", "differences"]

#: Most registrations waiting at once, all groups together (a session needs at most this many
#: nodes). Each costs a connection plus at most a few tens of KiB of state.
MAX_WAITING = 1024
#: Most peer ids waiting at once, all nodes together; also bounds a table message's size.
MAX_WAITING_PEERS = 65536
#: Most ``notice`` messages one waiting node is sent.
MAX_NOTICES = 4


class Conflict(ConfigError):
    """A newcomer refused because it and ``group``, waiting, cannot make one collective: their
    configs differ, or ``holder``, a member of the group, holds peer ids it also claims. The
    newcomer is refused with this message; the group is told ``their_reason`` (how much it is
    told, a refusal or a notice, the orchestrator decides)."""

    def __init__(self, reason: str, group: Group, their_reason: str,
                 holder: Member | None = None) -> None:
        super().__init__(reason)
        self.group = group
        self.their_reason = their_reason
        self.holder = holder


@dataclass
class Member:
    """One registered node: what its join said, and where it is now."""

    conn: Connection
    host: str
    port: int
    peer_ids: tuple[int, ...]
    fingerprint: JsonObject
    meta: JsonObject = field(default_factory=dict)
    index: int = -1
    session: Session | None = None
    group: Group | None = None
    #: Said ``leave``: it leaves a failed collective on purpose (its process is not dead).
    left: bool = False
    #: Groups this member was told about in a ``notice``.
    noticed: set[str] = field(default_factory=set)

    @classmethod
    def of(cls, conn: Connection, join: Join) -> Member:
        return cls(conn, join.host, join.port, tuple(sorted(join.peer_ids)), join.fingerprint,
                   join.meta)

    @property
    def num_nodes(self) -> int:
        """How many nodes the member's collective has (checked with its join)."""
        num_nodes = self.fingerprint.get("num_nodes")
        return num_nodes if isinstance(num_nodes, int) and num_nodes >= 1 else 1

    @property
    def key(self) -> str:
        """The canonical spelling of the fingerprint: members with the same key group."""
        return canonical(self.fingerprint)

    def may_notice(self, key: str) -> bool:
        """Whether this member may still be told about group ``key`` (once each, a few in
        all); counts the notice."""
        if key in self.noticed or len(self.noticed) >= MAX_NOTICES:
            return False
        self.noticed.add(key)
        return True


@dataclass
class Group:
    """Registrations with one fingerprint, waiting for ``num_nodes`` of them."""

    key: str
    num_nodes: int
    fingerprint: JsonObject
    members: list[Member] = field(default_factory=list)
    peer_ids: set[int] = field(default_factory=set)


@dataclass
class Session:
    """A full group's members, ordered by their lowest peer id, with the session's secret
    (32 random bytes, fresh for each session)."""

    sid: int
    members: list[Member]
    secret: str
    finished: set[int] = field(default_factory=set)

    @classmethod
    def form(cls, members: list[Member]) -> Session:
        session = cls(secrets.randbits(62) + 1, sorted(members, key=lambda m: min(m.peer_ids)),
                      secrets.token_bytes(32).hex())
        for index, m in enumerate(session.members):
            m.index = index
            m.session = session
        return session

    def tables(self) -> list[bytes]:
        """The node table each member is sent, by index (encoded frames: the entries encoded
        once for all of them)."""
        return Table.frames(self.sid, [TableEntry(m.index, m.host, m.port, m.peer_ids, m.meta)
                                       for m in self.members], self.secret)

    def finish(self, member: Member) -> bool:
        """``member`` finished; whether every member now has."""
        self.finished.add(member.index)
        return len(self.finished) == len(self.members)


class WaitingRoom:
    """The registrations waiting for their session, in groups by fingerprint.
    ``refuse_differences``: refuse a member whose fingerprint differs from a waiting group's (the
    orchestrator has a token). ``expected_nodes``: refuse any other ``num_nodes``."""

    def __init__(self, refuse_differences: bool, expected_nodes: int | None) -> None:
        self.refuse_differences = refuse_differences
        self.expected_nodes = expected_nodes
        self.groups: dict[str, Group] = {}
        self.waiting = 0
        self.waiting_peers = 0

    def admit(self, member: Member) -> list[Member] | None:
        """Put ``member`` in its group (:class:`ConfigError` saying why it cannot wait). The
        group's members, taken out of the room, when it is now full; else ``None``."""
        self._check_limits(member)
        key = member.key
        if self.refuse_differences:
            for other in self.groups.values():
                if other.key != key:
                    diffs = differences(member.fingerprint, other.fingerprint)
                    raise Conflict(
                        f"this node's config differs from the nodes already registered: {diffs}",
                        other, f"the orchestrator refused the node at {member.host}:"
                        f"{member.port} (peer ids {list(member.peer_ids[:16])}), which was to "
                        "join this collective: its config differs from this node's ("
                        + differences(other.fingerprint, member.fingerprint, "on that node")
                        + ")")
        group = self.groups.get(key) or Group(key, member.num_nodes, member.fingerprint)
        overlap = sorted(group.peer_ids.intersection(member.peer_ids))
        if overlap:
            holder = next(m for m in group.members if set(m.peer_ids) & set(overlap))
            raise Conflict(
                f"peer id(s) {overlap[:16]} are already used by the node at "
                f"{holder.host}:{holder.port}; peer ids must be unique across nodes (number "
                "them node_rank * num_devices + i: burncoll.peer_ids())", group,
                f"peer id(s) {overlap[:16]} of the node at {holder.host}:{holder.port} are also "
                f"claimed by the node at {member.host}:{member.port}, which was refused; peer "
                "ids must be unique across nodes (number them node_rank * num_devices + i: "
                "burncoll.peer_ids())", holder)
        self.groups[key] = group
        group.members.append(member)
        group.peer_ids.update(member.peer_ids)
        member.group = group
        self.waiting += 1
        self.waiting_peers += len(member.peer_ids)
        return self._take_out(group) if len(group.members) >= group.num_nodes else None

    def _check_limits(self, member: Member) -> None:
        expected = self.expected_nodes
        if expected is not None and member.num_nodes != expected:
            raise ConfigError(
                f"this orchestrator serves a collective of {expected} nodes (--nodes "
                f"{expected}), and this node says num_nodes={member.num_nodes}; set num_nodes "
                f"(BURNCOLL_NUM_NODES) to {expected}"
            )
        if member.num_nodes > MAX_WAITING:
            raise ConfigError(
                f"num_nodes={member.num_nodes} is more than the orchestrator's limit of "
                f"{MAX_WAITING} nodes per collective"
            )
        if self.waiting >= MAX_WAITING:
            raise ConfigError(
                f"the orchestrator already has {self.waiting} nodes waiting (its limit); try "
                "again later, and check that no stranger is flooding it (set an auth token)"
            )
        if self.waiting_peers + len(member.peer_ids) > MAX_WAITING_PEERS:
            raise ConfigError(
                f"the orchestrator already has {self.waiting_peers} peer ids waiting (its "
                f"limit is {MAX_WAITING_PEERS}); try again later, and check that no stranger "
                "is flooding it (set an auth token)"
            )

    def take_partial(self, key: str, min_nodes: int) -> list[Member] | None:
        """The members of group ``key``, taken out of the room, when it holds at least
        ``min_nodes`` but not all of its ``num_nodes`` (an elastic session of fewer nodes:
        the missing ones did not come in time); else ``None``."""
        group = self.groups.get(key)
        if group is None or not min_nodes <= len(group.members) < group.num_nodes:
            return None
        return self._take_out(group)

    def _take_out(self, group: Group) -> list[Member]:
        members = list(group.members)
        for m in members:
            self.unwait(m)
        return members

    def unwait(self, member: Member) -> bool:
        """Take ``member`` out of its waiting group; whether it was waiting."""
        group, member.group = member.group, None
        if group is None:
            return False
        group.members.remove(member)
        group.peer_ids.difference_update(member.peer_ids)
        self.waiting -= 1
        self.waiting_peers -= len(member.peer_ids)
        if not group.members and self.groups.get(group.key) is group:
            del self.groups[group.key]
        return True

    def notices(self, member: Member) -> list[tuple[Member, Notice]]:
        """The notices between a newly waiting ``member`` and the groups whose fingerprint
        differs from its own: informational, at most :data:`MAX_NOTICES` per member (so a
        flood of registrations costs each waiting node a few small messages), never a
        refusal."""
        group = member.group
        told: list[tuple[Member, Notice]] = []
        for other in [g for g in self.groups.values() if g is not group]:
            if member.may_notice(other.key):
                diffs = differences(member.fingerprint, other.fingerprint)
                told.append((member, Notice(
                    f"{len(other.members)} other node(s) wait at the orchestrator with a config "
                    f"that differs from this node's ({diffs}); they will not join this "
                    "collective: if they are yours, make the configs agree")))
            them = [m for m in list(other.members) if m.may_notice(member.key)]
            if them:
                mirrored = differences(other.fingerprint, member.fingerprint)
                notice = Notice(
                    f"another node waits at the orchestrator with a config that differs from "
                    f"this node's ({mirrored}); it will not join this collective: if it is "
                    "yours, make the configs agree")
                told.extend((m, notice) for m in them)
        return told


def differences(here: JsonObject, there: JsonObject,
                where: str = "on the node(s) already waiting") -> str:
    """``"key: X here, Y on the node(s) already waiting; ..."`` for each differing field."""
    return "; ".join(f"{key}: {here.get(key)!r} here, {there.get(key)!r} {where}"
                     for key in sorted(set(here) | set(there)) if here.get(key) != there.get(key))
