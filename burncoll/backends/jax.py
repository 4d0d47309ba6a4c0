"""The JAX backend: ``jax.Array`` on JAX's own devices (CPU, GPU or TPU).

Immutable: every operation returns a new array, ``out`` is ignored. On the CPU JAX has one
device unless ``XLA_FLAGS=--xla_force_host_platform_device_count=N`` is set before it is
imported. 64-bit dtypes need x64 mode (``JAX_ENABLE_X64=1``); without it they raise
:class:`~burncoll.UsageError` rather than narrow the values. jax is imported when
:class:`JaxBackend` is made.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from burncoll.backends import checks
from burncoll.backends.base import Array, Backend, Device, Elementwise
from burncoll.dtypes import dtype_from_name, dtype_name, host_view, is_inexact
from burncoll.errors import BackendUnavailable, UsageError

__all__ = ["JaxBackend"]

_MORE_CPU_DEVICES = ("on the CPU, set XLA_FLAGS=--xla_force_host_platform_device_count={n} "
                     "in the environment before jax is imported")


class JaxBackend(Elementwise):
    """:class:`~burncoll.backends.base.Backend` for ``jax.Array`` (immutable: ``out`` ignored).
    Raises :class:`~burncoll.BackendUnavailable` when jax is not installed."""

    name = "jax"
    mutable = False

    def __init__(self) -> None:
        try:
            import jax
            import jax.numpy as jnp
        except ImportError as exc:
            raise BackendUnavailable(
                "the jax backend needs jax: pip install 'burncoll[jax]'"
            ) from exc
        self._jax: Any = jax
        self._jnp: Any = jnp

    # -- devices -------------------------------------------------------------------------
    def devices(self, n: int) -> list[Device]:
        """``jax.devices()[:n]``, ready for ``jax.device_put``."""
        available = list(self._jax.devices())
        hint = ""
        if available and available[0].platform == "cpu":
            hint = _MORE_CPU_DEVICES.format(n=n)
        checks.check_devices(self.name, n, len(available), hint)
        return available[:n]

    def device_of(self, x: Array) -> Device:
        """The one device holding ``x``; :class:`UsageError` for an array sharded over many."""
        held = self._array(x).devices()
        if len(held) != 1:
            raise UsageError(
                f"the jax backend needs arrays on a single device; this one spans {len(held)}"
            )
        return next(iter(held))

    def same_device(self, a: Device, b: Device) -> bool:
        """True when ``a`` and ``b`` are the same JAX device."""
        return bool(a == b)

    def to_device(self, x: Array, device: Device) -> Array:
        """``x`` itself when it is on ``device`` already, else a copy there."""
        if self.device_of(x) == device:
            return x
        return self._jax.device_put(x, device)

    # -- inspection ----------------------------------------------------------------------
    def is_array(self, x: object) -> bool:
        """True for ``jax.Array`` (NumPy arrays are not)."""
        return isinstance(x, self._jax.Array)

    def dtype_name(self, x: Array) -> str:
        """``"float32"``, ``"bfloat16"``, ..."""
        return dtype_name(np.dtype(self._array(x).dtype))

    def shape(self, x: Array) -> tuple[int, ...]:
        return tuple(self._array(x).shape)

    # -- creation and layout -------------------------------------------------------------
    def empty(self, count: int, dtype: str, device: Device) -> Array:
        """A flat array of ``count`` zeros on ``device`` (JAX has no uninitialised arrays)."""
        checks.check_count(count)
        return self._jnp.zeros(count, dtype=self._dtype(dtype), device=device)

    def flatten(self, x: Array) -> Array:
        """``x`` as a flat C-ordered array."""
        return self._jnp.ravel(self._array(x))

    def reshape(self, x: Array, shape: tuple[int, ...]) -> Array:
        """``x`` with ``shape``."""
        arr = self._array(x)
        try:
            return self._jnp.reshape(arr, shape)
        except (TypeError, ValueError) as exc:
            raise UsageError(f"cannot reshape {arr.size} elements to shape {shape}") from exc

    def slice(self, x: Array, start: int, stop: int) -> Array:
        """Elements ``start:stop`` of the flat array ``x`` (a new array)."""
        arr = self._array(x)
        if arr.ndim != 1:
            raise UsageError(f"expected a flat (1-D) array, got shape {tuple(arr.shape)}")
        checks.check_slice(start, stop, arr.shape[0])
        return self._jax.lax.slice(arr, (start,), (stop,))

    def concat(self, xs: Sequence[Array]) -> Array:
        """The flat arrays ``xs`` end to end, on the device of ``xs[0]``."""
        checks.check_nonempty(xs, "concat")
        return self._jnp.concatenate([self._jnp.ravel(a) for a in self._gather(xs)])

    def concat_rows(self, xs: Sequence[Array]) -> Array:
        """``xs`` joined along axis 0, on the device of ``xs[0]``."""
        checks.check_nonempty(xs, "concat_rows")
        try:
            return self._jnp.concatenate(self._gather(xs), axis=0)
        except (TypeError, ValueError) as exc:
            raise UsageError(f"cannot join arrays along axis 0: {exc}") from exc

    def copy(self, x: Array, out: Array | None = None) -> Array:
        """A new array equal to ``x`` on the same device (``out`` is ignored)."""
        return self._jnp.array(self._array(x), copy=True)

    # -- reductions ----------------------------------------------------------------------
    def _elementwise(self, name: str, a: Array, b: Array, out: Array | None) -> Array:
        return getattr(self._jnp, name)(a, b)  # (immutable: out is ignored)

    def scale(self, x: Array, divisor: int) -> Array:
        """``x / divisor``: float dtypes kept; integers and bool become JAX's default float. The
        default float is float32, or float64 when x64 mode is on."""
        checks.check_divisor(divisor)
        arr = self._array(x)
        if is_inexact(np.dtype(arr.dtype)):
            dtype = arr.dtype
        else:
            dtype = self._jax.dtypes.canonicalize_dtype(np.float64)
        return arr.astype(dtype) / divisor

    # -- the host bridge -----------------------------------------------------------------
    def to_host(self, x: Array) -> np.ndarray[Any, Any]:
        """``x`` as a read-only NumPy array; no copy for arrays on the CPU."""
        return np.asarray(self._array(x))

    def from_host(self, buffer: np.ndarray[Any, Any], dtype: str, shape: tuple[int, ...],
                  device: Device) -> Array:
        """A new array of ``dtype`` and ``shape`` on ``device``, copied from ``buffer``. The result
        never shares memory with ``buffer``, which the caller may reuse at once."""
        self._dtype(dtype)
        # On the CPU, jax.device_put adopts a 64-byte aligned NumPy buffer without copying it
        # (whatever ``may_alias`` says), and copies others asynchronously; either way a later
        # write to ``buffer`` could show through. So hand it a private copy, aligned so that
        # on the CPU it is adopted rather than copied a second time.
        private = _aligned_copy(host_view(buffer, dtype, shape))
        return self._jax.device_put(private, device)

    # -- helpers -------------------------------------------------------------------------
    def _array(self, x: Any) -> Any:
        if not isinstance(x, self._jax.Array):
            raise UsageError(f"the jax backend needs a jax.Array, got {type(x).__name__}")
        return x

    def _dtype(self, name: str) -> np.dtype[Any]:
        """The NumPy dtype for ``name``; :class:`UsageError` when JAX would narrow it."""
        dtype = dtype_from_name(name)
        if self._jax.dtypes.canonicalize_dtype(dtype) != dtype:
            raise UsageError(
                f"dtype {name!r} needs JAX's 64-bit mode: set JAX_ENABLE_X64=1 or call "
                "jax.config.update('jax_enable_x64', True) before creating arrays"
            )
        return dtype

    def _gather(self, xs: Sequence[Array]) -> list[Array]:
        """``xs`` moved onto the device of ``xs[0]``."""
        device = self.device_of(xs[0])
        return [self.to_device(x, device) for x in xs]


_ALIGNMENT = 64


def _aligned_copy(host: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    """A C-ordered copy of ``host`` whose data starts on a 64-byte boundary."""
    raw = np.empty(host.nbytes + _ALIGNMENT, dtype=np.uint8)
    start = -raw.ctypes.data % _ALIGNMENT
    copy: np.ndarray[Any, Any] = (
        raw[start : start + host.nbytes].view(host.dtype).reshape(host.shape)
    )
    np.copyto(copy, host)
    return copy


if TYPE_CHECKING:  # mypy checks that the class satisfies the protocol
    _conforms: Backend = JaxBackend()
