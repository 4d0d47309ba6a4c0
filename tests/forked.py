"""Node processes for the multi-process tests, forked from a server that imported burncoll once.

``subprocess.Popen([sys.executable, "worker.py", ...])`` costs every node process an
interpreter start and burncoll's import: about 2 s of CPU (most of it the array libraries'
extension modules), which the node-process tests used to pay hundreds of times. :func:`start`
runs the same script in a real, separate child process instead, forked from a small server
(this file run as a script, one per test process) that has imported :data:`PRELOAD` and
started no thread. The child has its own pid, memory, sockets, threads and event loops, as
before; its standard streams, environment, working directory, ``sys.argv`` and ``sys.path``
are those the spawned process would have had; the script runs as ``__main__``; its end is the
interpreter's (non-daemon threads joined, ``atexit`` handlers run, ``SystemExit`` codes kept,
a signal that kills it reported as ``-N``). burncoll reads its ``BURNCOLL_*`` variables when a
config is made, never when it is imported, so the preloaded import sees nothing a fresh one
would not.

What differs from a spawned interpreter: ``/proc/<pid>/cmdline`` and the parent pid are the
server's, so the tests of command lines, launchers and process trees keep spawning theirs.
"""

from __future__ import annotations

import atexit
import contextlib
import io
import json
import os
import runpy
import select
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import IO, Any

#: What the server imports before it forks anything.
PRELOAD = ["numpy", "burncoll", "burncoll.transport.tcp", "burncoll.transport.websocket",
           "burncoll.transport.quic", "ml_dtypes"]
PIPE = subprocess.PIPE
STDOUT = subprocess.STDOUT
_REPO = Path(__file__).resolve().parents[1]
_MAX_REQUEST = 1 << 20

# -- the server (this file run as a script) ---------------------------------------------------


def _text(fd: int, mode: str) -> IO[str]:
    raw = io.FileIO(fd, mode, closefd=False)
    if mode == "r":
        return io.TextIOWrapper(io.BufferedReader(raw), encoding="utf-8")
    return io.TextIOWrapper(io.BufferedWriter(raw), encoding="utf-8", errors="backslashreplace",
                            line_buffering=True, write_through=True)


def _become(request: dict[str, Any], fds: list[int], base_path: list[str]) -> int:
    """In the forked child: become ``python script *args`` and run it; its exit code."""
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
    for fd in set(fds):
        if fd > 2:
            os.close(fd)
    sys.stdin, sys.stdout, sys.stderr = _text(0, "r"), _text(1, "w"), _text(2, "w")
    env: dict[str, str] = request["env"]
    os.environ.clear()
    os.environ.update(env)
    os.chdir(request["cwd"])
    script = request["script"]
    sys.argv = [script, *request["args"]]
    extra = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    sys.path[:] = [str(Path(script).resolve().parent), *extra, *base_path]
    code: Any = 0
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as exc:
        code = exc.code
    except BaseException:
        traceback.print_exc()
        code = 1
    # the interpreter's exit: wait for the non-daemon threads, then the atexit handlers
    for thread in threading.enumerate():
        if thread is not threading.current_thread() and not thread.daemon:
            thread.join()
    atexit._run_exitfuncs()
    if code is not None and not isinstance(code, int):
        print(code, file=sys.stderr)
        code = 1
    with contextlib.suppress(OSError, ValueError):
        sys.stdout.flush()
        sys.stderr.flush()
    return int(code or 0)


def _serve(control: socket.socket) -> None:
    """Fork a child per request; tell each request's status socket the pid, then the exit
    code (``-N`` for signal N). Ends when the test process closes ``control``."""
    base_path = list(sys.path)
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    status: dict[int, socket.socket] = {}
    poller = select.poll()  # (the control socket keeps its number: it may be past 1024)
    poller.register(control, select.POLLIN)
    poller.register(wake_r, select.POLLIN)
    while True:
        ready = {fd for fd, _ in poller.poll()}
        if wake_r in ready:
            os.read(wake_r, 4096)
            while True:
                try:
                    pid, sts = os.waitpid(-1, os.WNOHANG)
                except ChildProcessError:
                    break
                if pid == 0:
                    break
                sock = status.pop(pid, None)
                if sock is not None:
                    with contextlib.suppress(OSError):
                        sock.sendall(f"{os.waitstatus_to_exitcode(sts)}\n".encode())
                    sock.close()
        if control.fileno() in ready:
            data, fds, _, _ = socket.recv_fds(control, _MAX_REQUEST, 5)
            if not data:
                return
            request = json.loads(data)
            reply = socket.socket(fileno=fds[3])
            pid = os.fork()
            if pid == 0:
                code = 1
                try:
                    signal.set_wakeup_fd(-1)
                    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                    os.close(wake_r)
                    os.close(wake_w)
                    for sock in (control, reply, *status.values()):
                        sock.close()
                    code = _become(request, fds[:3], base_path)
                finally:
                    os._exit(code)
            for fd in fds[:3]:
                os.close(fd)
            reply.sendall(f"{pid}\n".encode())
            status[pid] = reply


# -- the test process's side ------------------------------------------------------------------

_server_lock = threading.Lock()
_server: tuple[subprocess.Popen[bytes], socket.socket] | None = None


def _control() -> socket.socket:
    """The control socket of this process's server, started on first use."""
    global _server
    with _server_lock:
        if _server is None or _server[0].poll() is not None:
            mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            path = os.environ.get("PYTHONPATH", "")
            env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(_REPO), path])))
            proc = subprocess.Popen([sys.executable, __file__, str(theirs.fileno())],
                                    pass_fds=[theirs.fileno()], env=env, cwd=_REPO,
                                    stdin=subprocess.DEVNULL)
            theirs.close()
            _server = (proc, mine)
            atexit.register(mine.close)
        return _server[1]


def _read_line(sock: socket.socket, timeout: float | None) -> str | None:
    """One ``\\n``-ended line from ``sock`` (None when nothing came within ``timeout``)."""
    data = b""
    deadline = None if timeout is None else time.monotonic() + timeout
    poller = select.poll()  # (not select.select: this process may hold over 1024 files)
    poller.register(sock, select.POLLIN)
    while not data.endswith(b"\n"):
        left = None if deadline is None else max(deadline - time.monotonic(), 0.0)
        if not poller.poll(None if left is None else left * 1000):
            if data:
                continue
            return None
        chunk = sock.recv(64)
        if not chunk:
            raise RuntimeError("the fork server went away")
        data += chunk
    return data.decode().strip()


class Forked:
    """What :func:`start` returns: the parts of a text-mode :class:`subprocess.Popen` that the
    harnesses use."""

    def __init__(self, script: str | Path, args: list[str], *, env: dict[str, str] | None,
                 cwd: str | Path | None, stdin: Any, stdout: Any, stderr: Any) -> None:
        self.args = [sys.executable, str(script), *args]
        self.returncode: int | None = None
        self.stdin: IO[str] | None = None
        self.stdout: IO[str] | None = None
        self.stderr: IO[str] | None = None
        theirs: list[int] = []  # the child's ends of what is made here: closed once it has them
        fds: list[int] = []
        for index, spec in enumerate((stdin, stdout, stderr)):
            if spec is PIPE:
                read, write = os.pipe()
                mine, child = (write, read) if index == 0 else (read, write)
                stream = open(mine, "w" if index == 0 else "r", encoding="utf-8")  # noqa: SIM115
                setattr(self, ("stdin", "stdout", "stderr")[index], stream)
                theirs.append(child)
                fds.append(child)
            elif spec is None and index == 0:
                theirs.append(os.open(os.devnull, os.O_RDONLY))
                fds.append(theirs[-1])
            elif spec is None:
                fds.append(index)  # this process's own, as a spawned process inherits it
            elif spec is STDOUT and index == 2:
                fds.append(fds[1])
            else:
                fds.append(spec if isinstance(spec, int) else spec.fileno())
        self._status, reply = socket.socketpair()
        request = {"script": os.path.abspath(script), "args": [str(a) for a in args],
                   "env": dict(os.environ if env is None else env),
                   "cwd": str(cwd or os.getcwd())}
        try:
            control = _control()
            with _server_lock:
                socket.send_fds(control, [json.dumps(request).encode()], [*fds, reply.fileno()])
        finally:
            reply.close()
            for fd in theirs:
                os.close(fd)
        pid = _read_line(self._status, 60.0)
        if pid is None:
            raise RuntimeError(f"the fork server did not start {script}")
        self.pid = int(pid)

    def poll(self) -> int | None:
        if self.returncode is None:
            code = _read_line(self._status, 0.0)
            if code is not None:
                self.returncode = int(code)
                self._status.close()
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            code = _read_line(self._status, timeout)
            if code is None:
                raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
            self.returncode = int(code)
            self._status.close()
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def communicate(self, timeout: float | None = None) -> tuple[str, str]:
        """Read stdout and stderr to their ends, then wait for the exit (as Popen's)."""
        out: dict[str, str] = {}
        readers = [threading.Thread(target=lambda n=name, s=stream: out.__setitem__(n, s.read()),
                                    daemon=True)
                   for name, stream in (("out", self.stdout), ("err", self.stderr)) if stream]
        for reader in readers:
            reader.start()
        deadline = None if timeout is None else time.monotonic() + timeout
        for reader in readers:
            reader.join(None if deadline is None else max(deadline - time.monotonic(), 0.0))
            if reader.is_alive():
                raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
        self.wait(None if deadline is None else max(deadline - time.monotonic(), 0.0))
        for stream in (self.stdout, self.stderr):
            if stream:
                stream.close()
        return out.get("out", ""), out.get("err", "")


def start(script: str | Path, *args: str, env: dict[str, str] | None = None,
          cwd: str | Path | None = None, stdin: Any = None, stdout: Any = None,
          stderr: Any = None) -> Forked:
    """``subprocess.Popen([sys.executable, script, *args], text=True, ...)``, forked from
    this process's preloaded server (see the module docstring). ``stdin``: ``PIPE`` or
    ``None`` (``/dev/null``); ``stdout``, ``stderr``: ``PIPE``, ``None`` (this process's),
    ``STDOUT`` (stderr only) or a file (object or descriptor)."""
    return Forked(script, list(args), env=env, cwd=cwd, stdin=stdin, stdout=stdout,
                  stderr=stderr)


if __name__ == "__main__":
    sys.path.pop(0)  # this file's directory: the children's sys.path starts without it
    for name in PRELOAD:
        __import__(name)
    _serve(socket.socket(fileno=int(sys.argv[1])))
