"""TLS material for the transports: ephemeral certificates, ``ssl`` contexts, QUIC settings.

WebSocket uses TLS (``wss``) when any field of :class:`~burncoll.transport.base.TlsSettings` is
set; QUIC always does. ``cert`` and ``key``: the listener presents that certificate, else an
ephemeral self-signed one (:func:`make_self_signed`). ``ca``: connecting sides verify the
listener's certificate and host name against it; without it the channel is encrypted but only
the token challenge (:mod:`burncoll.transport.auth`) identifies the peer, which an active
man-in-the-middle can relay: set ``ca`` on networks you do not trust. Imports neither
``websockets`` nor ``aioquic``.
"""

from __future__ import annotations

import atexit
import datetime
import functools
import hashlib
import ipaddress
import os
import ssl
import tempfile
import threading
from typing import Any

from burncoll.errors import ConfigError
from burncoll.transport.base import TlsSettings

__all__ = ["binding_of_certificate", "client_ssl_context", "configure_quic_client",
           "configure_quic_server", "listener_binding", "make_self_signed", "server_certificate",
           "server_ssl_context"]

#: Names every ephemeral certificate is valid for, besides the host it was made for.
_LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")


_SELF_SIGNED: dict[str, tuple[str, str]] = {}
_SELF_SIGNED_LOCK = threading.Lock()


def make_self_signed(host: str = "127.0.0.1") -> tuple[str, str]:
    """Write a fresh self-signed certificate for ``host`` and return ``(cert_path, key_path)``.

    Made once per process and host (every listener of a process shares it), in a private temporary
    directory removed at exit; valid for ``host`` and the loopback names for 30 days, and usable as
    its own trust anchor (``TlsSettings(cert, key, ca=cert)``). Thread-safe: an unguarded cache
    once let two threads each make one, a listener then presented one certificate and bound the
    token to the other, and every node was refused as having the wrong token.
    """
    with _SELF_SIGNED_LOCK:
        made = _SELF_SIGNED.get(host)
        if made is None:
            made = _SELF_SIGNED[host] = _write_self_signed(host)
        return made


def _write_self_signed(host: str) -> tuple[str, str]:
    """A new self-signed certificate and key for ``host``, written to a private directory."""
    # Imported here: ``cryptography`` is needed only where a certificate is generated.
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"burncoll {host}")])
    now = datetime.datetime.now(datetime.UTC)
    alt_names: list[x509.GeneralName] = []
    for entry in dict.fromkeys((host, *_LOOPBACK_NAMES)):
        try:
            alt_names.append(x509.IPAddress(ipaddress.ip_address(entry)))
        except ValueError:
            alt_names.append(x509.DNSName(entry))
    public_key = key.public_key()
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(public_key)
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=30))
        .add_extension(x509.SubjectAlternativeName(alt_names), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(public_key), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(public_key),
                       critical=False)
        .sign(key, hashes.SHA256())
    )
    directory = tempfile.TemporaryDirectory(prefix="burncoll-tls-")
    atexit.register(directory.cleanup)
    cert_path = os.path.join(directory.name, "cert.pem")
    key_path = os.path.join(directory.name, "key.pem")
    with open(cert_path, "wb") as f:
        f.write(cert.public_bytes(serialization.Encoding.PEM))
    fd = os.open(key_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(
            key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                              serialization.NoEncryption())
        )
    return cert_path, key_path


def server_certificate(settings: TlsSettings, host: str) -> tuple[str, str]:
    """The ``(cert, key)`` paths a listener on ``host`` presents under ``settings``. Raises
    :class:`~burncoll.ConfigError` when only one of ``cert`` and ``key`` is set, or when ``ca`` is
    set without them."""
    if settings.cert is None and settings.key is None:
        if settings.ca is not None:
            raise ConfigError(
                "TLS ca is set but cert and key are not: peers verifying against that CA "
                "would reject this listener's ephemeral certificate; set cert and key too"
            )
        return make_self_signed(host)
    if settings.cert is None or settings.key is None:
        raise ConfigError("TLS needs both a certificate and its private key (cert and key)")
    return settings.cert, settings.key


def binding_of_certificate(der: bytes) -> bytes:
    """The RFC 5929 ``tls-server-end-point`` channel binding of a DER certificate: its
    SHA-256 (the hash RFC 5929 section 4.1 prescribes for SHA-256 and weaker signatures; this
    module makes ECDSA-SHA256 certificates)."""
    return hashlib.sha256(der).digest()


@functools.cache
def _certificate_der(cert_path: str) -> bytes:
    with open(cert_path, "rb") as f:
        pem = f.read()
    start = pem.find(b"-----BEGIN CERTIFICATE-----")
    if start < 0:
        raise ConfigError(f"{cert_path} holds no PEM certificate")
    return ssl.PEM_cert_to_DER_cert(pem[start:].decode("ascii", errors="replace"))


def listener_binding(settings: TlsSettings | None, host: str) -> bytes:
    """The channel binding of the certificate a listener on ``host`` presents (the first one
    of its chain); see :func:`binding_of_certificate`."""
    cert, _ = server_certificate(settings or TlsSettings(), host)
    try:
        return binding_of_certificate(_certificate_der(cert))
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot read TLS certificate {cert}: {exc}") from exc


def server_ssl_context(settings: TlsSettings, host: str = "127.0.0.1") -> ssl.SSLContext:
    """An ``ssl`` server context (TLS 1.2 or later) presenting the certificate for ``host``. Raises
    :class:`~burncoll.ConfigError` when the files cannot be loaded."""
    cert, key = server_certificate(settings, host)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        context.load_cert_chain(cert, key)
    except (OSError, ssl.SSLError) as exc:
        raise ConfigError(f"cannot load TLS certificate {cert} / key {key}: {exc}") from exc
    return context


def client_ssl_context(settings: TlsSettings) -> ssl.SSLContext:
    """An ``ssl`` client context: verifying against ``settings.ca`` or, without it, not at all.
    Raises :class:`~burncoll.ConfigError` when ``ca`` cannot be loaded."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    if settings.ca is None:
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
        return context
    try:
        context.load_verify_locations(cafile=settings.ca)
    except (OSError, ssl.SSLError) as exc:
        raise ConfigError(f"cannot load TLS CA file {settings.ca}: {exc}") from exc
    return context


def configure_quic_server(configuration: Any, settings: TlsSettings | None, host: str) -> None:
    """Load the listener's certificate into an aioquic ``QuicConfiguration``. ``settings=None`` is
    read as ``TlsSettings()``: QUIC always runs TLS. Raises :class:`~burncoll.ConfigError` when the
    files cannot be loaded."""
    cert, key = server_certificate(settings or TlsSettings(), host)
    try:
        configuration.load_cert_chain(cert, key)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot load TLS certificate {cert} / key {key}: {exc}") from exc


def configure_quic_client(configuration: Any, settings: TlsSettings | None) -> None:
    """Set certificate verification on an aioquic client ``QuicConfiguration``. With ``settings.ca``
    the server is verified against it, host name included; otherwise verification is off
    (``ssl.CERT_NONE``) and the shared token authenticates the peer."""
    if settings is None or settings.ca is None:
        configuration.verify_mode = ssl.CERT_NONE
        return
    if not os.path.isfile(settings.ca):
        raise ConfigError(f"TLS CA file {settings.ca} does not exist")
    configuration.verify_mode = ssl.CERT_REQUIRED
    configuration.load_verify_locations(cafile=settings.ca)
