"""Chunk layouts: how a flat array of ``count`` elements is cut into the chunks of a schedule.

Pure arithmetic shared by both levels (the local buffers and the node-level walk): a layout is
the ``(start, stop)`` element offsets of each chunk, split the way ``numpy.array_split`` splits.
"""

from __future__ import annotations

from collections.abc import Sequence

from burncoll.errors import UsageError

__all__ = ["Layout", "block_rows", "even_layout", "row_layout", "sizes_layout"]

#: ``(start, stop)`` element offsets of each chunk in the flat array.
Layout = tuple[tuple[int, int], ...]


def sizes_layout(sizes: Sequence[int]) -> Layout:
    """Consecutive chunks of the given sizes."""
    bounds: list[tuple[int, int]] = []
    start = 0
    for size in sizes:
        bounds.append((start, start + size))
        start += size
    return tuple(bounds)


def even_layout(count: int, parts: int) -> Layout:
    """``count`` elements in ``parts`` chunks, sized as ``numpy.array_split`` sizes them."""
    base, extra = divmod(count, parts)
    return sizes_layout([base + (1 if i < extra else 0) for i in range(parts)])


def row_layout(shape: tuple[int, ...], parts: int) -> Layout:
    """Blocks of rows (axis 0) split as ``numpy.array_split`` does, in flat element offsets."""
    if not shape:
        raise UsageError("reduce_scatter needs an array with at least one dimension")
    row = 1
    for d in shape[1:]:
        row *= d
    rows = even_layout(shape[0], parts)
    return tuple((a * row, b * row) for a, b in rows)


def block_rows(shape: tuple[int, ...], parts: int, index: int) -> int:
    """Rows of block ``index`` when ``shape[0]`` rows are split as ``numpy.array_split``."""
    base, extra = divmod(shape[0], parts)
    return base + (1 if index < extra else 0)
