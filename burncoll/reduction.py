"""The one reduction kernel of host memory: :func:`reduce_into`.

The fused one-node all-reduce, the exchange, the host reduction, the global walk's REDUCE
steps (and the parts it combines straight out of a transport's memory), and the personalised
collectives' reduce-scatter and scans combine their operands here, element-wise, **in the
order given**: ``operands[0] op operands[1] op ... op operands[-1]``. Every node and every
peer passes them in the same (node or rank) order, so every one computes the same bits
(floating-point sums depend on their order). The inline plan uses it for NumPy arrays and the
views of torch CPU tensors; on other backends it, and the local schedules, combine with the
backend's own ops.

When the result is read again after its first pass -- a third operand, a mean's division, a
copy into other results -- the kernel works a cache-sized block (:data:`BLOCK_BYTES`) at a
time, so that each block of ``out`` stays in cache between the passes; element-wise, the
operations and their order are the same either way.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from burncoll.ops import ReduceOp

__all__ = ["BLOCK_BYTES", "reduce_into"]

NDArray = np.ndarray[Any, Any]

#: Elements are reduced in blocks of about this size (fits a core's L2 cache).
BLOCK_BYTES = 256 << 10

#: The NumPy ufunc that combines two host arrays element-wise for each op (MEAN sums: the
#: division by the peer count comes after, or through ``divisor``).
_UFUNCS: dict[ReduceOp, np.ufunc] = {
    ReduceOp.SUM: np.add,
    ReduceOp.MEAN: np.add,
    ReduceOp.MAX: np.maximum,
    ReduceOp.MIN: np.minimum,
    ReduceOp.PROD: np.multiply,
    ReduceOp.BAND: np.bitwise_and,
    ReduceOp.BOR: np.bitwise_or,
    ReduceOp.BXOR: np.bitwise_xor,
}


def reduce_into(op: ReduceOp, operands: Sequence[NDArray], out: NDArray, *,
                divisor: int | None = None, copies: Sequence[NDArray] = (),
                block_bytes: int = BLOCK_BYTES) -> NDArray:
    """``out = operands[0] op operands[1] op ... op operands[-1]``, element-wise, in that
    order; returns ``out``.

    Every array has ``out``'s number of elements. ``out`` may be ``operands[0]`` (in place);
    one operand alone is copied. Each operand is cast to ``out``'s dtype as it is combined
    (the compressed walk's 16-bit wire values are widened so, without a decoded copy); the
    arithmetic is that of ``out``'s dtype, as NumPy's ufuncs do it (float16 and bfloat16 round
    after every operation). A MEAN sums, and, given ``divisor`` (the peers the mean is over),
    divides the sum by it in ``out``'s dtype (a float). Each finished block is also copied
    into every array of ``copies`` (every other peer's result) while it is in cache.
    """
    ufunc = _UFUNCS[op]
    divisor = divisor if op is ReduceOp.MEAN else None
    passes = len(operands) - 1 + len(copies) + (divisor is not None)
    if out.nbytes <= block_bytes or passes <= 1 or not all(
            a.flags.c_contiguous for a in (out, *copies)):  # (blocks are of flat views)
        _reduce_block(ufunc, operands, out, divisor, copies)  # whole arrays, one block
        return out
    flat = out.reshape(-1)
    flat_operands = [x.reshape(-1) for x in operands]
    flat_copies = [c.reshape(-1) for c in copies]
    step = max(1, block_bytes // out.itemsize)
    for a in range(0, flat.size, step):
        b = a + step
        _reduce_block(ufunc, [x[a:b] for x in flat_operands], flat[a:b], divisor,
                      [c[a:b] for c in flat_copies])
    return out


def _reduce_block(ufunc: np.ufunc, operands: Sequence[NDArray], out: NDArray,
                  divisor: int | None, copies: Sequence[NDArray]) -> None:
    """One block of :func:`reduce_into`: the operands in order, the division, the copies."""
    if len(operands) == 1:
        if operands[0] is not out:
            out[...] = operands[0]
    else:
        ufunc(operands[0], operands[1], out=out, dtype=out.dtype)
        for x in operands[2:]:
            ufunc(out, x, out=out, dtype=out.dtype)
    if divisor is not None:
        np.divide(out, divisor, out=out)
    for c in copies:
        c[...] = out
