"""What one peer passed to one operation, and how calls are compared and described."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from burncoll.backends.base import Array
from burncoll.ops import OpKind, ReduceOp

__all__ = ["Call", "describe_calls", "find_mismatch"]


@dataclass(frozen=True, slots=True)
class Call:
    """One peer's call of one operation.

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

    def signature(self) -> tuple[object, ...]:
        """What must agree between peers (for all_gather, only the trailing shape)."""
        shape: tuple[int, ...] | None = self.shape
        if self.kind is OpKind.ALL_GATHER and shape is not None:
            shape = shape[1:]
        if self.kind is OpKind.BROADCAST:
            return (self.kind, self.root)
        return (self.kind, self.reduce_op, self.root, self.dtype, shape)

    def describe(self) -> str:
        """E.g. ``all_reduce(float32[4, 3], op=sum)``."""
        args: list[str] = []
        if self.array is not None:
            args.append(f"{self.dtype}{list(self.shape or ())}")
        elif self.kind is OpKind.BROADCAST:
            args.append("None")
        if self.reduce_op is not None:
            args.append(f"op={self.reduce_op.label}")
        if self.root is not None:
            args.append(f"root={self.root}")
        return f"{self.kind.label}({', '.join(args)})"


def describe_calls(calls: Sequence[Call]) -> str:
    """One line per peer: ``peer 3: all_reduce(float32[4], op=sum)``."""
    return "; ".join(f"peer {c.peer_id}: {c.describe()}" for c in calls)


def find_mismatch(calls: Sequence[Call]) -> str | None:
    """``None`` when the calls agree, else a sentence saying what differs."""
    first = calls[0]
    if all(c.signature() == first.signature() for c in calls[1:]):
        if first.kind is OpKind.BROADCAST:
            return _broadcast_mismatch(calls)
        return None
    return _what_differs(calls)


def _broadcast_mismatch(calls: Sequence[Call]) -> str | None:
    root = next((c for c in calls if c.peer_id == first_root(calls)), None)
    if root is None:
        return None
    for c in calls:
        if c.array is not None and (c.dtype, c.shape) != (root.dtype, root.shape):
            return (
                f"broadcast receivers must pass None or an array like the root's; peers passed "
                f"different arrays: {describe_calls(calls)}"
            )
    return None


def first_root(calls: Sequence[Call]) -> int | None:
    """The root every call names (they agree once the signatures match)."""
    return calls[0].root


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
    if any(c.signature()[-1] != first.signature()[-1] for c in calls) and "operation" not in fields:
        fields.append("shape")
    what = ", ".join(fields) or "arguments"
    return f"peers called with different {what}: {describe_calls(calls)}"
