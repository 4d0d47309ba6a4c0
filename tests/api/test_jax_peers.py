"""JAX on 4 real CPU devices: results are JAX arrays on each peer's own device."""

from __future__ import annotations

import numpy as np
import pytest

import burncoll
from tests.harness import run_peers

jax = pytest.importorskip("jax")


@pytest.mark.parametrize("strategy", ["centralized", "tree", "ring"])
def test_every_operation_on_jax_cpu_devices(strategy: str) -> None:
    devices = burncoll.get_backend("jax").devices(4)
    assert len({d.id for d in devices}) == 4
    cfg = burncoll.CollectiveConfig(
        backend="jax", num_devices=4, local_all_reduce_strategy=strategy,
        local_reduce_strategy=strategy, local_broadcast_strategy=strategy, timeout=30,
    )
    host = [np.arange(12, dtype=np.float32).reshape(4, 3) * (i + 1) for i in range(4)]
    ref = np.sum(np.stack(host).astype(np.float64), axis=0)

    def work(c: burncoll.Communicator, i: int) -> dict[str, object]:
        x = jax.device_put(host[i], devices[i])
        return {
            "device": c.device,
            "sum": c.all_reduce(x),
            "mean": c.all_reduce(x, op="mean"),
            "max": c.reduce(x, root=3, op="max"),
            "bcast": c.broadcast(x if i == 1 else None, root=1),
            "rs": c.reduce_scatter(x),
            "ag": c.all_gather(x[: i + 1]),
        }

    results = run_peers(cfg, work)
    for i, r in enumerate(results):
        assert not isinstance(r, Exception), r
        for key in ("sum", "mean", "bcast", "rs", "ag"):
            value = r[key]
            assert isinstance(value, jax.Array), key
            assert value.devices() == {devices[i]}, (key, value.devices())
        np.testing.assert_allclose(np.asarray(r["sum"]), ref, rtol=1e-6)
        np.testing.assert_allclose(np.asarray(r["mean"]), ref / 4, rtol=1e-6)
        np.testing.assert_array_equal(np.asarray(r["bcast"]), host[1])
        np.testing.assert_allclose(np.asarray(r["rs"]), np.array_split(ref, 4)[i], rtol=1e-6)
        np.testing.assert_array_equal(
            np.asarray(r["ag"]), np.concatenate([h[: j + 1] for j, h in enumerate(host)]))
        if i == 3:
            np.testing.assert_array_equal(np.asarray(r["max"]), host[3])
        else:
            assert r["max"] is None
    assert all(np.asarray(r["sum"]).tobytes() == np.asarray(results[0]["sum"]).tobytes()
               for r in results)
