"""What ``burncoll launch`` shows of its node processes: their output and how each ended.

Each node's output (stdout and stderr together) is copied line by line, prefixed ``[node R]``
(:class:`NodeOutput`), which also remembers the error the node ended with: the exception line
of its last Python traceback (``ValueError: peer 2 gives up``), else its last line of output.
When a node fails the launcher says so at once (:func:`failure_line`), and at the end of a
failed run it prints a summary like torchrun's (:func:`summary`): the first failure, with its
exit code and error, and how every other node ended.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterable
from dataclasses import dataclass
from typing import IO

__all__ = ["NodeOutput", "Outcome", "describe", "failure_line", "summary"]

#: Longest error line kept from a node's output (characters).
_LINE_LIMIT = 500
_TRACEBACK = "Traceback (most recent call last):"


def describe(returncode: int) -> str:
    """``"3"``, or ``"-9 (SIGKILL)"`` for a death by signal."""
    if returncode >= 0:
        return str(returncode)
    try:
        return f"{returncode} ({signal.Signals(-returncode).name})"
    except ValueError:
        return str(returncode)


class NodeOutput:
    """One node process's output: copied to ``sink`` with its prefix, under ``lock`` (a node
    killed mid-line leaves a last line without its newline: it gets one, so the next node's
    line is not glued to it); the error it ended with is kept."""

    def __init__(self, rank: int, sink: IO[str], lock: threading.Lock) -> None:
        self.rank = rank
        self._sink = sink
        self._lock = lock
        self._in_traceback = False
        self._exception: str | None = None
        self._last: str | None = None

    def pump(self, stream: Iterable[str]) -> None:
        """Copy ``stream`` until it ends (run in a thread of its own)."""
        for line in stream:
            self._see(line.rstrip("\r\n"))
            with self._lock:
                self._sink.write(f"[node {self.rank}] {line.rstrip(chr(10))}\n")
                self._sink.flush()

    def _see(self, line: str) -> None:
        if not line.strip():
            return
        self._last = line[:_LINE_LIMIT]
        if line.startswith(_TRACEBACK):
            self._in_traceback = True
        elif self._in_traceback and not line[0].isspace():
            self._exception, self._in_traceback = line[:_LINE_LIMIT], False

    @property
    def error(self) -> str | None:
        """The exception line of the node's last traceback, else its last line of output."""
        return self._exception or self._last


@dataclass(frozen=True)
class Outcome:
    """How one node process of a round ended."""

    rank: int
    returncode: int
    error: str | None
    stopped: bool  #: stopped by the launcher (SIGTERM, then SIGKILL) after another failed


def failure_line(rank: int, returncode: int, error: str | None) -> str:
    """``node 1 failed (exit code 3): ValueError: peer 2 gives up``."""
    said = f": {error}" if error else ""
    return f"node {rank} failed (exit code {describe(returncode)}){said}"


def summary(first: int, outcomes: list[Outcome], code: int) -> list[str]:
    """The lines that end a failed run: the launcher's exit code, the first failure, then how
    every other node ended."""
    lines = [f"FAILED with exit code {code}; node {first} failed first"]
    for outcome in sorted(outcomes, key=lambda o: (o.rank != first, o.rank)):
        if outcome.stopped:
            how = f"stopped by the launcher (exit code {describe(outcome.returncode)})"
        else:
            how = f"exit code {describe(outcome.returncode)}"
        shown = outcome.error and outcome.returncode and not outcome.stopped
        error = f": {outcome.error}" if shown else ""
        first_mark = " (first failure)" if outcome.rank == first else ""
        lines.append(f"  node {outcome.rank}{first_mark}: {how}{error}")
    return lines
