"""Collectives inside ``jax.jit`` (and under ``jax.grad``, ``jax.jvp``, ``jax.vmap``).

Every function takes the :class:`~burncoll.Communicator` explicitly, as a Python object: it
is closed over (or a static argument), never traced. Inside a jitted function each call is a
JAX primitive lowered to an ordered host callback (the one ``jax.experimental.io_callback``
emits with ``ordered=True``), so the collectives of one function run in program order, are
never removed as dead code, and the callback hands the communicator NumPy arrays of XLA's
buffers. Outside ``jit`` the same functions call the communicator directly.

Gradient rules (the linear collectives are their own JVPs; each transpose is the collective
that moves cotangents back to where the inputs came from):

- ``all_reduce`` sum/mean: JVP = the same all-reduce of the tangents; transpose = the same
  all-reduce of the cotangents. Other reduce ops are not differentiable.
- ``all_gather``: JVP = all-gather of the tangents; transpose = sum reduce-scatter.
- ``reduce_scatter`` sum: JVP = reduce-scatter of the tangents; transpose = all-gather.
- ``broadcast``: JVP = broadcast of the tangents; transpose = the sum of the cotangents on
  the root, zeros on every other peer.
- ``send``, ``recv``, ``barrier``: not differentiable (a :class:`~burncoll.UsageError` says
  so; wrap their inputs in ``jax.lax.stop_gradient``).

This module imports jax and is not imported by ``import burncoll``.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

import numpy as np

from burncoll.comm.communicator import Communicator
from burncoll.comm.p2p import check_tag
from burncoll.dtypes import dtype_name
from burncoll.errors import BackendUnavailable, UsageError
from burncoll.ops import ReduceOp, parse_reduce_op

try:  # (as Any: jax's own hints are partial, and mypy --strict checks what it sees)
    jax: Any = importlib.import_module("jax")
    jnp: Any = importlib.import_module("jax.numpy")
    io_callback: Any = importlib.import_module("jax.experimental").io_callback
    Primitive: Any = importlib.import_module("jax.extend.core").Primitive
    ad: Any = importlib.import_module("jax.interpreters.ad")
    batching: Any = importlib.import_module("jax.interpreters.batching")
    mlir: Any = importlib.import_module("jax.interpreters.mlir")
except ImportError as exc:  # pragma: no cover - jax is installed where this is tested
    raise BackendUnavailable("burncoll.jax needs jax: pip install 'burncoll[jax]'") from exc

#: What io_callback's lowering calls (jax's own, not public): the callback gets NumPy arrays
#: straight from XLA's buffers, where io_callback would first make jax.Arrays of them and
#: device_put its results (about a quarter of a small jitted step's CPU time, measured).
_emit_python_callback: Any = getattr(importlib.import_module("jax._src.callback"),
                                     "emit_python_callback", None)
if _emit_python_callback is None:  # pragma: no cover - jax 0.10 has it
    raise BackendUnavailable(f"burncoll.jax needs jax._src.callback.emit_python_callback, "
                             f"which jax {jax.__version__} lacks (jax 0.10.2 was tested)")

__all__ = ["all_gather", "all_reduce", "barrier", "broadcast", "recv", "reduce_scatter",
           "send"]

#: io_callback's ordered effect: declaring it makes JAX thread its token through every
#: primitive here (program order) and keep them when their results are unused.
_ORDERED = next(iter(jax.make_jaxpr(
    lambda: io_callback(lambda: None, None, ordered=True))().effects))
_LINEAR = (ReduceOp.SUM, ReduceOp.MEAN)


def all_reduce(x: Any, comm: Communicator, op: ReduceOp | str = "sum") -> Any:
    """``x`` reduced element-wise over every peer of ``comm`` (see
    :meth:`~burncoll.Communicator.all_reduce`); the dtype is kept, so ``mean`` needs a float
    array. Differentiable for ``sum`` and ``mean``."""
    reduce_op = parse_reduce_op(op)
    x = jnp.asarray(x)
    if reduce_op is ReduceOp.MEAN and not jnp.issubdtype(x.dtype, jnp.inexact):
        raise UsageError(f"burncoll.jax.all_reduce: op='mean' keeps the dtype inside jit, "
                         f"and {x.dtype} cannot hold a mean; cast x to a float dtype first")
    return _all_reduce_p.bind(x, comm=_checked(comm), op=reduce_op)[0]


def all_gather(x: Any, comm: Communicator) -> Any:
    """Every peer's ``x`` concatenated along axis 0 in rank order. Inside ``jit`` every peer
    passes the same shape (the result's shape must be known when tracing)."""
    x = _rows(x, "all_gather")
    rows = x.shape[0] * _checked(comm).world_size
    return _all_gather_p.bind(x, comm=comm, rows=rows)[0]


def reduce_scatter(x: Any, comm: Communicator, op: ReduceOp | str = "sum") -> Any:
    """This rank's block of ``x`` reduced over every peer: rows split along axis 0 as
    ``numpy.array_split(x, world_size)`` splits them. Differentiable for ``sum``."""
    x = _rows(x, "reduce_scatter")
    return _reduce_scatter_p.bind(x, comm=_checked(comm), op=parse_reduce_op(op))[0]


def broadcast(x: Any, root: int, comm: Communicator) -> Any:
    """Peer ``root``'s ``x`` on every peer. Every peer passes an array of the root's shape
    and dtype (its values are ignored except on the root)."""
    return _broadcast_p.bind(jnp.asarray(x), comm=_checked(comm), root=comm._check_root(root))[0]


def send(x: Any, dst: int, comm: Communicator, tag: int = 0) -> None:
    """Send ``x`` to peer ``dst`` (see :meth:`~burncoll.Communicator.send`); returns
    nothing, and runs in program order even though nothing uses a result."""
    comm = _checked(comm)
    _send_p.bind(jnp.asarray(x), comm=comm, dst=comm._p2p_peer("burncoll.jax.send", dst, "dst"),
                 tag=check_tag("burncoll.jax.send", tag))


def recv(like: Any, src: int, comm: Communicator, tag: int = 0) -> Any:
    """The array peer ``src`` sent with ``tag``. ``like`` (an array or a
    ``jax.ShapeDtypeStruct``) gives its shape and dtype, which must be known when tracing."""
    comm, label = _checked(comm), "burncoll.jax.recv"
    return _recv_p.bind(comm=comm, src=comm._p2p_peer(label, src, "src"),
                        tag=check_tag(label, tag), shape=tuple(like.shape),
                        dtype=np.dtype(like.dtype))[0]


def barrier(comm: Communicator) -> None:
    """Return once every peer of ``comm`` has reached this barrier (in program order)."""
    _barrier_p.bind(comm=_checked(comm))


# -- checks -----------------------------------------------------------------------------------
def _checked(comm: object) -> Communicator:
    if not isinstance(comm, Communicator):
        raise UsageError(f"burncoll.jax: comm must be a burncoll Communicator (from "
                         f"burncoll.register), got {type(comm).__name__}")
    return comm


def _rows(x: Any, label: str) -> Any:
    x = jnp.asarray(x)
    if x.ndim == 0:
        raise UsageError(f"burncoll.jax.{label} needs an array with at least one dimension")
    return x


def _block_rows(rows: int, comm: Communicator) -> int:
    """The rows of this rank's block of ``numpy.array_split(range(rows), world_size)``."""
    return rows // comm.world_size + (comm.rank < rows % comm.world_size)


def _not_differentiable(name: str) -> Callable[..., Any]:
    def refuse(*_: Any, **__: Any) -> Any:
        raise UsageError(f"burncoll.jax.{name} is not differentiable; wrap its input in "
                         "jax.lax.stop_gradient")
    return refuse


def _differentiable_op(name: str, op: ReduceOp, allowed: tuple[ReduceOp, ...]) -> None:
    if op not in allowed:
        names = " and ".join(o.label for o in allowed)
        raise UsageError(f"burncoll.jax.{name} with op={op.label!r} is not "
                         "differentiable: "
                         f"only {names} are (they are linear)")


# -- the host side (runs in the callback, on NumPy arrays) -----------------------------------
def _take(comm: Communicator, x: Any) -> Any:
    """The callback's NumPy ``x`` as the array type ``comm`` takes: itself, or a JAX array
    on the communicator's device for the jax backend."""
    host = np.asarray(x)
    if comm._backend.name == "numpy":
        return host
    return comm._backend.from_host(host, dtype_name(host.dtype), host.shape, comm.device)


def _give(comm: Communicator, result: Any, want: Any, label: str
          ) -> np.ndarray[Any, Any]:
    host = np.asarray(comm._backend.to_host(result))
    if host.shape != tuple(want.shape) or host.dtype != want.dtype:
        raise UsageError(
            f"burncoll.jax.{label}: this peer expected {want.dtype}{list(want.shape)} when "
            f"traced but the collective gave {host.dtype}{list(host.shape)}; inside jit every "
            "peer must pass the same shapes and dtypes")
    return host


def _all_reduce_host(x: Any, *, comm: Communicator, op: ReduceOp) -> Any:
    return comm.all_reduce(_take(comm, x), op)


def _all_gather_host(x: Any, *, comm: Communicator, rows: int) -> Any:
    return comm.all_gather(_take(comm, x))


def _reduce_scatter_host(x: Any, *, comm: Communicator, op: ReduceOp) -> Any:
    return comm.reduce_scatter(_take(comm, x), op)


def _broadcast_host(x: Any, *, comm: Communicator, root: int) -> Any:
    return comm.broadcast(_take(comm, x) if comm.peer_id == root else None, root)


def _send_host(x: Any, *, comm: Communicator, dst: int, tag: int) -> None:
    comm.send(_take(comm, x), dst, tag)


def _recv_host(*, comm: Communicator, src: int, tag: int, shape: tuple[int, ...],
               dtype: np.dtype[Any]) -> Any:
    return comm.recv(src, tag)


def _barrier_host(*, comm: Communicator) -> None:
    comm.barrier()


# -- the primitives ---------------------------------------------------------------------------
Result = Callable[..., Any]  # -> jax.ShapeDtypeStruct | None


def _primitive(name: str, host: Callable[..., Any], result: Result) -> Any:
    """A primitive whose implementation and lowering are one ordered host callback:
    ``host(*numpy_args, **params)``; ``result(*args, **params)`` is the shape and dtype of
    its one output (from the inputs' shapes and dtypes), or ``None`` for no output."""
    prim = Primitive(f"burncoll_{name}")
    prim.multiple_results = True

    def called(want: Any, params: dict[str, Any]) -> Callable[..., tuple[Any, ...]]:
        def callback(*xs: Any) -> tuple[Any, ...]:
            got = host(*xs, **params)
            return () if want is None else (_give(params["comm"], got, want, name),)
        return callback

    def run(*args: Any, **params: Any) -> list[Any]:  # outside jit: on the input's device
        where = next(iter(args[0].devices())) if args else None
        outs = called(result(*args, **params), params)(*args)
        return [jax.device_put(out, where) for out in outs]

    def lower(ctx: Any, *args: Any, **params: Any) -> Any:
        callback = called(result(*ctx.avals_in, **params), params)
        outs, token, _ = _emit_python_callback(
            ctx, callback, ctx.tokens_in.get(_ORDERED), list(args), ctx.avals_in,
            ctx.avals_out, has_side_effect=True, returns_token=True)
        ctx.set_tokens_out(ctx.tokens_in.update_tokens(mlir.TokenSet({_ORDERED: token})))
        return outs

    def abstract(*avals: Any, **params: Any) -> tuple[list[Any], set[Any]]:
        want = result(*avals, **params)
        shaped = [] if want is None else [jax.core.ShapedArray(want.shape, want.dtype)]
        return shaped, {_ORDERED}

    prim.def_impl(run)
    prim.def_effectful_abstract_eval(abstract)
    mlir.register_lowering(prim, lower, cacheable=False)
    return prim


def _like(x: Any, **_: Any) -> Any:
    return jax.ShapeDtypeStruct(x.shape, x.dtype)


def _gathered(x: Any, *, rows: int, **_: Any) -> Any:
    return jax.ShapeDtypeStruct((rows, *x.shape[1:]), x.dtype)


def _scattered(x: Any, *, comm: Communicator, **_: Any) -> Any:
    return jax.ShapeDtypeStruct((_block_rows(x.shape[0], comm), *x.shape[1:]), x.dtype)


def _received(*, shape: tuple[int, ...], dtype: np.dtype[Any], **_: Any
              ) -> Any:
    return jax.ShapeDtypeStruct(shape, dtype)


_all_reduce_p = _primitive("all_reduce", _all_reduce_host, _like)
_all_gather_p = _primitive("all_gather", _all_gather_host, _gathered)
_reduce_scatter_p = _primitive("reduce_scatter", _reduce_scatter_host, _scattered)
_broadcast_p = _primitive("broadcast", _broadcast_host, _like)
_send_p = _primitive("send", _send_host, lambda x, **_: None)
_recv_p = _primitive("recv", _recv_host, _received)
_barrier_p = _primitive("barrier", _barrier_host, lambda **_: None)


# -- gradient rules ---------------------------------------------------------------------------
def _self_jvp(prim: Any, name: str, ops: tuple[ReduceOp, ...]) -> None:
    """A linear collective's JVP: itself on the primals and on the tangents (a symbolic zero
    tangent is made real: every peer must take part in the tangents' collective)."""
    def jvp(primals: list[Any], tangents: list[Any], **params: Any
            ) -> tuple[list[Any], list[Any]]:
        if "op" in params:
            _differentiable_op(name, params["op"], ops)
        tangent = ad.instantiate_zeros(tangents[0])
        return prim.bind(primals[0], **params), prim.bind(tangent, **params)

    ad.primitive_jvps[prim] = jvp


def _transpose_all_reduce(cts: list[Any], x: Any, *, comm: Communicator, op: ReduceOp
                          ) -> list[Any]:
    return list(_all_reduce_p.bind(ad.instantiate_zeros(cts[0]), comm=comm, op=op))


def _transpose_all_gather(cts: list[Any], x: Any, *, comm: Communicator, rows: int
                          ) -> list[Any]:
    return list(_reduce_scatter_p.bind(ad.instantiate_zeros(cts[0]), comm=comm,
                                       op=ReduceOp.SUM))


def _transpose_reduce_scatter(cts: list[Any], x: Any, *, comm: Communicator, op: ReduceOp
                              ) -> list[Any]:
    return list(_all_gather_p.bind(ad.instantiate_zeros(cts[0]), comm=comm,
                                   rows=x.aval.shape[0]))


def _transpose_broadcast(cts: list[Any], x: Any, *, comm: Communicator, root: int
                         ) -> list[Any]:
    (total,) = _all_reduce_p.bind(ad.instantiate_zeros(cts[0]), comm=comm, op=ReduceOp.SUM)
    return [total if comm.peer_id == root else jnp.zeros_like(total)]


for _prim, _name, _ops in ((_all_reduce_p, "all_reduce", _LINEAR),
                           (_all_gather_p, "all_gather", ()),
                           (_reduce_scatter_p, "reduce_scatter", (ReduceOp.SUM,)),
                           (_broadcast_p, "broadcast", ())):
    _self_jvp(_prim, _name, _ops)
ad.primitive_transposes[_all_reduce_p] = _transpose_all_reduce
ad.primitive_transposes[_all_gather_p] = _transpose_all_gather
ad.primitive_transposes[_reduce_scatter_p] = _transpose_reduce_scatter
ad.primitive_transposes[_broadcast_p] = _transpose_broadcast
ad.primitive_jvps[_send_p] = _not_differentiable("send")
ad.primitive_jvps[_recv_p] = _not_differentiable("recv")


# -- vmap: the batch axis rides along (axis 1 where the collective works on rows) -------------
def _batch(prim: Any, axis: int | None) -> None:
    def rule(args: list[Any], dims: list[int | None], **params: Any
             ) -> tuple[list[Any], list[int | None]]:
        x, dim = args[0], dims[0]
        if axis is not None and dim is not None:
            x, dim = jnp.moveaxis(x, dim, axis), axis
        return prim.bind(x, **params), [dim]

    batching.primitive_batchers[prim] = rule


_batch(_all_reduce_p, None)
_batch(_broadcast_p, None)
_batch(_all_gather_p, 1)
_batch(_reduce_scatter_p, 1)
