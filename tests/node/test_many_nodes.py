"""A session of many node processes on one host (issue 32): 32 real node processes of one
device each meet at a real orchestrator (this file, run as a script, is one node), register
(every node dials many others from one address, a few at a time and in turn, so that no
listener evicts a dial: :mod:`burncoll.node.dialing`), all-reduce an 8 B and a 256 KiB array
(the host gather and the host reduction), meet at a barrier (the gather), broadcast 1 MiB from
a node and all-gather 128 KiB from each (large messages between region peers through their
stream regions, between the others on the socket:
:func:`burncoll.node.host_memory.region_peers`), each input its own,
compared with NumPy in float64, and hold no more open descriptors than
:func:`burncoll.node.descriptors.descriptors_needed` says -- 2 per other node once
registered. Then, in child processes, the descriptor limit: raised where the hard limit
allows, and a clear error at registration where it does not.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from typing import Any

import numpy as np
import pytest

import burncoll
from burncoll.node.descriptors import BASE, PER_NODE, descriptors_needed
from burncoll.node.host_memory import host_memory_bytes, region_peers, region_slots, regions_at
from burncoll.transport.shm import RING_BYTES
from tests.harness import run_node_processes

NODES = 32
SIZES = (2, 1 << 16)  # float32 elements: 8 B and 256 KiB


def _input(node: int, size: int) -> np.ndarray:
    return np.random.default_rng(1000 * node + size).standard_normal(size).astype(np.float32)


class _Evictions(logging.Handler):
    """Counts the dials a listener evicted: more pending from one address than it holds."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.count = 0

    def emit(self, record: logging.LogRecord) -> None:
        self.count += "max_pending_per_source" in record.getMessage()


def _node_main(argv: list[str]) -> None:
    """``NODE NODES ORCH_ADDRESS TRANSPORT DIES``: print one JSON record."""
    node, nodes, address, transport = int(argv[0]), int(argv[1]), argv[2], argv[3]
    config = burncoll.CollectiveConfig(num_devices=1, num_nodes=nodes, global_address=address,
                                       node_address="127.0.0.1", transport=transport,
                                       timeout=90.0)
    evictions = _Evictions()
    logging.getLogger("burncoll").addHandler(evictions)
    comm = burncoll.register(node, 0, config)
    record: dict[str, Any] = {"node": node, "error": 0.0, "evictions": evictions.count}
    for size in SIZES:
        got = comm.all_reduce(_input(node, size)).astype(np.float64)
        want = np.sum([_input(n, size).astype(np.float64) for n in range(nodes)], axis=0)
        record["error"] = max(record["error"], float(np.max(np.abs(got - want))))
    root = nodes // 2 + 1
    mine = _input(node, 1 << 18)
    got = comm.broadcast(mine if node == root else None, root=root)
    record["broadcast"] = bool(np.array_equal(got, _input(root, 1 << 18)))
    got = comm.all_gather(_input(node, 1 << 15))
    want = np.concatenate([_input(n, 1 << 15) for n in range(nodes)])
    record["all_gather"] = bool(np.array_equal(got, want))
    comm.barrier()
    plans = comm._server.plans.values()  # type: ignore[attr-defined]
    record["routes"] = [repr(plan.route) for plan in plans if hasattr(plan, "route")]
    memory = comm._server.link._host_memory  # type: ignore[attr-defined]
    record["region_peers"] = sorted(memory.region_peers)
    record["fds"] = len(os.listdir("/proc/self/fd"))
    comm.finish()
    print(json.dumps(record), flush=True)


def test_32_node_processes_of_one_host_register_and_all_reduce() -> None:
    records = run_node_processes(__file__, NODES, "tcp")
    assert sorted(r["node"] for r in records) == list(range(NODES))
    for record in records:
        assert record["error"] <= 1e-3, record  # (float32 sums of 32 normal values)
        assert record["broadcast"] and record["all_gather"], record
        assert record["evictions"] == 0, record  # (in turn, a few at a time: dialing.py)
        assert record["region_peers"] == region_peers(record["node"], NODES), record
        assert record["fds"] <= descriptors_needed(NODES), record
        # once registered, 2 per other node (the caller sockets closed: the host mail carries
        # every exchange; measured 2 x 31 + 11 = 73)
        assert record["fds"] <= 2 * (NODES - 1) + 16, record
        # auto's small all-reduce and barrier: the host gather; 256 KiB: the host reduction
        assert {"HostGather()", "HostReduce()"} <= set(record["routes"]), record


@pytest.mark.parametrize("count", [2, 3, 4, 5, 8, 31, 32, 64, 1000, 1024])
def test_region_peers_pair_up_and_grow_with_log_of_the_host_s_node_processes(count: int
                                                                             ) -> None:
    peers = [region_peers(p, count) for p in range(count)]
    assert all(p in peers[q] for p in range(count) for q in peers[p])  # (both ways)
    assert all(peers[p] == sorted(set(peers[p]) - {p}) for p in range(count))
    assert max(map(len, peers)) == region_slots(count) <= min(count - 1, 5 + count.bit_length())
    if count <= 4:
        assert all(len(p) == count - 1 for p in peers)  # (every other node)
    for p in range(count):  # the ring's neighbours, the tree's and recursive doubling's
        assert {(p - 1) % count, (p + 1) % count} - {p} <= set(peers[p])
        assert {p ^ 1, 2 * p + 1} & set(range(count)) - {p} <= set(peers[p])
    assert host_memory_bytes(count) == regions_at(count) + region_slots(count) * RING_BYTES
    assert host_memory_bytes(64, 4) == regions_at(64) + 3 * RING_BYTES  # (4 on its host)


_LIMIT = """
import resource, sys
import burncoll
from burncoll.node.descriptors import ensure_descriptors
soft, hard = {soft}, {hard}
resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
if {register}:
    config = burncoll.CollectiveConfig(num_devices=1, num_nodes={nodes}, global_address=
        "127.0.0.1:9", node_address="127.0.0.1", transport="tcp", timeout=5.0)
    try:
        burncoll.register(0, 0, config)
    except burncoll.ConfigError as exc:
        print("ConfigError:", exc)
else:
    print(ensure_descriptors({nodes}), resource.getrlimit(resource.RLIMIT_NOFILE)[0])
"""


def _limited(soft: int, hard: int, nodes: int, register: bool) -> str:
    script = _LIMIT.format(soft=soft, hard=hard, nodes=nodes, register=register)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=60, env=dict(os.environ))
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout.strip()


def test_a_node_raises_its_soft_descriptor_limit_as_far_as_its_session_needs() -> None:
    need = descriptors_needed(64)
    assert need == BASE + 63 * PER_NODE
    assert _limited(100, need + 10, 64, register=False) == f"{need} {need}"
    assert _limited(need + 5, need + 10, 64, register=False) == f"{need + 5} {need + 5}"


@pytest.mark.parametrize("nodes", [64, 1024])
def test_a_hard_descriptor_limit_too_low_fails_registration_naming_limit_need_and_fix(
        nodes: int) -> None:
    out = _limited(100, 100, nodes, register=True)
    need = descriptors_needed(nodes)
    assert out.startswith("ConfigError: register: a node of a session of "
                          f"{nodes} nodes needs about {need} open file descriptors"), out
    assert "at most 100 (its hard limit, RLIMIT_NOFILE" in out and "ulimit -Hn" in out, out


if __name__ == "__main__":
    _node_main(sys.argv[1:])
