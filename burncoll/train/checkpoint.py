"""Checkpoints of :func:`burncoll.train.fit.fit`, so that a restarted run resumes where it stopped.

An elastic launcher kills a failed training process and starts it again; with
``checkpoint_dir`` set, ``fit`` picks up from the last checkpoint instead of from step 0, and
ends with the same parameters as a run that was never interrupted (bitwise, since the
batches are a function of the step and the update is deterministic).

Writing. After every ``checkpoint_every``-th step and after the last one, the peer of global
rank 0 writes ``DIR/fit-checkpoint.npz``: a temporary file in ``DIR``, flushed and fsynced,
then renamed over the previous checkpoint (``os.replace``), so the file is always either the
old or the new checkpoint, whole; only the latest is kept.

Format (version 1): one uncompressed ``.npz`` archive, readable with
``numpy.load(path, allow_pickle=False)`` (nothing is pickled):

- ``meta``: a ``uint8`` array holding UTF-8 JSON: ``{"format": "burncoll.train.fit checkpoint",
  "version": 1, "step": <steps done>, "params": [leaf, ...], "state": [leaf, ...] | null}``,
  each leaf ``{"dtype": "float64", "shape": [3, 4], "raw": false}`` in flattening order
  (:func:`~burncoll.buckets.flatten_tree`); ``state`` is ``null`` for a plain update function
  and lists the leaves of the optax optimizer state otherwise.
- ``losses``: ``float64``, one per step done.
- ``params_00000``, ... and ``state_00000``, ...: the leaves, as arrays of their dtype, or for
  dtypes NumPy cannot store by itself (``bfloat16``) their raw bytes as ``uint8`` with
  ``"raw": true``.

The tree *structure* is never read from disk: it comes from the run's own initial params and
``update.init(params)``, and the stored leaves are put into it.

Resuming. The peer of global rank 0 reads the file and checks it against its own tree; every
peer then receives its verdict, the step, the losses and the leaves through collectives, so
only rank 0's filesystem matters on several hosts. A checkpoint that is unreadable or does not
match the model raises the same :class:`~burncoll.UsageError` on every peer.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from burncoll.api import Communicator
from burncoll.backends import get_backend
from burncoll.backends.base import Array, Backend, Device
from burncoll.buckets import broadcast_tree, flatten_tree
from burncoll.dtypes import dtype_from_name, dtype_name
from burncoll.errors import UsageError

__all__ = [
    "CHECKPOINT_FILE",
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "Checkpointer",
    "Restored",
    "Stored",
    "checkpointer",
    "from_numpy",
    "mismatch",
    "read_checkpoint",
    "write_checkpoint",
]

#: The checkpoint's file name inside ``checkpoint_dir``.
CHECKPOINT_FILE = "fit-checkpoint.npz"
#: The ``format`` field of the metadata, and the current ``version``.
FORMAT_NAME = "burncoll.train.fit checkpoint"
FORMAT_VERSION = 1
#: Checkpoints per run when only ``checkpoint_dir`` is given (see :func:`checkpointer`).
DEFAULT_CHECKPOINTS_PER_RUN = 10

_TEMP_PREFIX = ".fit-checkpoint."
_TEMP_SUFFIX = ".tmp"
_NONE, _OK, _FAILED = 0, 1, 2  # rank 0's verdict on the checkpoint in the directory

NDArray = np.ndarray[Any, Any]
#: A leaf's dtype name and shape.
Spec = tuple[str, tuple[int, ...]]


def from_numpy(backend: Backend, host: NDArray, device: Device) -> Array:
    """``host`` as an array of ``backend`` on ``device`` (itself for NumPy)."""
    if backend.is_array(host):
        return host
    shape = tuple(host.shape)  # np.ascontiguousarray makes a 0-d array 1-d
    return backend.from_host(np.ascontiguousarray(host), dtype_name(host.dtype), shape, device)


@dataclass(frozen=True)
class Stored:
    """A checkpoint as read from disk: host arrays in flattening order."""

    #: Steps done when it was written.
    step: int
    #: The loss of each of those steps.
    losses: list[float]
    params: list[NDArray]
    #: The optimizer state's leaves; ``None`` when the run used a plain update function.
    state: list[NDArray] | None


class Restored(NamedTuple):
    """What a peer resumes from: steps done, its params, optimizer state and losses."""

    step: int
    params: Any
    state: Any
    losses: list[float]


# -- the file -----------------------------------------------------------------------------------


def write_checkpoint(
    directory: Path,
    step: int,
    params: Sequence[NDArray],
    state: Sequence[NDArray] | None,
    losses: Sequence[float],
) -> Path:
    """Atomically replace ``directory/CHECKPOINT_FILE`` by this checkpoint; its path.

    Creates ``directory`` when missing, and removes temporary files left by a writer that
    was killed.
    """
    directory.mkdir(parents=True, exist_ok=True)
    entries: dict[str, NDArray] = {"losses": np.asarray(losses, dtype=np.float64)}
    meta: dict[str, Any] = {"format": FORMAT_NAME, "version": FORMAT_VERSION, "step": step}
    for kind, leaves in (("params", params), ("state", state)):
        if leaves is None:
            meta[kind] = None
            continue
        meta[kind] = []
        for i, leaf in enumerate(leaves):
            host = np.asarray(leaf)
            raw = host.dtype.kind not in "biufc"  # bfloat16 & co: np.save would lose the dtype
            meta[kind].append({"dtype": dtype_name(host.dtype), "shape": list(host.shape),
                               "raw": raw})
            entries[f"{kind}_{i:05d}"] = np.ascontiguousarray(host.reshape(-1)).view(
                np.uint8) if raw else host
    entries["meta"] = np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8)
    path = directory / CHECKPOINT_FILE
    fd, temp = tempfile.mkstemp(dir=directory, prefix=_TEMP_PREFIX, suffix=_TEMP_SUFFIX)
    try:
        with os.fdopen(fd, "wb") as f:
            np.savez(f, allow_pickle=False, **entries)
            f.flush()
            os.fsync(f.fileno())
        os.replace(temp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temp)
        raise
    _fsync_directory(directory)
    for stale in directory.glob(f"{_TEMP_PREFIX}*{_TEMP_SUFFIX}"):
        with contextlib.suppress(OSError):
            stale.unlink()
    return path


def _fsync_directory(directory: Path) -> None:
    """Make the rename durable (POSIX; a no-op where directories cannot be opened)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        with contextlib.suppress(OSError):
            os.fsync(fd)
    finally:
        os.close(fd)


def read_checkpoint(directory: Path) -> Stored | None:
    """The checkpoint in ``directory``; ``None`` when there is none.

    Raises :class:`~burncoll.UsageError` when ``directory`` is not a directory, or when the
    file cannot be read or is not a checkpoint of this format (truncated, corrupt, foreign).
    """
    if directory.exists() and not directory.is_dir():
        raise UsageError(f"checkpoint_dir {str(directory)!r} exists and is not a directory")
    path = directory / CHECKPOINT_FILE
    if not path.exists():
        return None
    try:
        archive = np.load(path, allow_pickle=False)
        if not isinstance(archive, np.lib.npyio.NpzFile):
            raise ValueError("not an .npz archive")
        with archive:
            return _parse(archive)
    except Exception as exc:  # whatever the damage, one clear message
        raise UsageError(
            f"the checkpoint {str(path)!r} cannot be read ({type(exc).__name__}: {exc}); it is "
            "truncated, corrupt or not a burncoll fit checkpoint: delete it (training then "
            "starts from step 0) or pass another checkpoint_dir"
        ) from exc


def _parse(archive: Any) -> Stored:
    meta = json.loads(bytes(np.asarray(archive["meta"], dtype=np.uint8)).decode())
    if not isinstance(meta, dict) or meta.get("format") != FORMAT_NAME:
        raise ValueError(f"the metadata does not say format {FORMAT_NAME!r}")
    if meta.get("version") != FORMAT_VERSION:
        raise ValueError(f"format version {meta.get('version')!r}, this burncoll reads "
                         f"version {FORMAT_VERSION}")
    step = meta.get("step")
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise ValueError(f"bad step {step!r} in the metadata")
    losses = archive["losses"]
    if losses.dtype != np.float64 or losses.shape != (step,):
        raise ValueError(f"losses are {losses.dtype} {losses.shape}, expected {step} float64")
    leaves: dict[str, list[NDArray] | None] = {}
    for kind in ("params", "state"):
        specs = meta.get(kind)
        if specs is None and kind == "state":
            leaves[kind] = None
            continue
        if not isinstance(specs, list):
            raise ValueError(f"{kind!r} in the metadata is not a list")
        leaves[kind] = [_leaf(archive, f"{kind}_{i:05d}", s) for i, s in enumerate(specs)]
    params = leaves["params"]
    assert params is not None
    return Stored(step, [float(x) for x in losses], params, leaves["state"])


def _leaf(archive: Any, key: str, spec: Any) -> NDArray:
    """Entry ``key``, checked against (and for raw bytes, viewed as) its metadata ``spec``."""
    if not isinstance(spec, dict) or not isinstance(spec.get("shape"), list):
        raise ValueError(f"bad metadata for {key}: {spec!r}")
    dtype = dtype_from_name(str(spec.get("dtype")))
    shape = tuple(int(n) for n in spec["shape"])
    array: NDArray = archive[key]
    if spec.get("raw"):
        if array.dtype != np.uint8 or array.size != math.prod(shape) * dtype.itemsize:
            raise ValueError(f"{key} holds {array.size} {array.dtype}, not the raw bytes of "
                             f"{dtype_name(dtype)} {shape}")
        return array.view(dtype).reshape(shape)
    if array.dtype != dtype or array.shape != shape:
        raise ValueError(f"{key} is {dtype_name(array.dtype)} {array.shape}, the metadata says "
                         f"{dtype_name(dtype)} {shape}")
    return array


def mismatch(stored: Stored, params: list[Spec], state: list[Spec] | None) -> str | None:
    """What differs between ``stored`` and this run's leaves (``None``: they match)."""
    if (stored.state is None) != (state is None):
        has = "has no" if stored.state is None else "has an"
        here = "a GradientTransformation" if state is not None else "a plain update function"
        return f"it {has} optimizer state, but this run's update is {here}"
    problems: list[str] = []
    for kind, theirs, ours in (("params", stored.params, params),
                               ("optimizer state", stored.state or [], state or [])):
        if len(theirs) != len(ours):
            problems.append(f"{kind}: {len(theirs)} leaves in the checkpoint, {len(ours)} here")
            continue
        for i, (array, (dtype, shape)) in enumerate(zip(theirs, ours, strict=True)):
            if dtype_name(array.dtype) != dtype or array.shape != shape:
                problems.append(f"{kind} leaf {i}: {dtype_name(array.dtype)} {array.shape} in "
                                f"the checkpoint, {dtype} {shape} here")
    return "; ".join(problems[:4]) or None


# -- the collective part ------------------------------------------------------------------------


def checkpointer(
    checkpoint_dir: str | os.PathLike[str] | None, checkpoint_every: int | None, steps: int
) -> Checkpointer | None:
    """The checkpoint policy of one :func:`~burncoll.train.fit.fit` call, checked.

    ``checkpoint_every`` defaults to ``max(1, steps // 10)``: about ten checkpoints per run,
    so a restart repeats at most a tenth of the steps. Without a directory there is no policy
    (``None``), but ``checkpoint_every`` is still checked, so that
    ``checkpoint_dir=os.environ.get(...)`` may switch checkpointing off. Raises
    :class:`~burncoll.UsageError` for a directory that is not a path, or ``checkpoint_every``
    not a positive int.
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
    return Checkpointer(Path(path), every)


@dataclass(frozen=True)
class Checkpointer:
    """Where and how often one ``fit`` call checkpoints; its methods are run by every peer."""

    directory: Path
    every: int

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
                         state_leaves, losses)

    def restore(self, comm: Communicator, params: Any, state: Any, stateful: bool,
                bucket_bytes: int) -> Restored | None:
        """The checkpoint on every peer, put into this run's ``params`` and ``state`` trees;
        ``None`` when there is none. A collective: every peer must call it.

        Raises :class:`~burncoll.UsageError` on every peer when rank 0 finds the checkpoint
        unreadable or not matching the trees.
        """
        backend = get_backend(comm.config.backend)
        p_leaves, p_unflatten = flatten_tree(params)
        s_leaves, s_unflatten = flatten_tree(state)
        stored, message = None, ""
        if comm.rank == 0:
            stored, message = self._judge(backend, p_leaves, s_leaves if stateful else None)
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

    def _judge(self, backend: Backend, params: list[Any], state: list[Any] | None
               ) -> tuple[Stored | None, str]:
        """Rank 0's reading of the directory: the checkpoint, or why it cannot be used."""
        try:
            stored = read_checkpoint(self.directory)
        except UsageError as exc:
            return None, str(exc)
        if stored is None:
            return None, ""
        specs = [_spec(backend, x) for x in params]
        differs = mismatch(stored, specs, None if state is None else [
            _spec(backend, x) for x in state])
        if differs is None:
            return stored, ""
        return None, (f"the checkpoint in {str(self.directory)!r} does not match this model "
                      f"({differs}); delete {str(self.directory / CHECKPOINT_FILE)!r} (training "
                      "then starts from step 0) or pass another checkpoint_dir")


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
