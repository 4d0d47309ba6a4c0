"""The one host reduction kernel, :func:`burncoll.reduction.reduce_into`, on its own.

Every op on several dtypes, 1-5 operands, in place and not, sizes around its block
boundaries: each result is checked against a reference computed in float64 (exactly in int64
for integers and bools), and, bit for bit, against the operands folded left in their own
dtype (``((x0 op x1) op x2) ...``), the node order every node and peer relies on for
identical bits.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

import burncoll
from burncoll.dtypes import dtype_from_name
from burncoll.ops import ReduceOp
from burncoll.reduction import BLOCK_BYTES, reduce_into

NDArray = np.ndarray[Any, Any]

try:  # ml_dtypes comes with jax
    dtype_from_name("bfloat16")
    HAVE_BF16 = True
except burncoll.UsageError:  # pragma: no cover - ml_dtypes missing
    HAVE_BF16 = False

#: Twice the unit roundoff of each float dtype, and its smallest (subnormal) step.
EPS = {"float16": 2.0**-10, "bfloat16": 2.0**-7, "float32": 2.0**-23, "float64": 2.0**-52}
TINY = {"float16": 2.0**-24, "bfloat16": 2.0**-133, "float32": 2.0**-149,
        "float64": 2.0**-1074}
FLOATS = list(EPS)
INTEGERS = ["int8", "int32", "uint16", "int64"]
#: The test's own element-wise ops (the reference does not borrow the kernel's table).
PAIRWISE: dict[ReduceOp, Callable[..., Any]] = {
    ReduceOp.SUM: np.add, ReduceOp.MEAN: np.add, ReduceOp.MAX: np.maximum,
    ReduceOp.MIN: np.minimum, ReduceOp.PROD: np.multiply, ReduceOp.BAND: np.bitwise_and,
    ReduceOp.BOR: np.bitwise_or, ReduceOp.BXOR: np.bitwise_xor,
}
#: A block of 64 bytes: sizes below cross it many times, cheaply.
SMALL_BLOCK = 64


def _cases() -> list[tuple[ReduceOp, str]]:
    cases = [(op, d) for op in ReduceOp if not op.bitwise for d in FLOATS]
    cases += [(op, d) for op in ReduceOp if op is not ReduceOp.MEAN
              for d in [*INTEGERS, "bool"]]
    return cases


def _dtype(name: str) -> np.dtype[Any]:
    if name == "bfloat16" and not HAVE_BF16:  # pragma: no cover - ml_dtypes missing
        pytest.skip("bfloat16 needs ml_dtypes")
    return dtype_from_name(name)


def _operands(k: int, size: int, dtype: np.dtype[Any], seed: int) -> list[NDArray]:
    """``k`` arrays of ``size``: floats in [-4, 4) (a product of 5 stays finite in float16),
    small integers (their sums and products of 5 fit an int64 exactly), random bools."""
    rng = np.random.default_rng([seed, k, size])
    if dtype == np.bool_:
        return [rng.random(size) < 0.7 for _ in range(k)]
    if dtype.kind in "iu":
        low = 0 if dtype.kind == "u" else -40
        return [rng.integers(low, 40, size).astype(dtype) for _ in range(k)]
    return [rng.uniform(-4, 4, size).astype(dtype) for _ in range(k)]


def _left_fold(op: ReduceOp, xs: list[NDArray]) -> NDArray:
    """``((x0 op x1) op x2) ...`` in the operands' dtype, one whole array at a time."""
    acc = np.array(xs[0], copy=True)
    for x in xs[1:]:
        PAIRWISE[op](acc, x, out=acc)
    return acc


def _check(op: ReduceOp, xs: list[NDArray], got: NDArray, divisor: int, what: str) -> None:
    """``got`` against float64 (or exact int64) and, bit for bit, against the left fold."""
    dtype = xs[0].dtype
    with np.errstate(over="ignore"):
        exact = _left_fold(op, xs)
        if op is ReduceOp.MEAN:
            np.divide(exact, divisor, out=exact)
    assert got.dtype == dtype and got.shape == xs[0].shape, what
    assert got.tobytes() == exact.tobytes(), f"{what}: not the left fold's bits"
    name = dtype.name
    if name in EPS:
        wide = [x.astype(np.float64) for x in xs]
        ref = _left_fold(op, wide) / (divisor if op is ReduceOp.MEAN else 1)
        steps = len(xs) + (op is ReduceOp.MEAN)
        scale = (np.abs(ref) if op is ReduceOp.PROD
                 else sum(np.abs(w) for w in wide) / (divisor if op is ReduceOp.MEAN else 1))
        error = np.abs(got.astype(np.float64) - ref)
        bound = steps * EPS[name] * scale + 4.0**steps * TINY[name]  # (products underflow)
        assert np.all(error <= bound), f"{what}: {error.max()}"
    else:  # integers (wrapping as the dtype does) and bools (nonzero)
        ref = _left_fold(op, [x.astype(np.int64) for x in xs])
        assert np.array_equal(got, ref.astype(dtype)), what


@pytest.mark.parametrize(("op", "dtype"), _cases(), ids=lambda v: getattr(v, "label", v))
def test_every_op_and_dtype_against_float64(op: ReduceOp, dtype: str) -> None:
    """2-5 operands into a fresh array and into the first operand (in place), one to many
    blocks with the last one partial; the divisor of a mean divides only a mean."""
    dt = _dtype(dtype)
    per_block = SMALL_BLOCK // dt.itemsize
    sizes = [1, per_block - 1, per_block, per_block + 1, 7 * per_block + 3]
    for k in (2, 3, 4, 5):
        for size in sizes:
            for in_place in (False, True):
                xs = _operands(k, size, dt, seed=size)
                operands = [x.copy() for x in xs]
                out = operands[0] if in_place else np.full_like(xs[0], 1)
                what = f"{op.label} of {k} x {size} {dtype} (in place: {in_place})"
                with np.errstate(over="ignore"):
                    got = reduce_into(op, operands, out, divisor=k, block_bytes=SMALL_BLOCK)
                assert got is out, what
                _check(op, xs, got, k, what)
                assert all(np.array_equal(a, b)
                           for a, b in zip(operands[1:], xs[1:], strict=True)), what


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_default_block_with_copies(dtype: str) -> None:
    """A mean of 3 operands over 3 default blocks and one element, each block copied into two
    other results: every copy holds the result's bits, the divided sum."""
    dt = _dtype(dtype)
    size = 3 * BLOCK_BYTES // dt.itemsize + 1
    xs = _operands(3, size, dt, seed=1)
    out, copies = np.empty_like(xs[0]), [np.full_like(xs[0], 7) for _ in range(2)]
    reduce_into(ReduceOp.MEAN, xs, out, divisor=3, copies=copies)
    _check(ReduceOp.MEAN, xs, out, 3, f"mean of 3 x {size} {dtype}")
    assert all(c.tobytes() == out.tobytes() for c in copies)


def test_the_order_is_the_operands_order() -> None:
    """float32 sums whose bits depend on the order: the kernel's are those of its operands'
    order, in every block, and another order gives other bits (so the check can fail)."""
    big = np.float32(2.0**25)
    column = [np.float32(1), big, np.float32(1), -big]  # 0 in this order, 2 in another
    xs = [np.full(5 * SMALL_BLOCK, v, np.float32) for v in column]
    out = reduce_into(ReduceOp.SUM, xs, np.empty_like(xs[0]), block_bytes=SMALL_BLOCK)
    assert np.all(out == 0.0)
    swapped = reduce_into(ReduceOp.SUM, [xs[1], xs[3], xs[0], xs[2]], np.empty_like(xs[0]),
                          block_bytes=SMALL_BLOCK)
    assert np.all(swapped == 2.0)


@pytest.mark.parametrize("dtype", ["int32", "float32"])
def test_a_mean_without_a_divisor_sums(dtype: str) -> None:
    """The mean's division belongs to the caller when it passes no divisor (integers then
    become float64 there): the kernel sums."""
    xs = _operands(4, 100, np.dtype(dtype), seed=4)
    out = reduce_into(ReduceOp.MEAN, xs, np.empty_like(xs[0]), block_bytes=SMALL_BLOCK)
    _check(ReduceOp.SUM, xs, out, 1, f"mean of 4 {dtype} without a divisor")


def test_one_operand_is_copied() -> None:
    """One node alone: its array is the result (copied into a separate out; in place, kept)."""
    x = np.arange(10, dtype=np.float64)
    out = reduce_into(ReduceOp.MAX, [x], np.zeros_like(x))
    assert np.array_equal(out, np.arange(10)) and not np.shares_memory(out, x)
    assert reduce_into(ReduceOp.MAX, [x], x) is x and np.array_equal(x, np.arange(10))


def test_16_bit_operands_are_widened_into_out() -> None:
    """The compressed walk's case: float16 wire values combined into float32, in float32."""
    rng = np.random.default_rng(3)
    source = rng.uniform(-4, 4, 1000).astype(np.float32)
    values = rng.uniform(-4, 4, 1000).astype(np.float16)
    out = reduce_into(ReduceOp.SUM, (source, values), np.empty_like(source))
    ref = source.astype(np.float64) + values.astype(np.float64)
    assert out.dtype == np.float32
    assert np.all(np.abs(out - ref) <= EPS["float32"] * np.abs(ref))


def test_multidimensional_and_strided_arrays() -> None:
    """Shapes are kept; a strided (non-contiguous) out or copy is written where it lies."""
    xs = _operands(3, 24, np.dtype(np.float64), seed=5)
    grids = [x.reshape(4, 6) for x in xs]
    out = reduce_into(ReduceOp.PROD, grids, np.empty((4, 6)), block_bytes=SMALL_BLOCK)
    _check(ReduceOp.PROD, grids, out, 1, "prod of 3 4x6 float64")
    for strided_out in (True, False):
        backing = np.zeros((4, 12))
        strided = backing[:, :6]  # (rows apart: no flat view of it)
        out, copy = (strided, np.zeros((4, 6))) if strided_out else (np.zeros((4, 6)), strided)
        reduce_into(ReduceOp.MEAN, grids, out, divisor=3, copies=[copy],
                    block_bytes=SMALL_BLOCK)
        _check(ReduceOp.MEAN, grids, out, 3, f"mean (strided out: {strided_out})")
        assert copy.tobytes() == out.tobytes() and np.all(backing[:, 6:] == 0)
