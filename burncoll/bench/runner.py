"""The measuring code: one node's local peers run every (operation, size) of the sweep.

A row (:data:`~burncoll.bench.results.TIMING_METHOD`): every peer builds its input on its
device; one untimed call is checked against the NumPy reference (:mod:`burncoll.bench.check`);
``warmup`` untimed iterations; ``iters`` timed ones (``barrier()``, then ``perf_counter`` around
the operation alone, until the result is computed on JAX and CuPy); one ``all_gather`` of every
peer's times and wrong count; the row's time is the median over iterations of the slowest
peer's. The slowest peer's time includes the barrier's release skew, as nccl-tests' does.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from burncoll.backends import get_backend
from burncoll.backends.base import Array, Backend
from burncoll.bench.check import ReferenceCache, count_wrong, element_counts, peer_input
from burncoll.bench.options import REDUCING_OPS, ROOTED_OPS
from burncoll.bench.results import Row, busbw_factor, median
from burncoll.comm.communicator import Communicator
from burncoll.config import CollectiveConfig
from burncoll.dtypes import dtype_from_name, is_inexact
from burncoll.train.ddp import DataParallel

__all__ = ["BenchSpec", "run_node"]


@dataclass(frozen=True)
class BenchSpec:
    """What to measure. ``root`` is a peer id; ``sizes`` are bytes (see ``element_counts``)."""

    ops: tuple[str, ...]
    sizes: tuple[int, ...]
    dtype: str = "float32"
    redop: str = "sum"
    root: int = 0
    iters: int = 20
    warmup: int = 5
    #: all_reduce returns a new array per call instead of writing into a preallocated ``out``.
    fresh_results: bool = False


@dataclass
class _Context:
    spec: BenchSpec
    config: CollectiveConfig
    backend: Backend
    cache: ReferenceCache
    emit: Callable[[Row], None]


def run_node(spec: BenchSpec, config: CollectiveConfig, node_rank: int = 0,
             on_row: Callable[[Row], None] | None = None) -> list[Row]:
    """Run this node's ``config.num_devices`` peers through the sweep; block until done. Peer ids
    are ``node_rank * num_devices + d`` for local device ``d``. Returns the rows on the node that
    holds rank 0 (``on_row`` is called with each as soon as it is known) and ``[]`` on the other
    nodes. One thread per peer (:meth:`burncoll.train.DataParallel.run`): a failing peer aborts
    the others, and its error is raised after every thread ended."""
    devices = config.num_devices
    world = devices * (config.num_nodes or 1)
    rows: list[Row] = []
    lock = threading.Lock()

    def emit(row: Row) -> None:
        with lock:
            rows.append(row)
        if on_row is not None:
            on_row(row)

    if config.backend == "jax":
        _give_jax_cpu_devices(devices)
    cache = ReferenceCache(world, config.compression, config.num_nodes or 1)
    context = _Context(spec, config, get_backend(config.backend), cache, emit)
    DataParallel(range(devices), config, node_rank).run(lambda comm: _sweep(context, comm))
    return rows


def _give_jax_cpu_devices(devices: int) -> None:
    """Ask XLA for ``devices`` CPU devices, unless jax is already imported or told otherwise. Only
    the CPU platform reads this flag; accelerators keep their real devices."""
    flags = os.environ.get("XLA_FLAGS", "")
    if "jax" not in sys.modules and "xla_force_host_platform_device_count" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={devices}"


def _sweep(context: _Context, comm: Communicator) -> None:
    spec = context.spec
    itemsize = dtype_from_name(spec.dtype).itemsize
    for op in spec.ops:
        if op == "barrier":
            _measure(context, comm, op, 0, 0, 0)
            continue
        seen: set[int] = set()
        for requested in spec.sizes:
            total, per_peer = element_counts(op, requested, itemsize, comm.world_size)
            if total == 0 or total in seen:
                continue  # too small for one element per peer, or the same as the last size
            seen.add(total)
            _measure(context, comm, op, requested, total, per_peer)


def _operation(comm: Communicator, op: str, x: Array,
               spec: BenchSpec) -> Callable[[], Array | None]:
    """The call to time, with its arguments bound."""
    if op == "all_reduce":
        backend = comm._backend
        integer_mean = spec.redop == "mean" and not is_inexact(dtype_from_name(spec.dtype))
        if spec.fresh_results or not backend.mutable or integer_mean:
            return lambda: comm.all_reduce(x, spec.redop)
        # as nccl-tests (out-of-place: separate send and receive buffers, both allocated once)
        # and mpi4py's Allreduce(sendbuf, recvbuf) measure it
        out = backend.copy(x)
        return lambda: comm.all_reduce(x, spec.redop, out=out)
    if op == "reduce":
        return lambda: comm.reduce(x, spec.root, spec.redop)
    if op == "broadcast":
        mine = x if comm.peer_id == spec.root else None
        return lambda: comm.broadcast(mine, spec.root)
    if op == "reduce_scatter":
        return lambda: comm.reduce_scatter(x, spec.redop)
    if op == "all_gather":
        return lambda: comm.all_gather(x)
    if op == "barrier":
        return comm.barrier
    raise ValueError(f"unknown operation {op!r}")  # pragma: no cover - parse_ops checks


def _wait(result: Array | None) -> None:
    """Block until ``result`` is computed: JAX and CuPy return before their device is done."""
    if result is None:
        return
    block = getattr(result, "block_until_ready", None)  # jax.Array
    if callable(block):
        block()
        return
    synchronize = getattr(getattr(result, "device", None), "synchronize", None)  # cupy
    if callable(synchronize):
        synchronize()


def _measure(context: _Context, comm: Communicator, op: str, requested: int, total: int,
             per_peer: int) -> None:
    spec, backend = context.spec, context.backend
    host_input = peer_input(comm.rank, per_peer, spec.dtype)
    x = backend.from_host(host_input, spec.dtype, host_input.shape, comm.device)
    call = _operation(comm, op, x, spec)

    wrong = 0
    result = call()
    if op != "barrier":
        got = None if result is None else np.asarray(backend.to_host(result))
        expected = context.cache.expected(op, total, spec.dtype, spec.redop, spec.root, comm.rank)
        wrong = count_wrong(got, expected)
    del result

    for _ in range(spec.warmup):
        comm.barrier()
        _wait(call())
    times: list[float] = []
    for _ in range(spec.iters):
        comm.barrier()
        start = time.perf_counter()
        _wait(call())
        times.append(time.perf_counter() - start)

    # float32 travels on every backend (JAX has no float64 by default): times in µs, and the
    # wrong count split in two exact halves
    mine = np.asarray([[*(t * 1e6 for t in times), *divmod(wrong, 2**20)]], dtype=np.float32)
    gathered = comm.all_gather(backend.from_host(mine, "float32", mine.shape, comm.device))
    if comm.rank != 0:
        return
    stats = np.asarray(backend.to_host(gathered), dtype=np.float64)
    stats = stats.reshape(comm.world_size, spec.iters + 2)
    slowest = stats[:, : spec.iters].max(axis=0)
    seconds = median([float(t) for t in slowest]) / 1e6
    size = total * dtype_from_name(spec.dtype).itemsize
    algbw = size / seconds / 1e9 if seconds > 0 else 0.0
    context.emit(
        Row(op=op, requested=requested, size=size, count=total,
            dtype=spec.dtype if op != "barrier" else "none",
            redop=spec.redop if op in REDUCING_OPS else "none",
            root=spec.root if op in ROOTED_OPS else -1, time_us=seconds * 1e6, algbw=algbw,
            busbw=algbw * busbw_factor(op, comm.world_size),
            wrong=int(stats[:, spec.iters].sum()) * 2**20 + int(stats[:, spec.iters + 1].sum()),
            iter_times_us=[float(t) for t in slowest])
    )
