"""Which node this process is, and which peer ids its devices take, under every launcher.

A script computes its peer ids the same way whether ``burncoll launch``, torchrun, SLURM,
mpirun or Ray started it: ``burncoll.peer_ids()`` reads the node rank and the devices per node
from the config (which reads the launcher's variables, see :mod:`burncoll.config`).
"""

from __future__ import annotations

from burncoll.config import CollectiveConfig
from burncoll.errors import UsageError

__all__ = ["node_rank", "peer_ids"]


def node_rank(config: CollectiveConfig | None = None) -> int:
    """This process's node rank: ``config.node_rank`` (from the launcher when not set), else 0.

    ``config`` defaults to ``CollectiveConfig()``, i.e. the environment's settings.
    """
    cfg = CollectiveConfig() if config is None else config
    return cfg.node_rank or 0


def peer_ids(config: CollectiveConfig | None = None,
             num_devices: int | None = None) -> tuple[int, ...]:
    """The peer ids of this node's devices: ``node_rank * num_devices + i`` for device ``i``.

    ``num_devices`` defaults to ``config.num_devices``; every node must use as many devices.
    Peer ids numbered this way order the nodes by rank, so node ``r`` of the launcher is node
    ``r`` of the collective.
    """
    cfg = CollectiveConfig() if config is None else config
    count = cfg.num_devices if num_devices is None else num_devices
    if isinstance(count, bool) or not isinstance(count, int) or count < 1:
        raise UsageError(f"num_devices must be an int >= 1, got {count!r}")
    first = node_rank(cfg) * count
    return tuple(range(first, first + count))
