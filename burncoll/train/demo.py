"""``burncoll demo``: data-parallel training of a small NumPy MLP, nothing to start by hand.

A tanh MLP with hand-written gradients learns a smooth function of 8 seeded inputs by
full-batch gradient descent on ``num_devices`` logical CPU devices, then reports the loss and
whether every replica ended bitwise identical. ``python -m burncoll.train.demo --help``.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from burncoll.config import CollectiveConfig
from burncoll.errors import CollectiveError
from burncoll.train.ddp import ddp, node_rank

__all__ = ["demo_node", "init_mlp", "main", "make_data", "mlp_loss_and_grad", "run_demo", "sgd"]

NDArray = np.ndarray[Any, Any]
Params = dict[str, NDArray]

#: Examples in the generated data set (divisible by 1, 2, 4, 8, 16 and 32 devices).
EXAMPLES = 1024
FEATURES = 8
HIDDEN = 32
LEARNING_RATE = 0.1


def make_data(seed: int = 0, n: int = EXAMPLES) -> tuple[NDArray, NDArray]:
    """``(x, y)``: ``n`` float64 examples, ``y = sin(x @ a) + 0.5 * cos(x @ b)`` plus noise."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, FEATURES))
    a, b = rng.normal(size=(2, FEATURES)) / np.sqrt(FEATURES)
    y = np.sin(x @ a) + 0.5 * np.cos(x @ b) + 0.05 * rng.normal(size=n)
    return x, y[:, None]


def init_mlp(seed: int = 1) -> Params:
    """The MLP's initial parameters: ``w1 (8, 32)``, ``b1 (32,)``, ``w2 (32, 1)``, ``b2 (1,)``."""
    rng = np.random.default_rng(seed)
    return {"w1": rng.normal(size=(FEATURES, HIDDEN)) / np.sqrt(FEATURES), "b1": np.zeros(HIDDEN),
            "w2": rng.normal(size=(HIDDEN, 1)) / np.sqrt(HIDDEN), "b2": np.zeros(1)}


def mlp_loss_and_grad(params: Params, batch: tuple[NDArray, NDArray]) -> tuple[float, Params]:
    """Mean squared error of ``tanh(x @ w1 + b1) @ w2 + b2`` on ``batch``, and its gradient."""
    x, y = batch
    h = np.tanh(x @ params["w1"] + params["b1"])
    err = h @ params["w2"] + params["b2"] - y
    n = x.shape[0]
    d_out = 2.0 * err / n
    d_h = (d_out @ params["w2"].T) * (1.0 - h * h)
    grads = {"w1": x.T @ d_h, "b1": d_h.sum(axis=0), "w2": h.T @ d_out, "b2": d_out.sum(axis=0)}
    return float(np.mean(err * err)), grads


def sgd(learning_rate: float = LEARNING_RATE) -> Any:
    """A plain ``update(params, grads) -> params``: one step of gradient descent."""

    def update(params: Params, grads: Params) -> Params:
        return {k: params[k] - learning_rate * grads[k] for k in params}

    return update


def demo_node(num_devices: int = 4, steps: int = 1000, progress: bool = True) -> int:
    """Train on this node's ``num_devices`` devices; 0 when the replicas end identical. The config
    comes from ``CollectiveConfig(num_devices=...)`` plus the ``BURNCOLL_*`` environment overrides,
    so the same function is what every node runs under ``burncoll launch`` (only node 0 reports)."""
    config = CollectiveConfig(backend="numpy", num_devices=num_devices)
    nodes = config.num_nodes or 1
    world = config.num_devices * nodes
    report = node_rank() == 0
    if report:
        print(f"burncoll demo: a {FEATURES}-{HIDDEN}-1 MLP (NumPy, hand-written gradients), "
              f"{EXAMPLES} examples, full-batch gradient descent, {steps} steps, "
              f"{world} replicas ({config.num_devices} devices x {nodes} node(s))", flush=True)
    started = time.perf_counter()
    try:
        trainer = ddp(range(config.num_devices), config)
        result = trainer.fit(init_mlp(), make_data(), mlp_loss_and_grad, sgd(), steps=steps,
                             progress=progress and report, desc="demo")
    except CollectiveError as exc:
        print(f"burncoll demo failed: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    elapsed = time.perf_counter() - started
    ok = result.identical and bool(result.losses) and bool(np.isfinite(result.losses[-1]))
    if report:
        first, last = result.losses[0], result.losses[-1]
        print(f"loss: {first:.4f} -> {last:.4f} in {steps} steps ({elapsed:.2f} s)")
        print(f"final loss: {last:.6f}")
        print(f"replicas identical: {'yes' if result.identical else 'NO'}")
    return 0 if ok else 1


def run_demo(num_devices: int = 4, steps: int = 1000, nodes: int = 1) -> int:
    """The demo on ``nodes`` local node processes of ``num_devices`` devices; an exit code."""
    if nodes < 1 or num_devices < 1 or steps < 1:
        print("burncoll demo: --nodes, --devices and --steps must be >= 1", file=sys.stderr)
        return 2
    if nodes == 1:
        return demo_node(num_devices, steps)
    return _run_multi_node(nodes, num_devices, steps)


def _run_multi_node(nodes: int, devices: int, steps: int) -> int:
    """Run :func:`demo_node` in ``nodes`` local processes through an orchestrator. The ``burncoll
    launch`` machinery starts an orchestrator on 127.0.0.1 and ``nodes`` processes of ``python -m
    burncoll.train.demo``, each with its ``BURNCOLL_*`` settings and a fresh shared auth token; 0
    when every process exits 0."""
    from burncoll.orchestration.launch import launch_nodes

    command = [sys.executable, "-m", "burncoll.train.demo", "--devices", str(devices),
               "--steps", str(steps)]
    return launch_nodes(command, nodes, devices)  # a fresh token of its own


def main(argv: Sequence[str] | None = None) -> int:
    """Parse ``--devices``, ``--steps``, ``--nodes`` and run the demo; an exit code."""
    parser = argparse.ArgumentParser(prog="burncoll demo", description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, default=4, help="devices per node (default 4)")
    parser.add_argument("--steps", type=int, default=1000, help="training steps (default 1000)")
    parser.add_argument("--nodes", type=int, default=1, help="local node processes (default 1)")
    args = parser.parse_args(argv)
    return run_demo(args.devices, args.steps, args.nodes)


if __name__ == "__main__":
    sys.exit(main())
