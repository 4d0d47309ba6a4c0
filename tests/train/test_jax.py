"""DDP with JAX on 4 real JAX CPU devices (tests/conftest.py sets XLA_FLAGS): jax.grad,
optax, float64 results equal to single-device full-batch training."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

import burncoll
from burncoll.train import all_reduce_tree, ddp
from tests.train._util import bitwise_equal, ddp_threads, max_abs_diff

jax = pytest.importorskip("jax")
jnp = pytest.importorskip("jax.numpy")

STEPS = 40


@pytest.fixture(autouse=True)
def x64() -> Iterator[None]:
    """float64 for the 1e-10 comparison; restored afterwards for the other tests."""
    before = bool(jax.config.jax_enable_x64)
    jax.config.update("jax_enable_x64", True)
    try:
        yield
    finally:
        jax.config.update("jax_enable_x64", before)


@pytest.fixture
def devices() -> list[Any]:
    if len(jax.devices()) < 4:
        pytest.skip("needs 4 JAX devices (XLA_FLAGS=--xla_force_host_platform_device_count=4)")
    return list(jax.devices()[:4])


def jax_config() -> burncoll.CollectiveConfig:
    return burncoll.CollectiveConfig(backend="jax", num_devices=4, timeout=60.0)


def data(n: int = 128) -> tuple[np.ndarray[Any, Any], np.ndarray[Any, Any]]:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(n, 6))
    return x, np.tanh(x @ rng.normal(size=(6, 2)))


def init(key: int = 0) -> dict[str, Any]:
    k1, k2 = jax.random.split(jax.random.PRNGKey(key))
    return {
        "hidden": {"w": jax.random.normal(k1, (6, 16), jnp.float64) / 3, "b": jnp.zeros(16)},
        "out": [jax.random.normal(k2, (16, 2), jnp.float64) / 4, jnp.zeros(2)],
    }


def loss_fn(params: dict[str, Any], batch: tuple[Any, Any]) -> Any:
    x, y = batch
    h = jnp.tanh(x @ params["hidden"]["w"] + params["hidden"]["b"])
    w, b = params["out"]
    return jnp.mean((h @ w + b - y) ** 2)


value_and_grad = jax.jit(jax.value_and_grad(loss_fn))


def plain_sgd(params: Any, grads: Any) -> Any:
    return jax.tree_util.tree_map(lambda p, g: p - 0.2 * g, params, grads)


def on_host(tree: Any) -> Any:
    return jax.tree_util.tree_map(np.asarray, tree)


def test_all_reduce_tree_on_a_jax_pytree(devices: list[Any]) -> None:
    def worker(comm: burncoll.Communicator) -> Any:
        tree = jax.tree_util.tree_map(lambda a: a * (comm.rank + 1), init())
        out = all_reduce_tree(comm, tree, op="sum")
        assert all(leaf.devices() == {comm.device} for leaf in jax.tree_util.tree_leaves(out))
        return on_host(out)

    results = ddp(devices, jax_config()).run(worker)
    want = on_host(jax.tree_util.tree_map(lambda a: a * 10, init()))
    assert max_abs_diff(results[0], want) < 1e-12
    assert all(bitwise_equal(r, results[0]) for r in results)


def test_fit_with_jax_grad_equals_single_device_full_batch(devices: list[Any]) -> None:
    x, y = data()
    snapshots: dict[tuple[int, int], Any] = {}

    def record(comm: burncoll.Communicator, step: int, params: Any) -> None:
        snapshots[comm.rank, step] = on_host(params)

    result = ddp(devices, jax_config()).fit(
        init(), (x, y), value_and_grad, plain_sgd, steps=STEPS, progress=False, callback=record
    )
    params, losses = init(), []
    full = (jnp.asarray(x), jnp.asarray(y))
    for _ in range(STEPS):
        loss, grads = value_and_grad(params, full)
        losses.append(float(loss))
        params = plain_sgd(params, grads)
    assert max_abs_diff(on_host(result.params), on_host(params)) < 1e-10
    np.testing.assert_allclose(result.losses, losses, rtol=0, atol=1e-10)
    assert result.losses[-1] < result.losses[0] and result.identical
    for step in range(STEPS):
        for rank in range(1, 4):
            assert bitwise_equal(snapshots[rank, step], snapshots[0, step]), (rank, step)
    assert ddp_threads() == []


def test_fit_with_optax_adam(devices: list[Any]) -> None:
    optax = pytest.importorskip("optax")
    x, y = data()
    tx = optax.adam(1e-2)
    result = ddp(devices, jax_config()).fit(
        init(), (x, y), value_and_grad, tx, steps=STEPS, progress=False
    )
    params = init()
    state = tx.init(params)
    full = (jnp.asarray(x), jnp.asarray(y))
    for _ in range(STEPS):
        _, grads = value_and_grad(params, full)
        updates, state = tx.update(grads, state, params)
        params = optax.apply_updates(params, updates)
    assert max_abs_diff(on_host(result.params), on_host(params)) < 1e-10
    assert result.identical


def test_a_failing_jax_step_raises_and_leaves_no_thread(devices: list[Any]) -> None:
    def worker(comm: burncoll.Communicator) -> None:
        for step in range(5):
            if comm.rank == 3 and step == 2:
                raise ArithmeticError("rank 3 failed")
            all_reduce_tree(comm, init())

    with pytest.raises(ArithmeticError, match="rank 3 failed"):
        ddp(devices, jax_config()).run(worker)
    assert ddp_threads() == []
