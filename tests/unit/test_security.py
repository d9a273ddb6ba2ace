"""The token check, token files, the exposure check and TLS options (service/security.py)."""

from __future__ import annotations

import base64
import logging
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ladle.service.errors import ConfigError
from ladle.service.security import (
    AuthenticationError,
    RefusalLog,
    TlsFiles,
    TokenCheck,
    check_exposure,
    is_loopback,
    load_tokens,
)
from tests.support.certs import make_pki, openssl_available

TOKEN = "0123456789abcdef-token"
NEW = "fedcba9876543210-token"


def basic(user: str, password: str) -> str:
    return "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()


def test_bearer_and_basic_headers() -> None:
    check = TokenCheck([TOKEN])
    assert check.allows(f"Bearer {TOKEN}")
    assert check.allows(f"bearer {TOKEN}")  # the scheme is case-insensitive (RFC 7235)
    assert check.allows(f"Bearer {TOKEN}".encode())
    assert check.allows(basic("anyone", TOKEN))
    assert check.allows(basic("", TOKEN))
    for header in (
        None,
        "",
        TOKEN,
        f"Bearer {TOKEN}x",
        f"Bearer {TOKEN[:-1]}",
        f"Token {TOKEN}",
        f"Bearer {NEW}",
        basic(TOKEN, "x"),  # the token as the user name is not the password
        "Basic !!not-base64!!",
        "Bearer",
    ):
        assert not check.allows(header), header


def test_every_accepted_token_works() -> None:
    check = TokenCheck([TOKEN, NEW])
    assert check.allows(f"Bearer {TOKEN}")
    assert check.allows(f"Bearer {NEW}")
    assert "token" in repr(check)
    assert TOKEN not in repr(check)


@given(st.one_of(st.text(max_size=80), st.binary(max_size=80)))
def test_no_header_but_the_token_passes_and_nothing_raises_but_the_typed_error(header: str | bytes) -> None:
    check = TokenCheck([TOKEN])
    assert check.allows(header) is False
    with pytest.raises(AuthenticationError) as info:
        check.check(header)
    assert TOKEN not in str(info.value)


def test_the_error_says_missing_or_wrong_and_never_echoes() -> None:
    check = TokenCheck([TOKEN])
    with pytest.raises(AuthenticationError, match="missing token"):
        check.check(None)
    with pytest.raises(AuthenticationError, match="wrong token") as info:
        check.check(f"Bearer {NEW}")
    assert NEW not in str(info.value)
    assert AuthenticationError.kind == "unauthenticated"


def test_token_files(tmp_path: Path) -> None:
    path = tmp_path / "token"
    path.write_text(f"  {TOKEN}  \n\n{NEW}\n")
    assert load_tokens(path) == (TOKEN, NEW)
    # the file wins over the environment; no file, no environment: no authentication
    assert load_tokens(path, env="x" * 20) == (TOKEN, NEW)
    assert load_tokens(None, env=f" {TOKEN}\n") == (TOKEN,)
    assert load_tokens(None, env="") == ()


def test_token_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LADLE_TOKEN", TOKEN)
    assert load_tokens() == (TOKEN,)
    monkeypatch.delenv("LADLE_TOKEN")
    assert load_tokens() == ()


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("", "holds no token"),
        ("\n  \n", "holds no token"),
        ("short\n", "at least 16 characters"),
        ("a token with spaces in it\n", "visible ASCII"),
        ("tökentökentökentöken\n", "visible ASCII"),
        ("change-me-to-a-long-random-token\n", "example Secret's placeholder"),  # published in deploy/
    ],
)
def test_bad_token_files_name_the_file_never_the_token(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "token"
    path.write_text(text, encoding="utf-8")
    with pytest.raises(ConfigError, match=message) as info:
        load_tokens(path)
    assert str(path) in str(info.value)
    if text.strip():
        assert text.strip() not in str(info.value)


def test_an_unreadable_token_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read") as info:
        load_tokens(tmp_path / "missing")
    assert info.value.field == "token_file"
    (tmp_path / "bin").write_bytes(b"\xff\xfe" * 20)
    with pytest.raises(ConfigError, match="cannot read"):
        load_tokens(tmp_path / "bin")


@pytest.mark.parametrize(
    ("host", "loopback"),
    [
        ("127.0.0.1", True),
        ("127.1.2.3", True),
        ("::1", True),
        ("[::1]", True),
        ("localhost", True),
        ("LOCALHOST", True),
        ("localhost.", True),
        ("localhost..", False),
        ("0.0.0.0", False),
        ("::", False),
        ("10.0.0.5", False),
        ("ladle.internal", False),
    ],
)
def test_is_loopback(host: str, loopback: bool) -> None:
    assert is_loopback(host) is loopback


def test_exposure_needs_a_token_or_insecure(caplog: pytest.LogCaptureFixture) -> None:
    check_exposure("127.0.0.1", token=False, tls=False, insecure=False)  # loopback: nothing to say
    with pytest.raises(ConfigError, match="no token is set") as info:
        check_exposure("0.0.0.0", token=False, tls=False, insecure=False)
    assert info.value.field == "host"
    with caplog.at_level(logging.WARNING, logger="ladle.security"):
        check_exposure("0.0.0.0", token=False, tls=True, insecure=True)
    assert "INSECURE" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="ladle.security"):
        check_exposure("0.0.0.0", token=True, tls=False, insecure=False)
    assert "clear text" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="ladle.security"):
        check_exposure("0.0.0.0", token=True, tls=True, insecure=False)
    assert caplog.text == ""


def test_tls_options(tmp_path: Path) -> None:
    assert TlsFiles.from_options(None, None) is None
    with pytest.raises(ConfigError) as info:
        TlsFiles.from_options("cert.pem", None)
    assert info.value.field == "tls_key"
    with pytest.raises(ConfigError) as info:
        TlsFiles.from_options(None, "key.pem")
    assert info.value.field == "tls_cert"
    with pytest.raises(ConfigError) as info:
        TlsFiles.from_options(None, None, "ca.pem")
    assert info.value.field == "tls_client_ca"
    with pytest.raises(ConfigError, match="no such file"):
        TlsFiles.from_options(tmp_path / "c.pem", tmp_path / "k.pem")


@pytest.mark.skipif(not openssl_available(), reason="the openssl command is not installed")
def test_tls_files_are_checked_at_start_up(tmp_path: Path) -> None:
    pki = make_pki(tmp_path)
    files = TlsFiles.from_options(pki.server_cert, pki.server_key, pki.ca)
    assert files is not None
    options = files.uvicorn_options()
    assert options["ssl_certfile"] == str(pki.server_cert)
    assert options["ssl_ca_certs"] == str(pki.ca)
    assert files.grpc_credentials() is not None
    with pytest.raises(ConfigError, match="cannot use"):
        TlsFiles.from_options(pki.server_cert, pki.client_key)  # a key of another certificate


def test_refusals_are_logged_once_a_minute_with_the_count_held_back(caplog: pytest.LogCaptureFixture) -> None:
    """A flood of refused calls is one log line a minute per kind, the next line saying how many."""
    now = [1000.0]
    refusals = RefusalLog(every=60.0, clock=lambda: now[0])
    with caplog.at_level(logging.INFO, logger="ladle.security"):
        logged = [refusals("too_many_watches", logging.WARNING, "refused Watch") for _ in range(500)]
        assert logged == [True] + [False] * 499
        assert refusals("token:/ladle.v1.BatchService/Stream:missing", logging.INFO, "refused Stream")
        now[0] += 61
        assert refusals("too_many_watches", logging.WARNING, "refused Watch")
        assert not refusals("too_many_watches", logging.WARNING, "refused Watch")
    lines = [(r.levelno, r.getMessage()) for r in caplog.records if r.name == "ladle.security"]
    assert lines == [
        (logging.WARNING, "refused Watch"),
        (logging.INFO, "refused Stream"),
        (logging.WARNING, "refused Watch (499 more like it since the last such line, 61 s ago)"),
    ]
