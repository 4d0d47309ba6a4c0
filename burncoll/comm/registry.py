"""Registration: the peers of a node find each other here, and the last one builds the node.

``register(peer_id, device, config)`` takes no handle, so the peers of a node meet in this
process-wide registry, keyed by config. The last local peer to arrive joins the other nodes
(hosting the orchestrator first when the config says so) and builds the node's
:class:`~burncoll.local.rendezvous.Rendezvous`; a failed node is closed before its peers
register again.
"""

from __future__ import annotations

import atexit
import contextlib
import threading
import time
import warnings
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field

from burncoll.backends import get_backend
from burncoll.backends.base import Device
from burncoll.config import CollectiveConfig
from burncoll.errors import CollectiveError, CollectiveTimeout, UsageError
from burncoll.local.rendezvous import Rendezvous
from burncoll.orchestration.hosting import hosted_orchestrator

__all__ = ["REGISTRY", "Registry", "close_node"]


@dataclass
class _Group:
    """The peers of one node registering with one config, until the node is built."""

    config: CollectiveConfig
    devices: dict[int, Device] = field(default_factory=dict)
    server: Rendezvous | None = None
    error: BaseException | None = None
    #: The aborted node this registration replaces: its connections and listener are closed
    #: before the new node binds (it may reuse the same port).
    previous: Rendezvous | None = None
    #: Set once every local peer has registered: the node is being built (it joins the other
    #: nodes within its own deadline), and the waiting peers wait for the outcome.
    building: bool = False


#: Seconds a registering peer waits for the node's builder beyond the builder's own deadline
#: (closing an aborted predecessor, and the I/O loop's guard).
_BUILD_GRACE = 10.0


class Registry:
    """The groups being registered in this process, keyed by config.

    ``register(peer_id, device, config)`` takes no handle, so the peers of a node find each
    other here; one registry per process, guarded by one lock.
    """

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._groups: dict[CollectiveConfig, _Group] = {}
        self._closed: weakref.WeakSet[Rendezvous] = weakref.WeakSet()
        self._on_close: weakref.WeakKeyDictionary[Rendezvous, list[Callable[[], None]]] = (
            weakref.WeakKeyDictionary())

    def join(self, peer_id: int, device: Device, config: CollectiveConfig
             ) -> tuple[Rendezvous, int]:
        """Register ``peer_id``; once every local peer has (and the node has joined the other
        nodes), the node's rendezvous and the peer's index in it."""
        deadline = time.monotonic() + config.timeout
        with self._cond:
            group = self._groups.get(config)
            if group is None or group.server is not None or group.error is not None:
                # none yet, or a complete (possibly aborted) one: this registration starts anew
                old = None if group is None else group.server
                previous = old if old is not None and old.failure is not None else None
                group = self._groups[config] = _Group(config, previous=previous)
            twice = self._add(group, peer_id, device)
            builder = len(group.devices) == config.num_devices and group.error is None
            if builder:
                group.building = True
        if builder:
            self._build(group)
        elif twice and group.error is not None and config.is_multi_node:
            from burncoll.node import report_failure

            report_failure(config, sorted(group.devices), group.error)
            raise group.error
        with self._cond:
            while group.server is None and group.error is None:
                remaining = deadline - time.monotonic()
                if group.building:
                    # every local peer is here: the builder reports the outcome (joining the
                    # other nodes is bounded by its own deadline), never "peers missing"
                    remaining += config.timeout + _BUILD_GRACE
                if remaining <= 0:
                    group.error = CollectiveTimeout(
                        f"register timed out after {config.timeout:g} s: "
                        f"{len(group.devices)} of num_devices={config.num_devices} local peers "
                        f"registered (peer ids {sorted(group.devices)}); every local peer must "
                        "call register() with the same config")
                    self._groups.pop(config, None)
                    self._cond.notify_all()
                    break
                self._cond.wait(remaining)
            if group.error is not None:
                raise group.error
            server = group.server
        assert server is not None  # (the loop ends only when it is set, or raises)
        return server, server.index_of[peer_id]

    def _add(self, group: _Group, peer_id: int, device: Device) -> bool:
        """Add ``peer_id`` to ``group`` (under the lock); whether it was there already, which
        fails the group: the node can never hold ``num_devices`` distinct peers, so every
        local peer fails now, and the caller tells the nodes waiting for it."""
        config = group.config
        if peer_id in group.devices and not group.building:
            group.error = UsageError(
                f"peer id {peer_id} was registered twice on node {config.node_rank or 0}; peer "
                "ids must be unique across the collective (number them node_rank * num_devices "
                "+ i: burncoll.peer_ids())")
            self._groups.pop(config, None)
            self._cond.notify_all()
            return True
        if peer_id in group.devices or len(group.devices) >= config.num_devices:
            raise UsageError(
                f"peer {peer_id} registered while all num_devices={config.num_devices} "
                f"local peers (ids {sorted(group.devices)}) are already registering with "
                "this config")
        group.devices[peer_id] = device
        return False

    def _build(self, group: _Group) -> None:
        config = group.config
        try:
            if group.previous is not None:
                # after a failure the peers register again without calling finish(): leave
                # the aborted collective first, so nothing of it lingers (threads, sockets,
                # the data service's port)
                previous, group.previous = group.previous, None
                with contextlib.suppress(CollectiveError):  # best effort: it failed already
                    self.close(previous)
            backend = get_backend(config.backend)
            peer_ids = sorted(group.devices)
            devices = [group.devices[p] for p in peer_ids]
            link = None
            if config.is_multi_node:
                from burncoll.node import join_collective

                hosted_orchestrator(config)
                link = join_collective(config, peer_ids)
            server = Rendezvous(backend, peer_ids, devices, config, link)
            if link is not None:
                link.attach(server)
        except BaseException as exc:
            with self._cond:
                group.error = exc
                self._groups.pop(config, None)
                self._cond.notify_all()
            return
        with self._cond:
            group.server = server
            self._cond.notify_all()

    def unfinished(self) -> list[Rendezvous]:
        """The healthy nodes of this process that no peer closed (every one of a node's peers
        calls ``finish()``; a failed node's peers were told why already)."""
        with self._cond:
            return [g.server for g in self._groups.values() if g.server is not None
                    and g.server.failure is None and g.server not in self._closed]

    def forget(self, server: Rendezvous) -> None:
        with self._cond:
            group = self._groups.get(server.config)
            if group is not None and group.server is server:
                del self._groups[server.config]

    def on_close(self, server: Rendezvous, fn: Callable[[], None]) -> None:
        """Call ``fn`` once ``server``'s node is closed (at once if it is already): what a
        communicator group started for its collective (its orchestrator) ends with it."""
        with self._cond:
            if server not in self._closed:
                self._on_close.setdefault(server, []).append(fn)
                return
        fn()

    def close(self, server: Rendezvous) -> None:
        """Close ``server``'s node link, once, whoever asks first (finish or a new register),
        then run what :meth:`on_close` asked for."""
        with self._cond:
            if server in self._closed:
                return
            self._closed.add(server)
            after = self._on_close.pop(server, [])
        try:
            if server.link is not None:
                server.link.close(time.monotonic() + server.config.timeout)
        finally:
            for fn in after:
                fn()


#: The one registry of this process.
REGISTRY = Registry()


def warn_unfinished() -> None:
    """(At exit.) A ``UserWarning`` for each node whose peers never all called ``finish()``,
    as torch.distributed warns when ``destroy_process_group()`` was not called: its sockets
    close with the process, and the other nodes see only a connection closed."""
    for server in REGISTRY.unfinished():
        link = server.link
        node = f"node {link.node_index} of a multi-node collective" if link else \
            "a one-node collective"
        why = ", so that the other nodes learn that this one left rather than lost it" if \
            link else ""
        warnings.warn(
            f"burncoll: peer(s) {list(server.peer_ids)} of {node} did not call finish() before "
            f"the program exited; call comm.finish() on every peer when done{why}",
            UserWarning, stacklevel=1)


atexit.register(warn_unfinished)


def close_node(server: Rendezvous) -> None:
    """Leave the collective of ``server``'s node: forget its registration, close its link."""
    REGISTRY.forget(server)
    REGISTRY.close(server)
