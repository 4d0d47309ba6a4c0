"""Argument checks, each raising a burncoll error that names the bad value: those the backends
share, and the check every ``out=`` array passes before an operation starts (:func:`check_out`:
an array of the backend, on the peer's device, writable, C-contiguous -- a torch tensor:
contiguous -- and in native byte order)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from burncoll.backends.base import Backend, Device
from burncoll.errors import ConfigError, UsageError

__all__ = ["check_count", "check_devices", "check_divisor", "check_nonempty", "check_out",
           "check_slice"]


def check_devices(backend: str, wanted: int, available: int, hint: str = "") -> None:
    """Raise :class:`ConfigError` unless ``1 <= wanted <= available``."""
    if wanted < 1:
        raise ConfigError(f"{backend}: asked for {wanted} devices; need at least 1")
    if wanted > available:
        more = f"; {hint}" if hint else ""
        raise ConfigError(f"{backend}: asked for {wanted} devices but only {available} exist{more}")


def check_count(count: int) -> None:
    """Raise :class:`UsageError` unless ``count`` is a non-negative element count."""
    if count < 0:
        raise UsageError(f"element count must be non-negative, got {count}")


def check_divisor(divisor: int) -> None:
    """Raise :class:`UsageError` unless ``divisor`` (a peer count) is positive."""
    if divisor < 1:
        raise UsageError(f"scale divisor must be a positive peer count, got {divisor}")


def check_slice(start: int, stop: int, size: int) -> None:
    """Raise :class:`UsageError` unless ``0 <= start <= stop <= size``."""
    if not 0 <= start <= stop <= size:
        raise UsageError(f"slice {start}:{stop} is outside a flat array of {size} elements")


def check_nonempty(xs: Sequence[Any], what: str) -> None:
    """Raise :class:`UsageError` when ``xs`` is empty (nothing to take dtype or device from)."""
    if len(xs) == 0:
        raise UsageError(f"{what} needs at least one array")


def check_out(backend: Backend, device: Device, out: object, label: str) -> None:
    """Refuse, with a :class:`~burncoll.UsageError` naming ``label``, an ``out`` that no
    result could be written to."""
    if not backend.mutable:
        raise UsageError(f"{label}: out= needs a backend with mutable arrays (numpy, cupy, torch); "
                         f"{backend.name} arrays are immutable: use the returned array")
    if not backend.is_array(out):
        raise UsageError(f"{label}: out must be an array of backend {backend.name!r}, got "
                         f"{type(out).__name__}")
    contiguous = getattr(out, "is_contiguous", None)  # a torch tensor
    if contiguous is not None and not contiguous():
        raise UsageError(f"{label}: out must be a contiguous tensor (out.contiguous() is a "
                         "copy, which would not receive the result)")
    if not backend.same_device(backend.device_of(out), device):
        raise UsageError(f"{label}: out is on {backend.device_of(out)}, not on this peer's "
                         f"device {device}")
    flags = getattr(out, "flags", None)  # CuPy's flags have no "writeable"
    if flags is not None and not (getattr(flags, "writeable", True) and flags.c_contiguous):
        raise UsageError(f"{label}: out must be writable and C-contiguous")
    dtype = getattr(out, "dtype", None)
    if isinstance(dtype, np.dtype) and not dtype.isnative:
        raise UsageError(f"{label}: out has non-native byte order ({dtype.str}); pass a "
                         "native-order array")
