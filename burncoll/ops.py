"""Enumerations shared by every layer: the reduce operations and the collective kinds.

Their integer codes travel on the wire (``transport/wire.py``); never renumber them.
"""

from __future__ import annotations

import enum

from burncoll.errors import UsageError

__all__ = ["OpKind", "ReduceOp", "parse_reduce_op"]


class ReduceOp(enum.IntEnum):
    """How the arrays of all peers are combined element-wise."""

    SUM = 1
    MEAN = 2
    MAX = 3
    MIN = 4
    PROD = 5

    @property
    def label(self) -> str:
        """The name users write: ``"sum"``, ``"mean"``, ..."""
        return self.name.lower()


class OpKind(enum.IntEnum):
    """The collective operations."""

    ALL_REDUCE = 1
    REDUCE = 2
    BROADCAST = 3
    REDUCE_SCATTER = 4
    ALL_GATHER = 5
    BARRIER = 6

    @property
    def label(self) -> str:
        """The method name: ``"all_reduce"``, ``"reduce"``, ..."""
        return self.name.lower()


_REDUCE_OPS_BY_NAME = {op.label: op for op in ReduceOp}


def parse_reduce_op(op: ReduceOp | str) -> ReduceOp:
    """Return the :class:`ReduceOp` for ``op``, a member or one of its lower-case names.

    Raises :class:`~burncoll.UsageError` naming the accepted values otherwise.
    """
    if isinstance(op, ReduceOp):
        return op
    if isinstance(op, str) and op.lower() in _REDUCE_OPS_BY_NAME:
        return _REDUCE_OPS_BY_NAME[op.lower()]
    accepted = ", ".join(repr(name) for name in _REDUCE_OPS_BY_NAME)
    raise UsageError(f"unknown reduce op {op!r}; use one of {accepted} or burncoll.ReduceOp")
