"""The control messages (``burncoll.protocol.control``), without sockets.

Each message encodes to the very bytes sent before it had a type (the JSON objects below are
what the node and the orchestrator sent as dicts), decodes back to itself, and a message whose
fields are not what its type says is refused with a ProtocolError naming the field.
"""

from __future__ import annotations

from typing import Any

import pytest

from burncoll.errors import ProtocolError
from burncoll.ops import OpKind, ReduceOp
from burncoll.protocol.control import (
    MAX_FIELD_BYTES,
    MAX_NODE_PEERS,
    MAX_REASON,
    Abandon,
    Abandoned,
    ControlMessage,
    Finish,
    Finished,
    Join,
    Leave,
    NodeLost,
    Notice,
    Refused,
    Table,
    TableEntry,
    decode_from_node,
    decode_from_orchestrator,
    encode,
    kind_of,
)
from burncoll.protocol.fields import MalformedMessage
from burncoll.protocol.members import Abort, Bye, Hello, Status, StatusQuery, decode_member
from burncoll.protocol.wire import DataHeader, decode, encode_control, encode_data_header

SECRET = "ab" * 32
FINGERPRINT = {"num_nodes": 2, "transport": "websocket", "integrity": False}

#: (message, the dict sent for it before the types, the conversation it belongs to)
EVERY_MESSAGE: list[tuple[ControlMessage, dict[str, Any], str]] = [
    (Hello(1, 77), {"type": "hello", "node": 1, "session": 77}, "member"),
    (Hello(1, 77, True, "0f" * 16), {"type": "hello", "node": 1, "session": 77, "lane": True,
                                     "table": "0f" * 16}, "member"),
    (Bye(2), {"type": "bye", "node": 2}, "member"),
    (Abort(0, "MismatchError", "all_reduce #3: shapes differ"),
     {"type": "abort", "node": 0, "error": "MismatchError",
      "message": "all_reduce #3: shapes differ"}, "member"),
    (Abort(1, "MismatchError", "all_reduce #3: shapes differ", 3),
     {"type": "abort", "node": 1, "error": "MismatchError",
      "message": "all_reduce #3: shapes differ", "done_before": 3}, "member"),
    (StatusQuery(1), {"type": "status?", "node": 1}, "member"),
    (Status(1), {"type": "status", "node": 1}, "member"),
    (Status(1, {4: (0, 1)}, {0: 5, 1: 4}),
     {"type": "status", "node": 1, "arrived": {"4": [0, 1]}, "next_seq": {0: 5, 1: 4}},
     "member"),
    (Join("10.0.0.2", 4100, (2, 3), FINGERPRINT, pid=4242, meta={"sharded": True}),
     {"type": "join", "host": "10.0.0.2", "port": 4100, "peer_ids": [2, 3],
      "fingerprint": FINGERPRINT, "pid": 4242, "meta": {"sharded": True}}, "node"),
    (Abandon(1, (2, 3), FINGERPRINT, "TransportError", "port in use", 4242),
     {"type": "abandon", "node": 1, "peer_ids": [2, 3], "fingerprint": FINGERPRINT,
      "error": "TransportError", "reason": "port in use", "pid": 4242}, "node"),
    (Finish(), {"type": "finish"}, "node"),
    (Leave(), {"type": "leave"}, "node"),
    (Table(9, 1, (TableEntry(0, "a", 1, (0,), {}), TableEntry(1, "b", 2, (1, 2), {"x": 1})),
           SECRET),
     {"type": "table", "session": 9, "index": 1,
      "nodes": [{"index": 0, "host": "a", "port": 1, "peer_ids": [0], "meta": {}},
                {"index": 1, "host": "b", "port": 2, "peer_ids": [1, 2], "meta": {"x": 1}}],
      "secret": SECRET}, "orchestrator"),
    (Refused("no"), {"type": "refused", "reason": "no"}, "orchestrator"),
    (Notice("differs"), {"type": "notice", "reason": "differs"}, "orchestrator"),
    (Abandoned("UsageError", "node 1 failed"),
     {"type": "abandoned", "error": "UsageError", "reason": "node 1 failed"}, "orchestrator"),
    (Finished(), {"type": "finished"}, "orchestrator"),
    (NodeLost(3), {"type": "node_lost", "node": 3}, "orchestrator"),
]

DECODERS = {"member": decode_member, "node": decode_from_node,
            "orchestrator": decode_from_orchestrator}


@pytest.mark.parametrize(("message", "sent", "side"), EVERY_MESSAGE,
                         ids=[f"{m[2]}-{m[1]['type']}" for m in EVERY_MESSAGE])
def test_every_message_is_the_same_bytes_and_decodes_back(
    message: ControlMessage, sent: dict[str, Any], side: str
) -> None:
    frame = encode(message, 77)
    assert frame == encode_control(sent, 77)
    assert DECODERS[side](decode(frame)) == message
    # the other conversations do not take it: a type they do not expect is ignored
    for other, decoder in DECODERS.items():
        if other != side:
            assert decoder(decode(frame)) is None, other


@pytest.mark.parametrize("secret", ["ab" * 32, None])
def test_the_orchestrator_s_table_frames_are_each_member_s_table_encoded(
        secret: str | None) -> None:
    """``Table.frames`` encodes the entries once for every member: byte for byte what each
    member's own :class:`Table` encodes into, and decoded back into it."""
    nodes = tuple(TableEntry(i, f"10.0.0.{i}", 1000 + i, (2 * i, 2 * i + 1),
                             {"host": "f" * 32, "lanes": i % 2 == 0, "odd \"key\"": [i]})
                  for i in range(5))
    frames = Table.frames(77, nodes, secret)
    assert len(frames) == len(nodes)
    for index, frame in enumerate(frames):
        table = Table(77, index, nodes, secret)
        assert frame == encode(table, 77)
        assert decode_from_orchestrator(decode(frame)) == table


def test_unknown_types_and_data_frames_are_ignored() -> None:
    assert decode_member(decode(encode_control({"type": "gossip", "node": 1}))) is None
    part = DataHeader(session=7, seq=0, op_kind=OpKind.ALL_REDUCE, reduce_op=ReduceOp.SUM,
                      dtype="float64", shape=(1,), root=-1, src=1, round=0, channel=0, chunk=0,
                      offset=0, chunk_bytes=8)
    data = decode(encode_data_header(part, 8) + bytes(8))
    assert kind_of(data) is None
    assert decode_member(data) is None and decode_from_orchestrator(data) is None


def test_status_of_a_local_report_keeps_its_int_keys() -> None:
    report = {"arrived": {"3": [0, 1]}, "next_seq": {0: 4, 1: 3}}
    status = Status.of(2, report)
    assert status == Status(2, {3: (0, 1)}, {0: 4, 1: 3})
    assert encode(status) == encode_control({"type": "status", "node": 2, **report})


def test_join_without_pid_or_meta() -> None:
    sent = {"type": "join", "host": "h", "port": 1, "peer_ids": [0], "fingerprint": {}}
    join = decode_from_node(decode(encode_control(sent)))
    assert join == Join("h", 1, (0,), {}) and join.pid is None and join.meta == {}
    assert join.num_nodes == 1
    # meta that is not an object is dropped, as always
    odd = decode_from_node(decode(encode_control({**sent, "meta": [1]})))
    assert isinstance(odd, Join) and odd.meta == {}


def _refused(decoder: Any, message: dict[str, Any]) -> str:
    with pytest.raises(MalformedMessage) as info:
        decoder(decode(encode_control(message)))
    assert isinstance(info.value, ProtocolError)
    return str(info.value)


JOIN = {"type": "join", "host": "h", "port": 1, "peer_ids": [0], "fingerprint": FINGERPRINT}

MALFORMED_JOINS = [
    ({"host": ""}, "host must be a non-empty string of at most 255 characters"),
    ({"host": "h" * 256}, "host must be a non-empty string"),
    ({"host": 7}, "host must be"),
    ({"port": 0}, "port must be an int in [1, 65535]"),
    ({"port": "80"}, "port must be an int"),
    ({"port": True}, "port must be an int"),
    ({"peer_ids": []}, "peer_ids must be a non-empty list"),
    ({"peer_ids": [1, 1]}, "distinct ints >= 0"),
    ({"peer_ids": [-1]}, "distinct ints >= 0"),
    ({"peer_ids": [2**63]}, "distinct ints >= 0"),
    ({"peer_ids": list(range(MAX_NODE_PEERS + 1))}, f"at most {MAX_NODE_PEERS}"),
    ({"fingerprint": "x"}, "fingerprint must be an object"),
    ({"fingerprint": {"num_nodes": 0}}, "fingerprint.num_nodes must be an int >= 1"),
    ({"fingerprint": {"num_nodes": True}}, "fingerprint.num_nodes must be an int >= 1"),
    ({"fingerprint": {"pad": "x" * MAX_FIELD_BYTES}},
     f"fingerprint must be at most {MAX_FIELD_BYTES} bytes of JSON"),
    ({"meta": {"pad": "x" * MAX_FIELD_BYTES}}, f"meta must be at most {MAX_FIELD_BYTES} bytes"),
    ({"pid": "me"}, "pid must be an int >= 0"),
]


@pytest.mark.parametrize(("change", "reason"), MALFORMED_JOINS)
def test_a_malformed_join_names_what_is_wrong(change: dict[str, Any], reason: str) -> None:
    text = _refused(decode_from_node, {**JOIN, **change})
    assert text.startswith("malformed join message: ") and reason in text, text


def test_a_join_names_every_field_that_is_wrong() -> None:
    text = _refused(decode_from_node, {"type": "join", "port": -1, "peer_ids": "x"})
    assert text.count(";") == 3, text  # host, port, peer_ids, fingerprint


TABLE = next(sent for _, sent, _ in EVERY_MESSAGE if sent["type"] == "table")

MALFORMED_TABLES = [
    ({"session": "9"}, "session must be an int"),
    ({"session": -1}, "session must be an int"),
    ({"index": 2}, "index must be an int in [0, 1]"),
    ({"nodes": []}, "nodes must be a non-empty list"),
    ({"nodes": [7]}, "nodes[0] must be an object"),
    ({"nodes": [{**TABLE["nodes"][0], "index": 1}]}, "nodes[0].index must be 0"),
    ({"nodes": [{**TABLE["nodes"][0], "port": 0}]}, "nodes[0].port must be an int"),
    ({"nodes": [{**TABLE["nodes"][0], "peer_ids": ["0"]}]}, "nodes[0].peer_ids must be"),
    ({"nodes": [{**TABLE["nodes"][0], "meta": 3}]}, "nodes[0].meta must be an object"),
    ({"secret": "abc"}, "the session secret is not 64 hex digits"),
    ({"secret": "zz" * 32}, "the session secret is not 64 hex digits"),
]


@pytest.mark.parametrize(("change", "reason"), MALFORMED_TABLES)
def test_a_malformed_table_names_what_is_wrong(change: dict[str, Any], reason: str) -> None:
    text = _refused(decode_from_orchestrator, {**TABLE, **change})
    assert text.startswith("malformed node table: ") and reason in text, text


def test_a_table_without_a_secret_decodes() -> None:
    table = decode_from_orchestrator(decode(encode_control({**TABLE, "secret": None})))
    assert isinstance(table, Table) and table.secret is None


MALFORMED_MEMBER_MESSAGES = [
    ({"type": "hello", "session": 1}, "hello from an unknown node None"),
    ({"type": "hello", "node": -1, "session": 1}, "hello from an unknown node -1"),
    ({"type": "hello", "node": True, "session": 1}, "hello from an unknown node True"),
    ({"type": "hello", "node": 1}, "hello from node 1 without its session"),
    ({"type": "hello", "node": 1, "session": "7"}, "hello from node 1 of another session ('7')"),
    ({"type": "hello", "node": 1, "session": 7, "table": 5}, "with a table digest that is not"),
    ({"type": "hello", "node": 1, "session": 7, "table": "AB"}, "with a table digest that is not"),
    ({"type": "hello", "node": 1, "session": 7, "table": "a" * 65},
     "with a table digest that is not"),
    ({"type": "bye", "node": "1"}, "malformed bye message: node must be an int >= 0"),
    ({"type": "abort", "node": 0, "error": "X"}, "malformed abort message: message must be"),
    ({"type": "abort", "node": 0, "error": 3, "message": "m"}, "error must be a string"),
    ({"type": "abort", "node": 0, "error": "X", "message": "m", "done_before": -1},
     "done_before must be an int >= 0"),
    ({"type": "abort", "node": 0, "error": "X", "message": "m", "done_before": "3"},
     "done_before must be an int >= 0"),
    ({"type": "status?"}, "malformed status? message: node must be an int >= 0"),
    ({"type": "status", "node": 0, "next_seq": {"a": 1}}, "next_seq must be an object"),
    ({"type": "status", "node": 0, "next_seq": {"1": -1}}, "next_seq must be an object"),
    ({"type": "status", "node": 0, "next_seq": {"9" * 30: 1}}, "next_seq must be an object"),
    ({"type": "status", "node": 0, "arrived": {"1": [0, "1"]}}, "arrived must be an object"),
    ({"type": "status", "node": 0, "arrived": []}, "arrived must be an object"),
]


@pytest.mark.parametrize(("message", "reason"), MALFORMED_MEMBER_MESSAGES)
def test_a_malformed_member_message_names_what_is_wrong(message: dict[str, Any],
                                                       reason: str) -> None:
    assert reason in _refused(decode_member, message)


@pytest.mark.parametrize("message", [
    {"type": "refused"}, {"type": "notice", "reason": 3}, {"type": "node_lost", "node": None},
    {"type": "abandoned", "error": "ConfigError"},
    {"type": "abandoned", "error": "E" * 41, "reason": "r"},
    {"type": "abandoned", "error": "ConfigError", "reason": "r" * (2 * MAX_REASON + 1)},
])
def test_a_malformed_orchestrator_message_is_refused(message: dict[str, Any]) -> None:
    assert _refused(decode_from_orchestrator, message).startswith(f"malformed {message['type']}")


@pytest.mark.parametrize(("change", "reason"), [
    ({"reason": "r" * (MAX_REASON + 1)},
     f"reason must be a non-empty string of at most {MAX_REASON}"),
    ({"error": ""}, "error must be a non-empty string"),
    ({"peer_ids": []}, "peer_ids must be a non-empty list"),
    ({"fingerprint": {"x": "y" * MAX_FIELD_BYTES}}, "fingerprint must be at most"),
    ({"node": -1}, "node must be an int >= 0"),
])
def test_a_malformed_abandon_names_what_is_wrong(change: dict[str, Any], reason: str) -> None:
    """What a node that failed before it joined may say is bounded (the orchestrator passes
    its reason on to every node waiting for it)."""
    message = {"type": "abandon", "node": 1, "peer_ids": [2], "fingerprint": FINGERPRINT,
               "error": "TransportError", "reason": "port in use", "pid": 1, **change}
    assert reason in _refused(decode_from_node, message)
