"""Cutting a byte stream of length-prefixed messages back into whole messages (the QUIC
streams' framing; see :class:`MessageAssembler`)."""

from __future__ import annotations

from burncoll.errors import ProtocolError
from burncoll.protocol.wire import LENGTH_PREFIX_BYTES

__all__ = ["MessageAssembler", "MessageTooBig"]


class MessageTooBig(ProtocolError):
    """A message announced on a stream is longer than the receiver accepts."""


class MessageAssembler:
    """Sans-I/O: cuts a byte stream of length-prefixed messages back into whole messages.

    ``feed`` accepts stream data in chunks of any size. A message's bytes are copied once,
    into a buffer allocated when its length is read and checked. Raises
    :class:`~burncoll.ProtocolError` (:class:`MessageTooBig` for a size) when the stream does
    not start with ``preamble`` or announces a message over ``max_message_bytes``; the
    assembler is then unusable.

    **Before authentication.** With ``preauth_bytes`` set, the other side is a stranger until
    :meth:`authenticated` is called, and the assembler trusts nothing it says:

    * it accepts at most ``preauth_bytes`` in total (preamble, lengths and messages together);
      a ``feed`` that goes past them raises :class:`MessageTooBig`;
    * ``feed`` only keeps the bytes (it returns no message): messages are cut from them one at
      a time, when the reader asks for the next one (:meth:`next_held`). So whatever the peer
      pipelines behind the messages read before authentication (a side that has just proved
      itself may send its first large message at once) waits, bounded, for
      :meth:`authenticated`, instead of being judged by the pre-authentication budget;
    * a message whose length does not fit in what is left of the budget is refused as soon
      as its length is cut (:class:`MessageTooBig` naming the limit), before anything is
      allocated for it: no buffer larger than ``preauth_bytes`` ever exists on a stranger's
      word.
    """

    def __init__(self, max_message_bytes: int, preamble: bytes = b"", *,
                 preauth_bytes: int | None = None) -> None:
        self.max_message_bytes = max_message_bytes
        self._preamble = preamble
        self._head = bytearray()  # preamble or length bytes collected so far
        self._message: bytearray | None = None
        self._filled = 0
        #: The pre-authentication budget; ``None`` once authenticated (or never limited).
        self._preauth_bytes = preauth_bytes
        self._held = bytearray()  # bytes fed before authentication, not cut yet
        self._fed = 0  # bytes fed before authentication
        self._cut_bytes = 0  # bytes cut into preamble, lengths and messages

    @property
    def mid_message(self) -> bool:
        """Whether bytes have been fed that do not complete a message (or that are held, not
        yet cut, before authentication)."""
        return bool(self._head) or self._message is not None or bool(self._held)

    @property
    def is_authenticated(self) -> bool:
        """Whether messages are cut as they arrive (no pre-authentication budget applies)."""
        return self._preauth_bytes is None

    def feed(self, data: bytes | bytearray | memoryview) -> list[bytearray]:
        """Take the next stream bytes; return the messages they complete, in order (always
        none before authentication: see the class docstring)."""
        view = memoryview(data).cast("B")
        limit = self._preauth_bytes
        if limit is None:
            return self._cut(view, first_only=False)[0]
        if self._fed + len(view) > limit:
            raise MessageTooBig(
                f"{self._fed + len(view)} bytes arrived before authentication: over the "
                f"pre-authentication limit ({limit} bytes)"
            )
        self._fed += len(view)
        self._held += view
        return []

    def next_held(self) -> bytearray | None:
        """Before authentication: cut the next message from the bytes held, or ``None`` when
        they do not complete one yet. After it: ``None`` (``feed`` returns every message)."""
        if self._preauth_bytes is None or not self._held:
            return None
        messages, used = self._cut(memoryview(self._held), first_only=True)
        del self._held[:used]
        return messages[0] if messages else None

    def authenticated(self) -> list[bytearray]:
        """The other side authenticated: lift the budget and return the messages completed by
        the bytes held so far (they are then checked against ``max_message_bytes`` only)."""
        if self._preauth_bytes is None:
            return []
        self._preauth_bytes = None
        held, self._held = self._held, bytearray()
        return self._cut(memoryview(held), first_only=False)[0]

    def _cut(self, view: memoryview, *, first_only: bool) -> tuple[list[bytearray], int]:
        """Cut ``view`` into messages; stop after the first completed one when
        ``first_only``. Returns the messages and how many bytes of ``view`` were used."""
        done: list[bytearray] = []
        total = len(view)
        while view and not (first_only and done):
            if self._preamble:
                view = self._take_preamble(view)
            elif self._message is None:
                view = self._take_length(view)
            else:
                take = min(len(view), len(self._message) - self._filled)
                self._message[self._filled : self._filled + take] = view[:take]
                self._filled += take
                self._cut_bytes += take
                view = view[take:]
            if self._message is not None and self._filled == len(self._message):
                done.append(self._message)
                self._message = None
        return done, total - len(view)

    def _take_preamble(self, view: memoryview) -> memoryview:
        take = min(len(view), len(self._preamble) - len(self._head))
        self._head += view[:take]
        self._cut_bytes += take
        if len(self._head) == len(self._preamble):
            if self._head != self._preamble:
                opened = bytes(self._head)
                raise ProtocolError(f"stream opened with {opened!r}: not a burncoll peer")
            self._preamble = b""
            self._head.clear()
        return view[take:]

    def _take_length(self, view: memoryview) -> memoryview:
        take = min(len(view), LENGTH_PREFIX_BYTES - len(self._head))
        self._head += view[:take]
        self._cut_bytes += take
        if len(self._head) == LENGTH_PREFIX_BYTES:
            size = int.from_bytes(self._head, "little")
            self._head.clear()
            self._check_size(size)
            self._message, self._filled = bytearray(size), 0
        return view[take:]

    def _check_size(self, size: int) -> None:
        """Refuse a message of ``size`` bytes, its length just cut, before allocating it."""
        limit = self._preauth_bytes
        if limit is not None and size > limit - self._cut_bytes:
            raise MessageTooBig(
                f"message of {size} bytes exceeds the pre-authentication limit ({limit} "
                f"bytes, {max(limit - self._cut_bytes, 0)} of them left): a peer may send no "
                "more until it has authenticated"
            )
        if size > self.max_message_bytes:
            raise MessageTooBig(
                f"message of {size} bytes exceeds the limit of {self.max_message_bytes} bytes"
            )
