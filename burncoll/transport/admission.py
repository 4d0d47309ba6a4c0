"""Listener admission: caps on connections a stranger can hold open before it authenticates.

Every listener asks its :class:`Admission` (``admit``) before it spends anything on a new
connection, and tells the :class:`Ticket` when the connection authenticates and when it closes.
``max_connections`` (pending and authenticated) refuses a new connection. ``max_pending`` and
``max_pending_per_source`` (a source: an IPv4 address or an IPv6 /64, :func:`source_group`)
evict the oldest pending connection of the source holding the most, so strangers churning from
many addresses evict one another, not a legitimate node (which authenticates within
milliseconds, and retries if evicted). ``preauth_seconds`` drops a connection still pending.
Every refusal and drop is logged through a :class:`BoundedLog`. A released ticket forgets its
``drop`` callback, so nothing here keeps a connection alive. One event loop; not thread-safe.
"""

from __future__ import annotations

import asyncio
import ipaddress
import itertools
import logging
import time
from collections import OrderedDict
from collections.abc import Callable

from burncoll.transport.base import PREAUTH_SECONDS

__all__ = ["Admission", "BoundedLog", "Ticket", "source_group", "stranger_log"]

logger = logging.getLogger("burncoll.transport")

#: Seconds of one logging window, and the most WARNING lines of one kind of event in one
#: window: a few strangers are each named, a flood costs at most this many lines a second.
LOG_INTERVAL = 1.0
LOG_BURST = 10


#: Prefix length by which IPv6 sources are grouped.
IPV6_SOURCE_PREFIX = 64


def source_group(host: str) -> str:
    """The source a connection from ``host`` counts against: an IPv4 address as it is (an
    IPv4-mapped IPv6 address as its IPv4 address), an IPv6 address as its /64 network
    (``"2001:db8:1:2::/64"``), anything else (a name, ``"?"``) as it is."""
    try:
        address = ipaddress.ip_address(host.split("%", 1)[0])  # without an IPv6 zone
    except ValueError:
        return host
    if isinstance(address, ipaddress.IPv6Address):
        if address.ipv4_mapped is not None:
            return str(address.ipv4_mapped)
        network = ipaddress.IPv6Network((address, IPV6_SOURCE_PREFIX), strict=False)
        return str(network)
    return str(address)


class BoundedLog:
    """WARNING lines on ``log`` (the ``burncoll.transport`` logger by default), at most
    :data:`LOG_BURST` per :data:`LOG_INTERVAL` seconds per ``kind``; the next line that goes
    out says how many were suppressed meanwhile. For events a stranger can cause at will."""

    def __init__(self, log: logging.Logger | None = None) -> None:
        self._logger = log if log is not None else logger
        self._window: dict[str, tuple[float, int]] = {}  # kind -> (window start, lines in it)
        self._suppressed: dict[str, int] = {}

    def warning(self, kind: str, message: str) -> None:
        """Log ``message`` unless :data:`LOG_BURST` lines of this ``kind`` went out in the
        current window; then count it."""
        now = time.monotonic()
        start, lines = self._window.get(kind, (now, 0))
        if now - start >= LOG_INTERVAL:
            start, lines = now, 0
        if lines >= LOG_BURST:
            self._suppressed[kind] = self._suppressed.get(kind, 0) + 1
            self._window[kind] = (start, lines)
            return
        self._window[kind] = (start, lines + 1)
        more = self._suppressed.pop(kind, 0)
        suffix = f" (and {more} more like it, not logged)" if more else ""
        self._logger.warning("%s%s", message, suffix)


#: The stream transports' WARNING lines about strangers (bad handshakes, silence), bounded: a
#: flood cannot fill the log.
stranger_log = BoundedLog()


class Ticket:
    """One admitted connection's place in its :class:`Admission`."""

    __slots__ = ("_admission", "_drop", "_timer", "group", "pending", "released", "serial",
                 "source")

    def __init__(self, admission: Admission, source: str, drop: Callable[[str], None],
                 serial: int) -> None:
        #: The source host the connection came from, as given to :meth:`Admission.admit`.
        self.source = source
        #: What the per-source cap counts it against (:func:`source_group`).
        self.group = source_group(source)
        #: Admission order: a smaller serial is older.
        self.serial = serial
        #: Not yet authenticated (counts against the pending caps and has a deadline).
        self.pending = True
        #: Released: counts against nothing any more.
        self.released = False
        self._admission: Admission | None = admission
        self._drop: Callable[[str], None] | None = drop
        self._timer: asyncio.TimerHandle | None = None

    def authenticated(self) -> None:
        """The connection authenticated: it leaves the pending set (and its deadline) but
        still counts against ``max_connections`` until :meth:`release`. Idempotent."""
        if not self.pending or self.released:
            return
        self.pending = False
        self._cancel_timer()
        if self._admission is not None:
            self._admission._unpend(self)
        self._drop = None  # an authenticated connection is never evicted

    def release(self) -> None:
        """The connection closed: free its place. Idempotent; call it from every close path."""
        if self.released:
            return
        admission = self._admission
        self._cancel_timer()
        if self.pending and admission is not None:
            admission._unpend(self)
        self.pending = False
        self.released = True
        self._drop = None
        self._admission = None
        if admission is not None:
            admission._count -= 1

    def _expire(self) -> None:
        """Still pending at the deadline: drop the connection."""
        self._timer = None
        admission = self._admission
        if not self.pending or admission is None:
            return
        admission._log.warning(
            "deadline", f"{admission.name}: dropped a connection from {self.source}: not "
            f"authenticated within {admission.preauth_seconds:g} s")
        self._evict(f"not authenticated within {admission.preauth_seconds:g} s")

    def _evict(self, reason: str) -> None:
        drop = self._drop
        self.release()
        if drop is not None:
            drop(reason)

    def _cancel_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()  # clears the handle's reference to this ticket
            self._timer = None


class Admission:
    """Caps on one listener's connections; see the module docstring.

    Args:
        max_pending: most connections not yet authenticated, from all sources together.
        max_pending_per_source: most connections not yet authenticated from one source host.
        max_connections: most connections admitted and not released (pending or not).
        preauth_seconds: a connection still pending this long after ``admit`` is dropped.
        name: how log lines name the listener (``"listener 0.0.0.0:7000"``).

    Raises :class:`ValueError` for a non-positive limit (a programming error, not a peer's).
    """

    def __init__(self, max_pending: int = 64, max_pending_per_source: int = 16,
                 max_connections: int = 1024, preauth_seconds: float = PREAUTH_SECONDS,
                 *, name: str = "listener") -> None:
        for label, value in (("max_pending", max_pending),
                             ("max_pending_per_source", max_pending_per_source),
                             ("max_connections", max_connections),
                             ("preauth_seconds", preauth_seconds)):
            if value <= 0:
                raise ValueError(f"{label} must be positive, not {value}")
        self.max_pending = max_pending
        self.max_pending_per_source = max_pending_per_source
        self.max_connections = max_connections
        self.preauth_seconds = preauth_seconds
        self.name = name
        self._pending: OrderedDict[Ticket, None] = OrderedDict()  # oldest first
        self._by_source: dict[str, OrderedDict[Ticket, None]] = {}  # by group, oldest first
        self._serials = itertools.count()
        self._count = 0
        self._closed = False
        self._log = BoundedLog()

    @property
    def pending(self) -> int:
        """Connections admitted and not yet authenticated."""
        return len(self._pending)

    @property
    def connections(self) -> int:
        """Connections admitted and not released (pending ones included)."""
        return self._count

    def admit(self, source: str, drop: Callable[[str], None]) -> Ticket | None:
        """Admit a new connection from ``source`` (its host address, without the port).

        Returns its :class:`Ticket`, or ``None`` to refuse it (``max_connections`` reached, or
        closed). Makes room under the pending caps first by evicting (see the module docstring).
        ``drop(reason)`` must close the connection at once; it is called at most once (eviction
        or the deadline), never after the ticket is authenticated or released. On the event loop.
        """
        if self._closed:
            return None
        if self._count >= self.max_connections:
            self._log.warning(
                "full", f"{self.name}: refused a connection from {source}: "
                f"{self.max_connections} connections open (max_connections)")
            return None
        ticket = Ticket(self, source, drop, next(self._serials))
        same = self._by_source.get(ticket.group)
        if same is not None and len(same) >= self.max_pending_per_source:
            self._evict_oldest(same, f"{self.max_pending_per_source} connections from "
                               f"{ticket.group} are waiting to authenticate "
                               "(max_pending_per_source)")
        if len(self._pending) >= self.max_pending:
            crowded = self._most_pending()
            self._evict_oldest(crowded, f"{self.max_pending} connections are waiting to "
                               f"authenticate (max_pending), {len(crowded)} of them from "
                               "this source, more than from any other")
        self._pending[ticket] = None
        self._by_source.setdefault(ticket.group, OrderedDict())[ticket] = None
        self._count += 1
        ticket._timer = asyncio.get_running_loop().call_later(
            self.preauth_seconds, ticket._expire)
        return ticket

    def close(self, reason: str = "the listener is closing") -> None:
        """Refuse every later connection and drop the pending ones (authenticated ones are
        the listener's to close). Idempotent."""
        self._closed = True
        for ticket in list(self._pending):
            ticket._evict(reason)

    def _most_pending(self) -> OrderedDict[Ticket, None]:
        """The pending connections of the group holding the most (between equals, the one
        whose oldest is oldest). O(groups), and there are at most ``max_pending`` groups."""
        return max(self._by_source.values(),
                   key=lambda same: (len(same), -next(iter(same)).serial))

    def _evict_oldest(self, tickets: OrderedDict[Ticket, None], why: str) -> None:
        oldest = next(iter(tickets))
        self._log.warning("evict", f"{self.name}: dropped the oldest unauthenticated "
                          f"connection, from {oldest.source}: {why}")
        oldest._evict(f"evicted: {why}")

    def _unpend(self, ticket: Ticket) -> None:
        self._pending.pop(ticket, None)
        same = self._by_source.get(ticket.group)
        if same is not None:
            same.pop(ticket, None)
            if not same:
                del self._by_source[ticket.group]
