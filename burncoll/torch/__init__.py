"""burncoll as a ``torch.distributed`` backend: ``import burncoll.torch`` registers
``"burncoll"``, so that ``dist.init_process_group("burncoll")`` (and ``new_group``, DDP, the
``*_object`` helpers) run their collectives on burncoll.

One torch process is one burncoll node with one peer, whose peer id is its rank in the group;
:mod:`burncoll.torch.session` meets the other ranks through torch's store. Each operation
maps to one burncoll collective on views of the tensors without a copy (:func:`as_array`, the
torch backend's: NumPy for CPU, CuPy through DLPack for CUDA), issued with ``async_op=True``
(in the calling thread instead when torch's caller waits at once, ``async_op=False``): the
returned ``Work`` (:class:`TorchWork`) completes its future with the tensors, as Gloo's, which
DDP and its communication hooks chain on. all_reduce reduces the caller's tensor in place; the
other operations write their result into the caller's tensors through burncoll's ``out=``.
burncoll's errors become torch's distributed errors (:func:`torch_error`; the table is in
docs/pytorch.md: the message is kept, the original is the ``__cause__``, and
:class:`~burncoll.UsageError` / :class:`~burncoll.ConfigError` pass unchanged).
docs/pytorch.md is the user's page.

An operation burncoll does not carry raises :class:`~burncoll.UsageError` (a ``ValueError``)
naming it, before anything is sent, so no peer is left waiting for it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from datetime import timedelta
from importlib.util import find_spec
from typing import Any, TypeVar

import numpy as np
import torch
import torch.distributed as dist
from torch._C._distributed_c10d import Store

from burncoll.backends.torch import as_array as tensor_view
from burncoll.comm.communicator import Communicator
from burncoll.errors import CollectiveError, ConfigError, TransportError, UsageError
from burncoll.ops import ReduceOp
from burncoll.torch.session import open_session
from burncoll.work import Work

T = TypeVar("T")

__all__ = ["BACKEND_NAME", "BurncollProcessGroup", "UNSUPPORTED"]


def as_array(tensor: torch.Tensor, label: str) -> Any:
    """``tensor``'s memory as an array of burncoll's backends, no copy: NumPy for a CPU
    tensor, CuPy for a CUDA one (the torch backend's :func:`~burncoll.backends.torch.as_array`).
    Writing into the array writes the tensor."""
    if not isinstance(tensor, torch.Tensor):
        raise UsageError(f"{label}: expected a torch.Tensor, got {type(tensor).__name__}")
    if tensor.layout == torch.strided and not tensor.is_contiguous():  # (sparse: see below)
        raise UsageError(f"{label}: the tensor is not contiguous; pass tensor.contiguous() "
                         "(and copy the result back), as torch's Gloo backend requires too")
    try:
        return tensor_view(tensor)
    except UsageError as exc:
        raise UsageError(f"{label}: {exc}") from None


def torch_error(error: BaseException, label: str) -> BaseException:
    """``error`` as torch.distributed raises it (see the module docstring)."""
    if isinstance(error, UsageError | ConfigError) or not isinstance(error, CollectiveError):
        return error
    kind = dist.DistNetworkError if isinstance(error, TransportError) else dist.DistBackendError
    made = kind(f"burncoll {label} failed (its peer ids are the process group's ranks): "
                f"{type(error).__name__}: {error}")
    made.__cause__ = error
    return made


@contextlib.contextmanager
def torch_errors(label: str) -> Iterator[None]:
    """Raise the burncoll errors of the block as :func:`torch_error` turns them."""
    try:
        yield
    except CollectiveError as exc:
        converted = torch_error(exc, label)
        if converted is exc:
            raise
        raise converted from exc


class TorchWork(dist._Work):  # type: ignore[misc,name-defined]
    """A torch ``Work`` for one burncoll operation in flight.

    ``then`` (optional) runs when the operation is done, before the future completes: the
    copy of a result into the caller's tensors, for the operations whose result is not
    written in place.
    """

    def __init__(self, work: Work[Any] | None, tensors: list[torch.Tensor], label: str,
                 then: Callable[[Any], None] | None = None, value: Any = None) -> None:
        """``work`` in flight, or ``None`` for an operation done already with ``value`` (a
        blocking call: its future completes here, without a :class:`~burncoll.Work`)."""
        super().__init__()
        self._label = label
        self._tensors = tensors
        self._then = then
        self._error: BaseException | None = None
        self._future: torch.futures.Future[list[torch.Tensor]] = torch.futures.Future()
        if work is None:
            self._settle(lambda: value)
        else:
            work.add_done_callback(lambda done: self._settle(done.result))

    def __repr__(self) -> str:
        return f"TorchWork({self._label}, done={self._future.done()})"

    def _settle(self, result: Callable[[], Any]) -> None:
        """Complete the future with the tensors once ``then`` took ``result()`` (or with the
        error either raised)."""
        try:
            value = result()
            if self._then is not None:
                self._then(value)
        except BaseException as exc:  # the future carries it to whoever waits
            self._error = torch_error(exc, self._label)
            self._future.set_exception(self._error)  # type: ignore[arg-type]
            return
        self._future.set_result(self._tensors)

    def get_future(self) -> torch.futures.Future[list[torch.Tensor]]:
        """Completed with the operation's tensors once it is done (its error if it failed)."""
        return self._future

    def wait(self, timeout: timedelta | None = None) -> bool:
        """Block until done; raise its error. Every operation ends by the session's timeout
        (the process group's), so torch's ``timeout`` (0 = none) need not be enforced here."""
        self._future.wait()  # raises the operation's error, as torch's own Work does
        return True

    def is_completed(self) -> bool:
        return bool(self._future.done())

    def is_success(self) -> bool:
        return bool(self._future.done()) and self._error is None

    def exception(self) -> BaseException | None:
        return self._error

    def result(self) -> list[torch.Tensor]:
        self.wait()
        return self._tensors

    def synchronize(self) -> None:
        """CPU tensors: nothing is left to order on a stream once the work is done."""


def flat(tensor: torch.Tensor, label: str) -> Any:
    """``tensor`` as a one-dimensional array view (no copy)."""
    return as_array(tensor, label).reshape(-1)


def split_into(result: Any, tensors: list[torch.Tensor], label: str) -> None:
    """Copy the flat ``result`` into ``tensors`` in order (each takes its own numel)."""
    sizes = [t.numel() for t in tensors]
    if sum(sizes) != int(np.prod(result.shape)):
        raise UsageError(f"{label}: the output tensors hold {sum(sizes)} elements in all but "
                         f"the result has {int(np.prod(result.shape))}; give every rank "
                         "tensors of the same sizes")
    start = 0
    source = result.reshape(-1)
    for tensor, size in zip(tensors, sizes, strict=True):
        flat(tensor, label)[...] = source[start:start + size]
        start += size


#: The name to pass to ``torch.distributed.init_process_group``.
BACKEND_NAME = "burncoll"

_OPS = {
    dist.ReduceOp.SUM: ReduceOp.SUM, dist.ReduceOp.AVG: ReduceOp.MEAN,
    dist.ReduceOp.PRODUCT: ReduceOp.PROD, dist.ReduceOp.MIN: ReduceOp.MIN,
    dist.ReduceOp.MAX: ReduceOp.MAX, dist.ReduceOp.BAND: ReduceOp.BAND,
    dist.ReduceOp.BOR: ReduceOp.BOR, dist.ReduceOp.BXOR: ReduceOp.BXOR,
}

#: ProcessGroup methods burncoll does not carry, and what to use instead.
UNSUPPORTED: dict[str, str] = {
    "allreduce_coalesced": "all_reduce each tensor (async_op=True), or flatten them first",
    "allgather_coalesced": "all_gather each tensor",
    "allgather_into_tensor_coalesced": "all_gather_into_tensor each tensor",
    "all_gather_single_coalesced": "all_gather_into_tensor each tensor",
    "reduce_scatter_tensor_coalesced": "reduce_scatter_tensor each tensor",
    "reduce_scatter_single_coalesced": "reduce_scatter_tensor each tensor",
    "recv_anysource": "recv with an explicit src",
    "merge_remote_group": "init_process_group over all the ranks",
}


def _reduce_op(op: Any, label: str) -> ReduceOp:
    for theirs, ours in _OPS.items():
        if op == theirs:
            return ours
    raise UsageError(
        f"burncoll's torch.distributed backend does not support reduce op "
        f"{str(getattr(op, 'op', op)).split('.')[-1]} in {label} "
        f"(supported: {', '.join(str(o).split('.')[-1] for o in _OPS)})")


def _one(tensors: list[T], label: str) -> T:
    if len(tensors) != 1:
        raise UsageError(f"{label}: burncoll takes one tensor per rank (one device per "
                         f"process), got {len(tensors)}")
    return tensors[0]


def _one_array(tensors: list[torch.Tensor], label: str) -> tuple[torch.Tensor, Any]:
    """The one tensor of ``tensors`` and its array view (:func:`as_array`)."""
    t = _one(tensors, label)
    return t, as_array(t, label)


class BurncollProcessGroup(dist.ProcessGroup):
    """A ``torch.distributed.ProcessGroup`` whose collectives run on a burncoll
    :class:`~burncoll.Communicator` (one per device type: ``"cpu"``, and ``"cuda"`` where
    torch has CUDA). Made by torch through ``init_process_group("burncoll")`` / ``new_group``.
    """

    def __init__(self, comms: dict[str, Communicator], rank: int, size: int) -> None:
        super().__init__(rank, size)  # type: ignore[call-arg]
        self._comms = comms
        self._rank = rank

    def getBackendName(self) -> str:
        return BACKEND_NAME

    def __repr__(self) -> str:
        return f"BurncollProcessGroup(rank={self._rank}, size={self.size()})"

    def communicator(self, device: str = "cpu") -> Communicator:
        """The burncoll :class:`~burncoll.Communicator` behind this group for ``device``'s
        tensors, to call burncoll's own API (``all_reduce_tree``, ``scan``, ...) on the same
        session; its peer ids are this group's ranks."""
        return self._comm(torch.empty(0, device=device))

    # -- issuing ------------------------------------------------------------------------------
    def _comm(self, tensor: torch.Tensor | None) -> Communicator:
        kind = "cpu" if tensor is None else tensor.device.type
        comm = self._comms.get(kind)
        if comm is None:
            raise UsageError(f"burncoll's process group has no session for {kind} tensors "
                             f"(it has {', '.join(self._comms)}); CUDA tensors need torch "
                             "with CUDA and CuPy when the group is created")
        return comm

    def _issue(self, opts: Any, label: str, tensors: list[torch.Tensor],
               start: Callable[[Communicator, bool], Any],
               then: Callable[[Any], None] | None = None) -> TorchWork:
        """Run one burncoll operation, ``start(comm, async_op)``, on the session of
        ``tensors``' device: with ``async_op=True`` unless torch says the caller waits at once
        (``opts.asyncOp`` false: ``dist.all_reduce(t)``), when it runs in this thread, as
        burncoll's own blocking calls do, with no hand-off to the communicator's worker."""
        run_async = bool(getattr(opts, "asyncOp", True))
        with torch_errors(label):
            got = start(self._comm(tensors[0] if tensors else None), run_async)
        if run_async:
            return TorchWork(got, tensors, label, then)
        return TorchWork(None, tensors, label, then, got)

    # -- collectives ------------------------------------------------------------------------
    def allreduce(self, tensors: list[torch.Tensor], opts: Any = None) -> TorchWork:  # type: ignore[override]
        op = _reduce_op((opts or dist.AllreduceOptions()).reduceOp, "all_reduce")
        t, a = _one_array(tensors, "all_reduce")
        return self._issue(opts, "all_reduce", [t], lambda c, s: c.all_reduce(
            a, op, out=a, async_op=s))

    def broadcast(self, tensors: list[torch.Tensor], opts: Any = None) -> TorchWork:  # type: ignore[override]
        root = (opts or dist.BroadcastOptions()).rootRank
        t, a = _one_array(tensors, "broadcast")
        if root == self._rank:
            return self._issue(opts, "broadcast", [t], lambda c, s: c.broadcast(
                a, root, async_op=s))
        return self._issue(opts, "broadcast", [t], lambda c, s: c.broadcast(
            None, root, out=a, async_op=s))

    def reduce(self, tensors: list[torch.Tensor], opts: Any = None) -> TorchWork:  # type: ignore[override]
        opts = opts or dist.ReduceOptions()
        op, root = _reduce_op(opts.reduceOp, "reduce"), opts.rootRank
        t, a = _one_array(tensors, "reduce")
        return self._issue(opts, "reduce", [t], lambda c, s: c.reduce(
            a, root, op, out=a if root == self._rank else None, async_op=s))

    def allgather(self, output_tensors: list[list[torch.Tensor]],  # type: ignore[override]
                  input_tensors: list[torch.Tensor], opts: Any = None) -> TorchWork:
        outs, t = _one(output_tensors, "all_gather"), _one(input_tensors, "all_gather")
        self._check_count(outs, "all_gather")
        a = flat(t, "all_gather")
        return self._issue(opts, "all_gather", outs, lambda c, s: c.all_gather(a, async_op=s),
                           lambda got: split_into(got, outs, "all_gather"))

    def all_gather_single(self, output: torch.Tensor, input: torch.Tensor,
                          opts: Any = None) -> TorchWork:
        label = "all_gather_into_tensor"
        self._check_numel(output, input, label)
        a, out = flat(input, label), flat(output, label)
        return self._issue(opts, label, [output], lambda c, s: c.all_gather(a, out=out, async_op=s))

    _allgather_base = all_gather_single

    def reduce_scatter(self, output_tensors: list[torch.Tensor],  # type: ignore[override]
                       input_tensors: list[list[torch.Tensor]], opts: Any = None) -> TorchWork:
        op = _reduce_op((opts or dist.ReduceScatterOptions()).reduceOp, "reduce_scatter")
        out, ins = _one(output_tensors, "reduce_scatter"), _one(input_tensors, "reduce_scatter")
        whole, counts = self._joined(ins, "reduce_scatter")
        target = flat(out, "reduce_scatter")
        return self._issue(opts, "reduce_scatter", [out], lambda c, s: c.reduce_scatter(
            whole, op, counts, out=target, async_op=s))

    def reduce_scatter_single(self, output: torch.Tensor, input: torch.Tensor,
                              opts: Any = None) -> TorchWork:
        label = "reduce_scatter_tensor"
        op = _reduce_op((opts or dist.ReduceScatterOptions()).reduceOp, label)
        self._check_numel(input, output, label)
        a, out = flat(input, label), flat(output, label)
        return self._issue(opts, label, [output], lambda c, s: c.reduce_scatter(
            a, op, out=out, async_op=s))

    _reduce_scatter_base = reduce_scatter_single  # type: ignore[assignment]

    def all_to_all_single(self, output: torch.Tensor, input: torch.Tensor,
                          output_split_sizes: list[int], input_split_sizes: list[int],
                          opts: Any = None) -> TorchWork:
        label = "all_to_all_single"
        if input.dim() == 0 or output.dim() == 0:
            raise UsageError(f"{label}: tensors need at least one dimension (rows)")
        a, out = as_array(input, label), as_array(output, label)
        counts = list(input_split_sizes) or None
        return self._issue(opts, label, [output], lambda c, s: c.all_to_all(
            a, counts, out=out, async_op=s))

    alltoall_base = all_to_all_single  # type: ignore[assignment]

    def alltoall(self, output_tensors: list[torch.Tensor], input_tensors: list[torch.Tensor],
                 opts: Any = None) -> TorchWork:
        self._check_count(output_tensors, "all_to_all")
        whole, counts = self._joined(input_tensors, "all_to_all")
        return self._issue(opts, "all_to_all", output_tensors, lambda c, s: c.all_to_all(
            whole, counts, async_op=s),
            lambda got: split_into(got, output_tensors, "all_to_all"))

    def gather(self, output_tensors: list[list[torch.Tensor]],  # type: ignore[override]
               input_tensors: list[torch.Tensor], opts: Any = None) -> TorchWork:
        root = (opts or dist.GatherOptions()).rootRank
        t = _one(input_tensors, "gather")
        a = flat(t, "gather")
        if root != self._rank:
            return self._issue(opts, "gather", [t], lambda c, s: c.gather(a, root, async_op=s))
        outs = _one(output_tensors, "gather")
        self._check_count(outs, "gather")
        return self._issue(opts, "gather", outs, lambda c, s: c.gather(a, root, async_op=s),
                           lambda got: split_into(got, outs, "gather"))

    def scatter(self, output_tensors: list[torch.Tensor],  # type: ignore[override]
                input_tensors: list[list[torch.Tensor]], opts: Any = None) -> TorchWork:
        root = (opts or dist.ScatterOptions()).rootRank
        out = _one(output_tensors, "scatter")
        target = flat(out, "scatter")
        if root != self._rank:
            return self._issue(opts, "scatter", [out], lambda c, s: c.scatter(
                None, root, out=target, async_op=s))
        ins = _one(input_tensors, "scatter")
        whole, counts = self._joined(ins, "scatter")
        return self._issue(opts, "scatter", [out], lambda c, s: c.scatter(
            whole, root, counts, out=target, async_op=s))

    def barrier(self, opts: Any = None) -> TorchWork:
        return self._issue(opts, "barrier", [], lambda c, s: c.barrier(async_op=s))

    def send(self, tensors: list[torch.Tensor], dst: int, tag: int) -> TorchWork:
        t, a = _one_array(tensors, "send")
        return self._issue(None, "send", [t], lambda c, s: c.isend(a, dst, tag))

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int) -> TorchWork:
        t, a = _one_array(tensors, "recv")
        return self._issue(None, "recv", [t], lambda c, s: c.irecv(src, tag, out=a))

    # -- life -------------------------------------------------------------------------------
    def shutdown(self) -> None:
        """``destroy_process_group``: leave the burncoll session(s) (waits for operations in
        flight, each bounded by the timeout)."""
        comms, self._comms = self._comms, {}
        for comm in comms.values():
            with torch_errors("destroy_process_group"):  # a failure after the last call
                comm.finish()

    # -- checks -----------------------------------------------------------------------------
    def _check_count(self, tensors: list[torch.Tensor], label: str) -> None:
        if len(tensors) != self.size():
            raise UsageError(f"{label}: expected a list of {self.size()} tensors (one per "
                             f"rank of the group), got {len(tensors)}")

    def _joined(self, tensors: list[torch.Tensor], label: str) -> tuple[np.ndarray, list[int]]:
        """One tensor per rank, checked, as one flat array and the ranks' element counts."""
        self._check_count(tensors, label)
        return np.concatenate([flat(x, label) for x in tensors]), [x.numel() for x in tensors]

    def _check_numel(self, whole: torch.Tensor, part: torch.Tensor, label: str) -> None:
        if whole.numel() != part.numel() * self.size():
            raise UsageError(f"{label}: the output/input sizes do not match: {whole.numel()} "
                             f"elements should be {self.size()} x {part.numel()}")


def _unsupported(name: str, instead: str) -> Callable[..., Any]:
    def refuse(self: BurncollProcessGroup, *args: Any, **kwargs: Any) -> Any:
        raise UsageError(f"burncoll's torch.distributed backend does not support "
                                  f"{name}: {instead}")
    refuse.__name__ = name
    return refuse


for _name, _instead in UNSUPPORTED.items():
    setattr(BurncollProcessGroup, _name, _unsupported(_name, _instead))


def _create(store: Store, rank: int, size: int, timeout: timedelta
            ) -> BurncollProcessGroup:
    """torch's creator: a process group over a new burncoll session (two with CUDA)."""
    with torch_errors("init_process_group"):
        comms = {"cpu": open_session(store, rank, size, timeout)}
        if torch.cuda.is_available() and find_spec("cupy") is not None:  # pragma: no cover
            # (no GPU on the machines tested)
            comms["cuda"] = open_session(store, rank, size, timeout, backend="cupy",
                                         device=torch.cuda.current_device(), label="cuda")
    return BurncollProcessGroup(comms, rank, size)


if BACKEND_NAME.upper() not in dist.Backend._plugins:
    dist.Backend.register_backend(BACKEND_NAME, _create, devices=["cpu", "cuda"])
