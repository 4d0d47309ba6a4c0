"""Text output in the layout of nccl-tests: a ``#`` banner, one table per operation, a summary.

Columns: ``size`` (bytes of the largest buffer), ``count`` (its elements), ``type``,
``redop``, ``root`` (-1: none), ``time`` (µs, median of the slowest peer), ``algbw`` and
``busbw`` (GB/s), ``#wrong``; then one ``vs NAME`` column per peer baseline that ran:
``peer_time / burncoll_time`` at the same sweep size (above 1: burncoll is faster).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from burncoll.bench.results import PeerResult, Row

__all__ = ["banner", "body", "closing", "format_row", "op_header", "peer_table", "ratio_peers",
           "ratios_for", "row_lines", "summary"]

_COLUMNS = ("size", "count", "type", "redop", "root", "time", "algbw", "busbw", "#wrong")
_UNITS = ("(B)", "(elements)", "", "", "", "(us)", "(GB/s)", "(GB/s)", "")
_WIDTHS = (12, 12, 8, 6, 6, 10, 8, 8, 7)
_RATIO_WIDTH = 9


def _cells(values: Sequence[str], widths: Sequence[int]) -> str:
    return " ".join(value.rjust(width) for value, width in zip(values, widths, strict=True))


def banner(settings: dict[str, Any]) -> list[str]:
    """``# key: value`` lines describing the run."""
    lines = ["# burncoll bench"]
    lines += [f"#   {key}: {value}" for key, value in settings.items()]
    return [*lines, "#"]


def ratio_peers(peers: Sequence[PeerResult]) -> list[PeerResult]:
    """The peers that get a ``vs`` column: those with rows."""
    return [peer for peer in peers if peer.rows]


def op_header(op: str, peers: Sequence[PeerResult]) -> list[str]:
    """The two header lines (names, units) of the table of ``op``."""
    names = [*_COLUMNS, *(f"vs {peer.name}" for peer in peers)]
    units = [*_UNITS, *("(x)" for _ in peers)]
    widths = [*_WIDTHS, *(_RATIO_WIDTH for _ in peers)]
    first = "#" + _cells(names, widths)[1:]
    second = ("#" + _cells(units, widths)[1:]).rstrip()
    return [f"# {op}", first, second]


def ratios_for(row: Row, peers: Sequence[PeerResult]) -> list[float | None]:
    """``peer_time / row_time`` for each peer, ``None`` where it has no comparable time."""
    out: list[float | None] = []
    for peer in peers:
        theirs = peer.time_at(row.requested) if peer.op in (None, row.op) else None
        comparable = theirs is not None and row.op != "barrier" and row.time_us > 0
        out.append(theirs / row.time_us if comparable and theirs is not None else None)
    return out


def format_row(row: Row, ratios: Sequence[float | None] = ()) -> str:
    """One table line."""
    values = [str(row.size), str(row.count), row.dtype, row.redop, str(row.root),
              f"{row.time_us:.1f}", f"{row.algbw:.3f}", f"{row.busbw:.3f}", str(row.wrong)]
    values += ["-" if r is None else f"{r:.3g}" for r in ratios]
    widths = [*_WIDTHS, *(_RATIO_WIDTH for _ in ratios)]
    return " " + _cells(values, widths)[1:]


def peer_table(peer: PeerResult) -> list[str]:
    """The baseline's own rows, or the one line saying why it was skipped."""
    if peer.skipped is not None:
        return [f"# vs {peer.name}: skipped: {peer.skipped}"]
    widths = (12, 12, 10, 8, 8)
    lines = [f"# vs {peer.name}: {peer.description}",
             f"#   (the 'vs {peer.name} (x)' column: its time / burncoll's; above 1, burncoll "
             "is faster)",
             "#" + _cells(("size", "count", "time", "algbw", "busbw"), widths)[1:],
             ("#" + _cells(("(B)", "(elements)", "(us)", "(GB/s)", "(GB/s)"), widths)[1:]).rstrip()]
    for row in peer.rows:
        values = (str(row.size), str(row.count), f"{row.time_us:.1f}", f"{row.algbw:.3f}",
                  f"{row.busbw:.3f}")
        lines.append(" " + _cells(values, widths)[1:])
    return lines


def summary(rows: Sequence[Row]) -> list[str]:
    """nccl-tests' closing lines: wrong elements and the mean busbw of the data rows."""
    wrong = sum(row.wrong for row in rows)
    data = [row.busbw for row in rows if row.op != "barrier"]
    average = sum(data) / len(data) if data else 0.0
    return [f"# Out of bounds values : {wrong} {'OK' if wrong == 0 else 'FAILED'}",
            f"# Avg bus bandwidth    : {average:.3f} GB/s", "#"]


def row_lines(row: Row, previous: str | None, columns: Sequence[PeerResult]) -> list[str]:
    """The lines printing ``row`` after a row of operation ``previous``: a new table header
    first when the operation changes. ``columns`` are the peers with a ``vs`` column."""
    lines: list[str] = []
    if row.op != previous:
        if previous is not None:
            lines.append("#")
        lines += op_header(row.op, columns)
    return [*lines, format_row(row, ratios_for(row, columns))]


def closing(rows: Sequence[Row], peers: Sequence[PeerResult], skipped: bool = True) -> list[str]:
    """What follows the tables: the peer baselines (``skipped``: their skip notes too) and the
    summary."""
    lines = ["#"]
    for peer in peers:
        if skipped or peer.skipped is None:
            lines += [*peer_table(peer), "#"]
    return lines + summary(rows)


def body(rows: Sequence[Row], peers: Sequence[PeerResult], skipped: bool = True) -> list[str]:
    """One table per operation, then :func:`closing`."""
    columns = ratio_peers(peers)
    lines: list[str] = []
    previous: str | None = None
    for row in rows:
        lines += row_lines(row, previous, columns)
        previous = row.op
    return lines + closing(rows, peers, skipped)
