"""Each operation as local schedules, composed with the global level when there is one.

One node: the local strategy runs the whole operation. Several nodes (DESIGN.md, "Composing
the levels"): the local peers reduce to a node leader, the leaders run the global operation
over the network, and the leader broadcasts the result back to its local peers. The leader is
the root peer on the root's node and the lowest local peer id elsewhere. A node with a single
local peer has neither local phase in an all-reduce: its leader runs the global all-reduce out
of place, reading the caller's input and writing a fresh result, so the input is never copied.

``prepare`` runs once per operation (in the last peer to arrive) and builds the shared buffers;
``execute`` runs in every peer thread and returns that peer's result.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from burncoll.backends.base import Array
from burncoll.levels import GlobalLink, GlobalOp, HostArray
from burncoll.local.buffers import ChunkBuffer
from burncoll.local.calls import Call
from burncoll.local.fused import prepare_fused, run_fused, wants_fused
from burncoll.local.inline import inline_results, wants_inline
from burncoll.local.server import LocalServer, OpState, Plan
from burncoll.ops import OpKind, ReduceOp
from burncoll.strategies import Action, Strategy, resolve
from burncoll.strategies.layout import Layout, block_rows, even_layout, row_layout, sizes_layout

__all__ = ["execute", "prepare"]


# -- helpers ----------------------------------------------------------------------------------


def _first(state: OpState) -> Call:
    return state.complete_calls()[0]


def _count(shape: tuple[int, ...]) -> int:
    return math.prod(shape)


def _flat_input(server: LocalServer, call: Call) -> Array:
    return server.backend.flatten(call.array)


def _new_buffers(
    server: LocalServer, state: OpState, dtype: str, layout: Layout, with_input: bool
) -> list[ChunkBuffer]:
    return [
        ChunkBuffer(
            server.backend,
            server.devices[i],
            dtype,
            layout,
            _flat_input(server, c) if with_input and c is not None and c.array is not None
            else None,
        )
        for i, c in enumerate(state.calls)
    ]


def run_local(
    server: LocalServer, state: OpState, index: int, deadline: float, plan: Plan,
    buffers: list[ChunkBuffer], op: ReduceOp | None, label: str,
) -> None:
    """Walk ``plan`` as participant ``index``: apply the steps into it, round by round."""
    backend = server.backend
    mine = buffers[index]
    rounds = plan.steps_into[index]
    for r, steps in enumerate(rounds):
        for step in steps:
            other = backend.to_device(buffers[step.src].chunk(step.chunk), mine.device)
            if step.action is Action.REDUCE and op is not None:
                mine.reduce(step.chunk, other, op)
            else:
                mine.assign(step.chunk, other)
        server.sync(state, index, deadline, f"{label} round {r + 1}/{len(rounds)}")


def _finish_reduce(server: LocalServer, x: Array, op: ReduceOp | None) -> Array:
    if op is ReduceOp.MEAN:
        return server.backend.scale(x, server.world_size)
    return x


def _s(server: LocalServer, state: OpState, field: str) -> Strategy:
    """The local strategy of ``field`` for this operation (``auto`` resolved by its size)."""
    return resolve(server.config.strategy(field), "local", state.shared.get("nbytes", 0),
                   server.size)


def _global_op(server: LocalServer, state: OpState, deadline: float) -> GlobalOp:
    call = _first(state)
    dtype: str | None
    shape: tuple[int, ...]
    if call.kind is OpKind.BROADCAST:
        dtype, shape = None, ()
    elif call.kind is OpKind.ALL_GATHER:
        dtype, shape = call.dtype, (call.shape or ())[1:]
    else:
        dtype, shape = call.dtype, call.shape or ()
    return GlobalOp(
        seq=state.seq, kind=call.kind, reduce_op=call.reduce_op, dtype=dtype, shape=shape,
        root=-1 if call.root is None else call.root, deadline=deadline, started=state.started,
    )


def _writable_host(server: LocalServer, flat: Array) -> HostArray:
    host = server.backend.to_host(flat)
    if not host.flags.writeable or not host.flags.c_contiguous:
        host = np.array(host, copy=True, order="C")
    return host


def _link(server: LocalServer) -> GlobalLink:
    if server.link is None:  # pragma: no cover - callers check
        raise RuntimeError("no global link")
    return server.link


def _leader(server: LocalServer, root: int | None) -> int:
    """The local index that talks to other nodes: the root if it is here, else index 0."""
    if root is not None and root in server.index_of:
        return server.index_of[root]
    return 0


# -- prepare ----------------------------------------------------------------------------------


def prepare(server: LocalServer, state: OpState) -> None:
    """Build the shared buffers of ``state``'s operation (runs in one thread)."""
    call = _first(state)
    kind = call.kind
    d = server.size
    calls = state.complete_calls()
    state.shared["nbytes"] = max(
        (_count(c.shape or ()) * c.array.dtype.itemsize if c.array is not None
         and hasattr(c.array, "dtype") else 0) for c in calls)
    if wants_inline(server, calls):
        deadline = state.started + server.config.timeout
        state.shared["results"] = inline_results(server, state, deadline)
        return
    if wants_fused(server, calls):
        prepare_fused(server, state)
        return
    if kind is OpKind.BARRIER or (kind is OpKind.BROADCAST and server.link is not None):
        return
    if kind is OpKind.ALL_REDUCE and _single_local_peer(server):
        return  # no local phase, no buffers: _out_of_place_all_reduce
    if kind is OpKind.BROADCAST:
        root_call = state.calls[server.index_of[call.root or 0]]
        if root_call is None or root_call.array is None or root_call.dtype is None:
            raise RuntimeError("broadcast root has no array")  # validated in the API
        root_index = server.index_of[call.root or 0]
        plan = server.plan(
            ("bcast", _s(server, state, "local_broadcast_strategy"), d, root_index),
            lambda: _s(server, state, "local_broadcast_strategy").broadcast(
                d, server.index_of[call.root or 0]
            ),
        )
        layout = even_layout(_count(root_call.shape or ()), plan.schedule.num_chunks)
        buffers = [
            ChunkBuffer(
                server.backend, server.devices[i], root_call.dtype, layout,
                _flat_input(server, root_call) if c is root_call else None,
            )
            for i, c in enumerate(state.calls)
        ]
        state.shared.update(plan=plan, buffers=buffers, shape=root_call.shape)
        return
    dtype = call.dtype or "float32"
    shape = call.shape or ()
    if kind is OpKind.ALL_GATHER:
        _prepare_all_gather(server, state, dtype, shape)
        return
    if kind is OpKind.REDUCE_SCATTER and server.link is None:
        plan = server.plan(
            ("rs", _s(server, state, "local_all_reduce_strategy"), d),
            lambda: _s(server, state, "local_all_reduce_strategy").reduce_scatter(
                d, tuple(range(d))
            ),
        )
        layout = row_layout(shape, d)
        state.shared.update(plan=plan, buffers=_new_buffers(server, state, dtype, layout, True))
        return
    if kind is OpKind.ALL_REDUCE and server.link is None:
        plan = server.plan(
            ("ar", _s(server, state, "local_all_reduce_strategy"), d),
            lambda: _s(server, state, "local_all_reduce_strategy").all_reduce(d),
        )
    elif kind is OpKind.ALL_REDUCE and server.link is not None and server.link.sharded:
        # local reduce-scatter -> per-shard global all-reduce -> local all-gather
        plan = server.plan(
            ("rs", _s(server, state, "local_all_reduce_strategy"), d),
            lambda: _s(server, state, "local_all_reduce_strategy").reduce_scatter(
                d, tuple(range(d))
            ),
        )
        layout = even_layout(_count(shape), d)
        state.shared.update(plan=plan, buffers=_new_buffers(server, state, dtype, layout, True))
        return
    else:
        # REDUCE on one node, or the first (local reduce) phase of a multi-node operation.
        strategy_field = (
            "local_reduce_strategy" if kind is OpKind.REDUCE else "local_all_reduce_strategy"
        )
        local_root = _leader(server, call.root if kind is OpKind.REDUCE else None)
        plan = server.plan(
            ("reduce", _s(server, state, strategy_field), d, local_root),
            lambda: _s(server, state, strategy_field).reduce(d, local_root),
        )
        state.shared["local_root"] = local_root
    layout = even_layout(_count(shape), plan.schedule.num_chunks)
    state.shared.update(plan=plan, buffers=_new_buffers(server, state, dtype, layout, True))


def _prepare_all_gather(
    server: LocalServer, state: OpState, dtype: str, shape: tuple[int, ...]
) -> None:
    if not shape:
        from burncoll.errors import UsageError

        raise UsageError("all_gather needs arrays with at least one dimension")
    if server.link is not None:
        return
    d = server.size
    row = _count(shape[1:])
    sizes = [(c.shape or (0,))[0] * row for c in state.complete_calls()]
    layout = sizes_layout(sizes)
    plan = server.plan(
        ("ag", _s(server, state, "local_all_reduce_strategy"), d),
        lambda: _s(server, state, "local_all_reduce_strategy").all_gather(d, tuple(range(d))),
    )
    buffers = _new_buffers(server, state, dtype, layout, False)
    for i, c in enumerate(state.complete_calls()):
        buffers[i].assign(i, _flat_input(server, c))
    rows = sum(s for s in sizes) // row if row else sum((c.shape or (0,))[0]
                                                         for c in state.complete_calls())
    state.shared.update(plan=plan, buffers=buffers, shape=(rows, *shape[1:]))


# -- execute ----------------------------------------------------------------------------------


def execute(server: LocalServer, state: OpState, index: int, deadline: float) -> Array | None:
    """Run peer ``index``'s part of the operation and return its result."""
    call = state.calls[index]
    if call is None:  # pragma: no cover - the caller arrived with it
        raise RuntimeError("peer has no call")
    results = state.shared.get("results")
    if results is not None:
        return results[index]
    if "fused" in state.shared:
        return run_fused(server, state, index, deadline, call)
    if server.link is None:
        return _execute_single_node(server, state, index, deadline, call)
    return _execute_multi_node(server, state, index, deadline, call)


def _execute_single_node(
    server: LocalServer, state: OpState, index: int, deadline: float, call: Call
) -> Array | None:
    kind = call.kind
    if kind is OpKind.BARRIER:
        return None
    shared: dict[str, Any] = state.shared
    buffers: list[ChunkBuffer] = shared["buffers"]
    run_local(server, state, index, deadline, shared["plan"], buffers, call.reduce_op,
              kind.label)
    backend = server.backend
    mine = buffers[index]
    if kind is OpKind.REDUCE and index != shared["local_root"]:
        return None
    if kind is OpKind.REDUCE_SCATTER:
        shape = call.shape or ()
        block = backend.copy(mine.chunk(index))
        rows = block_rows(shape, server.size, index)
        return _finish_reduce(server, backend.reshape(block, (rows, *shape[1:])),
                              call.reduce_op)
    shape = shared.get("shape", call.shape) or ()
    result = backend.reshape(mine.result(), tuple(shape))
    return _finish_reduce(server, result, call.reduce_op)


def _execute_multi_node(
    server: LocalServer, state: OpState, index: int, deadline: float, call: Call
) -> Array | None:
    link = _link(server)
    kind = call.kind
    gop = _global_op(server, state, deadline)
    if kind is OpKind.BARRIER:
        if index == 0:
            link.barrier(gop)
        server.sync(state, index, deadline, "global barrier")
        return None
    if kind is OpKind.BROADCAST:
        return _multi_broadcast(server, state, index, deadline, call, gop)
    if kind is OpKind.ALL_GATHER:
        return _multi_all_gather(server, state, index, deadline, call, gop)
    if kind is OpKind.ALL_REDUCE and _single_local_peer(server):
        return _out_of_place_all_reduce(server, call, gop)
    if kind is OpKind.ALL_REDUCE and link.sharded:
        return _sharded_all_reduce(server, state, index, deadline, call, gop)
    shared = state.shared
    buffers: list[ChunkBuffer] = shared["buffers"]
    run_local(server, state, index, deadline, shared["plan"], buffers, call.reduce_op,
              "local reduce")
    leader = shared["local_root"]
    shape = call.shape or ()
    dtype = call.dtype or "float32"
    backend = server.backend
    if kind is OpKind.REDUCE:
        root = call.root if call.root is not None else -1
        root_node = link.node_of[root]
        result: Array | None = None
        if index == leader:
            host = _writable_host(server, buffers[leader].result())
            link.reduce(gop, host, root_node)
            if root_node == link.node_index:
                result = backend.from_host(host, dtype, shape, server.devices[index])
                result = _finish_reduce(server, result, call.reduce_op)
        server.sync(state, index, deadline, "global reduce")
        return result
    if kind is OpKind.REDUCE_SCATTER:
        layout = row_layout(shape, server.world_size)
        if index == leader:
            host = _writable_host(server, buffers[leader].result())
            owners = [link.node_of[pid] for pid in server.world_peer_ids]
            link.reduce_scatter(gop, host, layout, owners)
            shared["host"] = host
        server.sync(state, index, deadline, "global reduce_scatter")
        rank = server.rank_of[server.peer_ids[index]]
        start, stop = layout[rank]
        rows = block_rows(shape, server.world_size, rank)
        block = np.array(shared["host"][start:stop], copy=True)
        out = backend.from_host(block, dtype, (rows, *shape[1:]), server.devices[index])
        server.sync(state, index, deadline, "local scatter")
        return _finish_reduce(server, out, call.reduce_op)
    # ALL_REDUCE: local reduce -> global all-reduce -> local broadcast.
    if index == leader:
        host = _writable_host(server, buffers[leader].result())
        link.all_reduce(gop, host)
        shared["global"] = backend.from_host(host, dtype, (host.size,), server.devices[index])
    server.sync(state, index, deadline, "global all_reduce")
    out = _local_broadcast(server, state, index, deadline, leader, shared["global"], dtype,
                           owned=True)
    return _finish_reduce(server, backend.reshape(out, shape), call.reduce_op)


def _single_local_peer(server: LocalServer) -> bool:
    """A multi-node operation on a node with a single local peer: its input already is the
    node's local reduction, and its result needs no local broadcast."""
    return server.link is not None and server.size == 1


def _out_of_place_all_reduce(server: LocalServer, call: Call, gop: GlobalOp) -> Array:
    """The global all-reduce of the only local peer's input, read where it is.

    The in-place path first copies the input into a working buffer (a whole extra pass over
    the data) so that the network reduction cannot modify it. Here the link only reads the
    input -- the caller's own array on NumPy, a host view or copy on JAX and CuPy, possibly
    read-only -- and writes the result into a fresh array. With one peer per node this is the
    same global schedule on the same channel as the sharded and unsharded compositions, so
    nodes with more peers still match it.
    """
    backend = server.backend
    if isinstance(call.out, np.ndarray) and isinstance(call.array, np.ndarray):
        return _all_reduce_into(server, call, gop, call.array, call.out)
    host = backend.to_host(_flat_input(server, call))
    if not host.flags.c_contiguous:  # pragma: no cover - flatten gives C order
        host = np.ascontiguousarray(host)
    out = np.empty_like(host)
    _link(server).all_reduce(gop, host, out=out)
    result = backend.from_host(out, call.dtype or "float32", call.shape or (),
                               server.devices[0])
    return _finish_reduce(server, result, call.reduce_op)


def _all_reduce_into(server: LocalServer, call: Call, gop: GlobalOp, x: HostArray,
                     out: HostArray) -> HostArray:
    """The caller's ``out=`` on host memory: the network result goes straight into it (in
    place when ``out`` is ``x``); a mean is divided there too (``out`` is a float array)."""
    flat_out = out.reshape(-1)
    if out is x:
        _link(server).all_reduce(gop, flat_out)
    else:
        _link(server).all_reduce(gop, x.reshape(-1), out=flat_out)
    if call.reduce_op is ReduceOp.MEAN:
        np.divide(flat_out, server.world_size, out=flat_out)
    return out


def _sharded_all_reduce(
    server: LocalServer, state: OpState, index: int, deadline: float, call: Call, gop: GlobalOp
) -> Array:
    """Local reduce-scatter, every local peer all-reduces its shard with the same-index peer
    of every other node (one channel per shard, concurrently), then a local all-gather."""
    link = _link(server)
    backend = server.backend
    d = server.size
    buffers: list[ChunkBuffer] = state.shared["buffers"]
    run_local(server, state, index, deadline, state.shared["plan"], buffers, call.reduce_op,
              "local reduce-scatter")
    mine = buffers[index]
    shard = mine.own(index)
    host = backend.to_host(shard)
    in_place = backend.mutable and host.flags.writeable and host.flags.c_contiguous
    if not in_place:
        host = np.array(host, copy=True, order="C")
    link.all_reduce(gop, host, channel=index)
    if not in_place:
        mine.assign(index, backend.from_host(host, call.dtype or "float32", (host.size,),
                                             mine.device))
    plan = server.plan(
        ("ag", _s(server, state, "local_all_reduce_strategy"), d),
        lambda: _s(server, state, "local_all_reduce_strategy").all_gather(d, tuple(range(d))),
    )
    server.sync(state, index, deadline, "global all_reduce of shards")
    run_local(server, state, index, deadline, plan, buffers, None, "local all-gather")
    result = backend.reshape(mine.result(), call.shape or ())
    return _finish_reduce(server, result, call.reduce_op)


def _local_broadcast(
    server: LocalServer, state: OpState, index: int, deadline: float, root: int,
    flat_on_root: Array | None, dtype: str, owned: bool = False,
) -> Array:
    """Broadcast a flat array held by local peer ``root`` (visible in ``state.shared``).

    ``owned``: the array is burncoll's own (not the caller's input), so the root may return
    it as its result instead of a copy.
    """
    d = server.size
    plan = server.plan(
        ("bcast", _s(server, state, "local_broadcast_strategy"), d, root),
        lambda: _s(server, state, "local_broadcast_strategy").broadcast(d, root),
    )
    key = "bcast_buffers"
    if index == root:
        if flat_on_root is None:  # pragma: no cover
            raise RuntimeError("local broadcast root has nothing to send")
        count = server.backend.shape(flat_on_root)[0]
        layout = even_layout(count, plan.schedule.num_chunks)
        state.shared[key] = [
            ChunkBuffer(server.backend, server.devices[i], dtype, layout,
                        flat_on_root if i == root else None)
            for i in range(d)
        ]
    server.sync(state, index, deadline, "local broadcast setup")
    buffers: list[ChunkBuffer] = state.shared[key]
    run_local(server, state, index, deadline, plan, buffers, None, "local broadcast")
    if owned and index == root and flat_on_root is not None:
        return flat_on_root  # never written during a broadcast; the last round has synced
    return buffers[index].result()


def _multi_broadcast(
    server: LocalServer, state: OpState, index: int, deadline: float, call: Call, gop: GlobalOp
) -> Array:
    link = _link(server)
    root = call.root if call.root is not None else -1
    root_node = link.node_of[root]
    leader = _leader(server, root)
    backend = server.backend
    if index == leader:
        mine = state.calls[index]
        send = None
        if root_node == link.node_index and mine is not None:
            send = _writable_host(server, backend.flatten(mine.array))
            # the root's shape travels in the frames; receivers adopt it
            gop = GlobalOp(gop.seq, gop.kind, gop.reduce_op, mine.dtype,
                           mine.shape or (), gop.root, gop.deadline, gop.started)
        host = link.broadcast(gop, send, root_node)
        dtype = _dtype_name(host)
        state.shared["dtype"] = dtype
        state.shared["shape"] = tuple(host.shape)
        state.shared["nbytes"] = host.nbytes
        state.shared["global"] = backend.from_host(
            np.ascontiguousarray(host).reshape(-1), dtype, (host.size,), server.devices[index]
        )
    server.sync(state, index, deadline, "global broadcast")
    out = _local_broadcast(server, state, index, deadline, leader, state.shared["global"],
                           state.shared["dtype"])
    return backend.reshape(out, state.shared["shape"])


def _multi_all_gather(
    server: LocalServer, state: OpState, index: int, deadline: float, call: Call, gop: GlobalOp
) -> Array:
    link = _link(server)
    backend = server.backend
    trailing = (call.shape or ())[1:]
    if index == 0:
        mine = {
            server.rank_of[c.peer_id]: np.ascontiguousarray(backend.to_host(c.array)).reshape(-1)
            for c in state.complete_calls()
        }
        parts = link.all_gather(gop, mine)
        full = np.concatenate([p.reshape(-1) for p in parts]) if parts else np.empty(0)
        dtype = call.dtype or "float32"
        row = _count(trailing)
        rows = full.size // row if row else sum(
            (c.shape or (0,))[0] for c in state.complete_calls()
        )
        state.shared["shape"] = (rows, *trailing)
        state.shared["nbytes"] = full.nbytes
        state.shared["global"] = backend.from_host(full, dtype, (full.size,),
                                                   server.devices[index])
    server.sync(state, index, deadline, "global all_gather")
    out = _local_broadcast(server, state, index, deadline, 0, state.shared["global"],
                           call.dtype or "float32", owned=True)
    return backend.reshape(out, state.shared["shape"])


def _dtype_name(host: HostArray) -> str:
    from burncoll.dtypes import dtype_name

    return dtype_name(host.dtype)
