"""The rooted and personalised collectives: gather, scatter, all_to_all, scan, exscan,
reduce_scatter with counts, their ``out=`` forms, and gather_object / scatter_object.

Real peers: threads of one node (1-4), and 2-3 nodes as threads of this process over every
transport, with ranks interleaved across nodes (node 0 holds ranks 0 and 2 of 4) so that blocks
cross nodes in every direction. Every result is compared with a reference computed here in
NumPy (float64 for the reductions) from the inputs alone: uneven counts, empty blocks, roots on
every node, several dtype families. Bad counts fail every peer with a UsageError at once.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

import burncoll
from burncoll.errors import CollectiveError, UsageError
from tests.harness import run_nodes, run_peers

DTYPES = ["float32", "int64", "bool", "float16", "complex64"]


def _x(rank: int, rows: int, dtype: str, trailing: tuple[int, ...] = (3,)) -> np.ndarray:
    """Rank ``rank``'s input: ``rows`` rows, values by rank (exact in every dtype)."""
    n = rows * int(np.prod(trailing))
    values = (np.arange(n) % 7 + 3 * rank + 1).reshape(rows, *trailing)
    if dtype == "bool":
        return values % 2 == 0
    return values.astype(dtype)


def _rows(rank: int) -> int:
    return (rank * 2) % 5  # 0, 2, 4, 1, 3: one peer has none


def _send_counts(rank: int, world: int) -> list[int]:
    counts = [(rank + d) % 3 for d in range(world)]  # zeros included
    return counts


# -- every operation on one world -------------------------------------------------------------
def _workload(comm: burncoll.Communicator) -> dict[str, Any]:
    r, w, ids = comm.rank, comm.world_size, comm.peer_ids
    out: dict[str, Any] = {}
    for dtype in DTYPES:
        x = _x(r, _rows(r), dtype)
        out[f"gather {dtype}"] = [comm.gather(x, root) for root in ids]
        big = _x(ids.index(ids[-1]), 2 * w + 1, dtype)
        out[f"scatter {dtype}"] = comm.scatter(big if comm.peer_id == ids[-1] else None, ids[-1])
        counts = [0] * (w - 1) + [3] if w > 1 else [3]
        out[f"scatter counts {dtype}"] = comm.scatter(
            _x(0, 3, dtype) if comm.peer_id == ids[0] else None, ids[0], counts)
        out[f"all_to_all {dtype}"] = comm.all_to_all(
            _x(r, sum(_send_counts(r, w)), dtype), _send_counts(r, w))
        out[f"all_to_all even {dtype}"] = comm.all_to_all(_x(r, 2 * w, dtype))
    for op, dtype in [("sum", "float64"), ("max", "int32"), ("prod", "int64"),
                      ("band", "uint8"), ("mean", "float32"), ("min", "float16")]:
        x = _x(r, 2, dtype, (2,))
        out[f"scan {op}"] = comm.scan(x, op)
        out[f"exscan {op}"] = comm.exscan(x, op)
    counts = [(d * 2) % 3 for d in range(w)]
    out["reduce_scatter counts"] = comm.reduce_scatter(_x(r, sum(counts), "float64"), "sum",
                                                       counts=counts)
    out["reduce_scatter mean"] = comm.reduce_scatter(_x(r, sum(counts), "int32"), "mean",
                                                     counts=counts)
    out["objects"] = (comm.gather_object({"rank": r, "t": (r, None)}, ids[-1]),
                      comm.scatter_object([[i] * i for i in range(w)]
                                          if comm.peer_id == ids[0] else None, ids[0]))
    return out


def _prefix(inputs: list[np.ndarray], op: str) -> np.ndarray:
    ref = inputs[0].astype(np.float64)
    if op == "band":
        return functools.reduce(np.bitwise_and, inputs)
    for x in inputs[1:]:
        ref = {"sum": np.add, "mean": np.add, "max": np.maximum, "min": np.minimum,
               "prod": np.multiply}[op](ref, x.astype(np.float64))
    return ref / len(inputs) if op == "mean" else ref


def _expect(rank: int, world: int, ids: list[int]) -> dict[str, Any]:
    """What rank ``rank`` must get, from the inputs alone."""
    want: dict[str, Any] = {}
    for dtype in DTYPES:
        every = [_x(q, _rows(q), dtype) for q in range(world)]
        want[f"gather {dtype}"] = [np.concatenate(every) if ids[rank] == root else None
                                   for root in ids]
        big = _x(world - 1, 2 * world + 1, dtype)
        want[f"scatter {dtype}"] = np.array_split(big, world)[rank]
        want[f"scatter counts {dtype}"] = (_x(0, 3, dtype) if rank == world - 1
                                           else _x(0, 0, dtype))
        parts = []
        for q in range(world):
            bounds = np.cumsum([0, *_send_counts(q, world)])
            parts.append(_x(q, int(bounds[-1]), dtype)[bounds[rank]:bounds[rank + 1]])
        want[f"all_to_all {dtype}"] = np.concatenate(parts)
        want[f"all_to_all even {dtype}"] = np.concatenate(
            [np.array_split(_x(q, 2 * world, dtype), world)[rank] for q in range(world)])
    for op, dtype in [("sum", "float64"), ("max", "int32"), ("prod", "int64"),
                      ("band", "uint8"), ("mean", "float32"), ("min", "float16")]:
        inputs = [_x(q, 2, dtype, (2,)) for q in range(world)]
        want[f"scan {op}"] = _prefix(inputs[:rank + 1], op)
        want[f"exscan {op}"] = _prefix(inputs[:rank], op) if rank else None
    counts = [(d * 2) % 3 for d in range(world)]
    a, b = sum(counts[:rank]), sum(counts[:rank + 1])
    total = sum(_x(q, sum(counts), "float64") for q in range(world))
    want["reduce_scatter counts"] = np.asarray(total)[a:b]
    want["reduce_scatter mean"] = np.asarray(total)[a:b] / world
    gathered = [{"rank": q, "t": (q, None)} for q in range(world)] if rank == world - 1 else None
    want["objects"] = (gathered, [rank] * rank)
    return want


def _compare(got: dict[str, Any], want: dict[str, Any], rank: int) -> None:
    assert not isinstance(got, BaseException), (rank, got)
    assert list(got) == list(want)
    for key, w in want.items():
        g = got[key]
        if key == "objects":
            assert g == w, (rank, key, g, w)
            continue
        for gi, wi in zip(g if isinstance(w, list) else [g], w if isinstance(w, list) else [w],
                          strict=True):
            if wi is None:
                assert gi is None, (rank, key)
                continue
            gi = np.asarray(gi)
            assert gi.shape == wi.shape, (rank, key, gi.shape, wi.shape)
            if key.startswith(("scan", "exscan", "reduce_scatter")):
                tol = 1e-2 if "min" in key or "mean" in key else 1e-6
                np.testing.assert_allclose(gi.astype(np.float64), wi.astype(np.float64),
                                           rtol=tol, err_msg=f"rank {rank} {key}")
            else:
                assert gi.dtype == wi.dtype, (rank, key, gi.dtype, wi.dtype)
                assert np.array_equal(gi, wi), (rank, key, gi, wi)
    assert got["scan sum"].dtype == np.float64 and got["scan mean"].dtype == np.float32
    assert got["reduce_scatter mean"].dtype == np.float64  # the mean of integers


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_every_operation_on_one_node(n: int) -> None:
    results = run_peers(burncoll.CollectiveConfig(num_devices=n, timeout=20),
                        lambda comm, i: _workload(comm))
    for rank, got in enumerate(results):
        _compare(got, _expect(rank, n, list(range(n))), rank)


def _run_nodes(address: str, nodes: int, devices: int, transport: str,
               fn: Callable[[burncoll.Communicator], Any], timeout: float = 20
               ) -> dict[int, Any]:
    """``nodes`` nodes of ``devices`` peers as threads; peer ids interleave the nodes
    (node ``k`` holds ranks ``k, k + nodes, ...``). Results by rank."""
    return run_nodes(address, nodes, devices, fn, transport=transport, timeout=timeout,
                     rank_of=lambda node, device: device * nodes + node,
                     peer_id=lambda rank: 10 * rank + 5)


@pytest.mark.parametrize(("transport", "nodes", "devices"), [
    ("websocket", 2, 2), ("tcp", 3, 1), ("quic", 2, 1), ("websocket", 3, 2),
])
def test_every_operation_across_nodes(transport: str, nodes: int, devices: int) -> None:
    with burncoll.start_orchestrator(transport=transport, expected_nodes=nodes) as orch:
        results = _run_nodes(orch.address, nodes, devices, transport, _workload)
    world = nodes * devices
    ids = [10 * r + 5 for r in range(world)]
    assert sorted(results) == list(range(world))
    for rank in range(world):
        _compare(results[rank], _expect(rank, world, ids), rank)


RS_OPS = [("sum", "float32"), ("max", "int32"), ("min", "float64"), ("prod", "int64"),
          ("mean", "int16"), ("sum", "bool"), ("mean", "float16")]


def _rs_input(rank: int, rows: int, dtype: str) -> np.ndarray:
    """Values that differ by rank and element, exact in every dtype (and small for prod)."""
    values = (np.arange(rows * 2).reshape(rows, 2) * (rank + 3)) % 5 + 1
    return values % 2 == 0 if dtype == "bool" else values.astype(dtype)


def _rs_counts(world: int) -> list[int]:
    return [(3 * d) % 4 for d in range(world)]  # 0, 3, 2, 1, ...: an empty block


@pytest.mark.parametrize(("transport", "nodes", "devices"), [("tcp", 2, 3), ("quic", 3, 2)])
def test_reduce_scatter_with_counts_combines_each_nodes_blocks_first(
        transport: str, nodes: int, devices: int) -> None:
    """Every reduce op over a reduce-scatter with counts, with several devices per node whose
    ranks interleave the nodes: each node combines its devices' blocks before sending one per
    rank; every result equals NumPy's over all ranks (float64; a mean of integers is
    float64, a sum of bools their logical or, as NumPy's add)."""
    world = nodes * devices
    counts = _rs_counts(world)

    def work(comm: burncoll.Communicator) -> Any:
        return [comm.reduce_scatter(_rs_input(comm.rank, sum(counts), dtype), op,
                                    counts=counts) for op, dtype in RS_OPS]

    with burncoll.start_orchestrator(transport=transport, expected_nodes=nodes) as orch:
        results = _run_nodes(orch.address, nodes, devices, transport, work)
    bounds = np.cumsum([0, *counts])
    for (op, dtype), index in zip(RS_OPS, range(len(RS_OPS)), strict=True):
        inputs = np.stack([_rs_input(q, sum(counts), dtype).astype(np.float64)
                           for q in range(world)])
        if dtype == "bool":
            want = inputs.max(axis=0)  # NumPy's add of bools is their logical or
        else:
            want = {"sum": inputs.sum(axis=0), "max": inputs.max(axis=0),
                    "min": inputs.min(axis=0), "prod": inputs.prod(axis=0),
                    "mean": inputs.mean(axis=0)}[op]
        for rank in range(world):
            got = results[rank]
            assert not isinstance(got, BaseException), (rank, got)
            mine = np.asarray(got[index])
            expected_dtype = "float64" if op == "mean" and dtype == "int16" else dtype
            assert mine.dtype == np.dtype(expected_dtype), (rank, op, dtype, mine.dtype)
            assert mine.shape == (counts[rank], 2), (rank, op, mine.shape)
            np.testing.assert_allclose(mine.astype(np.float64),
                                       want[bounds[rank]:bounds[rank + 1]],
                                       rtol=2e-3 if dtype == "float16" else 1e-12,
                                       err_msg=f"rank {rank} {op} {dtype}")


def test_large_blocks_cross_nodes_in_several_parts() -> None:
    """Blocks over a frame's part size (4 MiB) travel in parts and arrive whole."""
    rows = 3 << 19  # 1.5 Mi rows x 2 float32 = 12 MiB per peer

    def work(comm: burncoll.Communicator) -> Any:
        x = np.full((rows, 2), comm.rank + 1, np.float32)
        return comm.all_to_all(x), comm.gather(x, comm.peer_ids[0])

    with burncoll.start_orchestrator(expected_nodes=2) as orch:
        results = _run_nodes(orch.address, 2, 1, "websocket", work)
    for rank in range(2):
        a2a, gathered = results[rank]
        half = rows // 2
        assert a2a.shape == (rows, 2)
        assert (a2a[:half] == 1).all() and (a2a[half:] == 2).all()
        if rank == 0:
            assert gathered.shape == (2 * rows, 2) and gathered[rows:].min() == 2
        else:
            assert gathered is None


def test_out_forms_write_into_the_callers_arrays() -> None:
    def work(comm: burncoll.Communicator, i: int) -> dict[str, Any]:
        w, r = comm.world_size, comm.rank
        x = np.arange(2 * w, dtype=np.float64) + r
        got: dict[str, Any] = {}
        for name, call, shape in [
            ("gather", lambda o: comm.gather(x, 0, out=o), (2 * w * w,)),
            ("scatter", lambda o: comm.scatter(x if r == 0 else None, 0, out=o), (2,)),
            ("all_to_all", lambda o: comm.all_to_all(x, out=o), (2 * w,)),
            ("all_gather", lambda o: comm.all_gather(x, out=o), (2 * w * w,)),
            ("reduce_scatter", lambda o: comm.reduce_scatter(x, out=o), (2,)),
            ("broadcast", lambda o: comm.broadcast(x if r == 1 else None, 1, out=o), (2 * w,)),
            ("reduce", lambda o: comm.reduce(x, 0, out=o), (2 * w,)),
        ]:
            mine = np.full(shape, -1.0)
            result = call(mine)
            got[name] = (result is mine, mine.copy(), result)
        with pytest.raises(UsageError, match="out is float64\\[5\\] but the result is"):
            comm.all_to_all(x, out=np.empty(5))
        with pytest.raises(UsageError, match="writable"):
            comm.all_gather(x, out=np.empty(2 * w * w)[::1].view()[::-1])
        return got

    w = 3
    results = run_peers(burncoll.CollectiveConfig(num_devices=w, timeout=10), work)
    xs = [np.arange(2 * w, dtype=np.float64) + r for r in range(w)]
    for r, got in enumerate(results):
        assert not isinstance(got, BaseException), got
        want = {"gather": np.concatenate(xs), "scatter": xs[0][2 * r:2 * r + 2],
                "all_to_all": np.concatenate([x[2 * r:2 * r + 2] for x in xs]),
                "all_gather": np.concatenate(xs), "reduce_scatter": sum(xs)[2 * r:2 * r + 2],
                "broadcast": xs[1], "reduce": sum(xs)}
        for name, value in want.items():
            same, written, result = got[name]
            if name in ("gather", "reduce") and r != 0:
                assert result is None and (written == -1).all(), (r, name)
                continue
            assert same, (r, name)
            np.testing.assert_array_equal(written, value, err_msg=f"{r} {name}")


def test_jax_peers() -> None:
    jax = pytest.importorskip("jax")

    def work(comm: burncoll.Communicator, i: int) -> Any:
        x = jax.device_put(np.arange(4, dtype=np.float32) + comm.rank, comm.device)
        g = comm.gather(x, 0)
        return (None if g is None else np.asarray(g), np.asarray(comm.all_to_all(x)),
                np.asarray(comm.scan(x, "max")), comm.scatter_object(
                    ["a", "b"] if comm.rank == 0 else None, 0))

    results = run_peers(burncoll.CollectiveConfig(backend="jax", num_devices=2, timeout=20),
                        work)
    xs = [np.arange(4, dtype=np.float32) + r for r in range(2)]
    g, a, s, o = results[0]
    np.testing.assert_array_equal(g, np.concatenate(xs))
    np.testing.assert_array_equal(a, np.concatenate([xs[0][:2], xs[1][:2]]))
    np.testing.assert_array_equal(s, xs[0])
    assert o == "a" and results[1][3] == "b" and results[1][0] is None
    np.testing.assert_array_equal(results[1][2], xs[1])


# -- bad input: a clear error on every peer, at once -------------------------------------------
BAD = [
    ("scatter counts that do not add up",
     lambda c: c.scatter(np.zeros((5, 2)) if c.rank == 0 else None, c.peer_ids[0], [1, 1]),
     "counts [1, 1] sum to 2, but its array has 5 rows"),
    ("all_to_all counts of the wrong length",
     lambda c: c.all_to_all(np.zeros(3), [3] if c.rank == 1 else None),
     "counts [3] has 1 entries; give one per rank (2)"),
    ("reduce_scatter counts that differ between peers",
     lambda c: c.reduce_scatter(np.zeros(4), counts=[c.rank + 1, 3 - c.rank]),
     "counts"),
    ("scatter_object with an object that cannot be sent",
     lambda c: c.scatter_object([1, {2}] if c.rank == 0 else None, c.peer_ids[0]),
     "could not send its object: cannot send a set at obj"),
    ("gather_object with an object that cannot be sent",
     lambda c: c.gather_object(object() if c.rank == 1 else 1, c.peer_ids[0]),
     "could not send its object"),
]


@pytest.mark.parametrize(("what", "call", "message"), BAD, ids=[b[0] for b in BAD])
@pytest.mark.parametrize("nodes", [1, 2])
def test_bad_input_fails_every_peer_at_once(what: str, call: Callable[[Any], Any],
                                            message: str, nodes: int) -> None:
    def work(comm: burncoll.Communicator) -> str:
        # Every node has finished registering first: a node still sharing its host memory
        # inside register() gets the abort from there, not from the call.
        comm.barrier()
        with pytest.raises(CollectiveError) as info:
            call(comm)
        assert not isinstance(info.value, burncoll.CollectiveTimeout), info.value
        return str(info.value)

    if nodes == 1:
        results = dict(enumerate(run_peers(burncoll.CollectiveConfig(num_devices=2, timeout=10),
                                           lambda comm, i: work(comm))))
    else:
        with burncoll.start_orchestrator(expected_nodes=2) as orch:
            results = _run_nodes(orch.address, 2, 1, "websocket", work, timeout=10)
    for rank, got in results.items():
        assert isinstance(got, str), (rank, got)
        assert message in got, (rank, got)


def test_scans_of_0d_arrays_and_numpy_integer_counts() -> None:
    def work(comm: burncoll.Communicator) -> Any:
        x = np.array(float(comm.rank + 1))
        w = comm.world_size
        counts = np.full(w, 1, np.int64)
        return (comm.scan(x), comm.exscan(x, "max"),
                comm.all_to_all(np.arange(w) + 10 * comm.rank, list(counts)))

    with burncoll.start_orchestrator(expected_nodes=2) as orch:
        results = _run_nodes(orch.address, 2, 2, "websocket", work)
    for rank in range(4):
        scan, exscan, a2a = results[rank]
        assert scan.shape == () and scan == sum(range(1, rank + 2))
        assert exscan is None if rank == 0 else (exscan.shape == () and exscan == rank)
        np.testing.assert_array_equal(a2a, [10 * q + rank for q in range(4)])


def test_an_unexpected_error_while_preparing_fails_every_peer_at_once(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A fault injected into the plan (not a CollectiveError) reaches every peer of every
    node as a CollectiveError naming it, well before the timeout."""
    from burncoll.local.plans import personal

    def broken(*args: Any) -> Any:
        raise ValueError("injected fault")

    monkeypatch.setattr(personal, "_result", broken)

    def work(comm: burncoll.Communicator) -> str:
        with pytest.raises(CollectiveError) as info:
            comm.gather(np.zeros(2), comm.peer_ids[0])
        return str(info.value)

    with burncoll.start_orchestrator(expected_nodes=2) as orch:
        results = _run_nodes(orch.address, 2, 2, "websocket", work, timeout=30)
    for got in results.values():
        assert isinstance(got, str) and "injected fault" in got, got


def test_call_time_errors() -> None:
    def work(comm: burncoll.Communicator, i: int) -> None:
        with pytest.raises(UsageError, match="root=7 is not a peer"):
            comm.gather(np.zeros(2), 7)
        with pytest.raises(UsageError, match="at least one dimension"):
            comm.all_to_all(np.array(1.0))
        with pytest.raises(UsageError, match="counts must be a sequence of ints"):
            comm.all_to_all(np.zeros(2), [1.0, 1.0])  # type: ignore[list-item]
        with pytest.raises(UsageError, match="must pass an array"):
            comm.scatter(None, comm.peer_id)
        with pytest.raises(UsageError, match="list of 2 objects"):
            comm.scatter_object([1], comm.peer_id)

    for got in run_peers(burncoll.CollectiveConfig(num_devices=2, timeout=10), work):
        assert got is None, got
