"""Every collective on torch tensors (``backend="torch"``): tensors in, tensors out, on the
caller's dtype (bfloat16 included) and device.

Real peers: 4 threads of one node; 2 node processes (this file, run as a script, is one node)
through a real orchestrator; and 2 nodes of 2 threads each in this process (the hierarchical
paths and the 16-bit compressions). Each peer checks every result against a reference it
computes itself in NumPy float64 from every rank's input (inputs are small integers, exact in
every dtype and in every sum, product and mean of them, so the comparison is exact), and
returns the list of what differed. Then the torch-specific cases: ``out=`` and in place write
the caller's memory, a tensor that requires grad, non-contiguous tensors, unsupported dtypes,
a tensor given to another backend's communicator, the backend set from YAML and the
environment; and the CUDA path, which skips here (no GPU).
"""

from __future__ import annotations

import json
import sys
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch is not installed")

import burncoll  # noqa: E402
from tests.harness import (  # noqa: E402
    reduced_float64,
    register_node_process,
    run_node_processes,
    run_nodes,
    run_peers,
)

DTYPES = ["float32", "float64", "float16", "bfloat16", "int32", "int64"]
ROWS_PER_RANK = 2  # inputs have 2 * world + 1 rows: array_split makes uneven blocks


def _values(rank: int, rows: int) -> np.ndarray:
    """Rank ``rank``'s input values: integers in [-4, 4] (products of 4 stay within 256)."""
    return np.random.default_rng(rank).integers(-4, 5, size=(rows, 3)).astype(np.float64)


def _tensor(values: np.ndarray, dtype: str) -> Any:
    return torch.tensor(values, dtype=getattr(torch, dtype))


class Checker:
    """One peer's checks: every result against its float64 reference; ``problems`` lists
    what differed (empty when all is well), ``checked`` what was compared."""

    def __init__(self, comm: burncoll.Communicator, dtype: str) -> None:
        self.comm, self.dtype = comm, dtype
        self.rank, self.world = comm.rank, comm.world_size
        self.rows = ROWS_PER_RANK * self.world + 1
        self.inputs = np.stack([_values(r, self.rows) for r in range(self.world)])
        self.x = _tensor(self.inputs[self.rank], dtype)
        self.problems: list[str] = []
        self.checked: list[str] = []

    def check(self, name: str, got: Any, want: np.ndarray | None, dtype: str = "") -> None:
        self.checked.append(name)
        if want is None:
            if got is not None:
                self.problems.append(f"{name}: expected None, got {type(got).__name__}")
            return
        dtype = dtype or self.dtype
        if not isinstance(got, torch.Tensor):
            self.problems.append(f"{name}: got {type(got).__name__}, not a tensor")
        elif got.dtype != getattr(torch, dtype) or got.device.type != "cpu":
            self.problems.append(f"{name}: got {got.dtype} on {got.device}, not {dtype} cpu")
        elif tuple(got.shape) != want.shape:
            self.problems.append(f"{name}: shape {tuple(got.shape)}, expected {want.shape}")
        elif not np.array_equal(got.to(torch.float64).numpy(), want):
            self.problems.append(f"{name}: values differ from the float64 reference")

    def blocks(self, values: np.ndarray, counts: list[int] | None = None) -> list[np.ndarray]:
        if counts is None:
            return np.array_split(values, self.world)
        return np.split(values, np.cumsum(counts)[:-1])


def _reductions(c: Checker) -> None:
    comm, x, floats = c.comm, c.x, c.dtype.startswith(("float", "bfloat"))
    for op in ["sum", "max", "min", "prod", "mean"]:
        mean_dtype = "" if floats or op != "mean" else "float64"  # integers: a float64 mean
        c.check(f"all_reduce {op}", comm.all_reduce(x, op), reduced_float64(c.inputs, op),
                mean_dtype)
    if not floats:
        for op, ufunc in [("band", np.bitwise_and), ("bor", np.bitwise_or),
                          ("bxor", np.bitwise_xor)]:
            want = ufunc.reduce(c.inputs.astype(np.int64)).astype(np.float64)
            c.check(f"all_reduce {op}", comm.all_reduce(x, op), want)
    total = c.inputs.sum(0)
    out = torch.empty_like(x)
    got = comm.all_reduce(x, out=out)
    c.check("all_reduce out=", out if got is out else None, total)
    mine = x.clone()
    address = mine.data_ptr()
    comm.all_reduce(mine, out=mine)
    c.check("all_reduce in place", mine if mine.data_ptr() == address else None, total)
    c.check("all_reduce async", comm.all_reduce(x, async_op=True).wait(), total)
    root = comm.peer_ids[-1]
    c.check("reduce", comm.reduce(x, root), total if comm.peer_id == root else None)
    c.check("reduce_scatter", comm.reduce_scatter(x), c.blocks(total)[c.rank])
    counts = [c.rows - c.world + 1] + [1] * (c.world - 1)
    c.check("reduce_scatter counts", comm.reduce_scatter(x, counts=counts),
            c.blocks(total, counts)[c.rank])
    c.check("scan", comm.scan(x), c.inputs[: c.rank + 1].sum(0))
    c.check("exscan", comm.exscan(x), c.inputs[: c.rank].sum(0) if c.rank else None)


def _movements(c: Checker) -> None:
    comm, x, ids = c.comm, c.x, c.comm.peer_ids
    root = ids[0]
    c.check("broadcast", comm.broadcast(x if comm.peer_id == root else None, root),
            c.inputs[0])
    out = torch.empty_like(x)
    got = comm.broadcast(x if comm.peer_id == root else None, root, out=out)
    c.check("broadcast out=", out if got is out else None, c.inputs[0])
    c.check("all_gather", comm.all_gather(x), np.concatenate(list(c.inputs)))
    c.check("gather", comm.gather(x, root),
            np.concatenate(list(c.inputs)) if comm.peer_id == root else None)
    last = ids[-1]
    c.check("scatter", comm.scatter(x if comm.peer_id == last else None, last),
            c.blocks(c.inputs[-1])[c.rank])
    c.check("all_to_all", comm.all_to_all(x),
            np.concatenate([c.blocks(v)[c.rank] for v in c.inputs]))
    comm.barrier()
    if c.world > 1:
        after, before = ids[(c.rank + 1) % c.world], ids[(c.rank - 1) % c.world]
        sent = comm.isend(x, after)
        c.check("recv", comm.recv(before), c.inputs[(c.rank - 1) % c.world])
        sent.wait()
    group = comm.split(c.rank % 2)
    assert group is not None
    same = c.inputs[c.rank % 2 :: 2]
    c.check("split all_reduce", group.all_reduce(x), same.sum(0))
    group.finish()


def every_collective(comm: burncoll.Communicator, dtypes: list[str]) -> dict[str, Any]:
    """Every collective on ``comm`` with tensors of each dtype; what was checked, and what
    differed."""
    checked, problems = [], []
    for dtype in dtypes:
        c = Checker(comm, dtype)
        _reductions(c)
        _movements(c)
        checked += [f"{dtype} {name}" for name in c.checked]
        problems += [f"{dtype} {problem}" for problem in c.problems]
    return {"checked": checked, "problems": problems}


def _assert_all_well(results: dict[int, Any] | list[Any], dtypes: list[str]) -> None:
    values = list(results.values()) if isinstance(results, dict) else results
    for result in values:
        if isinstance(result, BaseException):
            raise result
        assert result["problems"] == []
        assert len(result["checked"]) >= 20 * len(dtypes)


def _two_peers(fn: Any, backend: str = "torch") -> list[Any]:
    """``fn(comm, i)`` on 2 peer threads of one node; their results (an error raised)."""
    config = burncoll.CollectiveConfig(num_devices=2, backend=backend, timeout=20.0)
    results = run_peers(config, lambda comm, i: fn(comm, i))
    for result in results:
        if isinstance(result, BaseException):
            raise result
    return results


@pytest.mark.parametrize("dtype", DTYPES)
def test_every_collective_on_one_node_of_4_devices(dtype: str) -> None:
    config = burncoll.CollectiveConfig(num_devices=4, backend="torch", timeout=20.0)
    _assert_all_well(run_peers(config, lambda comm, _: every_collective(comm, [dtype])),
                     [dtype])


@pytest.mark.parametrize("strategy", ["ring", "tree"])
def test_every_collective_through_the_local_schedules(strategy: str) -> None:
    # (auto runs these small operations inline: here every backend call gets tensors)
    config = burncoll.CollectiveConfig(
        num_devices=4, backend="torch", timeout=20.0, local_all_reduce_strategy=strategy,
        local_reduce_strategy=strategy, local_broadcast_strategy=strategy)
    _assert_all_well(run_peers(config, lambda comm, _: every_collective(
        comm, ["bfloat16", "int32"])), ["bfloat16", "int32"])


def test_every_collective_across_2_node_processes() -> None:
    records = run_node_processes(__file__, 2, "tcp")
    assert len(records) == 2
    _assert_all_well(records, DTYPES)


def test_every_collective_across_2_nodes_of_2_devices() -> None:
    with burncoll.start_orchestrator() as orch:
        results = run_nodes(orch.address, 2, 2, lambda comm: every_collective(
            comm, ["float32", "bfloat16", "int64"]), backend="torch")
    _assert_all_well(results, ["float32", "bfloat16", "int64"])


@pytest.mark.parametrize("compression", ["bf16", "fp16"])
def test_compressed_all_reduce_returns_the_callers_tensor(compression: str) -> None:
    def run(comm: burncoll.Communicator) -> Any:
        x = torch.full((1000,), 1.0 + comm.rank / 8, dtype=torch.float32)
        return comm.all_reduce(x, compression=compression)

    with burncoll.start_orchestrator() as orch:
        results = run_nodes(orch.address, 2, 2, run, backend="torch")
    want = sum(1.0 + r / 8 for r in range(4))  # exact in 16 bits
    for result in results.values():
        assert isinstance(result, torch.Tensor), result
        assert result.dtype == torch.float32
        np.testing.assert_array_equal(result.numpy(), np.full(1000, want))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "int64"])
def test_large_all_reduces_on_one_node_write_the_callers_memory(dtype: str) -> None:
    rows = (1 << 20) // 3 + 5  # past INLINE_BYTES in every dtype: the fused host path
    inputs = np.stack([_values(r, rows) for r in range(4)])

    def run(comm: burncoll.Communicator, i: int) -> Any:
        x = _tensor(inputs[i], dtype)
        results = [comm.all_reduce(x, op) for op in ("sum", "max", "mean")]
        out = torch.empty_like(x)
        results.append(out if comm.all_reduce(x, out=out) is out else None)
        address = x.data_ptr()
        comm.all_reduce(x, out=x)
        results.append(x if x.data_ptr() == address else None)
        return results

    config = burncoll.CollectiveConfig(num_devices=4, backend="torch", timeout=60.0)
    wants = [reduced_float64(inputs, op) for op in ("sum", "max", "mean", "sum", "sum")]
    for results in run_peers(config, run):
        assert not isinstance(results, BaseException), results
        for k, (got, want) in enumerate(zip(results, wants, strict=True)):
            dtype_wanted = "float64" if k == 2 and dtype == "int64" else dtype
            assert got.dtype == getattr(torch, dtype_wanted) and got.shape == (rows, 3)
            np.testing.assert_array_equal(got.to(torch.float64).numpy(), want)


def test_all_reduce_tree_of_tensors_keeps_each_leafs_dtype() -> None:
    def run(comm: burncoll.Communicator, i: int) -> Any:
        tree = {"w": _tensor(_values(i, 4), "float32"),
                "b": [_tensor(_values(i + 2, 1), "bfloat16"), _tensor(_values(i + 4, 2), "int64")]}
        return comm.all_reduce_tree(tree, "sum", bucket_bytes=64)

    wants = [_values(0, 4) + _values(1, 4), _values(2, 1) + _values(3, 1),
             _values(4, 2) + _values(5, 2)]
    for result in _two_peers(run):
        leaves = [result["w"], *result["b"]]
        for leaf, want, dtype in zip(leaves, wants, ["float32", "bfloat16", "int64"], strict=True):
            assert isinstance(leaf, torch.Tensor) and leaf.dtype == getattr(torch, dtype)
            np.testing.assert_array_equal(leaf.to(torch.float64).numpy(), want)

# -- what torch adds: grads, layouts, dtypes, devices, the backend's name -----------------------
def test_a_tensor_that_requires_grad_is_reduced_on_its_data_as_torch_distributed_does(
) -> None:
    def run(comm: burncoll.Communicator, i: int) -> Any:
        p = torch.nn.Parameter(torch.full((5,), float(i + 1)))
        fresh = comm.all_reduce(p)
        address = p.data_ptr()
        assert comm.all_reduce(p, out=p) is p  # in place, on its data: no autograd record
        return fresh, p, address

    for fresh, p, address in _two_peers(run):
        assert not fresh.requires_grad and fresh.dtype == torch.float32
        np.testing.assert_array_equal(fresh.numpy(), np.full(5, 3.0))
        assert p.requires_grad and p.grad is None and p.data_ptr() == address
        np.testing.assert_array_equal(p.detach().numpy(), np.full(5, 3.0))


def test_non_contiguous_tensors_in_and_a_non_contiguous_out_refused() -> None:
    base = [np.arange(12.0).reshape(3, 4) * (i + 1) for i in range(2)]

    def run(comm: burncoll.Communicator, i: int) -> Any:
        x = torch.tensor(base[i]).T  # (4, 3), not contiguous
        got = comm.all_reduce(x)
        with pytest.raises(burncoll.UsageError, match="contiguous"):
            comm.all_reduce(x, out=torch.empty(3, 4, dtype=torch.float64).T)
        return got

    for got in _two_peers(run):
        assert isinstance(got, torch.Tensor) and tuple(got.shape) == (4, 3)
        np.testing.assert_array_equal(got.numpy(), (base[0] + base[1]).T)


@pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental")
def test_bool_and_complex_tensors_and_unsupported_dtypes() -> None:
    def run(comm: burncoll.Communicator, i: int) -> Any:
        flags = comm.all_reduce(torch.tensor([i == 0, False, True]), "bor")
        z = comm.all_reduce(torch.tensor([1 + 2j, i * 1j], dtype=torch.complex64))
        for dtype in (torch.complex32, torch.float8_e4m3fn):
            with pytest.raises(burncoll.UsageError, match=f"dtype {str(dtype)[6:]} is not "
                                                          "supported"):
                comm.all_reduce(torch.zeros(3).to(dtype))
        with pytest.raises(burncoll.UsageError, match="meta"):
            comm.all_reduce(torch.zeros(3, device="meta"))
        return flags, z

    for flags, z in _two_peers(run):
        assert flags.dtype == torch.bool and flags.tolist() == [True, False, True]
        assert z.dtype == torch.complex64
        np.testing.assert_array_equal(z.numpy(), np.array([2 + 4j, 1j], np.complex64))


def test_an_array_of_another_backend_is_refused_naming_its_backend() -> None:
    def tensor_to_numpy_backend(comm: burncoll.Communicator, i: int) -> None:
        with pytest.raises(burncoll.UsageError, match=r"pass backend='torch' to Collective"):
            comm.all_reduce(torch.ones(3))
        with pytest.raises(burncoll.UsageError, match=r"pass backend='torch'"):
            comm.send(torch.ones(3), comm.peer_ids[1 - i])

    def array_to_torch_backend(comm: burncoll.Communicator, i: int) -> None:
        with pytest.raises(burncoll.UsageError, match=r"pass backend='numpy'"):
            comm.broadcast(np.ones(3), comm.peer_ids[0])

    assert _two_peers(tensor_to_numpy_backend, "numpy") == [None, None]
    assert _two_peers(array_to_torch_backend) == [None, None]


def test_the_backend_is_chosen_in_yaml_or_the_environment(
        tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "torch.yaml"
    path.write_text("backend: torch\nnum_devices: 2\n")
    assert burncoll.CollectiveConfig.from_yaml(path).backend == "torch"
    monkeypatch.setenv("BURNCOLL_BACKEND", "torch")
    assert burncoll.CollectiveConfig().backend == "torch"
    monkeypatch.setenv("BURNCOLL_BACKEND", "tensorflow")
    with pytest.raises(burncoll.ConfigError, match="numpy, jax, cupy, torch"):
        burncoll.CollectiveConfig()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device here")
def test_cuda_tensors_stay_on_the_callers_device() -> None:  # pragma: no cover - no GPU here
    n = min(2, torch.cuda.device_count())
    config = burncoll.CollectiveConfig(num_devices=n, backend="torch", timeout=20.0)

    def run(comm: burncoll.Communicator, i: int) -> Any:
        x = torch.full((1 << 16,), float(i + 1), dtype=torch.bfloat16, device=f"cuda:{i}")
        out = torch.empty_like(x)
        assert comm.all_reduce(x, out=out) is out
        return comm.all_reduce(x), out, comm.all_gather(x)

    for i, (fresh, out, gathered) in enumerate(run_peers(config, run)):
        for got in (fresh, out, gathered):
            assert got.device == torch.device("cuda", i) and got.dtype == torch.bfloat16
        want = float(sum(range(1, n + 1)))
        assert torch.equal(fresh.cpu(), torch.full((1 << 16,), want, dtype=torch.bfloat16))
        assert torch.equal(out, fresh)


if __name__ == "__main__":
    communicator, node, _, _ = register_node_process(sys.argv[1:], backend="torch")
    record = every_collective(communicator, DTYPES)
    communicator.finish()
    print(json.dumps({"node": node, **record}), flush=True)
