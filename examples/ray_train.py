"""Data-parallel training on Ray actors: 2 burncoll nodes of 2 devices each.

Run it on a local Ray instance (needs ``pip install 'burncoll[ray]'``)::

    python examples/ray_train.py

or on a running Ray cluster, one node per machine as far as the cluster has machines::

    python examples/ray_train.py --address auto --nodes 4

``burncoll.ray.run`` places one Ray actor per node, starts the orchestrator in node 0's actor
and hands every actor the ``BURNCOLL_*`` settings ``burncoll launch`` would give it, so
``train`` below is an ordinary burncoll training function: ``CollectiveConfig()`` finds its
node rank, node count, device count and rendezvous address in the environment. Each node
fits the MLP of ``burncoll demo`` by full-batch gradient descent on its 2 devices' shards.
"""

from __future__ import annotations

import argparse

import ray

import burncoll.ray
from burncoll import CollectiveConfig
from burncoll.train import ddp
from burncoll.train.demo import init_mlp, make_data, mlp_loss_and_grad, sgd


def train(steps: int) -> tuple[list[float], bool]:
    """One node's part: every step's loss, and whether the replicas ended identical."""
    config = CollectiveConfig(backend="numpy")  # nodes, devices, addresses: from BURNCOLL_*
    result = ddp(range(config.num_devices), config).fit(
        init_mlp(), make_data(), mlp_loss_and_grad, sgd(), steps=steps, progress=False
    )
    return result.losses, result.identical


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=2)
    parser.add_argument("--devices", type=int, default=2, help="devices per node")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--address", help="a Ray cluster to join (default: a local instance)")
    args = parser.parse_args()

    if args.address:
        ray.init(address=args.address)
    else:
        ray.init(num_cpus=args.nodes, include_dashboard=False, object_store_memory=100 * 2**20)
    try:
        results = burncoll.ray.run(
            train, args.steps, num_nodes=args.nodes, devices_per_node=args.devices
        )
    finally:
        ray.shutdown()
    losses, _ = results[0]
    identical = all(same for _, same in results) and all(other == losses for other, _ in results)
    print(f"nodes: {args.nodes} x {args.devices} devices")
    print(f"initial loss: {losses[0]:.4f}")
    print(f"final loss: {losses[-1]:.4f}")
    print(f"replicas identical: {'yes' if identical else 'NO'}")
    if not identical:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
