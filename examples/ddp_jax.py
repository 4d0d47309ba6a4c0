"""Data-parallel training with JAX: an MLP, ``jax.grad`` and optax, on 4 JAX CPU devices.

The data set is scikit-learn's handwritten digits (8x8 images, shipped inside the
scikit-learn package) when scikit-learn is installed, else generated data of the same shape.
Run it on one node::

    python examples/ddp_jax.py

or on several nodes, each with its config from ``BURNCOLL_*`` environment variables::

    burncoll launch --nodes 2 --devices 2 examples/ddp_jax.py

JAX on the CPU has one device unless ``XLA_FLAGS`` asks for more before jax is imported, so
this script sets it first. Each device holds a replica of the parameters; each step, every
device computes ``jax.value_and_grad`` on its shard of the global batch, ``all_reduce_tree``
averages the gradients (a few collectives for the whole model), and optax's Adam updates
every replica alike. Without optax, plain gradient descent is used.
"""

from __future__ import annotations

import argparse
import itertools
import os
from typing import Any

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--devices", type=int, default=4, help="JAX CPU devices on this node")
parser.add_argument("--steps", type=int, default=300)
parser.add_argument("--batch-size", type=int, default=256, help="global batch")
parser.add_argument("--no-progress", action="store_true")
ARGS = parser.parse_args()

# Before jax is imported: as many CPU devices as this node uses (`burncoll launch --devices D`
# sets BURNCOLL_NUM_DEVICES, which wins over --devices here).
DEVICES = int(os.environ.get("BURNCOLL_NUM_DEVICES", ARGS.devices))
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("XLA_FLAGS", f"--xla_force_host_platform_device_count={DEVICES}")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from burncoll import CollectiveConfig  # noqa: E402
from burncoll.train import ddp  # noqa: E402

Params = dict[str, Any]


def load_data(seed: int = 0) -> tuple[np.ndarray[Any, Any], np.ndarray[Any, Any], str]:
    """``(x, y, name)``: float32 features in [0, 1] (n, 64) and int32 labels 0..9."""
    try:
        from sklearn.datasets import load_digits  # type: ignore[import-not-found, unused-ignore]
    except ImportError:
        rng = np.random.default_rng(seed)
        centers = rng.uniform(0, 1, size=(10, 64))
        y = rng.integers(0, 10, size=1797)
        x = np.clip(centers[y] + 0.25 * rng.normal(size=(1797, 64)), 0, 1)
        return x.astype(np.float32), y.astype(np.int32), "generated digits-like data"
    digits = load_digits()
    x = (digits.data / 16.0).astype(np.float32)
    return x, digits.target.astype(np.int32), "scikit-learn digits"


def init_params(key: jax.Array, sizes: tuple[int, ...] = (64, 128, 10)) -> Params:
    """Weights and biases of an MLP with ReLU hidden layers."""
    params: Params = {}
    for i, (m, n) in enumerate(itertools.pairwise(sizes)):
        key, sub = jax.random.split(key)
        params[f"w{i}"] = jax.random.normal(sub, (m, n), jnp.float32) / jnp.sqrt(m)
        params[f"b{i}"] = jnp.zeros(n, jnp.float32)
    return params


def logits(params: Params, x: jax.Array) -> jax.Array:
    layers = len(params) // 2
    for i in range(layers):
        x = x @ params[f"w{i}"] + params[f"b{i}"]
        if i < layers - 1:
            x = jax.nn.relu(x)
    return x


def loss_fn(params: Params, batch: tuple[jax.Array, jax.Array]) -> jax.Array:
    """Mean softmax cross-entropy on ``batch``."""
    x, y = batch
    log_p = jax.nn.log_softmax(logits(params, x))
    return -jnp.mean(jnp.take_along_axis(log_p, y[:, None], axis=1))


def make_update() -> Any:
    """optax's Adam when optax is installed; else plain gradient descent as a function."""
    try:
        import optax
    except ImportError:

        def sgd(params: Params, grads: Params) -> Params:
            new: Params = jax.tree_util.tree_map(lambda p, g: p - 0.5 * g, params, grads)
            return new

        return sgd
    return optax.adam(1e-2)


def main() -> None:
    # The node's rank, the number of nodes and the addresses come from the environment
    # (`burncoll launch`, torchrun, SLURM or mpirun); the code sets only what it decides.
    config = CollectiveConfig(backend="jax", num_devices=DEVICES)
    x, y, name = load_data()
    batch = ARGS.batch_size
    trainer = ddp(range(config.num_devices), config)
    if trainer.node_rank == 0:
        print(f"{name}: {x.shape[0]} examples; {config.num_devices} JAX devices per node")
    result = trainer.fit(
        init_params(jax.random.PRNGKey(0)),
        (x, y),
        jax.jit(jax.value_and_grad(loss_fn)),
        make_update(),
        steps=ARGS.steps,
        batch_size=batch,
        progress=not ARGS.no_progress,
        desc="jax ddp",
    )
    params = jax.device_get(result.params)
    accuracy = float((np.argmax(logits(params, jnp.asarray(x)), axis=1) == y).mean())
    if trainer.node_rank == 0:
        print(f"final loss: {result.losses[-1]:.4f}  training accuracy: {accuracy:.1%}")
        print(f"replicas identical: {'yes' if result.identical else 'NO'}")
    if not result.identical:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
