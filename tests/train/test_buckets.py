"""all_reduce_tree / broadcast_tree over real peers, and the pure bucket plan."""

from __future__ import annotations

from collections import OrderedDict, namedtuple
from typing import Any

import numpy as np
import pytest

import burncoll
from burncoll.comm import buckets
from burncoll.comm.buckets import LeafSpec
from burncoll.train import all_reduce_tree, broadcast_tree, ddp, flatten_tree, plan_buckets
from tests.train._util import bitwise_equal, config, leaves

Pair = namedtuple("Pair", ["first", "second"])


def rank_tree(rank: int) -> dict[str, Any]:
    """A nested tree with several dtypes whose values depend on the rank."""
    base = np.arange(6, dtype=np.float64).reshape(2, 3)
    return {
        "b": [base * (rank + 1), (np.full(4, rank, dtype=np.float32),)],
        "a": Pair(np.array(rank + 10, dtype=np.int32), np.ones((2, 2)) * rank),
        "c": OrderedDict(z=np.arange(3, dtype=np.int64) - rank, y=None),
        "empty": np.zeros((0, 3), dtype=np.float32),
    }


class CountingComm:
    """Forwards to a real communicator and counts the collectives (no behaviour changed)."""

    def __init__(self, comm: burncoll.Communicator) -> None:
        self._comm = comm
        self.config = comm.config
        self.device = comm.device
        self.calls = 0

    def all_reduce(self, x: Any, op: Any = "sum", *, out: Any = None) -> Any:
        self.calls += 1
        return self._comm.all_reduce(x, op, out=out)

    def broadcast(self, x: Any, root: int) -> Any:
        self.calls += 1
        return self._comm.broadcast(x, root)


@pytest.mark.parametrize("op", ["sum", "max"])
def test_all_reduce_tree_matches_numpy_and_keeps_structure(op: str) -> None:
    world = 4
    trees = [rank_tree(r) for r in range(world)]

    def worker(comm: burncoll.Communicator) -> Any:
        return all_reduce_tree(comm, trees[comm.rank], op=op)

    results = ddp(range(world), config()).run(worker)
    combine = np.sum if op == "sum" else np.max
    expected = [
        combine(np.stack(group), axis=0).astype(group[0].dtype)
        for group in zip(*map(leaves, trees), strict=True)
    ]
    out = results[0]
    assert list(out) == ["a", "b", "c", "empty"]  # rebuilt in flattening order, as jax does
    assert isinstance(out["a"], Pair) and isinstance(out["b"], list)
    assert isinstance(out["b"][1], tuple) and isinstance(out["c"], OrderedDict)
    assert out["c"]["y"] is None and out["empty"].shape == (0, 3)
    for got, want in zip(leaves(out), expected, strict=True):
        assert got.dtype == want.dtype and got.shape == want.shape
        np.testing.assert_allclose(got, want, rtol=1e-6)
    assert all(bitwise_equal(r, out) for r in results)
    # packed buckets are reduced in place, never the caller's leaves
    assert all(bitwise_equal(t, rank_tree(r)) for r, t in enumerate(trees))


def test_all_reduce_tree_mean_divides_by_world_size() -> None:
    def worker(comm: burncoll.Communicator) -> Any:
        return all_reduce_tree(comm, {"g": np.full(3, float(comm.rank)), "h": [np.ones(2)]})

    out = ddp(range(4), config()).run(worker)[0]
    np.testing.assert_array_equal(out["g"], np.full(3, 1.5))
    np.testing.assert_array_equal(out["h"][0], np.ones(2))


def test_hundreds_of_leaves_cost_a_few_collectives() -> None:
    tree = {
        f"layer{i:03d}": [np.full(10, i, np.float32), np.full((2, 2), i, np.float64)]
        for i in range(300)
    }
    counts: list[int] = []

    def worker(comm: burncoll.Communicator) -> Any:
        counting = CountingComm(comm)
        out = all_reduce_tree(counting, tree, op="sum")  # type: ignore[arg-type]
        counts.append(counting.calls)
        return out

    out = ddp(range(4), config()).run(worker)[0]
    assert counts == [2, 2, 2, 2]  # one bucket per dtype
    for i in (0, 137, 299):
        np.testing.assert_array_equal(out[f"layer{i:03d}"][0], np.full(10, 4 * i, np.float32))
        np.testing.assert_array_equal(out[f"layer{i:03d}"][1], np.full((2, 2), 4 * i))


def test_small_buckets_split_the_tree_and_give_the_same_result() -> None:
    tree = [np.arange(100, dtype=np.float64) + i for i in range(20)]  # 800 bytes a leaf
    counts: list[int] = []

    def worker(comm: burncoll.Communicator) -> Any:
        counting = CountingComm(comm)
        out = all_reduce_tree(counting, tree, op="sum", bucket_bytes=2000)  # type: ignore[arg-type]
        counts.append(counting.calls)
        return out

    out = ddp(range(2), config(num_devices=2)).run(worker)[0]
    assert counts == [10, 10]  # two leaves per 2000-byte bucket
    for i, leaf in enumerate(out):
        np.testing.assert_array_equal(leaf, 2 * (np.arange(100.0) + i))


def test_broadcast_tree_gives_the_roots_values_everywhere() -> None:
    def worker(comm: burncoll.Communicator) -> Any:
        return broadcast_tree(comm, rank_tree(comm.rank), root=2)

    results = ddp(range(4), config()).run(worker)
    want = rank_tree(2)
    for out in results:
        assert bitwise_equal(out, want)
    results[0]["b"][0][0, 0] = 99.0  # replicas are private
    assert results[1]["b"][0][0, 0] == 0.0


def test_a_leaf_that_is_not_an_array_is_a_usage_error() -> None:
    def worker(comm: burncoll.Communicator) -> Any:
        return all_reduce_tree(comm, {"loss": 1.5})

    with pytest.raises(burncoll.UsageError, match="not an array of backend 'numpy'"):
        ddp(range(2), config(num_devices=2)).run(worker)


def test_mismatched_trees_fail_on_every_peer() -> None:
    def worker(comm: burncoll.Communicator) -> Any:
        return all_reduce_tree(comm, [np.ones(3 + comm.rank)])

    with pytest.raises(burncoll.MismatchError):
        ddp(range(2), config(num_devices=2)).run(worker)


# -- the pure parts -------------------------------------------------------------------------------


def test_plan_groups_by_dtype_and_respects_the_limit() -> None:
    specs = [
        LeafSpec("float32", (10,)),  # 40 B
        LeafSpec("int64", (2,)),  # 16 B
        LeafSpec("float32", (20,)),  # 80 B
        LeafSpec("float32", (100,)),  # 400 B: larger than a bucket, alone
        LeafSpec("float32", (5,)),  # 20 B
        LeafSpec("int64", (3,)),
    ]
    plan = plan_buckets(specs, bucket_bytes=128)
    assert [(b.dtype, b.leaves) for b in plan] == [
        ("float32", (0, 2)),
        ("float32", (3,)),
        ("float32", (4,)),
        ("int64", (1, 5)),
    ]
    assert plan[0].offsets == (0, 10, 30) and plan[3].size == 5
    assert sorted(i for b in plan for i in b.leaves) == list(range(len(specs)))


@pytest.mark.parametrize("bad", [0, -5, 1.5, True])
def test_plan_rejects_bad_bucket_sizes(bad: Any) -> None:
    with pytest.raises(burncoll.UsageError, match="bucket_bytes"):
        plan_buckets([LeafSpec("float32", (1,))], bucket_bytes=bad)


TREE = {
    "b": [1, (2, None, 3)],
    "a": {"y": 4, "x": 5},
    "c": Pair(6, 7),
    "d": OrderedDict(q=8, p=9),
}


def own_flatten(tree: Any) -> list[Any]:
    """The leaves by burncoll's own flattener, whether or not jax is imported."""
    out: list[Any] = []
    buckets._flatten(tree, out)
    return out


def test_flatten_order_is_sorted_keys_then_sequence_order() -> None:
    assert own_flatten(TREE) == [5, 4, 1, 2, 3, 6, 7, 8, 9]
    flat, unflatten = flatten_tree(TREE)
    assert flat == [5, 4, 1, 2, 3, 6, 7, 8, 9]
    rebuilt = unflatten([v * 10 for v in flat])
    assert rebuilt == {
        "b": [10, (20, None, 30)],
        "a": {"y": 40, "x": 50},
        "c": Pair(60, 70),
        "d": OrderedDict(q=80, p=90),
    }
    assert list(rebuilt) == ["a", "b", "c", "d"] and isinstance(rebuilt["c"], Pair)
    assert list(rebuilt["d"]) == ["q", "p"]


def test_flatten_order_matches_jax_tree_util() -> None:
    """A node with jax imported and one without must issue the same collectives."""
    jax = pytest.importorskip("jax")
    assert own_flatten(TREE) == jax.tree_util.tree_leaves(TREE)
