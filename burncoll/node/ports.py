"""What the global executor and the exchange use of this node's connections, and nothing more.

The data service does far more (dialing, membership, control messages); the code that walks a
schedule only needs to name nodes, send a frame, wait for a frame, offer memory for a part to
be received into, and fail the session. Declaring just that keeps the executor testable over
an in-memory double and independent of how the service is put together.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

from burncoll.node.mailbox import FrameKey
from burncoll.node.places import Place
from burncoll.protocol.wire import Frame
from burncoll.transport.base import Buffer

__all__ = ["FrameSource", "Member", "Ports"]


class Member(Protocol):
    """One node of the session, as errors name it."""

    @property
    def index(self) -> int: ...

    def describe(self) -> str: ...


class FrameSource(Protocol):
    """Where received DATA frames wait (:class:`~burncoll.node.mailbox.Mailbox`)."""

    def offer_place(self, key: FrameKey, offset: int, place: Place) -> None:
        """The part ``(key, offset)`` may be received straight into ``place``."""

    def withdraw_place(self, key: FrameKey, offset: int) -> None:
        """Withdraw the memory offered for ``(key, offset)`` if it was not used."""

    async def get(self, key: FrameKey, deadline: float,
                  on_timeout: Callable[[], BaseException]) -> Frame:
        """The next frame for ``key``; raises the session's failure, or ``on_timeout()``."""


class Ports(Protocol):
    """This node's connections to the other nodes of the session."""

    @property
    def node_index(self) -> int: ...

    @property
    def nodes(self) -> Sequence[Member]: ...

    @property
    def session(self) -> int | None: ...

    @property
    def timeout(self) -> float: ...

    @property
    def mailbox(self) -> FrameSource: ...

    async def send(self, node: int, parts: Sequence[Buffer]) -> None:
        """Send one frame to ``node``; a broken connection fails the session."""

    def fail(self, error: BaseException) -> None:
        """End the session on every node with ``error``."""
