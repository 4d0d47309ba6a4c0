"""Every operation across real node processes, through a real orchestrator on 127.0.0.1."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

import burncoll
from tests import forked

WORKER = Path(__file__).with_name("node_worker.py")
REPO = Path(__file__).resolve().parents[2]


def run_nodes(scenario: str, nodes: int, devices: int, local: str = "tree",
              global_: str = "ring", transport: str = "websocket", timeout: float = 20.0,
              ) -> list[dict[str, object]]:
    """Start an orchestrator and ``nodes`` processes (forked: ``tests/forked.py``); return
    every peer's JSON record."""
    env = dict(os.environ, TEST_TIMEOUT=str(timeout), PYTHONPATH=str(REPO))
    with burncoll.start_orchestrator(transport=transport) as orch:
        procs = [
            forked.start(WORKER, scenario, str(n), str(nodes), str(devices), orch.address, local,
                         global_, transport, stdout=forked.PIPE, stderr=forked.PIPE, env=env)
            for n in range(nodes)
        ]
        records: list[dict[str, object]] = []
        for p in procs:
            stdout, stderr = p.communicate(timeout=timeout * 4 + 30)
            records.extend(json.loads(line) for line in stdout.splitlines() if line.startswith("{"))
            if p.returncode not in (0, 17):
                raise AssertionError(f"node exited {p.returncode}: {stderr[-2000:]}")
    return records


_LOCAL = ["centralized", "tree", "ring"]
_GLOBAL = ["centralized", "tree", "ring"]
_SHAPES = [(2, 1), (2, 3), (3, 2), (4, 1)]
#: every pair of local and global strategy, on a rotating node/device layout
PAIRS = [
    (*_SHAPES[i % len(_SHAPES)], local, global_, "websocket")
    for i, (local, global_) in enumerate((lo, gl) for lo in _LOCAL for gl in _GLOBAL)
]

COMBOS = [
    *PAIRS,
    (2, 1, "tree", "ring", "websocket"),
    (4, 1, "tree:3", "tree:3", "websocket"),
    (3, 2, "tree", "ring", "websocket"),
    (2, 2, "ring", "ring", "websocket"),
    (2, 2, "tree", "ring", "quic"),
    (2, 2, "ring|tree", "ring", "websocket"),  # different local strategies per node
    (3, 3, "ring", "tree", "quic"),
    (3, 2, "auto", "auto", "websocket"),
    (3, 1, "centralized", "tree", "quic"),
    # the recursive doubling (issue 32): a fold and unfold around a core of 4, and a core of 4
    (5, 1, "tree", "doubling", "websocket"),
    (4, 2, "ring", "doubling", "tcp"),  # sharded: a doubling per shard, on its channel
    (3, 2, "auto", "doubling", "quic"),
]


@pytest.mark.parametrize(("nodes", "devices", "local", "global_", "transport"), COMBOS)
def test_every_operation_across_nodes(nodes: int, devices: int, local: str, global_: str,
                                      transport: str) -> None:
    records = run_nodes("every_op", nodes, devices, local, global_, transport)
    assert len(records) == nodes * devices
    for r in records:
        assert r["ok"], r


def test_a_local_ring_shards_the_global_all_reduce() -> None:
    records = run_nodes("sharded", 2, 3, "ring", "ring")
    assert len(records) == 6 and all(r["ok"] for r in records), records


def test_two_hundred_mixed_operations_up_to_4_mib() -> None:
    records = run_nodes("mixed", 3, 2, "tree", "ring", timeout=60)
    assert len(records) == 6 and all(r["ok"] for r in records), records


def test_mismatch_across_nodes_reaches_every_peer() -> None:
    records = run_nodes("mismatch", 3, 2, timeout=10)
    assert len(records) == 6
    for r in records:
        assert r["error"] == "MismatchError", r
        assert "float64[5]" in str(r["message"]) and "float64[4]" in str(r["message"])


def test_killed_node_makes_every_survivor_raise() -> None:
    """(Over QUIC too, where survivors wait for their timeout: with 4 strategy pairs in
    tests/reliability/test_node_faults.py::test_killed_node_makes_every_survivor_raise_naming_it.)"""
    records = run_nodes("kill", 3, 2, transport="websocket", timeout=5)
    survivors = [r for r in records if r["peer"] not in (2, 3)]
    assert len(survivors) == 4
    for r in survivors:
        assert r["error"] in ("PeerLost", "CollectiveTimeout"), r
        assert "node 1" in str(r["message"])
        assert float(str(r["elapsed"])) < 5 + 3
