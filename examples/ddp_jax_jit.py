"""Data-parallel training with the gradient all-reduce inside ``jax.jit`` (burncoll.jax), optax.

Run it on one node (4 JAX CPU devices, one thread each)::

    python examples/ddp_jax_jit.py

or on several nodes, each with its config from ``BURNCOLL_*`` environment variables::

    burncoll launch --nodes 2 --devices 2 examples/ddp_jax_jit.py

Each device holds a replica of an MLP's parameters and runs one jitted ``step``: the loss and
gradients of its shard of the global batch, one mean all-reduce of the flattened gradients
(``burncoll.jax.all_reduce``, inside the compiled step), and optax's Adam. Every replica
applies the same averaged gradients, so they stay identical, which the end checks.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--devices", type=int, default=4, help="JAX CPU devices on this node")
parser.add_argument("--steps", type=int, default=200)
parser.add_argument("--batch-size", type=int, default=256, help="global batch")
parser.add_argument("--no-progress", action="store_true", help="do not print the loss")
ARGS = parser.parse_args()

# Before jax is imported: as many CPU devices as this node uses (`burncoll launch --devices D`
# sets BURNCOLL_NUM_DEVICES, which wins over --devices here).
DEVICES = int(os.environ.get("BURNCOLL_NUM_DEVICES", ARGS.devices))
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("XLA_FLAGS", f"--xla_force_host_platform_device_count={DEVICES}")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.flatten_util import ravel_pytree  # noqa: E402

import burncoll.jax as bj  # noqa: E402
from burncoll import CollectiveConfig, Communicator  # noqa: E402
from burncoll.train import ddp  # noqa: E402

Params = dict[str, jax.Array]


def make_data(n: int = 2048, seed: int = 0) -> tuple[np.ndarray[Any, Any], np.ndarray[Any, Any]]:
    """Ten noisy clusters in 32 dimensions: float32 features and int32 labels."""
    rng = np.random.default_rng(seed)
    centers = rng.normal(size=(10, 32))
    y = rng.integers(0, 10, size=n)
    x = centers[y] + 2.5 * rng.normal(size=(n, 32))
    return x.astype(np.float32), y.astype(np.int32)


def init_params(key: jax.Array) -> Params:
    k1, k2 = jax.random.split(key)
    return {"w0": jax.random.normal(k1, (32, 64)) / jnp.sqrt(32.0), "b0": jnp.zeros(64),
            "w1": jax.random.normal(k2, (64, 10)) / 8.0, "b1": jnp.zeros(10)}


def loss_fn(params: Params, x: jax.Array, y: jax.Array) -> jax.Array:
    hidden = jax.nn.relu(x @ params["w0"] + params["b0"])
    log_p = jax.nn.log_softmax(hidden @ params["w1"] + params["b1"])
    return -jnp.mean(jnp.take_along_axis(log_p, y[:, None], axis=1))


def train(comm: Communicator) -> tuple[float, bool]:
    """One replica's training loop; its last global loss and whether every replica ended
    with the same parameters."""
    device = comm.device  # a JAX device: this config's backend is "jax"
    x, y = make_data()
    opt = optax.adam(1e-2)
    params = jax.device_put(init_params(jax.random.PRNGKey(0)), device)  # same everywhere
    opt_state = opt.init(params)

    @jax.jit
    def step(params: Params, opt_state: Any, x: jax.Array, y: jax.Array
             ) -> tuple[Params, Any, jax.Array]:
        loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
        flat, unravel = ravel_pytree(grads)
        grads = unravel(bj.all_reduce(flat, comm, "mean"))  # one collective for the model
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, bj.all_reduce(loss, comm, "mean")

    shard = ARGS.batch_size // comm.world_size
    rng = np.random.default_rng(1)  # the same batches on every replica; each takes its shard
    for i in range(ARGS.steps):
        rows = rng.choice(len(x), ARGS.batch_size, replace=False)
        mine = rows[comm.rank * shard:(comm.rank + 1) * shard]
        params, opt_state, loss = step(params, opt_state, jax.device_put(x[mine], device),
                                       jax.device_put(y[mine], device))
        if not ARGS.no_progress and comm.rank == 0 and i % 50 == 0:
            print(f"step {i}: loss {float(loss):.4f}", flush=True)
    flat = ravel_pytree(params)[0]
    replicas = np.asarray(bj.all_gather(flat[None], comm))
    return float(loss), bool((replicas == replicas[0]).all())


def main() -> None:
    # The node's rank, the number of nodes and the addresses come from the environment
    # (`burncoll launch`, torchrun, SLURM or mpirun); the code sets only what it decides.
    config = CollectiveConfig(backend="jax", num_devices=DEVICES)
    trainer = ddp(range(config.num_devices), config)
    results = trainer.run(train)
    if trainer.node_rank == 0:
        print(f"final loss: {results[0][0]:.4f}")
        print(f"replicas identical: {'yes' if all(same for _, same in results) else 'NO'}")
    if not all(same for _, same in results):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
