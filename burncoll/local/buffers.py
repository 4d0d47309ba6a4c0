"""Chunk layouts and one peer's working buffer.

A :class:`ChunkBuffer` is a peer's copy of the flat array being reduced or moved, cut into the
chunks of a schedule. On mutable backends (NumPy, CuPy) it is one preallocated output array:
a chunk that was never written still reads from the input (no up-front copy), a reduction
writes ``out[c] = in[c] op other[c]`` in a single pass. On immutable backends (JAX) each chunk
is its own array, replaced on every write, and the result is their concatenation.
"""

from __future__ import annotations

from burncoll.backends.base import Array, Backend, Device, combine
from burncoll.ops import ReduceOp
from burncoll.strategies.layout import Layout

__all__ = ["ChunkBuffer"]

class ChunkBuffer:
    """One peer's buffer over a layout. ``initial`` is the peer's flat input, or ``None``
    when every chunk will be written before it is read (a broadcast receiver)."""

    def __init__(
        self,
        backend: Backend,
        device: Device,
        dtype: str,
        layout: Layout,
        initial: Array | None,
    ) -> None:
        self.backend = backend
        self.device = device
        self.layout = layout
        self._initial = initial
        count = layout[-1][1] if layout else 0
        self._written = [False] * len(layout)
        if backend.mutable:
            self._out: Array | None = backend.empty(count, dtype, device)
            self._chunks: list[Array | None] = [
                backend.slice(self._out, a, b) for a, b in layout
            ]
        else:
            self._out = None
            self._chunks = [
                None if initial is None else backend.slice(initial, a, b) for a, b in layout
            ]

    def chunk(self, c: int) -> Array:
        """The current content of chunk ``c``."""
        if self.backend.mutable and not self._written[c]:
            if self._initial is None:
                raise RuntimeError(f"chunk {c} read before it was written (schedule bug)")
            start, stop = self.layout[c]
            return self.backend.slice(self._initial, start, stop)
        value = self._chunks[c]
        if value is None:
            raise RuntimeError(f"chunk {c} read before it was written (schedule bug)")
        return value

    def reduce(self, c: int, other: Array, op: ReduceOp) -> None:
        """``self[c] = self[c] (op) other``; ``other`` is already on this device."""
        current = self.chunk(c)
        self._chunks[c] = combine(self.backend, op, current, other, self._chunks[c])
        self._written[c] = True

    def assign(self, c: int, other: Array) -> None:
        """``self[c] = other``; ``other`` is already on this device."""
        if self.backend.mutable:
            self._chunks[c] = self.backend.copy(other, self._chunks[c])
        else:
            self._chunks[c] = other
        self._written[c] = True

    def own(self, c: int) -> Array:
        """Chunk ``c`` as this buffer's own memory (copied from the input if never written),
        so that writing into it in place never touches the caller's input."""
        if not self._written[c]:
            self.assign(c, self.chunk(c))
        return self.chunk(c)

    def result(self) -> Array:
        """The whole flat buffer; chunks never written are filled from the input."""
        for c in range(len(self.layout)):
            if not self._written[c]:
                self.assign(c, self.chunk(c))
        if self._out is not None:
            return self._out
        return self.backend.concat([self.chunk(c) for c in range(len(self.layout))])
