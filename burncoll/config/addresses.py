"""Finding this machine's address that other nodes can reach.

A node of a multi-host job must tell the others where its data service listens. When the user
did not say (``node_address`` unset), the right answer is the address of the interface that
routes to the rendezvous host: the kernel picks it when a UDP socket is connected there (no
packet is sent). A rendezvous on loopback gives a loopback address, so a one-machine job stays
on loopback.
"""

from __future__ import annotations

import socket

from burncoll.errors import ConfigError

__all__ = ["resolves_to_loopback", "route_address"]


def route_address(host: str, port: int = 9) -> str:
    """The local address the kernel would use to reach ``host`` (an IP or a name). Raises
    :class:`~burncoll.ConfigError` naming ``host`` when it cannot be resolved or no route leads
    there: set ``node_address`` (``BURNCOLL_NODE_ADDRESS``) then."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)
    except (OSError, UnicodeError) as exc:
        raise ConfigError(
            f"cannot resolve the rendezvous host {host!r} to find this node's address ({exc}); "
            "set node_address (BURNCOLL_NODE_ADDRESS) to an address other nodes can reach"
        ) from None
    errors: list[str] = []
    for family, kind, proto, _, target in infos:
        try:
            with socket.socket(family, kind, proto) as probe:
                probe.connect(target)
                address = probe.getsockname()[0]
        except OSError as exc:
            errors.append(f"{target[0]}: {exc.strerror or exc}")
            continue
        if isinstance(address, str) and address not in ("0.0.0.0", "::"):
            return address.split("%", 1)[0]
    raise ConfigError(
        f"no route from this machine to the rendezvous host {host!r} "
        f"({'; '.join(errors) or 'no address'}); set node_address (BURNCOLL_NODE_ADDRESS) to "
        "an address other nodes can reach"
    )


def resolves_to_loopback(host: str) -> bool:
    """Whether ``host`` (a name or an IP) resolves to a loopback address only, as a name in
    ``/etc/hosts`` mapped to ``127.0.1.1`` does; ``False`` when it does not resolve."""
    try:
        infos = socket.getaddrinfo(host.strip("[]"), None)
    except (OSError, UnicodeError):
        return False
    addresses = {str(info[4][0]) for info in infos}
    return bool(addresses) and all(
        a.startswith("127.") or a in ("::1", "::ffff:127.0.0.1") for a in addresses)
