"""dtype names as users write them, and the host view behind every ``from_host``."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest

from burncoll.dtypes import (
    SUPPORTED_DTYPES,
    dtype_from_name,
    dtype_name,
    host_view,
    is_inexact,
)
from burncoll.errors import UsageError

HAS_ML_DTYPES = importlib.util.find_spec("ml_dtypes") is not None


@pytest.mark.parametrize("name", SUPPORTED_DTYPES)
def test_names_round_trip(name: str) -> None:
    if name == "bfloat16" and not HAS_ML_DTYPES:
        pytest.skip("ml_dtypes is not installed")
    assert dtype_name(dtype_from_name(name)) == name


@pytest.mark.parametrize(
    ("spelling", "name"), [("<f4", "float32"), ("f8", "float64"), ("i8", "int64"), ("?", "bool")]
)
def test_numpy_spellings_are_accepted_and_normalised(spelling: str, name: str) -> None:
    assert dtype_name(dtype_from_name(spelling)) == name
    assert dtype_name(np.dtype(spelling)) == name


@pytest.mark.parametrize("name", ["float128", "object", "U3", ">f4", "datetime64[s]", "nope"])
def test_unsupported_names_list_the_supported_ones(name: str) -> None:
    with pytest.raises(UsageError, match="float32"):
        dtype_from_name(name)


def test_bfloat16_without_ml_dtypes(monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    from burncoll import dtypes

    monkeypatch.setitem(sys.modules, "ml_dtypes", None)
    dtypes._bfloat16.cache_clear()
    try:
        with pytest.raises(UsageError, match="ml_dtypes"):
            dtype_from_name("bfloat16")
    finally:
        monkeypatch.undo()
        dtypes._bfloat16.cache_clear()


def test_the_dtype_table_is_consistent() -> None:
    from burncoll.dtypes import DTYPE_TABLE, ITEMSIZES, WIRE_CODES, WIRE_NAMES

    codes = [code for _, code, _ in DTYPE_TABLE]
    assert len(set(codes)) == len(codes) and 0 not in codes
    assert all(WIRE_NAMES[WIRE_CODES[name]] == name for name in SUPPORTED_DTYPES)
    for name in SUPPORTED_DTYPES:
        if name != "bfloat16":
            assert ITEMSIZES[name] == np.dtype(name).itemsize, name
    assert ITEMSIZES["bfloat16"] == 2


def test_is_inexact() -> None:
    for name in ("float16", "float32", "float64", "complex64"):
        assert is_inexact(dtype_from_name(name))
    for name in ("int32", "uint8", "bool"):
        assert not is_inexact(dtype_from_name(name))
    if HAS_ML_DTYPES:
        assert is_inexact(dtype_from_name("bfloat16"))


def test_host_view_reinterprets_raw_bytes_without_copying() -> None:
    ref = np.arange(6, dtype=np.float32).reshape(2, 3)
    raw = ref.reshape(-1).view(np.uint8)
    view = host_view(raw, "float32", (2, 3))
    assert np.shares_memory(view, ref)
    np.testing.assert_array_equal(view, ref)


def test_host_view_never_converts_values() -> None:
    with pytest.raises(UsageError, match="cannot read float32 elements from a int64 buffer"):
        host_view(np.arange(3), "float32", (3,))
    with pytest.raises(UsageError, match="non-negative"):
        host_view(np.zeros(0, np.float32), "float32", (-1,))
