"""The exceptions burncoll raises, one tree under :class:`CollectiveError`.

::

    CollectiveError                 every error burncoll raises on purpose
    ├── ConfigError (ValueError)    a bad CollectiveConfig field, YAML file or environment variable
    ├── UsageError (ValueError)     you misused the API on this peer: a root that is not a peer,
    │                               an array of another backend, a call after finish()
    ├── BackendUnavailable (ImportError)
    │                               the array library of a backend is not installed
    ├── MismatchError               peers called the same operation with a different op kind,
    │                               reduce op, shape, dtype or root; lists what each peer passed
    ├── CollectiveTimeout           a deadline passed; names the operation, its sequence number
    │                               and the peers that never arrived or never finished
    ├── PeerLost                    a node's connection broke or its process died mid-collective
    ├── CollectiveAborted           the collective failed earlier; every later call raises this
    │                               at once (the first failure is in ``__cause__``) until the
    │                               peers register again
    ├── AuthenticationError         a connection failed the shared-token challenge
    └── TransportError              a socket could not be bound, reached or kept open
        └── ProtocolError           a peer sent bytes that are not a valid burncoll frame

The split follows h11: :class:`ConfigError` and :class:`UsageError` are *your* mistake on this
peer and are raised before anything is sent; :class:`MismatchError`, :class:`PeerLost` and
:class:`ProtocolError` say that *another* peer misbehaved. Errors caused by another peer reach
every peer of the collective, never only one.
"""

from __future__ import annotations

__all__ = [
    "AuthenticationError",
    "BackendUnavailable",
    "CollectiveAborted",
    "CollectiveError",
    "CollectiveTimeout",
    "ConfigError",
    "MismatchError",
    "PeerLost",
    "ProtocolError",
    "TransportError",
    "UsageError",
    "error_named",
]


class CollectiveError(Exception):
    """Base of every error burncoll raises on purpose."""


class ConfigError(CollectiveError, ValueError):
    """A configuration value is invalid; the message names the field and the accepted values."""


class UsageError(CollectiveError, ValueError):
    """The API was misused on this peer (raised before any data is exchanged)."""


class BackendUnavailable(CollectiveError, ImportError):
    """The array library behind a backend is not installed; the message names the extra."""


class MismatchError(CollectiveError):
    """Peers called the same operation with different arguments.

    The message lists what each peer (or node) passed.
    """


class CollectiveTimeout(CollectiveError, TimeoutError):
    """An operation did not complete within ``config.timeout`` seconds.

    The message names the operation, its sequence number, the peers that never arrived and the
    peers that arrived but did not finish.
    """


class PeerLost(CollectiveError, ConnectionError):
    """A node of the collective disconnected or died; the message names it."""


class CollectiveAborted(CollectiveError):
    """The collective failed earlier; register the peers again to use it.

    ``__cause__`` holds the original failure.
    """


class AuthenticationError(CollectiveError, PermissionError):
    """A connection failed authentication with the shared token."""


class TransportError(CollectiveError, ConnectionError):
    """A socket could not be bound, reached, or kept open."""


class ProtocolError(TransportError):
    """Bytes received were not a valid burncoll frame (bad magic, version, size, or field)."""


def error_named(name: str) -> type[CollectiveError]:
    """The error class another node named in a message (its ``__name__``); a name that is not
    one of the classes above arrives as a :class:`CollectiveError`."""
    return _BY_NAME.get(name, CollectiveError)


_BY_NAME: dict[str, type[CollectiveError]] = {
    cls.__name__: cls for cls in (
        CollectiveError, ConfigError, UsageError, BackendUnavailable, MismatchError,
        CollectiveTimeout, PeerLost, AuthenticationError, TransportError, ProtocolError)
}
