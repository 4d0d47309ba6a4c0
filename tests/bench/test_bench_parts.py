"""The benchmark's pure parts: option parsing, references and tolerances, busbw factors."""

from __future__ import annotations

import numpy as np
import pytest

from burncoll.bench.check import ReferenceCache, count_wrong, element_counts, peer_input
from burncoll.bench.options import format_size, parse_ops, parse_size, size_sweep
from burncoll.bench.results import busbw_factor, median


@pytest.mark.parametrize(
    ("text", "value"),
    [("8", 8), ("1K", 1024), ("64M", 64 * 2**20), ("1g", 2**30), ("2KB", 2048), ("3 MiB", 3 << 20)],
)
def test_parse_size(text: str, value: int) -> None:
    assert parse_size(text) == value
    assert parse_size(format_size(value)) == value


@pytest.mark.parametrize("text", ["", "K", "1.5M", "0", "-8", "1T", "12Q"])
def test_parse_size_rejects(text: str) -> None:
    with pytest.raises(ValueError, match="invalid size"):
        parse_size(text)


def test_size_sweep_like_nccl_tests() -> None:
    assert size_sweep(8, 64, 2) == [8, 16, 32, 64]
    assert size_sweep(1024, 5000, 4) == [1024, 4096]
    assert size_sweep(7, 7, 2) == [7]


def test_parse_ops() -> None:
    assert parse_ops("all")[0] == "all_reduce" and len(parse_ops("all")) == 6
    assert parse_ops("reduce-scatter, barrier,barrier") == ("reduce_scatter", "barrier")
    with pytest.raises(ValueError, match="invalid --op"):
        parse_ops("allreduce")


def test_busbw_factors() -> None:
    assert busbw_factor("all_reduce", 4) == pytest.approx(1.5)
    assert busbw_factor("reduce_scatter", 4) == pytest.approx(0.75)
    assert busbw_factor("all_gather", 2) == pytest.approx(0.5)
    assert busbw_factor("broadcast", 8) == busbw_factor("reduce", 8) == 1.0
    assert median([3.0, 1.0, 2.0]) == 2.0 and median([4.0, 1.0, 2.0, 3.0]) == 2.5


def test_element_counts() -> None:
    assert element_counts("all_reduce", 10, 4, 3) == (2, 2)
    assert element_counts("all_gather", 64, 4, 3) == (15, 5)
    assert element_counts("reduce_scatter", 64, 4, 3) == (15, 15)


@pytest.mark.parametrize("dtype", ["float16", "float32", "float64", "int8", "uint16", "int64"])
@pytest.mark.parametrize("redop", ["sum", "mean", "max", "min", "prod"])
def test_reference_matches_numpy_and_catches_one_wrong_element(dtype: str, redop: str) -> None:
    world, count = 3, 1000
    inputs = [peer_input(r, count, dtype) for r in range(world)]
    combine = {
        "sum": np.add,
        "mean": np.add,
        "prod": np.multiply,
        "max": np.maximum,
        "min": np.minimum,
    }[redop]
    with np.errstate(over="ignore"):
        got = inputs[0].copy()
        for x in inputs[1:]:
            got = combine(got, x)
    if redop == "mean":
        got = np.divide(got, world, dtype=got.dtype if got.dtype.kind == "f" else np.float64)
    expected = ReferenceCache(world).expected("all_reduce", count, dtype, redop, 0, 0)
    assert count_wrong(got, expected) == 0
    broken = got.copy()
    broken[17] += 1
    assert count_wrong(broken, expected) == 1
    assert count_wrong(got[:-1], expected) == count
    assert count_wrong(None, expected) == count


def test_reduce_scatter_blocks_and_reduce_non_root() -> None:
    cache = ReferenceCache(3)
    total = sum(peer_input(r, 10, "float64") for r in range(3))
    for rank, block in enumerate(np.array_split(total, 3)):
        expected = cache.expected("reduce_scatter", 10, "float64", "sum", 0, rank)
        assert count_wrong(block, expected) == 0
    assert cache.expected("reduce", 10, "float64", "sum", 0, 1) is None
    assert count_wrong(None, None) == 0
    assert count_wrong(total, None) == 10
