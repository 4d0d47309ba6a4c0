"""The secure defaults, shared by the config, the orchestrator and the CLI.

A collective that listens beyond loopback must carry an auth token unless the user says
``insecure``; an empty token and one under :data:`MIN_TOKEN_BYTES` are refused; a token file
must be a regular file (never a FIFO or a device: it is opened without blocking), readable,
small and private; TLS settings must be ones the transport can honour.
"""

from __future__ import annotations

import ipaddress
import os
import stat
import warnings

from burncoll.errors import ConfigError

__all__ = ["HOW_TO_SET_A_TOKEN", "MAKE_A_TOKEN", "MIN_TOKEN_BYTES", "TOKEN_FILE_LIMIT",
           "check_bind_address", "check_tls_mode", "check_token", "is_loopback", "read_token_file",
           "resolve_token"]

#: Tokens shorter than this (in UTF-8 bytes) are refused: an HMAC over a sniffed handshake
#: lets anyone test guesses offline, and a 4-letter token fell in 0.4 s.
MIN_TOKEN_BYTES = 16
#: Largest token file read (a token is a line; anything larger is a wrong path).
TOKEN_FILE_LIMIT = 4096


def is_loopback(host: str) -> bool:
    """Whether ``host`` names this machine only: ``127.0.0.0/8``, ``::1`` or ``localhost``.

    Any other name is taken as reachable from elsewhere (``0.0.0.0`` and ``::`` bind every
    interface; a host name may resolve to anything).
    """
    name = host.strip().strip("[]").lower()
    if name == "localhost" or name.endswith(".localhost"):
        return True
    try:
        address = ipaddress.ip_address(name.split("%", 1)[0])
    except ValueError:
        return False
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped.is_loopback
    return address.is_loopback


#: The command that prints a strong token.
MAKE_A_TOKEN = "python -c 'import secrets; print(secrets.token_urlsafe(32))'"

#: The advice every missing-token error ends with.
HOW_TO_SET_A_TOKEN = (
    "set a shared token on every node and on the orchestrator: BURNCOLL_AUTH_TOKEN=<secret> "
    "or BURNCOLL_AUTH_TOKEN_FILE=<path> in the environment, or auth_token_file: <path> in the "
    "config (make one with: " + MAKE_A_TOKEN + ")"
)


def check_bind_address(host: str, token: str | None, insecure: bool, subject: str,
                       override: str) -> None:
    """Refuse to listen on a non-loopback ``host`` without a token unless ``insecure``.
    :class:`ConfigError` naming the ``subject`` (``"node_address='0.0.0.0'"``), how to set a token,
    and the ``override`` that accepts the risk."""
    if token is not None or insecure or is_loopback(host):
        return
    raise ConfigError(
        f"{subject} is reachable from other machines, and no auth token is set: anyone who "
        "reaches it could join the collective and read or change its data. To fix it, "
        f"{HOW_TO_SET_A_TOKEN}; or, on a network you fully trust, set {override} to run "
        "without authentication"
    )


def check_token(token: str | None, what: str = "auth_token") -> None:
    """Refuse (:class:`ConfigError`) an empty token and one under :data:`MIN_TOKEN_BYTES` bytes."""
    if token is None:
        return
    if token == "":
        raise ConfigError(
            f"{what}: an empty auth_token authenticates nothing; {HOW_TO_SET_A_TOKEN}, or "
            "leave it unset (no authentication: loopback only)"
        )
    size = len(token.encode("utf-8"))
    if size < MIN_TOKEN_BYTES:
        raise ConfigError(
            f"{what} is only {size} bytes: anyone who sniffs one handshake can test guesses "
            f"offline (a 4-letter token was recovered in 0.4 s); use at least "
            f"{MIN_TOKEN_BYTES} random bytes, made with: {MAKE_A_TOKEN}"
        )


def read_token_file(path: str) -> str:
    """The token in file ``path``, its trailing newline stripped. :class:`ConfigError` naming the
    path when it is missing, unreadable, not a regular file (a FIFO or a device is refused
    without blocking on it), too large, not UTF-8 or empty; a :class:`UserWarning` when group
    or others may read it."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except OSError as exc:
        raise ConfigError(
            f"auth_token_file={path!r}: cannot read the token file: {exc.strerror or exc}"
        ) from None
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise ConfigError(f"auth_token_file={path!r} is not a regular file (a FIFO, device or "
                          "directory); write the token into a plain file (chmod 600)")
    with os.fdopen(fd, "rb") as f:
        raw = f.read(TOKEN_FILE_LIMIT + 1)
    if len(raw) > TOKEN_FILE_LIMIT:
        raise ConfigError(f"auth_token_file={path!r}: over {TOKEN_FILE_LIMIT} bytes; a token "
                          "file holds one line, the token")
    try:
        token = raw.decode("utf-8").rstrip("\r\n")
    except UnicodeDecodeError:
        raise ConfigError(f"auth_token_file={path!r}: the token is not UTF-8 text") from None
    if not token:
        raise ConfigError(f"auth_token_file={path!r}: the file is empty; write the token in it")
    if os.name == "posix" and mode & 0o077:
        warnings.warn(f"auth_token_file={path!r} may be read by other users (mode "
                      f"{stat.S_IMODE(mode):o}); restrict it: chmod 600 {path}", UserWarning,
                      stacklevel=3)
    return token


def resolve_token(token: str | None, token_file: str | None) -> str | None:
    """The token to use: ``token``, or the one read from ``token_file``, checked. Both given: they
    must agree (:class:`ConfigError` otherwise, neither shown). The result passes
    :func:`check_token`."""
    if token_file is not None:
        from_file = read_token_file(token_file)
        if token is not None and token != from_file:
            raise ConfigError(
                f"auth_token and auth_token_file={token_file!r} give different tokens; give "
                "the token one way (BURNCOLL_AUTH_TOKEN or the file), not both"
            )
        token = from_file
    check_token(token, "auth_token" if token_file is None else
                f"the token in auth_token_file={token_file!r}")
    return token


def check_tls_mode(transport: str, tls: bool | None, paths: tuple[str | None, ...]) -> None:
    """Refuse ``tls`` settings that ``transport`` cannot honour (:class:`ConfigError`)."""
    if tls is False and transport == "quic":
        raise ConfigError("tls=false: QUIC always runs TLS; leave tls unset (automatic), or "
                          "choose transport websocket for plain ws")
    if tls is False and any(p is not None for p in paths):
        raise ConfigError("tls=false (plain ws) conflicts with the tls_cert/tls_key/tls_ca "
                          "paths given; remove them, or leave tls unset to use wss")
    if tls is True and transport == "tcp":
        raise ConfigError("tls=true: the tcp transport has no TLS; choose transport websocket "
                          "(wss) or quic, or leave tls unset")
