"""Data-parallel training on burncoll: :func:`ddp`, bucketed tree collectives, the loop.

``ddp(devices, config).run(fn)`` runs ``fn(comm)`` on one thread per device;
``all_reduce_tree(comm, grads)`` averages a whole tree of gradients in a few collectives;
``ddp(devices, config).fit(...)`` is the training loop. ``burncoll.train.demo`` is the demo.
"""

from burncoll.buckets import (
    DEFAULT_BUCKET_BYTES,
    all_reduce_tree,
    broadcast_tree,
    flatten_tree,
    plan_buckets,
)
from burncoll.train.ddp import NODE_RANK_ENV, DataParallel, ddp, node_rank
from burncoll.train.fit import FitResult, GradientTransformation, replicas_identical

__all__ = [
    "DEFAULT_BUCKET_BYTES",
    "NODE_RANK_ENV",
    "DataParallel",
    "FitResult",
    "GradientTransformation",
    "all_reduce_tree",
    "broadcast_tree",
    "ddp",
    "flatten_tree",
    "node_rank",
    "plan_buckets",
    "replicas_identical",
]
