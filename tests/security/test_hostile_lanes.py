"""Caller sockets (``burncoll.node.lanes``) under attack, between real nodes through a real
orchestrator.

A member holding the token (a test double inside its process) writes on its lane what an
honest node never would -- a huge size, another operation's number, another dtype, another
session, bytes that are no frame: the receiving node allocates nothing on the message's word
(it reads only the length its own call gives, or the header), and every node fails with an
error that says what was wrong and names that member. A stranger without the token cannot
open a lane at all, and the session goes on with exact results.
"""

from __future__ import annotations

import dataclasses
import select
import socket
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

import burncoll
from burncoll.node.dialing import Dialing
from burncoll.protocol.wire import decode_data_head, encode_data_header
from tests.node.test_lanes import _lanes_of, _two_nodes


def _next_message_from_zero(comm: burncoll.Communicator) -> bytes:
    """(Node 1.) Wait for node 0's next message on the lane; leave it there."""
    sock = _lanes_of(comm).socks[0]
    assert select.select([sock], [], [], 10)[0], "node 0 sent nothing"
    return sock.recv(1 << 16, socket.MSG_PEEK)


def _tamper(message: bytes, kind: str, **fields: Any) -> bytes:
    """Node 0's message as node 1 (hostile) sends it back instead of its own (its header's
    ``fields`` changed too: ``src=1`` unless said)."""
    h, size = decode_data_head(memoryview(message))
    payload = message[len(message) - size:]
    h = dataclasses.replace(h, **{"src": 1, **fields})
    if kind == "huge_size":
        return encode_data_header(dataclasses.replace(h, chunk_bytes=2**40), 2**40) + payload
    if kind == "another_operation":
        return encode_data_header(dataclasses.replace(h, seq=h.seq + 5), size) + payload
    if kind == "another_dtype":
        return encode_data_header(dataclasses.replace(h, dtype="int32"), size) + payload
    if kind == "another_session":
        return encode_data_header(dataclasses.replace(h, session=h.session + 1), size) + payload
    if kind == "no_change":  # (the fields alone)
        return encode_data_header(h, size) + payload
    assert kind == "no_frame"
    return b"\xff" * len(message)


#: What node 0's error must say, by kind.
WHY = {
    "huge_size": ("ProtocolError", "a buffer of the wrong size"),
    "another_operation": ("MismatchError", "different sequences of operations"),
    "another_dtype": ("MismatchError", "different arguments"),
    "another_session": ("ProtocolError", "of session"),
    "no_frame": ("ProtocolError", "malformed message on its caller socket"),
}


def hostile_second_call(attack: Callable[[burncoll.Communicator], None], error: str, why: str,
                        **config: Any) -> None:
    """Two nodes all-reduce honestly once; then node 1 runs ``attack`` (a test double) before
    its second all-reduce: node 0's second call must raise ``error`` saying ``why`` and
    naming node 1, and node 1 must learn of the failure too."""
    x = np.arange(16, dtype=np.float32)

    def fn(comm: burncoll.Communicator) -> Any:
        first = comm.all_reduce(x.copy())  # honest: the exchange works
        np.testing.assert_array_equal(first, (x.astype(np.float64) * 2).astype(np.float32))
        if comm.peer_id == 1:
            attack(comm)
            comm.all_reduce(x.copy())  # its honest message too: node 1 finds nothing wrong
            for _ in range(3):  # and learns of node 0's failure by its next operations
                comm.barrier()
            return "node 1 never failed"
        return comm.all_reduce(x.copy())

    out = _two_nodes(fn, **config)
    zero = out[0]
    assert isinstance(zero, burncoll.CollectiveError), out
    assert type(zero).__name__ == error and why in str(zero) and "node 1" in str(zero), out
    assert isinstance(out[1], burncoll.CollectiveError), out


@pytest.mark.parametrize("kind", list(WHY))
def test_a_hostile_lane_message_fails_every_node_naming_its_sender(kind: str) -> None:
    def attack(comm: burncoll.Communicator) -> None:
        _lanes_of(comm).socks[0].sendall(_tamper(_next_message_from_zero(comm), kind))

    hostile_second_call(attack, *WHY[kind])


def test_a_stranger_without_the_token_cannot_open_a_lane() -> None:
    x = np.arange(8.0)

    def fn(comm: burncoll.Communicator) -> Any:
        comm.all_reduce(x.copy())
        if comm.peer_id == 1:  # node 1's process dials as a stranger would: another token
            link = comm._server.link  # type: ignore[attr-defined]
            service = link._service
            stranger = Dialing(service.transport, "not-the-token", 5.0, False,
                               service.membership)
            with pytest.raises(burncoll.AuthenticationError):
                link._io.submit(stranger.dial(service.nodes[0], time.monotonic() + 5,
                                              lane=True)).result(15)
        return comm.all_reduce(x.copy()), sorted(_lanes_of(comm).socks)

    out = _two_nodes(fn)
    for rank, other in ((0, 1), (1, 0)):
        assert not isinstance(out[rank], BaseException), out
        total, lanes = out[rank]
        np.testing.assert_array_equal(total, 2 * x)
        assert lanes == [other]  # its one lane, not the stranger's
