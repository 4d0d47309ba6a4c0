"""A node script whose peer 2 raises a user error between two all-reduces; every node prints
how its ``DataParallel.run`` ended. With a 120 s collective timeout, a node that waits for
the timeout instead of learning of the failure would outlive the test's deadline."""

from __future__ import annotations

import numpy as np

import burncoll
from burncoll.train import ddp


def fn(comm: burncoll.Communicator) -> None:
    comm.all_reduce(np.ones(3))
    if comm.peer_id == 2:
        raise ValueError("peer 2 gives up")
    comm.all_reduce(np.ones(3))


def main() -> None:
    try:
        ddp(range(2), burncoll.CollectiveConfig(timeout=120)).run(fn)
    except Exception as exc:
        print(f"node {burncoll.node_rank()} ended with {type(exc).__name__}: {exc}", flush=True)
        raise SystemExit(3) from None
    print(f"node {burncoll.node_rank()} ended without an error", flush=True)


if __name__ == "__main__":
    main()
