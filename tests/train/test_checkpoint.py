"""fit's checkpoint/resume: a run killed and started again ends bitwise where an undisturbed
run ends; bad, corrupt and foreign checkpoints, another run's (seed, batch, data) and one
beyond ``steps`` raise a clear UsageError on every peer; temp files of other writers stay."""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import burncoll
from burncoll.train import ddp
from burncoll.train.checkpoint import (
    CHECKPOINT_FILE,
    STALE_TEMP_SECONDS,
    Checkpointer,
    RunInfo,
    checkpointer,
    read_checkpoint,
    write_checkpoint,
)
from burncoll.train.demo import init_mlp, make_data, mlp_loss_and_grad, sgd
from tests.train._util import bitwise_equal, config, ddp_threads, max_abs_diff

STEPS = 10
BATCH = 32  # 64 examples: 2 steps per epoch, so 10 steps cross 4 epoch boundaries
DEVICES = 2


class Crash(RuntimeError):
    """The failure a test injects to kill a run."""


class Counter:
    """A grad_fn that counts its calls (from every peer's thread)."""

    def __init__(self) -> None:
        self.calls = 0
        self._lock = threading.Lock()

    def __call__(self, params: Any, batch: Any) -> Any:
        with self._lock:
            self.calls += 1
        return mlp_loss_and_grad(params, batch)


class Momentum:
    """A tiny optax-shaped optimizer with state: heavy-ball momentum with a bias correction
    that uses a step count (a Python int leaf, so non-array state leaves are covered)."""

    def __init__(self, lr: float = 0.02, beta: float = 0.8) -> None:
        self.lr, self.beta = lr, beta

    def init(self, params: dict[str, Any]) -> dict[str, Any]:
        return {"count": 0, "velocity": {k: np.zeros_like(v) for k, v in params.items()}}

    def update(self, grads: Any, state: dict[str, Any], params: Any = None) -> tuple[Any, Any]:
        count = state["count"] + 1
        v = {k: self.beta * state["velocity"][k] + g for k, g in grads.items()}
        scale = -self.lr / (1.0 - self.beta**count)
        return {k: scale * x for k, x in v.items()}, {"count": count, "velocity": v}


def run(
    checkpoint_dir: Path | None,
    steps: int = STEPS,
    *,
    update: Any = None,
    grad_fn: Any = mlp_loss_and_grad,
    crash_at: int | None = None,
    params: Any = None,
    every: Any = 3,
    seed: int = 5,
    batch_size: int | None = BATCH,
    data: Any = None,
    devices: int = DEVICES,
) -> burncoll.train.FitResult:
    def callback(comm: burncoll.Communicator, step: int, p: Any) -> None:
        if step == crash_at:
            raise Crash(f"killed at step {step}")

    return ddp(range(devices), config(num_devices=devices, timeout=10.0)).fit(
        init_mlp() if params is None else params, make_data(n=64) if data is None else data,
        grad_fn, sgd() if update is None else update, steps=steps, batch_size=batch_size,
        seed=seed, progress=False, callback=callback, checkpoint_dir=checkpoint_dir,
        checkpoint_every=every,
    )


def reference(steps: int, update: Any) -> tuple[Any, list[float]]:
    """Single-device NumPy float64 training on the same seeded minibatch schedule."""
    x, y = make_data(n=64)
    params, state, losses = init_mlp(), None, []
    if hasattr(update, "init"):
        state = update.init(params)
    for step in range(steps):
        epoch, k = divmod(step, 64 // BATCH)
        idx = np.random.default_rng([5, epoch]).permutation(64)[k * BATCH : (k + 1) * BATCH]
        loss, grads = mlp_loss_and_grad(params, (x[idx], y[idx]))
        losses.append(loss)
        if state is None:
            params = update(params, grads)
        else:
            updates, state = update.update(grads, state, params)
            params = {k: params[k] + updates[k] for k in params}
    return params, losses


def test_a_checkpointed_run_equals_a_plain_run(tmp_path: Path) -> None:
    plain = run(None)
    result = run(tmp_path)
    assert bitwise_equal(result.params, plain.params)
    assert result.losses == plain.losses and len(result.losses) == STEPS
    assert result.identical
    want, want_losses = reference(STEPS, sgd())
    assert max_abs_diff(result.params, want) < 1e-12
    np.testing.assert_allclose(result.losses, want_losses, rtol=0, atol=1e-12)
    assert sorted(p.name for p in tmp_path.iterdir()) == [CHECKPOINT_FILE]  # no temp left
    stored = read_checkpoint(tmp_path)
    assert stored is not None and stored.step == STEPS and stored.losses == result.losses
    assert stored.state is None
    # plain NumPy reads it, without pickle; the metadata is JSON
    with np.load(tmp_path / CHECKPOINT_FILE, allow_pickle=False) as archive:
        meta = json.loads(archive["meta"].tobytes())
        assert meta["step"] == STEPS and meta["version"] == 2 and meta["state"] is None
        assert len(meta["params"]) == 4
        assert meta["run"] == {"seed": 5, "batch": BATCH, "full_batch": False, "examples": 64,
                               "data": [{"dtype": "float64", "shape": [64, 8]},
                                        {"dtype": "float64", "shape": [64, 1]}]}
    assert stored.run == RunInfo(5, BATCH, False, 64, (("float64", (64, 8)), ("float64", (64, 1))))


@pytest.mark.parametrize("optimizer", ["sgd", "momentum"])
def test_a_crashed_run_resumes_from_its_last_checkpoint_bitwise(
    tmp_path: Path, optimizer: str
) -> None:
    make = sgd if optimizer == "sgd" else Momentum
    undisturbed = run(None, update=make())
    with pytest.raises(Crash, match="killed at step 6"):
        run(tmp_path, update=make(), crash_at=6)  # steps 0..6 ran; checkpoints after 3 and 6
    stored = read_checkpoint(tmp_path)
    assert stored is not None and stored.step == 6
    assert (stored.state is None) == (optimizer == "sgd")
    counter = Counter()
    resumed = run(tmp_path, update=make(), grad_fn=counter)
    assert counter.calls == (STEPS - 6) * DEVICES  # only steps 6..9 were computed again
    assert all(np.array_equal(resumed.params[k], undisturbed.params[k]) for k in resumed.params)
    assert bitwise_equal(resumed.params, undisturbed.params)
    assert resumed.losses == undisturbed.losses and len(resumed.losses) == STEPS
    assert resumed.identical
    want, want_losses = reference(STEPS, make())
    assert max_abs_diff(resumed.params, want) < 1e-12
    np.testing.assert_allclose(resumed.losses, want_losses, rtol=0, atol=1e-12)
    assert ddp_threads() == []


def test_a_finished_checkpoint_returns_its_result_at_once(tmp_path: Path) -> None:
    done = run(tmp_path)
    counter = Counter()
    again = run(tmp_path, grad_fn=counter)
    assert counter.calls == 0
    assert bitwise_equal(again.params, done.params) and again.losses == done.losses
    more = run(tmp_path, steps=STEPS + 2, grad_fn=counter)  # training can be extended
    assert counter.calls == 2 * DEVICES and more.losses[:STEPS] == done.losses
    assert bitwise_equal(more.params, run(None, steps=STEPS + 2).params)


def test_a_mismatching_checkpoint_raises_on_every_peer(tmp_path: Path) -> None:
    run(tmp_path, steps=3)
    wider = init_mlp()
    wider["b1"] = np.zeros(33)
    want = r"does not match this model \(params leaf 0: float64 \(32,\) in the checkpoint, "
    with pytest.raises(burncoll.UsageError, match=want + r"float64 \(33,\) here\); delete"):
        run(tmp_path, params=wider)
    with pytest.raises(burncoll.UsageError, match="has no optimizer state"):
        run(tmp_path, update=Momentum())
    fewer = {k: v for k, v in init_mlp().items() if k != "b2"}
    messages = restore_on_every_peer(tmp_path, fewer)
    assert len(messages) == DEVICES and len(set(messages)) == 1
    assert "params: 4 leaves in the checkpoint, 3 here" in messages[0]
    assert ddp_threads() == []


def test_a_checkpoint_beyond_steps_is_refused_on_every_peer(tmp_path: Path) -> None:
    run(tmp_path)
    want = (f"the checkpoint in {str(tmp_path)!r} is at step {STEPS}, beyond steps=4; pass "
            f"steps={STEPS} or more")
    with pytest.raises(burncoll.UsageError, match=want) as info:
        run(tmp_path, steps=4)
    assert "delete" in str(info.value) and "another checkpoint_dir" in str(info.value)
    messages = restore_on_every_peer(tmp_path, init_mlp(), steps=STEPS - 1)
    assert len(set(messages)) == 1 and f"beyond steps={STEPS - 1}" in messages[0]
    stored = read_checkpoint(tmp_path)
    assert stored is not None and run(tmp_path, steps=STEPS).losses == stored.losses
    assert ddp_threads() == []


def test_another_run_s_checkpoint_is_refused_on_every_peer(tmp_path: Path) -> None:
    run(tmp_path, steps=3)
    x, y = make_data(n=64)
    cases = {  # fit's keywords: what the message must say
        "seed": ({"seed": 6}, "seed 6 here, 5 in the checkpoint"),
        "batch": ({"batch_size": 16}, "batch 16 here, 32 in the checkpoint"),
        "full batch": ({"batch_size": None}, "batch 64 here, 32 in the checkpoint; full_batch "
                       "True here, False in the checkpoint"),
        "examples": ({"data": make_data(n=32)}, "examples 32 here, 64 in the checkpoint; data "
                     "[float64 (32, 8), float64 (32, 1)] here, [float64 (64, 8), float64 (64, 1)]"),
        "dtype": ({"data": (x.astype(np.float32), y)}, "data [float32 (64, 8), float64 (64, 1)]"
                  " here, [float64 (64, 8), float64 (64, 1)] in the checkpoint"),
        "arrays": ({"data": (x, y, y)}, "data [float64 (64, 8), float64 (64, 1), float64 (64, 1)]"
                   " here, [float64 (64, 8), float64 (64, 1)] in the checkpoint"),
    }
    counter = Counter()
    for keywords, want in cases.values():
        with pytest.raises(burncoll.UsageError) as info:
            run(tmp_path, grad_fn=counter, **keywords)
        message = str(info.value)
        assert message.startswith(f"the checkpoint in {str(tmp_path)!r} was written by another "
                                  "run ("), message
        assert want in message and message.count(" here, ") == want.count(" here, "), message
        assert f"delete {str(tmp_path / CHECKPOINT_FILE)!r}" in message
        assert "another checkpoint_dir" in message
    assert counter.calls == 0  # refused before any step
    other = RunInfo(6, BATCH, False, 64, (("float64", (64, 8)), ("float64", (64, 1))))
    messages = restore_on_every_peer(tmp_path, init_mlp(), run=other)
    assert len(messages) == DEVICES and len(set(messages)) == 1
    assert "seed 6 here, 5 in the checkpoint" in messages[0]
    stored = read_checkpoint(tmp_path)
    assert stored is not None and stored.step == 3  # left as it was
    assert ddp_threads() == []


def test_the_world_size_may_shrink_on_resume(tmp_path: Path) -> None:
    """An elastic restart on fewer nodes keeps the global batch: the checkpoint is resumed."""
    with pytest.raises(Crash):
        run(tmp_path, crash_at=6)
    counter = Counter()
    resumed = run(tmp_path, grad_fn=counter, devices=1)
    assert counter.calls == STEPS - 6 and len(resumed.losses) == STEPS
    want, want_losses = reference(STEPS, sgd())
    assert max_abs_diff(resumed.params, want) < 1e-12
    np.testing.assert_allclose(resumed.losses, want_losses, rtol=0, atol=1e-12)


def test_checkpoints_without_a_run_or_of_version_1_are_refused(tmp_path: Path) -> None:
    write_checkpoint(tmp_path, 1, list(init_mlp().values()), None, [0.5])  # no RunInfo
    with pytest.raises(burncoll.UsageError, match=r"written by another run \(it records no run\)"):
        run(tmp_path)
    with np.load(tmp_path / CHECKPOINT_FILE, allow_pickle=False) as archive:
        entries = dict(archive)
    meta = json.loads(entries["meta"].tobytes())
    del meta["run"]
    meta["version"] = 1
    entries["meta"] = np.frombuffer(json.dumps(meta).encode(), np.uint8)
    np.savez(tmp_path / CHECKPOINT_FILE, **entries)
    want = r"has format version 1, this burncoll reads version 2 only \(version 1 does not record"
    with pytest.raises(burncoll.UsageError, match=want + r".*delete it"):
        run(tmp_path)


def test_only_stale_temp_files_of_the_checkpoint_s_own_pattern_are_removed(
    tmp_path: Path,
) -> None:
    """A writer removes temps left by killed writers (old, of its own name pattern), never a
    temp another writer is still writing, nor any other file."""
    old = time.time() - STALE_TEMP_SECONDS - 60
    busy = tmp_path / ".fit-checkpoint.4242.k3j_x9a1.tmp"  # another writer's, in progress
    stale = tmp_path / ".fit-checkpoint.4243.zz81abcd.tmp"  # a killed writer's
    foreign = [tmp_path / ".fit-checkpoint.notes.tmp", tmp_path / "data.tmp",
               tmp_path / ".fit-checkpoint.12.abc.tmp.bak"]
    for path in [busy, stale, *foreign]:
        path.write_bytes(b"x")
    for path in [stale, *foreign]:
        os.utime(path, (old, old))
    write_checkpoint(tmp_path, 0, [np.zeros(2)], None, [])
    left = sorted(p.name for p in tmp_path.iterdir())
    assert left == sorted([CHECKPOINT_FILE, busy.name, *(p.name for p in foreign)])
    assert busy.read_bytes() == b"x"


def restore_on_every_peer(directory: Path, params: Any, *, run: RunInfo | None = None,
                          steps: int | None = None) -> list[str]:
    """What ``Checkpointer.restore`` raises on each peer (it must raise on all)."""

    def restore(comm: burncoll.Communicator) -> str:
        try:
            Checkpointer(directory, 1, run).restore(comm, params, None, False, 2**20, steps=steps)
        except burncoll.UsageError as exc:
            return str(exc)
        return "no error"

    return ddp(range(DEVICES), config(num_devices=DEVICES, timeout=10.0)).run(restore)


def test_bad_checkpoint_arguments_are_refused(tmp_path: Path) -> None:
    for every in (0, -2, True, 1.5, "3"):
        with pytest.raises(burncoll.UsageError, match="checkpoint_every must be an int >= 1"):
            run(tmp_path, every=every)
        with pytest.raises(burncoll.UsageError, match="checkpoint_every must be an int >= 1"):
            run(None, every=every)  # checked even when checkpointing is off
    with pytest.raises(burncoll.UsageError, match="checkpoint_dir must be a directory path"):
        run(123)  # type: ignore[arg-type]
    with pytest.raises(burncoll.UsageError, match=r"seed must be an int, got 1\.5"):
        run(tmp_path, seed=1.5)  # type: ignore[arg-type]  # the checkpoint records it
    (tmp_path / "file").write_text("")
    with pytest.raises(burncoll.UsageError, match="exists and is not a directory"):
        run(tmp_path / "file")
    assert checkpointer(tmp_path, None, 25) == Checkpointer(tmp_path, 2)  # the default
    assert checkpointer(tmp_path, None, 5) == Checkpointer(tmp_path, 1)
    assert ddp_threads() == []


@pytest.mark.parametrize("damage", ["truncated", "garbage", "flipped", "foreign", "pickled"])
def test_a_corrupt_checkpoint_raises_a_clear_error(tmp_path: Path, damage: str) -> None:
    run(tmp_path, steps=3)
    path = tmp_path / CHECKPOINT_FILE
    data = path.read_bytes()
    if damage == "truncated":
        path.write_bytes(data[: len(data) // 2])
    elif damage == "garbage":
        path.write_bytes(b"\x00not a checkpoint" * 10)
    elif damage == "flipped":  # a bit of a leaf changed: the zip CRC catches it
        with np.load(path) as archive:
            needle = archive["params_00000"].tobytes()[:16]
        at = data.index(needle) + 3
        path.write_bytes(data[:at] + bytes([data[at] ^ 1]) + data[at + 1 :])
    elif damage == "foreign":
        np.savez(path, weights=np.zeros(3))
    else:
        np.savez(path, meta=np.array([{"a": 1}], dtype=object))
    with pytest.raises(burncoll.UsageError, match=r"cannot be read.*delete it") as info:
        run(tmp_path)
    assert "Traceback" not in str(info.value)
    messages = restore_on_every_peer(tmp_path, init_mlp())
    assert len(set(messages)) == 1 and "cannot be read" in messages[0]
    assert ddp_threads() == []


def test_dtypes_numpy_cannot_store_round_trip_as_raw_bytes(tmp_path: Path) -> None:
    ml_dtypes = pytest.importorskip("ml_dtypes")
    bf16 = np.arange(6, dtype=np.float32).reshape(2, 3).astype(ml_dtypes.bfloat16)
    leaves = [bf16, np.arange(4, dtype=np.int32), np.zeros((0, 2))]
    write_checkpoint(tmp_path, 2, leaves, [np.float16(1.5) * np.ones(2, np.float16)], [1.0, 0.5])
    stored = read_checkpoint(tmp_path)
    assert stored is not None and stored.step == 2 and stored.losses == [1.0, 0.5]
    assert [a.dtype for a in stored.params] == [bf16.dtype, np.int32, np.float64]
    assert all(a.tobytes() == b.tobytes() and a.shape == b.shape
               for a, b in zip(stored.params, leaves, strict=True))
    assert stored.state is not None and stored.state[0].dtype == np.float16


def test_optax_on_jax_resumes_bitwise(tmp_path: Path) -> None:
    jax = pytest.importorskip("jax")
    optax = pytest.importorskip("optax")
    jnp = jax.numpy
    if len(jax.devices()) < 2:
        pytest.skip("needs 2 JAX devices (XLA_FLAGS=--xla_force_host_platform_device_count=4)")
    before = bool(jax.config.jax_enable_x64)
    jax.config.update("jax_enable_x64", True)
    try:
        x, y = make_data(n=64)

        def loss_fn(p: Any, batch: Any) -> Any:  # a linear model: few leaves, few compiles
            return jnp.mean((batch[0] @ p["w"] + p["b"] - batch[1]) ** 2)

        grad_fn = jax.jit(jax.value_and_grad(loss_fn))
        adam = optax.adam(0.01)
        jitted = optax.GradientTransformation(adam.init, jax.jit(adam.update))  # fewer compiles

        def fit(directory: Path | None, crash_at: int | None = None) -> Any:
            def callback(comm: burncoll.Communicator, step: int, p: Any) -> None:
                if step == crash_at:
                    raise Crash("killed")

            cfg = burncoll.CollectiveConfig(backend="jax", num_devices=2, timeout=30.0)
            params = {"w": jnp.asarray(init_mlp()["w1"][:, :1]), "b": jnp.zeros(1)}
            return ddp(jax.devices()[:2], cfg).fit(
                params, (x, y), grad_fn, jitted, steps=6, batch_size=BATCH,
                progress=False, callback=callback, checkpoint_dir=directory, checkpoint_every=2,
            )

        undisturbed = fit(None)
        with pytest.raises(Crash):
            fit(tmp_path, crash_at=2)  # the checkpoint after step 1 (2 done) is the last
        stored = read_checkpoint(tmp_path)
        assert stored is not None and stored.step == 2 and stored.state is not None
        resumed = fit(tmp_path)
        assert bitwise_equal(resumed.params, undisturbed.params)
        assert resumed.losses == undisturbed.losses
        assert all(isinstance(v, jax.Array) for v in resumed.params.values())
    finally:
        jax.config.update("jax_enable_x64", before)
