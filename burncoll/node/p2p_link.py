"""Point-to-point messages between peers of different nodes: :class:`NodePointToPoint`, what
:class:`~burncoll.node.link.NodeLink` does for ``send``/``recv`` across nodes.

A send runs on the node's event loop: it numbers the message (:class:`~burncoll.node.p2p_outbox.
Outbox`), sends its frames to the receiver's node -- one message at a time per destination
node, so that the parts of a message follow each other on the connection -- and waits for the
acknowledgement. A recv waits in the :class:`~burncoll.node.inbox.Inbox` for the next message
of its key, then acknowledges it to the sending node on the connection this node sends on:
taken, or refused when the receiver's ``out=`` has another dtype or shape
(:class:`~burncoll.MismatchError` on both sides; the collective goes on). The acknowledgement
is sent in the background, in order: a recv never waits for it to leave.

Both end by their deadline. A timeout fails the session (every node hears of it, as of any
failure) with a :class:`~burncoll.CollectiveTimeout` naming both peers and the tag; so does
any other error on the way (a lost node: :class:`~burncoll.PeerLost`).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import Future

from burncoll.errors import CollectiveError, CollectiveTimeout, MismatchError
from burncoll.ioloop import IoLoop
from burncoll.levels import HostArray
from burncoll.node.data_service import DataService
from burncoll.node.p2p_outbox import message_parts
from burncoll.protocol.control import encode
from burncoll.protocol.members import MAX_REFUSAL, P2PAck

__all__ = ["NodePointToPoint"]

#: What a receiver takes: the dtype and shape of its ``out=``, or ``None`` for anything.
Want = tuple[str, tuple[int, ...]] | None


class NodePointToPoint:
    """Sends and receives point-to-point messages of this node's peers across nodes."""

    def __init__(self, io: IoLoop, service: DataService, peer_ids: Sequence[int],
                 node_of: Mapping[int, int]) -> None:
        self._io = io
        self._service = service
        self._rank = {p: r for r, p in enumerate(peer_ids)}
        self._node_of = node_of
        #: One message at a time per destination node (made on the loop, when first used).
        self._locks: dict[int, asyncio.Lock] = {}
        self._acks: set[asyncio.Task[None]] = set()

    def send(self, src: int, dst: int, tag: int, buf: HostArray, deadline: float
             ) -> Future[None]:
        """From a peer thread: send ``buf`` from peer ``src`` to peer ``dst`` (see
        :meth:`burncoll.levels.GlobalLink.p2p_send`)."""
        return self._io.submit(self._send(src, dst, tag, buf, deadline))

    def recv(self, src: int, dst: int, tag: int, deadline: float, want: Want = None
             ) -> Future[HostArray]:
        """From a peer thread: the next message from peer ``src`` to peer ``dst`` (see
        :meth:`burncoll.levels.GlobalLink.p2p_recv`)."""
        return self._io.submit(self._recv(src, dst, tag, deadline, want))

    def _lock(self, node: int) -> asyncio.Lock:
        lock = self._locks.get(node)
        if lock is None:
            lock = self._locks[node] = asyncio.Lock()
        return lock

    def _describe(self, peer: int) -> str:
        return f"peer {peer} ({self._service.membership.describe(self._node_of[peer])})"

    # -- sending ------------------------------------------------------------------------------
    async def _send(self, src: int, dst: int, tag: int, buf: HostArray, deadline: float
                    ) -> None:
        service, node = self._service, self._node_of[dst]
        key = (self._rank[src], self._rank[dst], tag)
        seq, acked = service.outbox.open(key, node)
        try:
            async with asyncio.timeout(max(deadline - time.monotonic(), 0.0)):
                async with self._lock(node):
                    for parts in message_parts(service.session or 0, service.node_index, key,
                                               seq, buf):
                        await service.send(node, parts)
                refused = await acked
        except CollectiveError as exc:  # the session's failure, or one to make it
            service.fail(exc)
            raise
        except TimeoutError:
            raise await self._timed_out(self._send_timeout(src, dst, tag, deadline)) from None
        finally:
            service.outbox.close(key, seq)
        if refused is not None:
            raise MismatchError(f"send from peer {src} to peer {dst} (tag {tag}): peer {dst} "
                                f"refused the message: {refused}")

    def _send_timeout(self, src: int, dst: int, tag: int, deadline: float) -> CollectiveTimeout:
        timeout = self._service.timeout
        return CollectiveTimeout(
            f"send from peer {src} to peer {dst} (tag {tag}) timed out after "
            f"{time.monotonic() - deadline + timeout:.1f} s (timeout {timeout:g} s): "
            f"{self._describe(dst)} did not receive it. Hint: every send needs a matching "
            f"recv(src={src}, tag={tag}) on peer {dst}")

    async def _timed_out(self, error: CollectiveTimeout) -> CollectiveTimeout:
        """Fail the session with ``error`` and let the other nodes hear of it."""
        self._service.fail(error)
        await self._service.flush_abort()
        return error

    # -- receiving ----------------------------------------------------------------------------
    async def _recv(self, src: int, dst: int, tag: int, deadline: float, want: Want
                    ) -> HostArray:
        service, node = self._service, self._node_of[src]
        key = (self._rank[src], self._rank[dst], tag)
        errors: list[CollectiveTimeout] = []

        def timed_out() -> CollectiveTimeout:
            errors.append(self._recv_timeout(src, dst, tag, deadline))
            return errors[-1]

        try:
            message = await service.inbox.take(key, deadline, timed_out)
        except CollectiveTimeout as exc:
            if errors and exc is errors[-1]:
                raise await self._timed_out(exc) from None
            raise
        mine = (message.dtype, message.shape)
        refused = None
        if want is not None and mine != want:
            refused = (f"its recv(out=...) takes {want[0]}{list(want[1])}, the message is "
                       f"{mine[0]}{list(mine[1])}")[:MAX_REFUSAL]
        self._acknowledge(node, P2PAck(service.node_index, *key, message.seq, refused))
        if want is not None and refused is not None:
            raise MismatchError(
                f"recv from peer {src} (tag {tag}) on peer {dst}: the message is "
                f"{mine[0]}{list(mine[1])} but out is {want[0]}{list(want[1])}; they must match")
        return message.array()

    def _recv_timeout(self, src: int, dst: int, tag: int, deadline: float
                      ) -> CollectiveTimeout:
        timeout = self._service.timeout
        return CollectiveTimeout(
            f"recv from peer {src} (tag {tag}) on peer {dst} timed out after "
            f"{time.monotonic() - deadline + timeout:.1f} s (timeout {timeout:g} s): "
            f"{self._describe(src)} sent no message with that tag. Hint: every recv needs a "
            f"matching send or isend(dst={dst}, tag={tag}) on peer {src}")

    def _acknowledge(self, node: int, ack: P2PAck) -> None:
        """Send ``ack`` to ``node`` in the background (acknowledgements leave in order: each
        queues for the connection in turn; a broken connection fails the session)."""
        service = self._service
        task = asyncio.ensure_future(service.send(node, [encode(ack, service.session or 0)]))
        self._acks.add(task)
        task.add_done_callback(self._acknowledged)

    def _acknowledged(self, task: asyncio.Task[None]) -> None:
        self._acks.discard(task)
        if not task.cancelled():
            task.exception()  # retrieved: service.send failed the session with it
