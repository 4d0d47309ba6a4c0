"""The check every ``out=`` array passes before an operation starts: an array of the backend,
on the peer's device, writable, C-contiguous (a torch tensor: contiguous) and in native byte
order."""

from __future__ import annotations

import numpy as np

from burncoll.backends.base import Backend, Device
from burncoll.errors import UsageError

__all__ = ["check_out"]


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
