"""Live collectives under attack: child processes, and the memory of the process attacked.

:class:`LiveCollective` starts (optionally) an orchestrator and ``num_nodes`` member nodes,
each in a process of its own, so that the memory of every one can be measured alone
(:class:`RssMonitor` reads ``VmRSS`` from ``/proc/<pid>/status``). Each member runs
``devices`` peer threads that loop over all-reduces of float64 arrays and check every result
*exactly* against a NumPy float64 reference, until told to stop (a stop file). Every process
runs with the soft open-file limit most machines have (1024, :data:`NOFILE`).

This file is also the children's program::

    python victims.py orchestrator OPTIONS_JSON
    python victims.py member OPTIONS_JSON

The token travels in the environment (:data:`TOKEN_ENV`), never on the command line. Children
print JSON lines on stdout::

    {"event": "ready", "role": "orchestrator", "pid": p, "address": "host:port", "port": n}
    {"event": "ready", "role": "member", "node": n, "device": d, "pid": p, "port": data_port}
    {"event": "progress", "node": n, "k": ops_done, "at": wall_time}     (node 0, device 0)
    {"event": "done", "node": n, "device": d, "ok": bool, "iterations": k, "wrong": w,
     "first_wrong": str, "error": type, "cause": type, "message": str, "slowest": s, "at": t}
    {"event": "failed", "role": ..., "error": type, "message": str}     (could not start)

A result that differs from the reference in any element counts as *wrong* (``wrong``), and
the member carries on, so that a test sees every wrong result, not only the first.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import resource
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import IO, Any

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:  # run as a script: import burncoll and tests from the checkout
    sys.path.insert(0, str(REPO))

import numpy as np  # noqa: E402

#: The members' token (>= 16 bytes); children read it from :data:`TOKEN_ENV`.
TOKEN = "the members' token, 32 bytes ok"
TOKEN_ENV = "VICTIMS_TEST_TOKEN"
#: Where the victims listen and legitimate nodes connect from.
HOST = "127.0.0.1"
#: The soft open-file limit of every victim process (the common default).
NOFILE = 1024
#: Members stop on their own after this long, whatever the test does.
MAX_SECONDS = 300.0
#: Node 0, device 0 prints a progress record every this many operations.
PROGRESS_EVERY = 5
_THIS = Path(__file__).resolve()


# -- memory ---------------------------------------------------------------------------------


def rss_bytes(pid: int) -> int:
    """The resident set size of process ``pid`` (``VmRSS``), in bytes; 0 once it is gone."""
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return 0
    for line in text.splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


class RssMonitor:
    """Samples the RSS of ``pid`` every ``interval`` seconds in a thread; a context manager.

    ``alarm``: set (a :class:`threading.Event`) once the RSS exceeds ``baseline + limit``
    after :meth:`arm` -- attacks stop sending then, so that a failing test does not take the
    machine's memory with it.
    """

    def __init__(self, pid: int, interval: float = 0.02) -> None:
        self.pid = pid
        self.interval = interval
        self.samples: list[tuple[float, int]] = []
        self.alarm = threading.Event()
        self._ceiling: int | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            rss = rss_bytes(self.pid)
            self.samples.append((time.monotonic(), rss))
            ceiling = self._ceiling
            if ceiling is not None and rss > ceiling:
                self.alarm.set()
            self._stop.wait(self.interval)

    def max_between(self, start: float, end: float) -> int:
        values = [rss for t, rss in list(self.samples) if start <= t <= end and rss]
        return max(values) if values else 0

    def arm(self, baseline: int, limit: int) -> None:
        """Raise :attr:`alarm` once the RSS exceeds ``baseline + limit``."""
        self.alarm.clear()
        self._ceiling = baseline + limit

    def disarm(self) -> None:
        self._ceiling = None

    def close(self) -> None:
        self._stop.set()
        self._thread.join(2.0)

    def __enter__(self) -> RssMonitor:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# -- ports ------------------------------------------------------------------------------------


def free_port(kind: int = socket.SOCK_STREAM) -> int:
    """A port free on :data:`HOST` now (TCP or UDP), for a listener told to use it."""
    with socket.socket(socket.AF_INET, kind) as sock:
        sock.bind((HOST, 0))
        return int(sock.getsockname()[1])


# -- the harness (in the test process) ---------------------------------------------------------


@dataclass
class Settings:
    """One live collective. ``config``: extra ``CollectiveConfig`` fields (``integrity``,
    ``tls``, ``insecure``) for members and orchestrator alike; ``token`` ``None``: none."""

    transport: str = "websocket"
    num_nodes: int = 2
    devices: int = 1
    elements: int = 50_000
    timeout: float = 10.0
    token: str | None = TOKEN
    config: dict[str, Any] = field(default_factory=dict)
    #: Start an orchestrator (a child); ``False``: join the one at ``orchestrator_address``.
    orchestrator: bool = True
    orchestrator_address: str = ""
    #: Peer ids start here (a second collective on the same orchestrator needs other ids).
    peer_base: int = 0
    #: Start the members (``False``: the orchestrator alone).
    members: bool = True
    #: Per node: extra member options (``data_port``, ``advertise_port``).
    node_options: dict[int, dict[str, Any]] = field(default_factory=dict)
    #: Fork the children from the preloaded server of ``tests/forked.py`` instead of starting
    #: fresh interpreters: for the collectives whose memory nothing measures (the allocator
    #: settings of :func:`child_env` only apply to a fresh interpreter).
    fork: bool = False


def child_env(token: str | None) -> dict[str, str]:
    """A child's environment: no BURNCOLL_* settings leak in; the token in :data:`TOKEN_ENV`."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("BURNCOLL_")}
    env.pop(TOKEN_ENV, None)
    env["PYTHONPATH"] = str(REPO)
    env["MALLOC_ARENA_MAX"] = "2"  # fewer per-thread arenas: steadier RSS figures
    env["BURNCOLL_SHARED_MEMORY"] = "0"  # the attacks are on the network (see conftest.py)
    if token is not None:
        env[TOKEN_ENV] = token
    return env


def _limit_files() -> None:
    _soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(NOFILE, hard), hard))


class LiveCollective:
    """An orchestrator process (unless joining another) and ``num_nodes`` member processes
    looping over checked all-reduces; a context manager. See the module docstring."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self._dir = tempfile.TemporaryDirectory(prefix="burncoll-attack-")
        self.stopfile = Path(self._dir.name) / "stop"
        self._events: queue.Queue[dict[str, Any]] = queue.Queue()
        self.events: list[dict[str, Any]] = []
        self.procs: list[Any] = []  # subprocess.Popen, or tests.forked.Forked
        self._stderr: list[IO[str]] = []
        self._readers: list[threading.Thread] = []
        self.orchestrator_pid = 0
        self.orchestrator_port = 0
        self.orchestrator_address = settings.orchestrator_address
        try:
            if settings.orchestrator:
                self._start_orchestrator()
            for node in range(settings.num_nodes if settings.members else 0):
                options = {
                    "node": node,
                    "num_nodes": settings.num_nodes,
                    "devices": settings.devices,
                    "elements": settings.elements,
                    "orchestrator": self.orchestrator_address,
                    "transport": settings.transport,
                    "timeout": settings.timeout,
                    "config": settings.config,
                    "peer_base": settings.peer_base,
                    "stopfile": str(self.stopfile),
                    **settings.node_options.get(node, {}),
                }
                self._spawn("member", options, f"node{node}")
        except BaseException:
            self.close()
            raise

    def _spawn(self, role: str, options: dict[str, Any], name: str) -> Any:
        err = open(Path(self._dir.name) / f"{name}.err", "w+")  # noqa: SIM115
        self._stderr.append(err)
        proc: Any
        if self.settings.fork:
            from tests import forked  # (the children import this file too)

            proc = forked.start(_THIS, role, json.dumps(options), stdout=forked.PIPE,
                                stderr=err, env=child_env(self.settings.token))
        else:
            proc = subprocess.Popen(
                [sys.executable, str(_THIS), role, json.dumps(options)],
                stdout=subprocess.PIPE,
                stderr=err,
                text=True,
                env=child_env(self.settings.token),
                preexec_fn=_limit_files,
            )
        self.procs.append(proc)
        reader = threading.Thread(target=self._read, args=(proc,), daemon=True)
        reader.start()
        self._readers.append(reader)
        return proc

    def _start_orchestrator(self) -> None:
        options = {
            "transport": self.settings.transport,
            "timeout": self.settings.timeout,
            "config": self.settings.config,
            "stopfile": str(self.stopfile),
        }
        self._spawn("orchestrator", options, "orchestrator")
        ready = self.wait_for("ready", 1, 30.0, role="orchestrator")[0]
        self.orchestrator_pid = int(ready["pid"])
        self.orchestrator_port = int(ready["port"])
        self.orchestrator_address = str(ready["address"])

    def _read(self, proc: Any) -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            if line.startswith("{"):
                self._events.put(json.loads(line))

    def _drain(self, within: float) -> bool:
        try:
            self.events.append(self._events.get(timeout=max(within, 0.001)))
        except queue.Empty:
            return False
        while True:
            try:
                self.events.append(self._events.get_nowait())
            except queue.Empty:
                return True

    def of(self, event: str, **match: Any) -> list[dict[str, Any]]:
        return [
            e for e in self.events
            if e.get("event") == event and all(e.get(k) == v for k, v in match.items())
        ]

    def wait_for(self, event: str, count: int, within: float, **match: Any
                 ) -> list[dict[str, Any]]:
        """Wait until ``count`` records of ``event`` (with the ``match`` fields) were printed."""
        deadline = time.monotonic() + within
        while len(self.of(event, **match)) < count:
            failed = self.of("failed")
            if failed:
                raise AssertionError(f"a victim could not start: {failed}; {self.logs()[-3000:]}")
            exited = all(p.poll() is not None for p in self.procs)
            if not self._drain(min(deadline - time.monotonic(), 0.2)) and (
                    time.monotonic() >= deadline or (exited and self._events.empty())):
                raise AssertionError(
                    f"only {len(self.of(event, **match))} of {count} {event!r} records within "
                    f"{within} s; printed: {self.events[-20:]}; logged: {self.logs()[-3000:]}")
        return self.of(event, **match)

    def ready(self) -> dict[int, dict[str, Any]]:
        """Each member node's ready record (device 0), once every peer registered."""
        count = self.settings.num_nodes * self.settings.devices
        records = self.wait_for("ready", count, self.settings.timeout + 20, role="member")
        return {int(r["node"]): r for r in records if r["device"] == 0}

    def progress(self) -> int:
        """Operations node 0 finished so far (as last reported)."""
        self._drain(0.0)
        marks = self.of("progress")
        return int(marks[-1]["k"]) if marks else 0

    def wait_progress(self, ops: int, within: float) -> int:
        deadline = time.monotonic() + within
        while self.progress() < ops and time.monotonic() < deadline:
            self._drain(0.1)
        return self.progress()

    def finish(self, within: float = 30.0) -> list[dict[str, Any]]:
        """Tell the members to stop; their ``done`` records (every device), node order."""
        self.stopfile.touch()
        count = self.settings.num_nodes * self.settings.devices
        done = self.wait_for("done", count, within)
        return sorted(done, key=lambda r: (int(r["node"]), int(r["device"])))

    def logs(self) -> str:
        texts = []
        for err in self._stderr:
            with contextlib.suppress(ValueError, OSError):
                err.flush()
                texts.append(f"== {Path(err.name).name}\n{Path(err.name).read_text()}")
        return "\n".join(texts)

    def close(self) -> None:
        self.stopfile.touch()
        for proc in self.procs:
            try:
                proc.wait(timeout=self.settings.timeout + 10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for reader, proc in zip(self._readers, self.procs, strict=True):
            reader.join(5.0)
            if proc.stdout is not None:
                proc.stdout.close()
        for err in self._stderr:
            err.close()
        self._dir.cleanup()

    def __enter__(self) -> LiveCollective:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()


def summarize(done: list[dict[str, Any]]) -> dict[str, Any]:
    """What the members' ``done`` records add up to, for assertions and the benchmark."""
    return {
        "ok": all(r.get("ok") for r in done),
        "wrong": sum(int(r.get("wrong", 0)) for r in done),
        "iterations": min((int(r.get("iterations", 0)) for r in done), default=0),
        "errors": sorted({str(r.get("error")) for r in done if not r.get("ok")}),
        "slowest": max((float(r.get("slowest", 0.0)) for r in done), default=0.0),
    }


# -- one measured attack -----------------------------------------------------------------------

MiB = 1 << 20
KiB = 1 << 10


@dataclass
class Measured:
    """One attack on one process of a live collective: the attack's own report, the attacked
    process's RSS (``baseline``: the most in the second before; ``peak``: the most from the
    attack's start to ``settle`` seconds after its end; ``after``: at the end of that), and the
    operations node 0 finished during the attack."""

    report: Any
    baseline: int
    peak: int
    after: int
    ops_before: int
    ops_during: int
    bound: int

    @property
    def growth(self) -> int:
        return max(self.peak - self.baseline, 0)

    def describe(self) -> str:
        return (f"{self.report.describe()}; victim RSS {self.baseline / MiB:.0f} -> peak "
                f"{self.peak / MiB:.0f} MiB (+{self.growth / MiB:.1f} MiB, bound "
                f"{self.bound / MiB:.1f} MiB), {self.after / MiB:.0f} MiB after; "
                f"{self.ops_during} legitimate all-reduces during the attack")


def measure(live: LiveCollective, pid: int, attack: Callable[[threading.Event], Any],
            bound: int, *, settle: float = 0.5, baseline_window: float = 1.0) -> Measured:
    """Run ``attack(alarm)`` (blocking; it returns its report) against process ``pid`` of
    ``live`` and measure. ``alarm`` is set once the victim's RSS passes the baseline plus
    ``max(4 * bound, 256 MiB)``: the attack must then stop, so a failing test stays bounded."""
    with RssMonitor(pid) as monitor:
        time.sleep(baseline_window)
        started = time.monotonic()
        baseline = monitor.max_between(started - baseline_window, started)
        monitor.arm(baseline, max(4 * bound, 256 * MiB))
        ops_before = live.progress()
        report = attack(monitor.alarm)
        time.sleep(settle)
        ended = time.monotonic()
        peak = monitor.max_between(started, ended)
        ops_during = live.progress() - ops_before
    return Measured(report, baseline, peak, rss_bytes(pid), ops_before, ops_during, bound)


# -- the children ------------------------------------------------------------------------------

_emit_lock = threading.Lock()


def emit(record: dict[str, Any]) -> None:
    with _emit_lock:
        print(json.dumps(record), flush=True)


def _token() -> str | None:
    return os.environ.get(TOKEN_ENV)


def run_orchestrator(options: dict[str, Any]) -> None:
    import burncoll

    try:
        orch = burncoll.start_orchestrator(
            HOST, 0, options["transport"], _token(), timeout=float(options["timeout"]),
            **options.get("config", {}),
        )
    except Exception as exc:  # reported to the test, which names it
        emit({"event": "failed", "role": "orchestrator", "error": type(exc).__name__,
              "message": str(exc)})
        return
    emit({"event": "ready", "role": "orchestrator", "pid": os.getpid(),
          "address": orch.address, "port": orch.port})
    stopfile = Path(options["stopfile"])
    started = time.monotonic()
    try:
        while not stopfile.exists() and time.monotonic() - started < MAX_SECONDS:
            time.sleep(0.05)
        time.sleep(1.0)  # members call finish() after the stop: let them
    finally:
        orch.close()


def inputs(k: int, elements: int) -> np.ndarray:
    """The shared part of operation ``k``'s inputs: integers (exact in float64)."""
    rng = np.random.default_rng(k)
    return rng.integers(-(1 << 20), 1 << 20, elements).astype(np.float64)


def _advertise(port: int) -> None:
    """Test double for the network path: tell the orchestrator that this node's data service
    is at ``port`` (a relay's), not where it listens."""
    import dataclasses

    from burncoll.node.orchestrator_client import OrchestratorClient
    from burncoll.protocol.control import Join

    join = OrchestratorClient.join

    async def advertised(self: OrchestratorClient, message: Join, deadline: float) -> None:
        await join(self, dataclasses.replace(message, port=port), deadline)

    OrchestratorClient.join = advertised  # type: ignore[method-assign]


def _config(options: dict[str, Any]) -> Any:
    import burncoll

    return burncoll.CollectiveConfig(
        num_devices=int(options["devices"]),
        num_nodes=int(options["num_nodes"]),
        global_address=options["orchestrator"],
        node_address=HOST,
        data_service_port=int(options.get("data_port", 0)),
        transport=options["transport"],
        timeout=float(options["timeout"]),
        auth_token=_token(),
        **options.get("config", {}),
    )


def _peer(options: dict[str, Any], device: int, config: Any) -> None:
    """One device's thread: register, then loop over checked all-reduces until the stop."""
    import burncoll

    node, devices = int(options["node"]), int(options["devices"])
    world = int(options["num_nodes"]) * devices
    base = int(options.get("peer_base", 0))
    peer = base + node * devices + device
    peer_sum = float(sum(range(base, base + world)))
    elements = int(options["elements"])
    stopfile = Path(options["stopfile"])
    record: dict[str, Any] = {"event": "done", "node": node, "device": device, "wrong": 0,
                              "first_wrong": "", "slowest": 0.0}
    k = 0
    started = time.monotonic()
    comm: Any = None
    try:
        comm = burncoll.register(peer, device, config)
        emit({"event": "ready", "role": "member", "node": node, "device": device,
              "pid": os.getpid(), "port": comm._server.link._service.port})
        while True:
            stop = stopfile.exists() or time.monotonic() - started > MAX_SECONDS
            shared = inputs(k, elements)
            x = np.empty(elements + 1)
            x[:-1] = shared + peer
            x[-1] = 1.0 if stop else 0.0
            began = time.monotonic()
            result = comm.all_reduce(x)
            record["slowest"] = max(record["slowest"], time.monotonic() - began)
            reference = shared * world + peer_sum  # NumPy float64, exact for these integers
            flag = float(result[-1]) if result.shape == x.shape else -1.0
            if result.shape != x.shape or not np.array_equal(result[:-1], reference) or (
                    flag not in [float(i) for i in range(world + 1)]):
                record["wrong"] += 1
                if not record["first_wrong"]:
                    bad = int(np.argmax(result[:-1] != reference)) if (
                        result.shape == x.shape) else -1
                    record["first_wrong"] = (f"all-reduce {k}: element {bad} is "
                                             f"{result.ravel()[bad]!r}, not {reference[bad]!r}")
            k += 1
            if node == 0 and device == 0 and k % PROGRESS_EVERY == 0:
                emit({"event": "progress", "node": node, "k": k, "at": time.time()})
            if flag > 0 or (flag < 0 and stop):
                break
        record["ok"] = record["wrong"] == 0
        comm.finish()
    except burncoll.CollectiveError as exc:
        cause = exc.__cause__
        record.update(ok=False, error=type(exc).__name__, message=str(exc)[:2000],
                      cause=type(cause).__name__ if cause is not None else None)
    except Exception as exc:  # outside the CollectiveError tree: a finding, reported as such
        record.update(ok=False, error=f"uncaught {type(exc).__name__}", message=str(exc)[:2000],
                      cause=None)
    record.update(iterations=k, at=time.time())
    emit(record)
    if comm is not None and not record.get("ok"):
        with contextlib.suppress(burncoll.CollectiveError):
            comm.finish()


def run_member(options: dict[str, Any]) -> None:
    if "advertise_port" in options:
        _advertise(int(options["advertise_port"]))
    try:
        config = _config(options)
    except Exception as exc:  # a config this burncoll does not accept: the test names it
        emit({"event": "failed", "role": "member", "error": type(exc).__name__,
              "message": str(exc)})
        return
    threads = [threading.Thread(target=_peer, args=(options, d, config))
               for d in range(int(options["devices"]))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def main() -> None:
    import logging

    logging.basicConfig(level=logging.WARNING, stream=sys.stderr,
                        format="%(name)s %(levelname)s %(message)s")
    _limit_files()  # (a spawned child has it already; a forked one gets it here)
    role, options = sys.argv[1], json.loads(sys.argv[2])
    if role == "orchestrator":
        run_orchestrator(options)
    elif role == "member":
        run_member(options)
    else:
        raise SystemExit(f"unknown role {role!r}")


if __name__ == "__main__":
    main()
