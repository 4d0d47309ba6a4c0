"""The torch backend: ``torch.Tensor`` on the CPU or on CUDA GPUs, without copies.

A CPU tensor is worked on by the NumPy backend through ``tensor.numpy()`` (``bfloat16`` via an
``int16`` view as ``ml_dtypes.bfloat16``) and comes back with ``torch.from_numpy``; a CUDA
tensor by the CuPy backend through DLPack (**untested here**: no GPU; its tests skip). Values,
dtypes and devices are therefore exactly the NumPy (or CuPy) backend's; ``out=`` takes a
contiguous tensor; like ``torch.distributed`` it works on a tensor's data whether or not it
requires grad. ``devices(n)``: CUDA devices when torch sees CUDA, else logical CPU devices
(``torch.device("cpu")`` accepted). torch is imported when :class:`TorchBackend` is made.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from burncoll.backends import checks
from burncoll.backends.base import Array, Backend, Device, Elementwise
from burncoll.backends.numpy import CpuDevice, NumpyBackend
from burncoll.dtypes import dtype_from_name, dtype_name
from burncoll.errors import BackendUnavailable, UsageError

__all__ = ["TorchBackend", "as_array", "as_tensor", "shares_memory"]

_torch_module: Any = None


def _torch() -> Any:
    """The torch module (imported on first use); :class:`~burncoll.BackendUnavailable`
    without it."""
    global _torch_module
    if _torch_module is None:
        try:
            import torch
        except ImportError as exc:
            raise BackendUnavailable(
                "the torch backend needs torch: pip install 'burncoll[torch]'") from exc
        _torch_module = torch
    return _torch_module


def as_array(tensor: Any) -> Any:
    """``tensor``'s memory as a NumPy array (CPU) or a CuPy array (CUDA), without a copy. The view
    has the tensor's dtype (``bfloat16`` as ``ml_dtypes.bfloat16``), shape and strides; writing to
    it writes the tensor. A NumPy array passes through unchanged. Raises
    :class:`~burncoll.UsageError` for a tensor that has no such view (a sparse one, a conjugate
    view, one on another device, a dtype NumPy cannot hold)."""
    if isinstance(tensor, np.ndarray):
        return tensor
    torch = _torch()
    if isinstance(tensor, torch.Tensor) and tensor.is_cpu and tensor.dtype != torch.bfloat16:
        try:  # the common case, at once (microseconds count: every chunk of a schedule)
            return tensor.numpy()
        except (RuntimeError, TypeError):
            pass  # requires grad, a conjugate or negative view, sparse, ...: see below
    if not isinstance(tensor, torch.Tensor):
        raise UsageError(f"the torch backend needs a torch.Tensor, got {type(tensor).__name__}")
    if tensor.layout != torch.strided:
        raise UsageError(f"the torch backend needs dense tensors, got layout {tensor.layout}")
    if tensor.is_conj() or tensor.is_neg():
        raise UsageError("a conjugate or negative view (.conj()) has no NumPy view of its "
                         "values: pass tensor.resolve_conj() (a copy) instead")
    t = tensor.detach()
    if t.device.type == "cuda":  # pragma: no cover - no CUDA device here
        import cupy

        torch.cuda.current_stream(t.device).synchronize()  # the tensor's pending writes are done
        return cupy.from_dlpack(t)
    _check_placed(t)
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(dtype_from_name("bfloat16"))
    try:
        return t.numpy()
    except TypeError as exc:
        raise UsageError(f"dtype {_name(t.dtype)} has no NumPy view: convert the tensor "
                         f"(e.g. .to(torch.float32)) first") from exc


def _check_placed(tensor: Any) -> None:
    """Raise :class:`~burncoll.UsageError` unless ``tensor`` is on the CPU or a CUDA GPU."""
    if tensor.device.type not in ("cpu", "cuda"):
        raise UsageError(f"the torch backend handles CPU and CUDA tensors; this one is on "
                         f"{tensor.device}: move it with .cpu() or .cuda()")


def as_tensor(array: Any) -> Any:
    """The tensor over ``array``'s memory (a NumPy or CuPy array), without a copy; the inverse
    of :func:`as_array`. A read-only NumPy array is copied first (tensors are writable)."""
    torch = _torch()
    if isinstance(array, torch.Tensor):
        return array
    if not isinstance(array, np.ndarray):  # pragma: no cover - no CUDA device here
        return torch.from_dlpack(array)
    if not array.flags.writeable:
        array = array.copy()
    if dtype_name(array.dtype) == "bfloat16":
        return torch.from_numpy(array.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(array)


def shares_memory(a: Any, b: Any) -> bool:
    """Whether tensors ``a`` and ``b`` may share memory: their byte ranges on one device
    overlap (the bounds check of ``numpy.may_share_memory``, without making views)."""
    if a.device != b.device:
        return False
    (a_start, a_stop), (b_start, b_stop) = _bounds(a), _bounds(b)
    return a_start < b_stop and b_start < a_stop


def _bounds(t: Any) -> tuple[int, int]:
    """The first and one past the last byte address ``t`` covers (none when it is empty)."""
    if t.numel() == 0:
        return 0, 0
    span = sum((n - 1) * abs(s) for n, s in zip(t.shape, t.stride(), strict=True)) + 1
    start = t.data_ptr()
    return start, start + span * t.element_size()


_NAMES: dict[Any, str] = {}  # (a few dtypes: str(dtype) is slow enough to cache)


def _name(dtype: Any) -> str:
    """torch's dtype as users write it: ``torch.float32`` -> ``"float32"``."""
    name = _NAMES.get(dtype)
    if name is None:
        name = _NAMES[dtype] = str(dtype).removeprefix("torch.")
    return name


#: Every CPU tensor's device (logical CPU devices share host memory).
_CPU = CpuDevice(0)


class TorchBackend(Elementwise):
    """:class:`~burncoll.backends.base.Backend` for ``torch.Tensor`` (mutable: ``out=`` works).
    Raises :class:`~burncoll.BackendUnavailable` when torch is not installed."""

    name = "torch"
    mutable = True

    def __init__(self) -> None:
        self._torch: Any = _torch()
        self._host = NumpyBackend()
        self._gpu: Backend | None = None

    # -- devices -------------------------------------------------------------------------
    def devices(self, n: int) -> list[Device]:
        """``[cuda:0, ..., cuda:n-1]`` when torch sees CUDA, else ``n`` logical CPU devices."""
        count = self._cuda_count()
        if count == 0:
            return self._host.devices(n)
        checks.check_devices(self.name, n, count)  # pragma: no cover - no CUDA device here
        return [self._torch.device("cuda", i) for i in range(n)]  # pragma: no cover

    def device_of(self, x: Array) -> Device:
        """``cpu:0`` for a CPU tensor (all CPU devices share memory), else its CUDA device."""
        if self._tensor(x).is_cpu:
            return _CPU
        _check_placed(x)
        return x.device  # pragma: no cover - no CUDA device here

    def same_device(self, a: Device, b: Device) -> bool:
        """True when both are CPU devices, or the same CUDA device."""
        return bool(_key(a) == _key(b))

    def to_device(self, x: Array, device: Device) -> Array:
        """``x`` itself when it is on ``device`` already, else a copy there."""
        if self.same_device(self.device_of(x), device):
            return x
        key = _key(device)  # pragma: no cover - no CUDA device here
        return self._tensor(x).to(key if key == "cpu" else device)  # pragma: no cover

    # -- inspection ----------------------------------------------------------------------
    def is_array(self, x: object) -> bool:
        """True for ``torch.Tensor`` (and its subclasses, such as ``nn.Parameter``)."""
        return isinstance(x, self._torch.Tensor)

    def dtype_name(self, x: Array) -> str:
        """``"float32"``, ``"bfloat16"``, ...; torch's own name for a dtype burncoll lacks."""
        return _name(self._tensor(x).dtype)

    def shape(self, x: Array) -> tuple[int, ...]:
        return tuple(self._tensor(x).shape)

    # -- creation and layout -------------------------------------------------------------
    def empty(self, count: int, dtype: str, device: Device) -> Array:
        """A new uninitialised flat tensor of ``count`` elements on ``device``."""
        inner, where = self._inner_device(device)
        return as_tensor(inner.empty(count, dtype, where))

    def flatten(self, x: Array) -> Array:
        """A flat view of ``x`` when it is contiguous, else a flat C-ordered copy."""
        return self._apply("flatten", x)

    def reshape(self, x: Array, shape: tuple[int, ...]) -> Array:
        """``x`` with ``shape`` (a view when ``x`` is contiguous)."""
        return as_tensor(self._inner(x).reshape(as_array(x), shape))

    def slice(self, x: Array, start: int, stop: int) -> Array:
        """A view of elements ``start:stop`` of the flat tensor ``x``."""
        return as_tensor(self._inner(x).slice(as_array(x), start, stop))

    def concat(self, xs: Sequence[Array]) -> Array:
        """A new flat tensor: the flat tensors ``xs`` end to end, on the device of ``xs[0]``."""
        checks.check_nonempty(xs, "concat")
        return as_tensor(self._inner(xs[0]).concat([as_array(x) for x in xs]))

    def concat_rows(self, xs: Sequence[Array]) -> Array:
        """A new tensor: ``xs`` stacked along axis 0, on the device of ``xs[0]``."""
        checks.check_nonempty(xs, "concat_rows")
        return as_tensor(self._inner(xs[0]).concat_rows([as_array(x) for x in xs]))

    def copy(self, x: Array, out: Array | None = None) -> Array:
        """A copy of ``x``, written into ``out`` (and returned) when given."""
        return self._apply("copy", x, out=out)

    # -- reductions ----------------------------------------------------------------------
    def _elementwise(self, name: str, a: Array, b: Array, out: Array | None) -> Array:
        return self._apply(name, a, b, out=out)

    def scale(self, x: Array, divisor: int) -> Array:
        """``x / divisor`` as a new tensor: float dtypes kept, integers and bool to float64."""
        return as_tensor(self._inner(x).scale(as_array(x), divisor))

    # -- the host bridge -----------------------------------------------------------------
    def to_host(self, x: Array) -> np.ndarray[Any, Any]:
        """``x`` as a NumPy array: a view of a CPU tensor, a copy of a CUDA one."""
        host: np.ndarray[Any, Any] = self._inner(x).to_host(as_array(x))
        return host

    def from_host(self, buffer: np.ndarray[Any, Any], dtype: str, shape: tuple[int, ...],
                  device: Device) -> Array:
        """A writable tensor of ``dtype`` and ``shape`` on ``device`` holding ``buffer``'s
        elements; on the CPU it shares ``buffer``'s memory when that is writable and
        C-contiguous (as the NumPy backend's), else it is a copy."""
        inner, where = self._inner_device(device)
        return as_tensor(inner.from_host(buffer, dtype, shape, where))

    # -- helpers -------------------------------------------------------------------------
    def _tensor(self, x: Any) -> Any:
        if not isinstance(x, self._torch.Tensor):
            raise UsageError(f"the torch backend needs a torch.Tensor, got {type(x).__name__}")
        return x

    def _apply(self, method: str, *xs: Array, out: Array | None = None) -> Array:
        """The inner backend's ``method`` on views of ``xs``; ``out`` itself when given."""
        arrays = [as_array(x) for x in xs]
        inner = self._inner(xs[0])
        if out is None:
            return as_tensor(getattr(inner, method)(*arrays))
        getattr(inner, method)(*arrays, as_array(self._tensor(out)))
        return out

    def _inner(self, x: Any) -> Backend:
        """The backend of ``x``'s memory: NumPy for the CPU, CuPy for CUDA."""
        if isinstance(x, np.ndarray) or not self._tensor(x).is_cuda:
            return self._host
        return self._cuda()  # pragma: no cover - no CUDA device here

    def _inner_device(self, device: Device) -> tuple[Backend, Device]:
        """The inner backend of ``device`` and its own device object."""
        key = _key(device)
        if key == "cpu":
            return self._host, device if isinstance(device, CpuDevice) else CpuDevice(0)
        gpu = self._cuda()  # pragma: no cover - no CUDA device here
        return gpu, gpu.devices(key[1] + 1)[key[1]]  # pragma: no cover

    def _cuda(self) -> Backend:  # pragma: no cover - no CUDA device here
        if self._gpu is None:
            from burncoll.backends.cupy import CupyBackend

            self._gpu = CupyBackend()
        return self._gpu

    def _cuda_count(self) -> int:
        cuda = self._torch.cuda
        return int(cuda.device_count()) if cuda.is_available() else 0


def _key(device: Any) -> Any:
    """``"cpu"`` for any CPU device, ``("cuda", index)`` for a CUDA one."""
    if isinstance(device, CpuDevice):
        return "cpu"
    kind, index = getattr(device, "type", None), getattr(device, "index", None)
    if kind == "cpu":
        return "cpu"
    if kind == "cuda":
        return ("cuda", index or 0)
    raise UsageError(f"the torch backend's devices are CPU devices (CpuDevice or "
                     f"torch.device('cpu')) or torch.device('cuda', i), got {device!r}")


if TYPE_CHECKING:  # mypy checks that the class satisfies the protocol
    _conforms: Backend = TorchBackend()
