"""``ladle inspect``'s client: addresses (``host:port``, URLs, https), and what it says when a
server gives no usable answer, against loopback servers that misbehave on purpose."""

from __future__ import annotations

import json
import socket
import ssl
import threading
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any

import pytest

from ladle.proto.codec import JOB_NAME_RULE
from ladle.service.errors import ConfigError
from ladle.service.inspect_client import (
    DEFAULT_SERVER,
    InspectError,
    fetch_report,
    server_url,
    tls_context,
)
from tests.support.certs import Pki, make_pki, openssl_available


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


def test_a_client_certificate_with_an_http_url_is_refused(tmp_path: Path) -> None:
    # refused before the files are read, naming the option that asks for TLS
    with pytest.raises(ConfigError, match="tls_cert: is for an https:// server, but --server is http://h:1"):
        fetch_report("http://h:1", certfile=str(tmp_path / "c.pem"), keyfile=str(tmp_path / "c.key"))


# --- what a server that gives no usable answer is told apart by -------------------


@contextmanager
def answering(reply: bytes, tls: ssl.SSLContext | None = None) -> Iterator[str]:
    """A loopback server that reads each request (or TLS hello), writes ``reply`` and hangs up.

    With ``tls``, it speaks TLS with that server context first.
    """
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(0.1)
    done = threading.Event()

    def serve() -> None:
        while not done.is_set():
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                continue
            with conn, suppress(OSError):  # a client that hung up first, a refused handshake
                conn.settimeout(10)
                with tls.wrap_socket(conn, server_side=True) if tls else conn as talk:
                    talk.recv(65536)
                    talk.sendall(reply)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield f"127.0.0.1:{listener.getsockname()[1]}"
    finally:
        done.set()
        thread.join(timeout=10)
        listener.close()


def refusal(server: str, **options: Any) -> str:
    with pytest.raises(InspectError) as info:
        fetch_report(server, **options)
    return str(info.value)


def test_a_connection_closed_without_an_answer_is_not_blamed_on_the_grpc_port() -> None:
    # a server restarting, or plain http:// to a TLS port, hangs up without a word
    with answering(b"") as server:
        message = refusal(server)
    assert message == (
        f"http://{server} closed the connection without answering (RemoteDisconnected): "
        "a server restarting, or a TLS port: try https:// or --tls-ca"
    ), message
    assert "gRPC" not in message, "a closed connection blamed on the gRPC port"


def test_an_answer_cut_short_is_a_closed_connection() -> None:
    with answering(b'HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n{"jobs"') as server:
        message = refusal(server)
    assert "closed the connection before its answer was whole (IncompleteRead)" in message, message
    assert "gRPC" not in message, "a cut answer blamed on the gRPC port"


def test_an_answer_that_is_not_http_gets_the_grpc_hint() -> None:
    settings = b"\x00\x00\x06\x04\x00\x00\x00\x00\x00\x00\x03\x00\x00\x00\x64"  # an HTTP/2 SETTINGS frame
    with answering(settings) as server:
        message = refusal(server)
    assert "did not answer HTTP (BadStatusLine): is that the gRPC port?" in message, message


def http_answer(status: str, doc: Any) -> bytes:
    body = json.dumps(doc).encode()
    head = f"HTTP/1.1 {status}\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    return head.encode() + body


def test_a_422_is_one_readable_line() -> None:
    detail = [
        {
            "type": "string_pattern_mismatch",
            "loc": ["path", "job"],
            "msg": "String should match pattern '^[A-Za-z0-9._:-]{1,200}$'",
            "input": "x y",
            "ctx": {"pattern": "^[A-Za-z0-9._:-]{1,200}$"},
        },
        {"type": "int_parsing", "loc": ["query", "epoch"], "msg": "Input should be a valid integer"},
    ]
    with answering(http_answer("422 Unprocessable Entity", {"detail": detail})) as server:
        message = refusal(server)
    assert message.endswith(
        "HTTP 422: job: String should match pattern '^[A-Za-z0-9._:-]{1,200}$'; "
        "epoch: Input should be a valid integer"
    ), message
    assert "string_pattern_mismatch" not in message, "FastAPI's raw error list reached the user"


def test_a_401_says_how_inspect_sends_the_token() -> None:
    refused = {"detail": "missing token", "kind": "unauthenticated", "field": None}
    with answering(http_answer("401 Unauthorized", refused)) as server:
        message = refusal(server)
    assert "HTTP 401: missing token (ladle inspect: --token-file FILE" in message, message


def test_a_bad_job_name_is_refused_before_any_request() -> None:
    with answering(b"") as server, pytest.raises(ConfigError) as info:
        fetch_report(server, "bad name")
    assert str(info.value) == f"job: must be {JOB_NAME_RULE}, got 'bad name'"


def test_a_client_certificate_needs_its_key() -> None:
    for files in ({"certfile": "c.pem"}, {"keyfile": "c.key"}):
        with pytest.raises(ConfigError, match="tls_cert: --tls-cert and --tls-key go together"):
            tls_context(**files)


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    if not openssl_available():
        pytest.skip("the openssl command is not installed")
    return make_pki(tmp_path_factory.mktemp("pki"))


def test_tls_to_a_plain_http_port_says_it_does_not_speak_tls(pki: Pki) -> None:
    # a plain HTTP server answers the TLS hello with a 400 in clear text
    with answering(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n") as server:
        message = refusal(server, cafile=str(pki.ca))
    assert message == (
        f"https://{server} did not answer TLS (WRONG_VERSION_NUMBER): the port does not speak TLS: "
        "leave out --tls-ca (and https://) for a plain-HTTP server"
    ), message


def test_a_client_certificate_that_cannot_be_used_is_named(pki: Pki) -> None:
    with pytest.raises(ConfigError, match=f"tls_cert: cannot use {pki.client_cert} with the key {pki.ca}"):
        tls_context(str(pki.ca), str(pki.client_cert), str(pki.ca))  # a certificate is no key


@pytest.mark.parametrize("version", [ssl.TLSVersion.TLSv1_2, ssl.TLSVersion.TLSv1_3])
def test_a_server_that_wants_a_client_certificate_says_which_options(
    pki: Pki, version: ssl.TLSVersion
) -> None:
    # TLS 1.2 refuses in the handshake (an alert); TLS 1.3 after it (the connection closes)
    mutual = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    mutual.load_cert_chain(pki.server_cert, pki.server_key)
    mutual.load_verify_locations(pki.ca)
    mutual.verify_mode = ssl.CERT_REQUIRED
    mutual.minimum_version = mutual.maximum_version = version
    with answering(http_answer("200 OK", {}), tls=mutual) as server:
        message = refusal(server, cafile=str(pki.ca))
    assert "--tls-cert and --tls-key" in message, message
    assert "gRPC" not in message, "a missing client certificate blamed on the gRPC port"
