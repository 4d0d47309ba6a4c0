"""``examples/train_anywhere.py`` with a fault: on its first attempt, node ``CRASH_NODE`` kills
itself with SIGKILL after step ``CRASH_STEP`` (as a machine dies: no cleanup, no goodbye);
with ``CRASH_HOST=1`` it kills its launcher first, as when the whole host is lost.

Launchers start it like the example (same arguments); ``BURNCOLL_RESTART_COUNT`` (set by
``burncoll launch``) tells the attempts apart.
"""

from __future__ import annotations

import importlib.util
import os
import signal
import sys
from pathlib import Path
from typing import Any

import burncoll

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "train_anywhere.py"


def load_example() -> Any:
    spec = importlib.util.spec_from_file_location("train_anywhere", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main() -> None:
    crash_node = int(os.environ["CRASH_NODE"])
    crash_step = int(os.environ["CRASH_STEP"])
    first_attempt = os.environ.get("BURNCOLL_RESTART_COUNT", "0") == "0"

    def maybe_die(comm: burncoll.Communicator, step: int, params: Any) -> None:
        if first_attempt and step == crash_step and burncoll.node_rank() == crash_node:
            print(f"crash_train: node {crash_node} dies after step {step}", flush=True)
            if os.environ.get("CRASH_HOST") == "1":  # the whole host: its launcher dies too
                os.kill(os.getppid(), signal.SIGKILL)
            os.kill(os.getpid(), signal.SIGKILL)

    load_example().main(sys.argv[1:], callback=maybe_die)


if __name__ == "__main__":
    main()
