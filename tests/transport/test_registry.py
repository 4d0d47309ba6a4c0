"""``get_transport``: names, options and a missing optional dependency."""

from __future__ import annotations

import sys

import pytest

from burncoll.errors import ConfigError
from burncoll.transport import TRANSPORT_NAMES, TlsSettings, Transport, get_transport


@pytest.mark.parametrize("name", TRANSPORT_NAMES)
def test_every_name_gives_its_transport(name: str) -> None:
    transport = get_transport(name, tls=TlsSettings(), max_message_bytes=1234)
    assert isinstance(transport, Transport) and transport.name == name
    assert transport.max_message_bytes == 1234  # type: ignore[attr-defined]


def test_an_unknown_name_lists_the_choices() -> None:
    with pytest.raises(ConfigError, match="'websocket', 'quic'"):
        get_transport("carrier-pigeon")


def test_a_non_positive_size_limit_is_refused() -> None:
    with pytest.raises(ConfigError, match="max_message_bytes"):
        get_transport("websocket", max_message_bytes=0)


def test_quic_without_aioquic_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    for module in list(sys.modules):
        if module == "aioquic" or module.startswith("aioquic."):
            monkeypatch.setitem(sys.modules, module, None)
    monkeypatch.setitem(sys.modules, "aioquic", None)
    for module in list(sys.modules):
        if module.startswith("burncoll.transport.quic"):
            monkeypatch.delitem(sys.modules, module)
    with pytest.raises(ConfigError, match=r"pip install 'burncoll\[quic\]'"):
        get_transport("quic")
