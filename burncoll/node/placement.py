"""Placement: where a large DATA message from a member is received, chosen from its header.

The transport asks (``FastPath.place_with``) as soon as a message's first bytes are in:
its payload may be received straight into the place its receiver offered for it
(:meth:`~burncoll.node.mailbox.Mailbox.offer_place`), with no copy. Only a part in the sender's own
name, of this session, whose header and payload make up exactly the message, may be placed:
a member cannot start writing another node's part into its receiver's memory (and then
trickle it past the operation's end). The header is checked in full once the message is whole.
"""

from __future__ import annotations

import functools

from burncoll.node.mailbox import Mailbox
from burncoll.protocol.wire import peek_part
from burncoll.transport.base import Placer

__all__ = ["place", "placer_for"]


def place(mailbox: Mailbox, session: int | None, node: int, first: memoryview, size: int
          ) -> tuple[int, memoryview] | None:
    """Where the message of ``size`` bytes from ``node`` starting with ``first`` goes:
    ``(header length, memory)``, or ``None`` to receive it into a buffer of its own."""
    peek = peek_part(first)
    if peek is None or peek.session != session or peek.key[3] != node or (
            peek.header_len + peek.payload_len != size):
        return None
    memory = mailbox.take_place(peek.key, peek.offset, peek.payload_len)
    return None if memory is None else (peek.header_len, memory)


def placer_for(mailbox: Mailbox, session: int | None, node: int) -> Placer:
    """The placer of the connection that ``node``'s array data arrives on."""
    return functools.partial(place, mailbox, session, node)
