"""burncoll.jax inside ``jax.jit`` between 2 real node processes (one device each) meeting at
a real orchestrator: every collective, send/recv, a barrier, and gradients through them,
compared with NumPy in float64 (this file, run as a script, is one node)."""

from __future__ import annotations

import json
import sys
from typing import Any

import numpy as np
import pytest

from tests.harness import register_node_process, run_node_processes

NODES = 2


def data(node: int, rows: int = 5) -> np.ndarray:
    return ((np.arange(rows * 2, dtype=np.float32).reshape(rows, 2) + 3 * node) % 7) - 2


def weights(node: int) -> np.ndarray:
    return data(node + 5)


def _node_main(argv: list[str]) -> None:
    """``NODE NODES ORCH_ADDRESS TRANSPORT DIES``: print one JSON record of results."""
    import jax
    import jax.numpy as jnp

    import burncoll.jax as bj

    comm, node, _, _ = register_node_process(argv)
    other = 1 - node
    w = jnp.asarray(weights(node))

    @jax.jit
    def step(x: Any) -> dict[str, Any]:
        out = {op: bj.all_reduce(x, comm, op) for op in ("sum", "mean", "max")}
        out["gather"] = bj.all_gather(x, comm)
        out["scatter"] = bj.reduce_scatter(x, comm)
        out["bcast"] = bj.broadcast(x, 1, comm)
        bj.barrier(comm)
        if node == 0:
            bj.send(x + 100, other, comm, tag=3)
            out["recv"] = bj.recv(x, other, comm, tag=4)
        else:
            out["recv"] = bj.recv(x, other, comm, tag=3)
            bj.send(x - 100, other, comm, tag=4)
        out["grad_sum"] = jax.grad(lambda x: jnp.sum(w * bj.all_reduce(x, comm)))(x)
        out["grad_gather"] = jax.grad(
            lambda x: jnp.sum(jnp.concatenate([w, 2 * w]) * bj.all_gather(x, comm)))(x)
        return out

    got = step(jnp.asarray(data(node)))
    print(json.dumps({"node": node, **{k: np.asarray(v).tolist() for k, v in got.items()}}),
          flush=True)
    comm.finish()


@pytest.mark.slow
def test_jitted_collectives_and_their_gradients_between_two_node_processes() -> None:
    pytest.importorskip("jax")
    records = run_node_processes(__file__, NODES, "tcp")
    assert sorted(r["node"] for r in records) == [0, 1]
    xs = np.stack([data(n) for n in range(NODES)]).astype(np.float64)
    w_sum = np.sum([weights(n).astype(np.float64) for n in range(NODES)], axis=0)
    for r in records:
        n = r["node"]
        np.testing.assert_allclose(r["sum"], xs.sum(0))
        np.testing.assert_allclose(r["mean"], xs.mean(0))
        np.testing.assert_array_equal(r["max"], xs.max(0))
        np.testing.assert_array_equal(r["gather"], np.concatenate(xs))
        np.testing.assert_allclose(r["scatter"], np.array_split(xs.sum(0), NODES)[n])
        np.testing.assert_array_equal(r["bcast"], xs[1])
        np.testing.assert_array_equal(r["recv"], xs[1 - n] + (100 if n == 1 else -100))
        # the transpose of a sum all-reduce: a sum all-reduce of every node's cotangent
        np.testing.assert_allclose(r["grad_sum"], w_sum)
        # the transpose of an all-gather: a sum reduce-scatter (block n of [w; 2 w])
        np.testing.assert_allclose(r["grad_gather"], (n + 1) * w_sum)


if __name__ == "__main__":
    _node_main(sys.argv[1:])
