"""Members told different things by their orchestrator fail at once, every one of them, with a
clear error -- never a hang, never a wrong result.

Every node builds its schedules from the orchestrator's table (who the members are, their
addresses, which host each runs on). An orchestrator that hands members different tables --
faulty, or run by a peer that holds the token (a group's orchestrator runs in its rank 0's
process) -- would make them build different schedules. Every member says the digest of its
table in its hello, and the member it dials compares it with its own. The fault is injected
with a test double of the orchestrator's ``Session.tables`` (what it tells each node); the
nodes, the connections and the orchestrator are the real ones.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

import burncoll
from burncoll.orchestration.waiting import Session
from burncoll.protocol.control import Table, TableEntry, encode
from tests.harness import run_nodes

NODES = 3
#: The node told something else about node 0.
MISLED = 2
TIMEOUT = 20.0


def _other_host(entry: TableEntry) -> TableEntry:
    host = entry.meta.get("host")
    return dataclasses.replace(entry, meta={**entry.meta, "host": "e" * 32 if host == "f" * 32
                                            else "f" * 32})


def _flipped(key: str) -> Callable[[TableEntry], TableEntry]:
    def flip(entry: TableEntry) -> TableEntry:
        return dataclasses.replace(entry, meta={**entry.meta, key: not entry.meta.get(key)})
    return flip


FAULTS: dict[str, Callable[[TableEntry], TableEntry]] = {
    "node 0 on another host": _other_host,
    "node 0 without caller sockets": _flipped("lanes"),
    "node 0 with a ring of its own": _flipped("sharded"),
}


def _mislead(monkeypatch: pytest.MonkeyPatch, change: Callable[[TableEntry], TableEntry]
             ) -> None:
    """The orchestrator tells node :data:`MISLED` ``change`` of node 0's entry."""
    real = Session.tables

    def tables(self: Session) -> list[bytes]:
        frames = real(self)
        nodes = [TableEntry(m.index, m.host, m.port, m.peer_ids, m.meta) for m in self.members]
        nodes[0] = change(nodes[0])
        frames[MISLED] = encode(Table(self.sid, MISLED, tuple(nodes), self.secret), self.sid)
        return frames

    monkeypatch.setattr(Session, "tables", tables)


def _run(timeout: float) -> tuple[dict[int, Any], float]:
    def work(comm: burncoll.Communicator) -> Any:
        return comm.all_reduce(np.full(4, comm.rank + 1.0))

    started = time.monotonic()
    with burncoll.start_orchestrator(transport="tcp", expected_nodes=NODES) as orch:
        results = run_nodes(orch.address, NODES, 1, work, transport="tcp", timeout=timeout)
    assert sorted(results) == list(range(NODES))
    return results, time.monotonic() - started


@pytest.mark.parametrize("fault", list(FAULTS))
def test_a_member_told_another_table_fails_every_member_at_once(
        fault: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every member registers into a MismatchError naming a member whose table differs (each
    finds one itself), well before the timeout."""
    _mislead(monkeypatch, FAULTS[fault])
    results, took = _run(TIMEOUT)
    for rank, got in results.items():
        assert isinstance(got, burncoll.MismatchError), (fault, rank, got)
        assert "holds another table of session" in str(got), (fault, rank, got)
        assert "node 2" in str(got), (fault, rank, got)  # the misled one, or the one told
    assert took < TIMEOUT / 2, (fault, took, results)


def test_a_member_told_a_wrong_address_is_named_by_the_others(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Told another port for node 0, node 2 cannot reach it: node 1 and node 2 find that
    their tables differ; node 0, which never hears from node 2, names it as the node that
    did not connect, at its timeout -- an error naming the member, never a hang."""
    _mislead(monkeypatch, lambda e: dataclasses.replace(e, port=e.port % 65535 + 1))
    results, _ = _run(4.0)
    for rank in (1, 2):
        assert isinstance(results[rank], burncoll.MismatchError), (rank, results[rank])
    assert isinstance(results[0], burncoll.CollectiveError), results[0]
    assert "node 2" in str(results[0]) and "did not connect" in str(results[0]), results[0]
