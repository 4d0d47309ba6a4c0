"""Per-message integrity on connections without TLS (``integrity: true``).

After a successful challenge-response (:mod:`burncoll.transport.auth`) each direction of a
connection gets its own key::

    K_to_client = HMAC-SHA256(K, "burncoll-integrity-v1 to client" | Ns | Nc | B)
    K_to_server = HMAC-SHA256(K, "burncoll-integrity-v1 to server" | Ns | Nc | B)

(``K`` the token, ``Ns``/``Nc`` the two nonces of the exchange, ``B`` its channel binding),
and every message then travels as ``message | tag``, where ``tag`` is the HMAC-SHA256, under
the sending direction's key, of the message's number on this connection (0, 1, 2, ... as a
u64) followed by the message. The receiver recomputes it and compares in constant time before
it hands the message on. A relay that does not hold the token cannot compute a key, so it
cannot alter, forge, drop, reorder or replay a message (the number would not match) without
the receiver failing the connection with a :class:`~burncoll.ProtocolError` -- which fails the
collective on every node; it never yields a wrong result. It can still read the traffic: only
TLS hides it.

Costs: one HMAC pass over every byte on each side (SHA-256 runs at over a gigabyte per second
with the CPU's SHA extensions, outside the GIL), and a payload is received into the
transport's own buffer and copied to its place instead of being read straight there (it must
be checked before it is used). Messages leave from the event loop, so that their numbers
follow the order on the wire.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Sequence

from burncoll.errors import ProtocolError
from burncoll.protocol.wire import Placed
from burncoll.transport.base import Buffer, Connection, byte_view

__all__ = ["TAG_BYTES", "IntegrityConnection", "derive_keys"]

#: Bytes of the tag after every message.
TAG_BYTES = 32
_TO_CLIENT = b"burncoll-integrity-v1 to client"
_TO_SERVER = b"burncoll-integrity-v1 to server"


def derive_keys(token: bytes, server_nonce: bytes, client_nonce: bytes, binding: bytes
                ) -> tuple[bytes, bytes]:
    """``(key to the client, key to the server)`` of one authenticated connection."""
    def one(label: bytes) -> bytes:
        material = b"|".join((label, server_nonce, client_nonce, binding))
        return hmac.new(token, material, hashlib.sha256).digest()

    return one(_TO_CLIENT), one(_TO_SERVER)


def _tag(key: bytes, number: int, parts: Sequence[memoryview]) -> bytes:
    mac = hmac.new(key, number.to_bytes(8, "little"), hashlib.sha256)
    for part in parts:
        mac.update(part)
    return mac.digest()


class IntegrityConnection(Connection):
    """``inner`` with a tag on every message (see the module docstring)."""

    def __init__(self, inner: Connection, *, send_key: bytes, recv_key: bytes) -> None:
        self._inner = inner
        self.remote = inner.remote
        self._send_key = send_key
        self._recv_key = recv_key
        self._sent = 0
        self._received = 0

    async def send(self, parts: Sequence[Buffer]) -> None:
        views = [byte_view(p) for p in parts]
        number, self._sent = self._sent, self._sent + 1
        # No await before the inner send queues the message: numbers follow the wire order.
        await self._inner.send([*views, _tag(self._send_key, number, views)])

    async def recv(self) -> Buffer:
        message = await self._inner.recv()
        if isinstance(message, Placed):  # pragma: no cover - placement is never enabled here
            raise ProtocolError(f"a message from {self.remote} bypassed its integrity check")
        view = byte_view(message)
        number, self._received = self._received, self._received + 1
        if len(view) < TAG_BYTES or not hmac.compare_digest(
                _tag(self._recv_key, number, [view[:-TAG_BYTES]]), view[-TAG_BYTES:]):
            raise ProtocolError(
                f"message {number} from {self.remote} failed its integrity check: it was "
                "altered, dropped, reordered or injected on the way (a relay or a corrupted "
                "link between the two ends); the connection cannot be trusted"
            )
        return view[:-TAG_BYTES]

    async def close(self) -> None:
        await self._inner.close()

    def authenticated(self) -> None:
        self._inner.authenticated()

    def channel_binding(self) -> bytes:
        return self._inner.channel_binding()
