"""Peer baselines measured beside burncoll (``--vs gloo,mpi,tcp,numpy,naive``): the workers,
how they are started, and their rows; also the ``python -m`` entry point of one worker.

:func:`run_peers` measures each baseline: Gloo as ``world`` Python processes rendezvousing on
127.0.0.1 at a free port; MPI as ``mpirun -n world --oversubscribe --allow-run-as-root python
-m burncoll.bench.peers mpi``; TCP, NumPy and the naive threads in this process. A baseline
whose library is missing, or that fails, yields a :class:`PeerResult` with ``skipped`` set to
a one-line reason: never a traceback.

``python -m burncoll.bench.peers {gloo,mpi,tcp,numpy,naive} --sizes 8,1024 [--rank R --world N
--port P]`` runs one worker; rank 0 prints one ``BURNCOLL_PEER_RESULT <json>`` line. Every
worker times like burncoll's runner (a barrier before each iteration, the slowest
participant's time, the median over iterations). ``gloo``: ``torch.distributed.all_reduce``
in place; ``mpi``: mpi4py's ``Allreduce(send, recv)``; ``tcp``: both ends of one loopback
connection sending ``size`` bytes at once (GB/s each way); ``numpy``: ``np.add(a, b,
out=c)``, the kernel alone; ``naive``: ``world`` threads each summing a share of every input
into one shared sum, a barrier, each copying the sum out.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import numpy as np

from burncoll.bench.check import peer_input
from burncoll.bench.options import parse_names
from burncoll.bench.results import PeerResult, PeerRow, busbw_factor, median
from burncoll.dtypes import dtype_from_name
from burncoll.orchestration.launch import free_port

__all__ = ["PEER_NAMES", "RESULT_MARKER", "gloo_worker", "main", "mpi_worker", "naive_threads",
           "numpy_add", "parse_peers", "run_peers", "tcp_loopback"]


#: Prefix of the line that carries a worker's JSON result on stdout.
RESULT_MARKER = "BURNCOLL_PEER_RESULT "

_REDOPS = ("sum", "max", "min", "prod")
#: Seconds a loopback transfer or barrier may block before the TCP baseline gives up.
_TCP_TIMEOUT = 120.0


def _row(requested: int, count: int, itemsize: int, seconds: float, factor: float) -> PeerRow:
    size = count * itemsize
    algbw = size / seconds / 1e9 if seconds > 0 else 0.0
    return PeerRow(requested, size, count, seconds * 1e6, algbw, algbw * factor)


def _counts(sizes: Sequence[int], itemsize: int) -> list[tuple[int, int]]:
    """``(requested, count)`` for each size holding at least one element."""
    return [(size, size // itemsize) for size in sizes if size // itemsize > 0]


def gloo_worker(rank: int, world: int, port: int, sizes: Sequence[int], dtype: str, iters: int,
                warmup: int, redop: str = "sum") -> list[PeerRow]:
    """Time Gloo's all-reduce as rank ``rank`` of ``world``; rows are meaningful on rank 0."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)  # one process per device, as burncoll's one thread per device
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=timedelta(seconds=300))
    op = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN,
          "prod": dist.ReduceOp.PRODUCT}[redop]
    itemsize = dtype_from_name(dtype).itemsize
    rows: list[PeerRow] = []
    try:
        for requested, count in _counts(sizes, itemsize):
            source = torch.from_numpy(peer_input(rank, count, "float64")).to(getattr(torch, dtype))
            buffer = source.clone()
            times = []
            for i in range(warmup + iters):
                buffer.copy_(source)
                dist.barrier()
                start = time.perf_counter()
                dist.all_reduce(buffer, op=op)
                if i >= warmup:
                    times.append(time.perf_counter() - start)
            slowest = torch.tensor(times, dtype=torch.float64)
            dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
            seconds = median([float(t) for t in slowest.tolist()])
            rows.append(_row(requested, count, itemsize, seconds,
                             busbw_factor("all_reduce", world)))
    finally:
        dist.destroy_process_group()
    return rows


def mpi_worker(sizes: Sequence[int], dtype: str, iters: int, warmup: int, redop: str = "sum"
               ) -> tuple[int, list[PeerRow], str]:
    """Time MPI ``Allreduce`` in this ``mpirun`` job: ``(rank, rows, MPI library version)``."""
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    rank, world = comm.Get_rank(), comm.Get_size()
    op = {"sum": MPI.SUM, "max": MPI.MAX, "min": MPI.MIN, "prod": MPI.PROD}[redop]
    itemsize = dtype_from_name(dtype).itemsize
    rows: list[PeerRow] = []
    for requested, count in _counts(sizes, itemsize):
        send = peer_input(rank, count, dtype)
        recv = np.empty_like(send)
        times = np.empty(iters, dtype=np.float64)
        for i in range(warmup + iters):
            comm.Barrier()
            start = time.perf_counter()
            comm.Allreduce(send, recv, op=op)
            if i >= warmup:
                times[i - warmup] = time.perf_counter() - start
        slowest = np.empty_like(times)
        comm.Allreduce(times, slowest, op=MPI.MAX)
        seconds = median([float(t) for t in slowest])
        rows.append(_row(requested, count, itemsize, seconds, busbw_factor("all_reduce", world)))
    version = MPI.Get_library_version().replace("\0", "").strip().split(",")[0]
    return rank, rows, version


def tcp_loopback(sizes: Sequence[int], iters: int, warmup: int) -> list[PeerRow]:
    """Both ends of one loopback TCP connection send and receive ``size`` bytes at once. Four
    threads (each end's sender and receiver) meet at a barrier before each iteration; the
    iteration's time is the slowest thread's. ``algbw`` is GB/s in each direction."""
    with socket.create_server(("127.0.0.1", 0)) as listener:
        left = socket.create_connection(listener.getsockname()[:2])
        right, _ = listener.accept()
    ends = (left, right)
    for end in ends:
        end.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        end.settimeout(_TCP_TIMEOUT)  # a failed thread must not leave the others blocked
    rounds = warmup + iters
    transfer = _LoopbackTransfer(sizes, rounds)
    try:
        transfer.run([(transfer.send, left), (transfer.receive, left),
                      (transfer.send, right), (transfer.receive, right)])
    finally:
        for end in ends:
            end.close()
    rows = []
    for k, size in enumerate(sizes):
        window = slice(k * rounds + warmup, (k + 1) * rounds)
        columns = (t[window] for t in transfer.times)
        slowest = [max(column) for column in zip(*columns, strict=True)]
        rows.append(_row(size, size, 1, median(slowest), 1.0))
    return rows


_Worker = Callable[[socket.socket, list[float]], None]


class _LoopbackTransfer:
    """The four threads of :func:`tcp_loopback`, meeting at a barrier before each round."""

    def __init__(self, sizes: Sequence[int], rounds: int) -> None:
        self.sizes = sizes
        self.rounds = rounds
        self.barrier = threading.Barrier(4, timeout=_TCP_TIMEOUT)
        self.times: list[list[float]] = [[] for _ in range(4)]
        self.errors: list[BaseException] = []

    def send(self, end: socket.socket, out: list[float]) -> None:
        for size in self.sizes:
            payload = memoryview(bytearray(size))
            for _ in range(self.rounds):
                self.barrier.wait()
                start = time.perf_counter()
                end.sendall(payload)
                out.append(time.perf_counter() - start)

    def receive(self, end: socket.socket, out: list[float]) -> None:
        for size in self.sizes:
            view = memoryview(bytearray(size))
            for _ in range(self.rounds):
                self.barrier.wait()
                start = time.perf_counter()
                got = 0
                while got < size:
                    n = end.recv_into(view[got:])
                    if n == 0:
                        raise ConnectionError("loopback connection closed")
                    got += n
                out.append(time.perf_counter() - start)

    def run(self, workers: list[tuple[_Worker, socket.socket]]) -> None:
        """Run each ``(worker, end)`` on its own thread; raise the first failure."""
        threads = [threading.Thread(target=self._guarded, args=(fn, end, self.times[i]),
                                    daemon=True) for i, (fn, end) in enumerate(workers)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        if self.errors:
            raise RuntimeError(f"loopback transfer failed: {self.errors[0]!r}")

    def _guarded(self, fn: _Worker, end: socket.socket, out: list[float]) -> None:
        try:
            fn(end, out)
        except (OSError, threading.BrokenBarrierError) as exc:
            self.errors.append(exc)
            self.barrier.abort()  # release the other threads at once


def numpy_add(sizes: Sequence[int], dtype: str, iters: int, warmup: int) -> list[PeerRow]:
    """``np.add(a, b, out=c)`` on ``size``-byte arrays, one thread; ``algbw = size / time``."""
    itemsize = dtype_from_name(dtype).itemsize
    rows = []
    for requested, count in _counts(sizes, itemsize):
        a, b = peer_input(0, count, dtype), peer_input(1, count, dtype)
        c = np.empty_like(a)
        times = []
        with np.errstate(over="ignore"):
            for i in range(warmup + iters):
                start = time.perf_counter()
                np.add(a, b, out=c)
                if i >= warmup:
                    times.append(time.perf_counter() - start)
        rows.append(_row(requested, count, itemsize, median(times), 1.0))
    return rows


def naive_threads(sizes: Sequence[int], dtype: str, iters: int, warmup: int,
                  world: int) -> list[PeerRow]:
    """The chunked naive all-reduce of ``world`` threads (see the module docstring); the
    iteration's time is the slowest thread's, after a barrier."""
    itemsize = dtype_from_name(dtype).itemsize
    return [
        _row(requested, count, itemsize, _naive_seconds(count, dtype, iters, warmup, world),
             busbw_factor("all_reduce", world))
        for requested, count in _counts(sizes, itemsize)
    ]


def _naive_seconds(count: int, dtype: str, iters: int, warmup: int, world: int) -> float:
    inputs = [peer_input(r, count, dtype) for r in range(world)]
    outputs = [np.empty_like(x) for x in inputs]
    total = np.empty_like(inputs[0])
    start_line, summed = threading.Barrier(world), threading.Barrier(world)
    times: list[list[float]] = [[] for _ in range(world)]

    def thread(r: int) -> None:
        a, b = count * r // world, count * (r + 1) // world
        for _ in range(warmup + iters):
            start_line.wait()
            start = time.perf_counter()
            np.add(inputs[0][a:b], inputs[1][a:b], out=total[a:b])
            for x in inputs[2:]:
                np.add(total[a:b], x[a:b], out=total[a:b])
            summed.wait()
            np.copyto(outputs[r], total)
            times[r].append(time.perf_counter() - start)

    threads = [threading.Thread(target=thread, args=(r,), daemon=True) for r in range(world)]
    with np.errstate(over="ignore"):
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    return float(median([max(column) for column in zip(*times, strict=True)][warmup:]))


def _emit(rows: list[PeerRow], extra: dict[str, Any] | None = None) -> None:
    document = {"rows": [row.to_dict() for row in rows], **(extra or {})}
    print(RESULT_MARKER + json.dumps(document), flush=True)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m burncoll.bench.peers",
                                     description="Run one peer-baseline worker.")
    parser.add_argument("peer", choices=("gloo", "mpi", "tcp", "numpy", "naive"))
    parser.add_argument("--sizes", required=True, help="comma-separated sizes in bytes")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--redop", default="sum", choices=_REDOPS)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--rank", type=int, default=0, help="gloo: this process's rank")
    parser.add_argument("--world", type=int, default=1, help="gloo: number of processes")
    parser.add_argument("--port", type=int, default=0, help="gloo: rendezvous port")
    args = parser.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",") if s]
    if args.peer == "gloo":
        rows = gloo_worker(args.rank, args.world, args.port, sizes, args.dtype, args.iters,
                           args.warmup, args.redop)
        if args.rank == 0:
            _emit(rows)
    elif args.peer == "mpi":
        rank, rows, version = mpi_worker(sizes, args.dtype, args.iters, args.warmup, args.redop)
        if rank == 0:
            _emit(rows, {"library": version})
    elif args.peer == "tcp":
        _emit(tcp_loopback(sizes, args.iters, args.warmup))
    elif args.peer == "naive":
        _emit(naive_threads(sizes, args.dtype, args.iters, args.warmup, max(args.world, 2)))
    else:
        _emit(numpy_add(sizes, args.dtype, args.iters, args.warmup))
    return 0


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


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
