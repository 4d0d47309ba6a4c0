"""Python function calls per small all-reduce between node processes, counted on node 0.

Times on a shared machine move by a factor of 1.5 from one minute to the next; the number of
Python calls (and C calls) one operation makes does not, and on this path it is most of the
time: a count that goes down is a path that got shorter. ``--top N`` lists the N functions
called most (per operation).

    python benchmarks/calls_per_op.py [--nodes 2] [--bytes 8] [--ops 200] [--top 0]
"""

from __future__ import annotations

import argparse
import collections
import subprocess
import sys
from types import FrameType
from typing import Any

import numpy as np

import burncoll


def node(index: int, nodes: int, address: str, nbytes: int, ops: int, top: int) -> None:
    config = burncoll.CollectiveConfig(num_devices=1, num_nodes=nodes, global_address=address,
                                       node_address="127.0.0.1", transport="tcp", timeout=30)
    comm = burncoll.register(index, 0, config)
    x = np.ones(max(nbytes // 4, 1), np.float32)
    for _ in range(50):  # warm: plans and headers made, lanes' spinning settled
        comm.all_reduce(x)
    calls: collections.Counter[str] = collections.Counter()

    def count(frame: FrameType, event: str, arg: Any) -> None:
        if event == "call":
            code = frame.f_code
            calls["python"] += 1
            calls[f"{code.co_qualname} ({code.co_filename.rsplit('/', 1)[-1]})"] += 1
        elif event == "c_call":
            calls["C"] += 1

    if index == 0:
        sys.setprofile(count)
    for _ in range(ops):
        result = comm.all_reduce(x)
    sys.setprofile(None)
    assert np.array_equal(result, np.full_like(x, nodes)), "wrong result"
    comm.finish()
    if index == 0:
        print(f"per {nbytes} B all-reduce, {nodes} nodes: {calls.pop('python') / ops:.0f} "
              f"Python calls, {calls.pop('C') / ops:.0f} C calls")
        for name, n in calls.most_common(top):
            print(f"  {n / ops:5.1f}  {name}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=2)
    parser.add_argument("--bytes", type=int, default=8)
    parser.add_argument("--ops", type=int, default=200)
    parser.add_argument("--top", type=int, default=0)
    parser.add_argument("--node", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--address", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.node is not None:
        node(args.node, args.nodes, args.address, args.bytes, args.ops, args.top)
        return
    with burncoll.start_orchestrator(transport="tcp") as orch:
        procs = [subprocess.Popen(
            [sys.executable, __file__, "--node", str(i), "--address", orch.address,
             "--nodes", str(args.nodes), "--bytes", str(args.bytes), "--ops", str(args.ops),
             "--top", str(args.top)], stdout=subprocess.PIPE, text=True)
            for i in range(args.nodes)]
        outs = [p.communicate(timeout=600)[0] for p in procs]
    if any(p.returncode for p in procs):
        raise SystemExit("a node failed")
    print(outs[0].strip())


if __name__ == "__main__":
    main()
