"""The file of a :func:`burncoll.train.fit.fit` checkpoint: its format, writing and reading.

:mod:`burncoll.train.checkpoint` decides when to write and how every peer resumes; this module
is the file alone (``numpy`` and JSON, nothing pickled). :func:`write_checkpoint` writes
``DIR/.fit-checkpoint.<pid>.<random>.tmp``, fsyncs it and renames it over
``DIR/fit-checkpoint.npz``, so the file is always one whole checkpoint. Temporary files of
exactly that pattern left by a killed writer are removed once :data:`STALE_TEMP_SECONDS` old;
nothing else in ``DIR`` is touched. A checkpoint is read only from a place no other user can
change (:mod:`burncoll.train.trusted_files`), each entry checked from its header before it is
read.

Format (version 2): an uncompressed ``.npz`` (``numpy.load(path, allow_pickle=False)``):
``meta``, UTF-8 JSON as ``uint8``: ``{"format": "burncoll.train.fit checkpoint", "version": 2,
"step", "run": RunInfo | null, "params": [leaf...], "state": [leaf...] | null}``, a leaf being
``{"dtype", "shape", "raw"}`` in :func:`~burncoll.comm.buckets.flatten_tree` order;
``losses`` (``float64``, one per step); ``params_00000``, ... and ``state_00000``, ...: the
leaves (``"raw": true``: the bytes as ``uint8``, for dtypes NumPy cannot store such as
``bfloat16``). Version 1 had no ``run`` and is refused with a message of its own. The tree
*structure* is never read from disk: it comes from the run's own params and ``update.init``.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import tempfile
import time
import zipfile
from collections.abc import Sequence
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

import numpy as np

from burncoll.dtypes import dtype_from_name, dtype_name
from burncoll.errors import UsageError
from burncoll.train.trusted_files import open_trusted

__all__ = ["CHECKPOINT_FILE", "FORMAT_NAME", "FORMAT_VERSION", "STALE_TEMP_SECONDS", "RunInfo",
           "Spec", "Stored", "mismatch", "read_checkpoint", "write_checkpoint"]

#: The checkpoint's file name inside ``checkpoint_dir``.
CHECKPOINT_FILE = "fit-checkpoint.npz"
#: The ``format`` field of the metadata, and the current ``version``.
FORMAT_NAME = "burncoll.train.fit checkpoint"
FORMAT_VERSION = 2
#: Age (seconds, by mtime) after which a writer's temporary file counts as left by a killed one.
STALE_TEMP_SECONDS = 3600.0

_TEMP_PREFIX = ".fit-checkpoint."
_TEMP_SUFFIX = ".tmp"
_TEMP_NAME = re.compile(r"\.fit-checkpoint\.[0-9]+\.[a-z0-9_]+\.tmp")  # prefix, pid, mkstemp's

NDArray = np.ndarray[Any, Any]
#: A leaf's dtype name and shape.
Spec = tuple[str, tuple[int, ...]]


@dataclass(frozen=True)
class RunInfo:
    """What identifies the run behind a checkpoint (``meta["run"]``), so that a reused
    ``checkpoint_dir`` never silently resumes another experiment with the same shapes. Neither the
    world size (an elastic restart may resume on fewer nodes, with the same global batch) nor
    ``steps`` (a resumed run may train longer) belong to it."""

    seed: int
    #: The global batch (all replicas together), and whether it is every example
    #: (``batch_size=None``).
    batch: int
    full_batch: bool
    examples: int
    #: Each data array's dtype name and shape: a fingerprint of the data, not a hash of it.
    data: tuple[Spec, ...]

    def to_json(self) -> dict[str, Any]:
        """The ``run`` entry of the metadata."""
        return {**asdict(self), "data": [{"dtype": d, "shape": s} for d, s in self.data]}

    @staticmethod
    def from_json(run: Any) -> RunInfo:
        """The ``run`` entry read back; raises (``ValueError``, ``KeyError``...) if malformed."""
        data = tuple((str(d["dtype"]), tuple(int(n) for n in d["shape"])) for d in run["data"])
        info = RunInfo(**{**run, "data": data})
        types = {"seed": int, "batch": int, "full_batch": bool, "examples": int}
        if any(type(getattr(info, name)) is not t for name, t in types.items()):
            raise ValueError(f"bad run in the metadata: {run!r}")
        return info

    def differences(self, stored: RunInfo) -> list[str]:
        """What differs between this run (``self``) and the checkpoint's (``stored``), as
        ``"seed 1 here, 0 in the checkpoint"``."""

        def text(value: Any) -> str:
            if isinstance(value, tuple):
                return "[" + ", ".join(f"{d} {s}" for d, s in value) + "]"
            return str(value)

        return [f"{f.name} {text(getattr(self, f.name))} here, {text(getattr(stored, f.name))} "
                "in the checkpoint" for f in fields(self)
                if getattr(self, f.name) != getattr(stored, f.name)]


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
    #: The run that wrote it; ``None`` when the writer recorded none.
    run: RunInfo | None = None


def write_checkpoint(directory: Path, step: int, params: Sequence[NDArray],
                     state: Sequence[NDArray] | None, losses: Sequence[float],
                     run: RunInfo | None = None) -> Path:
    """Atomically replace ``directory/CHECKPOINT_FILE`` by this checkpoint; its path. Creates
    ``directory`` when missing (mode 755 under the umask), and removes temporary files left by
    a writer that was killed (those of the checkpoint's own temporary pattern older than
    :data:`STALE_TEMP_SECONDS`; see the module's docstring)."""
    directory.mkdir(mode=0o755, parents=True, exist_ok=True)  # never writable by others
    entries: dict[str, NDArray] = {"losses": np.asarray(losses, dtype=np.float64)}
    meta: dict[str, Any] = {"format": FORMAT_NAME, "version": FORMAT_VERSION, "step": step,
                            "run": None if run is None else run.to_json()}
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
    fd, temp = tempfile.mkstemp(dir=directory, prefix=f"{_TEMP_PREFIX}{os.getpid()}.",
                                suffix=_TEMP_SUFFIX)
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
        with contextlib.suppress(OSError):  # another writer may remove it first
            if _TEMP_NAME.fullmatch(stale.name) and (
                    time.time() - stale.stat().st_mtime > STALE_TEMP_SECONDS):
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
    """The checkpoint in ``directory``; ``None`` when there is none. Raises
    :class:`~burncoll.UsageError` when ``directory`` is not a directory, when it or the file
    could have been changed by another user (:mod:`burncoll.train.trusted_files`), or when the
    file cannot be read or is not a checkpoint of this format (truncated, corrupt, foreign,
    compressed). Every entry's size and shape are checked from its header before its data is
    read."""
    if directory.exists() and not directory.is_dir():
        raise UsageError(f"checkpoint_dir {str(directory)!r} exists and is not a directory")
    fd = open_trusted(directory, CHECKPOINT_FILE)  # a missing directory: where it would be
    if fd is None:
        return None
    path = directory / CHECKPOINT_FILE
    try:
        with os.fdopen(fd, "rb") as f:
            archive = np.load(f, allow_pickle=False)
            if not isinstance(archive, np.lib.npyio.NpzFile):
                raise ValueError("not an .npz archive")
            with archive:
                _check_members(archive, os.fstat(f.fileno()).st_size)
                return _parse(archive)
    except _VersionError as exc:
        raise UsageError(f"the checkpoint {str(path)!r} {exc}: delete it (training then starts "
                         "from step 0) or pass another checkpoint_dir") from exc
    except Exception as exc:  # whatever the damage, one clear message
        raise UsageError(
            f"the checkpoint {str(path)!r} cannot be read ({type(exc).__name__}: {exc}); it is "
            "truncated, corrupt or not a burncoll fit checkpoint: delete it (training then "
            "starts from step 0) or pass another checkpoint_dir"
        ) from exc


def _check_members(archive: Any, size: int) -> None:
    """Refuse compressed members before anything is inflated (burncoll writes none), and any
    that claims more bytes than the file has."""
    for info in archive.zip.infolist():
        if info.compress_type != zipfile.ZIP_STORED:
            raise ValueError(f"the entry {info.filename!r} is compressed; burncoll writes "
                             "uncompressed entries only, and a compressed one is refused before "
                             "it is inflated")
        if info.file_size > size:
            raise ValueError(f"the entry {info.filename!r} claims {info.file_size} bytes, "
                             f"more than the file's {size}")


def _header(archive: Any, key: str) -> tuple[np.dtype[Any], tuple[int, ...]]:
    """Entry ``key``'s dtype and shape from its ``.npy`` header alone, checked to fit the
    entry's bytes (so that reading it allocates no more than the file holds)."""
    name = f"{key}.npy"
    if name not in archive.zip.namelist():
        raise ValueError(f"the entry {name!r} is missing")
    with archive.zip.open(name) as member:
        version = np.lib.format.read_magic(member)
        if version not in ((1, 0), (2, 0)):
            raise ValueError(f"the entry {name!r} has .npy format version {version}")
        read = (np.lib.format.read_array_header_1_0 if version == (1, 0) else
                np.lib.format.read_array_header_2_0)
        shape, _, dtype = read(member)
    size = archive.zip.getinfo(name).file_size
    if dtype.hasobject or math.prod(shape) * dtype.itemsize > size:
        raise ValueError(f"the entry {name!r} claims {dtype} {shape}, more than its {size} "
                         "bytes")
    return dtype, tuple(shape)


def _expect(archive: Any, key: str, dtype: np.dtype[Any], shape: tuple[int, ...]) -> NDArray:
    """Entry ``key``, read only once its header says ``dtype`` and ``shape``."""
    got = _header(archive, key)
    if got != (dtype, shape):
        raise ValueError(f"{key} is {dtype_name(got[0])} {got[1]}, the metadata says "
                         f"{dtype_name(dtype)} {shape}")
    array: NDArray = archive[key]
    return array


class _VersionError(ValueError):
    """A checkpoint of another format version: not damaged, but not readable here."""


def _parse(archive: Any) -> Stored:
    dtype, shape = _header(archive, "meta")
    if dtype != np.uint8 or len(shape) != 1:
        raise ValueError(f"the metadata is {dtype} {shape}, not UTF-8 JSON as uint8")
    meta = json.loads(bytes(archive["meta"]).decode())
    if not isinstance(meta, dict) or meta.get("format") != FORMAT_NAME:
        raise ValueError(f"the metadata does not say format {FORMAT_NAME!r}")
    if meta.get("version") != FORMAT_VERSION:
        raise _VersionError(
            f"has format version {meta.get('version')!r}, this burncoll reads version "
            f"{FORMAT_VERSION} only (version 1 does not record the seed, batch and data that "
            "show which run wrote it; a later version needs a later burncoll)")
    step = meta.get("step")
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise ValueError(f"bad step {step!r} in the metadata")
    losses = _expect(archive, "losses", np.dtype(np.float64), (step,))
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
    run = None if meta.get("run") is None else RunInfo.from_json(meta["run"])
    return Stored(step, [float(x) for x in losses], params, leaves["state"], run)


def _leaf(archive: Any, key: str, spec: Any) -> NDArray:
    """Entry ``key``, checked against (and for raw bytes, viewed as) its metadata ``spec``."""
    if not isinstance(spec, dict) or not isinstance(spec.get("shape"), list):
        raise ValueError(f"bad metadata for {key}: {spec!r}")
    dtype = dtype_from_name(str(spec.get("dtype")))
    shape = tuple(int(n) for n in spec["shape"])
    if len(shape) > 64 or not all(0 <= n < 2**63 for n in shape):  # as NumPy allows
        raise ValueError(f"bad shape for {key} in the metadata: {spec['shape']!r:.200}")
    if spec.get("raw"):
        raw = _expect(archive, key, np.dtype(np.uint8), (math.prod(shape) * dtype.itemsize,))
        return raw.view(dtype).reshape(shape)
    return _expect(archive, key, dtype, shape)


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
