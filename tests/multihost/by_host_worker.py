"""A node process of the by-host tests: one of several on its host, one peer each.

Started with torchrun's variables (``RANK``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``,
``GROUP_RANK``, ...), so its place comes from the environment. It runs every collective
across the nodes with arrays past the exchange's sizes (so the schedules run, composed by
host), saves each result as ``<out>/<op>-<rank>.npy`` for the test to check against its own
reference, and prints one ``MULTIHOST {json}`` line with the bytes its host's network
interface sent during the all-reduce. With ``BY_HOST_DIES=R`` rank ``R`` exits after that
all-reduce, and the others report the error their next operation raised.
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

import burncoll
from burncoll.train import ddp
from tests.multihost.worker import contribution, report

#: float64 elements of the all-reduce: 8 MiB, past every exchange limit.
ELEMENTS = 1 << 20
#: The interface between the hosts (tests/multihost/netns.py); node processes of one host
#: reach each other through loopback or shared memory, never through it.
SENT = Path("/sys/class/net/eth0/statistics/tx_bytes")


def rows(rank: int) -> int:
    """Rank ``rank``'s rows in the all-gather: different on every rank."""
    return 3 + 2 * rank


def _sent() -> int:
    return int(SENT.read_text())


def run(comm: burncoll.Communicator, out: Path) -> dict[str, Any]:
    rank, world = comm.peer_id, len(comm.peer_ids)
    mine = contribution(rank, ELEMENTS)

    def save(name: str, value: object) -> None:
        if value is not None:
            np.save(out / f"{name}-{rank}.npy", np.asarray(value))

    comm.barrier()
    before = _sent()
    comm.barrier()
    save("all_reduce", comm.all_reduce(mine))
    comm.barrier()
    sent = _sent() - before
    if rank == int(os.environ.get("BY_HOST_DIES", "-1")):
        os._exit(17)  # gone without a word: the kernel closes its sockets
    started = time.monotonic()
    try:
        more(comm, out, save)
    except burncoll.CollectiveError as exc:
        return {"rank": rank, "world": world, "sent": sent, "error": type(exc).__name__,
                "message": str(exc), "seconds": time.monotonic() - started}
    return {"rank": rank, "world": world, "sent": sent}


def more(comm: burncoll.Communicator, out: Path, save: Callable[[str, object], None]) -> None:
    """Every other collective, each past the exchange's sizes."""
    rank = comm.peer_id
    mine = contribution(rank, ELEMENTS)
    save("max", comm.all_reduce(contribution(rank + 10, 40_000), "max"))
    save("reduce3", comm.reduce(mine[:300_000], root=3))
    save("reduce0", comm.reduce(mine[:5_000], root=0))
    save("broadcast", comm.broadcast(mine[:200_000] if rank == 1 else None, root=1))
    save("reduce_scatter", comm.reduce_scatter(mine[: 4 * 50_001].reshape(4, 50_001)))
    save("all_gather", comm.all_gather(contribution(rank + 20, rows(rank) * 1000)
                                       .reshape(rows(rank), 1000)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    args = parser.parse_args()
    config = burncoll.CollectiveConfig()
    trainer = ddp(range(1), config)
    (result,) = trainer.run(lambda comm: run(comm, args.out))
    report("by_host", node_rank=trainer.node_rank, **result)


if __name__ == "__main__":
    main()
