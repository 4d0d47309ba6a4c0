"""Which buffers each step of a node's walk reads and writes, and which chunks end holding
a compressed all-reduce's 16-bit values (no I/O; used by :class:`~burncoll.node.walk.Walk`)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from burncoll.levels import HostArray
from burncoll.strategies import Action, Step

__all__ = ["copy_unwritten", "step_buffers", "wire_settled"]

#: The chunk lists one step reads and writes (a send only reads).
_Buffers = tuple[Sequence[HostArray | None], list[HostArray | None]]


def step_buffers(steps: list[tuple[int, Step]], me: int, chunks: list[HostArray | None],
                  out: list[HostArray | None] | None) -> list[_Buffers]:
    """Which chunk list each of ``steps`` (in walk order) reads and writes.

    In place, both are ``chunks``. Out of place, chunk ``c`` lives in ``chunks`` (the caller's
    input, never written) until this node's first step that writes it, and in ``out`` from
    that step on: that step combines ``chunks[c]`` with what it receives into ``out[c]``, and
    every later step reads and writes ``out[c]``. This is decided here, once, from the order
    of the steps on ``c`` -- the order :class:`Pipeline` enforces part by part -- never from
    progress at run time: a pipelined send of ``c`` starts while the receive before it is still
    writing ``c``, and must read ``out`` from its first part on (it waits for each part there).
    """
    if out is None:
        return [(chunks, chunks)] * len(steps)
    written: set[int] = set()
    buffers: list[_Buffers] = []
    for _, s in steps:
        read = out if s.chunk in written else chunks
        buffers.append((read, out))
        if s.src != me:
            written.add(s.chunk)
    return buffers


def copy_unwritten(steps: list[tuple[int, Step]], me: int, chunks: list[HostArray | None],
                    out: list[HostArray | None]) -> None:
    """Out of place: the chunks no step of this node wrote still hold their value in
    ``chunks`` only (a node that just sends them, or a world of one node)."""
    written = {s.chunk for _, s in steps if s.src != me}
    for c, (src, dst) in enumerate(zip(chunks, out, strict=True)):
        if c not in written and src is not None and dst is not None:
            np.copyto(dst, src)


def wire_settled(steps: list[tuple[int, Step]], me: int, out_of_place: bool
                  ) -> tuple[set[int], set[int]]:
    """A compressed walk's sends that write the 16-bit values they send back into their chunk
    (indices into ``steps``), and the chunks the walk leaves holding 16-bit values.

    Every node must end with the bits it sent and no more (all nodes then hold identical
    results). A chunk already does when the last step writing it copies received (widened)
    values; the node's own final value of a chunk is kept as it is sent -- by the first send
    after the chunk's last receive (any send, when it receives none) -- part by part, while the
    network is busy, instead of in a pass over the whole result at the end. Out of place, a
    chunk this node never receives is the caller's input, never written: :meth:`Walk.finish`
    rounds its copy, as it does every chunk not settled here (a reduce's root, say)."""
    last_receive = {s.chunk: i for i, (_, s) in enumerate(steps) if s.src != me}
    write_back: set[int] = set()
    settled: set[int] = set()
    for i, (_, s) in enumerate(steps):
        last = last_receive.get(s.chunk)
        if s.chunk in settled:
            continue
        if s.src != me:
            if i == last and s.action is Action.COPY:
                settled.add(s.chunk)
        elif (last is None and not out_of_place) or (last is not None and i > last):
            write_back.add(i)
            settled.add(s.chunk)
    return write_back, settled
