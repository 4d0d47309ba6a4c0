"""A node's side of the orchestrator protocol (see :mod:`burncoll.orchestration.orchestrator`)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

from burncoll.errors import (
    AuthenticationError,
    CollectiveError,
    CollectiveTimeout,
    ConfigError,
    ProtocolError,
    TransportError,
    error_named,
)
from burncoll.node.membership import NodeInfo
from burncoll.protocol.control import (
    Abandon,
    Abandoned,
    Finish,
    Finished,
    Join,
    Leave,
    NodeLost,
    Notice,
    Refused,
    Table,
    decode_from_orchestrator,
    encode,
    kind_of,
)
from burncoll.protocol.fields import MalformedMessage
from burncoll.protocol.wire import decode
from burncoll.transport.auth import authenticate_client
from burncoll.transport.base import Connection, Transport, tell

__all__ = ["OrchestratorClient"]

#: Longest notice text kept from the orchestrator (it is only shown in an error message).
_NOTICE_LIMIT = 2000
#: Seconds a node that failed before it joined spends telling the orchestrator (best effort).
ABANDON_SECONDS = 2.0


class OrchestratorClient:
    """The node's connection to the orchestrator, kept open after the rendezvous."""

    def __init__(self, transport: Transport, host: str, port: int, token: str | None,
                 timeout: float, *, integrity: bool = False) -> None:
        self.transport = transport
        self.host = host
        self.port = port
        self.token = token
        self.timeout = timeout
        #: Per-message integrity tags on the connection (the config's ``integrity``).
        self.integrity = integrity
        self.conn: Connection | None = None
        self.session = 0
        self.index = -1
        self.nodes: tuple[NodeInfo, ...] = ()
        #: The session's secret (64 hex digits, 32 random bytes), sent by the orchestrator
        #: to the session's members only; ``None`` before the table.
        self.secret: str | None = None
        #: The orchestrator's last notice while this node waited (other nodes waiting with
        #: a config that differs), shown if registration times out.
        self.notice: str | None = None
        self.gone: BaseException | None = None
        self._finished = asyncio.Event()
        #: The orchestrator said ``finished`` (its connection may close right after).
        self._confirmed = False
        self._reader: asyncio.Task[None] | None = None
        #: Called with a node index when the orchestrator reports it lost.
        self.on_node_lost: Callable[[int], None] = lambda node: None

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    async def join(self, message: Join, deadline: float) -> None:
        """Register with the orchestrator and wait for the node table (until ``deadline``).

        A not-yet-listening orchestrator is retried with backoff. Raises
        :class:`~burncoll.ConfigError` when the orchestrator refuses this node,
        :class:`~burncoll.CollectiveTimeout` (naming any config differences the orchestrator
        noticed) when the other nodes do not come, :class:`~burncoll.ProtocolError` for a
        reply that is not a valid table.
        """
        conn = await self._connect(deadline)
        self.conn = conn
        await conn.send([encode(message)])
        reply = await self._await_table(conn, message, deadline)
        if isinstance(reply, Refused):
            raise ConfigError(f"the orchestrator refused this node: {reply.reason}")
        if isinstance(reply, Abandoned):
            raise error_named(reply.error)(reply.reason)
        self._take_table(reply)
        self._reader = asyncio.get_running_loop().create_task(self._read())

    async def abandon(self, message: Abandon, deadline: float) -> None:
        """Best effort: tell the orchestrator this node failed before it could join, so the
        nodes waiting for it fail at once with its error (nothing raised: the node's own error
        is what matters to its caller)."""
        try:
            async with asyncio.timeout(max(deadline - time.monotonic(), 0.01)):
                conn = await self._connect(deadline)
                try:
                    await conn.send([encode(message)])
                finally:
                    await conn.close()
        except (CollectiveError, TimeoutError, OSError):
            pass

    async def _await_table(self, conn: Connection, message: Join, deadline: float
                           ) -> Table | Refused | Abandoned:
        """The orchestrator's verdict (table or refusal), keeping the notices before it."""
        try:
            async with asyncio.timeout(max(deadline - time.monotonic(), 0.0)):
                while True:
                    reply = await self._next_reply(conn)
                    if isinstance(reply, Table | Refused | Abandoned):
                        return reply
                    self.notice = reply.reason[:_NOTICE_LIMIT]
        except TimeoutError:
            noticed = f"; the orchestrator noticed: {self.notice}" if self.notice else ""
            raise CollectiveTimeout(
                f"register timed out after {self.timeout:g} s waiting at the orchestrator "
                f"{self.address} for all {message.fingerprint.get('num_nodes')} nodes "
                f"to join; start every node (or check num_nodes){noticed}"
            ) from None
        except TransportError as exc:
            raise TransportError(
                f"the orchestrator at {self.address} closed the connection during "
                f"registration: {exc}"
            ) from exc

    async def _next_reply(self, conn: Connection) -> Table | Refused | Abandoned | Notice:
        """The orchestrator's next message during registration; :class:`ProtocolError` for
        one that has no place there, or a malformed one."""
        frame = decode(await conn.recv())
        try:
            reply = decode_from_orchestrator(frame)
        except MalformedMessage as exc:
            raise ProtocolError(f"the orchestrator at {self.address} sent a {exc}") from None
        if not isinstance(reply, Table | Refused | Abandoned | Notice):
            raise ProtocolError(f"unexpected reply from the orchestrator: {kind_of(frame)}")
        return reply

    def _take_table(self, table: Table) -> None:
        """Store the session, this node's index, the node table and the session secret."""
        if table.secret is None and self.token is None:
            raise ProtocolError(
                f"the orchestrator at {self.address} sent a malformed node table: no session "
                "secret, and without a token the connections between nodes would have no key")
        self.session = table.session
        self.index = table.index
        self.nodes = tuple(
            NodeInfo(n.index, n.host, n.port, n.peer_ids, n.meta.get("sharded") is True,
                     _host_id(n.meta.get("host")), n.meta.get("lanes") is True)
            for n in table.nodes
        )
        self.secret = table.secret

    async def _connect(self, deadline: float) -> Connection:
        delay = 0.05
        last: BaseException | None = None
        while time.monotonic() < deadline:
            try:
                async with asyncio.timeout(max(deadline - time.monotonic(), 0.01)):
                    conn = await self.transport.connect(self.host, self.port)
                    try:
                        return await authenticate_client(conn, self.token, self.timeout,
                                                         integrity=self.integrity)
                    except BaseException:
                        await conn.close()
                        raise
            except AuthenticationError:
                raise
            except (TransportError, TimeoutError, OSError) as exc:
                last = exc
                await asyncio.sleep(min(delay, max(deadline - time.monotonic(), 0.0)))
                delay = min(delay * 2, 1.0)
        flag = "" if self.transport.name == "websocket" else f" --transport {self.transport.name}"
        raise TransportError(
            f"could not reach the orchestrator at {self.address} within {self.timeout:g} s "
            f"({last or 'no answer'}); start it with `burncoll orchestrator --port "
            f"{self.port}{flag}` or check global_address"
        )

    async def _read(self) -> None:
        conn = self.conn
        if conn is None:  # pragma: no cover
            return
        try:
            while True:
                message = decode_from_orchestrator(decode(await conn.recv()))
                if isinstance(message, Finished):
                    self._confirmed = True
                    self._finished.set()
                elif isinstance(message, NodeLost):
                    if message.node >= len(self.nodes):
                        raise ProtocolError(f"the orchestrator reported an unknown node "
                                            f"{message.node} lost")
                    self.on_node_lost(message.node)
        except (TransportError, ProtocolError) as exc:
            self.gone = exc
            self._finished.set()

    async def finish(self, deadline: float,
                     failure: Callable[[], Awaitable[BaseException]] | None = None) -> None:
        """Tell the orchestrator this node is done; wait until every node is, or until
        ``failure`` returns (the session failed meanwhile: another node's abort, a lost
        node), and raise what it returns.

        Raises :class:`~burncoll.TransportError` when the orchestrator is gone.
        """
        conn = self.conn
        if conn is None or self.gone is not None:
            raise TransportError(
                f"finish: the orchestrator at {self.address} is gone ({self.gone}); the other "
                "nodes may not have finished"
            )
        try:
            await conn.send([encode(Finish())])
            finished = asyncio.ensure_future(self._finished.wait())
            failed = asyncio.ensure_future(failure()) if failure is not None else None
            try:
                async with asyncio.timeout(max(deadline - time.monotonic(), 0.0)):
                    await asyncio.wait([finished] if failed is None else [finished, failed],
                                       return_when=asyncio.FIRST_COMPLETED)
            finally:
                finished.cancel()
                if failed is not None:
                    failed.cancel()
        except TransportError as exc:
            raise TransportError(f"finish: lost the orchestrator at {self.address}: {exc}") from exc
        except TimeoutError:
            raise CollectiveTimeout(
                f"finish timed out after {self.timeout:g} s: the orchestrator at {self.address} "
                "did not confirm that every node finished. Hint: a node has not called "
                "finish() yet, or the orchestrator is down"
            ) from None
        if failed is not None and failed.done() and not failed.cancelled() and not (
                finished.done() and not finished.cancelled()):
            raise failed.result()  # (as it is: not as a lost orchestrator)
        if not self._confirmed:  # woken by the connection's end, not by ``finished``
            raise TransportError(
                f"finish: the orchestrator at {self.address} went away ({self.gone}) before "
                "every node finished"
            )

    async def close(self) -> None:
        """Close the connection; before every node finished, say ``leave`` first.

        A node closes early when its collective failed (or registration did): ``leave`` tells
        the orchestrator not to report it lost, for it is alive and the other nodes already
        know why it failed. Without it, a node still waiting for its deadline would raise a
        PeerLost naming a node that did not die.
        """
        if self._reader is not None:
            self._reader.cancel()
        if self.conn is not None:
            if self.gone is None and not self._finished.is_set():
                await tell(self.conn, Leave(), 1.0)
            await self.conn.close()


def _host_id(value: object) -> str:
    """A node's announced host identity, if it looks like one (32 hex digits), else ``""``."""
    if isinstance(value, str) and len(value) == 32 and all(c in "0123456789abcdef" for c in value):
        return value
    return ""
