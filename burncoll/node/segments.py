"""All-reduce through shared memory among node processes of one host (the ``HostReduce``
route): every node writes its array into its own segment, reduces one chunk of every node's,
and copies every node's reduced chunk out -- as Open MPI's shared-memory collectives do.

**Why.** Between processes of one host the ring still passes each part from node to node
(``2(n-1)`` steps, a message and a wake-up each, through the event loop): a 1 MiB all-reduce
of 4 node processes cost each 1.6-4.5x the CPU it costs here (docs/performance.md). Here each
node copies its array in once, reduces ``1/n`` of it reading every node's segment, and copies
the result out once, in two rounds of empty messages on the caller sockets
(:mod:`burncoll.node.lanes`) per piece of :data:`PIECE_BYTES`.

**Setup, at join.** Once the lanes are open, before the session's first operation
(:func:`burncoll.node.joining.join_collective`), every node makes its segment (a sealed
anonymous file, :mod:`burncoll.transport.ring_files`) and offers it on the lanes (round 1);
every node maps the others' read-only -- only if each is a segment a node makes, of the
segment's size, sealed, not offered twice -- and answers whether it mapped them all, and
whether its processor keeps stores in order (round 2). Every node reads every answer, so all
of them agree on the session's capabilities: ``host_memory`` (every segment mapped
everywhere) and ``host_mail`` (and every processor allows the mail). Without them (a node
without the memory, ``/proc`` closed) the session runs without host memory from its first
operation: the route of every operation is chosen knowing it
(:func:`burncoll.local.plans.choose.choose`), never changed here. No page of a segment is
touched at set-up: a session that never all-reduces through it (point to point only) holds
no memory for its data slot.

**Each piece** (round ``3 + 2p`` and ``4 + 2p`` of piece ``p``): a node writes its piece into
its segment's slot -- all but its own chunk (``even_layout`` over the nodes), which only it
reads, from its array -- and says so on every lane; once every node has, it reduces its own
chunk of the piece over every node's in node order, into its segment's result area, and says
so; once every node has, it copies every node's result chunk
into its output. A node writes its slot again only after every node reduced (the second
round), and its result area only after every node finished copying (the next first round),
so nothing is read while it is written. Every message is a DATA header naming the operation,
its round and its sender, checked byte for byte as the exchange's are; every wait ends by the
operation's deadline, and a process that dies closes its lanes (``PeerLost`` at once).

**Mail.** At its start, each segment holds the node's shared mail
(:mod:`burncoll.node.shared_mail`): with ``host_mail`` the rounds above go through it, and so
do the exchanges whose route says so (``Exchange(Medium.HOST)``), instead of the lanes.

A node can write only its own segment: another node's is mapped read-only, and its size
cannot change under the mapping (sealed). What a node puts in its slot is its contribution,
as any node's array is.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import re
import secrets

import numpy as np

from burncoll.errors import CollectiveError, ProtocolError
from burncoll.levels import GlobalOp, HostArray
from burncoll.node.lane_exchange import LaneExchange
from burncoll.node.shared_mail import MAIL_AREA_BYTES, ORDERED_STORES, SharedMail
from burncoll.ops import ReduceOp
from burncoll.protocol.checks import Check
from burncoll.reduction import reduce_into
from burncoll.strategies.auto import MOST_PIECES, PIECE_BYTES, SEGMENT_NODES
from burncoll.strategies.layout import even_layout
from burncoll.transport.ring_files import close_ring, map_offered, new_ring

__all__ = ["SEGMENT_BYTES", "HostSegments", "segment_bytes"]

#: A segment: the shared mail (:mod:`burncoll.node.shared_mail`) first, then (from
#: :data:`SEGMENT_NODES` nodes) the slot from the next page on, and the result area: a result
#: chunk is at most half a piece (2 nodes or more), plus an element.
_MAIL_AT = 0
_SLOT_AT = -(-MAIL_AREA_BYTES // mmap.PAGESIZE) * mmap.PAGESIZE
_RESULT_AT = _SLOT_AT + PIECE_BYTES
SEGMENT_BYTES = _RESULT_AT + PIECE_BYTES // 2 + 64
#: An offer: the segment's creator's pid, its descriptor there and its name's token, padded.
_OFFER_BYTES = 64
_OFFERED = re.compile(rb"([0-9]{1,10})/([0-9]{1,10})/([0-9a-f]{32})\0*")
_OFFER_ROUND, _ANSWER_ROUND, _FIRST_PIECE_ROUND = 1, 2, 3
assert _FIRST_PIECE_ROUND + 2 * MOST_PIECES <= 2**16 - 1  # (a message's round is a u16)
#: A node's answer in round 2: it mapped every segment; its processor allows the mail.
_MAPPED, _ORDERED = 1, 2


def segment_bytes(nodes: int) -> int:
    """A segment's size in a session of ``nodes`` node processes: the mail alone below
    :data:`SEGMENT_NODES` (their all-reduces past the exchange take the ring), else the slot
    and the result area too."""
    return SEGMENT_BYTES if nodes >= SEGMENT_NODES else _SLOT_AT


class HostSegments:
    """This node's segment and its mappings of every other node's (see the module)."""

    def __init__(self, lanes: LaneExchange) -> None:
        self._lanes = lanes
        self._me = lanes.service.node_index
        self._nodes = len(lanes.service.nodes)
        self._bytes = segment_bytes(self._nodes)
        #: Every node's segment, this node's writable, by node index.
        self._maps: dict[int, mmap.mmap] = {}

    def all_reduce(self, op: GlobalOp, buf: HostArray, out: HostArray) -> None:
        """``out = x0 op x1 op ...`` over every node's flat ``buf`` (``out`` may be ``buf``),
        a piece of :data:`PIECE_BYTES` at a time."""
        self._lanes.run(op, _OFFER_BYTES, lambda check: self._run(op, check, buf, out))

    def _run(self, op: GlobalOp, check: Check, buf: HostArray, out: HostArray) -> None:
        per_piece = PIECE_BYTES // buf.itemsize
        for p, start in enumerate(range(0, buf.size, per_piece)):
            end = min(start + per_piece, buf.size)
            self._piece(op, check, _FIRST_PIECE_ROUND + 2 * p, buf[start:end], out[start:end])

    def _piece(self, op: GlobalOp, check: Check, round_: int, piece: HostArray,
               out: HostArray) -> None:
        dtype, size = piece.dtype, piece.size
        maps = self._maps
        if len(maps) != self._nodes:  # (closed by a node leaving after a failure)
            raise CollectiveError(f"{op.label}: the shared segments were closed")
        slots = [np.frombuffer(maps[n], dtype, size, _SLOT_AT) for n in range(self._nodes)]
        layout = even_layout(size, self._nodes)
        a, b = layout[self._me]
        slots[self._me][:a] = piece[:a]  # (only this node reads its own chunk: from
        slots[self._me][b:] = piece[b:]  # its array, a copy's memory traffic fewer)
        slots[self._me] = piece
        self._round(op, check, round_)
        mine = np.frombuffer(maps[self._me], dtype, b - a, _RESULT_AT)
        reduce_into(op.reduce_op or ReduceOp.SUM, [s[a:b] for s in slots], mine)
        self._round(op, check, round_ + 1)
        for n, (a, b) in enumerate(layout):
            out[a:b] = np.frombuffer(maps[n], dtype, b - a, _RESULT_AT)

    def _round(self, op: GlobalOp, check: Check, round_: int, payload: bytes = b""
               ) -> dict[int, bytes]:
        """Round ``round_`` of ``op`` in the mail, if the session has it, else on the lanes:
        every node's ``payload``, by node (a copy: a few bytes)."""
        core = self._lanes.cores.of(op, len(payload))
        header = core.round_header(op, round_, len(payload))
        received = self._lanes.trade(op, check, header, payload, self._lanes.mail, core)
        return {node: bytes(data[len(header):]) for node, data in received.items()}

    def set_up(self, op: GlobalOp) -> bool:
        """(At join.) Make, offer and map the segments (rounds 1 and 2 of ``op`` on the
        lanes); whether every node mapped every other's, the same on every node. With every
        processor allowing it, the mail is then the lanes' (``LaneExchange.mail``)."""
        check = self._lanes.executor.checker(op)
        token = secrets.token_hex(16)
        fd: int | None = None
        seen: dict[tuple[int, int], str] = {}  # (every segment is a file of its own)
        try:
            offer = b""
            if ORDERED_STORES or self._nodes >= SEGMENT_NODES:  # (else it would serve nothing)
                with contextlib.suppress(OSError):  # (no memory or descriptor for it)
                    fd, self._maps[self._me] = new_ring(token, self._bytes, populate=False)
                    mine = os.fstat(fd)
                    seen[mine.st_dev, mine.st_ino] = "this node"
                    offer = f"{os.getpid()}/{fd}/{token}".encode()
            offers = self._round(op, check, _OFFER_ROUND, offer.ljust(_OFFER_BYTES, b"\0"))
            mapped = [self._map(op, n, offers[n], seen) for n in sorted(offers)]  # (all)
            answer = (_MAPPED if offer and all(mapped) else 0) | (_ORDERED * ORDERED_STORES)
            answers = [answer, *(a[0] for a in self._round(op, check, _ANSWER_ROUND,
                                                           bytes([answer])).values())]
        except BaseException:
            self.close()
            raise
        finally:
            if fd is not None:  # (every node mapped it before it answered, or never will)
                os.close(fd)
        usable = all(a & _MAPPED for a in answers)
        if not usable:
            self.close()
        elif all(a & _ORDERED for a in answers):
            self._lanes.mail = SharedMail(self._maps, self._me, _MAIL_AT)
        return usable

    def _map(self, op: GlobalOp, node: int, offer: bytes, seen: dict[tuple[int, int], str]
             ) -> bool:
        """Map node ``node``'s offered segment; ``False`` when it offered none or it cannot
        be reached. A file offered as one that is not a segment, or that another node (or
        this one) offered too, fails the session, naming both."""
        found = _OFFERED.fullmatch(offer)
        if found is None:
            if offer.strip(b"\0"):
                self._lanes.refuse(op, ProtocolError(
                    f"{op.label}: node {node} offered a shared-memory segment in a malformed "
                    "message on its caller socket"))
            return False
        pid, fd, token = int(found[1]), int(found[2]), found[3].decode()
        try:
            mapping = map_offered(pid, fd, token, self._bytes, seen, populate=False,
                                  offered_by=f"node {node}")
        except ProtocolError as exc:
            self._lanes.refuse(op, ProtocolError(f"{op.label}: node {node} {exc}"))
        if mapping is None:
            return False
        self._maps[node] = mapping
        return True

    def close(self) -> None:
        """Unmap every segment (views of them still held keep theirs mapped)."""
        maps, self._maps = self._maps, {}
        self._lanes.mail = None
        for mapping in maps.values():
            close_ring(None, mapping)
