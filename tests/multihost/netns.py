"""Several real hosts on one machine, made of Linux network namespaces, for multi-host tests.

:func:`hosts` builds ``n`` hosts joined by a switch, as machines on one LAN::

    switch namespace  bc<hex>sw: bridge "br0", ports p0 .. p(n-1)
    host namespace i  bc<hex>h<i>: "lo" up, "eth0" = 10.B.C.(i+1)/24, veth peer of p<i>

B and C are random, the names carry a random tag, so parallel runs don't clash. Every link is
created inside its namespace (``ip -n``): nothing is added to the root namespace, and a host
has no route anywhere but its own /24, so an address that only works locally (loopback, a
wrong bind address) fails. Building needs root and a kernel that allows ``ip netns add``;
without them :func:`hosts` skips the test with the reason. Everything is removed when the
``with`` block ends: the processes still running inside are killed, then the namespaces are
deleted (which deletes the veths and the bridge).
"""

from __future__ import annotations

import os
import random
import secrets
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

__all__ = ["Host", "hosts", "rate_limit"]

REPO = Path(__file__).resolve().parents[2]
#: The interface of every host, inside its namespace.
INTERFACE = "eth0"
_BRIDGE = "br0"
_IP_TIMEOUT = 15.0


@dataclass
class Host:
    """One simulated host: a network namespace with one address on the shared /24."""

    name: str  #: the namespace's name (``ip netns exec NAME ...``)
    address: str  #: its IPv4 address, e.g. ``"10.37.201.1"``
    index: int  #: its position, 0 for the first host
    processes: list[subprocess.Popen[Any]] = field(default_factory=list, repr=False)

    def popen(self, argv: Sequence[str], env: dict[str, str], **kwargs: Any
              ) -> subprocess.Popen[Any]:
        """Start ``argv`` inside this host (``ip netns exec NAME argv...``), in the repository
        root unless ``cwd`` is given; ``kwargs`` go to :class:`subprocess.Popen`. The process
        is killed when the hosts are torn down, if it still runs."""
        kwargs.setdefault("cwd", REPO)
        proc: subprocess.Popen[Any] = subprocess.Popen(
            ["ip", "netns", "exec", self.name, *argv], env=env, **kwargs)
        self.processes.append(proc)
        return proc


def _ip(*args: str) -> None:
    """Run ``ip args...``; a failure raises with ip's message."""
    done = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=_IP_TIMEOUT,
                          check=False)
    if done.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)} failed ({done.returncode}): "
                           f"{done.stderr.strip()}")


def _add_namespace(name: str, made: list[str]) -> None:
    """``ip netns add name``; skips the test when namespaces can't be made here."""
    if os.geteuid() != 0:
        pytest.skip("network namespaces need root (ip netns add)")
    if shutil.which("ip") is None:
        pytest.skip("the ip command (iproute2) is not installed")
    done = subprocess.run(["ip", "netns", "add", name], capture_output=True, text=True,
                          timeout=_IP_TIMEOUT, check=False)
    if done.returncode != 0:
        pytest.skip(f"cannot make a network namespace here (ip netns add: "
                    f"{done.stderr.strip()}); an unprivileged container?")
    made.append(name)
    _ip("-n", name, "link", "set", "lo", "up")


def _build(n: int, tag: str, made: list[str]) -> list[Host]:
    """The switch and ``n`` hosts wired to it; ``made`` lists each namespace once created."""
    subnet = f"10.{random.randrange(256)}.{random.randrange(256)}"
    switch = f"bc{tag}sw"
    _add_namespace(switch, made)
    _ip("-n", switch, "link", "add", _BRIDGE, "type", "bridge")
    _ip("-n", switch, "link", "set", _BRIDGE, "up")
    built = []
    for i in range(n):
        host = Host(f"bc{tag}h{i}", f"{subnet}.{i + 1}", i)
        port = f"p{i}"
        _add_namespace(host.name, made)
        _ip("-n", host.name, "link", "add", INTERFACE, "type", "veth", "peer", "name", port,
            "netns", switch)
        _ip("-n", switch, "link", "set", port, "master", _BRIDGE)
        _ip("-n", switch, "link", "set", port, "up")
        _ip("-n", host.name, "addr", "add", f"{host.address}/24", "dev", INTERFACE)
        _ip("-n", host.name, "link", "set", INTERFACE, "up")
        built.append(host)
    return built


def _kill_inside(name: str) -> None:
    """SIGKILL every process running in namespace ``name`` (all started by these tests),
    until none is left."""
    for _ in range(50):
        listed = subprocess.run(["ip", "netns", "pids", name], capture_output=True, text=True,
                                timeout=_IP_TIMEOUT, check=False)
        pids = [int(p) for p in listed.stdout.split() if p.isdigit()]
        if not pids:
            return
        for pid in pids:
            with suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.05)


def _tear_down(made: list[str], built: list[Host]) -> None:
    """Kill what still runs inside, reap the processes started, delete the namespaces."""
    for name in reversed(made):
        _kill_inside(name)
    for host in built:
        for proc in host.processes:
            if proc.poll() is None:
                proc.kill()
            with suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=10)
    errors = []
    for name in reversed(made):
        done = subprocess.run(["ip", "netns", "del", name], capture_output=True, text=True,
                              timeout=_IP_TIMEOUT, check=False)
        if done.returncode != 0:
            errors.append(f"{name}: {done.stderr.strip()}")
    if errors:
        raise RuntimeError(f"could not delete network namespaces: {'; '.join(errors)}")


@contextmanager
def hosts(n: int) -> Iterator[list[Host]]:
    """``n`` hosts on one switch (see the module), removed with everything in them at exit.

    Skips the test (``pytest.skip``) when not root or ``ip netns add`` fails.
    """
    if n < 1:
        raise ValueError(f"hosts(n={n}): expected at least one host")
    tag = secrets.token_hex(3)
    made: list[str] = []
    built: list[Host] = []
    try:
        built.extend(_build(n, tag, made))
        yield built
    finally:
        _tear_down(made, built)


def rate_limit(host: Host, rate: str = "1gbit") -> None:
    """Cap what ``host`` sends to ``rate`` (tc's units, e.g. ``"1gbit"``) with a token
    bucket filter on its interface."""
    _ip("netns", "exec", host.name, "tc", "qdisc", "add", "dev", INTERFACE, "root", "tbf",
        "rate", rate, "burst", "32kbit", "latency", "50ms")
