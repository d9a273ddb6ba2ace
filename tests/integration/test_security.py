"""Tokens, TLS and the exposure check against real ``ladle serve`` processes on loopback.

Certificates are made at test time with ``openssl`` (tests/support/certs.py).
Every server binds 127.0.0.1; the refusal of a non-loopback address happens
before anything is bound.
"""

from __future__ import annotations

import base64
import json
import os
import ssl
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from ladle.client import AuthenticationError, BatchClient, ServerUnavailableError
from ladle.proto import rpc
from ladle.service.security import MAX_WATCHES
from tests.support.certs import Pki, make_pki, openssl_available

from .test_serving import check_rank_stream, consume, reference

TOKEN = "tok-" + "A1b2C3d4E5f6G7h8I9j0-secret"
OTHER = "tok-" + "Z9y8X7w6V5u4T3s2R1q0-wrong!"

Factory = Callable[..., Any]
# one connection per channel (grpc shares one between channels with equal options otherwise)
OWN_CONNECTION = [("grpc.use_local_subchannel_pool", 1)]


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    if not openssl_available():
        pytest.skip("the openssl command is not installed")
    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture
def token_file(tmp_path: Path) -> Path:
    path = tmp_path / "token"
    path.write_text(f"{TOKEN}\n")
    path.chmod(0o600)
    return path


def http_get(
    url: str, headers: dict[str, str] | None = None, context: ssl.SSLContext | None = None
) -> tuple[int, dict[str, str], bytes]:
    request = urllib.request.Request(url, headers=headers or {})
    try:
        with urllib.request.urlopen(request, timeout=30, context=context) as response:
            return response.status, dict(response.headers), response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers), exc.read()


def secure_args(pki: Pki, token_file: Path) -> list[str]:
    """``ladle serve`` options for TLS with the test certificate and a token file."""
    return [
        "--tls-cert",
        str(pki.server_cert),
        "--tls-key",
        str(pki.server_key),
        "--token-file",
        str(token_file),
    ]


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


# --- the token ------------------------------------------------------------------


def test_grpc_calls_need_the_token_and_health_stays_open(
    server_factory: Factory, small_dataset: Path, token_file: Path
) -> None:
    server = server_factory(["--token-file", str(token_file), "--log-level", "DEBUG"])
    # no token, a wrong token: refused at once with a typed error, not retried until the timeout
    for token in (None, OTHER):
        began = time.monotonic()
        client = BatchClient(0, 1, server.address, "sec-a", token=token, timeout=30)
        with client, pytest.raises(AuthenticationError) as info:
            next(iter(client))
        assert time.monotonic() - began < 10
        assert info.value.code == "UNAUTHENTICATED"
        assert ("missing" if token is None else "wrong") in str(info.value)
        assert TOKEN not in str(info.value)
        assert OTHER not in str(info.value)
    # Describe too, with the ladle error trailer
    with grpc.insecure_channel(server.address) as channel:
        with pytest.raises(grpc.RpcError) as call:
            rpc.BatchServiceClient(channel).describe("sec-a", timeout=10)
        assert call.value.code() == grpc.StatusCode.UNAUTHENTICATED
        error = rpc.error_details(call.value.trailing_metadata())
        assert error is not None
        assert error.reason == "unauthenticated"
        # the standard health service answers without a token (probes have none)
        answer = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=""), timeout=10
        )
        assert answer.status == health_pb2.HealthCheckResponse.SERVING
    # the right token: a whole epoch, exactly the schedule
    with BatchClient(0, 1, server.address, "sec-a", token=TOKEN) as client:
        got = consume(client)
    check_rank_stream(small_dataset, reference(small_dataset, 1), 0, got)
    with grpc.insecure_channel(server.address) as channel:
        info_ = rpc.BatchServiceClient(channel, [("authorization", f"Bearer {TOKEN}")]).describe("sec-a", 10)
        assert info_.world_size == 1
    # refusals are counted (3: two streams, one Describe), and the metrics name no token
    status, _, body = http_get(server.http_url + "/metrics", bearer(TOKEN))
    assert status == 200
    assert 'ladle_errors_total{code="UNAUTHENTICATED",face="grpc"} 3.0' in body.decode()
    assert TOKEN.encode() not in body
    # the token is in no log line, even at DEBUG, and neither is the wrong one
    server.stop()
    log = (server.workdir / "server.log").read_text()
    assert "refused" in log
    assert TOKEN not in log
    assert OTHER not in log


def test_the_token_comes_from_the_environment_for_server_and_client(
    server_factory: Factory, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("LADLE_TOKEN", TOKEN)
    server = server_factory()  # the child inherits LADLE_TOKEN
    with BatchClient(0, 1, server.address, "sec-env") as client:
        assert len(consume(client, limit=3)) == 3
    monkeypatch.delenv("LADLE_TOKEN")
    with BatchClient(0, 1, server.address, "sec-env") as client, pytest.raises(AuthenticationError):
        next(iter(client))


def test_a_token_file_with_two_lines_accepts_both(server_factory: Factory, tmp_path: Path) -> None:
    """Rotation: add the new token as a second line, move the trainers, then drop the old line."""
    path = tmp_path / "tokens"
    path.write_text(f"{TOKEN}\n\n{OTHER}\n")
    server = server_factory(["--token-file", str(path)])
    for i, token in enumerate((TOKEN, OTHER)):
        with BatchClient(0, 1, server.address, f"sec-rot-{i}", token=token) as client:
            assert len(consume(client, limit=2)) == 2


def test_http_endpoints_need_the_token_but_health_and_readiness(
    server_factory: Factory, token_file: Path
) -> None:
    server = server_factory(["--token-file", str(token_file)])
    with BatchClient(0, 1, server.address, "sec-http", token=TOKEN) as client:
        consume(client, limit=2)
    base = server.http_url
    for path in ("/healthz", "/readyz", "/openapi.json"):
        assert http_get(base + path)[0] == 200, path
    for path in (
        "/v1/jobs",
        "/v1/jobs/sec-http",
        "/v1/jobs/sec-http/buckets",
        "/v1/jobs/sec-http/schedule?include=samples",
        "/v1/jobs/sec-http/quality",
        "/v1/jobs/sec-http/cursor",
        "/metrics",
    ):
        status, headers, body = http_get(base + path)
        assert status == 401, path
        assert headers["www-authenticate"].startswith("Bearer"), path
        assert json.loads(body)["kind"] == "unauthenticated"
        assert http_get(base + path, bearer(OTHER))[0] == 401, path
        status, _, body = http_get(base + path, bearer(TOKEN))
        assert status == 200, path
        assert TOKEN.encode() not in body, path
    # the page: a browser is asked for the token as a password (any user name)
    status, headers, _ = http_get(base + "/")
    assert status == 401
    assert headers["www-authenticate"].startswith("Basic")
    basic = {"Authorization": "Basic " + base64.b64encode(f"me:{TOKEN}".encode()).decode()}
    status, _, html = http_get(base + "/?job=sec-http", basic)
    assert status == 200
    assert b"sec-http" in html
    assert TOKEN.encode() not in html
    wrong = {"Authorization": "Basic " + base64.b64encode(f"me:{OTHER}".encode()).decode()}
    assert http_get(base + "/", wrong)[0] == 401
    # ladle inspect sends it from --token-file
    ladle = str(Path(sys.executable).with_name("ladle"))
    run = subprocess.run(
        [ladle, "inspect", "--server", base, "--job", "sec-http", "--token-file", str(token_file)],
        capture_output=True,
        text=True,
        timeout=120,
        env={k: v for k, v in os.environ.items() if k != "LADLE_TOKEN"},
    )
    assert run.returncode == 0, run.stderr
    assert "sec-http" in run.stdout
    assert TOKEN not in run.stdout + run.stderr
    refused = subprocess.run(
        [ladle, "inspect", "--server", base],
        capture_output=True,
        text=True,
        timeout=120,
        env={k: v for k, v in os.environ.items() if k != "LADLE_TOKEN"},
    )
    assert refused.returncode == 2
    assert "401" in refused.stderr


# --- TLS ------------------------------------------------------------------------


def test_tls_on_both_faces(server_factory: Factory, small_dataset: Path, pki: Pki, token_file: Path) -> None:
    server = server_factory(secure_args(pki, token_file))
    with BatchClient(0, 1, server.address, "sec-tls", token=TOKEN, root_certificates=pki.ca) as client:
        got = consume(client)
    check_rank_stream(small_dataset, reference(small_dataset, 1), 0, got)
    # PEM bytes work as well as a file name
    with BatchClient(
        0, 1, server.address, "sec-tls-2", token=TOKEN, root_certificates=pki.ca.read_bytes()
    ) as client:
        assert len(consume(client, limit=2)) == 2
    # plain text to a TLS port, and TLS that trusts another CA: no connection, a clear error
    for roots in (None, pki.other_ca):
        client = BatchClient(
            0, 1, server.address, "sec-tls-3", token=TOKEN, timeout=3, root_certificates=roots
        )
        with client, pytest.raises(ServerUnavailableError):
            next(iter(client))
    # HTTPS with the same certificate
    https = f"https://127.0.0.1:{server.http_port}"
    context = ssl.create_default_context(cafile=str(pki.ca))
    assert http_get(https + "/readyz", context=context)[0] == 200
    assert http_get(https + "/v1/jobs", bearer(TOKEN), context)[0] == 200
    with pytest.raises(urllib.error.URLError):
        http_get(https + "/readyz")  # the system's CAs do not know the test CA


def test_mutual_tls_needs_a_client_certificate(server_factory: Factory, pki: Pki, token_file: Path) -> None:
    server = server_factory(
        [
            "--tls-cert", str(pki.server_cert), "--tls-key", str(pki.server_key),
            "--tls-client-ca", str(pki.ca), "--token-file", str(token_file),
        ]
    )  # fmt: skip
    mine = BatchClient(
        0,
        1,
        server.address,
        "sec-mtls",
        token=TOKEN,
        root_certificates=pki.ca,
        client_certificate=pki.client_cert,
        client_key=pki.client_key,
    )
    with mine:
        assert len(consume(mine, limit=2)) == 2
    with (
        BatchClient(
            0, 1, server.address, "sec-mtls", token=TOKEN, root_certificates=pki.ca, timeout=3
        ) as client,
        pytest.raises(ServerUnavailableError),
    ):
        next(iter(client))
    https = f"https://127.0.0.1:{server.http_port}"
    context = ssl.create_default_context(cafile=str(pki.ca))
    with pytest.raises((urllib.error.URLError, ssl.SSLError, ConnectionError)):
        http_get(https + "/readyz", context=context)
    context.load_cert_chain(pki.client_cert, pki.client_key)
    assert http_get(https + "/readyz", context=context)[0] == 200


# --- safe defaults --------------------------------------------------------------


def run_serve(
    dataset: Path, *args: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    ladle = str(Path(sys.executable).with_name("ladle"))
    base = {k: v for k, v in os.environ.items() if k != "LADLE_TOKEN"}
    return subprocess.run(
        [ladle, "serve", str(dataset), "--grpc-port", "0", "--http-port", "0", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env={**base, **(env or {})},
    )


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "10.1.2.3", "ladle.example.com"])
def test_a_reachable_address_without_a_token_is_refused(
    small_dataset: Path, host: str, tmp_path: Path
) -> None:
    """Refused before the dataset is opened or anything is bound."""
    run = run_serve(small_dataset, "--host", host, "--state", str(tmp_path / "s.db"))
    assert run.returncode == 2
    assert "no token is set" in run.stderr
    assert "--insecure" in run.stderr
    assert not (tmp_path / "s.db").exists()


@pytest.mark.parametrize(
    ("args", "field"),
    [
        (["--tls-cert", "cert.pem"], "tls_key"),
        (["--tls-client-ca", "ca.pem"], "tls_client_ca"),
        (["--tls-cert", "nope.pem", "--tls-key", "nope.key"], "tls_cert"),
        (["--token-file", "missing-token"], "token_file"),
    ],
)
def test_bad_security_options_fail_at_start_up(
    small_dataset: Path, tmp_path: Path, args: list[str], field: str
) -> None:
    run = run_serve(small_dataset, *args)
    assert run.returncode == 2, run.stderr
    assert f"{field}:" in run.stderr


def test_a_short_token_is_refused_without_echoing_it(small_dataset: Path) -> None:
    run = run_serve(small_dataset, env={"LADLE_TOKEN": "hunter2"})
    assert run.returncode == 2
    assert "at least 16 characters" in run.stderr
    assert "hunter2" not in run.stderr


def test_a_certificate_that_does_not_match_its_key(small_dataset: Path, pki: Pki) -> None:
    run = run_serve(small_dataset, "--tls-cert", str(pki.server_cert), "--tls-key", str(pki.client_key))
    assert run.returncode == 2
    assert "tls_cert:" in run.stderr


def test_the_stream_is_unchanged_by_token_and_tls(
    server_factory: Factory, pki: Pki, token_file: Path, tmp_path: Path
) -> None:
    """The same batches, byte for byte, with and without the security layers."""
    plain = server_factory()
    secure = server_factory(
        state=tmp_path / "secure.db",
        extra=secure_args(pki, token_file),
    )
    with BatchClient(1, 2, plain.address, "sec-same") as a:
        ours = consume(a, limit=5)
    with BatchClient(1, 2, secure.address, "sec-same", token=TOKEN, root_certificates=pki.ca) as b:
        theirs = consume(b, limit=5)
    for x, y in zip(ours, theirs, strict=True):
        assert x["step"] == y["step"]
        assert np.array_equal(x["input_ids"], y["input_ids"])
        assert np.array_equal(x["sample_ids"], y["sample_ids"])


def test_a_server_without_a_token_ignores_an_authorization_header(module_server: Any) -> None:
    with grpc.insecure_channel(module_server.address) as channel:
        client = rpc.BatchServiceClient(channel, [("authorization", "Bearer whatever")])
        with pytest.raises(grpc.RpcError) as info:
            client.describe("no-such-job", timeout=10)
        assert info.value.code() == grpc.StatusCode.NOT_FOUND


# --- calls without a token hold nothing the trainers need -------------------------


def _reason(error: grpc.RpcError) -> tuple[str, str]:
    """(status code name, ladle reason or "") a call ended with."""
    details = rpc.error_details(error.trailing_metadata())
    return error.code().name, details.reason if details is not None else ""


def test_health_watches_without_a_token_cannot_shut_the_trainers_out(
    server_factory: Factory, token_file: Path
) -> None:
    """More open health Watch calls (no token needed, they never end) than gRPC's old call limit
    (--max-sessions + 64) admitted: beyond MAX_WATCHES each is refused at once, the probes' Check
    answers, a trainer with the token reads, and the refusals are counted and logged once."""
    sessions = 2
    count = sessions + 64 + 50
    server = server_factory(["--token-file", str(token_file), "--max-sessions", str(sessions)])
    channels = [grpc.insecure_channel(server.address, options=OWN_CONNECTION) for _ in range(4)]
    calls: list[Any] = []
    try:
        for i in range(count):
            stub = health_pb2_grpc.HealthStub(channels[i % len(channels)])
            calls.append(stub.Watch(health_pb2.HealthCheckRequest(service=""), timeout=120))
        watching, refusals = 0, []
        for call in calls:
            try:
                assert next(call).status == health_pb2.HealthCheckResponse.SERVING
                watching += 1
            except grpc.RpcError as exc:
                refusals.append(_reason(exc))
        # with every Watch still open: the probes' Check, for the process and for the service
        with grpc.insecure_channel(server.address) as channel:
            for service in ("", rpc.SERVICE):
                answer = health_pb2_grpc.HealthStub(channel).Check(
                    health_pb2.HealthCheckRequest(service=service), timeout=10
                )
                assert answer.status == health_pb2.HealthCheckResponse.SERVING, service
        # and a trainer with the token reads its batches
        with BatchClient(0, 1, server.address, "sec-watch-flood", token=TOKEN, timeout=30) as client:
            assert len(consume(client, limit=20)) == 20
            assert client.reconnects == 0
        assert watching == MAX_WATCHES, f"{watching} Watch calls of {count} stayed open"
        assert set(refusals) == {("RESOURCE_EXHAUSTED", "too_many_watches")}, set(refusals)
        status, _, body = http_get(server.http_url + "/metrics", bearer(TOKEN))
        assert status == 200
        text = body.decode()
        assert f'ladle_calls_refused_total{{reason="too_many_watches"}} {count - MAX_WATCHES}.0' in text
        assert 'ladle_errors_total{code="RESOURCE_EXHAUSTED",face="grpc"}' in text
    finally:
        for call in calls:
            call.cancel()
    try:
        # the cancelled Watches gave their slots back
        deadline = time.monotonic() + 20
        while True:
            again = health_pb2_grpc.HealthStub(channels[0]).Watch(health_pb2.HealthCheckRequest(), timeout=10)
            try:
                assert next(again).status == health_pb2.HealthCheckResponse.SERVING
                break
            except grpc.RpcError:
                assert time.monotonic() < deadline, "the Watch slots were not given back"
                time.sleep(0.1)
            finally:
                again.cancel()
    finally:
        for channel in channels:
            channel.close()
    server.stop()
    lines = [
        line
        for line in (server.workdir / "server.log").read_text().splitlines()
        if "too_many_watches" in line
    ]
    assert 1 <= len(lines) <= 3, f"{len(lines)} log lines for {count - MAX_WATCHES} refused Watch calls"
    assert "Watch" in lines[0]
    assert "limit" in lines[0]


def test_a_trainer_waits_out_a_server_at_its_call_limit(server_factory: Factory, token_file: Path) -> None:
    """Every call slot held (--max-sessions + 64 authenticated calls that send nothing until the
    handshake timeout ends them): the trainer's stream is refused RESOURCE_EXHAUSTED
    (too_many_calls), backs off and gets in once they end, instead of failing at once."""
    server = server_factory(
        ["--token-file", str(token_file), "--max-sessions", "1", "--handshake-timeout", "3"]
    )
    quiet = threading.Event()

    def nothing() -> Iterator[bytes]:
        quiet.wait(60)
        yield from ()

    auth = [("authorization", f"Bearer {TOKEN}")]
    with grpc.insecure_channel(server.address) as channel:
        try:
            silent = [
                channel.stream_unary(rpc.DESCRIBE_METHOD).future(nothing(), timeout=60, metadata=auth)
                for _ in range(1 + 64)
            ]
            # the server is full once one more call is refused
            stub = rpc.BatchServiceClient(channel, auth)
            deadline = time.monotonic() + 10
            while True:
                try:
                    stub.describe("sec-busy", timeout=10, world_size=1)
                except grpc.RpcError as exc:
                    if exc.code() is grpc.StatusCode.RESOURCE_EXHAUSTED:
                        break
                    raise
                assert time.monotonic() < deadline, "the silent calls did not fill the server"
                time.sleep(0.05)
            began = time.monotonic()
            with BatchClient(0, 1, server.address, "sec-busy", token=TOKEN, timeout=30) as client:
                assert len(consume(client, limit=5)) == 5
                assert client.reconnects >= 1, "the client was never refused"
            assert time.monotonic() - began < 20
            assert {_reason(call.exception(timeout=30)) for call in silent} == {
                ("DEADLINE_EXCEEDED", "no_request")
            }
        finally:
            quiet.set()
    status, _, body = http_get(server.http_url + "/metrics", bearer(TOKEN))
    assert status == 200
    assert 'ladle_calls_refused_total{reason="too_many_calls"}' in body.decode()
