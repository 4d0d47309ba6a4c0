"""Python objects over the collectives: ``broadcast_object`` and ``all_gather_object``.

Real peers (threads of one node through ``burncoll.train.ddp``, and 2-3 nodes as threads of
this process over each transport) send nested, rank-dependent objects; every peer's result is
compared with the objects built again independently (types, dtypes, shapes and values; tuples
stay tuples, dict order is kept). A peer whose object cannot be sent makes every peer raise a
:class:`~burncoll.UsageError` naming it and where the object went wrong, at once (the timeout
is 10 s and the error is not a timeout), and the communicator keeps working. Hostile bytes fed
to :func:`burncoll.comm.objects.decode` raise :class:`~burncoll.ProtocolError`, never another error.
"""

from __future__ import annotations

import functools
import itertools
import random
import re
import struct
from collections.abc import Callable
from typing import Any

import msgpack
import numpy as np
import pytest

import burncoll
from burncoll.comm import objects
from burncoll.errors import ProtocolError, UsageError
from burncoll.train import ddp
from tests.harness import run_nodes
from tests.security.object_member import colliding_pairs

SUPPORTED_NOTE = "supported: None, bool, int, float, str, bytes, list, tuple, dict"


class Opaque:
    """A custom class: not sendable."""


def _obj(rank: int) -> dict[Any, Any]:
    """Peer ``rank``'s object: every supported type, nested, its sizes and values by rank."""
    return {
        "rank": rank,
        "arrays": [
            (np.arange(rank + 2, dtype=np.int64) * -7, np.array([True, False, True][: rank + 1])),
            (np.linspace(-1, 1, 6 * (rank + 1)).astype(np.float16).reshape(rank + 1, 2, 3),),
            np.array(rank + 0.5j, np.complex64),  # 0-d
            np.zeros((0, rank + 1), np.float32),  # empty
            np.arange(12, dtype=">i4").reshape(3, 4)[:, ::2] + rank,  # big-endian, strided
        ],
        "scalars": (np.float32(rank / 3), np.int8(-rank), np.bool_(rank % 2),
                    np.uint64(2**64 - 1 - rank), np.complex128(rank - 1j)),
        "big": (2**64 - 1 - rank, -(2**63) + rank, 10**18 * rank),
        "text": "ünïcödé ☃ " * rank + "🚀",
        "raw": bytes(range(rank * 3)),
        "none": None,
        "floats": [rank / 7, -0.0, 1e300, float("inf")],
        "order": {f"k{i}": i for i in reversed(range(rank + 2))},
        "keys": {(rank, ("k", None)): [[(None, True)]], 1.5: {"deep": [rank] * rank},
                 False: 0, None: "none", -rank - 1: b""},
        "empty": ([], (), {}, ""),
    }


def _same(got: Any, want: Any, path: str = "obj") -> None:
    """``got`` equals ``want`` down to every type, dtype, shape and key order."""
    assert type(got) is type(want), (path, type(got), type(want))
    if isinstance(want, np.ndarray | np.generic):
        assert (got.dtype, got.shape) == (want.dtype.newbyteorder("="), want.shape), path
        assert np.array_equal(got, want), (path, got, want)
        if isinstance(got, np.ndarray):
            assert got.flags.writeable and got.flags.c_contiguous, path
    elif isinstance(want, dict):
        assert list(got) == list(want), path
        for (gk, gv), (wk, wv) in zip(got.items(), want.items(), strict=True):
            _same(gk, wk, f"{path} key {wk!r}")
            _same(gv, wv, f"{path}[{wk!r}]")
    elif isinstance(want, list | tuple):
        assert len(got) == len(want), path
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            _same(g, w, f"{path}[{i}]")
    else:
        assert got == want, (path, got, want)


# -- the exchange every case runs -------------------------------------------------------------
def _exchange(comm: burncoll.Communicator) -> dict[str, Any]:
    """Gather, broadcast from every root, then the two refusals, then a gather again."""
    out: dict[str, Any] = {"gathered": comm.all_gather_object(_obj(comm.rank))}
    # non-roots pass anything, even what could not be sent: only the root's object goes
    out["bcast"] = [comm.broadcast_object(_obj(root) if root == comm.peer_id else {1, 2}, root)
                    for root in comm.peer_ids]
    bad_rank, bad_root = 1 % comm.world_size, comm.peer_ids[-1]
    refused = {"metrics": [1, 2, {3}]} if comm.rank == bad_rank else _obj(comm.rank)
    with pytest.raises(UsageError) as gathered:
        comm.all_gather_object(refused)
    out["gather_error"] = str(gathered.value)
    with pytest.raises(UsageError) as sent:
        comm.broadcast_object(["ok", Opaque()] if comm.peer_id == bad_root else None, bad_root)
    out["bcast_error"] = str(sent.value)
    out["after"] = comm.all_gather_object((comm.peer_id, str(comm.rank)))
    return out


def _check(results: dict[int, Any], peer_ids: list[int]) -> None:
    assert sorted(results) == list(range(len(peer_ids)))
    for rank, got in results.items():
        assert not isinstance(got, BaseException), (rank, got)
        _same(got["gathered"], [_obj(r) for r in range(len(peer_ids))])
        _same(got["bcast"], [_obj(p) for p in peer_ids])
        bad = peer_ids[1 % len(peer_ids)]
        assert got["gather_error"].startswith(
            f"all_gather_object: peer {bad} could not send its object: cannot send a set at "
            "obj['metrics'][2]; " + SUPPORTED_NOTE), got["gather_error"]
        assert got["bcast_error"].startswith(
            f"broadcast_object: peer {peer_ids[-1]} could not send its object: cannot send a "
            f"{__name__}.Opaque at obj[1]; "), got["bcast_error"]
        _same(got["after"], [(p, str(r)) for r, p in enumerate(peer_ids)])


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_objects_between_the_threads_of_one_node(n: int) -> None:
    results = ddp(range(n), burncoll.CollectiveConfig(timeout=10)).run(_exchange)
    _check(dict(enumerate(results)), list(range(n)))


def test_jax_peers_send_jax_arrays_and_get_numpy_arrays() -> None:
    jax = pytest.importorskip("jax")

    def work(comm: burncoll.Communicator) -> list[object]:
        x = jax.device_put(np.arange(comm.rank + 1, dtype=np.float32), comm.device)
        return comm.all_gather_object({"x": x, "t": (comm.rank,)})

    cfg = burncoll.CollectiveConfig(backend="jax", timeout=10)
    for got in ddp(range(2), cfg).run(work):
        _same(got, [{"x": np.arange(r + 1, dtype=np.float32), "t": (r,)} for r in range(2)])


def _run_nodes(address: str, nodes: int, devices: int, transport: str,
               fn: Callable[[burncoll.Communicator], Any]) -> dict[int, Any]:
    return run_nodes(address, nodes, devices, fn, transport=transport, timeout=10)


@pytest.mark.parametrize(("transport", "nodes", "devices"), [
    ("websocket", 2, 1), ("tcp", 3, 1), ("quic", 2, 2),
])
def test_objects_across_nodes(transport: str, nodes: int, devices: int) -> None:
    with burncoll.start_orchestrator(transport=transport, expected_nodes=nodes) as orch:
        results = _run_nodes(orch.address, nodes, devices, transport, _exchange)
    _check(results, list(range(nodes * devices)))


# -- encode and decode on their own -----------------------------------------------------------
def test_round_trip_keeps_types_order_and_values() -> None:
    for rank in range(4):
        _same(objects.decode(objects.encode(_obj(rank))), _obj(rank))
    deep: Any = "leaf"
    for _ in range(objects.MAX_DEPTH):
        deep = [deep]
    assert objects.decode(objects.encode(deep)) == deep


@pytest.mark.parametrize(("obj", "where"), [
    ({"a": [1, {2}]}, "a set at obj['a'][1]"),
    ([2**64], "an int outside -2**63..2**64-1 (18446744073709551616) at obj[0]"),
    ({"k": (-(2**63) - 1,)}, "at obj['k'][0]"),
    ({frozenset(): 1}, "a dict key that is a frozenset"),
    ({"x": np.array(["s"])}, "an array of dtype str32 (supported dtypes: float16"),
    ({"x": np.array([None])}, "an array of dtype object"),
    ([bytearray(b"x")], "a bytearray at obj[0]"),
    ((print,), "a builtin_function_or_method at obj[0]"),
    ({"m": np.ma.array([1])}, "a numpy.ma.MaskedArray at obj['m']"),
    ("\ud800", "a str that is not valid Unicode"),
])
def test_unsendable_objects_are_named_with_their_path(obj: object, where: str) -> None:
    with pytest.raises(UsageError, match="cannot send") as info:
        objects.encode(obj)
    assert where in str(info.value)


def test_numpy_strings_go_as_str_and_numpy_keys_are_named_with_the_fix() -> None:
    """Strings from a NumPy array (np.str_) were refused as an array of dtype str32."""
    labels = list(np.array(["cat", "dog"]))
    sent = {"labels": labels, labels[0]: np.bytes_(b"\x00x"), "pair": (np.str_("é"), 1)}
    got = objects.decode(objects.encode(sent))
    assert got == {"labels": ["cat", "dog"], "cat": b"\x00x", "pair": ("é", 1)}
    assert [type(x) for x in got["labels"]] == [str, str] and type(got["cat"]) is bytes
    values, counts = np.unique([3, 1, 3], return_counts=True)
    with pytest.raises(UsageError, match=re.escape("a dict key that is a numpy.int64 (keys may "
                                                   "be str, int, float, bool, None or tuples "
                                                   "of those; send a NumPy scalar as "
                                                   "key.item()) at obj[np.int64(1)]")):
        objects.encode(dict(zip(values, counts, strict=True)))
    assert objects.decode(objects.encode({k.item(): c for k, c in zip(values, counts,
                                                                       strict=True)})) == {
        1: np.int64(1), 3: np.int64(2)}


def test_too_deep_and_self_holding_objects_are_refused() -> None:
    loop: list[object] = []
    loop.append(loop)
    deep: Any = 0
    for _ in range(objects.MAX_DEPTH + 1):
        deep = (deep,)
    for obj in (loop, deep):
        with pytest.raises(UsageError, match=f"nested deeper than {objects.MAX_DEPTH}"):
            objects.encode(obj)


def _record(body: bytes, tag: int = 1) -> bytes:
    return struct.pack("<BQ", tag, len(body)) + body


def _pack(obj: object) -> bytes:
    return _record(msgpack.packb(obj, use_bin_type=True))


def _array(name: bytes, shape: tuple[int, ...], raw: bytes, code: int = 2) -> bytes:
    head = struct.pack(f"<B{len(name)}sB{len(shape)}Q", len(name), name, len(shape), *shape)
    return _pack(msgpack.ExtType(code, head + raw))


def _nested(levels: int) -> bytes:
    return _record(b"\x91" * levels + b"\xc0")


GOOD = objects.encode(_obj(2))
TUPLE = msgpack.ExtType(1, b"")
HOSTILE = {
    "empty": b"",
    "truncated header": GOOD[:5],
    "truncated body": GOOD[:-1],
    "trailing bytes": GOOD + b"\x00",
    "unknown tag": b"\x07" + GOOD[1:],
    "tag zero": b"\x00" + GOOD[1:],
    "size over the limit": struct.pack("<BQ", 1, objects.MAX_OBJECT_BYTES + 1) + b"\xc0",
    "two msgpack objects": _record(msgpack.packb(1) + msgpack.packb(2)),
    "truncated msgpack": _record(b"\x92\x01"),
    "invalid utf-8 str": _record(b"\xa2\xff\xfe"),
    "unknown dtype name": _array(b"float8", (1,), b"\x00"),
    "object dtype": _array(b"object", (1,), b"\x00" * 8),
    "non-ascii dtype name": _array(b"\xff\xfe", (1,), b"\x00"),
    "shape and bytes disagree": _array(b"float32", (3,), b"\x00" * 8),
    "huge declared shape": _array(b"float64", (2**40, 2**40), b"\x00" * 8),
    "huge empty shape": _array(b"float32", (0, 2**62), b""),
    "dimension of 2**63": _array(b"int8", (2**63, 0), b""),
    "too many dimensions": _array(b"int8", (1,) * (objects.MAX_NDIM + 1), b"\x00"),
    "empty array ext": _pack(msgpack.ExtType(2, b"")),
    "cut array header": _pack(msgpack.ExtType(2, b"\x07float32\x03" + b"\x00" * 8)),
    "scalar with dimensions": _array(b"int8", (1,), b"\x00", code=3),
    "unknown ext type": _pack(msgpack.ExtType(9, b"")),
    "timestamp ext": _pack(msgpack.Timestamp(1)),
    "tuple ext with data": _pack(msgpack.ExtType(1, b"x")),
    "tuple mark out of place": _pack([1, TUPLE]),
    "tuple mark alone": _pack(TUPLE),
    "tuple mark as a value": _pack({"a": TUPLE}),
    "lists too deep": _nested(objects.MAX_DEPTH + 1),
    "lists far too deep": _nested(100_000),
    "tuples too deep": _pack(functools.reduce(lambda acc, _: [TUPLE, acc], range(101), None)),
    "repeated map key": _record(b"\x82\xa1a\x01\xa1a\x02"),
    "list as a key": _record(b"\x81\x91\x01\x02"),
    "bytes as a key": _pack({b"k": 1}),
    "array scalar as a key": _record(b"\x81" + msgpack.packb(msgpack.ExtType(
        3, b"\x04int8\x00\x01")) + b"\x01"),
    "bool array holding 2": _array(b"bool", (3,), b"\x01\x02\x00"),
    "bool scalar holding 255": _array(b"bool", (), b"\xff", code=3),
    "32-bit float": _record(b"\xca\x3f\x80\x00\x00"),
    "reserved byte 0xc1": _record(b"\x91\xc1"),
    "tuple mark as ext16": _record(b"\x92\xc8\x00\x00\x01\x01"),
    "tuple mark as fixext": _record(b"\x92\xd4\x01\x00\x01"),
    "list of marks": _pack([TUPLE, TUPLE]),
    "tuple key without its mark": _record(b"\x81\x92\x01\x02\xc0"),
    "empty array as a key": _record(b"\x81\x90\xc0"),
    "map as a key": _record(b"\x81\x80\xc0"),
    "array value as a key": _record(b"\x81" + msgpack.packb(msgpack.ExtType(
        2, b"\x04int8\x01" + struct.pack("<Q", 1) + b"\x01")) + b"\xc0"),
    "declared past the end": _record(b"\xdd\x00\x01\x00\x00" + b"\xc0" * 100),
    "nested declarations past the end": _record(b"\xdc\x00\x80" * 100 + b"\xc0" * 200),
    "map declared past the end": _record(b"\xdf\x00\x00\x01\x00" + b"\x00" * 300),
    "ends inside a length": _record(b"\x91\xdd\x00"),
    "ends inside a str": _record(b"\x91\xd9\x10ab"),
    "tuple keys sharing a hash": objects.encode(dict.fromkeys(colliding_pairs(
        objects.MAX_SAME_HASH + 1))),
    "too many empty lists": _record(b"\xdd" + struct.pack(">I", 2**19 + 1) + b"\x90" * (2**19 + 1)),
    "refusal not utf-8": _record(b"\xff\xfe", tag=2),
    "refusal too long": _record(b"x" * (objects.MAX_MESSAGE_BYTES + 1), tag=2),
}


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_hostile_bytes_raise_protocol_error(name: str) -> None:
    with pytest.raises(ProtocolError):
        objects.decode(HOSTILE[name])


def test_limits_follow_the_cap_and_the_record() -> None:
    # a cap of 7: 7 containers and entries pass; 6 do not
    seven = [[], (), {"a": 1}, [[1]]]  # 1 + 1 + 1 + 2 (a dict and its entry) + 2
    assert objects.decode(objects.encode(seven), cap=7) == seven
    with pytest.raises(ProtocolError, match="more than 6 containers and dict entries"):
        objects.decode(objects.encode(seven), cap=6)
    # past the cap, one per 16 bytes of the record
    big = [("x" * 20, i) for i in range(2000)]  # 2,001 containers in ~54 KB
    assert objects.decode(objects.encode(big), cap=10) == big
    many = objects.encode([(i,) for i in range(2000)])  # 2,001 containers in 13.6 KB
    with pytest.raises(ProtocolError, match=f"more than {(len(many) - 9) // 16} containers"):
        objects.decode(many, cap=10)


def test_short_values_are_bounded_by_what_they_cost_decoded() -> None:
    """Values are counted by what they take in Python: 3M two-character strings (9 MB of
    record, ~180 MiB decoded) are refused by the sender with the fix and, forged, by the
    receiver; honest records of words, floats and ints pass unchanged."""
    many = ["ab"] * 3_000_000
    with pytest.raises(UsageError, match=r"the peers would refuse it: values that would take "
                                         r"about .* MiB decoded.*as a NumPy array or bytes"):
        objects.encode(many)
    body = msgpack.packb(many, use_bin_type=True)
    with pytest.raises(ProtocolError, match=f"over 12 times the record's {len(body)} bytes"):
        objects.decode(_record(body))
    words = [f"w{i}" for i in range(200_000)]
    floats = [i / 7 for i in range(1_000_000)]
    ints = list(range(10**6, 2 * 10**6))
    honest = {"words": words, "floats": floats, "ints": ints,
              "index": {w: i for i, w in enumerate(words[:100_000])}}
    assert objects.decode(objects.encode(honest)) == honest


def test_the_configured_cap_reaches_every_peer(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(burncoll.ConfigError, match="max_object_containers=0: expected an int"):
        burncoll.CollectiveConfig(max_object_containers=0)
    monkeypatch.setenv("BURNCOLL_MAX_OBJECT_CONTAINERS", "3")
    assert burncoll.CollectiveConfig().max_object_containers == 3

    def work(comm: burncoll.Communicator) -> tuple[object, str]:
        small = comm.all_gather_object([[comm.rank]])  # 2 containers each
        with pytest.raises(UsageError) as info:  # refused by its sender, named on every peer
            comm.all_gather_object([[[[comm.rank]]]] if comm.rank else 0)  # 4 on peer 1
        return small, str(info.value)

    for small, error in ddp(range(2), burncoll.CollectiveConfig(timeout=10)).run(work):
        assert small == [[[0]], [[1]]]
        assert error.startswith("all_gather_object: peer 1 could not send its object: cannot "
                                "send obj: it holds 4 lists, tuples, dicts and dict entries, "
                                "more than the peers accept (max_object_containers=3"), error
        assert "BURNCOLL_MAX_OBJECT_CONTAINERS" in error


def test_the_sender_refuses_what_its_peers_would() -> None:
    """An honest object past the cap is a UsageError on its sender that says what to do, never
    a ProtocolError on the others: the sender counts as the receivers' scan does."""
    seven = [[], (), {"a": 1}, [[1]]]
    for obj in (seven, {(1, (2, "x")): [b"", (3,)], -1: {}, "k": [[(i,)] for i in range(5)]},
                [np.zeros(3), np.float32(1), [[[[None]]]]], ((), [], {}, ((),), [[[]]])):
        for cap in range(1, 30):
            try:
                sent = objects.encode(obj, cap)
            except UsageError as exc:
                assert "raise max_object_containers on every peer" in str(exc)
                with pytest.raises(ProtocolError, match="containers and dict entries"):
                    objects.decode(objects.encode(obj), cap)
            else:
                _same(objects.decode(sent, cap), obj)
    with pytest.raises(UsageError, match="it holds 600001 lists, tuples, dicts and dict "
                                         "entries, more than the peers accept"):
        objects.encode([[i, i] for i in range(600_000)])


def test_honest_shapes_the_scan_reads_at_once_or_one_by_one() -> None:
    """Runs of small ints and of floats are read at once; everything else item by item."""
    for obj in ([1.5] * 100 + [None], [0, -32, 127, None, True, False] * 20,
                [1.0] * 50 + [2**40], [[(i, -i) for i in range(20)], {"k": [0.5] * 30}],
                {(1, (2, "x")): [b"", b"x" * 300], -1: -2, -2: -1, 0.0: "", "": 0},
                [(), [], {}, ((),), [[[]]]], "x" * 70_000, [np.zeros(3, bool), np.True_],
                {5 + i * (2**61 - 1): i for i in range(8)},
                {2.0 ** (61 * k): k for k in range(9)}, dict.fromkeys(colliding_pairs(64)),
                dict.fromkeys(itertools.product(range(-2, 3), repeat=4))):  # 16 share a hash
        _same(objects.decode(objects.encode(obj)), obj)


def test_mutated_bytes_never_raise_anything_but_protocol_error() -> None:
    rng = random.Random(7)
    for _ in range(1500):
        data = bytearray(GOOD)
        for _ in range(rng.randint(1, 4)):
            data[rng.randrange(len(data))] = rng.randrange(256)
        if rng.random() < 0.2:
            data = data[: rng.randrange(len(data))]
        try:
            objects.decode(bytes(data))
        except ProtocolError:
            pass
        except UsageError:
            assert data[0] == 2  # the tag became a refusal's: its reason is raised


def test_unpack_names_the_peer_whose_bytes_are_bad() -> None:
    ok = objects.encode("fine")
    with pytest.raises(ProtocolError, match=r"^g: the bytes from peer 5: truncated record"):
        objects.unpack(ok + ok[:-1], [4, 5], "g")
    with pytest.raises(ProtocolError, match=r"^g: the object from peer 4: unknown msgpack ext"):
        objects.unpack(HOSTILE["unknown ext type"] + ok, [4, 5], "g")
    with pytest.raises(UsageError, match=r"^g: peer 4 could not send its object: no; peer 5 .*: x"):
        objects.unpack(objects.refusal("no") + objects.refusal("x"), [4, 5], "g")
    assert objects.unpack(np.frombuffer(ok + ok, np.uint8), [4, 5], "g") == ["fine", "fine"]
