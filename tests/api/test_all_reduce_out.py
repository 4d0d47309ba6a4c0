"""``Communicator.all_reduce(x, op, out=...)`` on one node, with real peer threads.

The result is written into ``out`` and ``out`` is returned; ``out=x`` (or another view of
exactly x's elements, also across nodes) reduces in place; every other argument is refused
with a :class:`burncoll.UsageError` before the collective starts (so a refused call neither
hangs nor spoils the next one). The inline path (``auto``, at most
``INLINE_BYTES``) and the fused path (``auto`` above it) write into ``out`` directly; the
schedules (tree, ring, centralized) copy their result into it. References are float64 NumPy.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

import burncoll
import burncoll.local.plans.inline as inline_plan
from burncoll.backends import installed_backends
from burncoll.local.plans.inline import inline_results
from burncoll.strategies.auto import INLINE_BYTES
from tests.api.test_fused_all_reduce import FusedSpy
from tests.api.test_single_node_ops import REDUCERS, _close, _config, _inputs
from tests.harness import run_nodes, run_peers

#: (strategy, rows): 5 x 3 is inline under auto; 100_000 x 3 (1.2 MB of float32 or int32,
#: 2.4 MB of float64) is fused under auto, and split into several chunks by the schedules.
CASES = [
    ("auto", 5), ("auto", 100_000),
    ("tree", 5), ("tree", 100_000),
    ("ring", 5), ("ring", 100_000),
    ("centralized", 5), ("centralized", 100_000),
]
OPS = ["sum", "mean", "max", "min", "prod"]


def _reference(xs: list[np.ndarray], op: str) -> np.ndarray:
    result: np.ndarray = REDUCERS[op](np.stack([x.astype(np.float64) for x in xs]))
    return result


def _dtypes(op: str) -> list[str]:
    return ["float32", "float64"] if op == "mean" else ["float32", "float64", "int32"]


@pytest.fixture
def spy(monkeypatch: pytest.MonkeyPatch) -> FusedSpy:
    return FusedSpy(monkeypatch)


@pytest.fixture
def inline_spy(monkeypatch: pytest.MonkeyPatch) -> list[list[Any]]:
    """What every ``inline_results`` call returned (observed, not replaced)."""
    returned: list[list[Any]] = []
    real = inline_results

    def counting(*args: Any, **kwargs: Any) -> Any:
        results = real(*args, **kwargs)
        returned.append(results)
        return results

    monkeypatch.setattr(inline_plan, "inline_results", counting)
    return returned


def _expect_path(strategy: str, n: int, spy: FusedSpy, inline: list[list[Any]],
                 outs: list[np.ndarray]) -> None:
    """Under auto, the inline or the fused path ran and handed back the callers' arrays."""
    nbytes = outs[0].nbytes
    if strategy != "auto":
        assert spy.calls == 0 and not inline
    elif nbytes <= INLINE_BYTES:
        assert spy.calls == 0 and inline, "the inline path did not run"
        assert all(r is o for r, o in zip(inline[-1], outs, strict=True))
    else:
        assert spy.calls == n and not inline, "the fused path did not run"
        assert {id(r) for r in spy.returned[-n:]} == {id(o) for o in outs}


# -- results ---------------------------------------------------------------------------------


@pytest.mark.parametrize(("strategy", "rows"), CASES)
@pytest.mark.parametrize("n", [2, 3])
def test_out_receives_the_result_and_the_input_is_untouched(
    spy: FusedSpy, inline_spy: list[list[Any]], strategy: str, rows: int, n: int,
) -> None:
    for op in OPS:
        for dtype in _dtypes(op):
            shape = (rows, 3)
            xs = _inputs(n, shape, dtype, seed=n + OPS.index(op))
            kept = [x.copy() for x in xs]
            outs = [np.full_like(x, 99) for x in xs]  # stale content must be overwritten
            spy.clear()
            inline_spy.clear()
            results = run_peers(_config(n, strategy),
                                lambda c, i: c.all_reduce(xs[i], op=op, out=outs[i]))
            ref = _reference(kept, op)
            for i, r in enumerate(results):
                assert r is outs[i], r
                assert r.dtype == np.dtype(dtype) and r.shape == shape
                assert r.tobytes() == results[0].tobytes(), f"peer {i}: different bits"
                _close(r, ref, dtype)
                np.testing.assert_array_equal(xs[i], kept[i])  # the input is only read
            _expect_path(strategy, n, spy, inline_spy, outs)


@pytest.mark.parametrize(("strategy", "rows"), CASES)
@pytest.mark.parametrize("n", [2, 3])
def test_out_is_x_reduces_in_place(
    spy: FusedSpy, inline_spy: list[list[Any]], strategy: str, rows: int, n: int,
) -> None:
    for op in OPS:
        for dtype in _dtypes(op):
            xs = _inputs(n, (rows, 3), dtype, seed=10 * n + OPS.index(op))
            ref = _reference(xs, op)
            spy.clear()
            inline_spy.clear()
            results = run_peers(_config(n, strategy),
                                lambda c, i: c.all_reduce(xs[i], op=op, out=xs[i]))
            for i, r in enumerate(results):
                assert r is xs[i], r
                assert r.tobytes() == xs[0].tobytes(), f"peer {i}: different bits"
                _close(r, ref, dtype)
            _expect_path(strategy, n, spy, inline_spy, xs)


#: Another array object over exactly x's elements: in place, as ``out=x`` is.
SAME_MEMORY = {
    "view": lambda x: x.view(),
    "whole slice": lambda x: x[:],
    "from the buffer": lambda x: np.frombuffer(x.data, x.dtype).reshape(x.shape),
    "reinterpreted twice": lambda x: x.view(np.uint8).view(x.dtype),
}


@pytest.mark.parametrize(("strategy", "rows"), CASES)
@pytest.mark.parametrize("how", list(SAME_MEMORY))
def test_out_over_x_s_memory_reduces_in_place_as_out_x_does(
    spy: FusedSpy, inline_spy: list[list[Any]], strategy: str, rows: int, how: str,
) -> None:
    n = 3
    for op in ("sum", "mean"):
        xs = _inputs(n, (rows, 3), "float64", seed=rows + len(how))
        ref = _reference(xs, op)
        outs = [SAME_MEMORY[how](x) for x in xs]  # (``t.numpy()`` twice, for torch users)
        for o, x in zip(outs, xs, strict=True):
            assert o is not x and o.ctypes.data == x.ctypes.data
        spy.clear()
        inline_spy.clear()
        results = run_peers(_config(n, strategy),
                            lambda c, i: c.all_reduce(xs[i], op=op, out=outs[i]))
        for i, r in enumerate(results):
            assert r is outs[i], r
            assert xs[i].tobytes() == xs[0].tobytes(), f"peer {i}: different bits"
            _close(xs[i], ref, "float64")
        _expect_path(strategy, n, spy, inline_spy, xs)  # x itself went down, as for out=x


@pytest.mark.parametrize("rows", [5, 100_000])
@pytest.mark.parametrize("devices", [1, 2])
def test_out_over_x_s_memory_reduces_in_place_across_nodes(rows: int, devices: int) -> None:
    world = 2 * devices
    xs = _inputs(world, (rows, 3), "float32", seed=rows)
    ref = _reference(xs, "sum")

    def work(comm: burncoll.Communicator) -> np.ndarray:
        x = xs[comm.rank]
        return comm.all_reduce(x, out=np.frombuffer(x.data, x.dtype).reshape(x.shape))

    with burncoll.start_orchestrator(transport="websocket", expected_nodes=2) as orch:
        results = run_nodes(orch.address, 2, devices, work)
    for rank in range(world):
        assert isinstance(results[rank], np.ndarray), results[rank]
        assert results[rank].ctypes.data == xs[rank].ctypes.data
        assert xs[rank].tobytes() == xs[0].tobytes()
        _close(xs[rank], ref, "float32")


@pytest.mark.parametrize("strategy", ["auto", "tree", "ring", "centralized"])
def test_in_place_separate_and_no_out_mixed_among_peers(strategy: str) -> None:
    n = 4
    for rows in (5, 100_000):
        xs = _inputs(n, (rows, 3), "float64", seed=rows)
        kept = [x.copy() for x in xs]
        outs: list[np.ndarray | None] = [xs[0], None, np.empty_like(xs[2]), xs[3]]
        results = run_peers(_config(n, strategy),
                            lambda c, i: c.all_reduce(xs[i], op="sum", out=outs[i]))
        ref = _reference(kept, "sum")
        assert results[0] is xs[0] and results[2] is outs[2] and results[3] is xs[3]
        assert not np.may_share_memory(results[1], xs[1])
        np.testing.assert_array_equal(xs[1], kept[1])
        np.testing.assert_array_equal(xs[2], kept[2])
        for r in results:
            assert r.tobytes() == results[0].tobytes()
            _close(r, ref, "float64")


@pytest.mark.parametrize("strategy", ["auto", "tree", "ring", "centralized"])
@pytest.mark.parametrize("shape", [(), (0,), (1,), (2, 0, 3), (7, 1, 2)])
def test_out_with_degenerate_shapes(strategy: str, shape: tuple[int, ...]) -> None:
    n = 3
    xs = _inputs(n, shape, "float32", seed=1)
    ref = _reference(xs, "sum")
    outs = [np.full(shape, 5, np.float32) for _ in range(n)]
    results = run_peers(_config(n, strategy), lambda c, i: c.all_reduce(xs[i], out=outs[i]))
    for r, o in zip(results, outs, strict=True):
        assert r is o, r
        _close(r, ref, "float32")
    inplace = run_peers(_config(n, strategy), lambda c, i: c.all_reduce(xs[i], out=xs[i]))
    for r, x in zip(inplace, xs, strict=True):
        assert r is x, r
        _close(r, ref, "float32")


@pytest.mark.parametrize("strategy", ["auto", "ring"])
def test_out_reused_across_calls_and_other_dtypes(strategy: str) -> None:
    """One ``out`` per peer for a series of all-reduces; float16 and unsigned ints too."""
    n = 2
    series = [(dtype, op, rows) for dtype in ("float16", "uint16", "int64")
              for op in ("sum", "max") for rows in (4, 70_000)]
    arrays = [_inputs(n, (rows, 3), dtype, seed=k) if dtype != "uint16" else
              [np.arange(rows * 3, dtype=dtype).reshape(rows, 3) % 7 + i for i in range(n)]
              for k, (dtype, _op, rows) in enumerate(series)]

    def work(c: burncoll.Communicator, i: int) -> list[bytes]:
        got = []
        outs: dict[tuple[str, int], np.ndarray] = {}
        for (dtype, op, rows), xs in zip(series, arrays, strict=True):
            out = outs.setdefault((dtype, rows), np.empty((rows, 3), dtype))
            r = c.all_reduce(xs[i], op=op, out=out)
            assert r is out
            got.append(r.tobytes())
        return got

    results = run_peers(_config(n, strategy), work)
    assert not isinstance(results[0], Exception), results[0]
    assert results[0] == results[1]
    for k, ((dtype, op, rows), xs) in enumerate(zip(series, arrays, strict=True)):
        got = np.frombuffer(results[0][k], dtype=dtype).reshape(rows, 3)
        _close(got, _reference(xs, op), dtype)


def test_out_mean_of_complex() -> None:
    n = 2
    xs = [np.full(4, 1 + 2j, np.complex64) * (i + 1) for i in range(n)]
    plain = run_peers(_config(n, "auto"), lambda c, i: c.all_reduce(xs[i], op="mean"))
    assert plain[0].dtype == np.complex64  # the mean of complex64 is complex64 ...
    outs = [np.empty_like(x) for x in xs]
    results = run_peers(_config(n, "auto"),
                        lambda c, i: c.all_reduce(xs[i], op="mean", out=outs[i]))
    for r, o in zip(results, outs, strict=True):  # ... so out= can hold it
        assert r is o, r
        np.testing.assert_allclose(o, np.full(4, 1.5 + 3j))


# -- refused arguments ------------------------------------------------------------------------


@pytest.fixture
def comm() -> Iterator[burncoll.Communicator]:
    """A one-peer collective: ``out`` is validated before any peer is waited for."""
    c = burncoll.register(0, 0, _config(1, "auto"))
    yield c
    c.finish()


def _read_only(shape: tuple[int, ...], dtype: str = "float32") -> np.ndarray:
    a = np.zeros(shape, dtype)
    a.flags.writeable = False
    return a


_X = np.arange(10, dtype=np.float32)
_BUF = np.zeros(20, np.float32)
#: (x, op, out, message pattern)
REFUSED: dict[str, tuple[np.ndarray, str, Any, str]] = {
    "list": (_X, "sum", [0.0] * 10, r"out must be an array of backend 'numpy', got list"),
    "numpy scalar": (_X, "sum", np.float32(0), r"out must be an array .*got float32"),
    "none-like": (_X, "sum", "out", r"out must be an array .*got str"),
    "shape": (_X, "sum", np.empty(9, np.float32), r"out is float32\[9\] but x is float32\[10\]"),
    "ndim": (_X, "sum", np.empty((2, 5), np.float32),
             r"out is float32\[2, 5\] but x is float32\[10\]; they must match"),
    "dtype": (_X, "sum", np.empty(10, np.float64), r"out is float64\[10\] but x is float32\[10\]"),
    "int mean": (_X.astype(np.int32), "mean", np.empty(10, np.int32),
                 r"the mean of int32 is float64, which out cannot hold"),
    "uint mean": (_X.astype(np.uint8), "mean", np.empty(10, np.uint8),
                  r"the mean of uint8 is float64"),
    "float64 out for int mean": (_X.astype(np.int64), "mean", np.empty(10),
                                 r"out is float64\[10\] but x is int64\[10\]"),
    "read-only": (_X, "sum", _read_only((10,)), r"out must be writable and C-contiguous"),
    "strided": (_X, "sum", np.empty(20, np.float32)[::2], r"writable and C-contiguous"),
    "fortran": (_X.reshape(2, 5), "sum", np.empty((2, 5), np.float32, order="F"),
                r"writable and C-contiguous"),
    "read-only x in place": (_read_only((10,)), "sum", None,
                             r"out must be writable and C-contiguous"),
    "partial overlap": (_BUF[:10], "sum", _BUF[5:15], r"out overlaps x without being x's "
                        r"elements \(another start, dtype or strides\); pass out=x"),
    "same start, other dtype": (_BUF[:10], "sum", _BUF[:10].view(np.int32), r"out is int32"),
    "same start, other strides": (_BUF[:10:2].reshape(5, 1), "sum", _BUF[:5].reshape(5, 1),
                                  r"out overlaps x without being x's elements"),
    "non-native byte order": (_X, "sum", np.empty(10, ">f4" if np.little_endian else "<f4"),
                              r"out has non-native byte order"),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_refused_out(comm: burncoll.Communicator, case: str) -> None:
    x, op, out, pattern = REFUSED[case]
    if out is None:
        out = x  # in place on an array that cannot be written
    kept = x.copy()
    with pytest.raises(burncoll.UsageError, match=pattern):
        comm.all_reduce(x, op=op, out=out)
    np.testing.assert_array_equal(x, kept)
    # the refusal happened before the collective: the next call works
    good = np.empty_like(x)
    assert comm.all_reduce(x, op="max", out=good) is good
    np.testing.assert_array_equal(good, x)


def test_out_refused_on_every_peer_leaves_the_collective_usable() -> None:
    """Every peer passes a bad ``out``: each raises at once (no hang, no timeout), and the
    peers go on with the next all-reduce together."""
    n = 3
    xs = _inputs(n, (6,), "float32", seed=3)

    def work(c: burncoll.Communicator, i: int) -> tuple[Exception, np.ndarray]:
        try:
            c.all_reduce(xs[i], out=np.empty(5, np.float32))
        except burncoll.UsageError as exc:
            error = exc
        else:  # pragma: no cover - reported below
            raise AssertionError("a bad out was accepted")
        out = np.empty_like(xs[i])
        return error, c.all_reduce(xs[i], out=out)

    cfg = burncoll.CollectiveConfig(num_devices=n, timeout=3)
    for error, result in run_peers(cfg, work):
        assert "out is float32[5] but x is float32[6]" in str(error)
        _close(result, _reference(xs, "sum"), "float32")


def test_bad_x_is_reported_before_out() -> None:
    c = burncoll.register(0, 0, _config(1, "auto"))
    try:
        with pytest.raises(burncoll.UsageError, match="expected an array of backend 'numpy'"):
            c.all_reduce([1.0, 2.0], out=np.empty(2))
        with pytest.raises(burncoll.UsageError, match=r"dtype .* is not supported"):
            c.all_reduce(np.array(["a"]), out=np.array(["b"]))
    finally:
        c.finish()


# -- JAX: immutable arrays --------------------------------------------------------------------

needs_jax = pytest.mark.skipif("jax" not in installed_backends(), reason="jax is not installed")


@needs_jax
def test_jax_backend_refuses_out() -> None:
    import jax

    n = 2
    devices = burncoll.get_backend("jax").devices(n)
    cfg = burncoll.CollectiveConfig(backend="jax", num_devices=n, timeout=20)
    host = [np.arange(6, dtype=np.float32) * (i + 1) for i in range(n)]

    def work(c: burncoll.Communicator, i: int) -> tuple[list[Exception], Any]:
        x = jax.device_put(host[i], devices[i])
        errors: list[Exception] = []
        for out in (x, jax.numpy.zeros_like(x), np.empty(6, np.float32)):
            try:
                c.all_reduce(x, out=out)
            except burncoll.UsageError as exc:
                errors.append(exc)
        return errors, c.all_reduce(x)  # still usable, and the result is a new JAX array

    results = run_peers(cfg, work)
    for i, r in enumerate(results):
        assert not isinstance(r, Exception), r
        errors, total = r
        assert len(errors) == 3
        for e in errors:
            assert "out= needs a backend with mutable arrays" in str(e)
            assert "jax arrays are immutable" in str(e)
        assert isinstance(total, jax.Array) and total.devices() == {devices[i]}
        np.testing.assert_allclose(np.asarray(total), host[0] + host[1])


@needs_jax
def test_numpy_backend_refuses_a_jax_out(comm: burncoll.Communicator) -> None:
    import jax.numpy as jnp

    with pytest.raises(burncoll.UsageError, match="out must be an array of backend 'numpy'"):
        comm.all_reduce(np.zeros(3, np.float32), out=jnp.zeros(3, jnp.float32))
