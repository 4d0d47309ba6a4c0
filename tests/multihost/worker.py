"""A node of the multi-host tests: finds its place from the launcher, then all-reduces.

Started once per host, by ``burncoll launch --nnodes``, by torchrun, or with torchrun's
variables set by hand. It builds ``burncoll.CollectiveConfig()`` with nothing in the code (so
the node rank, the number of nodes, the rendezvous address and this node's address all come
from the environment), prints one ``MULTIHOST {json}`` line with what the config says, then
runs ``--devices`` peers with ``burncoll.train.ddp(...).run`` that all-reduce (sum) the
float64 array :func:`contribution` of their peer id, and prints a second line with every
peer's result. The test computes the reference; this script only reports.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from typing import Any

import numpy as np

import burncoll
from burncoll.train import ddp

#: Elements all-reduced; not a multiple of the number of peers, so ring chunks differ.
SIZE = 4099
#: The marker before each JSON report on stdout.
MARK = "MULTIHOST "


def contribution(peer_id: int, size: int = SIZE) -> np.ndarray[Any, Any]:
    """Peer ``peer_id``'s float64 array: integers below 2**40 scaled by 2**-20, so values
    have 41 significant bits (float32 would round them) and the sum of a few peers is exact
    in float64 whatever the order of the additions."""
    rng = np.random.default_rng(7919 + peer_id)
    whole = rng.integers(-(2**40), 2**40, size=size, dtype=np.int64)
    return whole.astype(np.float64) * 2.0**-20


def report(kind: str, **values: Any) -> None:
    """Print one ``MULTIHOST {"kind": ..., ...}`` line."""
    print(MARK + json.dumps({"kind": kind, **values}), flush=True)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, default=None,
                        help="peers (threads) of this node; default the config's num_devices")
    args = parser.parse_args(argv)
    config = burncoll.CollectiveConfig()
    devices = args.devices or config.num_devices
    report("config", node_rank=config.node_rank, num_nodes=config.num_nodes,
           node_address=config.node_address, global_address=config.global_address,
           host_orchestrator=config.host_orchestrator, devices=devices)
    trainer = ddp(range(devices), config)

    def reduce(comm: burncoll.Communicator) -> dict[str, Any]:
        total = comm.all_reduce(contribution(comm.peer_id))
        array = np.asarray(total)
        return {"peer_id": comm.peer_id, "world": list(comm.peer_ids),
                "dtype": str(array.dtype), "sum": array.tolist()}

    report("result", node_rank=trainer.node_rank, results=trainer.run(reduce))


if __name__ == "__main__":
    main()
