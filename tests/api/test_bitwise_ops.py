"""The bitwise reduce ops (``band``, ``bor``, ``bxor``) and ``avg``, the alias of ``mean``.

Every path a reduce op takes: one node with 1-4 devices under each local strategy (small
arrays inline, large ones fused under ``auto``), and 2-3 nodes as threads of this process
under each global strategy and transport. Results are checked against NumPy's own
``bitwise_*.reduce`` over the peers' inputs. A bitwise op on a float array is refused with a
:class:`~burncoll.UsageError` on the calling peer, before it joins the operation.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

import burncoll
from burncoll.backends import installed_backends
from burncoll.ops import ReduceOp, parse_reduce_op
from burncoll.strategies.auto import INLINE_BYTES
from tests.harness import run_peers

NDArray = np.ndarray[Any, Any]

BITWISE: dict[str, Any] = {"band": np.bitwise_and, "bor": np.bitwise_or, "bxor": np.bitwise_xor}
DTYPES = ["int8", "int32", "int64", "uint8", "uint64", "bool"]
LOCAL_STRATEGIES = ["centralized", "tree", "tree:3", "ring", "auto"]
X64_DTYPES = {"int64", "uint64"}
REFUSED = "needs integer or bool arrays, got"


# -- inputs and references ----------------------------------------------------------------------
def _host(rank: int, dtype: str, shape: tuple[int, ...], seed: int = 0) -> NDArray:
    """Peer ``rank``'s input: random bits over the dtype's whole range (mostly-true bools)."""
    rng = np.random.default_rng([seed, rank, len(shape)])
    dt = np.dtype(dtype)
    if dt.kind == "b":
        return rng.random(shape) < 0.85
    info = np.iinfo(dt)
    return rng.integers(info.min, info.max, size=shape, dtype=dt, endpoint=True)


def _ref(op: str, inputs: list[NDArray]) -> NDArray:
    return np.asarray(BITWISE[op].reduce(np.stack(inputs), axis=0))


def _dtypes(backend: str) -> list[str]:
    if backend == "jax":
        import jax

        if not jax.config.jax_enable_x64:
            return [d for d in DTYPES if d not in X64_DTYPES]
    return DTYPES


def _need_backend(backend: str) -> None:
    if backend not in installed_backends():
        pytest.skip(f"backend {backend!r} is not usable here")


def _on(comm: burncoll.Communicator, x: NDArray) -> Any:
    """``x`` as an array of the communicator's backend on its device."""
    if comm.config.backend == "jax":
        import jax

        return jax.device_put(x, comm.device)
    return x.copy()


def _host_of(x: Any) -> NDArray:
    return np.asarray(x)


def _check(got: Any, want: NDArray, what: object) -> None:
    host = _host_of(got)
    assert host.dtype == want.dtype and host.shape == want.shape, (what, host.dtype, host.shape)
    np.testing.assert_array_equal(host, want, err_msg=str(what))


# -- the operations every configuration runs --------------------------------------------------
def _workload(dtypes: list[str], shape: tuple[int, ...], root: int
              ) -> Callable[[burncoll.Communicator, int], dict[Any, Any]]:
    """Every bitwise op on every dtype through all_reduce, reduce and reduce_scatter, and a
    float array refused on every peer (which then goes on: nothing was joined)."""

    def work(comm: burncoll.Communicator, rank: int) -> dict[Any, Any]:
        out: dict[Any, Any] = {}
        for dtype in dtypes:
            x = _on(comm, _host(rank, dtype, shape))
            for op in BITWISE:
                out["all_reduce", dtype, op] = comm.all_reduce(x, op=op)
                out["reduce", dtype, op] = comm.reduce(x, root=root, op=op)
                out["reduce_scatter", dtype, op] = comm.reduce_scatter(x, op=op)
        try:
            comm.all_reduce(_on(comm, np.ones(shape, np.float32)), op="band")
            out["refused"] = None
        except burncoll.UsageError as exc:
            out["refused"] = str(exc)
        return out

    return work


def _verify(results: list[Any], dtypes: list[str], shape: tuple[int, ...], peer_ids: list[int],
            root: int) -> None:
    world = len(peer_ids)
    for dtype in dtypes:
        inputs = [_host(r, dtype, shape) for r in range(world)]
        for op in BITWISE:
            want = _ref(op, inputs)
            for rank, got in zip(peer_ids, results, strict=True):
                assert not isinstance(got, BaseException), (rank, got)
                _check(got["all_reduce", dtype, op], want, (rank, dtype, op))
                _check(got["reduce_scatter", dtype, op], np.array_split(want, world)[rank],
                       (rank, dtype, op, "reduce_scatter"))
                if rank == root:
                    _check(got["reduce", dtype, op], want, (rank, dtype, op, "reduce"))
                else:
                    assert got["reduce", dtype, op] is None
    for got in results:
        assert f"band {REFUSED} float32" in got["refused"]


# -- one node -----------------------------------------------------------------------------------
def _local_config(backend: str, n: int, strategy: str, timeout: float = 20
                  ) -> burncoll.CollectiveConfig:
    return burncoll.CollectiveConfig(
        backend=backend, num_devices=n, local_all_reduce_strategy=strategy,
        local_reduce_strategy=strategy, local_broadcast_strategy=strategy, timeout=timeout)


#: (backend, strategy, devices): NumPy every strategy on 1-4 devices; JAX (whose first call
#: of each op, dtype and shape compiles) every strategy on 4 devices and every count.
ONE_NODE = [("numpy", s, n) for s in LOCAL_STRATEGIES for n in (1, 2, 3, 4)] + [
    ("jax", s, 4) for s in LOCAL_STRATEGIES] + [
    ("jax", "auto", 1), ("jax", "auto", 2), ("jax", "ring", 3)]


@pytest.mark.parametrize(("backend", "strategy", "n"), ONE_NODE)
def test_every_bitwise_op_on_one_node(backend: str, strategy: str, n: int) -> None:
    _need_backend(backend)
    dtypes, shape = _dtypes(backend), (7, 3) if backend == "numpy" else (12,)
    results = run_peers(_local_config(backend, n, strategy), _workload(dtypes, shape, n - 1))
    _verify(results, dtypes, shape, list(range(n)), n - 1)


def test_jax_64_bit_dtypes() -> None:
    """int64 and uint64 on JAX exist only in x64 mode, which is fixed for the process."""
    _need_backend("jax")
    import jax

    if not jax.config.jax_enable_x64:
        pytest.skip("JAX without x64 mode has no int64/uint64 arrays (JAX_ENABLE_X64=1 adds "
                    "them); the other dtypes ran on JAX")
    shape = (6,)
    results = run_peers(_local_config("jax", 2, "ring"), _workload(["int64", "uint64"], shape, 1))
    _verify(results, ["int64", "uint64"], shape, [0, 1], 1)


@pytest.mark.parametrize("n", [2, 4])
def test_large_arrays_take_the_fused_path(n: int) -> None:
    shape = (INLINE_BYTES + 4097,)  # past the inline size even for one-byte elements
    cases = [("uint8", "bxor"), ("bool", "band"), ("int64", "bor")]

    def work(comm: burncoll.Communicator, rank: int) -> list[NDArray]:
        return [comm.all_reduce(_host(rank, d, shape, seed=3), op=op) for d, op in cases]

    results = run_peers(_local_config("numpy", n, "auto"), work)
    for i, (dtype, op) in enumerate(cases):
        want = _ref(op, [_host(r, dtype, shape, seed=3) for r in range(n)])
        for got in results:
            assert not isinstance(got, BaseException), got
            _check(got[i], want, (dtype, op))


def _int_tree(rank: int, wide: str = "uint64") -> dict[str, Any]:
    """A nested dict of int and bool arrays; ``wide``: the dtype of its largest leaf."""
    return {"w": _host(rank, "int32", (4, 3)), "b": _host(rank, "uint8", (5,)),
            "nested": {"mask": _host(rank, "bool", (2, 2)), "k": _host(rank, "int8", ())},
            "big": _host(rank, wide, (300,))}


def _tree_on(comm: burncoll.Communicator, tree: dict[str, Any]) -> dict[str, Any]:
    return {k: _tree_on(comm, v) if isinstance(v, dict) else _on(comm, v)
            for k, v in tree.items()}


def _tree_leaves(tree: dict[str, Any]) -> dict[str, NDArray]:
    return {"w": tree["w"], "b": tree["b"], "mask": tree["nested"]["mask"],
            "k": tree["nested"]["k"], "big": tree["big"]}


@pytest.mark.parametrize("bucket_bytes", [64, 2**20])
def test_all_reduce_tree_of_int_arrays(bucket_bytes: int) -> None:
    n = 3

    def work(comm: burncoll.Communicator, rank: int) -> dict[str, Any]:
        return {op: comm.all_reduce_tree(_int_tree(rank), op=op, bucket_bytes=bucket_bytes)
                for op in BITWISE}

    results = run_peers(_local_config("numpy", n, "auto"), work)
    inputs = [_tree_leaves(_int_tree(r)) for r in range(n)]
    for got in results:
        assert not isinstance(got, BaseException), got
        for op in BITWISE:
            for name, leaf in _tree_leaves(got[op]).items():
                _check(leaf, _ref(op, [x[name] for x in inputs]), (op, name))


# -- avg ----------------------------------------------------------------------------------------
def test_avg_parses_to_mean() -> None:
    assert parse_reduce_op("avg") is ReduceOp.MEAN
    assert parse_reduce_op("AVG") is ReduceOp.MEAN
    assert [ReduceOp.BAND.value, ReduceOp.BOR.value, ReduceOp.BXOR.value] == [6, 7, 8]
    assert [parse_reduce_op(op) for op in BITWISE] == [ReduceOp.BAND, ReduceOp.BOR, ReduceOp.BXOR]
    with pytest.raises(burncoll.UsageError, match="'avg'"):
        parse_reduce_op("average")


@pytest.mark.parametrize("strategy", ["ring", "auto"])
def test_avg_equals_mean_bitwise(strategy: str) -> None:
    xs = [np.random.default_rng(i).standard_normal((9, 2)).astype(np.float32) for i in range(3)]
    ints = [_host(i, "int32", (5,)) for i in range(3)]

    def work(comm: burncoll.Communicator, i: int) -> list[NDArray]:
        return [comm.all_reduce(xs[i], op=op) for op in ("avg", "mean")] + [
            comm.all_reduce(ints[i], op=op) for op in ("avg", "mean")] + [
            comm.reduce_scatter(xs[i], op=op) for op in ("avg", "mean")]

    results = run_peers(_local_config("numpy", 3, strategy), work)
    ref = np.mean(np.stack(xs).astype(np.float64), axis=0)
    for got in results:
        assert not isinstance(got, BaseException), got
        for avg, mean in zip(got[0::2], got[1::2], strict=True):
            assert avg.dtype == mean.dtype and avg.tobytes() == mean.tobytes()
        np.testing.assert_allclose(got[0], ref, rtol=1e-6)


# -- refusals -----------------------------------------------------------------------------------
@pytest.mark.parametrize("backend", ["numpy", "jax"])
def test_bitwise_ops_on_inexact_arrays_are_refused_on_every_peer(backend: str) -> None:
    _need_backend(backend)
    calls: list[tuple[str, str, Callable[[burncoll.Communicator, Any], Any]]] = [
        ("band", "float32", lambda c, x: c.all_reduce(x, op="band")),
        ("bor", "float16", lambda c, x: c.reduce(x, root=0, op="bor")),
        ("bxor", "complex64", lambda c, x: c.reduce_scatter(x, op=ReduceOp.BXOR)),
        ("band", "bfloat16", lambda c, x: c.all_reduce_tree({"a": x, "i": x.astype("int8")},
                                                            op="band")),
    ]
    if backend == "numpy":
        calls.append(("bor", "float64", lambda c, x: c.all_reduce(x, op="bor", out=x)))

    def work(comm: burncoll.Communicator, i: int) -> list[str]:
        messages = []
        for _, dtype, call in calls:
            try:
                call(comm, _on(comm, np.ones((4, 2), dtype=_np_dtype(dtype))))
                messages.append("no error")
            except burncoll.UsageError as exc:
                messages.append(str(exc))
        # nothing was joined: the collective is still usable
        messages.append(str(_host_of(comm.all_reduce(_on(comm, np.ones(2, np.int32)), "bor"))))
        return messages

    for got in run_peers(_local_config(backend, 2, "auto"), work):
        assert not isinstance(got, BaseException), got
        for (op, dtype, _), message in zip(calls, got, strict=False):
            assert f"{op} {REFUSED} {dtype}" in message, message
        assert got[-1] == "[1 1]"


def _np_dtype(name: str) -> Any:
    if name == "bfloat16":
        import ml_dtypes

        return ml_dtypes.bfloat16
    return np.dtype(name)


def test_peers_that_called_correctly_fail_naming_the_refused_one() -> None:
    """The refused peer then finishes (``run_peers``) without the operation: the others fail
    at once, naming it (a MismatchError, or the abort that carries it for a peer that came
    after it)."""
    n, refused = 3, 1

    def work(comm: burncoll.Communicator, i: int) -> Any:
        dtype = np.float32 if i == refused else np.int32
        try:
            return comm.all_reduce(np.ones(4, dtype), op="band")
        except burncoll.CollectiveError as exc:
            return exc

    results = run_peers(_local_config("numpy", n, "auto", timeout=3), work)
    assert isinstance(results[refused], burncoll.UsageError), results[refused]
    assert f"band {REFUSED} float32" in str(results[refused])
    for i, got in enumerate(results):
        if i != refused:
            assert isinstance(got, burncoll.MismatchError | burncoll.CollectiveAborted), got
            assert f"local peer(s) [{refused}] called finish()" in str(got), got


# -- several nodes (threads of this process, an in-process orchestrator) ----------------------
def _cluster(transport: str, nodes: int, devices: int, work: Callable[..., Any],
             **fields: Any) -> list[Any]:
    """Run ``work(comm, rank)`` on every peer of ``nodes`` x ``devices``; results by rank."""
    out: list[Any] = [None] * (nodes * devices)

    def peer(node: int, device: int, cfg: burncoll.CollectiveConfig) -> None:
        rank = node * devices + device
        try:
            comm = burncoll.register(rank, device, cfg)
        except burncoll.CollectiveError as exc:
            out[rank] = exc
            return
        try:
            out[rank] = work(comm, rank)
        except burncoll.CollectiveError as exc:
            out[rank] = exc
        finally:
            comm.finish()

    with burncoll.start_orchestrator(transport=transport, expected_nodes=nodes) as orch:
        threads = []
        for node in range(nodes):
            cfg = burncoll.CollectiveConfig(
                num_nodes=nodes, node_rank=node, num_devices=devices, transport=transport,
                global_address=orch.address, **{"timeout": 20, **fields})
            threads += [threading.Thread(target=peer, args=(node, d, cfg), daemon=True)
                        for d in range(devices)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not any(t.is_alive() for t in threads), "a peer thread hung"
    return out


@pytest.mark.parametrize(("transport", "nodes", "devices", "global_", "local", "backend"), [
    ("websocket", 2, 2, "ring", "ring", "numpy"),
    ("tcp", 3, 2, "tree", "tree", "numpy"),
    ("quic", 2, 1, "centralized", "tree", "numpy"),
    ("tcp", 2, 2, "auto", "auto", "numpy"),
    ("websocket", 2, 2, "auto", "centralized", "jax"),
])
def test_every_bitwise_op_across_nodes(transport: str, nodes: int, devices: int, global_: str,
                                       local: str, backend: str) -> None:
    _need_backend(backend)
    world = nodes * devices
    root = devices  # the first peer of node 1: another node than rank 0's
    dtypes, shape = _dtypes(backend), (5, 3)
    tree_op, wide = "bxor", "uint64" if "uint64" in dtypes else "uint32"

    def work(comm: burncoll.Communicator, rank: int) -> dict[Any, Any]:
        out = _workload(dtypes, shape, root)(comm, rank)
        tree = _tree_on(comm, _int_tree(rank, wide))
        out["tree"] = comm.all_reduce_tree(tree, op=tree_op, bucket_bytes=64)
        return out

    results = _cluster(
        transport, nodes, devices, work, backend=backend,
        global_all_reduce_strategy=global_, global_reduce_strategy=global_,
        local_all_reduce_strategy=local, local_reduce_strategy=local)
    _verify(results, dtypes, shape, list(range(world)), root)
    inputs = [_tree_leaves(_int_tree(r, wide)) for r in range(world)]
    for got in results:
        for name, leaf in _tree_leaves(got["tree"]).items():
            _check(leaf, _ref(tree_op, [x[name] for x in inputs]), ("tree", name))


def test_a_tree_with_a_float_leaf_is_refused_before_anything_is_sent() -> None:
    """A bitwise op over a tree whose last leaf is float32: every peer refuses it before the
    first bucket leaves (no int bucket runs), naming the leaf; the communicator still works."""
    n = 2

    def work(comm: burncoll.Communicator, rank: int) -> tuple[str, list[int]]:
        tree = {"a": np.arange(4, dtype=np.int32), "z": np.ones(3, np.float32)}
        with pytest.raises(burncoll.UsageError) as info:
            comm.all_reduce_tree(tree, op="band", bucket_bytes=4)
        after = comm.all_reduce(np.array([rank + 1], np.int64), op="bor")
        return str(info.value), after.tolist()

    for got in run_peers(_local_config("numpy", n, "auto"), work):
        assert not isinstance(got, BaseException), got
        message, after = got
        assert "leaf 1 of the tree" in message and "float32" in message, message
        assert after == [3]
