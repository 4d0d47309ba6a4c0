"""The backend protocol: the array operations the collectives need, and nothing more.

A backend adapts one array library (NumPy, JAX, CuPy) to the executors. Arrays are opaque to
the rest of burncoll: it only ever calls these methods. Every method must be safe to call
from several threads at once (one thread per device).

The executors work on *flat* (1-D, C-ordered) arrays: ``flatten`` before, ``reshape`` after.
Reductions are element-wise and never modify their inputs unless an ``out`` array is given.

``mutable`` backends (NumPy, CuPy) accept ``out=`` and write the result into it; immutable
backends (JAX) ignore ``out`` and return a new array. Callers always use the return value.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

import numpy as np

from burncoll.ops import ReduceOp

__all__ = ["Array", "Backend", "Device", "Elementwise", "combine"]

#: An array of the backend's own type (``numpy.ndarray``, ``jax.Array``, ``cupy.ndarray``).
Array = Any
#: A device object of the backend's own type (a ``jax.Device``, a ``cupy.cuda.Device``, or a
#: :class:`~burncoll.backends.numpy.CpuDevice`).
Device = Any


class Elementwise(Protocol):
    """The element-wise reductions of :class:`Backend` (inputs are never modified), each the
    library function of the same name applied by the backend's ``_elementwise``; a backend
    subclasses this to inherit them."""

    @abc.abstractmethod
    def _elementwise(self, name: str, a: Array, b: Array, out: Array | None) -> Array:
        """The library's function ``name`` of ``a`` and ``b`` (into ``out`` where mutable)."""

    def add(self, a: Array, b: Array, out: Array | None = None) -> Array:
        """``a + b``."""
        return self._elementwise("add", a, b, out)

    def maximum(self, a: Array, b: Array, out: Array | None = None) -> Array:
        """Element-wise maximum (NaN propagates, as ``numpy.maximum``)."""
        return self._elementwise("maximum", a, b, out)

    def minimum(self, a: Array, b: Array, out: Array | None = None) -> Array:
        """Element-wise minimum (NaN propagates, as ``numpy.minimum``)."""
        return self._elementwise("minimum", a, b, out)

    def multiply(self, a: Array, b: Array, out: Array | None = None) -> Array:
        """``a * b``."""
        return self._elementwise("multiply", a, b, out)

    def bitwise_and(self, a: Array, b: Array, out: Array | None = None) -> Array:
        """``a & b`` (integer and bool arrays)."""
        return self._elementwise("bitwise_and", a, b, out)

    def bitwise_or(self, a: Array, b: Array, out: Array | None = None) -> Array:
        """``a | b`` (integer and bool arrays)."""
        return self._elementwise("bitwise_or", a, b, out)

    def bitwise_xor(self, a: Array, b: Array, out: Array | None = None) -> Array:
        """``a ^ b`` (integer and bool arrays)."""
        return self._elementwise("bitwise_xor", a, b, out)


@runtime_checkable
class Backend(Elementwise, Protocol):
    """What burncoll needs from an array library. See the module docstring for conventions."""

    #: The name used in configs: ``"numpy"``, ``"jax"`` or ``"cupy"``.
    name: str
    #: True when arrays can be written in place (``out=`` is honoured).
    mutable: bool

    # -- devices -------------------------------------------------------------------------
    def devices(self, n: int) -> list[Device]:
        """The backend's own first ``n`` devices, in order. Raises :class:`~burncoll.ConfigError`
        when ``n < 1`` or fewer than ``n`` exist (the message says how many there are and, for JAX
        on the CPU, how to get more). NumPy's devices are logical, so any number of them exists."""
        ...

    def device_of(self, x: Array) -> Device:
        """The device ``x`` lives on."""
        ...

    def same_device(self, a: Device, b: Device) -> bool:
        """True when ``a`` and ``b`` are the same device. NumPy's logical CPU devices all share host
        memory, so any two of them are the same."""
        ...

    def to_device(self, x: Array, device: Device) -> Array:
        """``x`` on ``device``. Returns ``x`` itself (no copy) when it is already there. On NumPy it
        is always ``x`` itself: use :meth:`copy` for a private buffer."""
        ...

    # -- inspection ----------------------------------------------------------------------
    def is_array(self, x: object) -> bool:
        """True when ``x`` is an array of this backend."""
        ...

    def dtype_name(self, x: Array) -> str:
        """The dtype as users write it: ``"float32"``, ``"bfloat16"``, ``"int64"``."""
        ...

    def shape(self, x: Array) -> tuple[int, ...]:
        """The shape of ``x``."""
        ...

    # -- creation and layout -------------------------------------------------------------
    def empty(self, count: int, dtype: str, device: Device) -> Array:
        """A new uninitialised flat array (mutable backends) or zeros (immutable ones)."""
        ...

    def flatten(self, x: Array) -> Array:
        """``x`` as a flat C-ordered array; a view (no copy) when ``x`` is contiguous."""
        ...

    def reshape(self, x: Array, shape: tuple[int, ...]) -> Array:
        """``x`` with a new shape (a view where the library allows)."""
        ...

    def slice(self, x: Array, start: int, stop: int) -> Array:
        """Elements ``start:stop`` of the flat array ``x``; a view on mutable backends."""
        ...

    def concat(self, xs: Sequence[Array]) -> Array:
        """The flat arrays ``xs`` joined end to end, on the device of the first one."""
        ...

    def concat_rows(self, xs: Sequence[Array]) -> Array:
        """The arrays ``xs`` joined along axis 0 (their trailing shapes agree)."""
        ...

    def copy(self, x: Array, out: Array | None = None) -> Array:
        """A copy of ``x`` (written into ``out`` on mutable backends)."""
        ...

    # -- the mean's division (the element-wise reductions: :class:`Elementwise`) -------------
    def scale(self, x: Array, divisor: int) -> Array:
        """``x / divisor`` for the mean, as a new array. Floating dtypes keep their dtype. Integer
        arrays become the backend's default float (float64 for NumPy, as ``numpy.mean`` does)."""
        ...

    # -- the host bridge (for the network) ------------------------------------------------
    def to_host(self, x: Array) -> np.ndarray[Any, Any]:
        """``x`` as a NumPy array in host memory; no copy when it already lives there. The result
        may be read-only; callers copy before writing."""
        ...

    def from_host(self, buffer: np.ndarray[Any, Any], dtype: str, shape: tuple[int, ...],
                  device: Device) -> Array:
        """An array of ``dtype`` and ``shape`` on ``device`` holding ``buffer``'s elements.
        ``buffer`` holds elements of ``dtype``, or their raw bytes as ``uint8`` (as received from
        the network); values are never converted. On mutable backends the result is writable;
        NumPy's shares memory with ``buffer`` when that is writable and contiguous, the others copy.
        Raises :class:`~burncoll.UsageError` when the sizes disagree."""
        ...


#: The library function that combines two arrays for each op (MEAN sums; the division by the
#: peer count comes at the end).
_COMBINERS: dict[ReduceOp, str] = {ReduceOp.SUM: "add", ReduceOp.MEAN: "add",
                                   ReduceOp.MAX: "maximum", ReduceOp.MIN: "minimum",
                                   ReduceOp.PROD: "multiply", ReduceOp.BAND: "bitwise_and",
                                   ReduceOp.BOR: "bitwise_or", ReduceOp.BXOR: "bitwise_xor"}


def combine(backend: Backend, op: ReduceOp, a: Array, b: Array, out: Array | None = None) -> Array:
    """Apply the element-wise part of ``op`` (MEAN sums; the division comes at the end)."""
    return backend._elementwise(_COMBINERS[op], a, b, out)
