"""Host memory: one sealed mapping per node process, that every other node process of its
host maps read-only, set up by one handshake at join.

**Layout** (offsets in every node's mapping): the host mail (:mod:`burncoll.node.host_mail`)
at 0 -- the counter line and two mail slots --, then, from :data:`SEGMENT_NODES` nodes, the
data slot from the next page on (:data:`DATA_AT`, a piece of :data:`PIECE_BYTES`) and the
result area (:data:`RESULT_AT`: a result chunk is at most half a piece, plus an element),
both for the host reduction (:mod:`burncoll.node.host_reduce`); last, from the next page on
(:func:`regions_at`), one stream region of :data:`~burncoll.transport.shm.RING_BYTES` per
*region peer* (:func:`region_peers`), in node order, through which this node's connection to it
carries its large messages (:mod:`burncoll.transport.shm`); the connections to the other nodes
of its host carry theirs on the socket. No page is touched at set-up: a session that never
all-reduces through the data slot or sends through a region holds no memory for them.

**Region peers** are the nodes a strategy's large messages go to, among the ``h`` node
processes of a host (positions ``p`` in node order): the ring's neighbours ``p +- 1``, the
partners of recursive doubling ``p xor 2**k`` and the binary tree's parent and children --
at most ``5 + log2(h)``, each pair both ways, so what a node maps and touches for its regions
grows with ``log h``, not with ``h`` (issue 32: one region per other node of the host made every
node of 32 map 32 x 620 MiB, and its resident size grow with the regions its strategies cycled
through). Up to 4 node processes of a host, every other one is a region peer.

**The handshake** (once the lanes are open, before the session's first operation, where a
host runs 2 node processes or more: :meth:`burncoll.node.link.NodeLink.share_host_memory`):
every node with another on its host makes its mapping (a sealed anonymous file,
:mod:`burncoll.transport.host_files`) and offers it on the lanes (round 1); every node maps
those of the nodes of its host read-only -- only if each is a file a node makes, of the
mapping's size, sealed, not offered twice --, hands each connection it receives on from
its region peers among them the region that peer writes to it, and answers (round 2) with a
bit per node whose region it took or, for the others, whose mapping it mapped (and its own,
if it offered it) and whether its processor keeps stores in order. No sender writes a region
before its reader has it: every node reads every answer, and hands each connection it sends
on its region only where the receiver's answer says it took it. So all of them agree on the
session's capabilities: ``host_memory`` (one host, every mapping mapped everywhere) and
``host_mail`` (and every processor allows the mail). Without them (a node without the memory,
``/proc`` closed, nodes on several hosts) the session runs without host memory from its first
operation: the route of every operation is chosen knowing
it (:func:`burncoll.local.plans.choose.choose`); the stream regions the nodes took still serve.

**Trust.** A node can write only its own mapping: another node's is mapped read-only, and its
size cannot change under the mapping (sealed). Every round is a DATA header naming the
operation, its round and its sender, checked byte for byte as the exchange's are
(:meth:`burncoll.node.lane_exchange.LaneExchange.trade`); what a node puts in its slots is its
contribution, as any node's array is.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import re
import secrets

from burncoll.errors import ProtocolError
from burncoll.levels import GlobalOp
from burncoll.node.host_mail import MAIL_AREA_BYTES, ORDERED_STORES, SharedMail
from burncoll.node.lane_exchange import LaneExchange
from burncoll.protocol.checks import Check
from burncoll.strategies.auto import PIECE_BYTES, SEGMENT_NODES
from burncoll.transport.host_files import close_host_file, map_offered, new_host_file
from burncoll.transport.shm import RING_BYTES

__all__ = ["DATA_AT", "OFFER_BYTES", "RESULT_AT", "HostMemory", "host_memory_bytes",
           "region_peers", "region_slots", "regions_at"]


def _paged(size: int) -> int:
    return -(-size // mmap.PAGESIZE) * mmap.PAGESIZE


DATA_AT = _paged(MAIL_AREA_BYTES)
RESULT_AT = DATA_AT + PIECE_BYTES
#: An offer: the mapping's creator's pid, its descriptor there and its name's token, padded.
OFFER_BYTES = 64
_OFFERED = re.compile(rb"([0-9]{1,10})/([0-9]{1,10})/([0-9a-f]{32})\0*")
_OFFER_ROUND, _ANSWER_ROUND = 1, 2
#: A node's answer in round 2 starts with this flag where its processor allows the mail.
_ORDERED = 1


def regions_at(nodes: int) -> int:
    """Where the stream regions start in a session of ``nodes`` node processes: after the
    mail alone below :data:`SEGMENT_NODES` (their all-reduces past the exchange take the
    ring), else after the data slot and the result area too."""
    return _paged(RESULT_AT + PIECE_BYTES // 2 + 64) if nodes >= SEGMENT_NODES else DATA_AT


def region_peers(position: int, count: int) -> list[int]:
    """The positions, among a host's ``count`` node processes, of the region peers of the one
    at ``position`` (see the module): ``q`` is ``p``'s exactly when ``p`` is ``q``'s."""
    near = {(position - 1) % count, (position + 1) % count, (position - 1) // 2,
            2 * position + 1, 2 * position + 2}
    near.update(position ^ (1 << k) for k in range(count.bit_length()))
    return sorted(p for p in near if 0 <= p < count and p != position)


def region_slots(count: int) -> int:
    """The stream regions of each mapping among a host's ``count`` node processes."""
    return max((len(region_peers(p, count)) for p in range(count)), default=0)


def host_memory_bytes(nodes: int, on_host: int | None = None) -> int:
    """A mapping's size in a session of ``nodes`` node processes, ``on_host`` of them (all,
    unless said) on its host."""
    return regions_at(nodes) + region_slots(nodes if on_host is None else on_host) * RING_BYTES


class HostMemory:
    """This node's mapping and its mappings of the other nodes' of its host (see the
    module)."""

    def __init__(self, lanes: LaneExchange, hosts: tuple[int, ...]) -> None:
        self.lanes = lanes
        self.me = lanes.service.node_index
        self.nodes = len(hosts)
        #: The nodes of this node's host (``hosts``: every node's, numbered), this one too.
        self._host = [n for n, h in enumerate(hosts) if h == hosts[self.me]]
        self._bytes = host_memory_bytes(self.nodes, len(self._host))
        #: This node's region peers (see the module), by node index.
        self.region_peers = set(self._peers(self.me))
        #: The mappings of this node's host, this node's writable, by node index.
        self.maps: dict[int, memoryview] = {}

    def round(self, op: GlobalOp, check: Check, round_: int, payload: bytes = b""
              ) -> dict[int, bytes]:
        """Round ``round_`` of ``op`` in the mail, if the session has it, else on the lanes:
        every other node's ``payload``, by node (a copy: a few bytes)."""
        core = self.lanes.cores.of(op, len(payload))
        header = core.round_header(op, round_, len(payload))
        received = self.lanes.trade(op, check, header, payload, self.lanes.mail, core)
        return {node: bytes(data[len(header):]) for node, data in received.items()}

    def set_up(self, op: GlobalOp) -> bool:
        """(At join.) Make, offer and map the mappings of the nodes of each host (rounds 1 and
        2 of ``op`` on the lanes) and hand the connections between them their stream regions;
        whether every node mapped every other's (one host), the same on every node. With every
        processor allowing it, the mail is then the lanes' (``LaneExchange.mail``)."""
        check = self.lanes.executor.checker(op)
        fd: int | None = None
        seen: dict[tuple[int, int], str] = {}  # (every mapping is a file of its own)
        try:
            offer = b""
            if len(self._host) > 1:  # (else it would serve nothing)
                with contextlib.suppress(OSError):  # (no memory or descriptor for it)
                    token = secrets.token_hex(16)
                    fd, self.maps[self.me] = new_host_file(token, self._bytes)
                    mine = os.fstat(fd)
                    seen[mine.st_dev, mine.st_ino] = "this node"
                    offer = f"{os.getpid()}/{fd}/{token}".encode()
            offers = self.round(op, check, _OFFER_ROUND, offer.ljust(OFFER_BYTES, b"\0"))
            for n in sorted(set(offers) & set(self._host)):  # (all: each is checked)
                self._map(op, n, offers[n], seen)
            answer = self._answer(bool(offer))
            answers = {self.me: answer, **self.round(op, check, _ANSWER_ROUND, answer)}
        except BaseException:
            self.close()
            raise
        finally:
            if fd is not None:  # (every node mapped it before it answered, or never will)
                os.close(fd)
        mapped = {n: {m for m in range(self.nodes) if a[1 + m // 8] >> (m % 8) & 1}
                  for n, a in answers.items()}
        if offer:  # (an answer naming a file this node never offered is no region)
            self.lanes.service.connections.write_regions({
                n: self.maps[self.me][self._region(self.me, n)]
                for n in self.region_peers if self.me in mapped[n]})
        usable = all(m == set(range(self.nodes)) for m in mapped.values())
        if usable and all(a[0] & _ORDERED for a in answers.values()):
            self.lanes.mail = SharedMail(self.maps, self.me, 0)
        return usable

    def _answer(self, offered: bool) -> bytes:
        """Hand every connection this node receives on from a region peer whose mapping it
        mapped the region that node writes to it; this node's answer in round 2: whether its
        processor allows the mail, then a bit per node -- set for this node if it offered its
        mapping, for every region peer whose region its connection took, and for every other
        node whose mapping it mapped."""
        regions = {n: m[self._region(n, self.me)] for n, m in self.maps.items()
                   if n in self.region_peers}
        taken = self.lanes.service.connections.read_regions(regions)
        others = set(self.maps) - self.region_peers - {self.me}
        bits = bytearray(1 + (self.nodes + 7) // 8)
        bits[0] = _ORDERED * ORDERED_STORES
        for n in taken | others | ({self.me} if offered else set()):
            bits[1 + n // 8] |= 1 << (n % 8)
        return bytes(bits)

    def _peers(self, node: int) -> list[int]:
        """``node``'s region peers (a node of this host), by node index, in node order."""
        host = self._host
        return [host[p] for p in region_peers(host.index(node), len(host))]

    def _region(self, writer: int, reader: int) -> slice:
        """Where ``writer``'s stream region to ``reader`` (one of its region peers) lies in
        ``writer``'s mapping."""
        at = regions_at(self.nodes) + self._peers(writer).index(reader) * RING_BYTES
        return slice(at, at + RING_BYTES)

    def _map(self, op: GlobalOp, node: int, offer: bytes, seen: dict[tuple[int, int], str]
             ) -> bool:
        """Map node ``node``'s offered file; ``False`` when it offered none or it cannot be
        reached. A file offered as one that is not a node's mapping, or that another node (or
        this one) offered too, fails the session, naming both."""
        found = _OFFERED.fullmatch(offer)
        if found is None:
            if offer.strip(b"\0"):
                self.lanes.refuse(op, ProtocolError(
                    f"{op.label}: node {node} offered its host memory in a malformed message "
                    "on its caller socket"))
            return False
        pid, fd, token = int(found[1]), int(found[2]), found[3].decode()
        try:
            mapping = map_offered(pid, fd, token, self._bytes, seen, offered_by=f"node {node}")
        except ProtocolError as exc:
            self.lanes.refuse(op, ProtocolError(f"{op.label}: node {node} {exc}"))
        if mapping is None:
            return False
        self.maps[node] = mapping
        return True

    def close(self) -> None:
        """Unmap every mapping (views of them still held keep theirs mapped)."""
        self.lanes.service.connections.read_regions({})
        maps, self.maps = self.maps, {}
        self.lanes.mail = None
        for mapping in maps.values():
            close_host_file(mapping)
