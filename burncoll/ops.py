"""Enumerations shared by every layer: the reduce operations and the collective kinds.

Their integer codes travel on the wire (``protocol/wire.py``); never renumber them.
"""

from __future__ import annotations

import enum
from functools import cached_property

from burncoll.errors import UsageError

__all__ = [
    "BITWISE_DTYPES", "ROW_KINDS", "OpKind", "ReduceOp", "check_reduce_dtype", "parse_reduce_op",
]

#: The dtypes (by the name users write) the bitwise reduce ops accept: integers and bool.
BITWISE_DTYPES: tuple[str, ...] = (
    "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64", "bool",
)


class ReduceOp(enum.IntEnum):
    """How the arrays of all peers are combined element-wise.

    ``BAND``, ``BOR`` and ``BXOR`` (bitwise AND, OR, XOR) take integer and bool arrays only.
    """

    #: The element-wise sum (``"sum"``).
    SUM = 1
    #: The sum divided by the number of peers (``"mean"`` or ``"avg"``); integer inputs give
    #: float64.
    MEAN = 2
    #: The element-wise maximum (``"max"``).
    MAX = 3
    #: The element-wise minimum (``"min"``).
    MIN = 4
    #: The element-wise product (``"prod"``).
    PROD = 5
    #: Bitwise AND (``"band"``); integer and bool arrays only.
    BAND = 6
    #: Bitwise OR (``"bor"``); integer and bool arrays only.
    BOR = 7
    #: Bitwise XOR (``"bxor"``); integer and bool arrays only.
    BXOR = 8

    @cached_property  # (on every call's path: read once per member)
    def label(self) -> str:
        """The name users write: ``"sum"``, ``"mean"``, ..., ``"band"``."""
        return self.name.lower()

    @cached_property
    def bitwise(self) -> bool:
        """True for the bitwise ops, which take integer and bool arrays only."""
        return self in (ReduceOp.BAND, ReduceOp.BOR, ReduceOp.BXOR)


class OpKind(enum.IntEnum):
    """The collective operations."""

    ALL_REDUCE = 1
    REDUCE = 2
    BROADCAST = 3
    REDUCE_SCATTER = 4
    ALL_GATHER = 5
    BARRIER = 6
    GATHER = 7
    SCATTER = 8
    ALL_TO_ALL = 9
    SCAN = 10
    EXSCAN = 11
    #: A point-to-point message (``send``/``recv``), not a collective: its frames never
    #: enter the collectives' mailbox.
    P2P = 12

    @cached_property
    def label(self) -> str:
        """The method name: ``"all_reduce"``, ``"reduce"``, ..."""
        return self.name.lower()


#: The operations whose arrays travel between nodes with their own rows (a chunk's header
#: carries its shape: its rows, then the call's trailing shape), so a receiver learns each
#: block's length from the sender.
ROW_KINDS = frozenset({OpKind.ALL_GATHER, OpKind.GATHER, OpKind.SCATTER, OpKind.ALL_TO_ALL,
                       OpKind.SCAN, OpKind.EXSCAN})

#: Every name ``parse_reduce_op`` accepts: each member's label, and ``"avg"`` (the name
#: ``torch.distributed.ReduceOp.AVG`` uses) for the mean.
_REDUCE_OPS_BY_NAME = {**{op.label: op for op in ReduceOp}, "avg": ReduceOp.MEAN}


def parse_reduce_op(op: ReduceOp | str) -> ReduceOp:
    """Return the :class:`ReduceOp` for ``op``, a member or one of its lower-case names.

    The names are the members' labels (``"sum"``, ``"mean"``, ``"max"``, ``"min"``,
    ``"prod"``, ``"band"``, ``"bor"``, ``"bxor"``) and ``"avg"``, an alias of ``"mean"``.

    Raises :class:`~burncoll.UsageError` naming the accepted values otherwise.
    """
    if isinstance(op, ReduceOp):
        return op
    named = _REDUCE_OPS_BY_NAME.get(op) if isinstance(op, str) else None
    if named is not None:
        return named
    if isinstance(op, str) and op.lower() in _REDUCE_OPS_BY_NAME:
        return _REDUCE_OPS_BY_NAME[op.lower()]
    accepted = ", ".join(repr(name) for name in _REDUCE_OPS_BY_NAME)
    raise UsageError(f"unknown reduce op {op!r}; use one of {accepted} or burncoll.ReduceOp")


def check_reduce_dtype(op: ReduceOp, dtype: str, what: str) -> None:
    """Raise :class:`~burncoll.UsageError` when ``op`` cannot combine arrays of ``dtype``.

    The bitwise ops take integer and bool arrays only; every other op takes every dtype.
    ``what`` names the operation in the message (``"all_reduce"``).
    """
    if op.bitwise and dtype not in BITWISE_DTYPES:
        raise UsageError(
            f"{what}: {op.label} needs integer or bool arrays, got {dtype}; use "
            f"{', '.join(BITWISE_DTYPES)}, or another op for {dtype} arrays"
        )
