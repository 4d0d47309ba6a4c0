"""The shared mail (``burncoll.node.host_mail``) under attack, between real nodes of one host
through a real orchestrator.

A member holding the token (a test double inside its process) posts in its mail what an
honest node never would -- a huge size, another operation's number, another dtype, another
session, bytes that are no frame -- or raises its counter far past its messages: the reading
node reads only the length its own call gives, checks the header byte for byte, and every
node fails with an error that says what was wrong and names that member. No result is
returned from such a message.
"""

from __future__ import annotations

import time
from typing import Any

import pytest

import burncoll
from burncoll.protocol.wire import FIXED_HEADER_BYTES, announced_lengths
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
