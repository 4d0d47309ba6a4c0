"""Parsing of the benchmark's options: byte sizes, the size sweep, operations and dtypes.

Each parser raises :class:`ValueError` with a message meant for the command line; the CLI
turns it into an argparse error (exit code 2).
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Callable
from typing import TypeVar

from burncoll.dtypes import SUPPORTED_DTYPES

__all__ = ["ALL_OPS", "BENCH_DTYPES", "REDOPS", "argtype", "format_size", "int_at_least",
           "parse_dtype", "parse_names", "parse_ops", "parse_size", "size_sweep"]

#: Every operation the benchmark measures, in the order ``--op all`` runs them.
ALL_OPS: tuple[str, ...] = ("all_reduce", "reduce", "broadcast", "reduce_scatter", "all_gather",
                            "barrier")
#: Operations that take a reduce op (``redop`` column) and a root (``root`` column).
REDUCING_OPS = frozenset({"all_reduce", "reduce", "reduce_scatter"})
ROOTED_OPS = frozenset({"reduce", "broadcast"})
#: The reduce operations accepted by ``--redop``.
REDOPS: tuple[str, ...] = ("sum", "mean", "max", "min", "prod")
#: The dtypes the benchmark can generate and check (complex and bool are left out).
BENCH_DTYPES: tuple[str, ...] = tuple(
    d for d in SUPPORTED_DTYPES if not d.startswith("complex") and d != "bool"
)

T = TypeVar("T")

_UNITS = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30}
_SIZE = re.compile(r"^\s*(\d+)\s*([KMG]?)(?:I?B)?\s*$", re.IGNORECASE)


def parse_size(text: str) -> int:
    """``"8"``, ``"1K"``, ``"64M"``, ``"1G"`` (binary units, as nccl-tests) -> bytes (>= 1)."""
    match = _SIZE.match(text)
    if match is None:
        raise ValueError(
            f"invalid size {text!r}: expected a whole number of bytes with an optional "
            "K, M or G suffix (1K = 1024), e.g. 8, 1K, 64M"
        )
    value = int(match.group(1)) * _UNITS[match.group(2).upper()]
    if value < 1:
        raise ValueError(f"invalid size {text!r}: must be at least 1 byte")
    return value


def format_size(nbytes: int) -> str:
    """The shortest exact spelling: ``1024 -> "1K"``, ``3000 -> "3000"``."""
    for suffix in ("G", "M", "K"):
        unit = _UNITS[suffix]
        if nbytes >= unit and nbytes % unit == 0:
            return f"{nbytes // unit}{suffix}"
    return str(nbytes)


def size_sweep(min_bytes: int, max_bytes: int, factor: float) -> list[int]:
    """``min_bytes, min_bytes*factor, ...`` up to ``max_bytes`` inclusive (nccl-tests -b -e -f)."""
    if min_bytes > max_bytes:
        raise ValueError(f"--min-bytes ({min_bytes}) is larger than --max-bytes ({max_bytes})")
    if not factor > 1:
        raise ValueError(f"--factor must be greater than 1, got {factor:g}")
    sizes: list[int] = []
    size = float(min_bytes)
    while round(size) <= max_bytes:
        if not sizes or round(size) != sizes[-1]:
            sizes.append(round(size))
        size *= factor
    return sizes


def parse_names(text: str, names: tuple[str, ...], flag: str) -> tuple[str, ...]:
    """``"all"`` (``names``) or a comma-separated list of ``names`` (``-`` may replace ``_``),
    in the order given; ValueError naming ``flag`` otherwise."""
    chosen = [part.strip().lower().replace("-", "_") for part in text.split(",")]
    chosen = [name for name in chosen if name]
    if chosen == ["all"]:
        return names
    if not chosen or any(name not in names for name in chosen):
        raise ValueError(f"invalid {flag} {text!r}: use 'all' or a comma-separated list of "
                         f"{', '.join(names)}")
    return tuple(dict.fromkeys(chosen))


def parse_ops(text: str) -> tuple[str, ...]:
    """``"all"`` or a comma-separated list of :data:`ALL_OPS`."""
    return parse_names(text, ALL_OPS, "--op")


def parse_dtype(text: str) -> str:
    """One of :data:`BENCH_DTYPES`, lower-cased."""
    name = text.strip().lower()
    if name not in BENCH_DTYPES:
        raise ValueError(f"invalid --dtype {text!r}: use one of {', '.join(BENCH_DTYPES)}")
    return name


def argtype(parse: Callable[[str], T], name: str) -> Callable[[str], T]:
    """An argparse ``type=`` from ``parse``: its ValueError becomes a usage error (exit 2)."""

    def convert(text: str) -> T:
        try:
            return parse(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    convert.__name__ = name
    return convert


def int_at_least(minimum: int) -> Callable[[str], int]:
    """An argparse ``type=`` for integers ``>= minimum``."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise ValueError(f"invalid integer {text!r}") from None
        if value < minimum:
            raise ValueError(f"must be at least {minimum}, got {value}")
        return value

    return argtype(parse, "integer")
