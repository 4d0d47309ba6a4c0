"""Member node processes around a real orchestrator (in this process), for the security tests.

:class:`Cluster` starts an orchestrator with a token, then ``num_nodes`` member processes
(``secure_worker.py member``, forked from a server that has imported burncoll:
``tests/forked.py``) that loop over checked all-reduces until told to stop. It
collects what they print (JSON lines), what they log (their stderr), and what the
orchestrator and its listener log (the ``burncoll`` loggers of this process).
"""

from __future__ import annotations

import json
import logging
import os
import queue
import subprocess
import tempfile
import threading
import time
from pathlib import Path
from types import TracebackType
from typing import IO, Any

import burncoll
from tests import forked

WORKER = Path(__file__).with_name("secure_worker.py")
REPO = Path(__file__).resolve().parents[2]
TOKEN = "the members' token"


def child_env(timeout: float) -> dict[str, str]:
    """The environment of a child: no BURNCOLL_* settings leak in from this one."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("BURNCOLL_")}
    env.update(TEST_TIMEOUT=str(timeout), PYTHONPATH=str(REPO))
    env["BURNCOLL_SHARED_MEMORY"] = "0"  # the attacks are on the network (see conftest.py)
    return env


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(f"{record.name} {record.levelname} {record.getMessage()}")


class Cluster:
    """An orchestrator and ``num_nodes`` looping member processes; a context manager."""

    def __init__(
        self, transport: str, num_nodes: int = 2, timeout: float = 10.0, corruption: str = ""
    ) -> None:
        self.transport = transport
        self.num_nodes = num_nodes
        self.timeout = timeout
        self._dir = tempfile.TemporaryDirectory(prefix="burncoll-security-")
        self.stopfile = Path(self._dir.name) / "stop"
        #: What burncoll logs in this process: the orchestrator and its transport's listener.
        self.orchestrator_log = _Records()
        self._logger = logging.getLogger("burncoll")
        self._saved_level = self._logger.level
        self._logger.addHandler(self.orchestrator_log)
        self._logger.setLevel(logging.INFO)
        self.orchestrator = burncoll.start_orchestrator(transport=transport, auth_token=TOKEN)
        self._events: queue.Queue[dict[str, Any]] = queue.Queue()
        self.events: list[dict[str, Any]] = []
        self._stderr: list[IO[str]] = []
        self.procs: list[forked.Forked] = []
        self._readers: list[threading.Thread] = []
        for node in range(num_nodes):
            err = open(Path(self._dir.name) / f"node{node}.err", "w+")  # noqa: SIM115
            self._stderr.append(err)
            args = [
                "member",
                str(node),
                str(num_nodes),
                self.orchestrator.address,
                transport,
                TOKEN,
                str(self.stopfile),
            ]
            if corruption:
                args.append(corruption)
            # a real process, forked from one that has imported burncoll (tests/forked.py)
            proc = forked.start(
                WORKER, *args, stdout=forked.PIPE, stderr=err, env=child_env(timeout))
            self.procs.append(proc)
            reader = threading.Thread(target=self._read, args=(proc,), daemon=True)
            reader.start()
            self._readers.append(reader)

    def _read(self, proc: forked.Forked) -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            if line.startswith("{"):
                self._events.put(json.loads(line))

    def wait_for(self, event: str, count: int, within: float) -> list[dict[str, Any]]:
        """Wait until ``count`` records of ``event`` were printed; return them all."""
        deadline = time.monotonic() + within
        while len(self.of(event)) < count:
            try:
                self.events.append(self._events.get(timeout=max(deadline - time.monotonic(), 0.01)))
            except queue.Empty:
                raise AssertionError(
                    f"only {len(self.of(event))} of {count} {event!r} records within "
                    f"{within} s; printed: {self.events}; logged: {self.node_logs()}"
                ) from None
        return self.of(event)

    def of(self, event: str) -> list[dict[str, Any]]:
        return [e for e in self.events if e.get("event") == event]

    def ports(self) -> dict[int, int]:
        """Each member's data port, once all have registered."""
        ready = self.wait_for("ready", self.num_nodes, self.timeout + 10)
        return {int(e["node"]): int(e["port"]) for e in ready}

    def finish(self, within: float = 30.0) -> list[dict[str, Any]]:
        """Tell the members to stop, wait for them, and return their ``done`` records."""
        self.stopfile.touch()
        done = self.wait_for("done", self.num_nodes, within)
        for proc in self.procs:
            proc.wait(timeout=within)
        return sorted(done, key=lambda r: int(r["node"]))

    def node_logs(self, node: int | None = None) -> str:
        """What member ``node`` (every member when ``None``) wrote on stderr so far."""
        texts = []
        for index, err in enumerate(self._stderr):
            if node is None or index == node:
                err.flush()
                texts.append(Path(err.name).read_text())
        return "\n".join(texts)

    def close(self) -> None:
        self.stopfile.touch()
        for proc in self.procs:
            try:
                proc.wait(timeout=self.timeout + 10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for reader, proc in zip(self._readers, self.procs, strict=True):
            reader.join(5.0)  # it reads to the end of the output of an ended process
            if proc.stdout is not None:
                proc.stdout.close()
        self.orchestrator.close()
        self._logger.removeHandler(self.orchestrator_log)
        self._logger.setLevel(self._saved_level)
        for err in self._stderr:
            err.close()
        self._dir.cleanup()

    def __enter__(self) -> Cluster:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
