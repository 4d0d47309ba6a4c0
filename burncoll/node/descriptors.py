"""The open file descriptors a node needs, and its process's limit on them (``RLIMIT_NOFILE``).

A node of a session of ``N`` nodes holds, per other node, :data:`PER_NODE` descriptors: its
two member connections (the one it sends on, the one it receives on; their zero-copy writers
share the connections' descriptors, :mod:`burncoll.transport.writer`) and their caller
socket (:mod:`burncoll.node.lanes`) -- its mappings of the host memory of the nodes of its host
keep none (:mod:`burncoll.transport.host_files`); and :data:`BASE` more for everything else
(its listener, the orchestrator's connection, the event loop, pipes, the process's own files).
So 64 node processes of one host need about 253 each while they register (they hold about
200 then, and 137 once registered: where the host mail carries every exchange, the caller
sockets are closed after the join, :meth:`burncoll.node.lanes.Lanes.drop_sockets`).

At registration, before it contacts the orchestrator, a node raises its soft limit towards
the hard one as far as it needs (:func:`ensure_descriptors`; a process may always do that),
and where even the hard limit is too low it fails registration at once with
:class:`~burncoll.ConfigError`, naming the limit, the need and the fix -- never a failure
deep inside a later operation when a connection or a mapping finds no descriptor left.
"""

from __future__ import annotations

import resource

from burncoll.errors import ConfigError

__all__ = ["BASE", "PER_NODE", "descriptors_needed", "ensure_descriptors"]

#: Descriptors a node holds per other node of its session (see the module).
PER_NODE = 3
#: Descriptors a node holds whatever the session's size, with room for the process's own.
BASE = 64


def descriptors_needed(nodes: int) -> int:
    """The descriptors one node of a session of ``nodes`` nodes needs."""
    return BASE + PER_NODE * max(nodes - 1, 0)


def ensure_descriptors(nodes: int) -> int:
    """Raise this process's soft ``RLIMIT_NOFILE`` to what a node of a session of ``nodes``
    nodes needs, where it is lower and the hard limit allows; the soft limit then.
    :class:`~burncoll.ConfigError` when the hard limit is lower than the need."""
    need = descriptors_needed(nodes)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or soft >= need:
        return soft
    if hard != resource.RLIM_INFINITY and hard < need:
        raise ConfigError(
            f"register: a node of a session of {nodes} nodes needs about {need} open file "
            f"descriptors ({PER_NODE} per other node + {BASE}), but this process may open "
            f"at most {hard} (its hard limit, RLIMIT_NOFILE; soft {soft}); raise the hard "
            f"limit to {need} or more where the node starts (`ulimit -Hn {need}` as root, "
            "LimitNOFILE= in a systemd unit, --ulimit nofile= for a container, nofile in "
            "/etc/security/limits.conf), or run fewer node processes (more devices per node)")
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (need, hard))
    except (OSError, ValueError) as exc:
        raise ConfigError(
            f"register: a node of a session of {nodes} nodes needs about {need} open file "
            f"descriptors, but its soft limit (RLIMIT_NOFILE) is {soft} and raising it to "
            f"{need} failed ({exc}); raise it where the node starts (`ulimit -n {need}`)"
        ) from exc
    return need
