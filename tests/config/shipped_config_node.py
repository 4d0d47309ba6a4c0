"""One node of a shipped multi-node config: ``python shipped_config_node.py CONFIG.yaml``, with
``BURNCOLL_NODE_RANK`` (and, in the tests, ``BURNCOLL_GLOBAL_ADDRESS``) in the environment, as
the config's comment says to run ``train.py``. Each device thread all-reduces
``arange(5) * (peer + 1)``; prints ``{"peer": P, "sum": [...]}`` per device."""

from __future__ import annotations

import json
import sys
import threading

import numpy as np

import burncoll


def main(path: str) -> None:
    config = burncoll.CollectiveConfig.from_yaml(path)
    backend = burncoll.get_backend(config.backend)
    devices = backend.devices(config.num_devices)
    lines: list[str] = []

    def peer(i: int, peer_id: int) -> None:
        comm = burncoll.register(peer_id, devices[i], config)
        total = comm.all_reduce(np.arange(5, dtype=np.float32) * (peer_id + 1))
        comm.finish()
        lines.append(json.dumps({"peer": peer_id, "sum": np.asarray(total).tolist()}))

    threads = [threading.Thread(target=peer, args=(i, p))
               for i, p in enumerate(burncoll.peer_ids(config))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    print("\n".join(lines), flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
