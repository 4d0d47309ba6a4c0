"""``burncoll launch`` meets a torchrun user's habits: torchrun's variables in every node
process (consistent with burncoll's node ranks, without confusing burncoll's own launcher
detection), ``--nproc-per-node``, and a failure summary that comes at once.

Real launcher processes (``python -m burncoll.cli launch``), real node processes, real sockets
on 127.0.0.1. The node script (torchrun_style_node.py) reads RANK, WORLD_SIZE and LOCAL_RANK
and all-reduces over burncoll; its sums are checked against NumPy.
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.cli.test_launch_hosts import (
    clean_env,
    free_port,
    launch_argv,
    run_launchers,
    show,
)

NODE = Path(__file__).with_name("torchrun_style_node.py")
#: The nodes' collective timeout (BURNCOLL_TIMEOUT in clean_env): a failed run must end well
#: before it.
TIMEOUT = 30.0


def records(stdout: str) -> list[dict[str, Any]]:
    """The JSON line of each node (after its ``[node R] `` prefix), checked against it."""
    found = []
    for line in stdout.splitlines():
        match = re.match(r"\[node (\d+)\] (\{.*\})$", line)
        if match:
            record = json.loads(match.group(2))
            assert record["rank"] == int(match.group(1)), line
            found.append(record)
    return sorted(found, key=lambda r: r["rank"])


def expected_sum(nodes: int, devices: int) -> float:
    """What every peer's all-reduce gives: node r's peer p adds r * 10 + p (float64)."""
    return float(np.sum([r * 10.0 + r * devices + d for r in range(nodes)
                         for d in range(devices)], dtype=np.float64))


def check(found: list[dict[str, Any]], nodes: int, devices: int, per_host: int) -> None:
    """torchrun's variables on every node, as burncoll's ranks say, and exact sums."""
    assert [r["rank"] for r in found] == list(range(nodes)), found
    ports = {r["master_port"] for r in found}
    assert len(ports) == 1 and 0 < int(ports.pop()) < 65536, found
    for r in found:
        assert (r["world_size"], r["local_world_size"]) == (nodes, str(per_host)), r
        assert r["local_rank"] == r["rank"] % per_host, r
        assert r["group_rank"] == str(r["rank"] // per_host), r
        assert r["master_addr"] == "127.0.0.1", r
        # burncoll's own variables decide in the child: its launcher, its node rank
        assert (r["launcher"], r["node_rank"], r["num_nodes"]) == ("burncoll", r["rank"], nodes)
        assert r["sums"] == [expected_sum(nodes, devices)] * devices, r


@pytest.mark.parametrize("form", [["--nodes", "2"], ["--nproc-per-node", "3", "--standalone"]],
                         ids=["nodes", "nproc-per-node"])
def test_a_torchrun_script_reads_its_variables_on_one_machine(form: list[str]) -> None:
    [(code, out, err)] = run_launchers([launch_argv(*form, "--devices", "2", str(NODE))],
                                       clean_env())
    assert code == 0, show(code, out, err)
    nodes = int(form[1])
    check(records(out), nodes, devices=2, per_host=nodes)


def test_two_hosts_of_two_node_processes_each() -> None:
    port = free_port()
    argvs = [launch_argv("--nnodes", "2", "--nproc-per-node", "2", "--node-rank", str(host),
                         "--master-addr", "127.0.0.1", "--master-port", str(port),
                         "--devices", "2", str(NODE))
             for host in (1, 0)]
    results = run_launchers(argvs, clean_env())
    for code, out, err in results:
        assert code == 0, show(code, out, err)
    found = sorted((r for _, out, _ in results for r in records(out)), key=lambda r: r["rank"])
    check(found, nodes=4, devices=2, per_host=2)
    assert {r["master_port"] for r in found} == {str(port + 1)}


def test_torch_distributed_initializes_from_the_variables_alone() -> None:
    """``init_process_group`` with torchrun's variables: MASTER_PORT is free for torch's
    store, and RANK / WORLD_SIZE agree with the node processes."""
    pytest.importorskip("torch.distributed")
    [(code, out, err)] = run_launchers(
        [launch_argv("--nproc-per-node", "2", str(NODE.with_name("torch_distributed_node.py")))],
        clean_env())
    assert code == 0, show(code, out, err)
    found = records(out)
    assert [(r["rank"], r["world_size"]) for r in found] == [(0, 2), (1, 2)], out
    assert all(r["sum"] == 1.0 + 2.0 for r in found), found


def test_a_failing_node_is_summarized_at_once_and_the_waiting_ones_are_told() -> None:
    started = time.monotonic()
    [(code, out, err)] = run_launchers([launch_argv("--nodes", "3", str(NODE))],
                                       clean_env(TORCHRUN_STYLE_FAIL="1"))
    seconds = time.monotonic() - started
    assert code == 1, show(code, out, err)
    assert "burncoll launch: node 1 failed (exit code 1): ValueError: rank 1 gives up" in err, err
    assert "FAILED with exit code 1; node 1 failed first" in err, err
    assert "  node 1 (first failure): exit code 1: ValueError: rank 1 gives up" in err, err
    # the nodes waiting at the orchestrator heard why from it, and ended on their own
    for rank in (0, 2):
        assert re.search(rf"\[node {rank}\] .*CollectiveError: burncoll launch: node 1 failed "
                         r"\(exit code 1\): ValueError: rank 1 gives up", out), out
        assert f"  node {rank}: exit code 1: " in err, err
    assert "stopping" not in err, err
    assert seconds < TIMEOUT / 2, (seconds, err)


def test_a_node_exiting_with_a_code_and_one_stuck_elsewhere() -> None:
    """No traceback: the node's last line of output is its error. A node that is in no
    collective (it sleeps) cannot hear of the failure: it is stopped after the grace, with a
    line saying so."""
    started = time.monotonic()
    [(code, out, err)] = run_launchers(
        [launch_argv("--nodes", "2", str(NODE))],
        clean_env(TORCHRUN_STYLE_FAIL="1", TORCHRUN_STYLE_HOW="exit", TORCHRUN_STYLE_STUCK="0"))
    seconds = time.monotonic() - started
    assert code == 7, show(code, out, err)
    assert "node 1 failed (exit code 7): rank 1: bad input file; the other nodes get" in err, err
    assert "stopping node(s) 0: still running" in err, err
    assert "  node 0: stopped by the launcher (exit code -15 (SIGTERM))" in err, err
    assert seconds < TIMEOUT / 2, (seconds, err)
