"""The one core every part of :class:`~burncoll.Communicator` shares: the peer's state, the
queue that runs its operations in program order, and the argument checks every operation makes.

:class:`~burncoll.comm.rooted.RootedOps`, :class:`~burncoll.comm.p2p.PointToPoint` and
:class:`~burncoll.comm.groups.Groups` subclass it; :class:`~burncoll.Communicator` joins them.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import numpy as np

from burncoll.backends import foreign_array
from burncoll.backends.base import Array, Backend, Device
from burncoll.backends.numpy import NumpyBackend
from burncoll.comm import objects
from burncoll.config import CollectiveConfig
from burncoll.dtypes import SUPPORTED_DTYPES, WIRE_CODES
from burncoll.errors import CollectiveError, ConfigError, UsageError
from burncoll.local.calls import Call
from burncoll.local.plans import choose
from burncoll.local.rendezvous import Rendezvous
from burncoll.ops import OpKind, ReduceOp, check_reduce_dtype
from burncoll.work import OpQueue, Work

__all__ = ["CommunicatorCore"]


class CommunicatorCore:
    """One peer's state and the machinery of its operations (see the module docstring)."""

    def __init__(self, server: Rendezvous, index: int, device: Device) -> None:
        self._server = server
        self._index = index
        self._backend: Backend = server.backend
        #: NumPy: every device is the host, where an array already is (no move to check).
        self._host = isinstance(self._backend, NumpyBackend)
        #: This peer's id, as passed to :func:`register`.
        self.peer_id: int = server.peer_ids[index]
        #: The device this peer's results live on.
        self.device: Device = device
        #: Position of ``peer_id`` among all peer ids of the collective, sorted.
        self.rank: int = server.rank_of[self.peer_id]
        #: Number of peers in the whole collective (all nodes).
        self.world_size: int = server.world_size
        #: This peer's operations in the order issued (``async_op=True`` runs them on its
        #: worker thread; see :mod:`burncoll.work`).
        self._ops = OpQueue(f"burncoll-peer-{self.peer_id}")
        self._p2p_in_flight: set[Work[Any]] = set()

    def __repr__(self) -> str:
        return (
            f"Communicator(peer_id={self.peer_id}, rank={self.rank}, "
            f"world_size={self.world_size}, device={self.device!r})"
        )

    @property
    def peer_ids(self) -> tuple[int, ...]:
        """Every peer id of the collective, sorted (index = rank)."""
        return self._server.world_peer_ids

    @property
    def config(self) -> CollectiveConfig:
        """The configuration this peer registered with."""
        return self._server.config

    def _issue(self, label: str, fn: Callable[[], Any], async_op: bool) -> Any:
        """Run ``fn`` (one operation) in program order: now, or queued behind this peer's
        operations in flight; with ``async_op``, return its :class:`~burncoll.Work` at once."""
        if async_op:
            return self._ops.submit(functools.partial(self._reported, fn), label)
        try:
            return self._ops.run(fn, label)
        except CollectiveError as exc:
            self._report(exc)
            raise

    def _reported(self, fn: Callable[[], Any]) -> Any:
        """``fn()``, its failure reported (:meth:`_report`)."""
        try:
            return fn()
        except CollectiveError as exc:
            self._report(exc)
            raise

    def _report(self, error: CollectiveError) -> None:
        """Mark the link's failure reported once a call raised ``error`` (``finish()`` then
        does not raise it again); not for the caller's own mistakes, after which the session
        goes on."""
        link = self._server.link
        if link is not None and not isinstance(error, UsageError | ConfigError):
            link.failure_reported = True

    # -- validation ---------------------------------------------------------------------------
    def _is_array(self, x: object) -> bool:
        return self._backend.is_array(x)

    def _check_root(self, root: int) -> int:
        if isinstance(root, bool) or not isinstance(root, int):
            raise UsageError(f"root must be a peer id (an int), got {root!r}")
        if root not in self._server.rank_of:
            raise UsageError(
                f"root={root} is not a peer of this collective; peer ids are "
                f"{list(self._server.world_peer_ids)}"
            )
        return root

    def _run(
        self, kind: OpKind, x: Array | None, op: ReduceOp | None, root: int | None,
        allow_none: bool = False, out: Array | None = None,
        counts: tuple[int, ...] | None = None, compression: str | None = None,
        dtype: str | None = None,
    ) -> Array | None:
        """Run this peer's part of operation ``kind`` on ``x`` (``dtype``: ``x``'s, given when
        :meth:`_accept` took it already)."""
        server = self._server
        server.check_usable(self._index)
        shape: tuple[int, ...] | None = None
        if dtype is None and (x is not None or not allow_none):
            x, dtype = self._typed(kind.label, x)
            if not self._host:
                x = self._on_device(x)
        if dtype is not None:
            if op is not None and op.bitwise:  # refused here, before this peer joins it
                check_reduce_dtype(op, dtype, kind.label)
            shape = tuple(self._backend.shape(x))
        call = Call(self.peer_id, kind, op, root, x, dtype, shape, out, counts, compression)
        return server.run(self._index, call, choose.prepare)

    def _checked(self, label: str, x: object) -> Array:
        """``x`` if it is an array of this backend in a supported dtype, in native byte order
        (a copy, as NumPy would make, when it was not: the wire carries native elements)."""
        return self._typed(label, x)[0]

    def _typed(self, label: str, x: object) -> tuple[Array, str]:
        """:meth:`_checked`'s array and its dtype's name."""
        backend = self._backend
        if not backend.is_array(x):
            raise UsageError(f"{label}: {foreign_array(x, backend.name)}")
        byteorder = getattr(x, "dtype", None)
        if isinstance(byteorder, np.dtype) and not byteorder.isnative:
            x = x.astype(byteorder.newbyteorder("="))  # type: ignore[attr-defined]
        dtype = backend.dtype_name(x)
        if dtype not in WIRE_CODES:
            raise UsageError(f"{label}: dtype {dtype} is not supported; use one of "
                             f"{', '.join(SUPPORTED_DTYPES)}")
        return x, dtype

    def _accept(self, kind: OpKind, x: Array | None) -> tuple[Array, str]:
        """``x`` checked (:meth:`_checked`) and on this peer's device, and its dtype's name."""
        x, dtype = self._typed(kind.label, x)
        return x if self._host else self._on_device(x), dtype

    def _on_device(self, x: Array) -> Array:
        """``x`` on this peer's device (moved there when it is not)."""
        backend = self._backend
        if not backend.same_device(backend.device_of(x), self.device):
            x = backend.to_device(x, self.device)
        return x

    def _all_gather_record(self, record: np.ndarray[Any, Any], label: str) -> list[object]:
        """Every peer's object in rank order, from this peer's ``record`` (an
        :func:`~burncoll.comm.objects.payload`): one all-gather of msgpack bytes, never pickle."""
        sent = self._backend.from_host(record, "uint8", record.shape, self.device)
        got = self._issue(label, lambda: self._run(OpKind.ALL_GATHER, sent, None, None), False)
        return objects.unpack(self._backend.to_host(got), self.peer_ids, label,
                              self.config.max_object_containers)
