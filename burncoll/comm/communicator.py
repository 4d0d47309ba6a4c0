"""The public entry points: :func:`register` and the per-peer :class:`Communicator`; and which
node this process is and which peer ids its devices take, under every launcher
(:func:`node_rank`, :func:`peer_ids`: a script computes its peer ids the same way whether
``burncoll launch``, torchrun, SLURM, mpirun or Ray started it, from the config, which reads
the launcher's variables, see :mod:`burncoll.config`)."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any, TypeVar

import numpy as np

from burncoll.backends import get_backend
from burncoll.backends.base import Array, Device
from burncoll.backends.checks import check_out
from burncoll.comm import objects
from burncoll.comm.buckets import all_reduce_tree
from burncoll.comm.groups import Groups
from burncoll.comm.p2p import PointToPoint
from burncoll.comm.registry import REGISTRY, close_node
from burncoll.comm.rooted import RootedOps, parse_counts, write_out
from burncoll.compression import COMPRESSIONS
from burncoll.config import CollectiveConfig
from burncoll.dtypes import dtype_from_name, is_inexact
from burncoll.errors import UsageError
from burncoll.ops import OpKind, ReduceOp, parse_reduce_op

__all__ = ["Communicator", "node_rank", "peer_ids", "register"]

T = TypeVar("T")


class Communicator(RootedOps, Groups, PointToPoint):
    """One peer's handle on the collective; use it from the thread that registered it.

    Every method blocks until the operation is done for this peer, or raises a
    :class:`~burncoll.CollectiveError` within ``config.timeout`` seconds. Inputs are never
    modified; results are new arrays of the same backend on this peer's device. With
    ``async_op=True`` a method returns a :class:`~burncoll.Work` at once and the operation
    reads its input (and writes its ``out=``) on this peer's worker thread: leave them
    unchanged until the Work completes.
    """

    # -- operations -------------------------------------------------------------------------
    def all_reduce(self, x: Array, op: ReduceOp | str = "sum", *, out: Array | None = None,
                   compression: str | None = None, async_op: bool = False) -> Any:
        """``x`` reduced element-wise over every peer; bitwise identical on every peer.

        ``out``: an array like ``x`` (same shape, dtype and device, writable, contiguous) to
        write the result into, and which is returned, as NumPy's ``out=``; ``out=x`` (or
        another view of exactly ``x``'s elements) reduces in place, like
        ``torch.distributed.all_reduce``. Reusing ``out`` across calls saves
        allocating (and the kernel zeroing) a new result every time. Mutable backends only
        (NumPy, CuPy); JAX arrays are immutable.

        ``async_op=True``: return a :class:`~burncoll.Work` at once (every collective takes
        it, as in torch.distributed); its ``wait()`` returns the result.

        ``compression``: ``"bf16"`` or ``"fp16"`` sends float32/float64 values between nodes
        as 16 bits (:mod:`burncoll.compression`: the error bound); ``"none"`` sends them whole;
        ``None`` takes ``config.compression``.
        """
        reduce_op = parse_reduce_op(op)
        wire = self._compression(x, compression)
        if out is None:  # (the operation's result is the array returned)
            return self._issue("all_reduce", functools.partial(
                self._run, OpKind.ALL_REDUCE, x, reduce_op, None, compression=wire), async_op)
        x, dtype = self._accept(OpKind.ALL_REDUCE, x)
        target = self._check_out(x, out, reduce_op, dtype)  # x itself when out is x's memory

        def run() -> Array:
            result = _not_none(self._run(OpKind.ALL_REDUCE, x, reduce_op, None, out=target,
                                         compression=wire, dtype=dtype))
            if result is not target:
                self._backend.copy(result, out=target)
            return out
        return self._issue("all_reduce", run, async_op)

    def reduce(self, x: Array, root: int, op: ReduceOp | str = "sum", *,
               out: Array | None = None, async_op: bool = False) -> Any:
        """``x`` reduced over every peer, returned on peer ``root``; ``None`` elsewhere.
        ``out=`` (read on the root only; ``out=x`` reduces in place there): where the result
        is written (see :mod:`burncoll.comm.rooted`)."""
        reduce_op, root = parse_reduce_op(op), self._check_root(root)
        mine = out if root == self.peer_id else None
        if mine is not None:
            check_out(self._backend, self.device, mine, "reduce")
        return self._issue("reduce", lambda: write_out(
            self._backend, mine, self._run(OpKind.REDUCE, x, reduce_op, root), "reduce"),
            async_op)

    def broadcast(self, x: Array | None, root: int, *, out: Array | None = None,
                  async_op: bool = False) -> Any:
        """Peer ``root``'s ``x`` on every peer (others may pass ``None``). ``out=``: each peer
        receives into its own array (the root's gets a copy of ``x``)."""
        root = self._check_root(root)
        if root == self.peer_id and x is None:
            raise UsageError(f"broadcast: the root (peer {root}) must pass an array, not None")
        if out is not None:
            check_out(self._backend, self.device, out, "broadcast")
        return self._issue("broadcast", lambda: write_out(self._backend, out, _not_none(
            self._run(OpKind.BROADCAST, x, None, root, allow_none=True)), "broadcast"),
            async_op)

    def reduce_scatter(self, x: Array, op: ReduceOp | str = "sum",
                       counts: Sequence[int] | None = None, *, out: Array | None = None,
                       async_op: bool = False) -> Any:
        """This rank's block of ``x`` reduced over every peer.

        The reduced array is split along axis 0 as ``numpy.array_split(x, world_size)`` splits
        it, or into ``counts[r]`` rows for rank ``r`` (every peer passes the same counts,
        one per rank, summing to the rows); rank ``r`` gets block ``r``.
        """
        if self._is_array(x) and len(self._backend.shape(x)) == 0:
            raise UsageError("reduce_scatter needs an array with at least one dimension")
        reduce_op, parsed = parse_reduce_op(op), parse_counts(counts, "reduce_scatter")
        if out is not None:
            check_out(self._backend, self.device, out, "reduce_scatter")
        return self._issue("reduce_scatter", lambda: write_out(self._backend, out, _not_none(
            self._run(OpKind.REDUCE_SCATTER, x, reduce_op, None, counts=parsed)),
            "reduce_scatter"), async_op)

    def all_gather(self, x: Array, *, out: Array | None = None, async_op: bool = False
                   ) -> Any:
        """Every peer's ``x`` concatenated along axis 0 in rank order.

        Peers may pass different lengths along axis 0; dtype and trailing shape must agree.
        """
        if self._is_array(x) and len(self._backend.shape(x)) == 0:
            raise UsageError("all_gather needs an array with at least one dimension")
        if out is not None:
            check_out(self._backend, self.device, out, "all_gather")
        return self._issue("all_gather", lambda: write_out(self._backend, out, _not_none(
            self._run(OpKind.ALL_GATHER, x, None, None)), "all_gather"), async_op)

    def broadcast_object(self, obj: object, root: int) -> object:
        """Peer ``root``'s ``obj`` on every peer (others pass anything, e.g. ``None``): one
        broadcast of msgpack bytes, never pickle; :mod:`burncoll.comm.objects` says what may go."""
        cap = self.config.max_object_containers
        mine = objects.payload(obj, self._backend, self.device, cap) if (
            root == self.peer_id) else None
        got = self._backend.to_host(self.broadcast(mine, root))
        return objects.unpack(got, [root], "broadcast_object", cap)[0]

    def all_gather_object(self, obj: object) -> list[object]:
        """Every peer's ``obj`` in rank order: one all_gather of msgpack bytes, never pickle;
        :mod:`burncoll.comm.objects` says what may be sent."""
        return self._all_gather_record(
            objects.payload(obj, cap=self.config.max_object_containers), "all_gather_object")

    def all_reduce_tree(
        self, tree: T, op: ReduceOp | str = "mean", bucket_bytes: int = 25 * 2**20, *,
        async_op: bool = False, compression: str | None = None,
    ) -> Any:
        """All-reduce every array leaf of a nested structure (dicts, lists, tuples, JAX
        pytrees) in a few bucketed collectives, one per ``bucket_bytes`` of each dtype.

        Returns the same structure; bitwise identical on every peer. ``op`` defaults to the
        mean, for gradients. ``async_op=True`` returns a :class:`~burncoll.Work` of the tree;
        ``compression`` goes to every bucket's all-reduce (see :meth:`all_reduce`).
        """
        if async_op:
            return all_reduce_tree(self, tree, op, bucket_bytes, async_op=True,
                                   compression=compression)
        return all_reduce_tree(self, tree, op, bucket_bytes, compression=compression)

    def barrier(self, *, async_op: bool = False) -> Any:
        """Return once every peer of the collective has called ``barrier``."""
        return self._issue("barrier", lambda: self._run(OpKind.BARRIER, None, None, None,
                                                        allow_none=True), async_op)

    def finish(self) -> None:
        """Leave the collective. The node closes its connections once every local peer has
        called it; later calls on this communicator raise :class:`~burncoll.UsageError`.
        Operations still in flight (``async_op=True``, ``isend``, ``irecv``) are waited for
        first (each ends by its own deadline at the latest)."""
        self._ops.run(lambda: None, "finish")
        self._finish_in_flight()
        if self._server.finish(self._index):
            close_node(self._server)

    def _compression(self, x: Array, given: str | None) -> str | None:
        """The wire format of an all-reduce of ``x``: ``given`` (checked), else the config's
        for float32/float64 arrays; ``None`` on a single node (nothing goes on a wire)."""
        server = self._server
        if given is None and (server.config.compression is None or not server.world.multi_node):
            return None  # (the common case, without looking at x)
        floats = self._is_array(x) and self._backend.dtype_name(x) in ("float32", "float64")
        if given is not None and given != "none":
            if given not in COMPRESSIONS:
                raise UsageError(f"all_reduce: compression={given!r}: expected one of "
                                 f"{', '.join(COMPRESSIONS)}, 'none' or None (the config's)")
            if not floats:
                raise UsageError(f"all_reduce: compression={given!r} applies to float32 and "
                                 f"float64 arrays; this one is not (pass compression='none')")
        elif given is None:
            given = self.config.compression if floats else None
        if given is None or given == "none" or not self._server.world.multi_node:
            return None
        return given

    def _check_out(self, x: Array, out: Array, op: ReduceOp, dtype: str) -> Array:
        """``out`` checked against ``x`` (of ``dtype``); the array to reduce into: ``x``
        itself when ``out`` is ``x``'s memory (``x``, or another view of its elements: in
        place), else ``out``."""
        backend = self._backend
        check_out(backend, self.device, out, "all_reduce")
        shape = tuple(backend.shape(x))
        if backend.dtype_name(out) != dtype or tuple(backend.shape(out)) != shape:
            raise UsageError(
                f"all_reduce: out is {backend.dtype_name(out)}{list(backend.shape(out))} but x "
                f"is {dtype}{list(shape)}; they must match")
        if op is ReduceOp.MEAN and not is_inexact(dtype_from_name(dtype)):
            raise UsageError(f"all_reduce: the mean of {dtype} is float64, "
                             "which out cannot hold; pass float arrays or omit out")
        if out is x:
            return x
        if type(x) is type(out) is np.ndarray and x.flags.owndata and out.flags.owndata:
            return out  # (two allocations never meet; np.may_share_memory would let go of
            # the GIL, a hand-off to another local peer's thread in every call)
        if _same_memory(x, out):
            return x
        if _overlap(x, out):
            raise UsageError("all_reduce: out overlaps x without being x's elements (another "
                             "start, dtype or strides); pass out=x to reduce in place, or a "
                             "separate array")
        return out


def _overlap(a: Array, b: Array) -> bool:
    """Whether two arrays may share memory (NumPy, CuPy and torch answer it)."""
    module = type(a).__module__.split(".")[0]
    if module == "numpy":
        return bool(np.may_share_memory(a, b))
    if module == "cupy":  # pragma: no cover - no GPU here
        import cupy

        return bool(cupy.may_share_memory(a, b))
    if module == "torch":
        from burncoll.backends.torch import shares_memory

        return shares_memory(a, b)
    return False


def _same_memory(a: Array, b: Array) -> bool:
    """Whether two arrays of one dtype and shape are views of the same elements: the same
    first byte and strides (``t.numpy()`` twice, ``x.view()``, ``x[:]``)."""
    interface = "__cuda_array_interface__" if type(a).__module__.startswith("cupy") else \
        "__array_interface__"
    first, second = getattr(a, interface, None), getattr(b, interface, None)
    if not isinstance(first, dict) or not isinstance(second, dict):
        return False
    return bool(first["data"][0] == second["data"][0] and a.strides == b.strides)


def _not_none(x: Array | None) -> Array:
    if x is None:  # pragma: no cover - the schedules guarantee a result
        raise RuntimeError("operation produced no result")
    return x


def register(peer_id: int, device: Device | int, config: CollectiveConfig) -> Communicator:
    """Join the collective as peer ``peer_id`` on ``device``; returns this peer's handle.

    Blocks until all ``config.num_devices`` local peers have registered (and, with several
    nodes, until every node has joined through the orchestrator), or raises
    :class:`~burncoll.CollectiveTimeout` after ``config.timeout`` seconds. ``peer_id`` is an
    int unique across the whole collective. ``device`` is one of the backend's devices
    (``burncoll.get_backend(name).devices(n)[i]``) or its index. Call it from the thread that
    will use the communicator; after a failure, call it again on every peer to start over.
    """
    if isinstance(peer_id, bool) or not isinstance(peer_id, int) or peer_id < 0:
        raise UsageError(f"peer_id must be a non-negative int, got {peer_id!r}")
    if not isinstance(config, CollectiveConfig):
        raise UsageError(f"config must be a burncoll.CollectiveConfig, got {type(config).__name__}")
    if isinstance(device, int) and not isinstance(device, bool):
        backend = get_backend(config.backend)
        devices = backend.devices(max(device + 1, config.num_devices))
        device = devices[device]
    server, index = REGISTRY.join(peer_id, device, config)
    return Communicator(server, index, device)


def node_rank(config: CollectiveConfig | None = None) -> int:
    """This process's node rank: ``config.node_rank``, which ``BURNCOLL_NODE_RANK`` or the
    launcher's variables (torchrun's ``RANK``, SLURM's ``SLURM_PROCID``, ...) set when the code
    does not; 0 on a single node. ``config`` defaults to ``CollectiveConfig()``, i.e. the
    environment's settings.

    Raises :class:`~burncoll.ConfigError` when those variables are not a valid rank.
    """
    cfg = CollectiveConfig() if config is None else config
    return cfg.node_rank or 0


def peer_ids(config: CollectiveConfig | None = None,
             num_devices: int | None = None) -> tuple[int, ...]:
    """The peer ids of this node's devices: ``node_rank * num_devices + i`` for device ``i``.

    ``num_devices`` defaults to ``config.num_devices``; every node must use as many devices.
    Peer ids numbered this way order the nodes by rank, so node ``r`` of the launcher is node
    ``r`` of the collective.
    """
    cfg = CollectiveConfig() if config is None else config
    count = cfg.num_devices if num_devices is None else num_devices
    if isinstance(count, bool) or not isinstance(count, int) or count < 1:
        raise UsageError(f"num_devices must be an int >= 1, got {count!r}")
    first = node_rank(cfg) * count
    return tuple(range(first, first + count))
