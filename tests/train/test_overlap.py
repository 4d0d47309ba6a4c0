"""Gradients reduced while backward runs: GradientBuckets, and fit with a layer-wise grad_fn.

A NumPy MLP's backward is written as a generator yielding each layer's gradients, last layer
first (as autograd hooks fire). ``fit`` with it must train exactly as ``fit`` with the same
gradients returned as one tree (bitwise on one node, where every element is reduced in peer
order whatever the bucket layout), and as single-process float64 full-batch descent; across
2 nodes x 2 peers (threads of this process, an in-process orchestrator) within float64
rounding. :class:`GradientBuckets` issues a bucket's all-reduce as soon as it and every bucket
before it are complete, and refuses gradients it cannot place.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

import burncoll
from burncoll.comm.buckets import LeafSpec, flatten_tree
from burncoll.train import GradientBuckets, ddp, leaf_paths, plan_stream_buckets
from burncoll.train.fit import StepReducer
from tests.train._util import bitwise_equal, config, ddp_threads, max_abs_diff

NDArray = np.ndarray[Any, Any]
SIZES = (6, 16, 12, 8, 1)
STEPS = 6
LR = 0.05


def init(seed: int = 3) -> list[dict[str, NDArray]]:
    rng = np.random.default_rng(seed)
    return [{"w": rng.normal(size=(a, b)) / np.sqrt(a), "b": rng.normal(size=b) * 0.1}
            for a, b in itertools.pairwise(SIZES)]


def data(n: int = 64) -> tuple[NDArray, NDArray]:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(n, SIZES[0]))
    return x, np.sin(x.sum(axis=1, keepdims=True))


def backward(params: list[dict[str, NDArray]], batch: tuple[NDArray, NDArray]
             ) -> tuple[float, Iterator[tuple[Any, NDArray]]]:
    """The mean squared error, and a generator computing the gradients layer by layer."""
    x, y = batch
    hs = [x]
    for layer in params[:-1]:
        hs.append(np.tanh(hs[-1] @ layer["w"] + layer["b"]))
    err = hs[-1] @ params[-1]["w"] + params[-1]["b"] - y

    def grads() -> Iterator[tuple[Any, NDArray]]:
        d = 2.0 * err / len(x)
        for i in reversed(range(len(params))):
            yield (i, "w"), hs[i].T @ d
            yield (i, "b"), d.sum(axis=0)
            if i:
                d = (d @ params[i]["w"].T) * (1.0 - hs[i] ** 2)

    return float(np.mean(err**2)), grads()


def as_tree(params: Any, batch: Any) -> tuple[float, list[dict[str, NDArray]]]:
    loss, pairs = backward(params, batch)
    tree: list[dict[str, NDArray]] = [{} for _ in params]
    for (i, name), g in pairs:
        tree[i][name] = g
    return loss, tree


def forward_order(params: Any, batch: Any) -> tuple[float, Iterator[tuple[Any, NDArray]]]:
    """The same gradients, yielded first layer first (the worst order for the default plan)."""
    loss, tree = as_tree(params, batch)
    return loss, iter([((i, k), g[k]) for i, g in enumerate(tree) for k in ("w", "b")])


def sgd(params: Any, grads: Any) -> Any:
    return [{k: p[k] - LR * g[k] for k in p} for p, g in zip(params, grads, strict=True)]


def reference(steps: int = STEPS) -> tuple[Any, list[float]]:
    """Single-process full-batch descent in float64."""
    params, losses = init(), []
    for _ in range(steps):
        loss, grads = as_tree(params, data())
        losses.append(loss)
        params = sgd(params, grads)
    return params, losses


# -- fit ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("grad_fn", [backward, forward_order])
def test_fit_with_layerwise_gradients_equals_the_blocking_fit_and_the_reference(
        grad_fn: Any) -> None:
    runs = {}
    for name, fn in (("overlap", grad_fn), ("blocking", as_tree)):
        runs[name] = ddp(range(4), config()).fit(init(), data(), fn, sgd, steps=STEPS,
                                                 bucket_bytes=400, progress=False)
    overlap, blocking = runs["overlap"], runs["blocking"]
    assert overlap.identical and blocking.identical
    assert bitwise_equal(overlap.params, blocking.params)
    assert overlap.losses == blocking.losses
    want, want_losses = reference()
    assert max_abs_diff(overlap.params, want) < 1e-12
    np.testing.assert_allclose(overlap.losses, want_losses, rtol=1e-12)
    assert ddp_threads() == []


def test_fit_with_layerwise_gradients_across_two_nodes() -> None:
    results: dict[int, Any] = {}
    with burncoll.start_orchestrator(transport="websocket", expected_nodes=2) as orch:
        def node(rank: int) -> None:
            cfg = config(2, timeout=20, num_nodes=2, node_rank=rank, global_address=orch.address)
            try:
                results[rank] = ddp(range(2), cfg).fit(init(), data(), backward, sgd,
                                                       steps=STEPS, bucket_bytes=600,
                                                       progress=False)
            except BaseException as exc:
                results[rank] = exc

        threads = [threading.Thread(target=node, args=(r,), daemon=True) for r in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(90)
    want, want_losses = reference()
    for rank in range(2):
        got = results[rank]
        assert not isinstance(got, BaseException), got
        assert got.identical
        assert max_abs_diff(got.params, want) < 1e-12
        np.testing.assert_allclose(got.losses, want_losses, rtol=1e-12)
    assert bitwise_equal(results[0].params, results[1].params)


# -- GradientBuckets ------------------------------------------------------------------------------
def test_buckets_are_issued_in_order_as_soon_as_they_are_complete() -> None:
    like = {f"g{i}": np.zeros(4) for i in range(4)}  # reverse order: g3, g2, g1, g0

    def grads(rank: int) -> dict[str, NDArray]:
        return {k: np.arange(4.0) * (i + 1) + rank for i, k in enumerate(like)}

    def work(comm: burncoll.Communicator, _: int) -> tuple[list[int], Any]:
        buckets = GradientBuckets(comm, like, "sum", bucket_bytes=32)
        assert [b.leaves for b in buckets.buckets] == [(3,), (2,), (1,), (0,)]
        mine, issued = grads(comm.rank), []
        for key in ("g1", "g3", "g0", "g2"):  # g1 and g0 wait until g2 has come
            buckets.ready(key, mine[key])
            issued.append(buckets.issued)
        return issued, buckets.wait(timeout=30)

    for issued, got in burncoll_peers(3, work):
        assert issued == [0, 1, 1, 4]
        for i, k in enumerate(like):
            np.testing.assert_array_equal(got[k], np.arange(4.0) * 3 * (i + 1) + 3.0)


def burncoll_peers(n: int, fn: Any) -> list[Any]:
    from tests.harness import run_peers

    results = run_peers(burncoll.CollectiveConfig(num_devices=n, timeout=10), fn)
    for got in results:
        assert not isinstance(got, BaseException), got
    return results


def test_gradients_that_cannot_be_placed_are_refused() -> None:
    def work(comm: burncoll.Communicator, _: int) -> None:
        like = {"a": np.zeros(3), "b": [np.zeros((2, 2), np.float32)]}
        buckets = GradientBuckets(comm, like)
        with pytest.raises(burncoll.UsageError, match="no leaf at 'c'"):
            buckets.ready("c", np.zeros(3))
        with pytest.raises(burncoll.UsageError, match=r"float64\[2\].*float64\[3\]"):
            buckets.ready("a", np.zeros(2))
        buckets.ready("a", np.ones(3))
        with pytest.raises(burncoll.UsageError, match="twice"):
            buckets.ready(("a",), np.ones(3))
        with pytest.raises(burncoll.UsageError, match=r"never handed in: \[\('b', 0\)\]"):
            buckets.wait()
        buckets.ready(("b", 0), np.ones((2, 2), np.float32))
        got = buckets.wait()
        np.testing.assert_array_equal(got["a"], np.ones(3))
        assert got["b"][0].dtype == np.float32
        with pytest.raises(burncoll.UsageError, match="bxor"):
            GradientBuckets(comm, like, "bxor")

    burncoll_peers(1, work)


def test_a_failing_bucket_raises_at_wait_on_every_peer() -> None:
    def work(comm: burncoll.Communicator, _: int) -> str:
        like = [np.zeros(2 + (comm.rank == 1)), np.zeros(5)]  # rank 1's plan differs
        buckets = GradientBuckets(comm, like, bucket_bytes=8)
        buckets.ready(1, np.ones(5))
        buckets.ready_leaf(0, like[0] + 1)
        with pytest.raises(burncoll.CollectiveError) as info:
            buckets.wait(timeout=30)
        return type(info.value).__name__

    assert burncoll_peers(2, work) == ["MismatchError", "MismatchError"]


def test_stream_plan_follows_the_arrival_order_per_dtype() -> None:
    specs = [LeafSpec("float32", (4,)), LeafSpec("float64", (2,)), LeafSpec("float32", (8,)),
             LeafSpec("float64", (1,)), LeafSpec("float32", (2,)), LeafSpec("int8", (0,))]
    order = [4, 3, 2, 5, 1, 0]
    buckets = plan_stream_buckets(specs, order, bucket_bytes=32)
    assert sorted(i for b in buckets for i in b.leaves) == list(range(6))
    for b in buckets:
        assert {specs[i].dtype for i in b.leaves} == {b.dtype}
        assert len(b.leaves) == 1 or sum(specs[i].nbytes for i in b.leaves) <= 32
        assert list(b.leaves) == sorted(b.leaves, key=order.index)  # arrival order within
        assert b.offsets[-1] == sum(specs[i].size for i in b.leaves)
    last = [max(order.index(i) for i in b.leaves) for b in buckets]
    assert last == sorted(last)
    assert [b.leaves for b in buckets] == [(4,), (2,), (5,), (3, 1), (0,)]
    with pytest.raises(burncoll.UsageError, match="each of the 6 leaf indices once"):
        plan_stream_buckets(specs, [0, 1, 2, 3, 4, 4])
    with pytest.raises(burncoll.UsageError, match="bucket_bytes"):
        plan_stream_buckets(specs, order, bucket_bytes=0)


def test_leaf_paths_name_the_leaves_in_flattening_order() -> None:
    tree = {"z": [np.zeros(1), (np.ones(2), None)], "a": {"k": np.full(3, 2.0)}}
    leaves, _ = flatten_tree(tree)
    paths = leaf_paths(tree)
    assert len(paths) == len(leaves)
    for path, leaf in zip(paths, leaves, strict=True):
        node: Any = tree
        for key in path:
            node = node[key]
        assert node is leaf


def test_after_the_first_step_every_peer_uses_rank_0s_order() -> None:
    params = init()
    n_leaves = len(flatten_tree(params)[0])

    def work(comm: burncoll.Communicator, _: int) -> tuple[list[int] | None, list[Any]]:
        reducer = StepReducer(comm, bucket_bytes=200)
        grad_fn = forward_order if comm.rank == 0 else backward  # the peers' orders differ
        shard = tuple(a[comm.rank * 32:(comm.rank + 1) * 32] for a in data())
        results = []
        for _ in range(2):
            loss, grads = grad_fn(params, shard)
            results.append(reducer(params, loss, grads))
        return reducer.order, results

    got = burncoll_peers(2, work)
    # leaf 0 is the loss; then rank 0's yield order, first layer first ("b" sorts before "w")
    want_order = [0] + [1 + 2 * i + (k == "w") for i in range(4) for k in ("w", "b")]
    assert got[0][0] == got[1][0] == want_order and len(want_order) == n_leaves + 1
    want_loss, want_grads = as_tree(params, data())
    for _, results in got:
        for loss, grads in results:
            assert abs(float(loss) - want_loss) < 1e-12
            assert max_abs_diff(grads, want_grads) < 1e-12
