"""Every operation, strategy and reduce op on one node, against float64 NumPy references."""

from __future__ import annotations

import numpy as np
import pytest

import burncoll
from tests.harness import run_peers

STRATEGIES = ["centralized", "tree", "tree:3", "ring", "auto"]
REDUCERS = {
    "sum": lambda xs: np.sum(xs, axis=0),
    "mean": lambda xs: np.mean(xs, axis=0),
    "max": lambda xs: np.max(xs, axis=0),
    "min": lambda xs: np.min(xs, axis=0),
    "prod": lambda xs: np.prod(xs, axis=0),
}
SHAPES = [(), (0,), (1,), (7,), (5, 3), (2, 0, 3), (33, 2)]


def _inputs(n: int, shape: tuple[int, ...], dtype: str, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    if dtype.startswith("int"):
        return [rng.integers(-3, 4, size=shape).astype(dtype) for _ in range(n)]
    return [rng.uniform(-2, 2, size=shape).astype(dtype) for _ in range(n)]


def _config(n: int, strategy: str) -> burncoll.CollectiveConfig:
    return burncoll.CollectiveConfig(
        num_devices=n, local_all_reduce_strategy=strategy, local_reduce_strategy=strategy,
        local_broadcast_strategy=strategy, timeout=20,
    )


def _close(result: np.ndarray, ref: np.ndarray, dtype: str) -> None:
    tol = {"float16": 2e-2, "float32": 1e-5}.get(dtype, 1e-12)
    np.testing.assert_allclose(np.asarray(result, dtype=np.float64), ref, rtol=tol, atol=tol)


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("n", [1, 2, 3, 5])
@pytest.mark.parametrize("op", list(REDUCERS))
def test_all_reduce(strategy: str, n: int, op: str) -> None:
    for shape in SHAPES:
        for dtype in ("float32", "float64", "int32", "int64"):
            xs = _inputs(n, shape, dtype, seed=n * 100 + len(shape))
            originals = [x.copy() for x in xs]
            results = run_peers(_config(n, strategy), lambda c, i: c.all_reduce(xs[i], op=op))
            ref = REDUCERS[op](np.stack([x.astype(np.float64) for x in xs]))
            for r in results:
                assert isinstance(r, np.ndarray), r
                assert r.shape == shape
                _close(r, ref, dtype)
                assert r.tobytes() == results[0].tobytes()  # bitwise identical everywhere
            for x, o in zip(xs, originals, strict=True):
                np.testing.assert_array_equal(x, o)  # inputs untouched


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("n", [1, 2, 4, 5])
def test_reduce_every_root(strategy: str, n: int) -> None:
    xs = _inputs(n, (6, 5), "float64", seed=n)
    for root in range(n):
        for op in ("sum", "max", "prod"):
            results = run_peers(_config(n, strategy),
                                lambda c, i: c.reduce(xs[i], root=root, op=op))
            for i, r in enumerate(results):
                if i == root:
                    _close(r, REDUCERS[op](np.stack(xs)), "float64")
                else:
                    assert r is None


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("n", [1, 3, 5])
def test_broadcast_every_root(strategy: str, n: int) -> None:
    for shape, dtype in [((4, 3), "float32"), ((0,), "int64"), ((), "float64"), ((9,), "int32")]:
        xs = _inputs(n, shape, dtype, seed=7)
        for root in range(n):
            results = run_peers(
                _config(n, strategy),
                lambda c, i: c.broadcast(xs[i] if i == root else None, root=root))
            for r in results:
                assert r.dtype == xs[root].dtype and r.shape == shape
                np.testing.assert_array_equal(r, xs[root])


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("n", [1, 2, 3, 5])
def test_reduce_scatter(strategy: str, n: int) -> None:
    for shape in [(7,), (10, 3), (2, 4), (0, 2)]:
        for op in ("sum", "mean", "min"):
            xs = _inputs(n, shape, "float64", seed=3)
            results = run_peers(_config(n, strategy),
                                lambda c, i: c.reduce_scatter(xs[i], op=op))
            blocks = np.array_split(REDUCERS[op](np.stack(xs)), n)
            for r, block in zip(results, blocks, strict=True):
                assert r.shape == block.shape
                _close(r, block, "float64")


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("n", [1, 2, 3, 5])
def test_all_gather_uneven_rows(strategy: str, n: int) -> None:
    xs = [np.arange((i + 1) * 3, dtype=np.int32).reshape(i + 1, 3) + 100 * i for i in range(n)]
    results = run_peers(_config(n, strategy), lambda c, i: c.all_gather(xs[i]))
    expected = np.concatenate(xs)
    for r in results:
        np.testing.assert_array_equal(r, expected)


def test_ranks_follow_sorted_peer_ids() -> None:
    ids = [42, 7, 19]
    results = run_peers(_config(3, "ring"), lambda c, i: (c.peer_id, c.rank, c.world_size),
                        peer_ids=ids)
    assert sorted(results) == [(7, 0, 3), (19, 1, 3), (42, 2, 3)]
    gathered = run_peers(_config(3, "tree"),
                         lambda c, i: c.all_gather(np.array([c.peer_id])), peer_ids=ids)
    np.testing.assert_array_equal(gathered[0], [7, 19, 42])


def test_float16_and_barrier() -> None:
    xs = _inputs(4, (16,), "float16", seed=1)
    results = run_peers(_config(4, "tree"),
                        lambda c, i: (c.barrier(), c.all_reduce(xs[i]))[1])
    for r in results:
        assert r.dtype == np.float16
        _close(r, np.sum(np.stack(xs).astype(np.float64), axis=0), "float16")


def test_many_back_to_back_operations() -> None:
    n = 3
    rng = np.random.default_rng(0)
    sizes = rng.integers(0, 200, size=60)
    arrays = [[rng.normal(size=s) for s in sizes] for _ in range(n)]

    def work(c: burncoll.Communicator, i: int) -> list[np.ndarray]:
        return [c.all_reduce(a) for a in arrays[i]]

    results = run_peers(_config(n, "ring"), work)
    for k in range(60):
        ref = sum(arrays[i][k] for i in range(n))
        for r in results:
            _close(r[k], ref, "float64")


@pytest.mark.parametrize("n", [2, 4])
def test_auto_above_the_inline_size_uses_schedules_correctly(n: int) -> None:
    xs = _inputs(n, (100_000, 2), "float64", seed=5)  # 1.6 MB: above INLINE_BYTES
    ref = np.sum(np.stack(xs), axis=0)

    def work(c: burncoll.Communicator, i: int) -> list[np.ndarray | None]:
        return [c.all_reduce(xs[i]), c.reduce(xs[i], root=n - 1), c.reduce_scatter(xs[i]),
                c.broadcast(xs[i] if i == 0 else None, root=0), c.all_gather(xs[i])]

    results = run_peers(_config(n, "auto"), work)
    for i, (total, red, block, bcast, gathered) in enumerate(results):
        _close(total, ref, "float64")
        assert (red is None) == (i != n - 1)
        _close(block, np.array_split(ref, n)[i], "float64")
        np.testing.assert_array_equal(bcast, xs[0])
        np.testing.assert_array_equal(gathered, np.concatenate(xs))
