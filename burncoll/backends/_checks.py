"""Argument checks shared by the backends; each raises a burncoll error naming the bad value."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from burncoll.errors import ConfigError, UsageError

__all__ = ["check_count", "check_devices", "check_divisor", "check_nonempty", "check_slice"]


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
