"""Data-parallel training in pure NumPy: a softmax classifier with hand-written gradients.

Run it on 4 logical CPU devices of one node::

    python examples/ddp_numpy.py

or on several nodes, each running this script with its config from ``BURNCOLL_*`` variables::

    burncoll launch --nodes 2 --devices 2 examples/ddp_numpy.py

Each step draws a global minibatch of 256 examples, every device computes the gradient of
its 256 / world_size examples, ``all_reduce_tree`` averages the gradients of all parameters
in one collective, and every replica applies the same SGD-with-momentum update.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

import numpy as np

from burncoll import CollectiveConfig
from burncoll.train import ddp

NDArray = np.ndarray[Any, Any]
Params = dict[str, NDArray]
CLASSES = 3


def make_spirals(n_per_class: int = 512, seed: int = 0) -> tuple[NDArray, NDArray]:
    """Three interleaved 2-D spirals: ``x`` (n, 2) float64 and integer labels ``y`` (n,)."""
    rng = np.random.default_rng(seed)
    xs, ys = [], []
    for c in range(CLASSES):
        r = np.linspace(0.05, 1.0, n_per_class)
        t = np.linspace(c * 4.2, (c + 1) * 4.2, n_per_class) + 0.25 * rng.normal(size=n_per_class)
        xs.append(np.stack([r * np.sin(t), r * np.cos(t)], axis=1))
        ys.append(np.full(n_per_class, c))
    return np.concatenate(xs), np.concatenate(ys)


def init_params(hidden: int = 64, seed: int = 1) -> Params:
    """A 2-``hidden``-3 perceptron with a ReLU hidden layer."""
    rng = np.random.default_rng(seed)
    return {
        "w1": rng.normal(size=(2, hidden)),
        "b1": np.zeros(hidden),
        "w2": rng.normal(size=(hidden, CLASSES)) / np.sqrt(hidden),
        "b2": np.zeros(CLASSES),
    }


def forward(params: Params, x: NDArray) -> tuple[NDArray, NDArray]:
    """The hidden activations and the class probabilities."""
    h = np.maximum(x @ params["w1"] + params["b1"], 0.0)
    logits = h @ params["w2"] + params["b2"]
    logits -= logits.max(axis=1, keepdims=True)
    p = np.exp(logits)
    return h, p / p.sum(axis=1, keepdims=True)


def loss_and_grad(params: Params, batch: tuple[NDArray, NDArray]) -> tuple[float, Params]:
    """Mean cross-entropy on ``batch`` and its gradient, by hand (backpropagation)."""
    x, y = batch
    n = x.shape[0]
    h, p = forward(params, x)
    loss = -np.log(p[np.arange(n), y] + 1e-12).mean()
    d_logits = p.copy()
    d_logits[np.arange(n), y] -= 1.0
    d_logits /= n
    d_h = (d_logits @ params["w2"].T) * (h > 0)
    grads = {
        "w1": x.T @ d_h,
        "b1": d_h.sum(axis=0),
        "w2": h.T @ d_logits,
        "b2": d_logits.sum(axis=0),
    }
    return float(loss), grads


class Momentum:
    """SGD with momentum, in the optax shape (``init``/``update``) that ``fit`` accepts."""

    def __init__(self, learning_rate: float = 0.5, beta: float = 0.9) -> None:
        self.learning_rate = learning_rate
        self.beta = beta

    def init(self, params: Params) -> Params:
        return {k: np.zeros_like(v) for k, v in params.items()}

    def update(
        self, grads: Params, velocity: Params, params: Params | None = None
    ) -> tuple[Params, Params]:
        velocity = {k: self.beta * velocity[k] + grads[k] for k in grads}
        return {k: -self.learning_rate * v for k, v in velocity.items()}, velocity


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--devices", type=int, default=int(os.environ.get("BURNCOLL_NUM_DEVICES", "4")),
        help="devices on this node (default: $BURNCOLL_NUM_DEVICES, which `burncoll launch "
             "--devices` sets, else 4)")
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--batch-size", type=int, default=256, help="global batch")
    parser.add_argument("--no-progress", action="store_true")
    args = parser.parse_args()

    # The node's rank, the number of nodes and the addresses come from the environment
    # (`burncoll launch`, torchrun, SLURM or mpirun); the code sets only what it decides.
    config = CollectiveConfig(backend="numpy", num_devices=args.devices)
    x, y = make_spirals()
    trainer = ddp(range(config.num_devices), config)
    result = trainer.fit(
        init_params(),
        (x, y),
        loss_and_grad,
        Momentum(),
        steps=args.steps,
        batch_size=args.batch_size,
        progress=not args.no_progress,
        desc="numpy ddp",
    )
    accuracy = (forward(result.params, x)[1].argmax(axis=1) == y).mean()
    if trainer.node_rank == 0:
        print(f"final loss: {result.losses[-1]:.4f}  training accuracy: {accuracy:.1%}")
        print(f"replicas identical: {'yes' if result.identical else 'NO'}")
    if not result.identical:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
