"""Checkpoints of :func:`burncoll.train.fit.fit`, so that a restarted run resumes where it stopped.

With ``checkpoint_dir`` set, the peer of global rank 0 writes ``DIR/fit-checkpoint.npz`` (with
the run's :class:`RunInfo`; the file is :mod:`burncoll.train.checkpoint_file`'s, its names
re-exported here) after every ``checkpoint_every``-th and the last step. A restarted ``fit``
resumes from it and ends bitwise like an uninterrupted run. Rank 0 reads and checks the file
and every peer gets its verdict, step, losses and leaves through collectives, so only rank 0's
filesystem matters. Every peer raises the same :class:`~burncoll.UsageError` for a checkpoint
that is unreadable, in a place another user can change (:mod:`burncoll.train.trusted_files`),
of another version, of another run (seed, global batch, data) or model, or beyond ``steps``.
The world size is not compared (an elastic restart may have fewer nodes).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from burncoll.backends import get_backend
from burncoll.backends.base import Array, Backend, Device
from burncoll.comm.buckets import broadcast_tree, flatten_tree
from burncoll.comm.communicator import Communicator
from burncoll.dtypes import dtype_name
from burncoll.errors import UsageError
from burncoll.train.checkpoint_file import (
    CHECKPOINT_FILE,
    FORMAT_NAME,
    FORMAT_VERSION,
    STALE_TEMP_SECONDS,
    RunInfo,
    Spec,
    Stored,
    mismatch,
    read_checkpoint,
    write_checkpoint,
)

__all__ = ["CHECKPOINT_FILE", "FORMAT_NAME", "FORMAT_VERSION", "STALE_TEMP_SECONDS", "Checkpointer",
           "Restored", "RunInfo", "Spec", "Stored", "checkpointer", "from_numpy", "mismatch",
           "read_checkpoint", "write_checkpoint"]

#: Checkpoints per run when only ``checkpoint_dir`` is given (see :func:`checkpointer`).
DEFAULT_CHECKPOINTS_PER_RUN = 10

_NONE, _OK, _FAILED = 0, 1, 2  # rank 0's verdict on the checkpoint in the directory

NDArray = np.ndarray[Any, Any]


def from_numpy(backend: Backend, host: NDArray, device: Device) -> Array:
    """``host`` as an array of ``backend`` on ``device`` (itself for NumPy)."""
    if backend.is_array(host):
        return host
    shape = tuple(host.shape)  # np.ascontiguousarray makes a 0-d array 1-d
    return backend.from_host(np.ascontiguousarray(host), dtype_name(host.dtype), shape, device)


class Restored(NamedTuple):
    """What a peer resumes from: steps done, its params, optimizer state and losses."""

    step: int
    params: Any
    state: Any
    losses: list[float]


def checkpointer(checkpoint_dir: str | os.PathLike[str] | None, checkpoint_every: int | None,
                 steps: int, run: RunInfo | None = None) -> Checkpointer | None:
    """The checkpoint policy of one :func:`~burncoll.train.fit.fit` call, checked.

    ``checkpoint_every`` defaults to ``max(1, steps // 10)``: about ten checkpoints per run,
    so a restart repeats at most a tenth of the steps. Without a directory there is no policy
    (``None``), but ``checkpoint_every`` is still checked, so that
    ``checkpoint_dir=os.environ.get(...)`` may switch checkpointing off. Raises
    :class:`~burncoll.UsageError` for a directory that is not a path, or ``checkpoint_every``
    not a positive int. ``run`` identifies the run (see :class:`Checkpointer`).
    """
    every = max(1, steps // DEFAULT_CHECKPOINTS_PER_RUN) if checkpoint_every is None else (
        checkpoint_every)
    if isinstance(every, bool) or not isinstance(every, int) or every < 1:
        raise UsageError(f"checkpoint_every must be an int >= 1 (steps between checkpoints), "
                         f"got {checkpoint_every!r}")
    if checkpoint_dir is None:
        return None
    path = os.fspath(checkpoint_dir) if isinstance(checkpoint_dir, str | os.PathLike) else None
    if not isinstance(path, str) or not path:
        raise UsageError(f"checkpoint_dir must be a directory path (str or os.PathLike), got "
                         f"{checkpoint_dir!r}")
    return Checkpointer(Path(path), every, run)


@dataclass(frozen=True)
class Checkpointer:
    """Where and how often one ``fit`` call checkpoints; its methods are run by every peer."""

    directory: Path
    every: int
    #: The run: written into every checkpoint, and a checkpoint of another run is refused.
    #: ``None`` writes none and checks none (the model and ``steps`` are checked still).
    run: RunInfo | None = None

    def due(self, done: int, steps: int) -> bool:
        """Whether to checkpoint after ``done`` of ``steps`` steps."""
        return done % self.every == 0 or done == steps

    def save(self, comm: Communicator, done: int, params: Any, state: Any, stateful: bool,
             losses: Sequence[float]) -> None:
        """Write a checkpoint on the peer of global rank 0 (the others return at once)."""
        if comm.rank != 0:
            return
        backend = get_backend(comm.config.backend)
        state_leaves = [_host(backend, x) for x in flatten_tree(state)[0]] if stateful else None
        write_checkpoint(self.directory, done, [_host(backend, x) for x in flatten_tree(params)[0]],
                         state_leaves, losses, self.run)

    def restore(self, comm: Communicator, params: Any, state: Any, stateful: bool,
                bucket_bytes: int, *, steps: int | None = None) -> Restored | None:
        """The checkpoint on every peer, put into this run's ``params`` and ``state`` trees;
        ``None`` when there is none. A collective: every peer must call it. Raises
        :class:`~burncoll.UsageError` on every peer when rank 0 finds the checkpoint unreadable,
        written by another run (:attr:`run`), not matching the trees, or at a step beyond ``steps``
        (this run's total; ``None``: any step)."""
        backend = get_backend(comm.config.backend)
        p_leaves, p_unflatten = flatten_tree(params)
        s_leaves, s_unflatten = flatten_tree(state)
        stored, message = None, ""
        if comm.rank == 0:
            stored, message = self._judge(backend, p_leaves, s_leaves if stateful else None,
                                          steps)
        code = _NONE if stored is None and not message else _OK if stored is not None else _FAILED
        header = np.array([code, stored.step if stored else 0, len(message.encode())], "<i8")
        code, step, size = (int(x) for x in _broadcast_bytes(comm, backend, header, 24).view(
            "<i8"))
        if code == _FAILED:
            text = _broadcast_bytes(comm, backend, np.frombuffer(message.encode(), np.uint8), size)
            comm.barrier()  # every peer has the verdict before any raises (and aborts the rest)
            raise UsageError(text.tobytes().decode())
        if code == _NONE:
            return None
        losses_host = np.asarray(stored.losses if stored else [], "<f8")
        losses = _broadcast_bytes(comm, backend, losses_host.view(np.uint8), 8 * step)
        if stored is not None:  # rank 0 sends the stored leaves; the others' give the layout
            sent = stored.params + (stored.state or [])
            mine = [from_numpy(backend, x, comm.device) for x in sent]
        else:
            mine = [_peer(backend, x, comm.device) for x in p_leaves + s_leaves]
        got = broadcast_tree(comm, mine, comm.peer_ids[0], bucket_bytes)
        new_state = [_like(backend, t, x) for t, x in zip(s_leaves, got[len(p_leaves):],
                                                             strict=True)]
        return Restored(step, p_unflatten(got[: len(p_leaves)]), s_unflatten(new_state),
                        [float(x) for x in losses.view("<f8")])

    def _judge(self, backend: Backend, params: list[Any], state: list[Any] | None,
               steps: int | None) -> tuple[Stored | None, str]:
        """Rank 0's reading of the directory: the checkpoint, or why it cannot be used."""
        try:
            stored = read_checkpoint(self.directory)
        except UsageError as exc:
            return None, str(exc)
        if stored is None:
            return None, ""
        where = f"the checkpoint in {str(self.directory)!r}"
        fix = (f"delete {str(self.directory / CHECKPOINT_FILE)!r} (training then starts from "
               "step 0) or pass another checkpoint_dir")
        if self.run is not None:
            other = ["it records no run"] if stored.run is None else self.run.differences(
                stored.run)
            if other:
                return None, (f"{where} was written by another run ({'; '.join(other)}), and "
                              f"resuming it would continue a different experiment; {fix}, or "
                              "run with the checkpoint's settings")
        specs = [_spec(backend, x) for x in params]
        differs = mismatch(stored, specs, None if state is None else [
            _spec(backend, x) for x in state])
        if differs is not None:
            return None, f"{where} does not match this model ({differs}); {fix}"
        if steps is not None and stored.step > steps:
            return None, (f"{where} is at step {stored.step}, beyond steps={steps}; pass "
                          f"steps={stored.step} or more to use it, or {fix}")
        return stored, ""


def _broadcast_bytes(comm: Communicator, backend: Backend, data: NDArray, size: int) -> NDArray:
    """Rank 0's ``size`` bytes ``data`` on every peer, as host ``uint8`` (a copy)."""
    if size == 0:
        return np.zeros(0, np.uint8)
    x = from_numpy(backend, np.ascontiguousarray(data.view(np.uint8)), comm.device) if (
        comm.rank == 0) else None
    return np.array(backend.to_host(comm.broadcast(x, comm.peer_ids[0])), dtype=np.uint8)


def _host(backend: Backend, leaf: Any) -> NDArray:
    return np.asarray(backend.to_host(leaf) if backend.is_array(leaf) else leaf)


def _spec(backend: Backend, leaf: Any) -> Spec:
    if backend.is_array(leaf):
        return backend.dtype_name(leaf), tuple(backend.shape(leaf))
    host = np.asarray(leaf)
    return dtype_name(host.dtype), tuple(host.shape)


def _peer(backend: Backend, leaf: Any, device: Device) -> Array:
    """A leaf of this run's tree as an array of ``backend`` (a scalar or host array is not)."""
    return leaf if backend.is_array(leaf) else from_numpy(backend, np.asarray(leaf), device)


def _like(backend: Backend, template: Any, leaf: Array) -> Any:
    """``leaf`` in the kind of ``template``: a backend array, NumPy array, or Python scalar."""
    if backend.is_array(template):
        return leaf
    host = np.array(backend.to_host(leaf))
    if isinstance(template, np.generic):
        return host[()]
    if isinstance(template, bool | int | float | complex):
        return type(template)(host.item())
    return host
