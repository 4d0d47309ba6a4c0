"""``--plot out.png``: bus bandwidth against size, one line per series (matplotlib)."""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Sequence

from burncoll.bench.results import PeerResult, Row

__all__ = ["MISSING_MATPLOTLIB", "matplotlib_missing", "plot_busbw"]

MISSING_MATPLOTLIB = (
    "--plot needs matplotlib, which is not installed: pip install 'burncoll[bench]'"
)


def matplotlib_missing() -> bool:
    """True when matplotlib cannot be imported (checked before any measuring starts)."""
    return importlib.util.find_spec("matplotlib") is None


def plot_busbw(path: str | os.PathLike[str], rows: Sequence[Row], peers: Sequence[PeerResult],
               title: str) -> None:
    """Write a log-log PNG of busbw (GB/s) against size (bytes) to ``path``. One line per burncoll
    operation and one per peer baseline that has rows. Raises :class:`RuntimeError` with
    :data:`MISSING_MATPLOTLIB` when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise RuntimeError(MISSING_MATPLOTLIB) from exc

    series: dict[str, list[tuple[int, float]]] = {}
    for row in rows:
        if row.op != "barrier":
            series.setdefault(f"burncoll {row.op}", []).append((row.size, row.busbw))
    for peer in peers:
        if peer.rows:
            label = f"{peer.name} {peer.op}" if peer.op else peer.name
            series[label] = [(r.size, r.busbw) for r in peer.rows]

    figure, axes = plt.subplots(figsize=(9, 5.5))
    for label, points in series.items():
        points = [(size, bw) for size, bw in points if bw > 0]
        if points:
            sizes, values = zip(*points, strict=True)
            axes.plot(sizes, values, marker="o", markersize=3, label=label)
    axes.set_xscale("log", base=2)
    axes.set_yscale("log")
    axes.set_xlabel("size (bytes)")
    axes.set_ylabel("busbw (GB/s)")
    axes.set_title(title)
    axes.grid(True, which="both", alpha=0.3)
    axes.legend(fontsize="small")
    figure.tight_layout()
    figure.savefig(os.fspath(path), dpi=120)
    plt.close(figure)
