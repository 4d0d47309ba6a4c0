"""``burncoll.ray.run``: a function on N Ray actors, one per burncoll node, rendezvous arranged.

What ``burncoll launch`` does with processes, :func:`run` does with Ray actors: one per node (a
placement group, strategy ``SPREAD``), node 0's hosting the orchestrator, each given the
``BURNCOLL_*`` variables of a launched node before it calls ``fn``. So an unchanged training
script works::

    def train() -> float:
        trainer = burncoll.train.ddp(range(2), CollectiveConfig(backend="numpy"))
        return trainer.fit(...).losses[-1]

    ray.init()
    losses = burncoll.ray.run(train, num_nodes=4, devices_per_node=2)

Each actor's node address is its Ray node IP; when all are the same, everything binds loopback.
Each call makes a fresh token. ``fn``, its arguments, results, errors and the nodes' settings
(the token among them) travel over Ray's own channel, pickled by Ray; burncoll's network never
unpickles anything. Install with ``pip install 'burncoll[ray]'``; :func:`run` calls
``ray.init()`` itself when Ray is not initialised yet (``RAY_ADDRESS`` or a local cluster).
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

from burncoll.config.values import parse_env
from burncoll.errors import (
    BackendUnavailable,
    CollectiveAborted,
    CollectiveError,
    CollectiveTimeout,
    PeerLost,
    UsageError,
)
from burncoll.orchestration.launch import new_token, node_environment
from burncoll.orchestration.orchestrator import Orchestrator, start_orchestrator
from burncoll.transport import TRANSPORT_NAMES

__all__ = ["run"]

R = TypeVar("R")

LOOPBACK = "127.0.0.1"
#: The variables :func:`run` sets on every node itself; ``env`` may not set them.
OWNED_VARIABLES = ("BURNCOLL_NODE_RANK", "BURNCOLL_NUM_NODES", "BURNCOLL_NUM_DEVICES",
                   "BURNCOLL_GLOBAL_ADDRESS", "BURNCOLL_NODE_ADDRESS", "BURNCOLL_DATA_SERVICE_PORT",
                   "BURNCOLL_TRANSPORT", "BURNCOLL_AUTH_TOKEN", "BURNCOLL_AUTH_TOKEN_FILE")
#: Seconds the orchestrator gets to stop before its actor is killed anyway.
_STOP_SECONDS = 5.0


def _consequence(error: BaseException) -> bool:
    """Whether a node raised ``error`` because another node failed first: an abort, a lost
    node, or a plain :class:`CollectiveError` (how burncoll hands a node another node's
    failure whose type is not burncoll's). Not the cause to report when there is another."""
    return isinstance(error, CollectiveAborted | PeerLost) or type(error) is CollectiveError


class _Node:
    """One burncoll node: the class of the Ray actors (``ray.remote`` is applied in run)."""

    def __init__(self) -> None:
        self._orchestrator: Orchestrator | None = None

    def node_ip(self) -> str:
        """This actor's Ray node IP."""
        import ray.util

        node_ip: Callable[[], str] = ray.util.get_node_ip_address  # untyped in Ray
        return str(node_ip())

    def start_orchestrator(self, host: str, transport: str, token: str, nodes: int,
                           integrity: bool, tls: bool | None) -> str:
        """Start the orchestrator in this actor's process; its ``"host:port"``."""
        self._orchestrator = start_orchestrator(
            host, 0, transport, token, integrity=integrity, tls=tls, expected_nodes=nodes)
        return self._orchestrator.address

    def stop_orchestrator(self) -> None:
        """Stop the orchestrator, if this actor hosts one."""
        orchestrator, self._orchestrator = self._orchestrator, None
        if orchestrator is not None:
            orchestrator.close()

    def call(self, settings: dict[str, str], fn: Callable[..., Any], args: tuple[Any, ...],
             kwargs: dict[str, Any]) -> Any:
        """Set this node's ``BURNCOLL_*`` variables in the process, then call ``fn``."""
        os.environ.pop("BURNCOLL_AUTH_TOKEN_FILE", None)  # the token comes in settings
        os.environ.update(settings)
        return fn(*args, **kwargs)


def run(fn: Callable[..., R], *args: Any, num_nodes: int, devices_per_node: int = 1,
        transport: str = "websocket", timeout: float = 120.0, num_cpus_per_node: float = 1,
        env: Mapping[str, str] | None = None, num_gpus_per_node: float = 0,
        **kwargs: Any) -> list[R]:
    """Call ``fn(*args, **kwargs)`` on ``num_nodes`` Ray actors, one per burncoll node.

    Each actor is a node of ``devices_per_node`` devices: ``BURNCOLL_NODE_RANK``, ``_NUM_NODES``,
    ``_NUM_DEVICES``, ``_GLOBAL_ADDRESS``, ``_NODE_ADDRESS``, ``_DATA_SERVICE_PORT=0``,
    ``_TRANSPORT`` and ``_AUTH_TOKEN`` are set in its process, so ``CollectiveConfig()`` finds its
    node; so are the driver's other ``BURNCOLL_*`` variables, then ``env`` (which may not set
    :data:`OWNED_VARIABLES`; its ``BURNCOLL_INTEGRITY`` and ``BURNCOLL_TLS`` apply to the
    orchestrator too).

    Returns the results in node-rank order. When ``fn`` fails on a node, the others are aborted
    and ``run`` raises the first node's own exception (remote traceback in ``__cause__``, a note
    naming the node) rather than the errors the others raise in consequence; a dead actor raises
    :class:`~burncoll.PeerLost`. The actors, placement group and orchestrator are always cleaned
    up before it returns. ``timeout`` bounds each set-up wait (:class:`~burncoll.CollectiveTimeout`
    naming the step) and the others' stop after a failure, not ``fn``. ``num_cpus_per_node``,
    ``num_gpus_per_node``: what each actor reserves (Ray shows it only the GPUs it reserved).
    Raises :class:`~burncoll.UsageError` for a bad argument, :class:`~burncoll.BackendUnavailable`
    without Ray.
    """
    extra = _check(fn, num_nodes, devices_per_node, transport, timeout, num_cpus_per_node,
                   num_gpus_per_node, env)
    job = _Job(_import_ray(), num_nodes, num_cpus_per_node, timeout, num_gpus_per_node)
    try:
        hosts = job.start()
        token = new_token()
        integrity = bool(parse_env("integrity", extra.get("BURNCOLL_INTEGRITY", "0")))
        tls = parse_env("tls", extra.get("BURNCOLL_TLS", "auto"))
        address = job.start_orchestrator(hosts[0], transport, token, integrity, tls)
        settings = [
            _settings(rank, num_nodes, devices_per_node, address, host, transport, token, extra)
            for rank, host in enumerate(hosts)
        ]
        return job.call(settings, fn, args, kwargs)
    finally:
        job.tear_down()


def _check(fn: Any, num_nodes: Any, devices_per_node: Any, transport: Any, timeout: Any,
           num_cpus_per_node: Any, gpus: Any, env: Mapping[str, str] | None) -> dict[str, str]:
    """Validate run's arguments; ``env`` as a dict."""
    if not callable(fn):
        raise UsageError(f"burncoll.ray.run: fn={fn!r} is not callable")
    for name, value in (("num_nodes", num_nodes), ("devices_per_node", devices_per_node)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise UsageError(f"burncoll.ray.run: {name}={value!r}: expected an int >= 1")
    if transport not in TRANSPORT_NAMES:
        raise UsageError(f"burncoll.ray.run: transport={transport!r}: expected one of "
                         f"{', '.join(TRANSPORT_NAMES)}")
    for name, value in (("timeout", timeout), ("num_cpus_per_node", num_cpus_per_node)):
        if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
            raise UsageError(f"burncoll.ray.run: {name}={value!r}: expected a number > 0")
    if isinstance(gpus, bool) or not isinstance(gpus, int | float) or gpus < 0:
        raise UsageError(f"burncoll.ray.run: num_gpus_per_node={gpus!r}: expected a number >= 0")
    extra = dict(env or {})
    for key, value in extra.items():
        if not isinstance(key, str) or not isinstance(value, str):
            raise UsageError(f"burncoll.ray.run: env must map str to str, got {key!r}: "
                             f"{type(value).__name__}")
    owned = sorted(set(extra) & set(OWNED_VARIABLES))
    if owned:
        raise UsageError(
            f"burncoll.ray.run: env sets {', '.join(owned)}, which run sets on each node itself; "
            "use num_nodes=, devices_per_node= and transport= instead")
    for key, field in (("BURNCOLL_INTEGRITY", "integrity"), ("BURNCOLL_TLS", "tls")):
        if key in extra:
            parse_env(field, extra[key])  # a ConfigError naming the variable when invalid
    return extra


def _import_ray() -> Any:
    """The ``ray`` module, initialised (``ray.init()`` when it is not yet)."""
    try:
        import ray
        import ray.util.placement_group  # the submodule run uses
    except ImportError as exc:
        if (exc.name or "").split(".")[0] != "ray":
            raise
        raise BackendUnavailable(
            f"burncoll.ray needs Ray, which is not installed ({exc}): "
            "pip install 'burncoll[ray]'") from exc
    if not ray.is_initialized():
        ray.init()
    return ray


def _settings(rank: int, nodes: int, devices: int, address: str, host: str, transport: str,
              token: str, extra: dict[str, str]) -> dict[str, str]:
    """The ``BURNCOLL_*`` variables of node ``rank``, as ``burncoll launch`` sets them."""
    full = node_environment(rank, nodes, devices, address, transport)
    settings = {k: v for k, v in full.items() if k.startswith("BURNCOLL_")}
    settings.pop("BURNCOLL_AUTH_TOKEN_FILE", None)
    settings.update({"BURNCOLL_NODE_ADDRESS": host, "BURNCOLL_AUTH_TOKEN": token,
                     "BURNCOLL_INTEGRITY": "0", "BURNCOLL_TLS": "auto"})
    settings.update(extra)
    return settings


class _Job:
    """One call of :func:`run`: its placement group, actors and pending calls."""

    def __init__(self, ray: Any, nodes: int, cpus: float, timeout: float,
                 gpus: float = 0) -> None:
        from ray.util.placement_group import placement_group

        self.ray = ray
        self.nodes = nodes
        self.cpus = cpus
        self.gpus = gpus
        self.timeout = timeout
        self.actors: list[Any] = []
        self.calls: list[Any] = []
        self.hosting = False
        self.bundle = {"CPU": float(cpus), **({"GPU": float(gpus)} if gpus else {})}
        self.group = placement_group([self.bundle] * nodes, strategy="SPREAD")

    def start(self) -> list[str]:
        """Place and start the actors; each node's address (loopback on one machine)."""
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        if not self.group.wait(self.timeout):
            raise CollectiveTimeout(
                f"burncoll.ray.run: Ray could not place {self.nodes} node(s) of "
                f"{self.bundle} within {self.timeout:g} s (available: "
                f"{self.ray.available_resources()}); lower num_nodes or num_cpus_per_node, "
                "add machines to the cluster, or raise timeout")
        actor_class = self.ray.remote(_Node)
        for rank in range(self.nodes):
            strategy = PlacementGroupSchedulingStrategy(
                placement_group=self.group, placement_group_bundle_index=rank)
            self.actors.append(actor_class.options(
                num_cpus=self.cpus, num_gpus=self.gpus, max_restarts=0,
                scheduling_strategy=strategy).remote())
        ips = self._get([a.node_ip.remote() for a in self.actors], "starting the actors")
        return [LOOPBACK] * self.nodes if len(set(ips)) == 1 else [str(ip) for ip in ips]

    def start_orchestrator(self, host: str, transport: str, token: str, integrity: bool,
                           tls: bool | None) -> str:
        """Start the orchestrator in node 0's actor; its address."""
        self.hosting = True
        ref = self.actors[0].start_orchestrator.remote(host, transport, token, self.nodes,
                                                       integrity, tls)
        return str(self._get([ref], "starting the orchestrator on node 0")[0])

    def _get(self, refs: list[Any], step: str) -> list[Any]:
        """``ray.get`` within the timeout; a node's error as :func:`_node_error` makes it."""
        exceptions = self.ray.exceptions
        try:
            ready, _ = self.ray.wait(refs, num_returns=len(refs), timeout=self.timeout)
            if len(ready) < len(refs):
                raise CollectiveTimeout(
                    f"burncoll.ray.run: {step} took more than timeout={self.timeout:g} s")
            return list(self.ray.get(refs, timeout=self.timeout))
        except exceptions.RayError as exc:
            raise _node_error(exceptions, f"a node ({step})", exc) from None

    def call(self, settings: list[dict[str, str]], fn: Callable[..., R], args: tuple[Any, ...],
             kwargs: dict[str, Any]) -> list[R]:
        """Call ``fn`` on every actor; the results in rank order, or the first node's error."""
        self.calls = [actor.call.remote(s, fn, args, kwargs)
                      for actor, s in zip(self.actors, settings, strict=True)]
        pending = {ref: rank for rank, ref in enumerate(self.calls)}
        results: dict[int, Any] = {}
        failures: list[BaseException] = []
        deadline: float | None = None
        while pending:
            wait = 1.0 if deadline is None else min(1.0, deadline - time.monotonic())
            if wait <= 0:
                break
            ready, _ = self.ray.wait(list(pending), num_returns=1, timeout=wait)
            for ref in sorted(ready, key=pending.__getitem__):
                rank = pending.pop(ref)
                try:
                    results[rank] = self.ray.get(ref, timeout=self.timeout)
                except self.ray.exceptions.RayError as exc:
                    failures.append(
                        _node_error(self.ray.exceptions, f"node {rank} of {self.nodes}", exc))
            if not all(_consequence(f) for f in failures):
                break  # the cause is known: the others are only being stopped
            if failures and deadline is None:
                deadline = time.monotonic() + self.timeout
        if failures:
            raise next((f for f in failures if not _consequence(f)), failures[0])
        if pending:  # pragma: no cover - only without failures, which never set a deadline
            raise CollectiveTimeout("burncoll.ray.run: the nodes did not finish")
        return [results[rank] for rank in range(self.nodes)]

    def tear_down(self) -> None:
        """Stop the orchestrator, kill the actors, remove the placement group (best effort)."""
        ray = self.ray
        idle = not self.calls or not ray.wait(self.calls[:1], timeout=0)[1]
        if self.hosting and idle:
            with contextlib.suppress(Exception):  # killing the actor stops it all the same
                ray.get(self.actors[0].stop_orchestrator.remote(), timeout=_STOP_SECONDS)
        for actor in self.actors:
            with contextlib.suppress(Exception):  # already dead
                ray.kill(actor, no_restart=True)
        with contextlib.suppress(Exception):  # already removed
            ray.util.remove_placement_group(self.group)


def _node_error(exceptions: Any, where: str, exc: BaseException) -> BaseException:
    """What to raise for the failure ``exc`` (a Ray error) of the node ``where`` names."""
    cause = getattr(exc, "cause", None)
    if isinstance(exc, exceptions.RayTaskError) and isinstance(cause, BaseException) and not (
            isinstance(cause, exceptions.RayError)):
        cause.add_note(f"burncoll.ray: raised on {where} (its Ray actor's traceback is in "
                       "__cause__)")
        cause.__cause__ = exc
        return cause
    if isinstance(exc, exceptions.RayActorError):
        lost = PeerLost(f"burncoll.ray: the Ray actor of {where} died: {exc}")
        lost.__cause__ = exc
        return lost
    return exc
