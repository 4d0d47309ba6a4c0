"""The CuPy backend: ``cupy.ndarray`` on CUDA GPUs, one ``cupy.cuda.Device`` per peer.

CuPy arrays are mutable, so ``out=`` is honoured. Every operation runs with the device of its
(first) array made current, so peers on different GPUs can call the backend from their own
threads at once (CuPy's current device is per thread). cupy is imported when
:class:`CupyBackend` is constructed, never when this module is imported.

``bfloat16`` works only with a CuPy build that supports it (through ``ml_dtypes``); other
builds raise :class:`~burncoll.UsageError` when such an array is created.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from burncoll.backends import checks
from burncoll.backends.base import Array, Backend, Device, Elementwise
from burncoll.dtypes import dtype_from_name, dtype_name, host_view, is_inexact
from burncoll.errors import BackendUnavailable, UsageError

__all__ = ["CupyBackend"]


class CupyBackend(Elementwise):
    """:class:`~burncoll.backends.base.Backend` for ``cupy.ndarray`` (mutable: ``out=`` works).
    Raises :class:`~burncoll.BackendUnavailable` when cupy is not installed."""

    name = "cupy"
    mutable = True

    def __init__(self) -> None:
        try:
            import cupy
        except ImportError as exc:
            raise BackendUnavailable(
                "the cupy backend needs cupy and a CUDA GPU: pip install 'burncoll[cupy]'"
            ) from exc
        self._cp: Any = cupy

    # -- devices -------------------------------------------------------------------------
    def device_count(self) -> int:
        """How many CUDA devices CuPy sees (0 when the CUDA driver is missing)."""
        try:
            return int(self._cp.cuda.runtime.getDeviceCount())
        except self._cp.cuda.runtime.CUDARuntimeError:
            return 0

    def devices(self, n: int) -> list[Device]:
        """``[cupy.cuda.Device(0), ..., cupy.cuda.Device(n - 1)]``."""
        checks.check_devices(self.name, n, self.device_count())
        return [self._cp.cuda.Device(i) for i in range(n)]

    def device_of(self, x: Array) -> Device:
        """``x.device``."""
        return self._array(x).device

    def same_device(self, a: Device, b: Device) -> bool:
        """True when ``a`` and ``b`` have the same CUDA device id."""
        return bool(a.id == b.id)

    def to_device(self, x: Array, device: Device) -> Array:
        """``x`` itself when it is on ``device`` already, else a copy there (peer to peer)."""
        if self.same_device(self.device_of(x), device):
            return x
        with device:
            # On another device than the current one, asarray copies onto the current one.
            return self._cp.asarray(x)

    # -- inspection ----------------------------------------------------------------------
    def is_array(self, x: object) -> bool:
        """True for ``cupy.ndarray``."""
        return isinstance(x, self._cp.ndarray)

    def dtype_name(self, x: Array) -> str:
        """``"float32"``, ``"int64"``, ..."""
        return dtype_name(self._array(x).dtype)

    def shape(self, x: Array) -> tuple[int, ...]:
        return tuple(self._array(x).shape)

    # -- creation and layout -------------------------------------------------------------
    def empty(self, count: int, dtype: str, device: Device) -> Array:
        """A new uninitialised flat array of ``count`` elements on ``device``."""
        checks.check_count(count)
        np_dtype = dtype_from_name(dtype)
        with device:
            try:
                return self._cp.empty(count, dtype=np_dtype)
            except (TypeError, ValueError, NotImplementedError) as exc:
                raise _unsupported(dtype, exc) from exc

    def flatten(self, x: Array) -> Array:
        """A flat view of ``x`` when it is C-contiguous, else a flat C-ordered copy."""
        arr = self._array(x)
        if arr.flags.c_contiguous:
            return arr.reshape(-1)
        with arr.device:
            return self._cp.ascontiguousarray(arr).reshape(-1)

    def reshape(self, x: Array, shape: tuple[int, ...]) -> Array:
        """``x`` with ``shape`` (a view when ``x`` is contiguous)."""
        arr = self._array(x)
        try:
            with arr.device:
                return arr.reshape(shape)
        except ValueError as exc:
            raise UsageError(f"cannot reshape {arr.size} elements to shape {shape}") from exc

    def slice(self, x: Array, start: int, stop: int) -> Array:
        """A view of elements ``start:stop`` of the flat array ``x``."""
        arr = self._array(x)
        if arr.ndim != 1:
            raise UsageError(f"expected a flat (1-D) array, got shape {tuple(arr.shape)}")
        checks.check_slice(start, stop, arr.shape[0])
        return arr[start:stop]

    def concat(self, xs: Sequence[Array]) -> Array:
        """A new flat array: the flat arrays ``xs`` end to end, on the device of ``xs[0]``."""
        checks.check_nonempty(xs, "concat")
        device = self.device_of(xs[0])
        with device:
            return self._cp.concatenate([self.to_device(x, device).reshape(-1) for x in xs])

    def concat_rows(self, xs: Sequence[Array]) -> Array:
        """A new array: ``xs`` stacked along axis 0, on the device of ``xs[0]``."""
        checks.check_nonempty(xs, "concat_rows")
        device = self.device_of(xs[0])
        with device:
            parts = [self.to_device(x, device) for x in xs]
            try:
                return self._cp.concatenate(parts, axis=0)
            except ValueError as exc:
                raise UsageError(f"cannot join arrays along axis 0: {exc}") from exc

    def copy(self, x: Array, out: Array | None = None) -> Array:
        """A copy of ``x`` on its device, or written into ``out`` (on any device) and returned."""
        arr = self._array(x)
        if out is None:
            with arr.device:
                return arr.copy()
        with self._array(out).device:
            self._cp.copyto(out, arr)  # copyto handles a source on another device
        return out

    # -- reductions ----------------------------------------------------------------------
    def _elementwise(self, name: str, a: Array, b: Array, out: Array | None) -> Array:
        with self.device_of(a):
            return getattr(self._cp, name)(a, b, out=out)

    def scale(self, x: Array, divisor: int) -> Array:
        """``x / divisor`` as a new array: float dtypes kept, integers and bool to float64."""
        checks.check_divisor(divisor)
        arr = self._array(x)
        dtype = arr.dtype if is_inexact(np.dtype(arr.dtype)) else np.dtype(np.float64)
        with arr.device:
            return self._cp.divide(arr, divisor, dtype=dtype)

    # -- the host bridge -----------------------------------------------------------------
    def to_host(self, x: Array) -> np.ndarray[Any, Any]:
        """A NumPy copy of ``x`` in host memory (GPU memory always needs the copy)."""
        arr = self._array(x)
        with arr.device:
            host: np.ndarray[Any, Any] = self._cp.asnumpy(arr)
        return host

    def from_host(self, buffer: np.ndarray[Any, Any], dtype: str, shape: tuple[int, ...],
                  device: Device) -> Array:
        """A new array of ``dtype`` and ``shape`` on ``device``, copied from ``buffer``."""
        host = host_view(buffer, dtype, shape)
        with device:
            try:
                return self._cp.asarray(host)
            except (TypeError, ValueError, NotImplementedError) as exc:
                raise _unsupported(dtype, exc) from exc

    # -- helpers -------------------------------------------------------------------------
    def _array(self, x: Any) -> Any:
        if not isinstance(x, self._cp.ndarray):
            raise UsageError(f"the cupy backend needs a cupy.ndarray, got {type(x).__name__}")
        return x


def _unsupported(dtype: str, exc: BaseException) -> UsageError:
    return UsageError(f"this CuPy build cannot hold {dtype} arrays ({exc})")


if TYPE_CHECKING:  # mypy checks that the class satisfies the protocol
    _conforms: Backend = CupyBackend()
