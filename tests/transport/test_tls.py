"""TLS on both transports: verified certificates, a wrong CA, and bad settings."""

from __future__ import annotations

import asyncio
import ssl

import pytest

from burncoll.errors import ConfigError, TransportError
from burncoll.transport.base import Connection, TlsSettings
from burncoll.transport.quic import QuicTransport
from burncoll.transport.tls import client_ssl_context, make_self_signed, server_ssl_context
from burncoll.transport.websocket import WebSocketTransport

from .support import HOST, connected, run


def _verified() -> TlsSettings:
    cert, key = make_self_signed(HOST)
    return TlsSettings(cert, key, ca=cert)


def _other_ca() -> str:
    return make_self_signed("other.invalid")[0]  # a different key: does not sign ours


TransportClass = type[WebSocketTransport] | type[QuicTransport]


def test_self_signed_certificates_are_cached_and_self_verifying() -> None:
    assert make_self_signed(HOST) == make_self_signed(HOST)
    server = server_ssl_context(_verified())
    client = client_ssl_context(_verified())
    assert client.verify_mode == ssl.CERT_REQUIRED and client.check_hostname
    assert server.minimum_version >= ssl.TLSVersion.TLSv1_2


@pytest.mark.parametrize("kind", [WebSocketTransport, QuicTransport])
def test_a_verified_certificate_connects(kind: TransportClass) -> None:
    async def body() -> None:
        async with connected(kind(tls=_verified())) as (client, server, _):
            await client.send([b"over tls"])
            assert await server.recv() == b"over tls"

    run(body())


@pytest.mark.parametrize("kind", [WebSocketTransport, QuicTransport])
def test_a_certificate_from_another_ca_is_refused(kind: TransportClass) -> None:
    async def body() -> None:
        server = kind(tls=_verified())
        cert, key = make_self_signed(HOST)
        client = kind(tls=TlsSettings(cert, key, ca=_other_ca()), connect_timeout=5.0)
        with pytest.raises(TransportError):
            async with asyncio.timeout(8), connected(server, client):
                pass

    run(body())


def test_websocket_without_tls_settings_is_plain_and_with_them_is_wss() -> None:
    assert WebSocketTransport(tls=TlsSettings()).tls is None
    assert WebSocketTransport(tls=None).tls is None
    assert WebSocketTransport(tls=_verified()).tls is not None


def test_quic_without_certificates_uses_an_ephemeral_one() -> None:
    async def body() -> None:
        async with connected(QuicTransport(tls=TlsSettings())) as (client, server, _):
            await server.send([b"encrypted anyway"])
            assert await client.recv() == b"encrypted anyway"

    run(body())


@pytest.mark.parametrize(
    "settings",
    [
        TlsSettings(cert="/nonexistent/cert.pem"),
        TlsSettings(ca="/nonexistent/ca.pem"),
        TlsSettings(cert="/nonexistent/cert.pem", key="/nonexistent/key.pem"),
    ],
)
@pytest.mark.parametrize("kind", [WebSocketTransport, QuicTransport])
def test_unusable_tls_settings_raise_config_error(
    kind: TransportClass, settings: TlsSettings
) -> None:
    async def handler(conn: Connection) -> None:
        pass

    async def body() -> None:
        with pytest.raises(ConfigError):
            listener = await kind(tls=settings).listen(HOST, 0, handler)
            await listener.close()

    run(body())


def test_listeners_started_at_once_in_several_threads_share_one_certificate() -> None:
    """A listener presents make_self_signed's certificate and binds the token to it by a
    second call: threads racing through a first call must all get the same one."""
    import secrets
    import threading

    host = f"race-{secrets.token_hex(4)}.invalid"  # never made before in this process
    start = threading.Barrier(8)
    got: list[tuple[str, str]] = []

    def make() -> None:
        start.wait(10)
        got.append(make_self_signed(host))

    threads = [threading.Thread(target=make) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert len(got) == 8 and len(set(got)) == 1, got
