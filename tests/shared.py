"""One expensive run per test session, shared by every pytest-xdist worker.

Several modules run one live collective (a cluster of processes under attack, or with a
corrupted connection) and check it with several tests, each reading the same cached run.
With ``pytest -n 2`` those tests can land on both workers, and an in-process cache alone
would then run the whole collective twice. :func:`once` runs it in the first worker that
needs it, under a file lock, and leaves the (pickled) result in a directory of this session
for the other worker to load -- the pattern pytest-xdist documents for session fixtures.
(``tests/conftest.py`` calls :func:`configure`.)
"""

from __future__ import annotations

import fcntl
import pickle
import re
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import pytest

T = TypeVar("T")
_directory: Path | None = None


def configure(config: pytest.Config) -> None:
    """In a pytest-xdist worker: share results through the session's base temporary
    directory (each worker's own is a subdirectory of it; pytest keeps the last few)."""
    global _directory
    basetemp = config.option.basetemp
    if hasattr(config, "workerinput") and basetemp:
        _directory = Path(basetemp).parent / "shared-runs"


def once(key: str, compute: Callable[[], T]) -> T:
    """``compute()`` once per test session (per ``key``), in whichever worker asks first; its
    (picklable) value in every worker that asks. Callers keep their own in-process cache."""
    directory = _directory
    if directory is None:
        return compute()
    directory.mkdir(parents=True, exist_ok=True)
    name = re.sub(r"[^0-9A-Za-z_.-]", "_", key)
    result = directory / f"{name}.pickle"
    with open(directory / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another worker running it: wait for its result
        try:
            if result.exists():
                with result.open("rb") as f:
                    loaded: T = pickle.load(f)
                    return loaded
            value = compute()  # raises: no result left, so the next caller runs it again
            temp = result.with_suffix(".tmp")
            with temp.open("wb") as f:
                pickle.dump(value, f)
            temp.replace(result)
            return value
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
