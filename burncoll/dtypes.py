"""dtype names as users write them, shared by every backend.

burncoll names dtypes the way users type them — ``"float32"``, ``"bfloat16"``, ``"int64"`` —
never NumPy's type codes (``"<f4"``). :func:`dtype_from_name` turns such a name into a NumPy
dtype; :func:`dtype_name` does the reverse. ``bfloat16`` comes from ``ml_dtypes`` (a JAX
dependency) and is available only where that package is installed; it is imported on first use.

:func:`host_view` is the host half of every backend's ``from_host``: it turns a received
buffer into a NumPy array of the wanted dtype and shape without copying.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import numpy as np

from burncoll.errors import UsageError

__all__ = [
    "DTYPE_TABLE",
    "ITEMSIZES",
    "SUPPORTED_DTYPES",
    "WIRE_CODES",
    "WIRE_NAMES",
    "dtype_from_name",
    "dtype_name",
    "host_view",
    "is_inexact",
]

#: The one table of dtypes: the name users write, its wire code (0 means "no array" on the
#: wire), and its size in bytes. Every other list of dtypes is derived from this one.
DTYPE_TABLE: tuple[tuple[str, int, int], ...] = (
    ("float16", 1, 2),
    ("bfloat16", 2, 2),
    ("float32", 3, 4),
    ("float64", 4, 8),
    ("int8", 5, 1),
    ("int16", 6, 2),
    ("int32", 7, 4),
    ("int64", 8, 8),
    ("uint8", 9, 1),
    ("uint16", 10, 2),
    ("uint32", 11, 4),
    ("uint64", 12, 8),
    ("complex64", 13, 8),
    ("complex128", 14, 16),
    ("bool", 15, 1),
)

#: Every dtype a collective can carry, by the name users write.
SUPPORTED_DTYPES: tuple[str, ...] = tuple(name for name, _, _ in DTYPE_TABLE)
#: dtype name -> wire code.
WIRE_CODES: dict[str, int] = {name: code for name, code, _ in DTYPE_TABLE}
#: wire code -> dtype name.
WIRE_NAMES: dict[int, str] = {code: name for name, code, _ in DTYPE_TABLE}
#: dtype name -> bytes per element.
ITEMSIZES: dict[str, int] = {name: size for name, _, size in DTYPE_TABLE}

_INEXACT = frozenset({"float16", "bfloat16", "float32", "float64", "complex64", "complex128"})


@functools.cache
def _bfloat16() -> np.dtype[Any]:
    """The ``ml_dtypes`` bfloat16 dtype; :class:`UsageError` when ml_dtypes is missing."""
    try:
        import ml_dtypes
    except ImportError as exc:
        raise UsageError(
            "dtype 'bfloat16' needs the ml_dtypes package (pip install ml_dtypes; "
            "it comes with jax)"
        ) from exc
    bfloat16: np.dtype[Any] = np.dtype(ml_dtypes.bfloat16)
    return bfloat16


#: Names and dtypes already looked up: both are asked for on every operation. Bounded: a
#: caller could otherwise grow them with spellings ("<f4", "f4", ...) or odd dtypes.
_BY_NAME: dict[str, np.dtype[Any]] = {}
_NAMES: dict[np.dtype[Any], str] = {}
_CACHE_LIMIT = 256


def dtype_from_name(name: str) -> np.dtype[Any]:
    """The NumPy dtype for ``name``, one of :data:`SUPPORTED_DTYPES`.

    NumPy spellings of a supported dtype (``"f4"``, ``"<f4"``, ``"double"``) are accepted too.
    Raises :class:`~burncoll.UsageError` for any other name, and for ``"bfloat16"`` when
    ``ml_dtypes`` is not installed.
    """
    known = _BY_NAME.get(name) if isinstance(name, str) else None
    if known is not None:
        return known
    if name == "bfloat16":
        return _bfloat16()
    try:
        dtype = np.dtype(name)
    except TypeError:
        dtype = None
    if dtype is None or dtype.name not in SUPPORTED_DTYPES or not dtype.isnative:
        accepted = ", ".join(SUPPORTED_DTYPES)
        raise UsageError(f"unsupported dtype {name!r}; use one of {accepted}")
    if len(_BY_NAME) < _CACHE_LIMIT:
        _BY_NAME[name] = dtype
    return dtype


def dtype_name(dtype: np.dtype[Any]) -> str:
    """The name users write for ``dtype``: ``"float32"``, not ``"<f4"``; ``"bfloat16"``.

    Never raises: a dtype outside :data:`SUPPORTED_DTYPES` gets NumPy's own name, so that
    error messages can still name it.
    """
    name = _NAMES.get(dtype) if isinstance(dtype, np.dtype) else None
    if name is None:
        name = np.dtype(dtype).name  # NumPy computes it on every access (microseconds)
        if isinstance(dtype, np.dtype) and len(_NAMES) < _CACHE_LIMIT:
            _NAMES[dtype] = name
    return name


def is_inexact(dtype: np.dtype[Any]) -> bool:
    """True for floating and complex dtypes (bfloat16 included, which NumPy cannot tell)."""
    return dtype_name(dtype) in _INEXACT or np.issubdtype(dtype, np.inexact)


def host_view(
    buffer: np.ndarray[Any, Any], dtype: str, shape: tuple[int, ...]
) -> np.ndarray[Any, Any]:
    """``buffer`` as a C-ordered host array of ``dtype`` and ``shape``, without a copy if possible.

    ``buffer`` holds either elements of ``dtype`` already, or their raw bytes as ``uint8``
    (``np.frombuffer(payload, np.uint8)``). Values are never converted between dtypes. The
    result may share memory with ``buffer`` and may be read-only when ``buffer`` is.

    Raises :class:`~burncoll.UsageError` when the element count or byte size does not match
    ``shape``, or ``buffer`` has another dtype that is not ``uint8``.
    """
    target = dtype_from_name(dtype)
    if any(dim < 0 for dim in shape):
        raise UsageError(f"invalid shape {shape}: dimensions must be non-negative")
    count = math.prod(shape)
    flat = np.ascontiguousarray(buffer).reshape(-1)
    if flat.dtype != target:
        if flat.dtype != np.uint8:
            raise UsageError(
                f"cannot read {dtype_name(target)} elements from a {dtype_name(flat.dtype)} "
                "buffer; pass elements of that dtype or raw bytes as uint8"
            )
        if flat.size != count * target.itemsize:
            raise UsageError(
                f"buffer holds {flat.size} bytes but {count} {dtype_name(target)} elements "
                f"of shape {shape} need {count * target.itemsize}"
            )
        flat = flat.view(target)
    if flat.size != count:
        raise UsageError(f"buffer holds {flat.size} elements but shape {shape} needs {count}")
    return flat.reshape(shape)
