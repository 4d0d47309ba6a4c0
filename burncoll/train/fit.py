"""The data-parallel training loop behind :meth:`DataParallel.fit`, and its steps.

Each step, every peer computes the loss and gradients of its shard of the global batch with the
user's ``grad_fn``, averages them over all peers with one bucketed all-reduce
(:func:`~burncoll.comm.buckets.all_reduce_tree`) and applies the update; the averaged
gradients are bitwise identical everywhere, so the replicas stay so. With equal shards the mean
of per-shard mean gradients is the full-batch one (``grad_fn`` returns the *mean* loss): ``fit``
computes what single-device training does, up to rounding. With ``checkpoint_dir`` a restarted
run resumes bitwise (:mod:`burncoll.train.checkpoint`).

``grad_fn`` returns its gradients as a tree (one bucketed all-reduce after it returns) or as
an iterator of ``(key, grad)`` pairs, last layer first, fed to a
:class:`~burncoll.train.overlap.GradientBuckets` so buckets reduce while backward runs
(:class:`StepReducer`). As DDP does, the first step's buckets follow the reverse flattening
order; then the order rank 0's generator yielded is broadcast and used by every peer.
"""

from __future__ import annotations

import hashlib
import numbers
import os
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar, runtime_checkable

import numpy as np

from burncoll.backends import get_backend
from burncoll.backends.base import Array, Backend, Device
from burncoll.comm.buckets import (
    DEFAULT_BUCKET_BYTES,
    all_reduce_tree,
    broadcast_tree,
    flatten_tree,
)
from burncoll.comm.communicator import Communicator
from burncoll.config import CollectiveConfig
from burncoll.dtypes import dtype_from_name, dtype_name, is_inexact
from burncoll.errors import UsageError
from burncoll.train.checkpoint import Checkpointer, RunInfo, Spec, checkpointer, from_numpy
from burncoll.train.overlap import GradientBuckets

R = TypeVar("R")


class Replicas(Protocol):
    """What :func:`fit` needs of :class:`~burncoll.train.DataParallel`: its config, and a way
    to run a function once per device."""

    @property
    def config(self) -> CollectiveConfig: ...

    def run(self, fn: Callable[[Communicator], R]) -> list[R]: ...


__all__ = ["FitResult", "GradFn", "GradientTransformation", "Progress", "StepReducer", "Update",
           "apply_updates", "fit", "loss_leaf", "replicas_identical"]

#: ``grad_fn(params, batch) -> (loss, grads)``: the mean loss over ``batch`` (a scalar or 0-d
#: array) and its gradient, a tree shaped like ``params`` (``jax.value_and_grad`` fits), or
#: an iterator of ``(key, grad)`` pairs, every leaf once, that backward yields layer by layer,
#: last layer first (``key``: the leaf's path in ``params``, or its dict key): each bucket is
#: then reduced while the next gradients are computed (:class:`StepReducer`).
#: ``bucket_bytes`` is DDP's ``bucket_cap_mb``, in bytes (25 MiB by default); about one
#: layer's gradients lets each layer's reduction start as soon as backward has produced it.
GradFn = Callable[[Any, Any], tuple[Any, Any]]


@runtime_checkable
class GradientTransformation(Protocol):
    """An optax-style optimizer: ``init(params) -> state`` and
    ``update(grads, state, params) -> (updates, state)``; updates are added to the params."""

    def init(self, params: Any) -> Any: ...

    def update(self, updates: Any, state: Any, params: Any = None) -> tuple[Any, Any]: ...


#: A plain ``update(params, grads) -> new_params``, or an optax ``GradientTransformation``.
Update = Callable[[Any, Any], Any] | GradientTransformation


@dataclass(frozen=True)
class FitResult:
    """What :meth:`DataParallel.fit` returns."""

    #: The final parameters: the replica of this node's first device.
    params: Any
    #: The loss of every step (before its update), averaged over the whole global batch.
    losses: list[float]
    #: True when every replica of the collective, on every node, ended bitwise identical.
    identical: bool


def fit(dp: Replicas, params: Any, data: Any, grad_fn: GradFn, update: Update, *, steps: int,
        batch_size: int | None = None, seed: int = 0, bucket_bytes: int | None = None,
        progress: bool = True, desc: str = "ddp",
        callback: Callable[[Communicator, int, Any], None] | None = None,
        checkpoint_dir: str | os.PathLike[str] | None = None,
        checkpoint_every: int | None = None) -> FitResult:
    """Train ``params`` for ``steps`` steps on every device of ``dp``; the final state.

    - ``params``: the initial tree of arrays. Rank 0's is broadcast, so every replica starts
      alike even when the nodes initialised theirs differently.
    - ``data``: an array, or a tuple/list of arrays (say ``(x, y)``), sharing their first
      dimension (the examples): NumPy arrays or arrays of the config's backend. Every node must
      hold the same data. ``grad_fn`` receives a shard in the same form (a tuple for a
      list), on the peer's device.
    - ``grad_fn(params, batch) -> (loss, grads)``, and ``bucket_bytes``: see :data:`GradFn`.
    - ``update``: ``update(params, grads) -> params`` (a plain function; it may update NumPy
      arrays in place, each replica is private), or an optax ``GradientTransformation``.
    - ``batch_size``: the global batch, split evenly among all peers of all nodes. ``None``
      takes every example each step (full-batch descent, shard ``r`` is the ``r``-th
      contiguous block). Otherwise each epoch visits the examples in an order shuffled by
      ``seed`` (the same on every peer), ``len(data) // batch_size`` steps per epoch; the
      remainder of an epoch is not used. The global batch must divide evenly by the world
      size: a :class:`~burncoll.UsageError` says so otherwise, rather than dropping examples.
    - ``progress``: a tqdm bar with the loss on rank 0 (plain lines when tqdm is missing).
    - ``callback(comm, step, params)``: called on every peer after every step and checkpoint.
    - ``checkpoint_dir``: rank 0 saves ``fit-checkpoint.npz`` there (created when missing;
      :mod:`burncoll.train.checkpoint`) after every ``checkpoint_every``-th and the last step.
      A run finding one resumes after its step, ending bitwise like an uninterrupted run (with
      more ``steps`` it trains on). One unreadable, of another run (``seed``, global batch, data
      shapes) or model, or beyond ``steps`` raises :class:`~burncoll.UsageError` on every peer.
    - ``checkpoint_every``: an int >= 1; by default ``max(1, steps // 10)``. Checked but
      unused without ``checkpoint_dir`` (``None`` switches checkpointing off).

    ``FitResult.losses`` covers every step, those done before a restart included.

    Failures follow :meth:`DataParallel.run`: an error on one peer aborts all and is raised.
    """
    arrays, as_tuple = _split_data(data)
    world = dp.config.num_devices * (dp.config.num_nodes or 1)
    batch = _global_batch(steps, batch_size, arrays[0].shape[0], world)
    run = None if checkpoint_dir is None else _run_info(seed, batch, batch_size, arrays, dp.config)
    job = _Job(params, arrays, as_tuple, grad_fn, update, steps, batch, batch_size is None, seed,
               DEFAULT_BUCKET_BYTES if bucket_bytes is None else bucket_bytes, progress, desc,
               callback, checkpointer(checkpoint_dir, checkpoint_every, steps, run))
    results = dp.run(job.train)
    final, losses, _ = results[0]
    return FitResult(final, losses, all(r[2] for r in results))


def _global_batch(steps: int, batch_size: int | None, rows: int, world: int) -> int:
    """The examples of one step on all replicas together, checked (see :func:`fit`)."""
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
        raise UsageError(f"steps must be a non-negative int, got {steps!r}")
    batch = rows if batch_size is None else batch_size
    if isinstance(batch, bool) or not isinstance(batch, int) or not 1 <= batch <= rows:
        raise UsageError(f"batch_size must be an int in 1..{rows} (the examples), got {batch!r}")
    _require_divisible(batch, world, batch_size is None)
    return batch


def _require_divisible(batch: int, world: int, full_batch: bool) -> None:
    if batch % world:
        what = "the data set" if full_batch else "batch_size"
        raise UsageError(
            f"{what} has {batch} examples, which do not divide evenly among {world} replicas; "
            f"use a multiple of {world} (each replica then gets batch // {world} examples)"
        )


@dataclass(frozen=True)
class _Job:
    """One :func:`fit` call, as every replica's thread runs it."""

    params: Any
    arrays: list[Any]
    as_tuple: bool
    grad_fn: GradFn
    update: Update
    steps: int
    batch: int
    full_batch: bool
    seed: int
    bucket: int
    progress: bool
    desc: str
    callback: Callable[[Communicator, int, Any], None] | None
    checkpoint: Checkpointer | None

    def train(self, comm: Communicator) -> tuple[Any, list[float], bool]:
        """This replica's training loop: its final params, losses, and whether all agree."""
        backend = get_backend(comm.config.backend)
        # an elastic session may hold fewer nodes than the config says
        _require_divisible(self.batch, comm.world_size, self.full_batch)
        sampler = _Sampler(self.arrays, self.as_tuple, self.batch, self.full_batch, self.seed,
                           comm, backend)
        p = broadcast_tree(comm, self.params, comm.peer_ids[0], self.bucket)
        update, ckpt = self.update, self.checkpoint
        stateful = isinstance(update, GradientTransformation)
        state = update.init(p) if isinstance(update, GradientTransformation) else None
        start, losses = 0, list[float]()
        if ckpt is not None:
            restored = ckpt.restore(comm, p, state, stateful, self.bucket, steps=self.steps)
            if restored is not None:
                start, p, state, losses = restored
        bar = Progress(self.steps, self.desc, self.progress and comm.rank == 0, start)
        reduce = StepReducer(comm, self.bucket)
        try:
            for step in range(start, self.steps):
                loss, grads = self.grad_fn(p, sampler.batch(step))
                loss_mean, grads = reduce(p, loss, grads)
                if isinstance(update, GradientTransformation):
                    updates, state = update.update(grads, state, p)
                    p = apply_updates(p, updates)
                else:
                    p = update(p, grads)
                losses.append(float(backend.to_host(loss_mean)))
                bar.step(losses[-1])
                if ckpt is not None and ckpt.due(step + 1, self.steps):
                    ckpt.save(comm, step + 1, p, state, stateful, losses)
                if self.callback is not None:
                    self.callback(comm, step, p)
        finally:
            bar.close()
        return p, losses, replicas_identical(comm, p)


def replicas_identical(comm: Communicator, tree: Any) -> bool:
    """True when every peer's ``tree`` is bitwise identical (dtypes and shapes included).

    A collective: every peer must call it. Each peer hashes its leaves (SHA-256) and the
    digests are all-gathered, so the answer is the same on every peer, on every node.
    """
    backend = get_backend(comm.config.backend)
    digest = hashlib.sha256()
    leaves, _ = flatten_tree(tree)
    for leaf in leaves:
        host = np.ascontiguousarray(backend.to_host(leaf) if backend.is_array(leaf) else leaf)
        digest.update(f"{dtype_name(host.dtype)}{host.shape};".encode())
        digest.update(host.tobytes())
    mine = np.frombuffer(digest.digest(), dtype=np.uint8).copy()
    gathered = np.asarray(backend.to_host(comm.all_gather(from_numpy(backend, mine, comm.device))))
    rows = gathered.reshape(comm.world_size, mine.size)
    return bool((rows == rows[0]).all())


# -- helpers ------------------------------------------------------------------------------------


def _split_data(data: Any) -> tuple[list[Any], bool]:
    arrays = list(data) if isinstance(data, list | tuple) else [data]
    if not arrays:
        raise UsageError("data must be an array or a non-empty tuple of arrays")
    rows: list[int] = []
    for i, a in enumerate(arrays):
        shape = getattr(a, "shape", None)
        if shape is None or len(shape) == 0:
            raise UsageError(f"data[{i}] must be an array with a first (examples) dimension")
        rows.append(int(shape[0]))
    if len(set(rows)) != 1:
        raise UsageError(f"the data arrays must share their first dimension, got {rows}")
    return arrays, isinstance(data, list | tuple)


def _run_info(seed: Any, batch: int, batch_size: int | None, arrays: list[Any],
              config: CollectiveConfig) -> RunInfo:
    """What a checkpoint records of this run: seed, global batch, and the data's fingerprint
    (each array's dtype and shape, read without copying the data)."""
    if isinstance(seed, bool) or not isinstance(seed, numbers.Integral):
        raise UsageError(f"seed must be an int, got {seed!r}")
    backend = get_backend(config.backend)
    specs: list[Spec] = []
    for a in arrays:
        if backend.is_array(a):
            specs.append((backend.dtype_name(a), tuple(int(n) for n in backend.shape(a))))
            continue
        try:
            dtype = dtype_name(np.dtype(a.dtype))
        except (AttributeError, TypeError):  # an array type NumPy does not know the dtype of
            dtype = str(getattr(a, "dtype", type(a).__name__))
        specs.append((dtype, tuple(int(n) for n in a.shape)))
    return RunInfo(int(seed), batch, batch_size is None, int(arrays[0].shape[0]), tuple(specs))


class _Sampler:
    """This peer's shard of each step's global batch; the same schedule on every peer."""

    def __init__(self, arrays: Sequence[Any], as_tuple: bool, batch: int, full: bool, seed: int,
                 comm: Communicator, backend: Backend) -> None:
        self._arrays = arrays
        self._as_tuple = as_tuple
        self._rows = int(arrays[0].shape[0])
        self._batch = batch
        self._full = full
        self._seed = seed
        self._shard = batch // comm.world_size
        self._offset = comm.rank * self._shard
        self._backend = backend
        self._device = comm.device
        self._epoch: tuple[int, np.ndarray[Any, Any]] | None = None
        self._cached: Any = None

    def batch(self, step: int) -> Any:
        if self._full:
            if self._cached is None:
                self._cached = self._take(slice(self._offset, self._offset + self._shard))
            return self._cached
        epoch, k = divmod(step, self._rows // self._batch)
        if self._epoch is None or self._epoch[0] != epoch:
            order = np.random.default_rng([self._seed, epoch]).permutation(self._rows)
            self._epoch = (epoch, order)
        start = k * self._batch + self._offset
        return self._take(self._epoch[1][start : start + self._shard])

    def _take(self, index: slice | np.ndarray[Any, Any]) -> Any:
        parts = [self._to_peer(a[index]) for a in self._arrays]
        return tuple(parts) if self._as_tuple else parts[0]

    def _to_peer(self, x: Any) -> Any:
        if self._backend.is_array(x):
            return self._backend.to_device(x, self._device)
        return from_numpy(self._backend, np.asarray(x), self._device)


class StepReducer:
    """Averages each step's loss and gradients over every peer, for one replica of ``fit``
    (see the module: a tree at once, an iterator of ``(key, grad)`` bucket by bucket)."""

    def __init__(self, comm: Communicator, bucket_bytes: int) -> None:
        self._comm = comm
        self._backend = get_backend(comm.config.backend)
        self._bucket_bytes = bucket_bytes
        #: The agreed bucket order (leaf indices of ``(loss, params)``) after the first
        #: streamed step; ``None`` before it.
        self.order: list[int] | None = None

    def __call__(self, params: Any, loss: Any, grads: Any) -> tuple[Array, Any]:
        """``(mean loss, mean gradients)`` over every peer; the gradients shaped as
        ``params`` when ``grads`` is an iterator, as ``grads`` otherwise."""
        comm, backend = self._comm, self._backend
        if not isinstance(grads, Iterator):
            leaf = loss_leaf(backend, loss, grads, comm.device)
            return all_reduce_tree(comm, (leaf, grads), "mean", self._bucket_bytes)
        leaf = loss_leaf(backend, loss, params, comm.device)
        buckets = GradientBuckets(comm, (leaf, params), "mean", self._bucket_bytes,
                                  order=self.order, keys_under=(1,))
        buckets.ready_leaf(0, leaf)
        for item in grads:
            if not isinstance(item, tuple) or len(item) != 2:
                raise UsageError("a grad_fn returning an iterator must yield (key, grad) pairs, "
                                 f"got {type(item).__name__}")
            buckets.ready(*item)
        loss_mean, reduced = buckets.wait()
        if self.order is None:
            self.order = self._rank0_order(buckets.arrival_order)
        return loss_mean, reduced

    def _rank0_order(self, mine: list[int]) -> list[int]:
        """Rank 0's ``mine``, on every peer (one broadcast)."""
        comm, backend = self._comm, self._backend
        root = comm.peer_ids[0]
        host = np.asarray(mine, dtype=np.int32)
        got = comm.broadcast(from_numpy(backend, host, comm.device) if comm.peer_id == root
                             else None, root)
        return [int(i) for i in np.asarray(backend.to_host(got))]


def loss_leaf(backend: Backend, loss: Any, grads: Any, device: Device) -> Array:
    """The loss as a 0-d array of ``backend``, in the first float dtype of ``grads`` (a tree)
    when it is not an array."""
    if backend.is_array(loss):
        if backend.shape(loss) != ():
            raise UsageError(f"grad_fn must return a scalar loss, got shape {backend.shape(loss)}")
        return loss
    like = "float64"
    for leaf in flatten_tree(grads)[0]:
        if backend.is_array(leaf) and is_inexact(dtype_from_name(backend.dtype_name(leaf))):
            like = backend.dtype_name(leaf)
            break
    host = np.asarray(loss, dtype=dtype_from_name(like))
    if host.shape != ():
        raise UsageError(f"grad_fn must return a scalar loss, got shape {host.shape}")
    return from_numpy(backend, host, device)


def apply_updates(params: Any, updates: Any) -> Any:
    """``params + updates`` leaf by leaf, in the params' dtypes, as ``optax.apply_updates``. Written
    out rather than calling optax, which would turn NumPy leaves into JAX arrays."""
    p_leaves, unflatten = flatten_tree(params)
    u_leaves, _ = flatten_tree(updates)
    if len(p_leaves) != len(u_leaves):
        raise UsageError(
            f"the optimizer returned {len(u_leaves)} updates for {len(p_leaves)} parameters"
        )
    return unflatten([(p + u).astype(p.dtype) for p, u in zip(p_leaves, u_leaves, strict=True)])


class Progress:
    """A tqdm bar with the loss; plain lines on stderr when tqdm is not installed or stderr
    is no terminal (a log file, or ``burncoll launch``, which prefixes each node's lines: a
    bar's redraws would each become a line there)."""

    def __init__(self, total: int, desc: str, enabled: bool, done: int = 0) -> None:
        self._total = total
        self._desc = desc
        self._enabled = enabled
        self._done = done
        self._bar: Any = None
        if enabled and sys.stderr.isatty():
            try:
                from tqdm.auto import tqdm
            except ImportError:
                return
            self._bar = tqdm(total=total, initial=min(done, total), desc=desc, unit="step",
                             dynamic_ncols=True)

    def step(self, loss: float) -> None:
        if not self._enabled:
            return
        self._done += 1
        if self._bar is not None:
            self._bar.set_postfix(loss=f"{loss:.4g}", refresh=False)
            self._bar.update(1)
        elif self._done % max(1, self._total // 10) == 0 or self._done == self._total:
            print(f"{self._desc}: step {self._done}/{self._total} loss {loss:.4g}", file=sys.stderr)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
