"""Configuration: :class:`CollectiveConfig` and where each of its values comes from.

:mod:`.collective` is the frozen dataclass and its validation; :mod:`.sources` fills the
fields the code left unset from a launcher's variables (:mod:`.launchers`: torchrun, SLURM,
Open MPI, MPICH) and finds this node's address (:mod:`.addresses`); :mod:`.values` reads
``host:port``, strategy names and ``BURNCOLL_*`` text; :mod:`.names` refuses unknown fields
and warns about unknown variables; :mod:`.security` holds the secure defaults (tokens,
loopback, TLS) that the orchestrator and the CLI check as well.
"""

from burncoll.config.collective import CollectiveConfig

__all__ = ["CollectiveConfig"]
