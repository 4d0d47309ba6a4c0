"""What every listener (TCP, WebSocket, QUIC) does with the connections it accepts.

:class:`ServingListener` runs the listener's handler on each accepted connection in a task of
its own, closes the connection when the handler returns (or fails: logged, never raised), and
ends them all when the listener closes: every connection is closed, each handler gets
:data:`HANDLER_GRACE` seconds to return, then is cancelled. A subclass binds the socket and
says how it shuts down (:meth:`ServingListener._shut_down`); admission of the connections
(:mod:`burncoll.transport.admission`) happens before they reach :meth:`ServingListener.serve`.
"""

from __future__ import annotations

import abc
import asyncio
import logging

from burncoll.errors import TransportError
from burncoll.transport.base import Connection, Handler, Listener

__all__ = ["HANDLER_GRACE", "ServingListener"]

logger = logging.getLogger("burncoll.transport")

#: How long ``Listener.close`` lets handlers finish before cancelling them.
HANDLER_GRACE = 1.0


class ServingListener(Listener):
    """A listener that serves ``handler`` on each connection it accepts (module docstring)."""

    def __init__(self, handler: Handler) -> None:
        self._handler = handler
        self._handler_tasks: set[asyncio.Task[None]] = set()
        self._connections: set[Connection] = set()
        self._closing: asyncio.Task[None] | None = None

    @property
    def closing(self) -> bool:
        """Whether :meth:`close` was called: nothing more is served."""
        return self._closing is not None

    def serve(self, conn: Connection) -> None:
        """Run the handler on ``conn`` in a task of its own (the caller checks
        :attr:`closing` first)."""
        self._connections.add(conn)
        task = asyncio.get_running_loop().create_task(self._serve(conn))
        self._handler_tasks.add(task)
        task.add_done_callback(self._handler_tasks.discard)

    async def _serve(self, conn: Connection) -> None:
        try:
            await self._handler(conn)
        except TransportError as exc:
            logger.debug("connection from %s ended: %s", conn.remote, exc)
        except asyncio.CancelledError:
            pass
        except Exception:
            logger.exception("handler for the connection from %s failed", conn.remote)
        finally:
            self._connections.discard(conn)
            await conn.close()

    async def close(self) -> None:
        if self._closing is None:
            self._closing = asyncio.get_running_loop().create_task(self._shut_down())
        await asyncio.shield(self._closing)

    @abc.abstractmethod
    async def _shut_down(self) -> None:
        """Stop accepting, drop the connections still being admitted, and end the served
        ones (:meth:`_end_handlers`), in the order this listener's sockets need."""

    async def _end_handlers(self) -> None:
        """Close every served connection and end its handler (see the module docstring)."""
        connections = list(self._connections)
        if connections:
            await asyncio.gather(*(c.close() for c in connections), return_exceptions=True)
        tasks = list(self._handler_tasks)
        if not tasks:
            return
        _, pending = await asyncio.wait(tasks, timeout=HANDLER_GRACE)
        for task in pending:
            task.cancel()
        if pending:
            _, stuck = await asyncio.wait(pending, timeout=HANDLER_GRACE)
            if stuck:
                logger.warning("listener %s:%s: a handler ignored cancellation",
                               self.host, self.port)
