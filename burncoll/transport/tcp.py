"""Plain TCP transport: length-prefixed messages on the zero-copy stream core.

Wire: the client opens with an 8-byte preamble (:data:`PREAMBLE`); after it, each message is
an 8-byte little-endian length (:data:`~burncoll.protocol.wire.LENGTH_PREFIX_BYTES`) followed by
that many bytes, in both directions. Authentication (:mod:`burncoll.transport.auth`) runs above
it, as on every transport. No TLS: choose ``websocket`` with TLS settings (wss) to encrypt.

Receiving, sending and the pre-authentication limits are the stream core's
(:mod:`burncoll.transport.stream`); a listener drops a client whose first bytes are not the
preamble, or that sends none within ``connect_timeout``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from burncoll.errors import ProtocolError, TransportError
from burncoll.protocol.wire import DEFAULT_MAX_MESSAGE_BYTES, LENGTH_PREFIX_BYTES
from burncoll.transport.admission import Admission, stranger_log
from burncoll.transport.base import Handler, Transport, format_address
from burncoll.transport.listening import StreamListener, listen_stream
from burncoll.transport.stream import JOIN_BYTES, StreamProtocol
from burncoll.transport.stream_connection import StreamConnection

__all__ = ["PREAMBLE", "TcpProtocol", "TcpTransport"]

#: The first bytes a TCP client sends: a listener drops a connection that opens otherwise.
PREAMBLE = b"BCTCP\x00\x01\n"


class TcpProtocol(StreamProtocol):
    """Length-prefixed messages after a preamble from the client."""

    def __init__(self, max_message_bytes: int, server: bool,
                 on_open: Callable[[TcpProtocol], None] | None = None,
                 preamble_timeout: float = 10.0, admission: Admission | None = None) -> None:
        super().__init__(max_message_bytes, admission=admission,
                         binding=b"" if server else None)
        self._await_preamble = server
        self._on_open = on_open
        self._preamble_timeout = preamble_timeout
        self._timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        if self.error is not None:  # refused
            return
        if not self._await_preamble:
            self.write_bytes(PREAMBLE)
        else:  # a stranger that says nothing is dropped, not held forever
            self._timer = asyncio.get_running_loop().call_later(
                self._preamble_timeout, self._silent)

    def _silent(self) -> None:
        self._timer = None
        if self._await_preamble and self.transport is not None:
            stranger_log.warning("silent", f"dropped a connection from {self.remote}: no "
                                 f"preamble within {self._preamble_timeout:g} s")
            self.protocol_error(ProtocolError(
                f"{self.remote} sent no preamble within {self._preamble_timeout:g} s"))

    def connection_lost(self, exc: Exception | None) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._on_open = None
        super().connection_lost(exc)

    def parse(self, view: memoryview) -> int:
        if self._await_preamble:
            return self._parse_preamble(view)
        if len(view) < LENGTH_PREFIX_BYTES:
            return 0
        size = int.from_bytes(view[:LENGTH_PREFIX_BYTES], "little")
        if self.over_budget(LENGTH_PREFIX_BYTES + size, len(view)):
            raise self.preauth_error()
        if size > self.max_message_bytes:
            raise ProtocolError(
                f"message from {self.remote} exceeds the size limit ({size} bytes announced, "
                f"limit {self.max_message_bytes})"
            )
        body = view[LENGTH_PREFIX_BYTES:]
        if len(body) >= size:
            self.deliver(bytes(body[:size]))
            return LENGTH_PREFIX_BYTES + size
        if size <= JOIN_BYTES:
            return 0  # a small message: wait until it is all in the scratch buffer
        self.expect_payload(size, body, self.deliver)
        return len(view)

    def _parse_preamble(self, view: memoryview) -> int:
        if len(view) < len(PREAMBLE):
            if bytes(view) != PREAMBLE[:len(view)]:
                raise ProtocolError(f"stream opened with {bytes(view)!r}: not a burncoll peer")
            return 0
        if bytes(view[:len(PREAMBLE)]) != PREAMBLE:
            raise ProtocolError(
                f"stream opened with {bytes(view[:len(PREAMBLE)])!r}: not a burncoll peer")
        self._await_preamble = False
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._on_open is not None:
            self._on_open(self)
        return len(PREAMBLE)

    def frame_header(self, size: int) -> bytes:
        return size.to_bytes(LENGTH_PREFIX_BYTES, "little")


class TcpTransport(Transport):
    """Length-prefixed messages on plain TCP (no TLS); see the module docstring.

    Args:
        max_message_bytes: the largest message this side accepts (once authenticated).
        connect_timeout: seconds for the TCP connect.
        close_timeout: seconds ``close`` waits for the written bytes to leave.
        admission: makes each listener's :class:`Admission` (its caps and pre-authentication
            deadline); the defaults when ``None``.
    """

    name = "tcp"

    def __init__(self, *, max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
                 connect_timeout: float = 10.0, close_timeout: float = 2.0,
                 admission: Callable[[], Admission] | None = None) -> None:
        self.max_message_bytes = max_message_bytes
        self.connect_timeout = connect_timeout
        self.close_timeout = close_timeout
        self.admission = admission or Admission

    async def listen(self, host: str, port: int, handler: Handler) -> StreamListener:
        listener = StreamListener(host, port, handler, self.admission())
        close_timeout, max_message_bytes = self.close_timeout, self.max_message_bytes
        preamble_timeout, admission = self.connect_timeout, listener.admission

        def opened(protocol: TcpProtocol) -> None:
            listener.start(StreamConnection(protocol, close_timeout))

        def factory() -> TcpProtocol:
            return TcpProtocol(max_message_bytes, server=True, on_open=opened,
                               preamble_timeout=preamble_timeout, admission=admission)

        await listen_stream(host, port, factory, listener)
        return listener

    async def connect(self, host: str, port: int) -> StreamConnection:
        netloc = format_address((host, port))
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self.connect_timeout):
                _, protocol = await loop.create_connection(
                    lambda: TcpProtocol(self.max_message_bytes, server=False), host, port)
        except (OSError, TimeoutError) as exc:
            raise TransportError(f"cannot connect to {netloc} over tcp: {exc}") from exc
        return StreamConnection(protocol, self.close_timeout)
