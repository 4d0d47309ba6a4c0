"""DataParallel.fit with NumPy: equal to single-device training, replicas identical."""

from __future__ import annotations

import sys
from typing import Any

import numpy as np
import pytest

import burncoll
from burncoll.train import ddp
from burncoll.train.demo import init_mlp, make_data, mlp_loss_and_grad, run_demo, sgd
from tests.train._util import bitwise_equal, config, ddp_threads, max_abs_diff

STEPS = 40


def reference_descent(
    params: Any, x: Any, y: Any, steps: int, batches: list[np.ndarray[Any, Any]] | None = None
) -> tuple[Any, list[float]]:
    """Single-device gradient descent on the whole batch (or the given index batches)."""
    update = sgd()
    losses = []
    for step in range(steps):
        idx = slice(None) if batches is None else batches[step]
        loss, grads = mlp_loss_and_grad(params, (x[idx], y[idx]))
        losses.append(loss)
        params = update(params, grads)
    return params, losses


def test_fit_on_4_shards_equals_full_batch_descent_and_replicas_stay_identical() -> None:
    x, y = make_data(n=256)
    snapshots: dict[tuple[int, int], Any] = {}

    def record(comm: burncoll.Communicator, step: int, params: Any) -> None:
        snapshots[comm.rank, step] = params

    result = ddp(range(4), config()).fit(
        init_mlp(), (x, y), mlp_loss_and_grad, sgd(), steps=STEPS, progress=False, callback=record
    )
    want, want_losses = reference_descent(init_mlp(), x, y, STEPS)
    assert max_abs_diff(result.params, want) < 1e-10
    np.testing.assert_allclose(result.losses, want_losses, rtol=0, atol=1e-10)
    assert result.losses[-1] < result.losses[0]
    assert result.identical
    for step in range(STEPS):
        for rank in range(1, 4):
            assert bitwise_equal(snapshots[rank, step], snapshots[0, step]), (rank, step)
    assert ddp_threads() == []


def test_minibatches_follow_the_seeded_schedule() -> None:
    x, y = make_data(n=200)
    batch, seed = 40, 7
    batches: list[np.ndarray[Any, Any]] = []
    for epoch in range(3):
        order = np.random.default_rng([seed, epoch]).permutation(200)
        batches += [order[k * batch : (k + 1) * batch] for k in range(200 // batch)]
    steps = 12  # crosses two epoch boundaries
    result = ddp(range(4), config()).fit(
        init_mlp(),
        (x, y),
        mlp_loss_and_grad,
        sgd(),
        steps=steps,
        batch_size=batch,
        seed=seed,
        progress=False,
    )
    want, want_losses = reference_descent(init_mlp(), x, y, steps, batches)
    assert max_abs_diff(result.params, want) < 1e-10
    np.testing.assert_allclose(result.losses, want_losses, rtol=0, atol=1e-10)


def test_rank_0_initial_parameters_are_broadcast() -> None:
    x, y = make_data(n=64)
    starts: dict[int, Any] = {}

    class Recording:
        """An optax-shaped optimizer (init/update) that records what each replica starts from."""

        def init(self, params: Any) -> None:
            starts[len(starts)] = params

        def update(self, grads: Any, state: None, params: Any = None) -> tuple[Any, None]:
            return {k: -0.1 * g for k, g in grads.items()}, None

    result = ddp(range(4), config()).fit(
        init_mlp(seed=3), (x, y), mlp_loss_and_grad, Recording(), steps=2, progress=False
    )
    assert all(bitwise_equal(s, init_mlp(seed=3)) for s in starts.values())
    want, _ = reference_descent(init_mlp(seed=3), x, y, 2)
    assert max_abs_diff(result.params, want) < 1e-12


def test_batches_that_do_not_divide_among_replicas_are_refused() -> None:
    x, y = make_data(n=66)
    dp = ddp(range(4), config())
    with pytest.raises(burncoll.UsageError, match=r"66 examples.*multiple of 4"):
        dp.fit(init_mlp(), (x, y), mlp_loss_and_grad, sgd(), steps=1, progress=False)
    with pytest.raises(burncoll.UsageError, match="batch_size has 30 examples"):
        dp.fit(init_mlp(), (x, y), mlp_loss_and_grad, sgd(), steps=1, batch_size=30)
    with pytest.raises(burncoll.UsageError, match="share their first dimension"):
        dp.fit(init_mlp(), (x, y[:10]), mlp_loss_and_grad, sgd(), steps=1)


def test_a_failing_grad_fn_raises_and_leaves_no_thread() -> None:
    x, y = make_data(n=64)

    def grad_fn(params: Any, batch: Any) -> Any:
        if batch[0].shape[0] == 16 and batch[0][0, 0] == x[32, 0]:  # rank 2's shard
            raise FloatingPointError("diverged on rank 2")
        return mlp_loss_and_grad(params, batch)

    with pytest.raises(FloatingPointError, match="diverged on rank 2"):
        ddp(range(4), config()).fit(init_mlp(), (x, y), grad_fn, sgd(), steps=3, progress=False)
    assert ddp_threads() == []


@pytest.mark.parametrize("terminal", [True, False])
def test_progress_shows_the_loss(capsys: pytest.CaptureFixture[str],
                                 monkeypatch: pytest.MonkeyPatch, terminal: bool) -> None:
    """A tqdm bar on a terminal; plain lines otherwise (a log, ``burncoll launch``'s
    prefixed output), where each of a bar's redraws would become a line."""
    pytest.importorskip("tqdm")
    monkeypatch.setattr(sys.stderr, "isatty", lambda: terminal)
    x, y = make_data(n=64)
    ddp(range(2), config(num_devices=2)).fit(
        init_mlp(), (x, y), mlp_loss_and_grad, sgd(), steps=5, desc="unit"
    )
    err = capsys.readouterr().err
    if terminal:
        assert "unit" in err and "loss=" in err and "5/5" in err
    else:
        assert "unit: step 5/5 loss" in err and "loss=" not in err


def test_demo_trains_and_reports_identical_replicas(capsys: pytest.CaptureFixture[str]) -> None:
    assert run_demo(num_devices=4, steps=100) == 0
    out = capsys.readouterr().out
    assert "final loss:" in out and "replicas identical: yes" in out
