"""The benchmark's data: each peer's input, and the expected result computed with NumPy.

Inputs are cheap deterministic patterns: element ``i`` of rank ``r`` is
``(37 i + 101 r + 11) mod 251``, shifted to ``[-125, 125]`` for signed integers and scaled by
1/64 for floating dtypes (values in ``[-1.95, 1.95]``, exact in every float dtype). The
reference is computed in float64 (int64 for integers, wrapped to the dtype as the integer
arithmetic of every backend wraps) from all ranks' inputs, and each peer's result is compared
element by element:

* integers, max, min, broadcast and all-gather: exactly;
* float sum: ``|got - ref| <= eps * n * sum_r |x_r|``, a bound on the rounding error of any
  summation order of ``n`` terms (Higham, *Accuracy and Stability of Numerical Algorithms*,
  2nd ed., §4.2), with ``eps`` the dtype's machine epsilon (twice the unit roundoff);
* float mean: the same bound divided by ``n`` plus one rounding; prod: ``eps (n + 1) |ref|``.

A result of the wrong shape or dtype, or a result where ``None`` was due (or the converse),
counts every expected element as wrong.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

import numpy as np

from burncoll.compression import error_bound
from burncoll.dtypes import dtype_from_name
from burncoll.strategies.layout import even_layout

__all__ = ["Expected", "ReferenceCache", "count_wrong", "element_counts", "peer_input"]

NDArray = np.ndarray[Any, Any]

_EPS = {"float16": 2.0**-10, "bfloat16": 2.0**-7, "float32": 2.0**-23, "float64": 2.0**-52}
#: How the reference folds each rank's input into the running result (``mean``: sum, then /n).
_FOLD = {"sum": np.add, "mean": np.add, "prod": np.multiply, "max": np.maximum,
         "min": np.minimum}


def element_counts(op: str, size: int, itemsize: int, world: int) -> tuple[int, int]:
    """``(total, per_peer_input)`` elements for a sweep size of ``size`` bytes. ``total`` counts the
    op's largest buffer (as nccl-tests' ``count`` column): the input of all-reduce, reduce,
    broadcast and reduce-scatter, the output of all-gather. It is rounded down to whole elements,
    and for reduce-scatter and all-gather to a multiple of ``world``."""
    total = size // itemsize
    if op in ("reduce_scatter", "all_gather"):
        total -= total % world
    per_peer = total // world if op == "all_gather" else total
    return total, per_peer


def _pattern(rank: int, count: int) -> NDArray:
    index = np.arange(count, dtype=np.int64)
    index *= 37
    index += 101 * rank + 11
    index %= 251
    return index


def peer_input(rank: int, count: int, dtype: str) -> NDArray:
    """Rank ``rank``'s input of ``count`` elements of ``dtype`` (see the module doc)."""
    values = _pattern(rank, count)
    np_dtype = dtype_from_name(dtype)
    if dtype in _EPS:
        return ((values - 125) / 64.0).astype(np_dtype)
    if np.issubdtype(np_dtype, np.signedinteger):
        values -= 125
    return values.astype(np_dtype)


@dataclass(frozen=True)
class Expected:
    """The expected result of one peer: values, and the tolerance (``None``: exact)."""

    values: NDArray
    tolerance: NDArray | None
    #: The dtype the result must have.
    dtype: np.dtype[Any]


def count_wrong(got: NDArray | None, expected: Expected | None) -> int:
    """Elements of ``got`` outside tolerance; ``expected is None`` means ``got`` must be too."""
    if expected is None:
        return 0 if got is None else max(int(got.size), 1)
    want = expected.values
    if got is None or got.shape != want.shape or got.dtype != expected.dtype:
        return max(int(want.size), 1)
    if expected.tolerance is None:
        return int(np.count_nonzero(got != want))
    diff = np.abs(got.astype(np.float64) - want)
    return int(np.count_nonzero(~(diff <= expected.tolerance)))


class ReferenceCache:
    """The full reference of the current (op, size), computed once per node. Local peers are threads
    of one process; the first one to ask computes the reference and the others reuse it. Only the
    latest few entries are kept."""

    def __init__(self, world: int, compression: str | None = None, nodes: int = 1) -> None:
        self.world = world
        #: A compressed all-reduce's wire format and the node count: its error bound
        #: (:func:`burncoll.compression.error_bound`) widens the float tolerances.
        self.compression = compression if nodes > 1 else None
        self.nodes = nodes
        self._lock = threading.Lock()
        self._entries: dict[tuple[Any, ...], Expected] = {}

    def expected(self, op: str, count: int, dtype: str, redop: str, root: int,
                 rank: int) -> Expected | None:
        """What rank ``rank`` must get from ``op`` on ``count``-element inputs."""
        if op == "reduce" and rank != root:
            return None
        key = (op, count, dtype,
               redop if op in ("all_reduce", "reduce", "reduce_scatter") else None,
               root if op == "broadcast" else None)
        with self._lock:
            full = self._entries.get(key)
            if full is None:
                if len(self._entries) >= 2:
                    self._entries.clear()
                full = self._entries[key] = self._compute(op, count, dtype, redop, root)
        if op != "reduce_scatter":
            return full
        start, stop = even_layout(count, self.world)[rank]  # numpy.array_split's block
        tolerance = None if full.tolerance is None else full.tolerance[start:stop]
        return Expected(full.values[start:stop], tolerance, full.dtype)

    def _compute(self, op: str, count: int, dtype: str, redop: str, root: int) -> Expected:
        np_dtype = dtype_from_name(dtype)
        if op == "broadcast":
            return Expected(peer_input(root, count, dtype), None, np_dtype)
        if op == "all_gather":
            parts = [peer_input(r, count // self.world, dtype) for r in range(self.world)]
            return Expected(np.concatenate(parts), None, np_dtype)
        if dtype in _EPS:
            return self._float_reduction(count, dtype, redop)
        return self._int_reduction(count, dtype, redop)

    def _float_reduction(self, count: int, dtype: str, redop: str) -> Expected:
        inputs = (peer_input(r, count, dtype).astype(np.float64) for r in range(self.world))
        n, eps = self.world, _EPS[dtype]
        ref = next(inputs)
        abs_sum = np.abs(ref)
        for x in inputs:
            _FOLD[redop](ref, x, out=ref)
            if redop in ("sum", "mean"):
                abs_sum += np.abs(x)
        if redop == "sum":
            tolerance = abs_sum * (eps * n)
        elif redop == "mean":
            ref /= n
            tolerance = abs_sum * (eps * (n + 1) / n)
        elif redop == "prod":
            tolerance = np.abs(ref) * (eps * (n + 1))
        else:
            tolerance = np.zeros_like(ref)
        if self.compression is not None and dtype in ("float32", "float64"):
            magnitude = abs_sum / n if redop == "mean" else (
                abs_sum if redop == "sum" else np.abs(ref) * n)
            tolerance = tolerance + error_bound(self.compression, self.nodes, magnitude, dtype)
        return Expected(ref, tolerance, dtype_from_name(dtype))

    def _int_reduction(self, count: int, dtype: str, redop: str) -> Expected:
        np_dtype = dtype_from_name(dtype)
        with np.errstate(over="ignore"):
            inputs = (peer_input(r, count, dtype).astype(np.int64) for r in range(self.world))
            ref = next(inputs)
            for x in inputs:
                _FOLD[redop](ref, x, out=ref)
            wrapped = ref.astype(np_dtype)
        if redop != "mean":
            return Expected(wrapped, None, np_dtype)
        mean = wrapped.astype(np.float64) / self.world
        return Expected(mean, np.abs(mean) * (4 * _EPS["float64"]), np.dtype(np.float64))
