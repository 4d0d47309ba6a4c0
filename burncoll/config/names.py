"""The names a config accepts, and "did you mean" for the others: keyword arguments and YAML
keys that are no field, and ``BURNCOLL_*`` environment variables that nothing reads (a typo
such as ``BURNCOLL_TIMEOT=5`` would otherwise leave the timeout at its default without a
word)."""

from __future__ import annotations

import difflib
import os
import threading
import warnings
from collections.abc import Iterable, Mapping

from burncoll.config.values import ENV_PREFIX
from burncoll.errors import ConfigError
from burncoll.hostlists import shown

__all__ = ["OTHER_VARIABLES", "nearest", "refuse_unknown_names", "warn_unknown_variables"]

#: ``BURNCOLL_*`` variables that are no config field but are read all the same.
OTHER_VARIABLES = frozenset({
    # set by `burncoll launch` for its nodes (burncoll.orchestration.launch)
    "BURNCOLL_RESTART_COUNT",
    "BURNCOLL_FAULT_TABLE",  # where tests/reliability writes its table of faults
})

_warned: set[str] = set()
_warned_lock = threading.Lock()


#: Names that other libraries use for what burncoll configures otherwise.
_OTHER_NAMES = {
    "strategy": "a strategy is chosen per level and operation: local_all_reduce_strategy, "
                "global_all_reduce_strategy, and the reduce and broadcast ones",
    "world_size": "the world is num_nodes x num_devices: set those",
    "rank": "a peer's rank is the peer_id given to register(); a node's is node_rank",
    "backend_name": "backend",
    "master_addr": "global_address ('host:port' of the orchestrator)",
}


def nearest(name: str, choices: Iterable[str]) -> str:
    """`` (did you mean 'timeout'?)`` for the choice nearest ``name``, or ``""``."""
    close = difflib.get_close_matches(name, list(choices), n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


def refuse_unknown_names(given: Iterable[object], fields: Iterable[str], where: str) -> None:
    """Raise :class:`~burncoll.ConfigError` when a name of ``given`` is no field, each with
    the nearest field; the list of every field when one of them has none near."""
    names = sorted(fields)
    unknown = sorted(str(k) for k in given if k not in names)
    if not unknown:
        return
    hints = [f" ({_OTHER_NAMES[k]})" if k in _OTHER_NAMES else nearest(k, names)
             for k in unknown]
    named = ", ".join(repr(k) + hint for k, hint in zip(unknown, hints, strict=True))
    listed = "" if all(hints) else f"; the fields are: {', '.join(names)}"
    raise ConfigError(f"unknown config field(s) {named} in {where}{listed}")


def warn_unknown_variables(fields: Iterable[str],
                           environ: Mapping[str, str] | None = None) -> list[str]:
    """Warn (a :class:`UserWarning`, once per variable and process) about each ``BURNCOLL_*``
    environment variable that is neither a field's nor one of :data:`OTHER_VARIABLES`, naming
    the nearest field's variable; returns the names warned about now. The warning shows a
    name as :func:`~burncoll.hostlists.shown` does (quoted, a long one elided)."""
    env = os.environ if environ is None else environ
    known = {ENV_PREFIX + name.upper() for name in fields} | OTHER_VARIABLES
    stray = sorted(k for k in env if k.startswith(ENV_PREFIX) and k not in known)
    with _warned_lock:
        new = [k for k in stray if k not in _warned]
        _warned.update(new)
    suffixes = sorted(k.removeprefix(ENV_PREFIX) for k in known)  # the prefix matches anyway
    for name in new:  # shown at the line that made the config: above us are sources.resolve,
        # CollectiveConfig.__post_init__ and its __init__
        hint = nearest(name.removeprefix(ENV_PREFIX), suffixes).replace("'", "'" + ENV_PREFIX, 1)
        warnings.warn(f"environment variable {shown(name)} is not a burncoll setting and is ignored"
                      f"{hint}", UserWarning, stacklevel=5)
    return new
