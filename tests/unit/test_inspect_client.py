"""``ladle inspect``'s addresses: ``host:port``, URLs, and ``--tls-ca`` (https)."""

from __future__ import annotations

import pytest

from ladle.service.errors import ConfigError
from ladle.service.inspect_client import DEFAULT_SERVER, server_url


def test_a_bare_address_is_http() -> None:
    assert server_url("127.0.0.1:8080") == "http://127.0.0.1:8080"
    assert server_url(" http://h:1/ ") == "http://h:1"
    assert server_url(DEFAULT_SERVER) == "http://127.0.0.1:8080"


def test_a_ca_makes_a_bare_address_https() -> None:
    assert server_url("h:8443", tls=True) == "https://h:8443"
    assert server_url(DEFAULT_SERVER, tls=True) == "https://127.0.0.1:8080"
    assert server_url("https://h:8443", tls=True) == "https://h:8443"


def test_a_ca_with_an_http_url_is_refused() -> None:
    with pytest.raises(ConfigError, match="tls_ca: verifies an https:// server"):
        server_url("http://h:8080", tls=True)
