"""Node processes of a benchmark script (``benchmarks/``): the script runs itself once per
node, at a fresh orchestrator, and prints its result on node 0's last line."""

from __future__ import annotations

import argparse
import subprocess
import sys
from collections.abc import Sequence

from burncoll.orchestration.orchestrator import start_orchestrator

__all__ = ["node_script_parser", "node_zero_line"]


def node_zero_line(script: str, nodes: int, transport: str, argv: Sequence[str]) -> str:
    """Run ``script --node I --address ORCH --transport T *argv`` for every node ``I`` at an
    orchestrator started here; node 0's last line of output. A node that fails ends the
    benchmark (``SystemExit``)."""
    with start_orchestrator(transport=transport) as orch:
        procs = [subprocess.Popen(
            [sys.executable, script, "--node", str(i), "--address", orch.address,
             "--transport", transport, *argv], stdout=subprocess.PIPE, text=True)
            for i in range(nodes)]
        out = [p.communicate(timeout=600)[0] for p in procs]
    if any(p.returncode for p in procs):
        raise SystemExit("a node failed")
    lines = out[0].strip().splitlines()
    if not lines:
        raise SystemExit("node 0 printed no result")
    return lines[-1]


def node_script_parser(doc: str, iters: int) -> argparse.ArgumentParser:
    """The options of every such script: ``--nodes``, ``--iters`` (default ``iters``),
    ``--runs``, ``--transport``, and the ``--node`` / ``--address`` its node processes get;
    the description is ``doc``'s first line."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=2)
    parser.add_argument("--iters", type=int, default=iters)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--transport", default="tcp")
    parser.add_argument("--node", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--address", default=None, help=argparse.SUPPRESS)
    return parser
