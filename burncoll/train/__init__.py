"""Data-parallel training on burncoll: :func:`ddp`, bucketed tree collectives, the loop.

``ddp(devices, config).run(fn)`` runs ``fn(comm)`` on one thread per device;
``all_reduce_tree(comm, grads)`` averages a whole tree of gradients in a few collectives;
``ddp(devices, config).fit(...)`` is the training loop; ``GradientBuckets`` reduces gradient
buckets while backward still runs (a ``grad_fn`` of ``fit`` that yields its gradients layer by
layer gets it). ``burncoll.train.demo`` is the demo.
"""

from burncoll.comm.buckets import (
    DEFAULT_BUCKET_BYTES,
    all_reduce_tree,
    broadcast_tree,
    flatten_tree,
    plan_buckets,
)
from burncoll.train.ddp import NODE_RANK_ENV, DataParallel, ddp, node_rank
from burncoll.train.fit import FitResult, GradientTransformation, replicas_identical
from burncoll.train.overlap import GradientBuckets, leaf_paths, plan_stream_buckets

__all__ = ["DEFAULT_BUCKET_BYTES", "NODE_RANK_ENV", "DataParallel", "FitResult", "GradientBuckets",
           "GradientTransformation", "all_reduce_tree", "broadcast_tree", "ddp", "flatten_tree",
           "leaf_paths", "node_rank", "plan_buckets", "plan_stream_buckets", "replicas_identical"]
