"""A member node of tests/security/test_hostile_objects.py: honest, or the liar (node 1).

Usage (the token in the environment, :data:`TOKEN_ENV`)::

    python object_member.py NODE NUM_NODES ORCH TRANSPORT TIMEOUT KIND[,KIND...]

Per kind, every member first runs an honest ``all_gather_object`` (the control, checked
exactly against the objects sent), then one in which node 1 sends the hostile record of that
kind instead of its object (a test double inside its process replaces
``burncoll.comm.objects.payload``). Each member prints JSON lines on stdout::

    {"event": "control", "node": n, "kind": k, "ok": bool, "detail": str}
    {"event": "attack", "node": n, "kind": k, "error": type, "message": str,
     "elapsed": seconds, "growth_mb": MiB}
    {"event": "done", "node": n, "ok": bool, "detail": str}

``growth_mb``: the peak of the process's resident memory during the attacked operation
(``VmHWM``, reset just before it through ``/proc/self/clear_refs``), less its resident memory
just before.
"""

from __future__ import annotations

import json
import os
import struct
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import msgpack  # noqa: E402
import numpy as np  # noqa: E402

import burncoll  # noqa: E402
from burncoll.comm import objects  # noqa: E402

TOKEN_ENV = "OBJECTS_TEST_TOKEN"
#: The member that sends the hostile records.
LIAR = 1
_TUPLE = msgpack.ExtType(1, b"")
# CPython's tuple hash (xxHash-based, 64-bit builds)
_MASK, _P1, _P2, _P5 = 2**64 - 1, 11400714785074694791, 14029467366897019727, 2870177450012600261
_HASH_MODULUS = 2**61 - 1


def colliding_pairs(count: int, target: int = 12345) -> list[tuple[int, int]]:
    """``count`` pairs of ints whose tuples all hash to ``target`` (for ``a`` >= 0 small,
    ``hash(a) == a``; the second int's hash is solved for)."""
    def rotl(x: int, r: int) -> int:
        return ((x << r) | (x >> (64 - r))) & _MASK

    acc = ((target - (2 ^ (_P5 ^ 3527539))) * pow(_P1, -1, 2**64)) & _MASK
    want = rotl(acc, 33)  # undo the rotation by 31
    pairs, a = [], 0
    while len(pairs) < count:
        lane = ((want - (rotl((_P5 + a * _P2) & _MASK, 31) * _P1)) * pow(_P2, -1, 2**64)) & _MASK
        if lane < _HASH_MODULUS:
            pairs.append((a, lane))
        elif 2**64 - _HASH_MODULUS < lane < _MASK:  # hash(-k) == -k for 2 <= k < 2**61 - 1
            pairs.append((a, lane - 2**64))
        a += 1
    return pairs


def hostile_record(kind: str) -> bytes:
    """The record node 1 sends instead of its object (a tag byte, the length, the body)."""
    if kind == "empty_lists":  # 8 MiB: an array of empty arrays
        count = 8 * 2**20 - 5
        body = b"\xdd" + struct.pack(">I", count) + b"\x90" * count
    elif kind == "short_strings":  # 8 MiB: an array of 2-character strings (~200 MiB decoded)
        count = (8 * 2**20 - 5) // 3
        body = b"\xdd" + struct.pack(">I", count) + b"\xa2ab" * count
    elif kind == "colliding_keys":  # a map of 40,000 tuple keys sharing one hash
        pairs = colliding_pairs(40_000)
        body = b"\xdf" + struct.pack(">I", len(pairs)) + b"".join(
            msgpack.packb([_TUPLE, a, b]) + b"\x00" for a, b in pairs)
    elif kind == "bool_byte_2":  # a bool array holding 0x02
        body = msgpack.packb(msgpack.ExtType(
            2, b"\x04bool\x01" + struct.pack("<Q", 3) + b"\x01\x02\x00"))
    elif kind == "deep":  # arrays nested a million deep
        body = b"\x91" * 2**20 + b"\xc0"
    elif kind == "declared":  # 1,000 nested arrays each declaring 16,000 items, 16 KB in all
        body = (b"\xdd" + struct.pack(">I", 16_000)) * 1000
        body += b"\xc0" * (16_000 - len(body))
    else:
        raise ValueError(kind)
    return struct.pack("<BQ", 1, len(body)) + body


def honest_object(node: int, k: int) -> dict[Any, Any]:
    return {"node": node, "round": k, "loss": [node / 7, -0.0, 1e300, float("inf")],
            "mask": np.array([True, False, node % 2 == 1]), "t": (node, str(k), None),
            "keys": {(node, k): "x", -1: 1, -2: 2, 1.5: b"\x00\x02"},
            "values": np.arange(k + 3, dtype=np.float32) * (node + 1)}


def same(got: Any, want: Any) -> bool:
    """``got`` equals ``want`` down to types, dtypes, shapes and dict order."""
    if type(got) is not type(want):
        return False
    if isinstance(want, np.ndarray):
        return bool(got.dtype == want.dtype and got.shape == want.shape
                    and np.array_equal(got, want))
    if isinstance(want, dict):
        return list(got) == list(want) and all(
            same(g, w) for g, w in zip(got.values(), want.values(), strict=True))
    if isinstance(want, list | tuple):
        return len(got) == len(want) and all(same(g, w) for g, w in zip(got, want, strict=True))
    return bool(got == want) or (got != got and want != want)


def _status(field: str) -> float:
    """A ``/proc/self/status`` field of this process, MiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    return 0.0


def emit(record: dict[str, Any]) -> None:
    print(json.dumps(record), flush=True)


def attacked(comm: burncoll.Communicator, node: int, kind: str, k: int) -> dict[str, Any]:
    """One ``all_gather_object`` in which node 1 sends the hostile record of ``kind``."""
    real = objects.payload
    if node == LIAR:  # the test double: this member's record is the hostile one
        record = np.frombuffer(hostile_record(kind), np.uint8)
        objects.payload = lambda *args, **kwargs: record
    base = _status("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM starts again from VmRSS
    started = time.monotonic()
    outcome: dict[str, Any] = {"error": None, "message": ""}
    try:
        comm.all_gather_object(honest_object(node, k))
    except burncoll.CollectiveError as exc:
        outcome = {"error": type(exc).__name__, "message": str(exc)[:600]}
    finally:
        objects.payload = real
    return {"event": "attack", "node": node, "kind": kind, **outcome,
            "elapsed": time.monotonic() - started, "growth_mb": _status("VmHWM") - base}


def main() -> None:
    node, num_nodes, orch, transport, timeout, kinds = sys.argv[1:7]
    cfg = burncoll.CollectiveConfig(
        num_devices=1, num_nodes=int(num_nodes), global_address=orch,
        node_address="127.0.0.1", data_service_port=0, transport=transport,
        timeout=float(timeout), auth_token=os.environ[TOKEN_ENV])
    me, peers = int(node), range(int(num_nodes))
    comm = burncoll.register(me, 0, cfg)
    for k, kind in enumerate(kinds.split(",")):
        got = comm.all_gather_object(honest_object(me, k))
        emit({"event": "control", "node": me, "kind": kind, "detail": repr(got)[:300],
              "ok": same(got, [honest_object(n, k) for n in peers])})
        emit(attacked(comm, me, kind, k))
    got = comm.all_gather_object(("after", me))
    emit({"event": "done", "node": me, "ok": same(got, [("after", n) for n in peers]),
          "detail": repr(got)[:300]})
    comm.finish()


if __name__ == "__main__":
    main()
