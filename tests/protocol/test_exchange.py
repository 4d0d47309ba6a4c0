"""The exchange's protocol without I/O (:class:`burncoll.protocol.exchange.ExchangeCore`).

Every node of a world has its own core, as a node process builds it; their messages go from
node to node in memory, as a lane, the shared mail or a member connection carries them
(a message's bytes, or its header decoded as the event loop's reader does). Every node checks
every other node's message and reduces in node order: every op and several dtypes, worlds of
1 to 5 nodes, sizes from 0 elements, against NumPy folds in node order (the same bits on every
node) and float64 references. Then what an honest node never sends -- another operation,
call, session, sender, round or size, a message cut short, one whose header lies about its
length (or of which only the header was read), bytes that are no frame -- must each be refused
with an error that names the sender and says what was wrong.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from burncoll.dtypes import dtype_from_name
from burncoll.errors import CollectiveError, MismatchError, ProtocolError
from burncoll.levels import GlobalOp
from burncoll.ops import OpKind, ReduceOp, parse_reduce_op
from burncoll.protocol.checks import header_check
from burncoll.protocol.exchange import ExchangeCore
from burncoll.protocol.wire import FIXED_HEADER_BYTES, decode_data_head, encode_data_header

SESSION = 41
SEQ = 9
_UFUNC: dict[str, Callable[..., Any]] = {
    "sum": np.add, "mean": np.add, "max": np.maximum, "min": np.minimum, "prod": np.multiply}
_REFERENCE: dict[str, Callable[..., Any]] = {
    "sum": np.sum, "mean": np.sum, "max": np.max, "min": np.min, "prod": np.prod}


def describe(node: int) -> str:
    return f"node {node}"


def _op(reduce_op: str, x: np.ndarray, seq: int = SEQ) -> GlobalOp:
    return GlobalOp(seq=seq, kind=OpKind.ALL_REDUCE, reduce_op=parse_reduce_op(reduce_op),
                    dtype=x.dtype.name, shape=x.shape, root=-1, deadline=1e9, started=0.0)


def _core(op: GlobalOp, me: int, nodes: int, nbytes: int | None = None) -> ExchangeCore:
    size = nbytes if nbytes is not None else int(np.prod(op.shape)) * dtype_from_name(
        op.dtype or "uint8").itemsize
    return ExchangeCore(op, size, me=me, nodes=nodes, session=SESSION, describe=describe)


def _values(seed: list[int], count: int, dtype: str) -> np.ndarray:
    rng = np.random.default_rng(seed)
    if "int" in dtype:
        return rng.integers(0 if dtype.startswith("u") else -3, 4, size=count).astype(dtype)
    return rng.uniform(-2, 2, size=count).astype(dtype_from_name(dtype))


def _world(bufs: list[np.ndarray], name: str) -> list[np.ndarray]:
    """Every node's result: each sends its message to every other (in memory), checks every
    message it receives and reduces them."""
    nodes = len(bufs)
    cores = [_core(_op(name, b), me, nodes) for me, b in enumerate(bufs)]
    sent = [b"".join(bytes(part) for part in core.message(SEQ, b))
            for core, b in zip(cores, bufs, strict=True)]
    outs = []
    for me, core in enumerate(cores):
        assert len(sent[me]) == core.expected_bytes
        check = header_check(_op(name, bufs[me]), me, describe)
        received = {n: sent[n] for n in core.others}
        for node, data in received.items():
            assert core.check(_op(name, bufs[me]), check, node, data) is None, (me, node)
        out = np.full_like(bufs[me], 77)
        core.reduce_messages(_op(name, bufs[me]), bufs[me], received, out)
        outs.append(out)
    return outs


@pytest.mark.parametrize("nodes", [1, 2, 3, 5])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32", "float64", "int32",
                                   "uint8"])
def test_every_node_reduces_every_message_in_node_order(nodes: int, dtype: str) -> None:
    for count in (0, 1, 7, 1001):
        for name in _UFUNC:
            bufs = [_values([nodes, count, n], count, dtype) for n in range(nodes)]
            outs = _world(bufs, name)
            folded = functools.reduce(_UFUNC[name], bufs)  # x0 op x1 op ... in node order
            reference = _REFERENCE[name](np.stack([b.astype(np.float64) for b in bufs]),
                                         axis=0)
            tolerance = {"float16": 5e-2, "bfloat16": 2e-1, "float32": 1e-5}.get(dtype, 0.0)
            for out in outs:
                assert out.dtype == bufs[0].dtype and out.tobytes() == folded.tobytes()
                if "int" in dtype:  # (exact while nothing overflows: small values)
                    np.testing.assert_array_equal(out, reference.astype(dtype))
                else:
                    np.testing.assert_allclose(out.astype(np.float64), reference,
                                               rtol=tolerance, atol=tolerance)


def test_the_order_is_the_nodes_not_mine_first() -> None:
    """float32 addition is not associative: (1e8 + 1) - 1e8 is 0, 1e8 - 1e8 + 1 is 1."""
    bufs = [np.array([1e8], np.float32), np.array([1.0], np.float32),
            np.array([-1e8], np.float32)]
    assert [float(o[0]) for o in _world(bufs, "sum")] == [0.0, 0.0, 0.0]
    assert [float(o[0]) for o in _world(bufs[::-1], "sum")] == [0.0, 0.0, 0.0]


def test_operations_that_differ_only_in_number_share_a_core() -> None:
    x = np.ones(4, np.float32)
    assert ExchangeCore.signature(_op("sum", x, 1), 16) == ExchangeCore.signature(
        _op("sum", x, 2), 16)
    for other in (ExchangeCore.signature(_op("max", x), 16),
                  ExchangeCore.signature(_op("sum", x.astype(np.float64)), 16),
                  ExchangeCore.signature(_op("sum", x), 16, channel=1),
                  ExchangeCore.signature(_op("sum", x), 8)):
        assert other != ExchangeCore.signature(_op("sum", x), 16)
    core = _core(_op("sum", x, 1), 0, 2)
    for seq in (1, 2, 2**40):  # the header is restamped with each operation's number
        h, size = decode_data_head(memoryview(core.header(seq)))
        assert (h.seq, h.src, h.session, size, h.chunk_bytes) == (seq, 0, SESSION, 16, 16)


# -- what an honest node never sends ----------------------------------------------------------

X = np.arange(4, dtype=np.float32)


def _from_one(tamper: Callable[[bytes], bytes]) -> CollectiveError | None:
    """Node 0's verdict on node 1's message, as ``tamper`` makes it from the honest one."""
    op = _op("sum", X)
    honest = b"".join(bytes(p) for p in _core(op, 1, 2).message(SEQ, X))
    return _core(op, 0, 2).check(op, header_check(op, 0, describe), 1, tamper(honest))


def _reheader(message: bytes, payload_len: int | None = None, **fields: Any) -> bytes:
    h, size = decode_data_head(memoryview(message))
    payload = message[len(message) - size:]
    return encode_data_header(dataclasses.replace(h, **fields),
                              size if payload_len is None else payload_len) + payload


#: (how node 1's message is changed, the error's type, what it must say)
HOSTILE: dict[str, tuple[Callable[[bytes], bytes], type[CollectiveError], str]] = {
    "another_operation": (lambda m: _reheader(m, seq=SEQ + 5), MismatchError,
                          "different sequences of operations"),
    "another_dtype": (lambda m: _reheader(m, dtype="int32"), MismatchError,
                      "different arguments"),
    "another_op": (lambda m: _reheader(m, reduce_op=ReduceOp.MAX), MismatchError, "op=max"),
    "another_session": (lambda m: _reheader(m, session=SESSION + 1), ProtocolError,
                        f"of session {SESSION + 1}"),
    "another_sender": (lambda m: _reheader(m, src=2), ProtocolError, "names node 2"),
    "another_round": (lambda m: _reheader(m, round=1), ProtocolError, "another round"),
    "another_channel": (lambda m: _reheader(m, channel=1), ProtocolError, "another round"),
    "an_offset": (lambda m: _reheader(m, offset=4), ProtocolError, "overruns its chunk"),
    "a_later_part": (lambda m: _reheader(m, 12, offset=4)[:-4], ProtocolError, "wrong size"),
    "a_longer_buffer": (lambda m: _reheader(m, 20, chunk_bytes=20) + bytes(4), ProtocolError,
                        "wrong size"),
    "a_huge_size": (lambda m: _reheader(m, 2**40, chunk_bytes=2**40), ProtocolError,
                    "wrong size"),
    "its_header_alone": (lambda m: _reheader(m, 2**40, chunk_bytes=2**40)[:-16],
                         ProtocolError, "wrong size"),
    "a_shorter_payload": (lambda m: _reheader(m, 12, chunk_bytes=12)[:-4], ProtocolError,
                          "wrong size"),
    "cut_short": (lambda m: m[:-1], ProtocolError, "cut short"),
    "a_header_cut_short": (lambda m: m[:FIXED_HEADER_BYTES + 3], ProtocolError,
                           "malformed message on its caller socket"),
    "no_frame": (lambda m: b"\xff" * len(m), ProtocolError, "malformed message"),
    "nothing": (lambda m: b"", ProtocolError, "malformed message"),
}


@pytest.mark.parametrize("kind", list(HOSTILE))
def test_a_message_no_honest_node_sends_is_refused_naming_its_sender(kind: str) -> None:
    tamper, error, why = HOSTILE[kind]
    got = _from_one(tamper)
    assert isinstance(got, error) and why in str(got) and "node 1" in str(got), got
    assert _from_one(lambda m: m) is None  # (the honest message itself passes)


def test_a_decoded_header_is_checked_as_its_bytes_are() -> None:
    """The event loop's driver gets frames decoded: the same verdicts from the header."""
    op = _op("sum", X)
    core, check = _core(op, 0, 3), header_check(op, 0, describe)
    honest = b"".join(bytes(p) for p in _core(op, 2, 3).message(SEQ, X))
    h, size = decode_data_head(memoryview(honest))
    assert core.check_header(op, check, 2, h, size) is None
    assert "names node 2" in str(core.check_header(op, check, 1, h, size))  # another sender
    wrong = core.check_header(op, check, 2, h, size - 4, where="on its member connection")
    assert isinstance(wrong, ProtocolError) and "wrong size" in str(wrong)
    other = dataclasses.replace(h, chunk=1)
    found = core.check_header(op, check, 2, other, size, where="on its member connection")
    assert "chunk on its member connection" in str(found)


def test_the_rounds_of_the_shared_segments_are_checked_as_the_exchange_is() -> None:
    op = _op("sum", X)
    zero, one = _core(op, 0, 2, 64), _core(op, 1, 2, 64)
    check = header_check(op, 0, describe)
    mine = zero.round_header(op, 3, 64)
    theirs = one.round_header(op, 3, 64) + bytes(64)
    assert zero.check(op, check, 1, theirs, mine) is None
    late = one.round_header(op, 4, 64) + bytes(64)
    assert "another round" in str(zero.check(op, check, 1, late, mine))
    empty = _core(op, 1, 2, 0).round_header(op, 3, 0)  # (a round that says "done")
    done = _core(op, 0, 2, 0)
    assert done.check(op, check, 1, empty, done.round_header(op, 3, 0)) is None
    assert "wrong size" in str(zero.check(op, check, 1, empty, mine))
