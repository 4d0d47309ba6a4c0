"""The fused local all-reduce (``burncoll.local.plans.fused``): ``auto``, one node, NumPy backend,
arrays above ``INLINE_BYTES``. Every peer thread reduces its share of the elements, block by
block, in peer order, and writes it into every peer's result.

Checked against two references: a float64 NumPy reduction (with a dtype-appropriate
tolerance), and the left fold ``x0 op x1 op ... op x(d-1)`` in the array's own dtype, which the
fused path must reproduce bit for bit (the same order as the inline path). Inputs are made
read-only, so any write into one raises. A counting wrapper around ``FusedBuffers.run``
observes which path ran without changing what it does.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

import burncoll
from burncoll.dtypes import dtype_from_name
from burncoll.local.plans.fused import FusedBuffers
from burncoll.reduction import BLOCK_BYTES
from burncoll.strategies.auto import INLINE_BYTES
from tests.api.test_single_node_ops import REDUCERS, _config, _inputs
from tests.harness import run_peers

try:  # registers the "bfloat16" name with NumPy (ml_dtypes comes with jax)
    dtype_from_name("bfloat16")
    HAVE_BF16 = True
except burncoll.UsageError:  # pragma: no cover - ml_dtypes missing
    HAVE_BF16 = False

OPS = ["sum", "mean", "max", "min", "prod"]
FLOATS = ["float16", "bfloat16", "float32", "float64"]
INTS = ["int32", "int64", "uint8"]
_UFUNC = {"sum": np.add, "mean": np.add, "max": np.maximum, "min": np.minimum,
          "prod": np.multiply}
#: Unit roundoff of each float dtype (bfloat16 has 8 significant bits).
_EPS = {"float16": 2.0**-11, "bfloat16": 2.0**-8, "float32": 2.0**-24, "float64": 2.0**-53}


class FusedSpy:
    """Counts calls of ``FusedBuffers.run`` (wrapped, never replaced) and remembers what
    each returned, to tell which path an all-reduce took."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.returned: list[Any] = []
        real = FusedBuffers.run

        def counting(*args: Any, **kwargs: Any) -> Any:
            result = real(*args, **kwargs)
            self.returned.append(result)
            return result

        monkeypatch.setattr(FusedBuffers, "run", counting)

    @property
    def calls(self) -> int:
        return len(self.returned)

    def clear(self) -> None:
        self.returned.clear()


@pytest.fixture
def spy(monkeypatch: pytest.MonkeyPatch) -> FusedSpy:
    return FusedSpy(monkeypatch)


def _skip_missing(dtype: str) -> None:
    if dtype == "bfloat16" and not HAVE_BF16:  # pragma: no cover - ml_dtypes missing
        pytest.skip("bfloat16 needs ml_dtypes")


def _count_above_inline(dtype: str, extra: int = 3) -> int:
    """Element count just above ``INLINE_BYTES`` (by ``extra`` elements) for ``dtype``."""
    return INLINE_BYTES // dtype_from_name(dtype).itemsize + extra


def _frozen_inputs(n: int, shape: tuple[int, ...], dtype: str, seed: int) -> list[np.ndarray]:
    """``_inputs`` made read-only: writing one raises, so "inputs untouched" is enforced."""
    if dtype.startswith("uint"):  # _inputs draws -3..3: unsigned ones stay non-negative
        rng = np.random.default_rng(seed)
        xs = [rng.integers(0, 4, size=shape).astype(dtype) for _ in range(n)]
    else:
        xs = _inputs(n, shape, dtype, seed)
    for x in xs:
        x.flags.writeable = False
    return xs


def _fold(xs: list[np.ndarray], op: str) -> np.ndarray:
    """``x0 op x1 op ... op x(d-1)`` in the inputs' dtype: the fused path's exact bits."""
    total: np.ndarray = functools.reduce(_UFUNC[op], xs)
    if op == "mean":
        total = np.divide(total, len(xs), dtype=total.dtype)
    return total


def _reference(xs: list[np.ndarray], op: str) -> np.ndarray:
    result: np.ndarray = REDUCERS[op](np.stack([x.astype(np.float64) for x in xs]))
    return result


def _assert_close(result: np.ndarray, xs: list[np.ndarray], op: str) -> None:
    """``result`` against the float64 reference, within what ``len(xs) - 1`` roundings of the
    dtype (plus one for the mean's division) can explain."""
    ref = _reference(xs, op)
    dtype = xs[0].dtype.name
    got = result.astype(np.float64)
    if dtype not in _EPS:
        np.testing.assert_array_equal(got, ref, err_msg=f"{op} of {dtype}")
        return
    # n - 1 roundings of the fold, one of the mean's division, one more for slack; a product
    # has no cancellation (relative error only), a sum is bounded by n * max|x|
    tol = 2 * (len(xs) + 1) * _EPS[dtype]
    scale = float(max(np.max(np.abs(x.astype(np.float64)), initial=0.0) for x in xs))
    bound = 1.0 if op == "prod" else scale * (len(xs) if op == "sum" else 1)
    np.testing.assert_allclose(got, ref, rtol=tol, atol=tol * bound, err_msg=f"{op} of {dtype}")


def _check(results: list[Any], xs: list[np.ndarray], op: str, shape: tuple[int, ...]) -> None:
    """Every peer got the same bits, the fused fold's bits, close to the float64 reference;
    the inputs are intact; no result shares memory with an input or another result."""
    expected = _fold(xs, op)
    for i, r in enumerate(results):
        assert isinstance(r, np.ndarray), r
        assert r.shape == shape and r.dtype == xs[0].dtype, (r.shape, r.dtype)
        assert r.tobytes() == results[0].tobytes(), f"peer {i} got different bits"
        for x in xs:
            assert not np.may_share_memory(r, x)
        for other in results[:i]:
            assert not np.may_share_memory(r, other)
    assert results[0].tobytes() == expected.tobytes(), f"{op} is not the peer-order fold"
    _assert_close(results[0], xs, op)


def _all_reduce(n: int, xs: list[np.ndarray], op: str,
                strategy: str = "auto") -> list[Any]:
    return run_peers(_config(n, strategy), lambda c, i: c.all_reduce(xs[i], op=op))


# -- every op, dtype and peer count -----------------------------------------------------------


@pytest.mark.parametrize("n", [2, 3, 4])
@pytest.mark.parametrize("dtype", [*FLOATS, *INTS])
def test_every_op_and_dtype_is_fused_and_bitwise_identical(
    spy: FusedSpy, n: int, dtype: str,
) -> None:
    """1 MiB + 3 elements: not divisible by 2, 3 or 4 peers, a few blocks per peer."""
    _skip_missing(dtype)
    shape = (_count_above_inline(dtype),)
    for op in OPS:
        if op == "mean" and dtype in INTS:
            continue  # not fused: test_mean_of_integers_falls_back_to_float64
        if op == "prod" and dtype == "uint8":
            continue  # wraps around: the float64 reference cannot follow
        xs = _frozen_inputs(n, shape, dtype, seed=n * 7 + OPS.index(op))
        spy.clear()
        results = _all_reduce(n, xs, op)
        assert spy.calls == n, f"{op} of {dtype} did not take the fused path"
        _check(results, xs, op, shape)


@pytest.mark.parametrize("n", [2, 3, 4])
def test_many_blocks_per_peer(spy: FusedSpy, n: int) -> None:
    """8 MiB: every peer's share spans many BLOCK_BYTES blocks, the last one partial."""
    count = (8 << 20) // 4 + 5
    assert count * 4 // n > 4 * BLOCK_BYTES
    for op, dtype in (("sum", "float32"), ("max", "float32"), ("mean", "float64")):
        xs = _frozen_inputs(n, (count if dtype == "float32" else count // 2,), dtype, seed=n)
        spy.clear()
        results = _all_reduce(n, xs, op)
        assert spy.calls == n
        _check(results, xs, op, xs[0].shape)


@pytest.mark.parametrize("n", [2, 3, 4, 5, 8])
def test_sizes_around_the_inline_limit_and_the_block(spy: FusedSpy, n: int) -> None:
    """Exactly INLINE_BYTES runs inline, one element more is fused; element counts that leave
    some peers one element fewer, a share of one block plus one element, of a whole number of
    blocks, or (5 and 8 peers) less than one block."""
    per_block = BLOCK_BYTES // 4
    at_limit = INLINE_BYTES // 4
    counts = sorted({at_limit, at_limit + 1, at_limit + n - 1, n * per_block + 1,
                     n * (per_block + 1), (n + 1) * per_block - 1, 5 * per_block})
    for count in counts:
        fused = count * 4 > INLINE_BYTES
        xs = _frozen_inputs(n, (count,), "float32", seed=count)
        spy.clear()
        results = _all_reduce(n, xs, "sum")
        assert spy.calls == (n if fused else 0), count
        _check(results, xs, "sum", (count,))


def test_multidimensional_and_non_contiguous_inputs(spy: FusedSpy) -> None:
    """Shapes are kept; transposed, Fortran-ordered and strided inputs are read correctly."""
    n = 3
    base = _frozen_inputs(n, (700, 401), "float64", seed=11)  # 2.2 MB
    variants: list[list[np.ndarray]] = [
        base,
        [x.T for x in base],  # Fortran order
        [np.asfortranarray(x) for x in base],
        [x[:, ::2] for x in base],  # strided, 1.1 MB
        [base[0].T, np.ascontiguousarray(base[1].T), base[2].T],  # mixed layouts
    ]
    for xs in variants:
        for x in xs:
            x.flags.writeable = False
        kept = [np.array(x) for x in xs]
        spy.clear()
        results = _all_reduce(n, xs, "sum")
        assert spy.calls == n
        assert all(r.flags.c_contiguous for r in results)
        _check(results, [np.ascontiguousarray(x) for x in xs], "sum", xs[0].shape)
        for x, k in zip(xs, kept, strict=True):
            np.testing.assert_array_equal(x, k)


def test_peers_may_share_one_input_array(spy: FusedSpy) -> None:
    n = 4
    x = _frozen_inputs(1, (_count_above_inline("float32"),), "float32", seed=5)[0]
    results = _all_reduce(n, [x] * n, "sum")
    assert spy.calls == n
    _check(results, [x] * n, "sum", x.shape)


# -- what is not fused ------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", INTS)
def test_mean_of_integers_falls_back_to_float64(spy: FusedSpy, dtype: str) -> None:
    n = 3
    xs = _frozen_inputs(n, (_count_above_inline(dtype),), dtype, seed=2)
    results = _all_reduce(n, xs, "mean")
    assert spy.calls == 0
    for r in results:
        assert isinstance(r, np.ndarray) and r.dtype == np.float64, r
        assert r.tobytes() == results[0].tobytes()
        np.testing.assert_allclose(r, _reference(xs, "mean"), rtol=1e-12, atol=1e-12)


def test_mean_of_bfloat16_is_fused(spy: FusedSpy) -> None:
    _skip_missing("bfloat16")
    n = 2
    xs = _frozen_inputs(n, (_count_above_inline("bfloat16"),), "bfloat16", seed=4)
    results = _all_reduce(n, xs, "mean")
    _assert_close(results[0], xs, "mean")  # correct either way
    assert spy.calls == n


def test_mean_of_bfloat16_is_correct(spy: FusedSpy) -> None:
    """Whichever path runs it, a bfloat16 mean is bfloat16, identical everywhere, close."""
    _skip_missing("bfloat16")
    for n in (2, 3):
        xs = _frozen_inputs(n, (_count_above_inline("bfloat16"),), "bfloat16", seed=n)
        results = _all_reduce(n, xs, "mean")
        for r in results:
            assert r.dtype == xs[0].dtype
            assert r.tobytes() == results[0].tobytes()
        _assert_close(results[0], xs, "mean")


@pytest.mark.parametrize("strategy", ["tree", "ring", "centralized"])
def test_only_auto_fuses(spy: FusedSpy, strategy: str) -> None:
    n = 2
    xs = _frozen_inputs(n, (_count_above_inline("float32"),), "float32", seed=1)
    results = _all_reduce(n, xs, "sum", strategy)
    assert spy.calls == 0
    for r in results:
        assert r.tobytes() == results[0].tobytes()
        _assert_close(r, xs, "sum")


def test_a_single_peer_is_not_fused(spy: FusedSpy) -> None:
    xs = _frozen_inputs(1, (_count_above_inline("float32"),), "float32", seed=1)
    (result,) = _all_reduce(1, xs, "max")
    assert spy.calls == 0
    np.testing.assert_array_equal(result, xs[0])
    assert not np.shares_memory(result, xs[0])


def test_other_operations_above_the_inline_size_are_not_fused(spy: FusedSpy) -> None:
    n = 2
    xs = _frozen_inputs(n, (_count_above_inline("float64", 1), 2), "float64", seed=3)

    def work(c: burncoll.Communicator, i: int) -> list[Any]:
        return [c.reduce(xs[i], root=1), c.reduce_scatter(xs[i]), c.all_gather(xs[i]),
                c.broadcast(xs[i] if i == 0 else None, root=0)]

    results = run_peers(_config(n, "auto"), work)
    assert spy.calls == 0
    total = _reference(xs, "sum")
    for i, (red, block, gathered, bcast) in enumerate(results):
        assert (red is None) == (i != 1)
        np.testing.assert_allclose(block, np.array_split(total, n)[i], rtol=1e-12)
        np.testing.assert_array_equal(gathered, np.concatenate(xs))
        np.testing.assert_array_equal(bcast, xs[0])


# -- out= and repeated use -------------------------------------------------------------------


def test_out_in_place_separate_and_none_mixed(spy: FusedSpy) -> None:
    """Peer 0 reduces in place, peer 1 into a separate array, peer 2 into a new array: the
    fused path writes straight into the callers' arrays and returns them."""
    n = 3
    shape = (_count_above_inline("float32", 5),)
    for op in ("sum", "mean", "prod"):
        xs = _inputs(n, shape, "float32", seed=OPS.index(op))
        kept = [x.copy() for x in xs]
        outs: list[np.ndarray | None] = [xs[0], np.full(shape, np.nan, np.float32), None]
        spy.clear()
        results = run_peers(_config(n, "auto"),
                            lambda c, i: c.all_reduce(xs[i], op=op, out=outs[i]))
        assert spy.calls == n
        assert results[0] is xs[0] and results[1] is outs[1]
        assert any(r is xs[0] for r in spy.returned) and any(r is outs[1] for r in spy.returned)
        for x, k in zip(xs[1:], kept[1:], strict=True):
            np.testing.assert_array_equal(x, k)  # only peer 0 asked for in place
        _check([np.array(r) for r in results], kept, op, shape)


def test_back_to_back_with_a_reused_out(spy: FusedSpy) -> None:
    n = 2
    shape = (_count_above_inline("float64", 1),)
    outs = [np.empty(shape) for _ in range(n)]
    series = [_frozen_inputs(n, shape, "float64", seed=k) for k in range(6)]

    def work(c: burncoll.Communicator, i: int) -> list[bytes]:
        return [c.all_reduce(xs[i], op="max", out=outs[i]).tobytes() for xs in series]

    results = run_peers(_config(n, "auto"), work)
    assert spy.calls == n * len(series)
    for k, xs in enumerate(series):
        assert results[0][k] == results[1][k] == _fold(xs, "max").tobytes()


def test_results_are_independent_of_each_other(spy: FusedSpy) -> None:
    """Writing into one peer's result leaves the others (and the inputs) alone."""
    n = 3
    xs = _frozen_inputs(n, (_count_above_inline("float32"),), "float32", seed=9)
    results = _all_reduce(n, xs, "sum")
    before = results[1].copy()
    results[0][...] = 0
    np.testing.assert_array_equal(results[1], before)
    np.testing.assert_array_equal(results[2], before)


# -- mismatches -------------------------------------------------------------------------------


@pytest.mark.parametrize("make", [
    lambda i, c: np.ones(c + i, np.float32),  # different lengths, both fused
    lambda i, c: np.ones(c if i else 10, np.float32),  # one inline-sized, one fused
    lambda i, c: np.ones(c, np.float32 if i else np.float64),  # different dtypes
], ids=["lengths", "inline-vs-fused", "dtypes"])
def test_mismatched_calls_raise_on_every_peer(
    spy: FusedSpy, make: Callable[[int, int], np.ndarray],
) -> None:
    n = 2
    xs = [make(i, _count_above_inline("float32")) for i in range(n)]
    results = run_peers(burncoll.CollectiveConfig(num_devices=n, timeout=5),
                        lambda c, i: c.all_reduce(xs[i]))
    assert spy.calls == 0
    for r in results:
        assert isinstance(r, burncoll.MismatchError), r
