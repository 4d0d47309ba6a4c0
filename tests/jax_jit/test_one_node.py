"""burncoll.jax inside ``jax.jit`` on one node: 4 peer threads, each on its own JAX CPU device,
each running its own jitted function (so XLA's CPU runtime must run them concurrently).

Every result is compared with NumPy in float64; gradients and JVPs with the rules written out
by hand in NumPy (the transpose of a sum all-reduce is a sum all-reduce of the cotangents...).
Program order: peers that run a jitted function and peers that run the same collectives
eagerly must agree call by call; collectives also run inside ``lax.scan``, ``while_loop`` and
``cond``. Errors: a missing peer fails the others within their
timeout, naming it; what cannot be differentiated or traced says so.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import pytest

import burncoll
from tests.harness import run_peers

jax = pytest.importorskip("jax")
jnp = pytest.importorskip("jax.numpy")
bj = pytest.importorskip("burncoll.jax")

PEERS = 4


def data(pid: int, rows: int = 6) -> np.ndarray:
    """Peer ``pid``'s input: float32 values exact in float32 sums."""
    return ((np.arange(rows * 3, dtype=np.float32).reshape(rows, 3) * (pid + 1)) % 11) - 5


def config(peers: int = PEERS, backend: str = "numpy", timeout: float = 30.0
           ) -> burncoll.CollectiveConfig:
    return burncoll.CollectiveConfig(backend=backend, num_devices=peers, timeout=timeout)


def ok(results: list[Any]) -> list[Any]:
    for r in results:
        if isinstance(r, BaseException):
            raise r
    return results


@pytest.mark.parametrize("backend", ["numpy", "jax"])
def test_every_collective_inside_jit_matches_numpy(backend: str) -> None:
    devices = jax.devices()[:PEERS]
    stacked = np.stack([data(p) for p in range(PEERS)]).astype(np.float64)

    def work(c: burncoll.Communicator, i: int) -> dict[str, Any]:
        @jax.jit
        def step(x: Any) -> dict[str, Any]:
            out = {op: bj.all_reduce(x, c, op) for op in ("sum", "mean", "max", "min", "prod")}
            out["gather"] = bj.all_gather(x[:2], c)
            out["scatter"] = bj.reduce_scatter(x, c)  # 6 rows over 4 ranks: 2, 2, 1, 1
            out["bcast"] = bj.broadcast(x, 2, c)
            bj.barrier(c)
            return out

        got = step(jax.device_put(data(i), devices[i]))
        assert {d for v in got.values() for d in v.devices()} == {devices[i]}
        return {k: np.asarray(v) for k, v in got.items()}

    for i, got in enumerate(ok(run_peers(config(backend=backend), work))):
        for op, ref in (("sum", stacked.sum(0)), ("mean", stacked.mean(0)),
                        ("max", stacked.max(0)), ("min", stacked.min(0)),
                        ("prod", stacked.prod(0))):
            assert got[op].dtype == np.float32
            np.testing.assert_allclose(got[op], ref, rtol=1e-6, err_msg=op)
        np.testing.assert_array_equal(got["gather"], np.concatenate(stacked[:, :2]))
        np.testing.assert_allclose(got["scatter"], np.array_split(stacked.sum(0), PEERS)[i])
        np.testing.assert_array_equal(got["bcast"], data(2))


def test_results_go_into_xlas_buffers_and_the_inputs_stay_unchanged() -> None:
    """On the CPU the callback gets XLA's buffers themselves (the buffer callback, no copies):
    the all-reduce writes its result into the call's output buffer and never into its input,
    which XLA reads again after the call (``x + total``), also when the input is donated; at
    2 MiB too, past ``INLINE_BYTES``. The sums are exact in float32 (bit-identical)."""
    elements = (1 << 19) + 3
    devices = jax.devices()[:2]

    def make(i: int) -> np.ndarray:
        return (np.arange(elements, dtype=np.float32) % 101) * (i + 1) - 7 * i

    def work(c: burncoll.Communicator, i: int) -> tuple[np.ndarray, list[np.ndarray], str]:
        def step(x: Any) -> tuple[Any, Any, Any]:
            total = bj.all_reduce(x, c)
            return total, x + total, bj.all_gather(x[:2], c)

        x = jax.device_put(make(i), devices[i])
        kept = jax.jit(step)(x)
        donated = jax.jit(step, donate_argnums=0)(jax.device_put(make(i), devices[i]))
        lowered = jax.jit(step).lower(x).as_text()
        return np.asarray(x), [np.asarray(a) for a in (*kept, *donated)], lowered

    xs = [make(p).astype(np.float64) for p in range(2)]
    for i, (x, got, lowered) in enumerate(ok(run_peers(config(2), work))):
        np.testing.assert_array_equal(x, make(i))  # the caller's array is unchanged
        for total, plus, gathered in (got[:3], got[3:]):
            assert total.dtype == np.float32
            np.testing.assert_array_equal(total, xs[0] + xs[1])
            np.testing.assert_array_equal(plus, xs[i] + xs[0] + xs[1])
            np.testing.assert_array_equal(gathered, np.concatenate([xs[0][:2], xs[1][:2]]))
        assert "xla_buffer_python_cpu_callback" in lowered
        assert "xla_ffi_python_cpu_callback" not in lowered  # io_callback's copying one


def test_collectives_keep_program_order_against_peers_that_call_them_eagerly() -> None:
    """Peers 0 and 1 run one jitted function of independent collectives (one result unused,
    a send with no result); peers 2 and 3 make the same calls eagerly, in the order written.
    Peer 0 sends to peer 2, peer 3 to peer 1. A reordered or dropped collective would be a
    mismatch or a timeout."""
    partner, sends = {0: 2, 1: 3, 2: 0, 3: 1}, (0, 3)

    def work(c: burncoll.Communicator, i: int) -> list[np.ndarray]:
        x, y = data(i), data(i, rows=2)
        if i < 2:
            @jax.jit
            def step(x: Any, y: Any) -> tuple[Any, Any, Any]:
                bj.all_reduce(y, c, "min")  # unused: still runs, in its place
                gathered = bj.all_gather(y, c)
                biggest = bj.all_reduce(x, c, "max")
                if i in sends:
                    bj.send(x * 2, partner[i], c, tag=7)
                    return gathered, biggest, x
                return gathered, biggest, bj.recv(x, partner[i], c, tag=7)
            return [np.asarray(a) for a in step(x, y)]
        c.all_reduce(y, "min")
        gathered, biggest = c.all_gather(y), c.all_reduce(x, "max")
        if i in sends:
            c.send(x * 2, partner[i], tag=7)
            return [gathered, biggest, x]
        return [gathered, biggest, c.recv(partner[i], tag=7)]

    stacked = np.stack([data(p) for p in range(PEERS)]).astype(np.float64)
    for i, (gathered, biggest, got) in enumerate(ok(run_peers(config(), work))):
        np.testing.assert_array_equal(gathered, np.concatenate([data(p, 2) for p in range(4)]))
        np.testing.assert_array_equal(biggest, stacked.max(0))
        np.testing.assert_array_equal(got, data(i) if i in sends else 2 * data(partner[i]))


def test_grad_and_jvp_follow_the_rules_of_each_collective() -> None:
    """Peer i's loss is sum(w_i * collective(x_i)); its gradient is what the transpose rule
    moves back from every peer's cotangent w_j, computed here in NumPy."""
    peers = PEERS
    w = [data(p + 7) for p in range(peers)]  # each peer's cotangent, (6, 3)
    w_sum = np.sum(np.stack(w).astype(np.float64), axis=0)

    def work(c: burncoll.Communicator, i: int) -> dict[str, np.ndarray]:
        x, wi = jnp.asarray(data(i)), jnp.asarray(w[i])

        def grad(f: Any) -> np.ndarray:
            def loss(x: Any) -> Any:
                y = f(x)
                return jnp.sum(wi[: y.shape[0]] * y)
            return np.asarray(jax.jit(jax.grad(loss))(x))

        tangent = jnp.asarray(data(i + 3))
        _, jvp = jax.jvp(jax.jit(lambda x: bj.all_reduce(x, c)), (x,), (tangent,))
        return {
            "sum": grad(lambda x: bj.all_reduce(x, c)),
            "mean": grad(lambda x: bj.all_reduce(x, c, "mean")),
            "gather": grad(lambda x: bj.all_gather(x[:1], c)),  # (4, 3): w rows 0..3
            "scatter": grad(lambda x: bj.reduce_scatter(x, c)),
            "bcast": grad(lambda x: bj.broadcast(x, 1, c)),
            "jvp": np.asarray(jvp),
        }

    tangents = np.sum(np.stack([data(p + 3) for p in range(peers)]).astype(np.float64), 0)
    blocks = [np.array_split(w_i.astype(np.float64), peers) for w_i in w]
    for i, got in enumerate(ok(run_peers(config(peers), work))):
        np.testing.assert_allclose(got["sum"], w_sum)
        np.testing.assert_allclose(got["mean"], w_sum / peers)
        gather = np.zeros((6, 3))  # row 0 of x went to row i of every peer's result
        gather[0] = sum(w_j[i] for w_j in w)
        np.testing.assert_allclose(got["gather"], gather)
        # peer j's result is block j of the sum; its cotangent is w_j's first rows
        np.testing.assert_allclose(got["scatter"], np.concatenate(
            [w[j][: len(blocks[j][j])] for j in range(peers)]))
        np.testing.assert_allclose(got["bcast"], w_sum if i == 1 else np.zeros((6, 3)))
        np.testing.assert_allclose(got["jvp"], tangents)


def test_collectives_inside_scan_while_loop_and_cond() -> None:
    def work(c: burncoll.Communicator, i: int) -> list[np.ndarray]:
        def body(carry: Any, _: Any) -> tuple[Any, None]:
            return bj.all_reduce(carry, c) / 2 + 1, None

        x = jnp.asarray(data(i))
        scanned = jax.jit(lambda x: jax.lax.scan(body, x, None, length=3)[0])(x)
        looped = jax.jit(lambda x: jax.lax.while_loop(  # (a fori_loop of static bounds is a scan)
            lambda kv: kv[0] < 2,
            lambda kv: (kv[0] + 1, bj.all_reduce(kv[1], c, "max")), (0, x))[1])(x)
        chosen = jax.jit(lambda x: jax.lax.cond(
            x[0, 0] < 100, lambda v: bj.all_gather(v, c), lambda v: jnp.tile(v, (2, 1)), x))(x)
        return [np.asarray(scanned), np.asarray(looped), np.asarray(chosen)]

    xs = [data(p).astype(np.float64) for p in range(2)]
    for scanned, looped, chosen in ok(run_peers(config(2), work)):
        np.testing.assert_allclose(looped, np.maximum(*xs))
        np.testing.assert_array_equal(chosen, np.concatenate(xs))
        carry = xs
        for _ in range(3):
            total = carry[0] + carry[1]
            carry = [total / 2 + 1] * 2
        np.testing.assert_allclose(scanned, carry[0], rtol=1e-6)


def test_vmap_batches_the_collectives() -> None:
    def work(c: burncoll.Communicator, i: int) -> list[np.ndarray]:
        x = jnp.asarray(data(i))  # a batch of 6 rows of 3
        rows = jax.vmap(lambda r: bj.all_reduce(r, c))(x)
        gathered = jax.jit(jax.vmap(lambda r: bj.all_gather(r[None], c)))(x)
        return [np.asarray(rows), np.asarray(gathered)]

    stacked = np.stack([data(p) for p in range(PEERS)]).astype(np.float64)
    for rows, gathered in ok(run_peers(config(), work)):
        np.testing.assert_allclose(rows, stacked.sum(0))
        np.testing.assert_array_equal(gathered, np.moveaxis(stacked, 0, 1))


def test_what_cannot_be_differentiated_or_traced_is_refused_clearly() -> None:
    def work(c: burncoll.Communicator, i: int) -> list[str]:
        x = jnp.asarray(data(i))
        errors = []
        for f in (lambda x: jnp.sum(bj.all_reduce(x, c, "max")),
                  lambda x: jnp.sum(bj.reduce_scatter(x, c, "prod")),
                  lambda x: (bj.send(x, 1 - i, c), jnp.sum(x))[1],
                  lambda x: jnp.sum(bj.all_reduce(x.astype(jnp.int32), c, "mean")),
                  lambda x: jnp.sum(bj.all_reduce(x, "not a communicator")),
                  lambda x: jnp.sum(bj.broadcast(x, 9, c))):
            with pytest.raises(burncoll.UsageError) as caught:
                jax.grad(f)(x)
            errors.append(str(caught.value))
        return errors

    for errors in ok(run_peers(config(2), work)):
        assert "op='max' is not differentiable: only sum and mean" in errors[0]
        assert "op='prod' is not differentiable: only sum" in errors[1]
        assert "send is not differentiable" in errors[2]
        assert "cast x to a float dtype" in errors[3]
        assert "comm must be a burncoll Communicator" in errors[4]
        assert "root=9 is not a peer" in errors[5]


def test_a_missing_peer_fails_the_jitted_call_naming_it() -> None:
    """Peer 1 finishes (``run_peers``) without the all-reduce: peer 0's jitted call fails
    naming it, well within the timeout."""
    timeout = 2.0

    def work(c: burncoll.Communicator, i: int) -> tuple[str, float] | None:
        if i == 1:
            return None  # never calls the all-reduce
        started = time.monotonic()
        with pytest.raises(jax.errors.JaxRuntimeError) as caught:
            np.asarray(jax.jit(lambda x: bj.all_reduce(x, c))(jnp.ones(3)))
        return str(caught.value), time.monotonic() - started

    message, seconds = ok(run_peers(config(2, timeout=timeout), work))[0]
    assert "MismatchError" in message and "local peer(s) [1] called finish()" in message
    assert seconds < 5 * timeout + 10


def test_peers_tracing_different_shapes_get_a_clear_error() -> None:
    def work(c: burncoll.Communicator, i: int) -> str:
        with pytest.raises(jax.errors.JaxRuntimeError) as caught:
            np.asarray(jax.jit(lambda x: bj.all_gather(x, c))(jnp.ones((2 + i, 3))))
        return str(caught.value)

    for message in ok(run_peers(config(2), work)):
        assert "inside jit every peer must pass the same shapes" in message
