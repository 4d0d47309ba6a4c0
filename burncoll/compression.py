"""16-bit wire formats for compressed all-reduces across nodes: ``"bf16"`` and ``"fp16"``.

A compressed all-reduce sends every value between nodes as 16 bits and adds what it receives
into a buffer of the input's own precision (float32 or float64), so only the wire is narrow:
each value is rounded once when it leaves its node, and a partial sum once per hop it is
forwarded. Every node ends with the 16-bit values it sent, so all nodes hold bitwise identical
values (the node that reduced a chunk last would otherwise keep more bits than those it sent
the chunk to): it rounds its own final values as it sends them, and rounds only what it never
sent when the operation ends (:func:`quantize`).

Error bound, for ``n`` nodes, ``k = n + 1`` roundings at most on a value's way (once when it
leaves its node, once per hop its partial sum is forwarded, once at the end) and ``s = x_1 +
... + x_n``: ``|result - s| <= g * (|x_1| + ... + |x_n|) + k * t``, with ``g = k*u / (1 - k*u)``
(the usual bound for ``k`` roundings, not just its first-order ``k*u``), ``u = 2**-8`` for bf16
and ``2**-11`` for fp16 (half an ulp: round to nearest even; float64 inputs are rounded to
float32 first, so ``u`` grows by ``2**-24`` for them), and ``t`` the absolute error of a value
too small for the format (``2**-25`` for fp16's subnormals; nothing worth counting for bf16),
plus the input-precision error of an uncompressed sum. :func:`error_bound` computes it. bf16
keeps float32's range; fp16 overflows to ``inf`` beyond 65504 -- partial sums included --
which no bound covers (scale gradients first, as torch's fp16 hook users do). NaN stays NaN.

bf16 is float32's top 16 bits, rounded to nearest even: ml_dtypes' cast when it is installed
(a dependency of burncoll), else the same rounding with NumPy bit operations.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np

__all__ = [
    "COMPRESSIONS",
    "WIRE_ITEMSIZE",
    "decode",
    "encode",
    "error_bound",
    "of_root",
    "quantize",
    "root_code",
    "wire_values",
]

#: The accepted ``compression`` values.
COMPRESSIONS = ("bf16", "fp16")
#: Bytes per value on the wire.
WIRE_ITEMSIZE = 2
#: How a compressed all-reduce says so in its frames' ``root`` field (an all-reduce has no
#: root: -1), which every receiver compares with its own call's: nodes that disagree on the
#: compression fail with a MismatchError before any size check.
_ROOT_CODES = {"bf16": -2, "fp16": -3}
#: The unit roundoff of each format (half an ulp at 1.0).
_UNIT = {"bf16": 2.0**-8, "fp16": 2.0**-11}

NDArray = np.ndarray[Any, Any]

@functools.cache
def _bfloat16() -> Any:
    """ml_dtypes' bfloat16 dtype (a dependency; jax brings it too), ``None`` without it;
    imported at the first bf16 operation, not with burncoll: it costs a process ~1 s of CPU."""
    try:
        import ml_dtypes
    except ImportError:  # pragma: no cover - installed with burncoll
        return None
    return np.dtype(ml_dtypes.bfloat16)


def encode(x: NDArray, kind: str) -> NDArray:
    """``x`` (float32 or float64, 1-D) as a new uint16 array of its 16-bit values."""
    if kind == "fp16":
        with np.errstate(over="ignore", invalid="ignore"):  # beyond 65504: inf, as documented
            return x.astype(np.float16).view(np.uint16)
    bfloat16 = _bfloat16()
    if bfloat16 is not None:  # ml_dtypes' cast: about 5x faster than the bit operations
        narrowed: NDArray = x.astype(bfloat16).view(np.uint16)
        return narrowed
    bits = np.ascontiguousarray(x, np.float32).view(np.uint32)
    rounded = np.right_shift(bits, 16)
    np.bitwise_and(rounded, 1, out=rounded)
    np.add(rounded, 0x7FFF, out=rounded)
    np.add(rounded, bits, out=rounded)  # round to nearest even
    np.right_shift(rounded, 16, out=rounded)
    out = rounded.astype(np.uint16)
    nan = np.isnan(x)
    if nan.any():  # a NaN whose payload sits in the low bits would round to inf
        out[nan] = (bits[nan] >> np.uint32(16)).astype(np.uint16) | np.uint16(0x0040)
    return out


def decode(raw: NDArray, kind: str) -> NDArray:
    """uint16 wire values as a new float32 array."""
    if kind == "fp16":
        return raw.view(np.float16).astype(np.float32)
    bfloat16 = _bfloat16()
    if bfloat16 is not None:
        widened: NDArray = raw.view(bfloat16).astype(np.float32)
        return widened
    wide = raw.astype(np.uint32)
    np.left_shift(wide, 16, out=wide)
    return wide.view(np.float32)


def wire_values(raw: NDArray, kind: str) -> NDArray:
    """uint16 wire values as 16-bit floats NumPy widens while it combines or copies them (a
    view, no copy: ``np.add(acc, wire_values(raw, k), out=acc, dtype=acc.dtype)``); the
    decoded float32 copy where the bfloat16 dtype is missing."""
    if kind == "fp16":
        return raw.view(np.float16)
    bfloat16 = _bfloat16()
    if bfloat16 is not None:
        return raw.view(bfloat16)
    return decode(raw, kind)


def quantize(x: NDArray, kind: str) -> None:
    """Round ``x`` (float32 or float64, writable) in place to the values ``kind`` holds."""
    flat = x.reshape(-1)
    flat[...] = decode(encode(flat, kind), kind)


def error_bound(kind: str, nodes: int, magnitudes: NDArray, dtype: str = "float32"
                ) -> NDArray:
    """The documented bound on a compressed sum's error, per element, given ``magnitudes =
    sum(|x_i|)`` over the ``nodes`` nodes' inputs of ``dtype`` (see the module docstring)."""
    k = nodes + 1
    unit = _UNIT[kind] + (2.0**-24 if dtype == "float64" else 0.0)
    growth = k * unit / (1 - k * unit)
    tiny = 2.0**-25 if kind == "fp16" else 0.0
    bound: NDArray = growth * magnitudes + k * tiny
    return bound


def root_code(kind: str) -> int:
    """The ``root`` a compressed all-reduce's frames carry."""
    return _ROOT_CODES[kind]


def of_root(root: int) -> str | None:
    """The compression an all-reduce's ``root`` field names, or ``None``."""
    return next((k for k, code in _ROOT_CODES.items() if code == root), None)
