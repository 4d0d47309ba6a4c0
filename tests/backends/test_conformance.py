"""The backend conformance suite: every installed backend must pass every test here.

Each test checks one clause of the :class:`~burncoll.backends.base.Backend` contract against
a NumPy float64 (or exact) reference. Arrays enter a backend through ``from_host`` and leave
through ``to_host``; both are themselves checked in the round-trip tests at the end.
"""

from __future__ import annotations

import importlib.util
import threading
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from burncoll.backends import Backend
from burncoll.dtypes import SUPPORTED_DTYPES, dtype_from_name
from burncoll.errors import ConfigError, UsageError

NDArray = np.ndarray[Any, Any]

FLOAT_DTYPES = ["float16", "bfloat16", "float32", "float64"]
INT_DTYPES = ["int32", "int64"]
X64_DTYPES = {"float64", "int64", "uint64", "complex128"}
#: Relative tolerance of one rounding step, by dtype.
RTOL = {"float16": 1e-3, "bfloat16": 8e-3, "float32": 1e-6, "float64": 1e-12}
SHAPES = [(), (0,), (1,), (7,), (3, 5), (2, 0, 3), (2, 3, 4)]
EXPECTED_MUTABLE = {"numpy": True, "jax": False, "cupy": True, "torch": True}

REDUCTIONS: dict[str, Callable[[NDArray, NDArray], NDArray]] = {
    "add": np.add,
    "maximum": np.maximum,
    "minimum": np.minimum,
    "multiply": np.multiply,
}


# -- helpers ------------------------------------------------------------------------------
def logical(backend: Backend) -> bool:
    """Whether ``backend``'s devices are logical CPU devices sharing host memory (NumPy, and
    torch without CUDA), so that an array's device is ``cpu:0`` whichever one it was for."""
    return backend.name == "numpy" or (backend.name == "torch" and not torch_cuda())


def torch_cuda() -> bool:
    import torch

    return bool(torch.cuda.is_available())


def all_devices(backend: Backend) -> list[Any]:
    """Every device the suite spreads arrays over: 4 logical CPU ones, else all there are."""
    if logical(backend):
        return backend.devices(4)
    if backend.name == "torch":  # pragma: no cover - no CUDA device here
        import torch

        return backend.devices(torch.cuda.device_count())
    if backend.name == "jax":
        import jax

        return backend.devices(len(jax.devices()))
    import cupy

    return backend.devices(cupy.cuda.runtime.getDeviceCount())


def jax_x64() -> bool:
    import jax

    return bool(jax.config.jax_enable_x64)


def has_dtype(backend: Backend, name: str) -> bool:
    """Whether ``backend`` can hold ``name`` arrays here."""
    if name == "bfloat16" and importlib.util.find_spec("ml_dtypes") is None:
        return False
    if backend.name == "jax" and name in X64_DTYPES:
        return jax_x64()
    if backend.name == "cupy" and name == "bfloat16":
        try:
            backend.empty(1, name, backend.devices(1)[0])
        except UsageError:
            return False
    return True


def need_dtype(backend: Backend, name: str) -> None:
    if not has_dtype(backend, name):
        pytest.skip(f"the {backend.name} backend has no {name} here")


def sample(name: str, shape: tuple[int, ...], seed: int = 0) -> NDArray:
    """Random values of dtype ``name`` and ``shape``, exactly representable."""
    rng = np.random.default_rng(seed)
    dtype = dtype_from_name(name)
    if dtype.kind == "b":
        return rng.integers(0, 2, size=shape).astype(dtype)
    if dtype.kind in "iu":
        return rng.integers(-40 if dtype.kind == "i" else 0, 40, size=shape).astype(dtype)
    if dtype.kind == "c":
        return (rng.standard_normal(shape) + 1j * rng.standard_normal(shape)).astype(dtype)
    return (rng.standard_normal(shape) * 4).astype(dtype)


def make(backend: Backend, ref: NDArray, device: Any = None) -> Any:
    """``ref`` as an array of ``backend`` on ``device`` (default: the first device).

    The array never shares memory with ``ref`` (NumPy's ``from_host`` would), so that ``ref``
    stays a reference whatever the test does to the array.
    """
    if device is None:
        device = backend.devices(1)[0]
    return backend.from_host(ref.copy(), str(ref.dtype), ref.shape, device)


def host(backend: Backend, x: Any) -> NDArray:
    return np.asarray(backend.to_host(x))


def assert_close(actual: NDArray, expected: NDArray, name: str) -> None:
    """``actual`` equals the float64 reference ``expected`` up to one rounding in ``name``."""
    assert str(actual.dtype) == name
    if name in RTOL:
        np.testing.assert_allclose(
            actual.astype(np.float64), expected, rtol=RTOL[name], atol=RTOL[name]
        )
    else:
        np.testing.assert_array_equal(actual, expected)


# -- identity and devices -------------------------------------------------------------------
def test_name_and_mutability(backend: Backend, backend_name: str) -> None:
    assert isinstance(backend, Backend)
    assert backend.name == backend_name
    assert backend.mutable is EXPECTED_MUTABLE[backend_name]


def test_devices_are_distinct_and_in_order(backend: Backend) -> None:
    devices = all_devices(backend)
    n = len(devices)
    if backend.name == "jax":
        import jax

        assert devices == jax.devices()[:n]
        if devices[0].platform == "cpu":
            assert n == 4, "tests/conftest.py asks XLA for 4 CPU devices"
    if backend.name == "cupy":
        assert [d.id for d in devices] == list(range(n))
    for i in range(n):
        for j in range(n):
            assert (devices[i] == devices[j]) is (i == j)
    for k in range(1, n + 1):
        assert backend.devices(k) == devices[:k]


def test_devices_refuses_zero(backend: Backend) -> None:
    with pytest.raises(ConfigError):
        backend.devices(0)


def test_devices_refuses_more_than_exist(backend: Backend) -> None:
    if logical(backend):
        assert len(backend.devices(64)) == 64  # logical devices: any number
        return
    n = len(all_devices(backend))
    with pytest.raises(ConfigError, match=f"only {n} exist") as info:
        backend.devices(n + 1)
    if backend.name == "jax" and all_devices(backend)[0].platform == "cpu":
        assert f"--xla_force_host_platform_device_count={n + 1}" in str(info.value)


def test_arrays_land_on_the_device_asked_for(backend: Backend) -> None:
    ref = sample("float32", (6,))
    for device in all_devices(backend):
        for x in (make(backend, ref, device), backend.empty(3, "float32", device)):
            assert backend.same_device(backend.device_of(x), device)
            if not logical(backend):
                assert backend.device_of(x) == device


def test_to_device_moves_and_keeps_values(backend: Backend) -> None:
    devices = all_devices(backend)
    ref = sample("float32", (2, 3))
    x = make(backend, ref, devices[0])
    for device in devices:
        y = backend.to_device(x, device)
        assert backend.same_device(backend.device_of(y), device)
        if not logical(backend):
            assert backend.device_of(y) == device
        np.testing.assert_array_equal(host(backend, y), ref)
    np.testing.assert_array_equal(host(backend, x), ref)


def test_to_device_is_a_no_op_when_already_there(backend: Backend) -> None:
    for device in all_devices(backend):
        x = make(backend, sample("float32", (5,)), device)
        assert backend.to_device(x, device) is x
        assert backend.to_device(x, backend.device_of(x)) is x


def test_logical_devices_share_memory(backend: Backend) -> None:
    if not logical(backend):
        pytest.skip("logical CPU devices only (NumPy, torch without CUDA)")
    a, b = backend.devices(2)
    assert repr(a) == "cpu:0" and repr(b) == "cpu:1"
    assert backend.same_device(a, b)
    x = make(backend, sample("float32", (4,)), b)
    assert backend.device_of(x) == a  # arrays carry no device
    assert backend.to_device(x, b) is x


# -- inspection -----------------------------------------------------------------------------
@pytest.mark.parametrize("name", SUPPORTED_DTYPES)
def test_dtype_name_is_spelled_as_users_write_it(backend: Backend, name: str) -> None:
    need_dtype(backend, name)
    x = make(backend, sample(name, (3,)))
    assert backend.dtype_name(x) == name


def test_shape(backend: Backend) -> None:
    for shape in SHAPES:
        assert backend.shape(make(backend, sample("float32", shape))) == shape


def test_is_array(backend: Backend) -> None:
    assert backend.is_array(make(backend, sample("float32", (3,))))
    for other in ([1.0, 2.0], None, 3.0, np.float32(1.0), "x"):
        assert not backend.is_array(other)
    if backend.name != "numpy":
        assert not backend.is_array(np.zeros(3, np.float32))


# -- creation and layout --------------------------------------------------------------------
@pytest.mark.parametrize("count", [0, 1, 9])
def test_empty(backend: Backend, count: int) -> None:
    device = all_devices(backend)[-1]
    x = backend.empty(count, "float32", device)
    assert backend.shape(x) == (count,)
    assert backend.dtype_name(x) == "float32"
    assert backend.same_device(backend.device_of(x), device)
    if not backend.mutable:
        np.testing.assert_array_equal(host(backend, x), np.zeros(count, np.float32))


def test_empty_refuses_bad_arguments(backend: Backend) -> None:
    device = backend.devices(1)[0]
    with pytest.raises(UsageError):
        backend.empty(-1, "float32", device)
    with pytest.raises(UsageError, match="unsupported dtype"):
        backend.empty(3, "float128", device)


@pytest.mark.parametrize("shape", [(0,), (5,), (2, 3), (2, 3, 4)])
def test_flatten_contiguous(backend: Backend, shape: tuple[int, ...]) -> None:
    ref = sample("float32", shape)
    flat = backend.flatten(make(backend, ref))
    assert backend.shape(flat) == (ref.size,)
    np.testing.assert_array_equal(host(backend, flat), ref.reshape(-1))


def test_flatten_is_a_view_of_a_contiguous_numpy_array(backend: Backend) -> None:
    if backend.name != "numpy":
        pytest.skip("NumPy only")
    x = sample("float32", (2, 3))
    assert np.shares_memory(backend.flatten(x), x)


def test_flatten_non_contiguous_is_c_ordered(backend: Backend) -> None:
    ref = sample("float32", (3, 4))
    transposed = make(backend, ref).T
    np.testing.assert_array_equal(host(backend, backend.flatten(transposed)), ref.T.reshape(-1))


def test_reshape(backend: Backend) -> None:
    ref = sample("int32", (12,))
    y = backend.reshape(make(backend, ref), (3, 4))
    assert backend.shape(y) == (3, 4)
    np.testing.assert_array_equal(host(backend, y), ref.reshape(3, 4))
    with pytest.raises(UsageError):
        backend.reshape(make(backend, ref), (5, 3))


def test_slice(backend: Backend) -> None:
    ref = sample("float32", (10,))
    x = make(backend, ref)
    for start, stop in [(0, 10), (2, 5), (4, 4), (9, 10), (0, 0)]:
        part = backend.slice(x, start, stop)
        assert backend.shape(part) == (stop - start,)
        np.testing.assert_array_equal(host(backend, part), ref[start:stop])


def test_slice_is_a_view_on_mutable_backends(backend: Backend) -> None:
    ref = np.arange(10, dtype=np.float32)
    x = make(backend, ref)
    part = backend.slice(x, 2, 5)
    backend.copy(make(backend, np.zeros(3, np.float32)), out=part)
    expected = ref.copy()
    if backend.mutable:
        expected[2:5] = 0
    np.testing.assert_array_equal(host(backend, x), expected)


def test_slice_refuses_bad_bounds(backend: Backend) -> None:
    x = make(backend, sample("float32", (10,)))
    for start, stop in [(-1, 3), (3, 2), (0, 11)]:
        with pytest.raises(UsageError):
            backend.slice(x, start, stop)
    with pytest.raises(UsageError, match="flat"):
        backend.slice(make(backend, sample("float32", (2, 5))), 0, 1)


def test_concat(backend: Backend) -> None:
    devices = all_devices(backend)
    parts = [sample("float32", (n,), seed=n) for n in (3, 0, 5, 1)]
    xs = [make(backend, p, devices[i % len(devices)]) for i, p in enumerate(parts)]
    y = backend.concat(xs)
    np.testing.assert_array_equal(host(backend, y), np.concatenate(parts))
    assert backend.same_device(backend.device_of(y), devices[0])
    # on the device of the first array, wherever the others are
    y = backend.concat(list(reversed(xs)))
    assert backend.same_device(backend.device_of(y), backend.device_of(xs[-1]))
    if not logical(backend):
        assert backend.device_of(y) == backend.device_of(xs[-1])
    with pytest.raises(UsageError):
        backend.concat([])


def test_concat_rows(backend: Backend) -> None:
    devices = all_devices(backend)
    a, b = sample("float32", (2, 3), seed=1), sample("float32", (1, 3), seed=2)
    y = backend.concat_rows([make(backend, a, devices[-1]), make(backend, b, devices[0])])
    assert backend.shape(y) == (3, 3)
    np.testing.assert_array_equal(host(backend, y), np.concatenate([a, b]))
    assert backend.same_device(backend.device_of(y), devices[-1])
    with pytest.raises(UsageError):
        backend.concat_rows([])
    with pytest.raises(UsageError):
        backend.concat_rows([make(backend, a), make(backend, sample("float32", (1, 4)))])


def test_copy(backend: Backend) -> None:
    ref = sample("float32", (6,))
    x = make(backend, ref)
    c = backend.copy(x)
    assert c is not x
    np.testing.assert_array_equal(host(backend, c), ref)
    # overwrite the original (a no-op on immutable backends): the copy must not change
    backend.copy(make(backend, np.zeros(6, np.float32)), out=x)
    np.testing.assert_array_equal(host(backend, c), ref)


def test_copy_into_out(backend: Backend) -> None:
    ref = sample("float32", (6,))
    out = backend.empty(6, "float32", backend.devices(1)[0])
    result = backend.copy(make(backend, ref), out=out)
    np.testing.assert_array_equal(host(backend, result), ref)
    if backend.mutable:
        assert result is out


# -- reductions -----------------------------------------------------------------------------
@pytest.mark.parametrize("op", sorted(REDUCTIONS))
@pytest.mark.parametrize("name", FLOAT_DTYPES + INT_DTYPES)
def test_reduction(backend: Backend, op: str, name: str) -> None:
    need_dtype(backend, name)
    a_ref, b_ref = sample(name, (33,), seed=1), sample(name, (33,), seed=2)
    a, b = make(backend, a_ref), make(backend, b_ref)
    result = getattr(backend, op)(a, b)
    expected = REDUCTIONS[op](a_ref.astype(np.float64), b_ref.astype(np.float64))
    assert_close(host(backend, result), expected, name)
    np.testing.assert_array_equal(host(backend, a), a_ref)  # inputs untouched
    np.testing.assert_array_equal(host(backend, b), b_ref)


@pytest.mark.parametrize("op", sorted(REDUCTIONS))
def test_reduction_into_out(backend: Backend, op: str) -> None:
    a_ref, b_ref = sample("float32", (17,), seed=1), sample("float32", (17,), seed=2)
    a, b = make(backend, a_ref), make(backend, b_ref)
    out = backend.empty(17, "float32", backend.devices(1)[0])
    result = getattr(backend, op)(a, b, out)
    expected = REDUCTIONS[op](a_ref.astype(np.float64), b_ref.astype(np.float64))
    assert_close(host(backend, result), expected, "float32")
    if backend.mutable:
        assert result is out
        assert_close(host(backend, out), expected, "float32")
    np.testing.assert_array_equal(host(backend, a), a_ref)


def test_reduction_may_write_into_an_input(backend: Backend) -> None:
    a_ref, b_ref = sample("float32", (9,), seed=1), sample("float32", (9,), seed=2)
    a, b = make(backend, a_ref), make(backend, b_ref)
    result = backend.add(a, b, a)
    assert_close(host(backend, result), a_ref.astype(np.float64) + b_ref, "float32")


@pytest.mark.parametrize("op", ["maximum", "minimum"])
def test_nan_propagates(backend: Backend, op: str) -> None:
    a = make(backend, np.array([1.0, np.nan, 3.0, np.nan], np.float32))
    b = make(backend, np.array([np.nan, 2.0, 1.0, np.nan], np.float32))
    result = host(backend, getattr(backend, op)(a, b))
    np.testing.assert_array_equal(np.isnan(result), [True, True, False, True])


@pytest.mark.parametrize("name", FLOAT_DTYPES)
def test_scale_keeps_float_dtypes(backend: Backend, name: str) -> None:
    need_dtype(backend, name)
    ref = sample(name, (20,))
    result = backend.scale(make(backend, ref), 3)
    assert backend.dtype_name(result) == name
    assert_close(host(backend, result), ref.astype(np.float64) / 3, name)


@pytest.mark.parametrize("name", [*INT_DTYPES, "uint8", "bool"])
def test_scale_turns_integers_into_the_default_float(backend: Backend, name: str) -> None:
    need_dtype(backend, name)
    ref = sample(name, (20,))
    result = backend.scale(make(backend, ref), 4)
    default_float = "float32" if backend.name == "jax" and not jax_x64() else "float64"
    assert backend.dtype_name(result) == default_float
    assert_close(host(backend, result), ref.astype(np.float64) / 4, default_float)


def test_scale_refuses_a_non_positive_divisor(backend: Backend) -> None:
    with pytest.raises(UsageError):
        backend.scale(make(backend, sample("float32", (3,))), 0)


def test_threads_on_their_own_devices(backend: Backend) -> None:
    devices = all_devices(backend)
    errors: list[BaseException] = []

    def work(device: Any, seed: int) -> None:
        try:
            for _ in range(20):
                a_ref, b_ref = sample("float32", (256,), seed), sample("float32", (256,), seed + 1)
                y = backend.add(make(backend, a_ref, device), make(backend, b_ref, device))
                assert backend.same_device(backend.device_of(y), device)
                assert_close(host(backend, y), a_ref.astype(np.float64) + b_ref, "float32")
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(d, i)) for i, d in enumerate(devices)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []


# -- the host bridge ------------------------------------------------------------------------
def test_to_host_is_zero_copy_for_numpy(backend: Backend) -> None:
    if backend.name != "numpy":
        pytest.skip("NumPy only")
    x = sample("float32", (8,))
    assert np.shares_memory(backend.to_host(x), x)


def test_to_host_is_zero_copy_for_jax_on_the_cpu(backend: Backend) -> None:
    if backend.name != "jax" or all_devices(backend)[0].platform != "cpu":
        pytest.skip("JAX on the CPU only")
    x = make(backend, sample("float32", (1024,)), all_devices(backend)[-1])
    assert backend.to_host(x).ctypes.data == x.unsafe_buffer_pointer()


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("name", SUPPORTED_DTYPES)
def test_from_host_round_trip(backend: Backend, name: str, shape: tuple[int, ...]) -> None:
    need_dtype(backend, name)
    ref = sample(name, shape)
    device = all_devices(backend)[-1]
    raw = np.frombuffer(ref.tobytes(), np.uint8)  # as the network delivers it: read-only
    for buffer in (ref, raw):
        x = backend.from_host(buffer, name, shape, device)
        assert backend.is_array(x)
        assert backend.shape(x) == shape
        assert backend.dtype_name(x) == name
        assert backend.same_device(backend.device_of(x), device)
        back = host(backend, x)
        assert back.shape == shape and str(back.dtype) == name
        assert back.tobytes() == ref.tobytes()


def test_from_host_numpy_is_writable_and_zero_copy_when_it_can_be(backend: Backend) -> None:
    if backend.name != "numpy":
        pytest.skip("NumPy only")
    device = backend.devices(1)[0]
    ref = sample("float32", (2, 3))
    shared = backend.from_host(ref, "float32", (2, 3), device)
    assert np.shares_memory(shared, ref)
    raw = np.frombuffer(ref.tobytes(), np.uint8)
    copied = backend.from_host(raw, "float32", (2, 3), device)
    assert copied.flags.writeable and not np.shares_memory(copied, raw)
    np.testing.assert_array_equal(copied, ref)


def test_from_host_of_an_immutable_backend_does_not_alias_the_buffer(backend: Backend) -> None:
    if backend.mutable:
        pytest.skip("immutable backends only")
    buffer = np.arange(1 << 16, dtype=np.float32)
    x = backend.from_host(buffer, "float32", buffer.shape, backend.devices(1)[0])
    buffer[:] = -1
    np.testing.assert_array_equal(host(backend, x), np.arange(1 << 16, dtype=np.float32))


def test_from_host_refuses_mismatched_buffers(backend: Backend) -> None:
    device = backend.devices(1)[0]
    with pytest.raises(UsageError, match="needs 6"):
        backend.from_host(np.zeros(5, np.float32), "float32", (2, 3), device)
    with pytest.raises(UsageError, match="bytes"):
        backend.from_host(np.zeros(23, np.uint8), "float32", (2, 3), device)
    with pytest.raises(UsageError, match="float64"):
        backend.from_host(np.zeros(6, np.float64), "float32", (2, 3), device)
    with pytest.raises(UsageError, match="unsupported dtype"):
        backend.from_host(np.zeros(6, np.uint8), "<f4x", (6,), device)


def test_jax_refuses_64_bit_dtypes_without_x64(backend: Backend) -> None:
    if backend.name != "jax" or jax_x64():
        pytest.skip("JAX without x64 only")
    device = backend.devices(1)[0]
    for name in sorted(X64_DTYPES):
        with pytest.raises(UsageError, match="JAX_ENABLE_X64"):
            backend.from_host(sample(name, (3,)), name, (3,), device)
        with pytest.raises(UsageError, match="JAX_ENABLE_X64"):
            backend.empty(3, name, device)
