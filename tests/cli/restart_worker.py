"""A node script for the restart tests of ``burncoll launch``, configured by ``BURNCOLL_*``.

Each of its ``BURNCOLL_NUM_DEVICES`` peers (``ddp``) all-reduces :func:`data` twice (steps 0
and 1) and prints one JSON line: ``{"node", "restart", "peer", "results": [step 0, step 1]}``.
With ``RESTART_TEST_CRASH=node:R`` and ``BURNCOLL_RESTART_COUNT=0``, node R kills itself with
SIGKILL after its first all-reduce, as a machine that dies mid-run; restarted, it runs through.
"""

from __future__ import annotations

import json
import os
import signal
import threading

import numpy as np

from burncoll import CollectiveConfig, Communicator
from burncoll.train import ddp

#: Elements of each all-reduced array.
SIZE = 64
#: All-reduces per peer.
STEPS = 2


def data(peer: int, step: int) -> np.ndarray:
    """What peer ``peer`` contributes at ``step``: exact in float64, different per peer."""
    return np.arange(SIZE, dtype=np.float64) * (peer + 1) + 1000.0 * step + peer


def crashes_here(node: int) -> bool:
    """Whether this node must die in this round (``RESTART_TEST_CRASH=node:R``, round 0)."""
    spec = os.environ.get("RESTART_TEST_CRASH", "")
    return (spec == f"node:{node}"
            and os.environ.get("BURNCOLL_RESTART_COUNT", "0") == "0")


def main() -> None:
    node = int(os.environ["BURNCOLL_NODE_RANK"])
    devices = int(os.environ["BURNCOLL_NUM_DEVICES"])
    crash = crashes_here(node)
    lock = threading.Lock()
    done_first = [0]

    def work(comm: Communicator) -> list[list[float]]:
        results: list[list[float]] = []
        for step in range(STEPS):
            results.append(np.asarray(comm.all_reduce(data(comm.peer_id, step))).tolist())
            if crash and step == 0:
                with lock:
                    done_first[0] += 1
                    last = done_first[0] == devices
                if last:  # every peer of this node is through step 0: die mid-run
                    os.kill(os.getpid(), signal.SIGKILL)
        return results

    parallel = ddp(range(devices), CollectiveConfig())
    for peer, results in zip(parallel.peer_ids, parallel.run(work), strict=True):
        print(json.dumps({"node": node, "peer": peer,
                          "restart": int(os.environ.get("BURNCOLL_RESTART_COUNT", "-1")),
                          "results": results}), flush=True)


if __name__ == "__main__":
    main()
