"""What a received DATA header must say before a byte of its part is used.

Two questions, both answered from the header alone (no I/O, no clock): is it a frame of this
node's own call (the *fingerprint*: operation, reduce op, dtype, shape, root -- a difference is
a :class:`~burncoll.MismatchError`), and, for a chunk this node allocates on receipt (broadcast
receivers, all-gather), how many bytes may it be -- the size its dtype and shape give under the
operation's layout, refused as a :class:`~burncoll.ProtocolError` when no array or no machine
could hold it. The errors name the sender through ``describe`` (the node table's words).
"""

from __future__ import annotations

import functools
import math
import os
from collections.abc import Callable

from burncoll.compression import of_root
from burncoll.dtypes import dtype_from_name
from burncoll.errors import CollectiveError, CollectiveTimeout, MismatchError, ProtocolError
from burncoll.levels import GlobalOp
from burncoll.ops import ROW_KINDS, OpKind, ReduceOp
from burncoll.protocol.wire import DataHeader
from burncoll.strategies.layout import even_layout

__all__ = ["Check", "array_bytes", "describe_fingerprint", "expected_bytes", "header_check",
           "memory_bytes", "order_mismatch", "part_of", "protocol_error", "timed_out"]

#: ``check(header)``: the error of a frame that is not of this node's call, or ``None``.
Check = Callable[[DataHeader], CollectiveError | None]

#: The largest dimension an array may have (numpy's index type).
_MAX_DIM = 2**63 - 1


@functools.cache
def memory_bytes() -> int:
    """This machine's physical memory: no array received can be larger."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):  # pragma: no cover - not POSIX
        return _MAX_DIM


def part_of(h: DataHeader) -> str:
    """The part ``h`` heads, in the words of errors."""
    return f"the part at byte {h.offset} of chunk {h.chunk} (round {h.round + 1})"


def describe_fingerprint(kind: OpKind, reduce_op: ReduceOp | None, dtype: str | None,
                         shape: tuple[int, ...], root: int) -> str:
    args = []
    if dtype is not None:
        args.append(f"{dtype}{list(shape)}")
    if reduce_op is not None:
        args.append(f"op={reduce_op.label}")
    if kind is OpKind.ALL_REDUCE and of_root(root) is not None:
        args.append(f"compressed {of_root(root)}")
    elif root >= 0 and kind is OpKind.REDUCE_SCATTER:
        args.append(f"counts digest {root:#x}")
    elif root >= 0:
        args.append(f"root={root}")
    return f"{kind.label}({', '.join(args)})"


def protocol_error(op: GlobalOp, describe: Callable[[int], str], h: DataHeader,
                   what: str) -> ProtocolError:
    """Node ``h.src`` sent ``what`` in ``op``."""
    return ProtocolError(f"{op.label}: {describe(h.src)} sent {what}")


def timed_out(op: GlobalOp, describe: Callable[[int], str], me: int, src: int, r: int,
              timeout: float, now: float) -> CollectiveTimeout:
    """The error for a frame from node ``src`` that had not come in round ``r`` at ``now``."""
    return CollectiveTimeout(
        f"{op.label} timed out after {now - op.started:.1f} s (timeout {timeout:g} s) on "
        f"{describe(me)}, waiting for {describe(src)} in round {r + 1}"
    )


def header_check(op: GlobalOp, me: int, describe: Callable[[int], str]) -> Check:
    """``check(header)``: the error of a frame that is not of this node's call ``op``
    (:class:`~burncoll.MismatchError`), or ``None``. A broadcast receiver (which calls it without an
    array) and an all-gather (whose peers' arrays differ in length) learn the array from the frames:
    every later frame of the operation (of the chunk, for an all-gather) must then carry the same
    dtype and shape as the first, or it is a :class:`~burncoll.ProtocolError`. One check per walk:
    it remembers the first array a frame carried."""
    first: dict[int, tuple[str | None, tuple[int, ...]]] = {}
    rows = op.kind in ROW_KINDS

    def check(h: DataHeader) -> CollectiveError | None:
        array: int | None = None
        if op.kind is OpKind.BROADCAST and h.op_kind is OpKind.BROADCAST:
            same, array = h.root == op.root, -1
        elif rows and h.op_kind is op.kind:
            same, array = _same_rows(op, h), h.chunk
        else:
            same = h.fingerprint() == op.fingerprint()
        if not same:
            return _mismatch(op, me, describe, h)
        if op.dtype is None and rows:  # a scatter's receiver learns the array from the root
            seen = first.setdefault(-1, (h.dtype, h.shape[1:]))
            if seen != (h.dtype, h.shape[1:]):
                return ProtocolError(
                    f"{op.label}: {describe(h.src)} sent {part_of(h)} of blocks "
                    f"{h.dtype}{list(h.shape[1:])} after blocks of {seen[0]}{list(seen[1])}: "
                    "every block of one scatter has the same dtype and trailing shape")
        if array is not None:
            seen = first.setdefault(array, (h.dtype, h.shape))
            if seen != (h.dtype, h.shape):
                return ProtocolError(
                    f"{op.label}: {describe(h.src)} sent {part_of(h)} of an array "
                    f"{h.dtype}{list(h.shape)} after parts of {seen[0]}{list(seen[1])}: "
                    "every frame of one array carries the same dtype and shape")
        return None

    return check


def _same_rows(op: GlobalOp, h: DataHeader) -> bool:
    """Whether ``h``, a frame of an operation whose chunks carry their rows, is of ``op``:
    its shape is the chunk's rows, then ``op.shape`` (a scan's chunk is one row); a scatter
    receiver (``op.dtype`` ``None``) knows only the root and the op."""
    if (h.reduce_op, h.root) != (op.reduce_op, op.root) or not h.shape:
        return False
    if op.kind in (OpKind.SCAN, OpKind.EXSCAN) and h.shape[0] != 1:
        return False
    if op.dtype is None and op.kind is OpKind.SCATTER:
        return True
    return (h.dtype, h.shape[1:]) == (op.dtype, op.shape)


def _calls(op: GlobalOp, h: DataHeader) -> tuple[str, str]:
    """This node's call ``op`` and the call the sender of ``h`` made, in the words of errors."""
    shape = h.shape[1:] if h.op_kind in ROW_KINDS and h.shape else h.shape
    mine = describe_fingerprint(op.kind, op.reduce_op, op.dtype, op.shape, op.root)
    return mine, describe_fingerprint(h.op_kind, h.reduce_op, h.dtype, shape, h.root)


def _mismatch(op: GlobalOp, me: int, describe: Callable[[int], str],
              h: DataHeader) -> MismatchError:
    mine, theirs = _calls(op, h)
    return MismatchError(f"{op.label}: peers called it with different arguments: "
                         f"{describe(me)} called {mine}; {describe(h.src)} called {theirs}")


def order_mismatch(op: GlobalOp, me: int, describe: Callable[[int], str],
                   h: DataHeader) -> MismatchError:
    """Node ``h.src`` sent ``h`` as its operation ``h.seq`` where this node runs ``op``
    (another number): the peers called different sequences of operations."""
    mine, theirs = _calls(op, h)
    return MismatchError(
        f"{op.label}: peers called different sequences of operations: {describe(me)} called "
        f"{mine} as its operation #{op.seq}; {describe(h.src)} called {theirs} as its "
        f"operation #{h.seq}; every peer must call the same collectives in the same order"
    )


def expected_bytes(op: GlobalOp, num_chunks: int, h: DataHeader) -> int:
    """The size of chunk ``h.chunk`` that this node allocates on receipt, from the dtype and
    shape ``h`` carries: a broadcast's chunk of its even layout over ``num_chunks``, or an
    all-gather's whole chunk. Raises :class:`~burncoll.ProtocolError` (worded "sent ...") for
    an array no node could hold, or an operation that allocates nothing.
    """
    array_bytes(h, part_of(h))  # a dtype this node holds, a shape any array may have
    itemsize = dtype_from_name(h.dtype or "uint8").itemsize
    count = math.prod(h.shape)
    if op.kind is OpKind.BROADCAST and h.op_kind is OpKind.BROADCAST and (
            0 <= h.chunk < num_chunks):
        a, b = even_layout(count, num_chunks)[h.chunk]
    elif op.kind in ROW_KINDS and h.op_kind is op.kind:
        a, b = 0, count
    else:
        raise ProtocolError(f"sent {part_of(h)} of {op.label}, a chunk this node holds no "
                            "buffer for")
    whole = count * itemsize
    if whole > memory_bytes():
        raise ProtocolError(
            f"sent {part_of(h)} of an array {h.dtype}{list(h.shape)} of {whole} bytes, more "
            f"than this machine's memory ({memory_bytes()} bytes)")
    return (b - a) * itemsize


def array_bytes(h: DataHeader, part: str) -> int:
    """The bytes of the array ``h``'s dtype and shape describe (``part`` names the frame in
    errors); a :class:`~burncoll.ProtocolError` worded "sent ..." for a dtype this process
    cannot hold, or a shape no array can have."""
    try:
        itemsize = dtype_from_name(h.dtype or "uint8").itemsize
    except CollectiveError as exc:  # a dtype this process cannot hold (no ml_dtypes)
        raise ProtocolError(f"sent {part} of dtype {h.dtype}, which this node cannot "
                            f"receive: {exc}") from exc
    # numpy's limit on an array's size counts every dimension, zero ones aside
    if math.prod(d for d in h.shape if d) * itemsize > _MAX_DIM:
        raise ProtocolError(f"sent {part} of an array of shape {list(h.shape)}, which no "
                            "array can have")
    return math.prod(h.shape) * itemsize
