"""The NumPy backend: arrays in host memory, split among *logical* CPU devices.

NumPy arrays carry no device. The backend still hands out distinct :class:`CpuDevice` objects,
one per local peer, so that NumPy peers are configured like any other; but every logical
device shares the same host memory. Hence :meth:`NumpyBackend.device_of` always answers
``cpu:0``, :meth:`NumpyBackend.same_device` is true for any two CPU devices, and
:meth:`NumpyBackend.to_device` never copies — use :meth:`NumpyBackend.copy` for a private
buffer.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from burncoll.backends import checks
from burncoll.backends.base import Array, Backend, Elementwise
from burncoll.backends.pool import fresh
from burncoll.dtypes import dtype_from_name, dtype_name, host_view, is_inexact
from burncoll.errors import UsageError

__all__ = ["CpuDevice", "NumpyBackend", "host_memory"]

NDArray = np.ndarray[Any, Any]


@dataclass(frozen=True, slots=True)
class CpuDevice:
    """A logical CPU device of the NumPy backend; all of them share host memory."""

    #: Position among the backend's devices, from 0.
    index: int

    def __repr__(self) -> str:
        return f"cpu:{self.index}"


_CPU0 = CpuDevice(0)


class NumpyBackend(Elementwise):
    """:class:`~burncoll.backends.base.Backend` for ``numpy.ndarray`` (mutable: ``out=`` works)."""

    name = "numpy"
    mutable = True

    # -- devices -------------------------------------------------------------------------
    def devices(self, n: int) -> list[CpuDevice]:
        """``[cpu:0, ..., cpu:n-1]``; any ``n >= 1`` works (they are logical)."""
        if n < 1:
            checks.check_devices(self.name, n, n)
        return [CpuDevice(i) for i in range(n)]

    def device_of(self, x: Array) -> CpuDevice:
        """Always ``cpu:0``: a NumPy array does not record which logical device it is for."""
        if type(x) is not np.ndarray:
            _array(x)  # (refuses what is no NumPy array)
        return _CPU0

    def same_device(self, a: Any, b: Any) -> bool:
        """True when both are :class:`CpuDevice` objects (they share host memory)."""
        return isinstance(a, CpuDevice) and isinstance(b, CpuDevice)

    def to_device(self, x: Array, device: Any) -> NDArray:
        """``x`` itself, never a copy (logical devices share host memory)."""
        _check_device(device)
        return _array(x)

    # -- inspection ----------------------------------------------------------------------
    def is_array(self, x: object) -> bool:
        """True for ``numpy.ndarray`` (NumPy scalars are not arrays)."""
        return isinstance(x, np.ndarray)

    def dtype_name(self, x: Array) -> str:
        """``"float32"``, ``"bfloat16"``, ..."""
        return dtype_name((x if type(x) is np.ndarray else _array(x)).dtype)

    def shape(self, x: Array) -> tuple[int, ...]:
        """The shape of ``x``."""
        arr: NDArray = x if type(x) is np.ndarray else _array(x)
        return tuple(arr.shape)

    # -- creation and layout -------------------------------------------------------------
    def empty(self, count: int, dtype: str, device: Any) -> NDArray:
        """A new uninitialised flat array of ``count`` elements (large ones reuse memory its
        earlier holders released: :mod:`burncoll.backends.pool`)."""
        checks.check_count(count)
        _check_device(device)
        return fresh(count, dtype_from_name(dtype))

    def flatten(self, x: Array) -> NDArray:
        """A flat view of ``x`` when it is C-contiguous, else a flat C-ordered copy."""
        arr = _array(x)
        return (arr if arr.flags.c_contiguous else np.ascontiguousarray(arr)).reshape(-1)

    def reshape(self, x: Array, shape: tuple[int, ...]) -> NDArray:
        """``x`` with ``shape`` (a view when ``x`` is contiguous)."""
        arr = _array(x)
        try:
            return arr.reshape(shape)
        except ValueError as exc:
            raise UsageError(f"cannot reshape {arr.size} elements to shape {shape}") from exc

    def slice(self, x: Array, start: int, stop: int) -> NDArray:
        """A view of elements ``start:stop`` of the flat array ``x``."""
        arr = _flat(x)
        checks.check_slice(start, stop, arr.shape[0])
        return arr[start:stop]

    def concat(self, xs: Sequence[Array]) -> NDArray:
        """A new flat array: the flat arrays ``xs`` end to end."""
        checks.check_nonempty(xs, "concat")
        return np.concatenate([_array(x).reshape(-1) for x in xs])

    def concat_rows(self, xs: Sequence[Array]) -> NDArray:
        """A new array: ``xs`` stacked along axis 0."""
        checks.check_nonempty(xs, "concat_rows")
        try:
            return np.concatenate([_array(x) for x in xs], axis=0)
        except ValueError as exc:
            raise UsageError(f"cannot join arrays along axis 0: {exc}") from exc

    def copy(self, x: Array, out: Array | None = None) -> NDArray:
        """A copy of ``x``, written into ``out`` (and returned) when given."""
        if out is None:
            return np.array(_array(x), copy=True)
        np.copyto(out, x)
        return _array(out)

    # -- reductions ----------------------------------------------------------------------
    def _elementwise(self, name: str, a: Array, b: Array, out: Array | None) -> NDArray:
        return np.asarray(getattr(np, name)(a, b, out=out))

    def scale(self, x: Array, divisor: int) -> NDArray:
        """``x / divisor`` as a new array: float dtypes kept, integers and bool to float64."""
        checks.check_divisor(divisor)
        arr = _array(x)
        dtype = arr.dtype if is_inexact(arr.dtype) else np.dtype(np.float64)
        return np.asarray(np.divide(arr, divisor, dtype=dtype))

    # -- the host bridge -----------------------------------------------------------------
    def to_host(self, x: Array) -> NDArray:
        """``x`` itself: NumPy arrays already live in host memory."""
        return _array(x)

    def from_host(self, buffer: NDArray, dtype: str, shape: tuple[int, ...],
                  device: Any) -> NDArray:
        """A writable array of ``dtype`` and ``shape`` over ``buffer``'s memory. Shares memory with
        ``buffer`` when it is writable and C-contiguous; copies otherwise."""
        _check_device(device)
        arr = host_view(buffer, dtype, shape)
        return arr if arr.flags.writeable else arr.copy()


def _array(x: Any) -> NDArray:
    """``x`` typed as a NumPy array (for mypy; a subclass such as ``np.matrix`` as a plain
    view of the same memory); :class:`UsageError` when it is not one."""
    if type(x) is np.ndarray:
        return x
    if not isinstance(x, np.ndarray):
        raise UsageError(f"the numpy backend needs a numpy.ndarray, got {type(x).__name__}")
    return np.asarray(x)  # a subclass (np.matrix) as a plain view: its reshape keeps 2 dims


def _flat(x: Any) -> NDArray:
    """``x`` as a NumPy array; :class:`UsageError` unless it is one and is 1-D."""
    arr = _array(x)
    if arr.ndim != 1:
        raise UsageError(f"expected a flat (1-D) array, got shape {arr.shape}")
    return arr


def _check_device(device: object) -> None:
    if not isinstance(device, CpuDevice):
        raise UsageError(f"the numpy backend's devices are CpuDevice objects, got {device!r}")


if TYPE_CHECKING:  # mypy checks that the class satisfies the protocol
    _conforms: Backend = NumpyBackend()


def host_memory(backend: Backend, x: object) -> NDArray | None:
    """``x`` as a NumPy array over its own memory when it lives in host memory -- a NumPy
    array, or an array of a mutable backend on a logical CPU device (a torch CPU tensor,
    whose ``to_host`` is a view) -- else ``None``. The host paths of the plans work on it."""
    if isinstance(x, np.ndarray):
        return x
    if x is None or not backend.mutable or not backend.is_array(x):
        return None
    return backend.to_host(x) if isinstance(backend.device_of(x), CpuDevice) else None
