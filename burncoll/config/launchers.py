"""Which launcher started this process: ``burncoll launch``, torchrun, SLURM, Open MPI or MPICH.

:func:`detect_launcher` reads the rank and job size each launcher exports, so that burncoll
never runs as a silent world of one under a launcher; each launched process is one node.
Launchers are tried in the order of :data:`LAUNCHERS`, the first whose marker is set winning
(``BURNCOLL_*`` beat torchrun's, torchrun's beat SLURM's, mpirun inside SLURM beats SLURM:
:func:`_mpi_inside_slurm`). SLURM counts processes only inside an srun step. Variables that
don't add up raise :class:`~burncoll.ConfigError` naming them; ``""``, ``none``, ``null`` are
unset. Every value is bounded before work that grows with it (another tool may have assembled
the environment): numbers have at most :data:`MAX_DIGITS` digits, host names at most
:data:`MAX_HOST_NAME` characters, of a host list only the first host is made, and values
quoted in messages are shortened (:func:`~burncoll.hostlists.shown`). The orchestrator's
address (``127.0.0.1`` when the whole job is on this host): torchrun
``MASTER_ADDR:(MASTER_PORT + 1)`` (its agent holds ``MASTER_PORT``); SLURM ``MASTER_ADDR`` or
the step's first host; MPI ``MASTER_ADDR`` or (Open MPI) mpirun's host.
The port, where no ``MASTER_PORT`` gives it, is derived from the job id (:func:`derived_port`,
as jax does).
"""

from __future__ import annotations

import os
import re
import zlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import NoReturn

from burncoll.errors import ConfigError
from burncoll.hostlists import (
    MAX_DIGITS,
    MAX_HOST_NAME,
    MAX_HOSTS,
    expand_hostlist,
    first_host,
    shown,
)

__all__ = ["LAUNCHERS", "MAX_DIGITS", "MAX_HOSTS", "MAX_HOST_NAME", "LaunchEnvironment",
           "derived_port", "detect_launcher", "expand_hostlist"]

#: The launchers :func:`detect_launcher` knows, in the order it tries them.
LAUNCHERS: tuple[str, ...] = ("burncoll", "torchrun", "slurm", "openmpi", "mpich")

_PORT_BASE = 61440
_PORT_SPAN = 4096
_BLANK = ("", "none", "null")


@dataclass(frozen=True)
class LaunchEnvironment:
    """What the launcher told this process: its place in the job and the rendezvous address."""

    launcher: str  #: one of :data:`LAUNCHERS`
    node_rank: int  #: this process's node rank (each launched process is one node)
    num_nodes: int  #: processes in the job
    local_rank: int  #: rank among the processes on this host
    local_world_size: int  #: processes on this host (1 when the launcher doesn't say)
    #: ``"host:port"`` of burncoll's rendezvous; ``None`` only for ``"burncoll"`` without
    #: ``BURNCOLL_GLOBAL_ADDRESS``
    rendezvous: str | None
    variables: tuple[str, ...]  #: names of the (set) variables it read, for messages

    @property
    def all_on_one_host(self) -> bool:
        """Whether every process of the job runs on this host."""
        return self.local_world_size == self.num_nodes


class _Vars:
    """One launcher's variables: reads them, remembers which were set, explains bad values."""

    def __init__(self, launcher: str, environ: Mapping[str, str]) -> None:
        self.launcher = launcher
        self.environ = environ
        self.read: list[str] = []

    def text(self, name: str) -> str | None:
        value = self.environ.get(name, "")
        if value.strip().lower() in _BLANK:
            return None
        if name not in self.read:
            self.read.append(name)
        return value.strip()

    def number(self, name: str, minimum: int = 0) -> int | None:
        raw = self.text(name)
        if raw is None:
            return None
        digits = raw[1:] if raw[0] in "+-" else raw  # one sign at most
        if not (digits.isascii() and digits.isdigit()) or len(digits) > MAX_DIGITS:
            self.fail(f"{name}={shown(raw)} is not an integer of at most {MAX_DIGITS} digits; "
                      "fix it or unset it")
        value = int(raw)
        if value < minimum:
            self.fail(f"{name}={value} (must be at least {minimum})")
        return value

    def host(self, name: str) -> str | None:
        """A host name or address, at most :data:`MAX_HOST_NAME` characters."""
        text = self.text(name)
        self.check(text is None or len(text) <= MAX_HOST_NAME, f"{name}={shown(text or '')} "
                   f"is longer than {MAX_HOST_NAME} characters, so it names no host; fix it")
        return text

    def need(self, name: str, minimum: int = 0) -> int:
        value = self.number(name, minimum)
        if value is None:
            given = ", ".join(f"{n}={self.environ[n].strip()[:40]}" for n in self.read)
            self.fail(f"{given} set but {name} is not (the launcher sets them together: "
                      f"set {name} too, or unset the others)")
        return value

    def fail(self, detail: str) -> NoReturn:
        raise ConfigError(f"{self.launcher} variables don't add up: {detail}")

    def check(self, ok: bool, detail: str) -> None:
        if not ok:
            self.fail(detail)

    def world(self, rank_name: str, size_name: str) -> tuple[int, int]:
        """(rank, size) from a required pair; the rank must be below the size."""
        self.number(size_name, 1)  # read first, so a missing rank's message names the size
        rank, size = self.need(rank_name), self.need(size_name, 1)
        self.check(rank < size, f"{rank_name}={rank} but {size_name}={size} "
                                f"({rank_name} must be below {size_name})")
        return rank, size

    def local(self, rank_name: str, size_name: str, world: tuple[str, int]) -> tuple[int, int]:
        """(local rank, local size); (0, 1) when neither is set, an error when half is."""
        rank, size = self.number(rank_name), self.number(size_name, 1)
        if size is None:
            self.check(not rank, f"{rank_name}={rank} but {size_name} is not set "
                                 f"(set {size_name} to the processes on this host)")
            return 0, 1
        if rank is None:
            self.fail(f"{size_name}={size} but {rank_name} is not set (set {rank_name} too, "
                      f"or unset {size_name})")
        self.check(rank < size, f"{rank_name}={rank} but {size_name}={size} "
                                f"({rank_name} must be below {size_name})")
        self.check(size <= world[1], f"{size_name}={size} but {world[0]}={world[1]} "
                                     f"(a host can't run more processes than the job has)")
        return rank, size

    def next_port(self) -> int | None:
        """``MASTER_PORT + 1`` (the launcher's own store holds ``MASTER_PORT``), or None."""
        port = self.number("MASTER_PORT")
        if port is None:
            return None
        self.check(0 < port < 65535, f"MASTER_PORT={port}: burncoll's rendezvous takes "
                   "MASTER_PORT + 1, so MASTER_PORT must be 1..65534; pick another MASTER_PORT "
                   "or set BURNCOLL_GLOBAL_ADDRESS='host:port'")
        return port + 1

    def job_port(self, *names: str) -> int:
        """``MASTER_PORT + 1``, else a port derived from the first job id variable set."""
        port = self.next_port()
        if port is not None:
            return port
        for name in names:
            key = self.text(name)
            if key is not None:
                return derived_port(key)
        self.fail(f"none of MASTER_PORT, {', '.join(names)} is set, so there is no port for "
                  "burncoll's rendezvous; set MASTER_PORT (burncoll uses MASTER_PORT + 1) or "
                  "BURNCOLL_GLOBAL_ADDRESS='host:port'")

    def done(self, rank: int, size: int, local: tuple[int, int],
             host: str | None, port: int | None) -> LaunchEnvironment:
        if size > 1 and local[1] == size:
            host = "127.0.0.1"  # every process on this host: loopback, whatever the name says
        if host is not None and ":" in host and not host.startswith("["):
            host = f"[{host}]"  # an IPv6 address
        rendezvous = None if host is None or port is None else f"{host}:{port}"
        return LaunchEnvironment(self.launcher, rank, size, local[0], local[1], rendezvous,
                                 tuple(self.read))


def derived_port(key: str) -> int:
    """A port in 61440..65535 from a job id, the same on every process of the job. An integer id
    gives ``id % 4096 + 61440`` (as jax does for SLURM); other text gives ``crc32(text) % 4096 +
    61440``."""
    text = key.strip()
    if text.isascii() and text.isdigit() and len(text) < 4000:  # int() takes up to 4300
        return int(text) % _PORT_SPAN + _PORT_BASE
    return zlib.crc32(text.encode("utf-8", "surrogatepass")) % _PORT_SPAN + _PORT_BASE


def _tasks_on_node(v: _Vars, name: str, text: str, node: int) -> int:
    """Tasks on node ``node`` from SLURM's ``"2(x3),1"`` (2 tasks on each of 3 nodes, then 1)."""
    seen = 0
    for item in text.split(","):
        match = re.fullmatch(rf"\s*(\d{{1,{MAX_DIGITS}}})\s*(?:\(x(\d{{1,{MAX_DIGITS}}})\))?\s*",
                             item)
        if match is None:
            v.fail(f"{name}={shown(text)} is not a tasks-per-node list like '2(x3),1' (numbers "
                   f"of at most {MAX_DIGITS} digits)")
        seen += int(match.group(2) or 1)
        if node < seen:
            return int(match.group(1))
    v.fail(f"{name}={shown(text)} lists {seen} nodes but SLURM_NODEID={node}")


def _burncoll(v: _Vars) -> LaunchEnvironment:
    rank, size = v.number("BURNCOLL_NODE_RANK") or 0, v.number("BURNCOLL_NUM_NODES", 1) or 1
    v.check(rank < size, f"BURNCOLL_NODE_RANK={rank} but BURNCOLL_NUM_NODES={size} "
                         "(BURNCOLL_NODE_RANK must be below BURNCOLL_NUM_NODES)")
    address = v.text("BURNCOLL_GLOBAL_ADDRESS")
    return LaunchEnvironment("burncoll", rank, size, rank, size, address, tuple(v.read))


def _torchrun(v: _Vars) -> LaunchEnvironment:
    v.text("TORCHELASTIC_RUN_ID")
    rank, size = v.world("RANK", "WORLD_SIZE")
    local = v.local("LOCAL_RANK", "LOCAL_WORLD_SIZE", ("WORLD_SIZE", size))
    v.check(local[0] <= rank, f"LOCAL_RANK={local[0]} but RANK={rank} "
                              "(a local rank can't exceed the global one)")
    group = v.number("GROUP_RANK")
    v.check(group is None or group <= rank - local[0],
            f"GROUP_RANK={group} but RANK={rank} and LOCAL_RANK={local[0]} (each lower group "
            "runs at least one process, so GROUP_RANK must be at most RANK - LOCAL_RANK)")
    host = v.host("MASTER_ADDR")
    v.check(host is not None, "MASTER_ADDR is not set; set it to the host of rank 0 (or set "
                              "BURNCOLL_GLOBAL_ADDRESS='host:port')")
    port = v.next_port()
    v.check(port is not None, "MASTER_PORT is not set; set it (burncoll's rendezvous uses "
                              "MASTER_PORT + 1) or set BURNCOLL_GLOBAL_ADDRESS='host:port'")
    return v.done(rank, size, local, host, port)


def _slurm(v: _Vars) -> LaunchEnvironment:
    tasks_name = "SLURM_STEP_NUM_TASKS"  # srun sets it for the tasks of a step
    nodes_name = "SLURM_STEP_NUM_NODES" if v.text("SLURM_STEP_NUM_NODES") else "SLURM_NNODES"
    node, nodes = v.number("SLURM_NODEID") or 0, v.number(nodes_name, 1)
    v.check(nodes is None or node < nodes, f"SLURM_NODEID={node} but {nodes_name}={nodes} "
                                           "(SLURM_NODEID must be below the node count)")
    if v.text(tasks_name) is None:
        # the batch script itself (no srun): one process, whatever --ntasks reserved for the
        # steps it may start; burncoll then runs on this one node
        rank = v.need("SLURM_PROCID")
        v.check(rank == 0, f"SLURM_PROCID={rank} but SLURM_STEP_NUM_TASKS is not set (srun "
                           "sets both: start the tasks with srun)")
        size, local = 1, (0, 1)
    else:
        rank, size = v.world("SLURM_PROCID", tasks_name)
        local = _slurm_local(v, node, (tasks_name, size))
    host = v.host("MASTER_ADDR") or _first_slurm_host(v)
    return v.done(rank, size, local, host, v.job_port("SLURM_JOB_ID"))


def _slurm_local(v: _Vars, node: int, world: tuple[str, int]) -> tuple[int, int]:
    """(SLURM_LOCALID, tasks on this node from the step's or job's tasks-per-node list)."""
    local_rank = v.number("SLURM_LOCALID") or 0
    name = next((n for n in ("SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE")
                 if v.text(n)), None)
    if name is None:  # the launcher doesn't say: count this process alone
        v.check(local_rank == 0, f"SLURM_LOCALID={local_rank} but neither "
                "SLURM_STEP_TASKS_PER_NODE nor SLURM_TASKS_PER_NODE is set (set one)")
        return 0, 1
    per_node = v.text(name) or ""
    local_size = _tasks_on_node(v, name, per_node, node)
    v.check(local_rank < local_size, f"SLURM_LOCALID={local_rank} but {name}={shown(per_node)}"
            f" puts {local_size} tasks on node SLURM_NODEID={node} (SLURM_LOCALID must be "
            "below that)")
    v.check(local_size <= world[1], f"{name}={shown(per_node)} puts {local_size} tasks on "
            f"node SLURM_NODEID={node} but {world[0]}={world[1]}")
    return local_rank, local_size


def _first_slurm_host(v: _Vars) -> str:
    for name in ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST"):
        text = v.text(name)
        if text is not None:
            try:
                host = first_host(text)  # the rest is never expanded
            except ConfigError as exc:
                v.fail(f"{name}={shown(text)} is not a SLURM host list ({exc})")
            if host:
                return host
    v.fail("neither MASTER_ADDR nor SLURM_STEP_NODELIST / SLURM_JOB_NODELIST names a host "
           "for burncoll's rendezvous; set MASTER_ADDR or BURNCOLL_GLOBAL_ADDRESS='host:port'")


def _hnp_host(uri: str | None) -> str | None:
    """mpirun's host from ``OMPI_MCA_orte_hnp_uri`` (``'jobid.0;tcp://IP[,IP]:PORT;...'``)."""
    for part in (uri or "").split(";"):
        if part.startswith("tcp://"):
            address = part[len("tcp://"):].rpartition(":")[0].split(",")[0].strip()
            if address:
                return address
    return None


#: Open MPI's and MPICH's (rank, size, local rank, local size) variables, then job id ones.
_MPI: dict[str, tuple[tuple[str, str, str, str], tuple[str, ...]]] = {
    "openmpi": (("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
                 "OMPI_COMM_WORLD_LOCAL_SIZE"), ("OMPI_MCA_ess_base_jobid", "PMIX_NAMESPACE")),
    "mpich": (("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"),
              ("PMI_KVSNAME", "PMIX_NAMESPACE")),
}


def _mpi(v: _Vars) -> LaunchEnvironment:
    """Open MPI and MPICH (hydra): the rendezvous host is MASTER_ADDR, this host when every
    process is here, or (Open MPI) mpirun's host."""
    names, job_ids = _MPI[v.launcher]
    rank, size = v.world(names[0], names[1])
    local = v.local(names[2], names[3], (names[1], size))
    host = v.host("MASTER_ADDR") or ("127.0.0.1" if local[1] == size else None)
    if host is None and v.launcher == "openmpi":
        host = _hnp_host(v.text("OMPI_MCA_orte_hnp_uri"))
        v.check(host is None or len(host) <= MAX_HOST_NAME, f"OMPI_MCA_orte_hnp_uri names "
                f"mpirun's host {shown(host or '')}, longer than {MAX_HOST_NAME} characters")
    v.check(host is not None, f"{names[1]}={size} processes are not all on this host "
            f"({names[3]}={local[1] if v.text(names[3]) else 'unset'}) and nothing names the "
            "rendezvous host; set MASTER_ADDR to the host of rank 0 (burncoll uses "
            "MASTER_PORT + 1) or BURNCOLL_GLOBAL_ADDRESS='host:port'")
    return v.done(rank, size, local, host, v.job_port(*job_ids))


#: Each launcher's reader and its markers: it is detected when all names of a group are set.
_READERS: dict[str, tuple[Callable[[_Vars], LaunchEnvironment], tuple[tuple[str, ...], ...]]] = {
    "burncoll": (_burncoll, (("BURNCOLL_NUM_NODES",), ("BURNCOLL_NODE_RANK",))),
    "torchrun": (_torchrun, (("RANK", "WORLD_SIZE"), ("TORCHELASTIC_RUN_ID",))),
    "slurm": (_slurm, (("SLURM_PROCID",),)),
    "openmpi": (_mpi, (("OMPI_COMM_WORLD_RANK",), ("OMPI_COMM_WORLD_SIZE",))),
    "mpich": (_mpi, (("PMI_RANK",), ("PMI_SIZE",))),
}


def _is_set(environ: Mapping[str, str], name: str) -> bool:
    return environ.get(name, "").strip().lower() not in _BLANK


def _mpi_inside_slurm(env: Mapping[str, str], slurm: LaunchEnvironment) -> str | None:
    """An MPI launcher that ran inside a SLURM allocation, whose variables every rank
    inherits. Decided on what is the same on every rank, so all ranks agree: Open MPI's
    ``OMPI_COMM_WORLD_*`` come from mpirun only, so mpirun started the ranks; ``PMI_SIZE``
    equal to the srun step's task count means srun started them itself (``--mpi=pmi2``), so
    SLURM's variables describe them; any other ``PMI_SIZE`` means mpiexec started them."""
    if any(_is_set(env, name) for name in _MPI["openmpi"][0][:2]):
        return "openmpi"
    size = env.get("PMI_SIZE", "").strip()
    if size and size != str(slurm.num_nodes):
        return "mpich"
    return None


def detect_launcher(environ: Mapping[str, str] | None = None) -> LaunchEnvironment | None:
    """The launcher that started this process and what it says, or None when there is none.
    ``environ`` defaults to ``os.environ``. Raises :class:`~burncoll.ConfigError` naming the
    variables when they don't add up, or when only half of torchrun's ``RANK`` / ``WORLD_SIZE`` pair
    is set and no other launcher is found."""
    env = os.environ if environ is None else environ
    for launcher in LAUNCHERS:
        read, markers = _READERS[launcher]
        if any(all(_is_set(env, n) for n in group) for group in markers):
            found = read(_Vars(launcher, env))
            inner = _mpi_inside_slurm(env, found) if launcher == "slurm" else None
            return found if inner is None else _READERS[inner][0](_Vars(inner, env))
    half = [f"{n}={env[n].strip()[:40]}" for n in ("RANK", "WORLD_SIZE") if _is_set(env, n)]
    if half:
        missing = "WORLD_SIZE" if half[0].startswith("RANK=") else "RANK"
        raise ConfigError(f"torchrun variables don't add up: {half[0]} is set but {missing} is "
                          f"not (torchrun sets both); set {missing} too, or unset "
                          f"{half[0].partition('=')[0]} to run without a launcher")
    return None
