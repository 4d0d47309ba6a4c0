"""The files behind host memory (:mod:`burncoll.node.host_memory`): sealed anonymous files,
which host can share them, and how a receiver opens the one it was offered.

A host file is an anonymous ``memfd`` *sealed* at its size (``F_SEAL_SHRINK | F_SEAL_GROW |
F_SEAL_SEAL``): nobody, its creator included, can shrink it under a reader's mapping (a read
of pages a file lost is ``SIGBUS``, which kills the reader) or change its seals. Its sender
offers it as ``pid/fd/token``; the receiver finds it through ``/proc`` with ``O_PATH`` (no
device or FIFO is ever opened on an offer's word) and maps it only if it is the offered file:
named ``memfd:burncoll-<token>``, a regular file on the kernel's own memfd filesystem (not a
huge-page one, whose faults can fail), of this user, of the offered size, sealed, and openable
without waiting (a lease would make the open block).

A mapping keeps no descriptor: Python's ``mmap`` (before 3.13's ``trackfd``) keeps a duplicate
of each file's, which made host memory one descriptor per node process of the host (issue 32:
264 per node at 64 of them). The files are mapped with the C library's ``mmap`` instead
(:func:`_map`) and handed out as a ``memoryview`` of bytes, unmapped when the last view of the
pages is gone -- never under a view still in use.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import functools
import hashlib
import mmap
import os
import stat
import weakref
from pathlib import Path

import numpy as np

from burncoll.errors import ProtocolError

__all__ = ["close_host_file", "host_identity", "map_offered", "new_host_file", "sealed_file"]

#: A host file's seals (0 where the platform has none: then no host shares memory).
SEALS: int = (getattr(fcntl, "F_SEAL_SHRINK", 0) | getattr(fcntl, "F_SEAL_GROW", 0)
              | getattr(fcntl, "F_SEAL_SEAL", 0))


@functools.cache
def host_identity() -> str:
    """What two processes share exactly when they can share a host file: the kernel's boot id,
    the network and process namespaces, and the user (``""`` where any is unknown, or where
    this process cannot make a sealed file and find it again through ``/proc``)."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        net = os.stat("/proc/self/ns/net").st_ino
        pids = os.stat("/proc/self/ns/pid").st_ino
        _probe()
    except (OSError, AttributeError):
        return ""
    text = f"{boot}:{net}:{pids}:{os.getuid()}"
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def _probe() -> None:
    """Make a tiny sealed file and find it as a receiver would (``OSError`` if that fails)."""
    if not SEALS:
        raise OSError("this platform cannot seal a file's size")
    fd = sealed_file("burncoll-probe", 4096)
    try:
        found = os.open(f"/proc/{os.getpid()}/fd/{fd}", os.O_PATH)
        try:
            mine, there = os.fstat(fd), os.fstat(found)
            if (mine.st_dev, mine.st_ino) != (there.st_dev, there.st_ino):
                raise OSError("/proc shows another process's files")
        finally:
            os.close(found)
    finally:
        os.close(fd)


def sealed_file(name: str, size: int) -> int:
    """A new anonymous file of ``size`` bytes that can never change size; its descriptor."""
    fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, size)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SEALS)
    except BaseException:
        os.close(fd)
        raise
    return fd


def new_host_file(token: str, size: int) -> tuple[int, memoryview]:
    """A new sealed host file named with ``token``: its descriptor and its writable mapping
    (each page mapped at its first use: no memory for the pages never used)."""
    fd = sealed_file(f"burncoll-{token}", size)
    try:
        return fd, _map(fd, size, writable=True)
    except BaseException:
        os.close(fd)
        raise


def close_host_file(mapping: memoryview) -> None:
    """Let go of a mapping: its pages are unmapped once no view of them is left."""
    with contextlib.suppress(BufferError):  # (views made from this one: unmapped after them)
        mapping.release()


@functools.cache
def _libc() -> ctypes.CDLL:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                          ctypes.c_int, ctypes.c_long)
    libc.munmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t)
    return libc


def _map(fd: int, size: int, *, writable: bool) -> memoryview:
    """The first ``size`` bytes of file ``fd`` mapped shared, keeping no descriptor (see the
    module): bytes, read-only unless ``writable``; ``OSError`` when they cannot be mapped."""
    libc = _libc()
    prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
    address = libc.mmap(None, size, prot, mmap.MAP_SHARED, fd, 0)
    if address is None or address == ctypes.c_void_p(-1).value:
        error = ctypes.get_errno()
        raise OSError(error, os.strerror(error))
    pages = (ctypes.c_ubyte * size).from_address(address)
    weakref.finalize(pages, libc.munmap, address, size)  # (when no view holds them)
    array = np.frombuffer(memoryview(pages), np.uint8)
    array.flags.writeable = writable
    return array.data


@functools.cache
def _memfd_device() -> int:
    """The device of the kernel's memfd filesystem (that of a plain memfd of this process)."""
    fd = os.memfd_create("burncoll-device", os.MFD_CLOEXEC)
    try:
        return os.fstat(fd).st_dev
    finally:
        os.close(fd)


def map_offered(pid: int, fd: int, token: str, size: int,
                seen: dict[tuple[int, int], str] | None = None, *,
                offered_by: str = "another node") -> memoryview | None:
    """The host file process ``pid`` offered as its descriptor ``fd`` named with ``token``,
    mapped read-only; ``None`` when it cannot be reached or is not that file (its owner has
    ended or closed it, ``/proc`` is closed to this process): the receiver declines it. A
    file that is named as that file but is not one a node makes is :class:`ProtocolError`; so
    is, with ``seen`` (who offered each file already offered, by ``(st_dev, st_ino)``, to
    which this one is added as ``offered_by``'s), a file offered twice: the error names who
    offered it
    first."""
    try:
        handle = os.open(f"/proc/{pid}/fd/{fd}", os.O_PATH)
    except OSError:
        return None
    try:
        if os.readlink(f"/proc/self/fd/{handle}") not in (
                f"/memfd:burncoll-{token} (deleted)", f"/memfd:burncoll-{token}"):
            return None  # (a number its sender reused since, or never had)
        info = os.fstat(handle)
        try:
            device = _memfd_device()
        except OSError:  # (no descriptor or memory left for the probe: decline)
            return None
        if not stat.S_ISREG(info.st_mode) or info.st_dev != device:
            raise ProtocolError("offered a shared-memory file that is not an ordinary "
                                "anonymous file")
        return _map_checked(handle, size, seen, offered_by)
    finally:
        os.close(handle)


def _map_checked(handle: int, size: int, seen: dict[tuple[int, int], str] | None,
                 offered_by: str) -> memoryview | None:
    try:  # O_NONBLOCK: a file under a lease fails at once instead of blocking the loop
        fd = os.open(f"/proc/self/fd/{handle}", os.O_RDONLY | os.O_NONBLOCK)
    except BlockingIOError as exc:  # (a lease: no sender takes one)
        raise ProtocolError(f"offered a shared-memory file it cannot be read from: {exc}"
                            ) from None
    except OSError:  # (no descriptor left here, ...: decline)
        return None
    try:
        if fcntl.fcntl(fd, fcntl.F_GET_SEALS) & SEALS != SEALS:
            raise ProtocolError("offered a shared-memory file that could still be resized "
                                "(a shrunk file would crash this process)")
        info = os.fstat(fd)
        if info.st_uid != os.getuid() or info.st_size != size:
            raise ProtocolError("offered a shared-memory file of another user or size")
        if seen is not None:
            file = (info.st_dev, info.st_ino)
            if file in seen:
                raise ProtocolError(f"offered a shared-memory file that {seen[file]} "
                                    "offered too")
            seen[file] = offered_by
        try:
            return _map(fd, size, writable=False)
        except OSError:  # (no memory for it now: the receiver declines)
            return None
    finally:
        os.close(fd)
