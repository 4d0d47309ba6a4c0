"""The test side of the fault-injection suite: real node processes around a real orchestrator.

:class:`Cluster` starts ``worker.py`` processes (one per node, forked from a server that has
imported burncoll: ``tests/forked.py``) with a JSON spec, follows the events they print, can
SIGKILL them or feed them commands, and collects every peer's record.
The orchestrator runs in this process (:func:`burncoll.start_orchestrator`) or, when a test
must kill it, in a child process (``python -m burncoll.cli orchestrator``).
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import burncoll
from tests import forked

WORKER = Path(__file__).with_name("worker.py")
REPO = Path(__file__).resolve().parents[2]
#: (the faults are the network's: nodes of this host stay on it, not on shared memory)
ENV = dict(os.environ, PYTHONPATH=str(REPO), PYTHONUNBUFFERED="1", BURNCOLL_SHARED_MEMORY="0")


def free_port() -> int:
    """A port free for both TCP and UDP on 127.0.0.1 (WebSocket listens on one, QUIC the
    other)."""
    for _ in range(50):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as tcp:
            tcp.bind(("127.0.0.1", 0))
            port = int(tcp.getsockname()[1])
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as udp:
                try:
                    udp.bind(("127.0.0.1", port))
                except OSError:
                    continue
                return port
    raise RuntimeError("no free port")


class NodeProcess:
    """One ``worker.py`` process and what it printed."""

    def __init__(self, spec: dict[str, Any]) -> None:
        self.spec = spec
        # a real process, forked from one that has imported burncoll (tests/forked.py)
        self.proc = forked.start(
            WORKER,
            json.dumps(spec),
            stdin=forked.PIPE,
            stdout=forked.PIPE,
            stderr=forked.PIPE,
            # the frame faults are a test double around the member connections: the small
            # operations' frames must travel there, not on the caller sockets (whose own
            # hostile messages tests/security/test_hostile_lanes.py sends)
            env=dict(ENV, BURNCOLL_CALLER_SOCKETS="0") if spec.get("frames") else
            dict(ENV, BURNCOLL_SHARED_MEMORY="1") if spec.get("host_memory") else ENV,
        )
        self.events: queue.Queue[dict[str, Any]] = queue.Queue()
        self.records: list[dict[str, Any]] = []
        self.seen: list[dict[str, Any]] = []
        self.stderr = ""
        self._out = threading.Thread(target=self._read_stdout, daemon=True)
        self._err = threading.Thread(target=self._read_stderr, daemon=True)
        self._out.start()
        self._err.start()

    def _read_stdout(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if not line.startswith("{"):
                continue
            item = json.loads(line)
            if "event" in item:
                self.seen.append(item)
                self.events.put(item)
            else:
                self.records.append(item)

    def _read_stderr(self) -> None:
        assert self.proc.stderr is not None
        self.stderr = self.proc.stderr.read()

    def wait_event(self, name: str, timeout: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while True:
            try:
                item = self.events.get(timeout=max(deadline - time.monotonic(), 0.01))
            except queue.Empty:
                raise AssertionError(
                    f"node {self.spec['node']} never reported {name!r}: {self.stderr[-2000:]}"
                ) from None
            if item["event"] == name:
                return item

    def event(self, name: str) -> dict[str, Any] | None:
        return next((e for e in self.seen if e["event"] == name), None)

    def send(self, line: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def wait(self, timeout: float) -> int:
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise AssertionError(
                f"node {self.spec['node']} hung (killed after {timeout:.0f} s); it had printed "
                f"{self.records + self.seen}; stderr: {self.stderr[-3000:]}"
            ) from None
        self._out.join(5)
        self._err.join(5)
        return code

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            self.proc.kill()


class Cluster:
    """``nodes`` worker processes sharing one spec (``node`` filled in per process)."""

    def __init__(
        self,
        address: str,
        nodes: int,
        devices: int = 2,
        *,
        transport: str = "websocket",
        timeout: float = 3.0,
        local: str = "tree",
        global_: str = "ring",
        gate: threading.Barrier | None = None,
        **spec: Any,
    ) -> None:
        self.spec: dict[str, Any] = dict(
            address=address,
            nodes=nodes,
            devices=devices,
            transport=transport,
            timeout=timeout,
            local=local,
            **{"global": global_},
            **spec,
        )
        self.procs = [NodeProcess(dict(self.spec, node=n)) for n in range(nodes)]
        self.start(self.procs, gate)

    @staticmethod
    def start(procs: list[NodeProcess], gate: threading.Barrier | None = None) -> None:
        """Let ``procs`` register once every one of them has started Python and imported
        burncoll (and, with a ``gate``, once the clusters started beside this one have too),
        so that the registration deadline measures registration alone."""
        for p in procs:
            p.wait_event("ready", 120)
        if gate is not None:
            gate.wait(120)
        for p in procs:
            p.send("start")

    def replace(self, node: int, **changes: Any) -> NodeProcess:
        """Start a new process for ``node`` (after the old one died)."""
        proc = NodeProcess(dict(self.spec, node=node, **changes))
        self.procs.append(proc)
        self.start([proc])
        return proc

    def collect(self, timeout: float | None = None) -> list[dict[str, Any]]:
        """Wait for every process; every peer record (of the processes that printed one)."""
        limit = timeout if timeout is not None else self.spec["timeout"] * 6 + 20
        deadline = time.monotonic() + limit
        for p in self.procs:
            code = p.wait(max(deadline - time.monotonic(), 1.0))
            if code not in (0, -signal.SIGKILL):
                raise AssertionError(f"node exited {code}: {p.stderr[-3000:]}")
        return [r for p in self.procs for r in p.records]

    def close(self) -> None:
        for p in self.procs:
            p.kill()

    def __enter__(self) -> Cluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@contextlib.contextmanager
def orchestrator(transport: str) -> Iterator[str]:
    """An orchestrator in this process; yields its address."""
    with burncoll.start_orchestrator(transport=transport) as orch:
        yield orch.address


class OrchestratorProcess:
    """``burncoll orchestrator`` in a child process, so that a test can SIGKILL it."""

    def __init__(self, transport: str, port: int | None = None) -> None:
        self.port = port or free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "burncoll.cli",
                "orchestrator",
                "--port",
                str(self.port),
                "--transport",
                transport,
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=ENV,
        )

    def wait_listening(self, timeout: float = 20.0) -> None:
        assert self.proc.stdout is not None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if "listening" in line:
                return
            if not line and self.proc.poll() is not None:
                break
        raise AssertionError("the orchestrator did not start")

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)

    def __enter__(self) -> OrchestratorProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.kill()
