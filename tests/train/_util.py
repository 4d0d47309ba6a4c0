"""Helpers shared by the training tests: a small model with hand-written gradients."""

from __future__ import annotations

import threading
from typing import Any

import numpy as np

import burncoll
from burncoll.train import flatten_tree

NDArray = np.ndarray[Any, Any]

#: Thread-name prefix of DataParallel's worker threads.
DDP_THREAD_PREFIX = "burncoll-ddp-"


def config(num_devices: int = 4, timeout: float = 30.0, **kw: Any) -> burncoll.CollectiveConfig:
    return burncoll.CollectiveConfig(num_devices=num_devices, timeout=timeout, **kw)


def ddp_threads() -> list[str]:
    """Names of the DataParallel worker threads still alive."""
    return [t.name for t in threading.enumerate() if t.name.startswith(DDP_THREAD_PREFIX)]


def regression_data(n: int = 64, d: int = 5, seed: int = 0) -> tuple[NDArray, NDArray]:
    rng = np.random.default_rng(seed)
    return rng.normal(size=(n, d)), rng.normal(size=n)


def nested_params(d: int = 5, seed: int = 1) -> dict[str, Any]:
    """A nested structure: dicts, a list, a tuple, several shapes."""
    rng = np.random.default_rng(seed)
    return {
        "linear": {"w": rng.normal(size=(d,)), "scale": rng.normal(size=(1, 1))},
        "bias": [np.zeros(1), (rng.normal(size=(3,)), np.zeros((2, 2)))],
    }


def nested_grad(p: dict[str, Any], x: NDArray, y: NDArray) -> dict[str, Any]:
    """Gradient of the mean squared error of a model that uses every leaf of ``p``."""
    w, s = p["linear"]["w"], p["linear"]["scale"][0, 0]
    b0, (b1, b2) = p["bias"][0][0], p["bias"][1]
    pred = s * (x @ w) + b0 + b1.sum() + b2.sum()
    r = 2.0 * (pred - y) / len(y)
    gb = np.sum(r)
    return {
        "linear": {"w": s * (x.T @ r), "scale": np.array([[np.sum(r * (x @ w))]])},
        "bias": [np.array([gb]), (np.full(3, gb), np.full((2, 2), gb))],
    }


def nested_step(p: dict[str, Any], g: dict[str, Any], lr: float = 0.05) -> dict[str, Any]:
    return {
        "linear": {k: p["linear"][k] - lr * g["linear"][k] for k in p["linear"]},
        "bias": [
            p["bias"][0] - lr * g["bias"][0],
            tuple(a - lr * b for a, b in zip(p["bias"][1], g["bias"][1], strict=True)),
        ],
    }


def leaves(tree: Any) -> list[NDArray]:
    return [np.asarray(x) for x in flatten_tree(tree)[0]]


def max_abs_diff(a: Any, b: Any) -> float:
    return max(float(np.max(np.abs(x - y))) for x, y in zip(leaves(a), leaves(b), strict=True))


def bitwise_equal(a: Any, b: Any) -> bool:
    la, lb = leaves(a), leaves(b)
    return len(la) == len(lb) and all(
        x.dtype == y.dtype and x.shape == y.shape and x.tobytes() == y.tobytes()
        for x, y in zip(la, lb, strict=True)
    )
