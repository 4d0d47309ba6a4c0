"""Where each value of a :class:`~burncoll.CollectiveConfig` comes from, first match wins.

1. the code's arguments (constructor, ``from_mapping``, ``replace``, the ``with_*`` builders);
2. a ``BURNCOLL_<FIELD>`` environment variable (how ``burncoll launch`` configures nodes);
3. a YAML file (``from_yaml``); 4. the launcher's variables (:mod:`burncoll.config.launchers`:
   ``num_nodes``, ``node_rank``, ``global_address``); 5. the field's default.

The nearer to the code, the stronger, as pydantic-settings orders its sources and as torch's
``init_process_group(rank=...)`` ignores ``RANK``. :func:`file_values` keeps a file's values
that no variable overrides; :func:`resolve` does 2 and 4; :func:`check_node_fields` checks the
rank and rendezvous address and finds a multi-node config's missing ``node_address``;
:func:`naming_the_variable` makes an error about a value from a variable name the variable.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from typing import Any

from burncoll.config.addresses import resolves_to_loopback, route_address
from burncoll.config.launchers import detect_launcher
from burncoll.config.names import warn_unknown_variables
from burncoll.config.values import ENV_PREFIX, parse_env, parse_host_port
from burncoll.errors import ConfigError

__all__ = ["check_node_fields", "file_values", "naming_the_variable", "resolve"]

#: The fields a launcher's variables (torchrun, SLURM, mpirun) can fill.
LAUNCHER_FIELDS = ("num_nodes", "node_rank", "global_address")


def file_values(data: Mapping[Any, Any]) -> dict[Any, Any]:
    """A file's values without those a ``BURNCOLL_<FIELD>`` variable overrides (the file is
    not the code's argument, so the environment wins over it)."""
    return {k: v for k, v in data.items()
            if not (isinstance(k, str) and ENV_PREFIX + k.upper() in os.environ)}


def resolve(code: frozenset[str], so_far: Mapping[str, Any]) -> dict[str, Any]:
    """The values that the environment, then the launcher, give the fields the code did not
    (``code``); ``so_far``: every field's value, the code's or the default. Warns about each
    ``BURNCOLL_*`` variable that is no field's (:func:`~.names.warn_unknown_variables`)."""
    warn_unknown_variables(so_far)
    from_env = {name: parse_env(name, raw) for name in so_far if name not in code
                and (raw := os.environ.get(ENV_PREFIX + name.upper())) is not None}
    now = {**so_far, **from_env}
    return from_env | launcher_values(code, frozenset(from_env), now["num_nodes"],
                                      now["node_rank"])


def naming_the_variable(error: ConfigError, code: frozenset[str]) -> ConfigError:
    """``error`` (about the field its message starts with: ``transport='x': expected ...``)
    naming the variable instead (``environment variable BURNCOLL_TRANSPORT='x': ...``) where
    that field took its value from ``BURNCOLL_<FIELD>``: not given by the code (``code``)."""
    text = str(error)
    found = re.match(r"([a-z_]+)(?=[=: ])", text)
    if found is None or found[1] in code or ENV_PREFIX + found[1].upper() not in os.environ:
        return error
    return ConfigError(f"environment variable {ENV_PREFIX}{found[1].upper()}"
                       f"{text[found.end():]}")


def launcher_values(code: frozenset[str], env: frozenset[str], num_nodes: int | None,
                    node_rank: int | None) -> dict[str, Any]:
    """The field values the launcher's variables give, for the fields that neither the code
    (``code``) nor a ``BURNCOLL_*`` variable (``env``) set. ``num_nodes`` and ``node_rank``: the
    values so far. A ``num_nodes`` set elsewhere that differs from the launcher's takes nothing from
    it (the three fields go together). Node 0 of a torchrun, SLURM or mpirun job hosts the
    orchestrator (``host_orchestrator``) unless the code chose the rendezvous address or said who
    hosts. Raises :class:`~burncoll.ConfigError` when the launcher's variables don't add up."""
    given = code | env
    if all(name in given for name in LAUNCHER_FIELDS):
        return {}
    found = detect_launcher()
    if found is None:
        return {}
    if "num_nodes" in given and (num_nodes or 1) != found.num_nodes:
        return {}  # a job of another size than the launcher's: nothing of it applies
    if "global_address" not in given and found.rendezvous is not None:
        _check_spans_hosts(found.rendezvous, found.num_nodes, found.all_on_one_host,
                           found.launcher)
    offered = {"num_nodes": found.num_nodes, "node_rank": found.node_rank,
               "global_address": found.rendezvous}
    values = {name: value for name, value in offered.items()
              if name not in given and value is not None}
    if ("host_orchestrator" not in given and "global_address" not in code
            and found.launcher != "burncoll"):
        rank = found.node_rank if "node_rank" in values else (node_rank or 0)
        values["host_orchestrator"] = found.num_nodes > 1 and rank == 0
    return values


def _check_spans_hosts(rendezvous: str, nodes: int, one_host: bool, launcher: str) -> None:
    """A job over several hosts cannot meet at a loopback address (a host name that
    ``/etc/hosts`` maps to ``127.0.1.1``, say): the other hosts would wait out the timeout."""
    host, _ = parse_host_port(rendezvous, "the rendezvous address")
    if nodes > 1 and not one_host and resolves_to_loopback(host):
        raise ConfigError(
            f"the {launcher} job spans several hosts but its rendezvous host {host!r} resolves "
            "to a loopback address, which the other hosts cannot reach; set MASTER_ADDR to "
            "an address of node 0's host that the others reach (or BURNCOLL_GLOBAL_ADDRESS)")


def _require_rank(node_rank: object, nodes: int) -> None:
    if node_rank is None:
        return
    if isinstance(node_rank, bool) or not isinstance(node_rank, int) or node_rank < 0:
        raise ConfigError(f"node_rank={node_rank!r}: expected an integer >= 0")
    if node_rank >= nodes:
        raise ConfigError(
            f"node_rank={node_rank} but num_nodes={nodes}: the node rank must be below the "
            "number of nodes (check BURNCOLL_NODE_RANK / BURNCOLL_NUM_NODES or the launcher's "
            "RANK / WORLD_SIZE)")


def check_node_fields(num_nodes: int | None, node_rank: object, host_orchestrator: object,
                      global_address: str | None, node_address: str | None) -> str | None:
    """Check ``node_rank``, ``host_orchestrator`` and the rendezvous address; the address
    found for ``node_address`` when a multi-node config leaves it unset (else ``None``): this
    machine's address toward the rendezvous host, loopback for a loopback rendezvous."""
    nodes = num_nodes or 1
    _require_rank(node_rank, nodes)
    if host_orchestrator is not None and not isinstance(host_orchestrator, bool):
        raise ConfigError(
            f"host_orchestrator={host_orchestrator!r}: expected true, false or null (auto)")
    if global_address is None and (nodes > 1 or host_orchestrator):
        raise ConfigError(
            f"num_nodes={nodes} needs global_address='host:port' of the orchestrator "
            "(BURNCOLL_GLOBAL_ADDRESS), or a launcher's variables (torchrun, SLURM, mpirun)")
    if global_address is None:
        return None
    rendezvous, _ = parse_host_port(global_address, "global_address")
    if nodes <= 1 or node_address is not None:
        return None
    return route_address(rendezvous)
