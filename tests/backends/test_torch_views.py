"""The torch backend's bridge: CPU tensors are NumPy views and back without a copy, in every
dtype (bfloat16 through ml_dtypes), on logical CPU devices; CUDA tensors go to CuPy through
DLPack, which skips here (no GPU). The backend's contract itself is checked by
``test_conformance.py`` like every backend's."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch is not installed")

from burncoll.backends import get_backend  # noqa: E402
from burncoll.backends.numpy import CpuDevice  # noqa: E402
from burncoll.backends.torch import as_array, as_tensor, shares_memory  # noqa: E402
from burncoll.dtypes import SUPPORTED_DTYPES, dtype_from_name, dtype_name  # noqa: E402
from burncoll.errors import UsageError  # noqa: E402


@pytest.fixture
def backend() -> Any:
    return get_backend("torch")


def _tensor(name: str) -> Any:
    values = torch.arange(-3, 9).reshape(3, 4)
    return (values % 2 == 0) if name == "bool" else values.to(getattr(torch, name))


@pytest.mark.parametrize("name", SUPPORTED_DTYPES)
def test_tensors_are_numpy_views_and_back_in_every_dtype(backend: Any, name: str) -> None:
    t = _tensor(name)
    view = as_array(t)
    assert isinstance(view, np.ndarray) and dtype_name(view.dtype) == name
    assert view.ctypes.data == t.data_ptr() and view.shape == (3, 4)
    assert backend.dtype_name(t) == name
    back = as_tensor(view)
    assert back.dtype == t.dtype and back.data_ptr() == t.data_ptr()
    assert torch.equal(back, t)
    host = backend.to_host(t)
    assert host.ctypes.data == t.data_ptr()
    np.testing.assert_array_equal(host.astype(np.complex128), t.to(torch.complex128).numpy())


def test_writes_through_a_view_reach_the_tensor(backend: Any) -> None:
    t = torch.zeros(4, dtype=torch.bfloat16)
    as_array(t)[1:3] = np.array([1.5, -2.0], dtype=dtype_from_name("bfloat16"))
    assert t.tolist() == [0.0, 1.5, -2.0, 0.0]
    flat = backend.flatten(t)
    assert flat.data_ptr() == t.data_ptr()
    backend.copy(torch.ones(2, dtype=torch.bfloat16), out=backend.slice(flat, 2, 4))
    assert t.tolist() == [0.0, 1.5, 1.0, 1.0]


def test_from_host_shares_a_writable_buffer_and_copies_a_read_only_one(backend: Any) -> None:
    device = backend.devices(2)[1]
    buffer = np.arange(6, dtype=np.float32)
    shared = backend.from_host(buffer, "float32", (2, 3), device)
    assert shared.data_ptr() == buffer.ctypes.data and shared.shape == (2, 3)
    raw = np.frombuffer(buffer.tobytes(), np.uint8)  # as the network delivers it: read-only
    copied = backend.from_host(raw, "float32", (6,), device)
    assert copied.data_ptr() != raw.ctypes.data
    copied[0] = 7.0  # writable
    np.testing.assert_array_equal(copied.numpy(), [7, 1, 2, 3, 4, 5])


def test_shares_memory_agrees_with_numpy_on_views() -> None:
    base = torch.arange(24.0).reshape(4, 6)
    others = [base, base[1], base[:, 2], base[2:, 3:], base.T, base.clone(), base[0, :0],
              torch.from_numpy(base.numpy()[3])]
    for x in others:
        for y in others:
            assert shares_memory(x, y) == np.may_share_memory(x.numpy(), y.numpy()), (x, y)


def test_a_tensor_that_requires_grad_is_viewed_detached() -> None:
    p = torch.nn.Parameter(torch.ones(3))
    as_array(p)[0] = 5.0
    assert p.requires_grad and p.detach().tolist() == [5.0, 1.0, 1.0]


def test_tensors_without_a_numpy_view_are_refused(backend: Any) -> None:
    with pytest.raises(UsageError, match="meta"):
        as_array(torch.zeros(2, device="meta"))
    with pytest.raises(UsageError, match="dense"):
        as_array(torch.zeros(2).to_sparse())
    with pytest.raises(UsageError, match="float8_e4m3fn has no NumPy view"):
        as_array(torch.zeros(2).to(torch.float8_e4m3fn))
    assert backend.dtype_name(torch.zeros(2).to(torch.float8_e4m3fn)) == "float8_e4m3fn"
    with pytest.raises(UsageError, match="conjugate"):  # (writes would miss the tensor)
        as_array(torch.ones(2, dtype=torch.complex64).conj())
    with pytest.raises(UsageError, match=r"needs a torch\.Tensor"):
        as_array([1.0])


def test_cpu_devices(backend: Any) -> None:
    if torch.cuda.is_available():  # pragma: no cover - no CUDA device here
        pytest.skip("CPU devices are the default only without CUDA")
    assert backend.devices(3) == [CpuDevice(0), CpuDevice(1), CpuDevice(2)]
    t = torch.zeros(2)
    assert backend.same_device(backend.device_of(t), torch.device("cpu"))
    assert backend.to_device(t, torch.device("cpu")) is t
    assert backend.from_host(np.zeros(2), "float64", (2,), torch.device("cpu")).shape == (2,)
    with pytest.raises(UsageError, match=r"torch\.device"):
        backend.same_device(CpuDevice(0), "cpu")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device here")
def test_cuda_tensors_are_cupy_arrays_through_dlpack(backend: Any
                                                     ) -> None:  # pragma: no cover - no GPU
    cupy = pytest.importorskip("cupy", reason="cupy is not installed")
    t = torch.arange(8, dtype=torch.float32, device="cuda:0")
    view = as_array(t)
    assert isinstance(view, cupy.ndarray) and view.data.ptr == t.data_ptr()
    back = as_tensor(view)
    assert back.device == t.device and back.data_ptr() == t.data_ptr()
    assert backend.device_of(t) == torch.device("cuda", 0)
    np.testing.assert_array_equal(backend.to_host(backend.add(t, t)), np.arange(8) * 2.0)
