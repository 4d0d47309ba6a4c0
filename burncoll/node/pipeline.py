"""The order, part by part, of one node's steps that touch the same chunk (no I/O).

A pipelined walk runs every step of this node at once; the steps on one chunk form a sequence
in round order. Each has a *slot* whose progress is the number of the chunk's leading bytes it
has finished (parts of a chunk are sent and received in order). A step may handle bytes
``[.., end)`` once every earlier step it conflicts with -- a receive after anything, anything
after a receive: reading and writing the same bytes -- has progressed to ``end``. A step that
may not waits until the chunk changes; whoever runs the steps learns of every change through
``changed(chunk)`` (the executor wakes the steps that wait on that chunk).
"""

from __future__ import annotations

import math
from collections.abc import Callable

__all__ = ["Pipeline"]


class Pipeline:
    """Progress of every step of one walk on each chunk."""

    __slots__ = ("_progress", "_writes", "changed")

    def __init__(self, changed: Callable[[int], None]) -> None:
        #: Called with a chunk whenever a step progresses on it (or its buffer appears).
        self.changed = changed
        self._writes: dict[int, list[bool]] = {}
        self._progress: dict[int, list[float]] = {}

    def add(self, chunk: int, writes: bool) -> int:
        """The slot of the next step on ``chunk`` (``writes``: a receive)."""
        kinds = self._writes.setdefault(chunk, [])
        kinds.append(writes)
        self._progress.setdefault(chunk, []).append(0)
        return len(kinds) - 1

    def ready(self, chunk: int, slot: int, end: int) -> bool:
        """Whether step ``slot`` may handle the bytes of ``chunk`` up to ``end``."""
        kinds, progress = self._writes[chunk], self._progress[chunk]
        writes = kinds[slot]
        return all(progress[j] >= end for j in range(slot) if writes or kinds[j])

    def touched(self, chunk: int) -> None:
        """The buffer of ``chunk`` appeared (allocated by the receive of its first part)."""
        self.changed(chunk)

    def advance(self, chunk: int, slot: int, end: int) -> None:
        """Step ``slot`` is done with the bytes of ``chunk`` up to ``end``."""
        self._progress[chunk][slot] = end
        self.changed(chunk)

    def finish(self, chunk: int, slot: int) -> None:
        """Step ``slot`` is done with ``chunk``."""
        self._progress[chunk][slot] = math.inf
        self.changed(chunk)
