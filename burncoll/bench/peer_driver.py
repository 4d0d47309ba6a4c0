"""Starting the peer baselines (``--vs gloo,mpi,tcp,numpy,naive``) and collecting their rows.

Gloo runs as ``world`` Python processes rendezvousing on 127.0.0.1 at a free port; MPI as
``mpirun -n world --oversubscribe --allow-run-as-root python -m burncoll.bench.peers mpi``;
TCP and NumPy run in this process. A baseline whose library is missing, or that fails, yields
a :class:`PeerResult` with ``skipped`` set to a one-line reason: never a traceback.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence

from burncoll.bench.options import parse_names
from burncoll.bench.peers import RESULT_MARKER, naive_threads, numpy_add, tcp_loopback
from burncoll.bench.results import PeerResult, PeerRow
from burncoll.orchestration.launch import free_port

__all__ = ["PEER_NAMES", "parse_peers", "run_peers"]

#: The baselines ``--vs`` accepts, in the order they run.
PEER_NAMES: tuple[str, ...] = ("gloo", "mpi", "tcp", "numpy", "naive")
_INSTALL = "pip install 'burncoll[bench]'"


def parse_peers(text: str) -> tuple[str, ...]:
    """A comma-separated subset of :data:`PEER_NAMES` (or ``"all"``), in their order."""
    chosen = parse_names(text, PEER_NAMES, "--vs")
    return tuple(name for name in PEER_NAMES if name in chosen)


def _worker_args(sizes: Sequence[int], dtype: str, redop: str, iters: int,
                 warmup: int) -> list[str]:
    return ["--sizes", ",".join(str(s) for s in sizes), "--dtype", dtype, "--redop", redop,
            "--iters", str(iters), "--warmup", str(warmup)]


_EXCEPTION = re.compile(r"^(\[rank\d+\]:\s*)?[\w.]*(Error|Exception)\b")


def _last_line(text: str) -> str:
    """The reason a worker failed: its last exception line, else its last line of text."""
    lines = [line.strip() for line in text.splitlines() if line.strip(" -=\t")]
    exceptions = [line for line in lines if _EXCEPTION.match(line)]
    chosen = exceptions[-1] if exceptions else lines[-1] if lines else "no output"
    return chosen[:300]


def _parse_result(output: str) -> dict[str, object]:
    for line in output.splitlines():
        if line.startswith(RESULT_MARKER):
            result: dict[str, object] = json.loads(line[len(RESULT_MARKER) :])
            return result
    raise ValueError("no result line in the worker's output")


def _rows(result: dict[str, object]) -> list[PeerRow]:
    raw = result.get("rows")
    if not isinstance(raw, list):
        raise ValueError("malformed worker result")
    return [PeerRow(**row) for row in raw]


def _gloo(result: PeerResult, world: int, worker_args: list[str], timeout: float) -> None:
    if importlib.util.find_spec("torch") is None:
        result.skipped = f"torch is not installed ({_INSTALL})"
        return
    port = free_port()
    deadline = time.monotonic() + timeout
    with contextlib.ExitStack() as stack:
        # files, not pipes: a rank blocked on a full pipe would stall the others
        logs = [stack.enter_context(tempfile.TemporaryFile("w+")) for _ in range(2 * world)]
        procs = [subprocess.Popen([sys.executable, "-m", "burncoll.bench.peers", "gloo", "--rank",
                                   str(rank), "--world", str(world), "--port", str(port),
                                   *worker_args], stdout=logs[2 * rank], stderr=logs[2 * rank + 1])
                 for rank in range(world)]
        try:
            for proc in procs:
                proc.wait(timeout=max(deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            result.skipped = f"timed out after {timeout:g} s"
            return
        finally:
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
        texts = []
        for log in logs:
            log.seek(0)
            texts.append(log.read())
    for rank, proc in enumerate(procs):
        if proc.returncode:
            error = _last_line(texts[2 * rank + 1])
            result.skipped = f"rank {rank} failed (exit {proc.returncode}): {error}"
            return
    result.rows = _rows(_parse_result(texts[0]))


def _mpi(result: PeerResult, world: int, worker_args: list[str], timeout: float) -> None:
    if importlib.util.find_spec("mpi4py") is None:
        result.skipped = f"mpi4py is not installed ({_INSTALL}; needs an MPI such as OpenMPI)"
        return
    mpirun = shutil.which("mpirun")
    if mpirun is None:
        result.skipped = "mpirun not found (install OpenMPI: apt-get install openmpi-bin)"
        return
    command = [mpirun, "-n", str(world), "--oversubscribe", "--allow-run-as-root", sys.executable,
               "-m", "burncoll.bench.peers", "mpi", *worker_args]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
        result.skipped = f"timed out after {timeout:g} s"
        return
    if done.returncode:
        result.skipped = f"failed (exit {done.returncode}): {_last_line(done.stderr)}"
        return
    parsed = _parse_result(done.stdout)
    result.rows = _rows(parsed)
    result.description += f" [{parsed.get('library', 'MPI')}]"


def run_peers(names: Sequence[str], sizes: Sequence[int], dtype: str, iters: int, warmup: int,
              world: int, redop: str = "sum", timeout: float = 900.0) -> list[PeerResult]:
    """Measure each baseline in ``names`` at ``sizes``; one :class:`PeerResult` each."""
    worker_args = _worker_args(sizes, dtype, redop, iters, warmup)
    results: list[PeerResult] = []
    for name in names:
        result = _describe(name, world)
        try:
            if name in ("gloo", "mpi") and redop == "mean":
                result.skipped = f"redop mean has no {name} equivalent"
            elif name == "gloo":
                _gloo(result, world, worker_args, timeout)
            elif name == "mpi":
                _mpi(result, world, worker_args, timeout)
            elif name == "tcp":
                result.rows = tcp_loopback(sizes, iters, warmup)
            elif name == "naive":
                result.rows = naive_threads(sizes, dtype, iters, warmup, max(world, 2))
            else:
                result.rows = numpy_add(sizes, dtype, iters, warmup)
        except (OSError, ValueError, RuntimeError, TypeError) as exc:
            result.rows = []
            result.skipped = f"failed: {type(exc).__name__}: {exc}"
        results.append(result)
    return results


def _describe(name: str, world: int) -> PeerResult:
    if name == "gloo":
        return PeerResult("gloo", f"torch.distributed all_reduce, backend gloo, {world} "
                          "processes on 127.0.0.1", "all_reduce")
    if name == "mpi":
        return PeerResult("mpi", f"mpi4py Allreduce, mpirun -n {world}", "all_reduce")
    if name == "tcp":
        return PeerResult("tcp", "TCP loopback, one connection, both ends sending and "
                          "receiving size bytes at once; algbw = GB/s each way", None)
    if name == "naive":
        return PeerResult("naive", f"chunked naive all-reduce, {max(world, 2)} threads of one "
                          "process in plain NumPy: each sums its share, barrier, each copies "
                          "the sum", "all_reduce")
    return PeerResult("numpy", "np.add(a, b, out=c) on one thread; algbw = size/time (memory "
                      "traffic is 3x size)", None)
