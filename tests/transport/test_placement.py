"""Receiving a large message's payload straight into memory its receiver chose (``place_with``).

The data service uses it to place received parts in the result array; here the placer is
a plain function, so the transport's side is tested alone: the kept head, the placed bytes,
the fallback when the placer declines, and no placement for masked WebSocket frames (their
bytes must be unmasked, so they are received into a buffer of their own). Connections that
cannot place at all (QUIC, integrity-tagged ones, whose payloads are checked before use) do
not claim to.
"""

from __future__ import annotations

import asyncio
import os

import numpy as np
import pytest

from burncoll.errors import ProtocolError
from burncoll.protocol.wire import Placed, decode, encode_control, peek_part
from burncoll.transport.base import FastPath
from burncoll.transport.integrity import IntegrityConnection
from tests.transport.support import ALL_TRANSPORTS, MakeTransport, connected, run

SIZE = 1 << 20
HEAD = 24


@pytest.mark.parametrize("make", [ALL_TRANSPORTS[0], ALL_TRANSPORTS[3]])
def test_a_placed_payload_lands_in_the_chosen_memory(make: MakeTransport) -> None:
    async def body() -> None:
        async with connected(make()) as (client, server, _):
            target = np.zeros(SIZE - HEAD, np.uint8)
            asked: list[int] = []

            def placer(first: memoryview, size: int) -> tuple[int, memoryview] | None:
                asked.append(size)
                if len(asked) == 2:
                    return None  # declined: the message gets a buffer of its own
                return HEAD, memoryview(target)

            assert isinstance(client, FastPath)
            client.place_with(placer)
            messages = [os.urandom(SIZE) for _ in range(2)]
            for m in messages:
                await server.send([m[:1000], m[1000:]])  # server -> client: plain frames
            first = await asyncio.wait_for(client.recv(), 10)
            assert isinstance(first, Placed)
            assert first.head == messages[0][:HEAD]
            assert bytes(target) == messages[0][HEAD:]
            second = await asyncio.wait_for(client.recv(), 10)
            assert not isinstance(second, Placed) and bytes(second) == messages[1]
            assert asked == [SIZE, SIZE]

    run(body())


@pytest.mark.parametrize("make", ALL_TRANSPORTS)
def test_only_stream_connections_without_tags_offer_placement(
        make: MakeTransport, request: pytest.FixtureRequest) -> None:
    name = request.node.callspec.id

    async def body() -> None:
        async with connected(make()) as (client, server, _):
            for conn in (client, server):
                assert isinstance(conn, FastPath) == (name != "quic"), name
            tagged = IntegrityConnection(client, send_key=b"k" * 32, recv_key=b"k" * 32)
            assert not isinstance(tagged, FastPath)

    run(body())


def test_masked_websocket_frames_are_never_placed() -> None:
    async def body() -> None:
        async with connected(ALL_TRANSPORTS[0].values[0]()) as (client, server, _):
            assert isinstance(server, FastPath)
            server.place_with(lambda first, size: pytest.fail("a masked frame was placed"))
            message = os.urandom(SIZE)
            await client.send([message])  # client -> server: masked
            got = await asyncio.wait_for(server.recv(), 10)
            assert not isinstance(got, Placed) and bytes(got) == message

    run(body())


def test_a_placed_message_decodes_like_a_whole_one() -> None:
    from burncoll.ops import OpKind, ReduceOp
    from burncoll.protocol.wire import DataHeader, encode_data_header

    payload = np.arange(10, dtype=np.float32)
    header = DataHeader(session=7, seq=3, op_kind=OpKind.ALL_REDUCE, reduce_op=ReduceOp.SUM,
                        dtype="float32", shape=(10,), root=-1, src=1, round=2, channel=0,
                        chunk=1, offset=0, chunk_bytes=40)
    head = encode_data_header(header, 40)
    whole = decode(head + payload.tobytes())
    placed = decode(Placed(head, memoryview(payload.view(np.uint8))))
    assert placed.header == whole.header and placed.placed and not whole.placed
    assert bytes(placed.payload) == bytes(whole.payload)
    peek = peek_part(memoryview(head + b"xx"))
    assert peek is not None and peek.key == (3, 0, 2, 1, 1) and peek.payload_len == 40
    assert peek.header_len == len(head) and peek.session == 7
    assert peek_part(memoryview(encode_control({"type": "bye"}))) is None
    assert peek_part(memoryview(head[:30])) is None
    with pytest.raises(ProtocolError, match="announces"):
        decode(Placed(head, memoryview(b"short")))


def test_stop_placing_leaves_the_chosen_memory_alone() -> None:
    """An operation failed while its part was arriving: the rest of the payload must not be
    written into the memory (its owner may already use it again)."""
    from burncoll.transport.tcp import PREAMBLE, TcpTransport
    from tests.transport.support import HOST, serving

    async def body() -> None:
        async with serving(TcpTransport()) as served:
            _reader, writer = await asyncio.open_connection(HOST, served.port)
            target = np.zeros(SIZE - HEAD, np.uint8)
            message = np.frombuffer(os.urandom(SIZE), np.uint8)
            writer.write(PREAMBLE)
            conn = await asyncio.wait_for(served.accepted.get(), 5)
            conn.authenticated()  # as the authentication exchange, skipped here, would
            assert isinstance(conn, FastPath)
            conn.place_with(lambda first, size: (HEAD, memoryview(target)))
            first = 200_000
            writer.write(SIZE.to_bytes(8, "little") + message[:first].tobytes())
            await writer.drain()
            for _ in range(200):  # until the first bytes have been placed
                if target[first - HEAD - 1] == message[first - 1] and target[0] == message[HEAD]:
                    break
                await asyncio.sleep(0.01)
            conn.stop_placing()
            writer.write(message[first:].tobytes())
            await writer.drain()
            got = await asyncio.wait_for(conn.recv(), 10)
            assert isinstance(got, Placed) and got.payload.obj is not target
            assert not target[first - HEAD:].any()  # nothing after the stop was placed
            writer.close()

    run(body())
