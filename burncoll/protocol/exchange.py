"""The one-round exchange without I/O: what every node sends, what it accepts, and the result.

In the exchange every node sends its whole buffer to every other node, in one DATA message
(round 0, chunk 0, one part), and reduces the ``n`` buffers itself, always in node order
(``x0 op x1 op ... op x(n-1)``): every node computes the same bits, as a schedule's "reduce
once, then copy" guarantees. :class:`ExchangeCore` is that protocol for one operation
signature on one node, built once and used by every operation of that signature:

- :meth:`~ExchangeCore.header` and :meth:`~ExchangeCore.message`: this node's message, its
  header built once and restamped with each operation's number (and
  :meth:`~ExchangeCore.result_header`, the host gather's result's);
- :attr:`~ExchangeCore.expected_bytes`: the length of every other node's message;
- :meth:`~ExchangeCore.check` (a message's bytes) and :meth:`~ExchangeCore.check_header` (a
  decoded header): ``None``, or the error naming the sender -- a mismatch for another call or
  another operation's number, a protocol error for another session, round, channel, chunk or
  size, or for bytes that are no frame;
- :meth:`~ExchangeCore.reduce` and :meth:`~ExchangeCore.reduce_messages`: the node-order
  reduction of the payloads (or of the whole messages);
- :meth:`~ExchangeCore.round_header`: the header of a round of the host memory (empty or
  small messages that only say "done", checked the same way).

No clock, no socket, no event loop: the drivers move the bytes -- the calling thread on its
caller sockets or the shared mail (:mod:`burncoll.node.lane_exchange`), the event loop on the
member connections (:mod:`burncoll.node.exchange`) -- and ask the core what they mean.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from burncoll.dtypes import dtype_from_name
from burncoll.errors import CollectiveError, ProtocolError
from burncoll.levels import GlobalOp, HostArray
from burncoll.ops import ReduceOp
from burncoll.protocol.checks import Check, order_mismatch, protocol_error
from burncoll.protocol.wire import (
    SRC_AT,
    SRC_END,
    DataHeader,
    decode_data_head,
    encode_data_header,
    restamped,
)
from burncoll.reduction import reduce_into

__all__ = ["ExchangeCore", "payload_bytes"]

_Bytes = bytes | bytearray | memoryview
#: Where a message was read, in the words of errors (the driver's medium).
ON_LANE = "on its caller socket"


class ExchangeCore:
    """The exchange of operations like ``op`` (same fingerprint) of ``nbytes`` per node, on
    channel ``channel``, as node ``me`` of ``nodes`` in ``session`` sees it; ``describe``
    names a node in errors."""

    def __init__(self, op: GlobalOp, nbytes: int, *, me: int, nodes: int, session: int,
                 describe: Callable[[int], str], channel: int = 0) -> None:
        self.me, self.nodes, self.session, self.channel = me, nodes, session, channel
        self.describe = describe
        self.others = tuple(n for n in range(nodes) if n != me)
        #: Each node's sender field, as its header carries it.
        self._srcs = {n: struct.pack("<i", n) for n in range(nodes)}
        self.dtype: np.dtype[Any] = dtype_from_name(op.dtype or "uint8")
        self._template = self.round_header(op, 0, nbytes)
        self._result = self.round_header(op, 1, nbytes)
        #: This node's header length, and the length of every node's whole message.
        self.header_bytes = len(self._template)
        self.expected_bytes = self.header_bytes + nbytes

    @staticmethod
    def signature(op: GlobalOp, nbytes: int, channel: int = 0) -> tuple[object, ...]:
        """What a core is built for in one session: operations that share it differ only in
        number (``op[1:6]`` is :meth:`GlobalOp.fingerprint`, without a call)."""
        return (op[1:6], nbytes, channel)

    def header(self, seq: int) -> bytes:
        """This node's header in operation ``seq``."""
        return restamped(self._template, seq, self.me)

    def result_header(self, seq: int) -> bytes:
        """This node's header of the result of operation ``seq`` in the host gather (round
        1, as many payload bytes): the root's, before the result; every other node's, alone
        (``levels.HostGather``)."""
        return restamped(self._result, seq, self.me)

    def message(self, seq: int, buf: HostArray) -> list[_Bytes]:
        """This node's message in operation ``seq``: its header, then ``buf``'s bytes."""
        return [self.header(seq), payload_bytes(buf)]

    def round_header(self, op: GlobalOp, round_: int, size: int) -> bytes:
        """This node's header of round ``round_`` of ``op``, before ``size`` payload bytes
        (round 0 is the exchange's message; the host memory's rounds count on)."""
        return encode_data_header(DataHeader(
            session=self.session, seq=op.seq, op_kind=op.kind, reduce_op=op.reduce_op,
            dtype=op.dtype, shape=op.shape, root=op.root, src=self.me, round=round_,
            channel=self.channel, chunk=0, offset=0, chunk_bytes=size), size)

    def check(self, op: GlobalOp, check: Check, node: int, data: _Bytes,
              mine: bytes | None = None, where: str = ON_LANE) -> CollectiveError | None:
        """``None`` when ``data`` is the message this node expects from ``node`` in ``op``:
        :attr:`expected_bytes` long, and the same header bytes as ``mine`` but for the
        sender (``mine``: this node's header from this core, the exchange's by default or a
        :meth:`round_header` of as many payload bytes).
        Otherwise why not, naming ``node`` (read ``where``); ``data`` may then hold only the
        start of its message, as far as its header (when it announced another length).
        ``check`` is this node's call's (:func:`~burncoll.protocol.checks.header_check`)."""
        mine = self.header(op.seq) if mine is None else mine
        view = memoryview(data)
        # (``mine`` but for the sender, compared around it: no header is built per node)
        if (len(view) == self.expected_bytes and view[:SRC_AT] == mine[:SRC_AT]
                and view[SRC_AT:SRC_END] == self._srcs.get(node, b"")
                and view[SRC_END:len(mine)] == mine[SRC_END:]):
            return None
        return self.wrong(op, check, node, view, mine, where)

    def wrong(self, op: GlobalOp, check: Check, node: int, data: _Bytes,
              mine: bytes | None = None, where: str = ON_LANE) -> CollectiveError:
        """Why ``data``, from ``node``, is not the message :meth:`check` expects (``data``
        holds at least its header, or it is malformed)."""
        try:
            h, payload_len = decode_data_head(memoryview(data))
        except ProtocolError as exc:
            return ProtocolError(f"{op.label}: {self.describe(node)} sent a malformed "
                                 f"message {where}: {exc}")
        whole = self.expected_bytes
        return self.check_header(op, check, node, h, payload_len, mine, where) or (
            protocol_error(op, self.describe, h, f"a message cut short ({len(data)} of "
                           f"{whole} bytes)" if len(data) < whole else "a header that "
                           "differs from this operation's"))

    def check_header(self, op: GlobalOp, check: Check, node: int, h: DataHeader,
                     payload_len: int, mine: bytes | None = None, where: str = ON_LANE
                     ) -> CollectiveError | None:
        """Why ``h``, a header ``node`` sent before ``payload_len`` bytes, is not the one
        this node expects from it in ``op`` (``mine``: this node's, as in :meth:`check`), or
        ``None``: the same fields as ``mine`` but for the sender."""
        describe = self.describe
        if h.src != node or h.session != self.session:
            return ProtocolError(f"{op.label}: {describe(node)} sent a frame that names "
                                 f"node {h.src} of session {h.session}")
        if h.seq != op.seq:
            return order_mismatch(op, self.me, describe, h)
        error = check(h)
        if error is not None:
            return error
        own, size = decode_data_head(memoryview(
            self.header(op.seq) if mine is None else mine))
        if (h.channel, h.round, h.chunk) != (own.channel, own.round, own.chunk):
            return protocol_error(op, describe, h, "a part of another round, channel or "
                                  f"chunk {where}")
        if h.offset or h.chunk_bytes != own.chunk_bytes or payload_len != size:
            return protocol_error(op, describe, h, "a buffer of the wrong size")
        return None

    def reduce(self, op: GlobalOp, buf: HostArray, received: Mapping[int, HostArray],
               out: HostArray) -> None:
        """``out = x0 op x1 op ...`` in node order, ``buf`` being this node's ``x`` and
        ``received`` every other node's (payloads as frames carry them): every node computes
        the same bits."""
        me = self.me
        reduce_into(op.reduce_op or ReduceOp.SUM,
                    [buf if i == me else received[i] for i in range(self.nodes)], out)

    def reduce_messages(self, op: GlobalOp, buf: HostArray, received: Mapping[int, _Bytes],
                        out: HostArray) -> None:
        """:meth:`reduce` of every other node's whole message (header, then payload)."""
        me, dtype, at = self.me, self.dtype, self.header_bytes
        reduce_into(op.reduce_op or ReduceOp.SUM, [
            buf if i == me else np.frombuffer(received[i], dtype, offset=at)
            for i in range(self.nodes)], out)


def payload_bytes(buf: HostArray) -> memoryview:
    """``buf``'s bytes as a flat view (a copy only when ``buf`` is not contiguous)."""
    return memoryview(np.ascontiguousarray(buf).view(np.uint8))  # type: ignore[arg-type]

