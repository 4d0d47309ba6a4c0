"""``burncoll bench``: an nccl-tests style benchmark of every collective, with baselines.

* :mod:`~burncoll.bench.runner` measures (thread per device, as burncoll runs);
* :mod:`~burncoll.bench.check` builds the inputs and the NumPy float64 reference;
* :mod:`~burncoll.bench.table` prints the nccl-tests layout;
* :mod:`~burncoll.bench.peers` runs the baselines (Gloo, MPI, TCP loopback, ``np.add``);
* :mod:`~burncoll.bench.cli` is the glue behind ``burncoll bench``.

How a time is measured is stated once, in :data:`burncoll.bench.results.TIMING_METHOD`.
"""

from __future__ import annotations

from burncoll.bench.results import TIMING_METHOD, PeerResult, PeerRow, Row
from burncoll.bench.runner import BenchSpec, run_node

__all__ = ["TIMING_METHOD", "BenchSpec", "PeerResult", "PeerRow", "Row", "run_node"]
