"""The open connections of one node to the other members of its session.

Per other member, two: the one this node *sends* on (the member dialed it, this node accepted
it) and the one this node *receives* array data on (this node dialed it). Each connection has
one writer at a time: sends to a member go under its lock.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Mapping, Sequence

from burncoll.protocol.control import ControlMessage
from burncoll.transport.base import Buffer, Connection, FastPath, Placer, tell
from burncoll.transport.shm import RingReceiver, RingSender

__all__ = ["MemberConnections"]


class MemberConnections:
    """Connections by member index: :attr:`out` to send on, :attr:`dialed` to receive on."""

    def __init__(self) -> None:
        #: Connections this node sends on, by destination (each dialed by its destination).
        self.out: dict[int, Connection] = {}
        #: Connections this node dialed, to receive from each other node.
        self.dialed: dict[int, Connection] = {}
        self._locks: dict[int, asyncio.Lock] = {}
        #: Set once every other member has dialed this node (see :meth:`expect`).
        self.all_out = asyncio.Event()
        self._expected = -1

    def expect(self, others: int) -> None:
        """``others`` members will dial this node: :attr:`all_out` is set when they have."""
        self._expected = others
        self._check_all_out()

    def _check_all_out(self) -> None:
        if len(self.out) == self._expected:
            self.all_out.set()

    def add_out(self, node: int, conn: Connection) -> bool:
        """``node``'s connection to send on; ``False`` when it already has one."""
        if node in self.out:
            return False
        self.out[node] = conn
        self._locks[node] = asyncio.Lock()
        self._check_all_out()
        return True

    def add_dialed(self, node: int, conn: Connection, placer: Placer) -> None:
        """The connection ``node`` sends array data on; where it can, its large payloads are
        received where ``placer`` says."""
        self.dialed[node] = conn
        if isinstance(conn, FastPath):
            conn.place_with(placer)

    async def send(self, node: int, parts: Sequence[Buffer]) -> None:
        """Send one message to ``node`` (``KeyError`` without a connection to it)."""
        conn = self.out[node]
        async with self._locks[node]:
            await conn.send(parts)

    async def tell(self, nodes: Iterable[int], message: ControlMessage, session: int,
                   timeout: float) -> None:
        """Best effort: send ``message`` to each of ``nodes`` it has a connection to,
        concurrently, each bounded by ``timeout``."""
        await asyncio.gather(*(
            tell(self.out[n], message, timeout, session=session, lock=self._locks[n])
            for n in nodes if n in self.out))

    def stop_placing(self) -> None:
        """Write nothing more into memory a placer chose (a failed operation's memory is its
        caller's again)."""
        for conn in (*self.out.values(), *self.dialed.values()):
            if isinstance(conn, FastPath):
                conn.stop_placing()

    def read_regions(self, regions: Mapping[int, memoryview]) -> set[int]:
        """(At join, from the registering thread: before any sender writes them.) The stream
        region each same-host connection this node receives on reads, by sender (none for
        the others); the senders whose connection took its region."""
        receivers = {n: c for n, c in self.dialed.items() if isinstance(c, RingReceiver)}
        for node, conn in receivers.items():
            conn.attach(regions.get(node))
        return set(regions) & set(receivers)

    def write_regions(self, regions: Mapping[int, memoryview]) -> None:
        """(At join, once every receiver reads its region.) The stream region each
        same-host connection this node sends on writes, by destination."""
        for node, region in regions.items():
            conn = self.out.get(node)
            if isinstance(conn, RingSender):
                conn.attach(region)

    def abandon_sends(self, error: BaseException) -> None:
        """The session failed: a send waiting for room in a stream region fails now, freeing
        its member's lock for the abort."""
        for conn in self.out.values():
            if isinstance(conn, RingSender):
                conn.abandon(error)

    async def close(self) -> None:
        """Close every connection, concurrently: a close waits for the other end to
        acknowledge (bounded by the transport), and the other end may be gone."""
        conns = [*self.out.values(), *self.dialed.values()]
        await asyncio.gather(*(c.close() for c in conns), return_exceptions=True)
