"""Reading a member connection: what arrives from another member, and what it means.

DATA frames go to the :class:`~burncoll.node.mailbox.Mailbox` -- only the sender's own parts,
of this session, on the connection this node dialed (the only one array data comes on).
Point-to-point messages (op kind P2P) go to the :class:`~burncoll.node.inbox.Inbox` instead.
A reader that stored a frame of an operation not started here, or a message no recv took yet,
past the data service's held budget stops reading (:mod:`burncoll.node.held`: backpressure,
not hoarding).
CONTROL frames carry :class:`~burncoll.protocol.members.Abort` (another node failed),
:class:`~burncoll.protocol.members.Bye` (a node leaving cleanly), status queries and
:class:`~burncoll.protocol.members.P2PAck` (a message this node sent was received).

A connection that breaks without ``bye``, or that sends bytes that are not a valid frame, fails
the session with :class:`~burncoll.PeerLost` / :class:`~burncoll.ProtocolError`.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Protocol

from burncoll.errors import PeerLost, ProtocolError, TransportError
from burncoll.node.inbox import Inbox
from burncoll.node.mailbox import Mailbox
from burncoll.node.membership import Membership, error_from_abort
from burncoll.node.p2p_outbox import Outbox
from burncoll.ops import OpKind
from burncoll.protocol.members import Abort, Bye, P2PAck, Status, StatusQuery, decode_member
from burncoll.protocol.wire import Frame, FrameType, decode
from burncoll.transport.base import Connection

__all__ = ["MemberReader", "ReaderService"]

log = logging.getLogger("burncoll.node")

_CORRUPTED = "the connection between members is corrupted"


class ReaderService(Protocol):
    """What a reader needs of its data service."""

    @property
    def membership(self) -> Membership: ...
    @property
    def mailbox(self) -> Mailbox: ...
    @property
    def inbox(self) -> Inbox: ...
    @property
    def outbox(self) -> Outbox: ...

    def fail(self, error: BaseException, tell: bool = True) -> None: ...
    def fail_remote(self, error: BaseException, done_before: int | None) -> None: ...
    async def await_explanation(self) -> None: ...
    async def reply_status(self, node: int) -> None: ...
    def took_status(self, status: Status, node: int) -> None: ...


class MemberReader:
    """Reads the member connections of one data service until they end."""

    def __init__(self, service: ReaderService) -> None:
        self.service = service
        #: The service is closing: a connection's end is no failure.
        self.closing = False
        #: Members that said ``bye``: their connections' ends are no failure.
        self.leaving: set[int] = set()

    def _describe(self, node: int) -> str:
        return self.service.membership.describe(node)

    async def read(self, conn: Connection, node: int, data: bool) -> None:
        """Read a member connection until it ends; its end or corruption fails the session.

        ``data``: the connection this node dialed, the only one ``node`` sends array data on
        (on the other, this node sends, and ``node`` only says what happens to it)."""
        try:
            await self._receive(conn, node, data)
        except ProtocolError as exc:
            if not self.closing:
                # the other end sent bytes that break the transport's framing, or refused
                # ours (a message over its limit): either way the connection is unusable
                self._corrupted(ProtocolError(
                    f"{exc} (the connection with {self._describe(node)}); {_CORRUPTED}"))
        except TransportError as exc:
            if self.closing or node in self.leaving:
                return
            await self.service.await_explanation()
            self._lost(node, exc)
        except Exception as exc:  # a check that did not expect these bytes: still the peer's
            if not self.closing:
                self._corrupted(ProtocolError(
                    f"{self._describe(node)} sent a frame this node cannot use "
                    f"({type(exc).__name__}: {exc}); {_CORRUPTED}"))

    def _corrupted(self, error: ProtocolError) -> None:
        log.warning("data service: %s", error)
        self.service.fail(error)

    async def _receive(self, conn: Connection, node: int, data: bool) -> None:
        # A frame that breaks the protocol fails the session, but the connection stays open
        # (its frames are ignored from then on, the mailbox being failed): closing it would
        # reach the sender as a dead connection -- a PeerLost blaming a live node -- possibly
        # before the abort that says what really happened.
        while True:
            message = await conn.recv()
            try:
                frame = decode(message)
                if frame.frame_type == FrameType.DATA:
                    await self._take_data(frame, node, data)
                    continue
                said = decode_member(frame)
            except ProtocolError as exc:
                self._corrupted(ProtocolError(
                    f"{self._describe(node)} sent a malformed frame ({exc}); {_CORRUPTED}"))
                continue
            if isinstance(said, Bye):
                self.leaving.add(node)
                return
            if isinstance(said, Abort):
                self.service.fail_remote(error_from_abort(
                    said, self.service.membership.nodes), said.done_before)
            elif isinstance(said, StatusQuery):
                await self.service.reply_status(node)
            elif isinstance(said, Status):
                self.service.took_status(said, node)
            elif isinstance(said, P2PAck):
                try:
                    self.service.outbox.took(said, node)
                except ProtocolError as exc:
                    self._corrupted(ProtocolError(f"{self._describe(node)} {exc}; {_CORRUPTED}"))

    async def _take_data(self, frame: Frame, node: int, data: bool) -> None:
        """A DATA frame from ``node``: into the mailbox, unless it may not come from there."""
        header = frame.header
        holder: Mailbox | Inbox = self.service.mailbox
        held = False
        try:
            if header is not None and header.session != self.service.membership.session:
                raise ProtocolError(f"sent a frame of another session ({header.session:#x})")
            if header is not None and header.src != node:
                raise ProtocolError(f"sent a frame in the name of node {header.src}")
            if not data:
                raise ProtocolError("sent array data on the connection this node sends on")
            if header is not None and header.op_kind is OpKind.P2P:
                holder = self.service.inbox  # point to point: never the mailbox
                held = self.service.inbox.put(frame.owned(), node)
            else:
                held = self.service.mailbox.put(frame)
        except ProtocolError as exc:
            self.service.fail(ProtocolError(
                f"{self._describe(node)} {exc}; {_CORRUPTED}, so the operation cannot be "
                "trusted"))
        if held and header is not None and holder.budget.crowded:
            # Backpressure: past the budget, read no further until this frame's operation
            # starts or its message is received (see burncoll.node.mailbox for why that comes).
            await holder.budget.drained(lambda: holder.holds(header))
        if frame.borrowed:
            # A lent part (shared memory) that its walk awaited wakes that walk: let it run
            # and offer the next part's place before the next message is read, so that part
            # too is combined where it lies instead of copied out.
            await asyncio.sleep(0)

    def _lost(self, node: int, exc: BaseException) -> None:
        if self.closing or node in self.leaving:
            return
        error = PeerLost(f"{self._describe(node)} disconnected ({exc})")
        log.warning("data service: %s", error)
        self.service.fail(error)
