"""Stream framing (``MessageAssembler``, used by QUIC) on any chunking; QUIC-only faults."""

from __future__ import annotations

import asyncio
import itertools
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from burncoll.errors import ConfigError, ProtocolError, TransportError
from burncoll.transport.assembler import MessageAssembler
from burncoll.transport.quic import QuicTransport
from burncoll.transport.quic_connection import PREAMBLE

from .support import connected, run


def _stream(messages: list[bytes]) -> bytes:
    return b"".join(len(m).to_bytes(8, "little") + m for m in messages)


@settings(max_examples=300, deadline=None)
@given(
    messages=st.lists(st.binary(max_size=300), max_size=8),
    cuts=st.lists(st.integers(0, 5000), max_size=20),
    preamble=st.booleans(),
)
def test_messages_survive_any_chunking(
    messages: list[bytes], cuts: list[int], preamble: bool
) -> None:
    data = (PREAMBLE if preamble else b"") + _stream(messages)
    assembler = MessageAssembler(1000, preamble=PREAMBLE if preamble else b"")
    bounds = sorted({0, len(data), *(c % (len(data) + 1) for c in cuts)})
    out: list[bytes] = []
    for start, stop in itertools.pairwise(bounds):
        out += [bytes(m) for m in assembler.feed(data[start:stop])]
    assert out == messages
    assert not assembler.mid_message


def test_a_length_over_the_limit_is_refused_before_any_payload() -> None:
    assembler = MessageAssembler(100)
    with pytest.raises(ProtocolError, match="101 bytes exceeds"):
        assembler.feed((101).to_bytes(8, "little"))


def test_a_wrong_preamble_is_refused() -> None:
    with pytest.raises(ProtocolError, match="not a burncoll peer"):
        MessageAssembler(100, preamble=PREAMBLE).feed(b"GET / HTTP/1.1\r\n")


def test_datagrams_larger_than_aioquic_handles_are_refused() -> None:
    with pytest.raises(ConfigError, match="max_datagram_size"):
        QuicTransport(max_datagram_size=32768)


def test_a_peer_that_vanishes_silently_is_noticed_after_the_idle_timeout() -> None:
    """The client's socket closes without a CONNECTION_CLOSE (as when its host dies)."""

    async def body() -> None:
        transport = QuicTransport(idle_timeout=1.0)
        async with connected(transport) as (client, server, _):
            client._protocol._transport.abort()  # type: ignore[attr-defined]  # no goodbye
            started = time.monotonic()
            with pytest.raises(TransportError):
                async with asyncio.timeout(5):
                    await server.recv()
            assert time.monotonic() - started < 3

    run(body())


def test_a_quiet_connection_outlives_the_idle_timeout() -> None:
    async def body() -> None:
        transport = QuicTransport(idle_timeout=0.6)
        async with connected(transport) as (client, server, _):
            await asyncio.sleep(1.5)  # keepalive pings hold it open
            await client.send([b"still here"])
            assert await server.recv() == b"still here"

    run(body())
