"""A node script written for torchrun: it reads only RANK, WORLD_SIZE and LOCAL_RANK (and, to
show them, the other variables torchrun sets), then all-reduces over burncoll with a config
that comes from the environment. Prints one JSON line per node.

With ``TORCHRUN_STYLE_FAIL=R``, node process R instead fails at once, before it registers:
``exit`` prints a line to stderr and exits 7, ``raise`` raises a ValueError; the others
register and wait for it. With ``TORCHRUN_STYLE_STUCK=R`` node R sleeps, in no collective.
"""

from __future__ import annotations

import json
import os
import sys
import time

import numpy as np

import burncoll
from burncoll.config.launchers import detect_launcher
from burncoll.train import ddp

RANK = int(os.environ["RANK"])
WORLD_SIZE = int(os.environ["WORLD_SIZE"])
LOCAL_RANK = int(os.environ["LOCAL_RANK"])


def main() -> None:
    how = os.environ.get("TORCHRUN_STYLE_HOW", "raise")
    if os.environ.get("TORCHRUN_STYLE_FAIL") == str(RANK):
        if how == "exit":
            print(f"rank {RANK}: bad input file", file=sys.stderr, flush=True)
            raise SystemExit(7)
        raise ValueError(f"rank {RANK} gives up")
    if os.environ.get("TORCHRUN_STYLE_STUCK") == str(RANK):
        time.sleep(600)
    config = burncoll.CollectiveConfig()
    found = detect_launcher()
    sums = ddp(range(config.num_devices), config).run(
        lambda comm: comm.all_reduce(np.full(3, float(RANK * 10 + comm.peer_id)))[0].item())
    print(json.dumps({
        "rank": RANK, "world_size": WORLD_SIZE, "local_rank": LOCAL_RANK,
        **{name.lower(): os.environ[name] for name in ("LOCAL_WORLD_SIZE", "GROUP_RANK",
                                                      "MASTER_ADDR", "MASTER_PORT")},
        "node_rank": config.node_rank, "num_nodes": config.num_nodes,
        "launcher": found.launcher if found else None, "sums": sums}), flush=True)


if __name__ == "__main__":
    main()
