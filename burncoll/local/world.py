"""Who takes part in the operations of one node, as the choice of an operation's plan sees it."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from burncoll.levels import GlobalLink

__all__ = ["World"]


@dataclass(frozen=True, slots=True)
class World:
    """This node's peers and, with several nodes, the rest of the collective."""

    #: This node's peer ids, sorted (a peer's local index is its index here).
    peer_ids: tuple[int, ...]
    #: Every peer id of the collective, sorted (a peer's rank is its index here).
    all_peer_ids: tuple[int, ...]
    num_nodes: int
    node_index: int
    #: The node index hosting each peer id.
    node_of: Mapping[int, int]
    #: Every node runs a local ring over as many devices: all-reduces shard across nodes.
    sharded: bool
    #: Every node runs on one host and shares memory (exchanges pay off up to larger sizes).
    one_host: bool = False
    #: The host of each node (``GlobalLink.hosts``); empty on one node or when unknown.
    hosts: tuple[int, ...] = ()
    #: What the nodes agreed at join (``GlobalLink``'s): every node uses lanes; every node
    #: mapped every other's host memory (``levels.HostReduce``); and its mail is usable.
    lanes: bool = False
    host_memory: bool = False
    host_mail: bool = False

    @classmethod
    def of(cls, peer_ids: Sequence[int], link: GlobalLink | None) -> World:
        """The world of a node with ``peer_ids``, alone (``link`` is ``None``) or linked."""
        mine = tuple(peer_ids)
        if link is None:
            return cls(mine, mine, 1, 0, dict.fromkeys(mine, 0), False)
        return cls(mine, link.peer_ids, link.num_nodes, link.node_index, link.node_of,
                   link.sharded, link.one_host, link.hosts, link.lanes, link.host_memory,
                   link.host_mail)

    @property
    def size(self) -> int:
        """The number of local peers."""
        return len(self.peer_ids)

    @property
    def multi_node(self) -> bool:
        return self.num_nodes > 1

    def local_index(self, peer_id: int) -> int | None:
        """``peer_id``'s local index, or ``None`` when it lives on another node."""
        return self.peer_ids.index(peer_id) if peer_id in self.peer_ids else None
