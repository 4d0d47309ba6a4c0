"""Fresh host result arrays that cost no page faults: memory released by its caller is reused.

A new array from ``malloc`` is fresh pages every call, which the kernel zeroes at first touch:
at 64 MiB that costs as much as the reduction. A large array (at least :data:`MIN_BYTES`) here
lives in an anonymous ``mmap`` (transparent huge pages where offered) that a
``weakref.finalize`` on its buffer returns to a free list once no array or view uses it, for
the next array of that size. At most :data:`MAX_FREE_BYTES` wait there; beyond, memory goes
back to the kernel. :func:`fresh` is safe from any thread.
"""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import threading
import weakref
from collections import defaultdict
from typing import Any

import numpy as np

__all__ = ["MAX_FREE_BYTES", "MIN_BYTES", "free_bytes", "fresh", "trim"]

#: Arrays smaller than this come from NumPy's allocator (small blocks are cheap there).
MIN_BYTES = 1 << 20
#: The most memory kept in the free lists (:func:`trim` gives it all back).
MAX_FREE_BYTES = 512 << 20

_lock = threading.RLock()  # a collection inside the lock may run a finalizer that takes it
_free: dict[int, list[mmap.mmap]] = defaultdict(list)
_free_total = 0


def _take(size: int) -> mmap.mmap:
    global _free_total
    with _lock:
        spare = _free.get(size)
        if spare:
            _free_total -= size
            return spare.pop()
    # private: a forked child gets its own copy, as with malloc'd memory
    mapping = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE") and size >= 2 << 20:
        with contextlib.suppress(OSError):  # a kernel without transparent huge pages
            mapping.madvise(mmap.MADV_HUGEPAGE)
    return mapping


def _give_back(mapping: mmap.mmap, size: int) -> None:
    global _free_total
    with _lock:
        if _free_total + size <= MAX_FREE_BYTES:
            _free[size].append(mapping)
            _free_total += size
            return
    # dropped: unmapped once the last export of it is released (close() would refuse now)


def fresh(count: int, dtype: np.dtype[Any]) -> np.ndarray[Any, Any]:
    """A new writable 1-D array of ``count`` elements of ``dtype`` (uninitialised), which
    shares memory with no array anyone holds."""
    nbytes = count * dtype.itemsize
    if nbytes < MIN_BYTES:
        return np.empty(count, dtype)
    size = -(-nbytes // mmap.PAGESIZE) * mmap.PAGESIZE
    mapping = _take(size)
    # A new buffer object per loan over the mapping's memory: every array and view made from
    # it keeps it alive (NumPy never skips past a foreign exporter), and its end -- the end of
    # the last of them -- returns the mapping.
    loan = (ctypes.c_char * nbytes).from_buffer(mapping)
    # (not at exit: an array still in use must never go back to the free lists then)
    weakref.finalize(loan, _give_back, mapping, size).atexit = False
    return np.frombuffer(memoryview(loan).cast("B"), dtype=dtype, count=count)


def trim() -> None:
    """Give every mapping waiting in the free lists back to the kernel."""
    global _free_total
    with _lock:
        _free.clear()
        _free_total = 0


def free_bytes() -> int:
    """Bytes waiting in the free lists (for tests and diagnostics)."""
    with _lock:
        return _free_total
