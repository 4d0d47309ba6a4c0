"""Compressed all-reduces across nodes: ``compression="bf16" | "fp16"`` (config or per call).

Real nodes (threads of this process, each node its own config, sockets on 127.0.0.1) reduce
random float32 and float64 arrays; the result is compared with the float64 sum of the inputs
against the documented bound ``(nodes + 1) * u * sum(|x_i|)``, every peer's result must be
bitwise identical, and the uncompressed path must stay exact. Disagreeing peers fail with a
MismatchError; the codec itself is checked against ml_dtypes/NumPy where they exist.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

import burncoll
from burncoll import compression
from burncoll.errors import UsageError
from tests.harness import run_nodes, run_peers


def _nodes(nodes: int, devices: int, fn: Callable[[burncoll.Communicator], Any],
           transport: str = "websocket", **config: Any) -> dict[int, Any]:
    with burncoll.start_orchestrator(transport=transport, expected_nodes=nodes) as orch:
        return run_nodes(orch.address, nodes, devices, fn, transport=transport, timeout=15,
                         **config)


def _x(rank: int, n: int, dtype: str) -> np.ndarray:
    rng = np.random.default_rng(rank)
    return (rng.standard_normal(n) * 10.0 ** rng.integers(-3, 3, n)).astype(dtype)


@pytest.mark.parametrize("kind", ["bf16", "fp16"])
@pytest.mark.parametrize(("nodes", "devices", "strategy", "n"), [
    (2, 1, "auto", 100_000), (2, 1, "tree", 1_000), (3, 2, "ring", 3_000_000),
    (2, 1, "ring", 5_000_000),
    (3, 1, "centralized", 10), (2, 2, "auto", 1),
])
def test_the_error_stays_within_the_documented_bound(kind: str, nodes: int, devices: int,
                                                     strategy: str, n: int) -> None:
    def work(comm: burncoll.Communicator) -> Any:
        x32, x64 = _x(comm.rank, n, "float32"), _x(comm.rank + 50, n, "float64")
        return (comm.all_reduce(x32, compression=kind), comm.all_reduce(x64, "mean"),
                comm.all_reduce(x32, compression="none"))

    results = _nodes(nodes, devices, work, global_all_reduce_strategy=strategy,
                     compression=kind)
    world = nodes * devices
    got = [results[r] for r in range(world)]
    for g in got:
        assert not isinstance(g, BaseException), g
    for i, dtype in enumerate(["float32", "float64"]):
        first = got[0][i]
        assert first.dtype == np.dtype(dtype)  # accumulated and returned in the input's dtype
        assert all(np.array_equal(g[i], first) for g in got), "peers differ"
        xs = [_x(r + 50 * i, n, dtype).astype(np.float64) for r in range(world)]
        ref, mag = sum(xs), sum(np.abs(x) for x in xs)
        if i == 1:  # the mean
            ref, mag = ref / world, mag / world
        error = np.abs(first.astype(np.float64) - ref)
        bound = compression.error_bound(kind, nodes, mag, dtype)
        assert (error <= bound + 1e-9).all(), error.max()
        if n >= 1000:  # it really was compressed: more error than float32 alone
            assert error.max() > 1e-5 * mag.max()
    exact = sum(_x(r, n, "float32").astype(np.float64) for r in range(world))
    np.testing.assert_allclose(got[0][2], exact, rtol=1e-5, atol=1e-3)


def test_config_compression_leaves_other_dtypes_whole_and_calls_may_opt_out() -> None:
    def work(comm: burncoll.Communicator) -> Any:
        big = np.full(4, 2**20 + 1, np.int64) + comm.rank
        x = np.full(4, 1 + 2**-12, np.float32)
        return (comm.all_reduce(big), comm.all_reduce(x), comm.all_reduce(x, compression="none"),
                comm.all_reduce(np.full(4, 1 + 2**-12, np.float16)))

    results = _nodes(2, 1, work, compression="bf16")
    for r in range(2):
        ints, squeezed, whole, half = results[r]
        assert (ints == 2 * (2**20 + 1) + 1).all()  # never compressed
        assert (squeezed == 2.0).all()  # bf16 has no room for 2**-12
        assert (whole == np.float32(2 * (1 + 2**-12))).all()
        assert half.dtype == np.float16 and (half == np.float16(2 * (1 + 2**-12))).all()


def test_bad_and_disagreeing_compression() -> None:
    def work(comm: burncoll.Communicator, i: int) -> None:
        with pytest.raises(UsageError, match="applies to float32 and float64"):
            comm.all_reduce(np.zeros(3, np.int32), compression="bf16")
        with pytest.raises(UsageError, match="expected one of bf16, fp16"):
            comm.all_reduce(np.zeros(3), compression="int8")

    for got in run_peers(burncoll.CollectiveConfig(num_devices=2, timeout=5), work):
        assert got is None, got  # (a single node checks the arguments too, then ignores it)
    with pytest.raises(burncoll.ConfigError, match="compression='zip'"):
        burncoll.CollectiveConfig(compression="zip")

    def differ(comm: burncoll.Communicator) -> str:
        with pytest.raises(burncoll.CollectiveError) as info:
            comm.all_reduce(np.ones(1000, np.float32),
                            compression="bf16" if comm.rank == 0 else "fp16")
        return type(info.value).__name__ + ": " + str(info.value)

    results = _nodes(2, 1, differ)
    for text in results.values():
        assert isinstance(text, str) and "compressed bf16" in text, text
        assert text.startswith(("MismatchError", "CollectiveAborted")), text

    def agree(comm: burncoll.Communicator, i: int) -> Any:  # one node: nothing on a wire
        return comm.all_reduce(np.ones(3, np.float32), compression="bf16" if i else "fp16")

    for got in run_peers(burncoll.CollectiveConfig(num_devices=2, timeout=5), agree):
        np.testing.assert_array_equal(got, np.full(3, 2.0, np.float32))


def test_compression_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BURNCOLL_COMPRESSION", "fp16")
    assert burncoll.CollectiveConfig().compression == "fp16"
    monkeypatch.setenv("BURNCOLL_COMPRESSION", "none")
    assert burncoll.CollectiveConfig().compression is None


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
def test_the_codec_rounds_to_nearest_even_and_keeps_nan_and_inf() -> None:
    special = np.array([0.0, -0.0, 1.0, -2.5, np.inf, -np.inf, np.nan, 3e38, 1e-40,
                        1 + 2**-8, 1 + 3 * 2**-8, 65504.0, 7e4], np.float32)
    bits = np.array([0x7F800001], np.uint32).view(np.float32)  # a NaN with a low payload
    x = np.concatenate([special, bits, np.random.default_rng(0).standard_normal(10_000)
                        .astype(np.float32)])
    ml_dtypes = pytest.importorskip("ml_dtypes")
    bf = compression.decode(compression.encode(x, "bf16"), "bf16")
    want = x.astype(ml_dtypes.bfloat16).astype(np.float32)
    np.testing.assert_array_equal(bf, want)
    assert np.isnan(bf[-10_001])
    fp = compression.decode(compression.encode(x, "fp16"), "fp16")
    np.testing.assert_array_equal(fp, x.astype(np.float16).astype(np.float32))
    y = x.astype(np.float64)
    compression.quantize(y, "bf16")
    np.testing.assert_array_equal(y.astype(np.float32), want)



def test_the_bit_operations_round_as_ml_dtypes_does(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without ml_dtypes bf16 is rounded with NumPy bit operations: the same values."""
    ml_dtypes = pytest.importorskip("ml_dtypes")
    rng = np.random.default_rng(1)
    x = np.concatenate([rng.standard_normal(50_000).astype(np.float32),
                        rng.integers(0, 2**32, 50_000, dtype=np.uint32).view(np.float32)])
    monkeypatch.setattr(compression, "_bfloat16", lambda: None)
    with np.errstate(invalid="ignore"):
        got = compression.decode(compression.encode(x, "bf16"), "bf16")
        want = x.astype(ml_dtypes.bfloat16).astype(np.float32)
    same = (got.view(np.uint32) == want.view(np.uint32)) | (np.isnan(got) & np.isnan(want))
    assert same.all()


def test_importing_burncoll_leaves_ml_dtypes_to_the_first_bf16_operation() -> None:
    """ml_dtypes costs a process ~1 s of CPU to import: a fresh interpreter that imports
    burncoll has not imported it, and its first bf16 encoding does (the same bits as the
    bit operations' rounding)."""
    script = (
        "import sys, numpy as np, burncoll\n"
        "from burncoll import compression\n"
        "before = 'ml_dtypes' in sys.modules\n"
        "raw = compression.encode(np.array([1.0, 1.00390625, -2.5e-3], np.float32), 'bf16')\n"
        "print(before, 'ml_dtypes' in sys.modules, raw.tolist())\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120, check=True)
    before, after, raw = done.stdout.split(" ", 2)
    assert (before, after) == ("False", "True"), done.stdout
    want = np.array([1.0, 1.00390625, -2.5e-3], np.float32).view(np.uint32)
    rounded = (want + 0x7FFF + ((want >> 16) & 1)) >> 16  # round to nearest even
    assert [int(v) for v in raw.strip("[]\n").split(", ")] == rounded.tolist()
