"""The fault table: every fault-injection test records what it injected and how it ended.

``BURNCOLL_FAULT_TABLE=path pytest tests/reliability`` writes the table (Markdown) to
``path`` at the end of the session; the README's table comes from it.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

_ROWS: list[tuple[str, str, str, str]] = []


class FaultTable:
    def add(self, fault: str, transport: str, survived: str, time_to_error: str) -> None:
        _ROWS.append((fault, transport, survived, time_to_error))


@pytest.fixture
def fault_table() -> FaultTable:
    return FaultTable()


@pytest.fixture(autouse=True)
def _nodes_talk_over_the_network(monkeypatch: pytest.MonkeyPatch) -> None:
    """The faults injected here are faults of the network between nodes (frames delayed,
    dropped, doubled, cut): keep this host's nodes on it rather than on shared memory
    (``burncoll.transport.shm``), as nodes of different hosts are."""
    monkeypatch.setenv("BURNCOLL_SHARED_MEMORY", "0")  # child processes inherit it


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    path = os.environ.get("BURNCOLL_FAULT_TABLE")
    if not path or not _ROWS:
        return
    lines = ["| fault injected | transport | survived | time to error |", "|---|---|---|---|"]
    lines += [f"| {f} | {t} | {s} | {e} |" for f, t, s, e in _ROWS]
    Path(path).write_text("\n".join(lines) + "\n")
