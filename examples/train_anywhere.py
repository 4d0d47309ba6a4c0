"""One training script for every launcher: the same file runs unchanged under each of these.

    python examples/train_anywhere.py                      # one node, 2 devices (threads)
    burncoll launch --nodes 2 examples/train_anywhere.py   # 2 node processes on this machine
    torchrun --standalone --nproc-per-node 2 examples/train_anywhere.py
    mpirun -np 2 python examples/train_anywhere.py
    srun --ntasks 2 python examples/train_anywhere.py      # inside a SLURM allocation

and on several hosts, once per host (R = 0 on the host named by --master-addr, 1 on the other)::

    export BURNCOLL_AUTH_TOKEN=...   # the same secret on every host
    burncoll launch --nnodes 2 --node-rank R --master-addr HOST0 --master-port 29400 \\
        examples/train_anywhere.py

Nothing in it names a launcher: ``CollectiveConfig()`` reads the node rank, the number of
nodes and the rendezvous address from the launcher's variables, and node 0 of a torchrun,
SLURM or mpirun job hosts the rendezvous itself. With ``--checkpoint-dir`` the run resumes
from its last checkpoint when a launcher restarts it (``burncoll launch --max-restarts 1``).

The model: linear regression by gradient descent with momentum on 240 fixed examples, in
float64; the global batch is all of them, split evenly among the replicas.
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from burncoll import CollectiveConfig, Communicator
from burncoll.train import FitResult, ddp

NDArray = np.ndarray[Any, Any]
Params = dict[str, NDArray]
EXAMPLES, FEATURES = 240, 8  # 240 rows divide evenly among 1-6, 8, 10, 12 ... replicas


def make_data(seed: int = 0) -> tuple[NDArray, NDArray]:
    """``EXAMPLES`` rows of ``FEATURES`` inputs and a noisy linear target."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(EXAMPLES, FEATURES))
    w = rng.normal(size=FEATURES)
    return x, x @ w + 0.5 + 0.01 * rng.normal(size=EXAMPLES)


def init_params() -> Params:
    return {"w": np.zeros(FEATURES), "b": np.zeros(())}


def loss_and_grad(params: Params, batch: tuple[NDArray, NDArray]) -> tuple[float, Params]:
    """Mean squared error on ``batch`` and its gradient."""
    x, y = batch
    error = x @ params["w"] + params["b"] - y
    n = x.shape[0]
    grads = {"w": 2.0 * x.T @ error / n, "b": np.asarray(2.0 * error.mean())}
    return float(np.mean(error**2)), grads


class Momentum:
    """Gradient descent with momentum, in the optax shape (``init`` / ``update``)."""

    def __init__(self, learning_rate: float = 0.05, beta: float = 0.9) -> None:
        self.learning_rate, self.beta = learning_rate, beta

    def init(self, params: Params) -> Params:
        return {k: np.zeros_like(v) for k, v in params.items()}

    def update(self, grads: Params, velocity: Params, params: Params | None = None
               ) -> tuple[Params, Params]:
        velocity = {k: self.beta * velocity[k] + grads[k] for k in grads}
        return {k: -self.learning_rate * v for k, v in velocity.items()}, velocity


def train(devices: int, steps: int, checkpoint_dir: str | None = None,
          checkpoint_every: int = 5,
          callback: Callable[[Communicator, int, Any], None] | None = None
          ) -> tuple[FitResult, int, int]:
    """Fit on this node's ``devices``; the result, this node's rank and the number of peers
    that took part in the last step (fewer than configured after an elastic restart)."""
    config = CollectiveConfig(backend="numpy", num_devices=devices)
    trainer = ddp(range(devices), config)
    world: list[int] = []

    def each_step(comm: Communicator, step: int, params: Any) -> None:
        world[:] = [comm.world_size]
        if callback is not None:
            callback(comm, step, params)

    keywords: dict[str, Any] = {}
    if checkpoint_dir is not None:
        keywords = {"checkpoint_dir": checkpoint_dir, "checkpoint_every": checkpoint_every}
    result = trainer.fit(init_params(), make_data(), loss_and_grad, Momentum(), steps=steps,
                         progress=False, callback=each_step, **keywords)
    nodes = world[0] // devices if world else (config.num_nodes or 1)
    return result, trainer.node_rank, nodes


def main(argv: Sequence[str] | None = None,
         callback: Callable[[Communicator, int, Any], None] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int,
                        default=int(os.environ.get("BURNCOLL_NUM_DEVICES", "2")),
                        help="devices (threads) per node; default $BURNCOLL_NUM_DEVICES, else 2")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--checkpoint-dir", default=None)
    parser.add_argument("--checkpoint-every", type=int, default=5)
    parser.add_argument("--result", default=None, help="node 0 writes the final state here")
    args = parser.parse_args(argv)
    result, rank, nodes = train(args.devices, args.steps, args.checkpoint_dir,
                                args.checkpoint_every, callback)
    print(f"node {rank} of {nodes}: final loss {result.losses[-1]:.6f}, replicas identical: "
          f"{'yes' if result.identical else 'NO'}", flush=True)
    if rank == 0 and args.result:
        state = {"params": {k: np.asarray(v).tolist() for k, v in result.params.items()},
                 "losses": result.losses, "nodes": nodes, "devices": args.devices,
                 "identical": result.identical}
        with open(args.result, "w") as f:
            json.dump(state, f)
    if not result.identical:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
