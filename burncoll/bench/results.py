"""The benchmark's results: one :class:`Row` per (operation, size), peer series, and JSON.

Bandwidths follow nccl-tests (``doc/PERFORMANCE.md`` there): ``algbw = size / time`` with
``size`` the largest buffer of the operation (the whole gathered array for all-gather, the
whole input for reduce-scatter), and ``busbw = algbw * factor`` where the factor makes the
number comparable to the hardware's bandwidth whatever the world size ``n``:

========================  ==================
operation                 busbw factor
========================  ==================
all_reduce                ``2 (n - 1) / n``
reduce_scatter            ``(n - 1) / n``
all_gather                ``(n - 1) / n``
broadcast, reduce         ``1``
barrier                   ``0`` (no data)
========================  ==================
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import sys
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from statistics import median
from typing import Any

__all__ = ["TIMING_METHOD", "PeerResult", "PeerRow", "Row", "busbw_factor", "environment_info",
           "median", "write_json"]

#: How a row's time is measured, recorded in the JSON output and shown by ``--help``.
TIMING_METHOD = (
    "per iteration, every peer calls barrier() and then times the operation alone "
    "(time.perf_counter from the barrier's return to the operation's return); the "
    "iteration's time is the maximum over all peers (all nodes); the reported time is the "
    "median over --iters iterations, after --warmup untimed ones. Results are checked on a "
    "separate untimed call before the warm-up."
)


def busbw_factor(op: str, world: int) -> float:
    """The factor from algbw to busbw for ``op`` among ``world`` peers (see module doc)."""
    if op == "all_reduce":
        return 2 * (world - 1) / world
    if op in ("reduce_scatter", "all_gather"):
        return (world - 1) / world
    if op in ("broadcast", "reduce"):
        return 1.0
    return 0.0


@dataclass(frozen=True)
class Row:
    """One (operation, size) measurement of burncoll."""

    #: Operation name, e.g. ``"all_reduce"``.
    op: str
    #: The size asked for by the sweep, in bytes (peer ratios are matched on it).
    requested: int
    #: Bytes of the largest buffer actually used (``count * itemsize``).
    size: int
    #: Elements of that buffer.
    count: int
    #: dtype name, e.g. ``"float32"``; ``"none"`` for barrier.
    dtype: str
    #: Reduce op name, or ``"none"`` for operations without one.
    redop: str
    #: Root peer id, or -1 for operations without one.
    root: int
    #: Median over iterations of the slowest peer's time, microseconds.
    time_us: float
    #: ``size / time`` in GB/s (1 GB = 1e9 bytes).
    algbw: float
    #: ``algbw * busbw_factor(op, world)`` in GB/s.
    busbw: float
    #: Elements outside tolerance, summed over peers.
    wrong: int
    #: Each timed iteration's slowest-peer time, microseconds.
    iter_times_us: list[float] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Row:
        return cls(**data)


@dataclass(frozen=True)
class PeerRow:
    """One size of a peer baseline (Gloo, MPI, TCP loopback, NumPy add)."""

    requested: int
    size: int
    count: int
    time_us: float
    algbw: float
    busbw: float

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class PeerResult:
    """A peer baseline's series, or the reason it was skipped."""

    #: ``"gloo"``, ``"mpi"``, ``"tcp"`` or ``"numpy"``.
    name: str
    #: What was measured, in words (shown above its table).
    description: str
    #: The burncoll operation its times compare with; ``None`` for every operation.
    op: str | None
    rows: list[PeerRow] = field(default_factory=list)
    #: Why there are no rows (not installed, failed), as one line; ``None`` when it ran.
    skipped: str | None = None

    def time_at(self, requested: int) -> float | None:
        """This peer's time at sweep size ``requested``, if measured."""
        return next((row.time_us for row in self.rows if row.requested == requested), None)

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "description": self.description, "op": self.op,
                "skipped": self.skipped, "rows": [row.to_dict() for row in self.rows]}


def environment_info() -> dict[str, Any]:
    """Versions and machine facts recorded next to the rows."""
    import numpy

    from burncoll import __version__

    info: dict[str, Any] = {"burncoll": __version__, "python": sys.version.split()[0],
                            "numpy": numpy.__version__, "platform": platform.platform(),
                            "machine": platform.machine(), "processor": platform.processor(),
                            "cpu_count": os.cpu_count(),
                            "date": datetime.now(UTC).isoformat(timespec="seconds")}
    with contextlib.suppress(OSError):  # not on every platform
        info["load_average"] = list(os.getloadavg())
    return info


def write_json(path: str | os.PathLike[str], rows: list[Row], peers: list[PeerResult],
               settings: dict[str, Any]) -> None:
    """Write ``{"environment", "settings", "timing", "rows", "peers"}`` to ``path``."""
    document = {"environment": environment_info(), "settings": settings, "timing": TIMING_METHOD,
                "rows": [row.to_dict() for row in rows],
                "peers": [peer.to_dict() for peer in peers]}
    Path(path).write_text(json.dumps(document, indent=2) + "\n")
