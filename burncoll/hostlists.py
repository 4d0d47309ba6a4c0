"""SLURM's compressed host lists (``gpu[01-04,07],login``), expanded lazily and with bounds.

A host list comes from the environment, which other tools assemble, so every size is bounded
before work that grows with it: :func:`iter_hostlist` makes each name only when asked for (the
rendezvous needs the first host only), a number in brackets has at most :data:`MAX_DIGITS`
digits, a host name at most :data:`MAX_HOST_NAME` characters, a list at most
:data:`MAX_HOSTS` hosts (counted before anything is expanded).
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Iterator

from burncoll.errors import ConfigError

__all__ = ["MAX_DIGITS", "MAX_HOSTS", "MAX_HOST_NAME", "expand_hostlist", "first_host",
           "iter_hostlist", "shown"]

#: At most this many hosts come out of one host list (a hostile variable can't exhaust memory).
MAX_HOSTS = 65536
#: The longest host name (DNS allows 253 characters; 255 with room for a trailing dot).
MAX_HOST_NAME = 255
#: The most digits of a number in brackets (and of any count read from the environment).
MAX_DIGITS = 18


def shown(value: object, head: int = 60, tail: int = 20) -> str:
    """``repr`` of a value, its middle elided when long, so that a huge hostile value can't
    flood a message: the first ``head`` characters, ``...``, the last ``tail``, and the
    length."""
    text = repr(value)
    if len(text) <= head + tail + 20:
        return text
    return f"{text[:head]}...{text[-tail:]} ({len(text)} characters)"


def _split_entries(spec: str) -> Iterator[str]:
    """Top-level comma-separated entries, each as soon as it is read (a comma inside brackets
    belongs to the bracket)."""
    depth, start = 0, 0
    for at, char in enumerate(spec):
        depth += {"[": 1, "]": -1}.get(char, 0)
        if not 0 <= depth <= 1:
            what = "a nested '['" if depth > 1 else "a ']' without '['"
            raise ConfigError(f"host list {shown(spec)}: {what} at position {at}")
        if char == "," and depth == 0:
            if spec[start:at].strip():
                yield spec[start:at].strip()
            start = at + 1
    if depth:
        raise ConfigError(f"host list {shown(spec)}: a '[' is never closed")
    if spec[start:].strip():
        yield spec[start:].strip()


def _ranges(group: str, spec: str) -> list[tuple[int, int, int]]:
    """``"01-04,07"`` -> ``[(1, 4, 2), (7, 7, 2)]``: (first, last, zero-padded width)."""
    out = []
    for item in group.split(","):
        low, dash, high = item.strip().partition("-")
        high = high if dash else low
        if not (low.isascii() and low.isdigit() and high.isascii() and high.isdigit()):
            raise ConfigError(f"host list {shown(spec)}: {shown(item.strip())} in brackets is "
                              "not a number or a range like 01-04")
        if max(len(low), len(high)) > MAX_DIGITS:
            raise ConfigError(f"host list {shown(spec)}: a number in brackets has more than "
                              f"{MAX_DIGITS} digits")
        first, last = int(low), int(high)
        if first > last:
            raise ConfigError(f"host list {shown(spec)}: the range {low}-{high} runs backwards")
        out.append((first, last, len(low)))
    return out


def _entry(entry: str, spec: str) -> tuple[list[str], list[list[tuple[int, int, int]]], int]:
    """An entry's literals and bracket groups, checked, and how many hosts it names."""
    pieces = re.split(r"\[([^\]]*)\]", entry)  # literal, group, literal, group, ..., literal
    groups = [_ranges(group, spec) for group in pieces[1::2]]
    widest = sum(len(p) for p in pieces[0::2]) + sum(
        max(max(len(str(last)), width) for _, last, width in g) for g in groups)
    if widest > MAX_HOST_NAME:
        raise ConfigError(f"host list {shown(spec)}: the entry {shown(entry)} makes host names "
                          f"longer than {MAX_HOST_NAME} characters")
    count = 1
    for group_ranges in groups:
        count *= sum(last - first + 1 for first, last, _ in group_ranges)
        count = min(count, MAX_HOSTS + 1)  # bounded: a product of huge ranges stays small
    return pieces, groups, count


def iter_hostlist(spec: str) -> Iterator[str]:
    """SLURM's compressed host list -> host names, in order, each made only when asked for.

    ``"gpu[01-04,07],login"`` -> gpu01..gpu04, gpu07, login; several bracket groups in one
    entry expand as a cartesian product (``"rack[1-2]-n[1-2]"`` -> rack1-n1, rack1-n2,
    rack2-n1, rack2-n2). Raises :class:`~burncoll.ConfigError` for a malformed entry (when it
    is reached), or one that takes the list past :data:`MAX_HOSTS` hosts.
    """
    total = 0
    for entry in _split_entries(spec):
        pieces, groups, count = _entry(entry, spec)
        total += count
        if total > MAX_HOSTS:  # checked before the entry is expanded
            raise ConfigError(f"host list {shown(spec)} names more than {MAX_HOSTS} hosts")
        choices = [[f"{n:0{width}d}" for first, last, width in group_ranges
                    for n in range(first, last + 1)] for group_ranges in groups]
        for picked in itertools.product(*choices):
            yield pieces[0] + "".join(p + s for p, s in zip(picked, pieces[2::2], strict=True))


def expand_hostlist(spec: str) -> list[str]:
    """Every host of :func:`iter_hostlist`, as a list (at most :data:`MAX_HOSTS`)."""
    return list(iter_hostlist(spec))


def first_host(spec: str) -> str | None:
    """The first host of the list (``None`` for an empty one), the rest not expanded."""
    return next(iter_hostlist(spec), None)
