"""The host memory under attack (:mod:`burncoll.node.host_memory`,
:mod:`burncoll.node.host_mail`, :mod:`burncoll.node.host_reduce`), between real node processes
of one host through a real orchestrator (this file, run as a script, is one node).

Node 1 of 3 is a member holding the token with a test double in its process. At join it
offers, as its mapping, a file that is not a memfd (a regular file, a pipe), a memfd that is
unsealed or can still grow, one of the wrong size, node 0's own mapping, or a descriptor of
node 0's under its own name. During a host reduction (a size past the exchange's, 3 nodes: the
``HostReduce`` route) it writes past its data slot and its result chunk, posts a message in its
mail that runs past the mail's slot, posts a round header of another round or another
operation, raises its counter far past its messages, or is killed (``SIGKILL``) between the
rounds.

A file that is not a mapping at all (not a memfd of the offered name) is declined, as a file of
a process that has ended is: every node answers so, and the session forms without host memory
on every node, with exact results. A file that is named as a mapping but is not one a node
makes, or that was offered twice, fails the session at join; a malformed mail message fails
the operation; a killed node is lost -- on every honest node, naming node 1, within the
configured timeout, and no honest process crashes (``SIGBUS``). Where an operation completes,
its result is compared with NumPy's in float64 and is the same bits on every node.
"""

from __future__ import annotations

import dataclasses
import fcntl
import hashlib
import json
import mmap
import os
import re
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import burncoll
import burncoll.node.host_memory as host_memory_module
import burncoll.node.host_reduce as host_reduce_module
from burncoll.node.host_mail import SLOT_BYTES
from burncoll.protocol.wire import DataHeader, encode_data_header
from tests import forked

pytestmark = pytest.mark.host_memory  # (tests/security/conftest.py leaves host memory on)

_REPO = Path(__file__).resolve().parents[2]
NODES, HOSTILE = 3, 1
TIMEOUT = 10.0
#: 320 KB of float64 per call: past the exchange's 128 KiB for 3 nodes with host memory.
ELEMENTS = 40_000
CALLS = 2
#: The attacks at join that every node declines (the session forms without host memory)...
DECLINED = ("regular_file", "pipe", "another_process_descriptor")
#: ... those that fail the join, and what every honest node's error says ...
AT_JOIN = {"unsealed": "could still be resized", "growable": "could still be resized",
           "wrong_size": "of another user or size", "another_nodes_mapping": "offered too"}
#: ... and the attacks in a host reduction's round that fail it (the second call), and what
#: the errors may say. Each posts out of turn, over the slot of the first call's last round
#: that a node still behind may not have read yet: what that node finds there (this attack's
#: message, or the round after it) depends on how far it had come, and it fails in the first
#: call then.
IN_ROUND = ("past_the_mail_slot", "another_round", "another_operation", "counter_far_ahead")
OUT_OF_TURN = ("a buffer of the wrong size", "malformed message in the shared mail",
               "a part of another round", "different sequences of operations")


# -- the hostile member's test doubles (in node 1's process) ---------------------------------

def _memfd(token: str, size: int, seals: int) -> tuple[int, memoryview]:
    fd = os.memfd_create(f"burncoll-{token}", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, size)
    if seals:
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, seals)
    return fd, memoryview(mmap.mmap(fd, size))


def _bad_file(kind: str) -> Any:
    """A ``new_host_file`` that makes the file ``kind`` instead of a node's mapping."""
    def new_host_file(token: str, size: int, **kwargs: Any) -> tuple[int, memoryview]:
        if kind == "regular_file":
            fd, _ = tempfile.mkstemp(prefix=f"burncoll-{token}")
            os.ftruncate(fd, size)
            return fd, memoryview(mmap.mmap(fd, size))
        if kind == "pipe":  # (a FIFO is never opened on an offer's word: it would block)
            read, _write = os.pipe()
            return read, memoryview(mmap.mmap(-1, size))
        if kind == "unsealed":
            return _memfd(token, size, 0)
        if kind == "growable":  # sealed against shrinking, not growing
            return _memfd(token, size, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_SEAL)
        assert kind == "wrong_size"
        return _memfd(token, size - mmap.PAGESIZE,
                      fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)
    return new_host_file


def _mapping_of(pid: int) -> tuple[int, str]:
    """Node 0's mapping, found through ``/proc``: its descriptor there and its token."""
    deadline = time.monotonic() + TIMEOUT
    while time.monotonic() < deadline:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                found = re.match(r"/memfd:burncoll-([0-9a-f]{32})",
                                 os.readlink(f"/proc/{pid}/fd/{fd}"))
            except OSError:
                continue
            if found:
                return int(fd), found[1]
        time.sleep(0.01)
    raise AssertionError(f"process {pid} made no mapping")


def _header(self: Any, op: Any, round_: int, size: int = 0, **fields: Any) -> bytes:
    """A round's message header as :meth:`HostMemory.round` writes it (announcing ``size``
    bytes), with ``fields`` changed."""
    header = DataHeader(session=self.lanes.service.session or 0, seq=op.seq, op_kind=op.kind,
                        reduce_op=op.reduce_op, dtype=op.dtype, shape=op.shape, root=op.root,
                        src=self.me, round=round_, channel=0, chunk=0, offset=0,
                        chunk_bytes=size)
    return encode_data_header(dataclasses.replace(header, **fields), size)


def _post_raw(mail: Any, message: bytes) -> None:
    """Write ``message`` into the next slot of the mail, past the slot's end if it is longer,
    and raise the counter (what :meth:`SharedMail.post` refuses to do)."""
    k = mail.posted_count + 1
    at, mine = mail._slots[k & 1], mail._maps[mail._me]
    mine[at:at + len(message)] = message
    mail._counters[mail._me][0] = k
    mail.posted_count = k


def _in_round(self: Any, kind: str, op: Any, round_: int) -> None:
    """The attack ``kind`` at round ``round_`` of ``op`` (a host reduction's second round)."""
    mail = self.lanes.mail
    assert mail is not None, "the session has no shared mail"
    if kind == "killed":
        os.kill(os.getpid(), signal.SIGKILL)
    if kind == "counter_far_ahead":  # an empty post, numbered 1000 past the next
        mail.posted_count += 1000
        mail.post((b"",))
        return
    if kind == "past_the_mail_slot":  # announces and writes 2 slots' worth
        _post_raw(mail, _header(self, op, round_, 2 * SLOT_BYTES) + b"\xff" * 2 * SLOT_BYTES)
    elif kind == "another_round":
        mail.post((_header(self, op, round_ + 1),))
    else:
        assert kind == "another_operation"
        mail.post((_header(self, op, round_, seq=op.seq + 5),))


def _arm(kind: str, victim: int) -> None:
    """Put the test double of attack ``kind`` into this (node 1's) process."""
    cls = host_memory_module.HostMemory
    if kind in {"regular_file", "pipe", "unsealed", "growable", "wrong_size"}:
        host_memory_module.new_host_file = _bad_file(kind)
        return
    real_round, real_piece = cls.round, host_reduce_module._piece
    rounds: list[int] = []

    def hostile_round(self: Any, op: Any, check: Any, round_: int, payload: bytes = b"") -> Any:
        if round_ == 1 and kind in {"another_nodes_mapping", "another_process_descriptor"}:
            fd, token = _mapping_of(victim)
            if kind == "another_process_descriptor":  # node 0's file under this node's name
                token = payload.rstrip(b"\0").decode().split("/")[2]
            payload = f"{victim}/{fd}/{token}".encode().ljust(len(payload), b"\0")
        if round_ >= 3:
            rounds.append(round_)
            if kind in (*IN_ROUND, "killed") and len(rounds) == (4 if kind == "killed" else 3):
                _in_round(self, kind, op, round_)  # (the second call's first or second round)
        return real_round(self, op, check, round_, payload)

    def piece(memory: Any, op: Any, check: Any, round_: int, buf: Any, out: Any) -> None:
        if kind == "past_the_slots":  # garbage right past its piece and its result chunk
            mine = memory.maps[memory.me]
            ends = (host_memory_module.DATA_AT + buf.nbytes,
                    host_memory_module.RESULT_AT + buf.nbytes // NODES + 64)
            for end in ends:
                mine[end:end + (1 << 20)] = b"\xff" * (1 << 20)
        real_piece(memory, op, check, round_, buf, out)

    cls.round = hostile_round  # type: ignore[method-assign]
    host_reduce_module._piece = piece


# -- a node ----------------------------------------------------------------------------------

def _input(node: int, call: int) -> np.ndarray:
    return np.random.default_rng(100 * call + node).standard_normal(ELEMENTS)


def _node_main(argv: list[str]) -> None:
    """``NODE ORCH_ADDRESS KIND VICTIM_PID``: all-reduce ``CALLS`` times; print a record."""
    node, address, kind, victim = int(argv[0]), argv[1], argv[2], int(argv[3])
    if node == HOSTILE:
        _arm(kind, victim)
    record: dict[str, Any] = {"node": node, "results": []}
    started = time.monotonic()
    try:
        comm = burncoll.register(node, 0, burncoll.CollectiveConfig(
            num_devices=1, num_nodes=NODES, global_address=address, node_address="127.0.0.1",
            transport="tcp", timeout=TIMEOUT, shared_memory=True))
        record["host_memory"] = bool(comm._server.link.host_memory)  # type: ignore[attr-defined]
        for call in range(CALLS):
            started = time.monotonic()
            got = comm.all_reduce(_input(node, call))
            want = sum(_input(n, call) for n in range(NODES))
            record["results"].append({"sha": hashlib.sha256(got.tobytes()).hexdigest(),
                                      "error": float(np.max(np.abs(got - want)))})
        record["routes"] = [repr(p.route) for p in comm._server.plans.values()]  # type: ignore[attr-defined]
        comm.finish()
    except burncoll.CollectiveError as exc:
        record["raised"] = f"{type(exc).__name__}: {exc}"
        record["waited"] = time.monotonic() - started
    print(json.dumps(record), flush=True)


# -- the tests -------------------------------------------------------------------------------

def _run(kind: str) -> tuple[dict[int, dict[str, Any]], dict[int, int]]:
    """Three node processes, node 1 hostile with ``kind``: their records and exit codes."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("BURNCOLL_")}
    env["PYTHONPATH"] = str(_REPO)
    records: dict[int, dict[str, Any]] = {}
    codes: dict[int, int] = {}
    with burncoll.start_orchestrator(transport="tcp") as orch:
        procs = []
        for node in range(NODES):
            victim = procs[0].pid if procs else 0
            procs.append(forked.start(__file__, str(node), orch.address, kind, str(victim),
                                      stdout=forked.PIPE, stderr=forked.PIPE, env=env))
        for node, proc in enumerate(procs):
            stdout, stderr = proc.communicate(timeout=3 * TIMEOUT + 30)
            assert proc.returncode is not None
            codes[node] = proc.returncode
            for line in stdout.splitlines():
                if line.startswith("{"):
                    records[node] = json.loads(line)
            assert node in records or node == HOSTILE, (node, codes[node], stderr[-3000:])
    return records, codes


def _completed(records: dict[int, dict[str, Any]], codes: dict[int, int], host_memory: bool
               ) -> None:
    """Every node: no error, exact results, the same bits and routes everywhere."""
    for node in range(NODES):
        record = records[node]
        assert codes[node] == 0 and "raised" not in record, (codes, records)
        assert record["host_memory"] is host_memory, records
        assert [r["error"] < 1e-12 for r in record["results"]] == [True] * CALLS, records
        assert record["routes"] == records[0]["routes"], records
        assert record["results"] == records[0]["results"], records
    assert ("HostReduce()" in records[0]["routes"]) is host_memory, records


def _honest_nodes_name_node_1(records: dict[int, dict[str, Any]], codes: dict[int, int],
                              *why: str) -> None:
    for node in set(range(NODES)) - {HOSTILE}:
        record = records[node]
        assert codes[node] == 0, (codes, records)  # (no SIGBUS, no crash)
        assert "raised" in record and "node 1" in record["raised"], records
        assert not why or any(w in record["raised"] for w in why), records
        assert record["waited"] < TIMEOUT + 10, records  # (by the deadline, generously)


@pytest.mark.parametrize("kind", DECLINED)
def test_a_file_that_is_no_mapping_leaves_every_node_without_host_memory(kind: str) -> None:
    _completed(*_run(kind), host_memory=False)


@pytest.mark.parametrize("kind", list(AT_JOIN))
def test_a_hostile_mapping_fails_the_join_on_every_node_naming_its_member(kind: str) -> None:
    records, codes = _run(kind)
    _honest_nodes_name_node_1(records, codes, AT_JOIN[kind])
    for node in set(range(NODES)) - {HOSTILE}:
        assert records[node]["results"] == [] and "host_memory" not in records[node], records


def test_writing_past_its_slot_and_result_chunk_changes_no_result() -> None:
    _completed(*_run("past_the_slots"), host_memory=True)


@pytest.mark.parametrize("kind", IN_ROUND)
def test_a_hostile_round_fails_every_node_naming_its_member(kind: str) -> None:
    records, codes = _run(kind)
    _honest_nodes_name_node_1(records, codes, *OUT_OF_TURN)
    for node in set(range(NODES)) - {HOSTILE}:
        record = records[node]
        assert record["host_memory"] is True, records
        assert len(record["results"]) <= 1, records  # (what completed is right:)
        assert all(result["error"] < 1e-12 for result in record["results"]), records
        # found by this node, or by another before this node's next call (a node whose round
        # had every message in when the failure woke it completes it: what came in counts)
        raised = record["raised"]
        assert raised.startswith(("ProtocolError", "MismatchError")) or (
            raised.startswith("CollectiveAborted") and record["results"]
            and ("(ProtocolError" in raised or "(MismatchError" in raised)), records


def test_a_member_killed_between_the_rounds_is_lost_on_every_node() -> None:
    records, codes = _run("killed")
    assert codes[HOSTILE] == -signal.SIGKILL and HOSTILE not in records, codes
    _honest_nodes_name_node_1(records, codes)
    for node in set(range(NODES)) - {HOSTILE}:
        assert [r["error"] < 1e-12 for r in records[node]["results"]] == [True], records
        assert records[node]["raised"].startswith(("PeerLost", "CollectiveAborted")), records


if __name__ == "__main__":
    _node_main(sys.argv[1:])
