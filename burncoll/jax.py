"""Collectives inside ``jax.jit`` (and under ``jax.grad``, ``jax.jvp``, ``jax.vmap``).

Every function takes the :class:`~burncoll.Communicator` explicitly, as a Python object: it
is closed over (or a static argument), never traced. Inside a jitted function each call is a
JAX primitive lowered to one host callback that carries the ordered effect of
``jax.experimental.io_callback(..., ordered=True)``, so the collectives of one function run
in program order and are never removed as dead code. On the CPU the callback is XLA's buffer
callback (the FFI target of ``jax.experimental.buffer_callback``): it gets XLA's input and
output buffers themselves, and the collective reads the one and writes into the other with no
copy between (an all-reduce of the NumPy backend reduces straight into XLA's output buffer).
On other platforms it is io_callback's, which hands over host copies. Outside ``jit`` the
same functions call the communicator directly.

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

#: The lowering of io_callback (jax's own, not public), for platforms other than the CPU: the
#: callback gets NumPy copies of XLA's input buffers and its results are copied into XLA's.
_emit_python_callback: Any = getattr(importlib.import_module("jax._src.callback"),
                                     "emit_python_callback", None)
#: The token an ordered FFI call takes and returns (jax.core's is deprecated in jax 0.10).
_abstract_token: Any = getattr(importlib.import_module("jax._src.core"), "abstract_token", None)
if _emit_python_callback is None or _abstract_token is None:  # pragma: no cover - jax 0.10
    raise BackendUnavailable(f"burncoll.jax needs jax._src.callback.emit_python_callback and "
                             f"jax._src.core.abstract_token, which jax {jax.__version__} "
                             "lacks (jax 0.10.2 was tested)")
#: The CPU's buffer callback, called as ``callback(context, *inputs, *outputs)`` with XLA's
#: own buffers (``jax.experimental.buffer_callback`` lowers to it, without our ordered token).
_buffer_callback = jax.ffi.ffi_lowering("xla_buffer_python_cpu_callback", has_side_effect=True)

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
#: ``host(out, *xs, **params)``: the collective of NumPy arrays ``xs``, its result written
#: into ``out`` (an array of the traced shape and dtype; ``None`` for no result).
Host = Callable[..., None]


def _take(comm: Communicator, x: Any) -> Any:
    """The callback's NumPy ``x`` as the array type ``comm`` takes: itself, or a JAX array
    on the communicator's device for the jax backend."""
    if comm._backend.name == "numpy":
        return x
    return comm._backend.from_host(x, dtype_name(x.dtype), x.shape, comm.device)


def _give(comm: Communicator, result: Any, out: np.ndarray[Any, Any], label: str) -> None:
    """``result`` copied into ``out``, whose shape and dtype were traced."""
    host = np.asarray(comm._backend.to_host(result))
    if host.shape != out.shape or host.dtype != out.dtype:
        raise UsageError(
            f"burncoll.jax.{label}: this peer expected {out.dtype}{list(out.shape)} when "
            f"traced but the collective gave {host.dtype}{list(host.shape)}; inside jit every "
            "peer must pass the same shapes and dtypes")
    np.copyto(out, host)


def _all_reduce_host(out: Any, x: Any, *, comm: Communicator, op: ReduceOp) -> None:
    if comm._backend.name == "numpy":  # reduced straight into out (XLA's buffer in jit)
        comm.all_reduce(x, op, out=out)
    else:
        _give(comm, comm.all_reduce(_take(comm, x), op), out, "all_reduce")


def _all_gather_host(out: Any, x: Any, *, comm: Communicator, rows: int) -> None:
    _give(comm, comm.all_gather(_take(comm, x)), out, "all_gather")


def _reduce_scatter_host(out: Any, x: Any, *, comm: Communicator, op: ReduceOp) -> None:
    _give(comm, comm.reduce_scatter(_take(comm, x), op), out, "reduce_scatter")


def _broadcast_host(out: Any, x: Any, *, comm: Communicator, root: int) -> None:
    mine = _take(comm, x) if comm.peer_id == root else None
    _give(comm, comm.broadcast(mine, root), out, "broadcast")


def _send_host(out: None, x: Any, *, comm: Communicator, dst: int, tag: int) -> None:
    comm.send(_take(comm, x), dst, tag)


def _recv_host(out: Any, *, comm: Communicator, src: int, tag: int, shape: tuple[int, ...],
               dtype: np.dtype[Any]) -> None:
    _give(comm, comm.recv(src, tag), out, "recv")


def _barrier_host(out: None, *, comm: Communicator) -> None:
    comm.barrier()


# -- the primitives ---------------------------------------------------------------------------
Result = Callable[..., Any]  # -> jax.ShapeDtypeStruct | None


def _empty(want: Any) -> np.ndarray[Any, Any] | None:
    return None if want is None else np.empty(want.shape, want.dtype)


def _primitive(name: str, host: Host, result: Result) -> Any:
    """A primitive whose implementation and lowering are one ordered host callback that runs
    ``host(out, *numpy_args, **params)``; ``result(*args, **params)`` is the shape and dtype
    of its one output (from the inputs' shapes and dtypes), or ``None`` for no output."""
    prim = Primitive(f"burncoll_{name}")
    prim.multiple_results = True

    def run(*args: Any, **params: Any) -> list[Any]:  # outside jit: on the input's device
        where = next(iter(args[0].devices())) if args else None
        out = _empty(result(*args, **params))
        host(out, *map(np.asarray, args), **params)
        return [] if out is None else [jax.device_put(out, where)]

    def on_cpu(ctx: Any, *args: Any, **params: Any) -> Any:
        return _lower_to_buffers(ctx, list(args), lambda *xs: host(*xs, **params))

    def elsewhere(ctx: Any, *args: Any, **params: Any) -> Any:
        return _lower_to_copies(ctx, list(args), lambda *xs: host(*xs, **params),
                                result(*ctx.avals_in, **params))

    def abstract(*avals: Any, **params: Any) -> tuple[list[Any], set[Any]]:
        want = result(*avals, **params)
        shaped = [] if want is None else [jax.core.ShapedArray(want.shape, want.dtype)]
        return shaped, {_ORDERED}

    prim.def_impl(run)
    prim.def_effectful_abstract_eval(abstract)
    mlir.register_lowering(prim, on_cpu, platform="cpu", cacheable=False)
    mlir.register_lowering(prim, elsewhere, cacheable=False)
    return prim


def _lower_to_buffers(ctx: Any, args: list[Any], call: Host) -> list[Any]:
    """``call`` as the CPU's buffer callback, the ordered token its last operand and result.

    It gets ``(context, *inputs, token, *outputs, token)``: views of XLA's buffers. The
    inputs are made read-only (XLA may still read them after the call: the collective must
    not write into them); the output is the custom call's own result buffer, which no other
    operation holds while it runs, so the collective writes its result there."""
    def callback(_: Any, *buffers: Any) -> None:
        xs = [np.asarray(b) for b in buffers[:len(args)]]
        for x in xs:
            x.flags.writeable = False
        outs = buffers[len(args) + 1:-1]
        call(np.asarray(outs[0]) if outs else None, *xs)

    ctx.module_context.add_host_callback(callback)
    index = np.uint64(len(ctx.module_context.host_callbacks) - 1)
    tokened = ctx.replace(avals_in=[*ctx.avals_in, _abstract_token],
                          avals_out=[*ctx.avals_out, _abstract_token])
    outs = list(_buffer_callback(tokened, *args, ctx.tokens_in.get(_ORDERED), index=index))
    ctx.set_tokens_out(ctx.tokens_in.update_tokens(mlir.TokenSet({_ORDERED: outs.pop()})))
    return outs


def _lower_to_copies(ctx: Any, args: list[Any], call: Host, want: Any) -> Any:
    """``call`` as io_callback's ordered callback (other platforms than the CPU): it gets
    host copies of the inputs, and its result is copied into XLA's output buffer."""
    def callback(*xs: Any) -> tuple[Any, ...]:
        out = _empty(want)
        call(out, *xs)
        return () if out is None else (out,)

    outs, token, _ = _emit_python_callback(
        ctx, callback, ctx.tokens_in.get(_ORDERED), args, ctx.avals_in, ctx.avals_out,
        has_side_effect=True, returns_token=True)
    ctx.set_tokens_out(ctx.tokens_in.update_tokens(mlir.TokenSet({_ORDERED: token})))
    return outs


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
