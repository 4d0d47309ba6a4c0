"""The host reduction (the ``HostReduce`` route): an all-reduce among node processes of one
host through their host memory (:mod:`burncoll.node.host_memory`): every node writes its
array into its data slot, reduces one chunk of every node's, and copies every node's reduced
chunk out -- as Open MPI's shared-memory collectives do.

**Why.** Between processes of one host the ring still passes each part from node to node
(``2(n-1)`` steps, a message and a wake-up each, through the event loop): a 1 MiB all-reduce
of 4 node processes cost each 1.6-4.5x the CPU it costs here (docs/performance.md). Here each
node copies its array in once, reduces ``1/n`` of it reading every node's data slot, and
copies the result out once, in two rounds of empty messages per piece of :data:`PIECE_BYTES`
(:meth:`~burncoll.node.host_memory.HostMemory.round`: in the host mail, or on the lanes).

**Each piece** (round ``3 + 2p`` and ``4 + 2p`` of piece ``p``): a node writes its piece into
its data slot -- all but its own chunk (``even_layout`` over the nodes), which only it reads,
from its array -- and says so; once every node has, it reduces its own chunk of the piece over
every node's in node order, into its result area, and says so; once every node has, it copies
every node's result chunk into its output. A node writes its slot again only after every node
reduced (the second round), and its result area only after every node finished copying (the
next first round), so nothing is read while it is written. Every wait ends by the operation's
deadline, and a process that dies fails the session (its member connections, the
orchestrator), which wakes every wait.
"""

from __future__ import annotations

import numpy as np

from burncoll.errors import CollectiveError
from burncoll.levels import GlobalOp, HostArray
from burncoll.node.host_memory import DATA_AT, OFFER_BYTES, RESULT_AT, HostMemory
from burncoll.ops import ReduceOp
from burncoll.protocol.checks import Check
from burncoll.reduction import reduce_into
from burncoll.strategies.auto import MOST_PIECES, PIECE_BYTES
from burncoll.strategies.layout import even_layout

__all__ = ["host_all_reduce"]

_FIRST_PIECE_ROUND = 3  # (rounds 1 and 2 are the handshake's)
assert _FIRST_PIECE_ROUND + 2 * MOST_PIECES <= 2**16 - 1  # (a message's round is a u16)


def host_all_reduce(memory: HostMemory, op: GlobalOp, buf: HostArray, out: HostArray) -> None:
    """``out = x0 op x1 op ...`` over every node's flat ``buf`` (``out`` may be ``buf``),
    a piece of :data:`PIECE_BYTES` at a time."""
    def run(check: Check) -> None:
        per_piece = PIECE_BYTES // buf.itemsize
        for p, start in enumerate(range(0, buf.size, per_piece)):
            end = min(start + per_piece, buf.size)
            _piece(memory, op, check, _FIRST_PIECE_ROUND + 2 * p, buf[start:end],
                  out[start:end])

    memory.lanes.run(op, OFFER_BYTES, run)


def _piece(memory: HostMemory, op: GlobalOp, check: Check, round_: int, buf: HostArray,
          out: HostArray) -> None:
    """One piece ``buf`` of the host reduction, into ``out``, in rounds ``round_`` and
    ``round_ + 1``."""
    dtype, size, me, maps = buf.dtype, buf.size, memory.me, memory.maps
    if len(maps) != memory.nodes:  # (closed by a node leaving after a failure)
        raise CollectiveError(f"{op.label}: the host memory was closed")
    slots = [np.frombuffer(maps[n], dtype, size, DATA_AT) for n in range(memory.nodes)]
    layout = even_layout(size, memory.nodes)
    a, b = layout[me]
    slots[me][:a] = buf[:a]  # (only this node reads its own chunk: from
    slots[me][b:] = buf[b:]  # its array, a copy's memory traffic fewer)
    slots[me] = buf
    memory.round(op, check, round_)
    mine = np.frombuffer(maps[me], dtype, b - a, RESULT_AT)
    reduce_into(op.reduce_op or ReduceOp.SUM, [s[a:b] for s in slots], mine)
    memory.round(op, check, round_ + 1)
    for n, (a, b) in enumerate(layout):
        out[a:b] = np.frombuffer(maps[n], dtype, b - a, RESULT_AT)
