"""The shared mail (``burncoll.node.host_mail``) under attack, between real nodes of one host
through a real orchestrator.

A member holding the token (a test double inside its process) posts in its mail what an
honest node never would -- a huge size, another operation's number, another dtype, another
session, bytes that are no frame -- or raises its counter far past its messages: the reading
node reads only the length its own call gives, checks the header byte for byte, and every
node fails with an error that says what was wrong and names that member. No result is
returned from such a message. The same in the host gather, where a member's message is read
by the root alone, and the root's result by every other node: a forged result fails every
node, naming the root.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import numpy as np
import pytest

import burncoll
import burncoll.local.plans.choose as choose_module
from burncoll.protocol.wire import (
    FIXED_HEADER_BYTES,
    announced_lengths,
    decode_data_head,
    encode_data_header,
)
from tests.node.test_lanes import _two_nodes
from tests.security.test_hostile_lanes import WHY, _tamper, hostile_second_call

#: What node 0's error must say, by kind (its slot 0 was never written: its first message
#: went into slot 1).
WHY_MAIL = {**WHY, "no_frame": ("ProtocolError", "malformed message in the shared mail"),
            "counter_far_ahead": ("ProtocolError", "malformed message in the shared mail")}


def _mail(comm: burncoll.Communicator) -> Any:
    """The node's shared mail (internal: a test double reaches it to inject a fault)."""
    mail = comm._server.link._lanes.mail  # type: ignore[attr-defined]
    assert mail is not None, "the mail is not in use"
    return mail


def _next_message_from_zero(mail: Any) -> bytes:
    """(Node 1.) Node 0's next message in the mail, once posted."""
    k = mail.posted_count + 1
    deadline = time.monotonic() + 10
    while not mail.posted(0, k):
        assert time.monotonic() < deadline, "node 0 posted nothing"
        time.sleep(0.001)
    head = mail.read(0, k, FIXED_HEADER_BYTES)
    return bytes(mail.read(0, k, announced_lengths(memoryview(head))[1]))


@pytest.mark.parametrize("kind", list(WHY_MAIL))
def test_a_hostile_mail_message_fails_every_node_naming_its_sender(kind: str) -> None:
    def attack(comm: burncoll.Communicator) -> None:
        mail = _mail(comm)
        message = _next_message_from_zero(mail)
        if kind == "counter_far_ahead":  # an empty post, numbered 1000 past the next
            mail.posted_count += 1000
            mail.post((b"",))
        else:
            mail.post((_tamper(message, kind),))

    hostile_second_call(attack, *WHY_MAIL[kind], shared_memory=True)


# -- the host gather (``levels.HostGather``): node 0 reads every node's message, the others its
# result; its route among 2 nodes here (``auto`` gives it to 16 node processes of a host)

#: What node 0 (the root) must say when node 1 posts ``kind`` in the gather: what the
#: exchange's reader says, but for a counter raised far ahead (the root then reads what node 1
#: left in that slot: its message of the first call).
WHY_GATHER = {**WHY_MAIL,
              "counter_far_ahead": ("MismatchError", "different sequences of operations")}


def _gathering(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(choose_module, "GATHER_NODES", 2)


def _message(mail: Any, node: int, k: int) -> bytes:
    head = mail.read(node, k, FIXED_HEADER_BYTES)
    return bytes(mail.read(node, k, announced_lengths(memoryview(head))[1]))


@pytest.mark.parametrize("kind", list(WHY_GATHER))
def test_a_hostile_message_to_the_gather_fails_every_node_naming_its_sender(
        kind: str, monkeypatch: pytest.MonkeyPatch) -> None:
    _gathering(monkeypatch)

    def attack(comm: burncoll.Communicator) -> None:
        mail = _mail(comm)
        if kind == "counter_far_ahead":  # an empty post, numbered 1000 past the next
            mail.posted_count += 1000
            mail.post((b"",))
            return
        # its own message of the first call (two numbers back: a header alone came after it)
        h, size = decode_data_head(memoryview(_message(mail, 1, mail.posted_count - 1)))
        mail.post((_tamper(encode_data_header(dataclasses.replace(h, seq=h.seq + 1), size)
                           + b"\0" * size, kind),))

    hostile_second_call(attack, *WHY_GATHER[kind], shared_memory=True)


#: What node 1 must say when node 0 posts ``kind`` as the gather's result.
WHY_RESULT = {**{k: WHY_MAIL[k] for k in ("huge_size", "another_operation", "another_dtype",
                                           "another_session", "no_frame")},
              "a_contribution": ("ProtocolError", "a part of another round")}


def _forged(message: bytes, kind: str) -> bytes:
    """Node 1's message of the gather, as node 0 (hostile) posts it as its result."""
    if kind == "a_contribution":  # (round 0: node 1's message, as node 0's)
        return _tamper(message, "no_change", src=0)
    return _tamper(message, kind, src=0, round=1)


@pytest.mark.parametrize("kind", list(WHY_RESULT))
def test_a_hostile_gather_result_fails_every_node_naming_the_root(
        kind: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Node 0 (the root, hostile) posts a forged result once node 1 posted its message: node 1
    reads only the length its own call gives, checks the header, and fails naming node 0;
    node 0 learns of it by its next operations."""
    _gathering(monkeypatch)
    x = np.arange(16, dtype=np.float32)

    def fn(comm: burncoll.Communicator) -> Any:
        first = comm.all_reduce(x.copy())  # honest: the gather works
        np.testing.assert_array_equal(first, (x.astype(np.float64) * 2).astype(np.float32))
        if comm.peer_id == 1:
            return comm.all_reduce(x.copy())
        mail = _mail(comm)
        k = mail.posted_count + 1
        deadline = time.monotonic() + 10
        while not mail.posted(1, k):
            assert time.monotonic() < deadline, "node 1 posted nothing"
            time.sleep(0.001)
        mail.post((_forged(_message(mail, 1, k), kind),), skip=1)
        for _ in range(3):
            comm.barrier()
        return "node 0 never failed"

    out = _two_nodes(fn, shared_memory=True)
    error, why = WHY_RESULT[kind]
    one = out[1]
    assert isinstance(one, burncoll.CollectiveError), out
    assert type(one).__name__ == error and why in str(one) and "node 0" in str(one), out
    assert isinstance(out[0], burncoll.CollectiveError), out
