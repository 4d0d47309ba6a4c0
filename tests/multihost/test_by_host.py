"""Several node processes on each of several real hosts: the schedules are composed by host.

Two hosts (network namespaces on a bridge, tests/multihost/netns.py), two node processes on
each, started with torchrun's variables as ``torchrun --nnodes 2 --nproc-per-node 2`` starts
them. Every collective runs across the 4 nodes with arrays past the exchange's sizes; each
result is checked against a float64 NumPy reference computed here. The bytes each host's
interface sent during an 8 MiB all-reduce show the composition: inside a host the nodes move
data through shared memory, so each host sends what a ring between the 2 hosts sends (the
array once, ``2 (H - 1) / H * S``) where a flat ring of 4 nodes sends 1.5 times that out of
each host. Needs root (``ip netns add``); skipped otherwise.
"""

from __future__ import annotations

import json
import secrets
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.launchers.common import clean_env
from tests.multihost.by_host_worker import ELEMENTS, rows
from tests.multihost.netns import hosts
from tests.multihost.worker import MARK, contribution

pytestmark = pytest.mark.slow

PORT = 29400
TIMEOUT = 120.0
HOSTS, PER_HOST = 2, 2


def _start(tmp_path: Path, strategy: str, **more: str) -> tuple[list[int], list[str]]:
    """Run the 4 node processes to the end with ``strategy`` as the global all-reduce
    strategy (and the variables ``more``); their exit codes and outputs, by rank."""
    token = secrets.token_urlsafe(32)
    world = HOSTS * PER_HOST
    outputs: list[str] = []
    with hosts(HOSTS) as hs:
        procs, logs = [], []
        for host in hs:
            for local in range(PER_HOST):
                rank = host.index * PER_HOST + local
                env = clean_env(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(local),
                                LOCAL_WORLD_SIZE=str(PER_HOST), GROUP_RANK=str(host.index),
                                MASTER_ADDR=hs[0].address, MASTER_PORT=str(PORT),
                                BURNCOLL_AUTH_TOKEN=token, OMP_NUM_THREADS="1",
                                BURNCOLL_GLOBAL_ALL_REDUCE_STRATEGY=strategy, **more)
                log = tmp_path / f"rank{rank}.log"
                logs.append(log)
                with log.open("w") as sink:
                    procs.append(host.popen(
                        [sys.executable, "-m", "tests.multihost.by_host_worker", str(tmp_path)],
                        env, stdout=sink, stderr=subprocess.STDOUT))
        deadline = time.monotonic() + TIMEOUT
        try:
            codes = [p.wait(timeout=max(0.1, deadline - time.monotonic())) for p in procs]
        except subprocess.TimeoutExpired:
            codes = [-1] * world
        outputs = [log.read_text() for log in logs]
    return codes, outputs


def _shown(codes: list[int], outputs: list[str]) -> str:
    return "\n".join(f"--- rank {r} exited {c}\n{o}" for r, (c, o)
                     in enumerate(zip(codes, outputs, strict=True)))


def _report(output: str) -> dict[str, Any]:
    (line,) = [line for line in output.splitlines() if MARK in line]
    found: dict[str, Any] = json.loads(line.split(MARK, 1)[1])
    return found


def _load(tmp_path: Path, name: str, rank: int) -> np.ndarray[Any, Any]:
    loaded: np.ndarray[Any, Any] = np.load(tmp_path / f"{name}-{rank}.npy")
    return loaded


@pytest.mark.parametrize(("strategy", "out_of_each_host"), [("auto", (1.0, 1.2)),
                                                          ("ring", (1.45, 1.7))])
def test_every_collective_across_two_hosts_of_two_node_processes(
        tmp_path: Path, strategy: str, out_of_each_host: tuple[float, float]) -> None:
    """``auto`` composes by host; an explicit ``ring`` runs flat over the 4 nodes, as
    configured: both exact, the flat ring sending 1.5 times the bytes between the hosts."""
    codes, outputs = _start(tmp_path, strategy)
    assert codes == [0] * len(codes), _shown(codes, outputs)
    world = HOSTS * PER_HOST
    ranks = range(world)
    inputs = np.stack([contribution(r, ELEMENTS) for r in ranks])
    total = inputs.sum(axis=0, dtype=np.float64)  # exact: see worker.contribution
    maxima = np.stack([contribution(r + 10, 40_000) for r in ranks]).max(axis=0)
    blocks = inputs[:, : 4 * 50_001].reshape(world, 4, 50_001).sum(axis=0)
    gathered = np.concatenate([contribution(r + 20, rows(r) * 1000).reshape(rows(r), 1000)
                               for r in ranks])
    for r in ranks:
        got = _load(tmp_path, "all_reduce", r)
        assert np.array_equal(got, total), (
            f"rank {r}: {np.count_nonzero(got != total)} of {total.size} elements differ")
        assert np.array_equal(_load(tmp_path, "max", r), maxima), r
        assert np.array_equal(_load(tmp_path, "broadcast", r), inputs[1, :200_000]), r
        assert np.array_equal(_load(tmp_path, "reduce_scatter", r), blocks[r:r + 1]), r
        assert np.array_equal(_load(tmp_path, "all_gather", r), gathered), r
    assert np.array_equal(_load(tmp_path, "reduce3", 3), total[:300_000])
    assert np.array_equal(_load(tmp_path, "reduce0", 0), total[:5_000])
    assert not (tmp_path / "reduce3-0.npy").exists()  # reduce returns None off the root

    size = ELEMENTS * 8
    for rank, output in enumerate(outputs):
        # by the node's host, between two barriers: composed by host, a ring between the 2
        # hosts (the array once, plus headers); flat, a ring of 4 nodes (1.5 times that)
        sent = _report(output)["sent"]
        low, high = out_of_each_host
        assert low * size <= sent < high * size, (rank, sent / size, output)


def test_a_node_process_that_dies_is_named_by_every_other_at_once(tmp_path: Path) -> None:
    """Rank 3 (host 1's second node) exits without a word after the first all-reduce; the
    next operation, composed by host, fails on the 3 others with the loss of node 3, long
    before the 60 s timeout."""
    codes, outputs = _start(tmp_path, "auto", BY_HOST_DIES="3", BURNCOLL_TIMEOUT="60")
    assert codes == [0, 0, 0, 17], _shown(codes, outputs)
    for rank in range(3):
        report = _report(outputs[rank])
        # lost during the operation, or noticed before it (then the operation is refused
        # with that loss as the cause)
        assert report["error"] in ("PeerLost", "CollectiveAborted"), report
        assert "node 3" in report["message"] and "lost" in report["message"], report
        assert report["seconds"] < 15, report
