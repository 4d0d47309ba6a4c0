"""What :mod:`burncoll.torch` hands torch: tensors as arrays without a copy (:func:`as_array`,
the torch backend's view: NumPy for CPU, CuPy through DLPack for CUDA), a
``torch.distributed`` ``Work`` around a :class:`burncoll.Work` (:class:`TorchWork`, whose
future completes with the operation's tensors, as Gloo's, so DDP's communication hooks can
chain on it), and burncoll's errors as torch's distributed errors (:func:`torch_error`; the
table is in docs/pytorch.md: the message is kept, the original is the ``__cause__``, and
:class:`~burncoll.UsageError` / :class:`~burncoll.ConfigError` pass unchanged).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from burncoll.backends.torch import as_array as tensor_view
from burncoll.errors import CollectiveError, ConfigError, TransportError, UsageError
from burncoll.work import Work

__all__ = ["TorchWork", "as_array", "flat", "split_into", "torch_error", "torch_errors"]


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
