"""One node process of a tiny collective, configured entirely by ``BURNCOLL_*`` variables.

Each of its ``num_devices`` peers all-reduces known data and compares the result with NumPy;
prints one JSON line per peer: ``{"peer", "ok", "message", "token_bytes", "token_sha"}`` (the
token itself is never printed: only its length and a hash, so that the test can tell that
every node got the same one). With ``TEST_EXPECT_TOKEN_FILE`` set, checks that the token is
that file's, and that no command line of this process or its parent shows it.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
from pathlib import Path

import numpy as np

import burncoll


def data(peer: int) -> np.ndarray:
    return np.arange(1000, dtype=np.float64) * (peer + 1) + peer


def check_token(cfg: burncoll.CollectiveConfig) -> str:
    """Problems with how the token reached this process ("" if none)."""
    token = cfg.auth_token or ""
    expected_file = os.environ.get("TEST_EXPECT_TOKEN_FILE")
    if expected_file and token != Path(expected_file).read_text().rstrip("\n"):
        return "the token is not the one in the file"
    for pid in (os.getpid(), os.getppid()):
        path = f"/proc/{pid}/cmdline"
        if token and os.path.exists(path):
            with open(path, "rb") as f:
                if token.encode() in f.read():
                    return f"the token is visible in {path}"
    return ""


def run_peer(pid: int, local: int, cfg: burncoll.CollectiveConfig, world: int,
             out: list[dict[str, object]]) -> None:
    record: dict[str, object] = {"peer": pid, "ok": False}
    try:
        comm = burncoll.register(pid, local, cfg)
        result = comm.all_reduce(data(pid))
        reference = np.sum(np.stack([data(p) for p in range(world)]), axis=0)
        record["ok"] = bool(np.array_equal(result, reference))
        record["message"] = "" if record["ok"] else "the all-reduce differs from NumPy"
        comm.finish()
    except burncoll.CollectiveError as exc:
        record["message"] = f"{type(exc).__name__}: {exc}"
    out.append(record)


def main() -> None:
    cfg = burncoll.CollectiveConfig(timeout=float(os.environ.get("TEST_TIMEOUT", "30")))
    rank = int(os.environ["BURNCOLL_NODE_RANK"])
    devices = cfg.num_devices
    world = devices * (cfg.num_nodes or 1)
    problem = check_token(cfg)
    out: list[dict[str, object]] = []
    threads = [threading.Thread(target=run_peer, args=(rank * devices + i, i, cfg, world, out))
               for i in range(devices)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    token = (cfg.auth_token or "").encode()
    for record in out:
        if problem:
            record.update(ok=False, message=problem)
        record.update(token_bytes=len(token), token_sha=hashlib.sha256(token).hexdigest())
        print(json.dumps(record), flush=True)


if __name__ == "__main__":
    main()
