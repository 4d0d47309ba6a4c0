"""Mismatches, missing peers and misuse fail clearly on every peer, and never hang."""

from __future__ import annotations

import time

import numpy as np
import pytest

import burncoll
from tests.harness import run_peers


def _cfg(n: int, timeout: float = 10.0) -> burncoll.CollectiveConfig:
    return burncoll.CollectiveConfig(num_devices=n, timeout=timeout)


@pytest.mark.parametrize(
    ("call", "what"),
    [
        (lambda c, i: c.all_reduce(np.ones(4 + (i == 2), np.float32)), "shape"),
        (lambda c, i: c.all_reduce(np.ones(4, np.float32 if i else np.float64)), "dtype"),
        (lambda c, i: c.all_reduce(np.ones(4), op="max" if i == 1 else "sum"), "reduce op"),
        (lambda c, i: c.reduce(np.ones(4), root=i % 2), "root"),
        (lambda c, i: c.all_reduce(np.ones(3)) if i else c.barrier(), "operation"),
    ],
)
def test_mismatch_reaches_every_peer_and_names_it(call: object, what: str) -> None:
    results = run_peers(_cfg(3), call)  # type: ignore[arg-type]
    for r in results:
        assert isinstance(r, burncoll.MismatchError), r
        assert what in str(r)
        for pid in range(3):
            assert f"peer {pid}:" in str(r)


def test_aborted_until_registered_again() -> None:
    def work(c: burncoll.Communicator, i: int) -> object:
        with pytest.raises(burncoll.MismatchError):
            c.all_reduce(np.ones(2 + i))
        with pytest.raises(burncoll.CollectiveAborted) as info:
            c.all_reduce(np.ones(2))
        assert isinstance(info.value.__cause__, burncoll.MismatchError)
        return "ok"

    assert run_peers(_cfg(2), work) == ["ok", "ok"]
    # a fresh registration works again
    results = run_peers(_cfg(2), lambda c, i: c.all_reduce(np.full(3, i + 1.0)))
    for r in results:
        np.testing.assert_array_equal(r, [3.0, 3.0, 3.0])


def test_missing_peer_times_out_on_every_other_peer_naming_it() -> None:
    def work(c: burncoll.Communicator, i: int) -> object:
        if c.peer_id == 2:
            time.sleep(3.5)  # never calls the operation in time
            return "absent"
        start = time.monotonic()
        try:
            c.all_reduce(np.ones(4))
        except burncoll.CollectiveTimeout as exc:
            return (time.monotonic() - start, str(exc))
        return "no error"

    timeout = 2.0
    results = run_peers(_cfg(3, timeout=timeout), work)
    for elapsed, message in results[:2]:
        assert timeout - 0.1 < elapsed < 3 * timeout  # at the deadline (room for load)
        assert "[2]" in message and "all_reduce #0" in message
    assert results[2] == "absent"


def test_register_times_out_when_a_local_peer_never_registers() -> None:
    cfg = burncoll.CollectiveConfig(num_devices=2, timeout=0.5)
    start = time.monotonic()
    with pytest.raises(burncoll.CollectiveTimeout, match="1 of num_devices=2"):
        burncoll.register(0, 0, cfg)
    assert time.monotonic() - start < 10 * cfg.timeout  # by the deadline, not never


def _jax_array() -> object:
    jnp = pytest.importorskip("jax.numpy")
    return jnp.ones(2)


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda c: c.all_reduce([1, 2, 3]), "expected an array of backend 'numpy'"),
        (lambda c: c.reduce(np.ones(2), root=99), "root=99 is not a peer"),
        (lambda c: c.broadcast(None, root=0), "must pass an array"),
        (lambda c: c.all_reduce(np.ones(2), op="median"), "unknown reduce op"),
        (lambda c: c.all_gather(np.float64(1.0)), "expected an array"),
        (lambda c: c.reduce_scatter(np.array(1.0)), "at least one dimension"),
        (lambda c: c.all_reduce(np.array(["a"])), "dtype"),
        (lambda c: c.all_reduce(_jax_array()), "a jax.Array was given to a communicator of "
                                               "backend 'numpy': pass backend='jax'"),
    ],
)
def test_usage_errors_are_raised_before_anything_is_sent(call: object, message: str) -> None:
    comm = burncoll.register(0, 0, _cfg(1))
    try:
        with pytest.raises(burncoll.UsageError, match=message):
            call(comm)  # type: ignore[operator]
        np.testing.assert_array_equal(comm.all_reduce(np.ones(2)), [1.0, 1.0])  # still usable
    finally:
        comm.finish()
    with pytest.raises(burncoll.UsageError, match="after finish"):
        comm.all_reduce(np.ones(2))


def test_duplicate_peer_id_on_a_node() -> None:
    """Both peers fail at once (the first one too: its node can never be whole), well before
    the timeout that would otherwise end the first one's wait."""
    started = time.monotonic()
    results = run_peers(_cfg(2, timeout=30.0), lambda c, i: None, peer_ids=[5, 5])
    assert all(isinstance(r, burncoll.UsageError) and "peer id 5 was registered twice" in str(r)
               for r in results), results
    assert time.monotonic() - started < 15.0
