"""SLURM's compressed host lists (``gpu[01-04,07],login``), expanded with a bound."""

from __future__ import annotations

import itertools
import re

from burncoll.errors import ConfigError

__all__ = ["MAX_HOSTS", "expand_hostlist", "shown"]

#: At most this many hosts come out of one host list (a hostile variable can't exhaust memory).
MAX_HOSTS = 65536


def shown(text: str) -> str:
    """``repr`` of a variable's text, cut short so a huge hostile value can't flood a message."""
    return repr(text) if len(text) <= 120 else repr(text[:120]) + "..."


def _split_entries(spec: str) -> list[str]:
    """Top-level comma-separated entries; a comma inside brackets belongs to the bracket."""
    entries, depth, start = [], 0, 0
    for at, char in enumerate(spec):
        depth += {"[": 1, "]": -1}.get(char, 0)
        if not 0 <= depth <= 1:
            what = "a nested '['" if depth > 1 else "a ']' without '['"
            raise ConfigError(f"host list {shown(spec)}: {what} at position {at}")
        if char == "," and depth == 0:
            entries.append(spec[start:at])
            start = at + 1
    if depth:
        raise ConfigError(f"host list {shown(spec)}: a '[' is never closed")
    entries.append(spec[start:])
    return [entry.strip() for entry in entries if entry.strip()]


def _ranges(group: str, spec: str) -> list[tuple[int, int, int]]:
    """``"01-04,07"`` -> ``[(1, 4, 2), (7, 7, 2)]``: (first, last, zero-padded width)."""
    out = []
    for item in group.split(","):
        low, dash, high = item.strip().partition("-")
        high = high if dash else low
        if not (low.isascii() and low.isdigit() and high.isascii() and high.isdigit()):
            raise ConfigError(f"host list {shown(spec)}: {shown(item.strip())} in brackets is "
                              "not a number or a range like 01-04")
        try:
            first, last = int(low), int(high)
        except ValueError:
            raise ConfigError(f"host list {shown(spec)}: a number is too long") from None
        if first > last:
            raise ConfigError(f"host list {shown(spec)}: the range {low}-{high} runs backwards")
        out.append((first, last, len(low)))
    return out


def expand_hostlist(spec: str) -> list[str]:
    """SLURM's compressed host list -> host names, in order.

    ``"gpu[01-04,07],login"`` -> gpu01..gpu04, gpu07, login; several bracket groups in one
    entry expand as a cartesian product (``"rack[1-2]-n[1-2]"`` -> rack1-n1, rack1-n2,
    rack2-n1, rack2-n2). Raises :class:`~burncoll.ConfigError` for a malformed list or one of
    more than :data:`MAX_HOSTS` hosts.
    """
    hosts: list[str] = []
    for entry in _split_entries(spec):
        pieces = re.split(r"\[([^\]]*)\]", entry)  # literal, group, literal, group, ..., literal
        groups = [_ranges(group, spec) for group in pieces[1::2]]
        count = 1
        for group_ranges in groups:
            count *= sum(last - first + 1 for first, last, _ in group_ranges)
        if len(hosts) + count > MAX_HOSTS:  # checked before anything is expanded
            raise ConfigError(f"host list {shown(spec)} names more than {MAX_HOSTS} hosts")
        choices = [[f"{n:0{width}d}" for first, last, width in group_ranges
                    for n in range(first, last + 1)] for group_ranges in groups]
        for picked in itertools.product(*choices):
            hosts.append(pieces[0] + "".join(p + s for p, s in zip(picked, pieces[2::2],
                                                                    strict=True)))
    return hosts
