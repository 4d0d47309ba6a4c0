"""What one peer passed to one operation, and how calls are compared and described."""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import NamedTuple

from burncoll.backends.base import Array
from burncoll.ops import OpKind, ReduceOp

__all__ = ["ARGUMENTS", "Call", "describe_calls", "find_mismatch"]


class Call(NamedTuple):
    """One peer's call of one operation (a named tuple, immutable as a frozen dataclass, and
    made for every operation at a third of the cost).

    ``array`` is ``None`` for a barrier and for broadcast receivers that passed nothing.
    ``dtype`` and ``shape`` describe ``array`` (``None`` when there is none).
    """

    peer_id: int
    kind: OpKind
    reduce_op: ReduceOp | None
    root: int | None
    array: Array | None
    dtype: str | None
    shape: tuple[int, ...] | None
    #: Where the caller wants the result written (``all_reduce(..., out=)``), else ``None``.
    out: Array | None = None
    #: Rows per rank: a scatter root's blocks, an all-to-all peer's send counts, a
    #: reduce-scatter's blocks (the same on every peer); ``None``: ``numpy.array_split``'s.
    counts: tuple[int, ...] | None = None
    #: An all-reduce's 16-bit wire format across nodes (``"bf16"``, ``"fp16"``), else
    #: ``None`` (:mod:`burncoll.compression`).
    compression: str | None = None

    def signature(self) -> tuple[object, ...]:
        """What must agree between peers (for the operations whose peers' arrays differ in
        length -- all_gather, gather, all_to_all -- only the trailing shape; a scatter's and
        a broadcast's only the root, the receivers having no array)."""
        if self.kind in (OpKind.BROADCAST, OpKind.SCATTER):
            return (self.kind, self.root)
        shape = _agreed_shape(self)
        if self.kind is OpKind.REDUCE_SCATTER:
            return (self.kind, self.reduce_op, self.root, self.dtype, shape, self.counts)
        if self.kind is OpKind.ALL_REDUCE:
            return (self.kind, self.reduce_op, self.root, self.dtype, shape, self.compression)
        return (self.kind, self.reduce_op, self.root, self.dtype, shape)

    def describe(self) -> str:
        """E.g. ``all_reduce(float32[4, 3], op=sum)``."""
        args: list[str] = []
        if self.array is not None:
            args.append(f"{self.dtype}{list(self.shape or ())}")
        elif self.kind in (OpKind.BROADCAST, OpKind.SCATTER):
            args.append("None")
        if self.counts is not None:
            args.append(f"counts={list(self.counts)}")
        if self.compression is not None:
            args.append(f"compression={self.compression}")
        if self.reduce_op is not None:
            args.append(f"op={self.reduce_op.label}")
        if self.root is not None:
            args.append(f"root={self.root}")
        return f"{self.kind.label}({', '.join(args)})"


def describe_calls(calls: Sequence[Call]) -> str:
    """One line per peer: ``peer 3: all_reduce(float32[4], op=sum)``."""
    return "; ".join(f"peer {c.peer_id}: {c.describe()}" for c in calls)


#: A call's arguments but its peer, arrays and ``out=``: calls alike in these agree (no
#: Python call per peer, where :meth:`Call.signature` makes one).
ARGUMENTS = operator.itemgetter(1, 2, 3, 5, 6, 8, 9)


def find_mismatch(calls: Sequence[Call]) -> str | None:
    """``None`` when the calls agree, else a sentence saying what differs."""
    first = calls[0]
    if first.kind is not OpKind.BROADCAST and all(
            map(ARGUMENTS(first).__eq__, map(ARGUMENTS, calls))):
        return None  # (the common case: the same arguments)
    agreed = first.signature()
    if all(c.signature() == agreed for c in calls[1:]):
        if first.kind is OpKind.BROADCAST:
            return _broadcast_mismatch(calls)
        return None
    return _what_differs(calls)


def _broadcast_mismatch(calls: Sequence[Call]) -> str | None:
    root = next((c for c in calls if c.peer_id == calls[0].root), None)  # (roots agree)
    if root is None:
        return None
    for c in calls:
        if c.array is not None and (c.dtype, c.shape) != (root.dtype, root.shape):
            return (
                f"broadcast receivers must pass None or an array like the root's; peers passed "
                f"different arrays: {describe_calls(calls)}"
            )
    return None


def _what_differs(calls: Sequence[Call]) -> str:
    first = calls[0]
    fields: list[str] = []
    if any(c.kind is not first.kind for c in calls):
        fields.append("operation")
    if any(c.reduce_op is not first.reduce_op for c in calls):
        fields.append("reduce op")
    if any(c.root != first.root for c in calls):
        fields.append("root")
    if any(c.dtype != first.dtype for c in calls):
        fields.append("dtype")
    if any(c.counts != first.counts for c in calls) and first.kind is OpKind.REDUCE_SCATTER:
        fields.append("counts")
    if any(c.compression != first.compression for c in calls):
        fields.append("compression")
    if any(_agreed_shape(c) != _agreed_shape(first) for c in calls) and (
            "operation" not in fields):
        fields.append("shape")
    what = ", ".join(fields) or "arguments"
    return f"peers called with different {what}: {describe_calls(calls)}"


def _agreed_shape(call: Call) -> tuple[int, ...] | None:
    """The part of ``call``'s shape that peers must agree on (as :meth:`Call.signature`)."""
    shape = call.shape
    if call.kind in (OpKind.ALL_GATHER, OpKind.GATHER, OpKind.ALL_TO_ALL) and shape:
        return shape[1:]
    return shape
