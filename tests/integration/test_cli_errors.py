"""The command line's refusals against real processes: taken ports, the wrong port, a closed pipe,
TLS spoken to the wrong port, a mutual-TLS server without a client certificate.

Each one prints one line (``ladle: error: ...``, no traceback) and exits 2,
or, for a reader that went away, ends quietly.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import urllib.request
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from ladle.service import cli
from tests.support.certs import Pki, make_pki, openssl_available
from tests.support.pipes import into_closed_pipe

from .conftest import SMALL_CONFIG, ServerProcess

Factory = Callable[..., ServerProcess]
LADLE = str(Path(sys.executable).with_name("ladle"))


def serve(
    dataset: Path, state: Path, grpc_port: int, timeout: float = 60
) -> subprocess.CompletedProcess[str]:
    """``ladle serve`` on ``grpc_port``, expected to refuse at once (a server that starts is killed)."""
    cmd = [
        LADLE, "serve", str(dataset), "--host", "127.0.0.1", "--grpc-port", str(grpc_port),
        "--http-port", "0", "--state", str(state), "--grace", "0", *SMALL_CONFIG,
    ]  # fmt: skip
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as exc:  # subprocess.run has killed it
        raise AssertionError(
            f"a second ladle serve on port {grpc_port} kept running instead of refusing: {exc.stdout!r}"
        ) from None


def assert_one_line_refusal(done: subprocess.CompletedProcess[str], expected: str) -> None:
    assert done.returncode == 2, f"exit {done.returncode}: {done.stderr[-2000:]}"
    assert "Traceback" not in done.stderr, f"a traceback instead of one line: {done.stderr[-2000:]}"
    lines = [line for line in done.stderr.splitlines() if line.startswith("ladle: error:")]
    assert lines == [expected], f"stderr: {done.stderr[-2000:]}"


def grpc_serving(address: str) -> bool:
    with grpc.insecure_channel(address) as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
    return bool(reply.status == health_pb2.HealthCheckResponse.SERVING)


def test_a_second_server_on_the_same_grpc_port_refuses(
    server_factory: Factory, small_dataset: Path, tmp_path: Path
) -> None:
    first = server_factory()
    done = serve(small_dataset, tmp_path / "second.db", first.port)
    assert_one_line_refusal(
        done,
        f"ladle: error: grpc_port: cannot listen on 127.0.0.1:{first.port}: address already in use; "
        "give another with --grpc-port (0: any free port)",
    )
    assert first.proc is not None
    assert first.proc.poll() is None, "the first server stopped"
    assert grpc_serving(first.address), "the first server no longer answers gRPC"
    with urllib.request.urlopen(first.http_url + "/healthz", timeout=30) as response:
        assert response.status == 200


def test_a_grpc_port_held_by_another_program(small_dataset: Path, tmp_path: Path) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen(1)
        port = sock.getsockname()[1]
        done = serve(small_dataset, tmp_path / "state.db", port)
    assert_one_line_refusal(
        done,
        f"ladle: error: grpc_port: cannot listen on 127.0.0.1:{port}: address already in use; "
        "give another with --grpc-port (0: any free port)",
    )


def test_inspect_on_the_grpc_port_says_so(
    module_server: ServerProcess, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main(["inspect", "--server", module_server.address]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, f"not one line: {err!r}"
    assert "is that the gRPC port? inspect speaks HTTP (--http-port, default 8080)" in err


def test_inspect_into_a_closed_pipe_ends_quietly(module_server: ServerProcess) -> None:
    # the reader (`| head`) has gone before anything is written
    done = into_closed_pipe([LADLE, "inspect", "--server", module_server.http_url, "--json"])
    assert done.stderr == "", f"a closed pipe printed: {done.stderr[-2000:]}"
    assert done.returncode == 1


def inspect_refusal(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    """``ladle inspect ARGV``'s one line of refusal (exit 2)."""
    assert cli.main(["inspect", *argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, f"not one line: {err!r}"
    assert err.startswith("ladle: error: "), err
    return err


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    if not openssl_available():
        pytest.skip("the openssl command is not installed")
    return make_pki(tmp_path_factory.mktemp("pki"))


def test_inspect_with_tls_to_a_plain_port_says_it_does_not_speak_tls(
    module_server: ServerProcess, pki: Pki, capsys: pytest.CaptureFixture[str]
) -> None:
    address = f"127.0.0.1:{module_server.http_port}"
    err = inspect_refusal(capsys, "--server", address, "--tls-ca", str(pki.ca))
    assert "the port does not speak TLS: leave out --tls-ca" in err, err
    assert "is `ladle serve` running there?" not in err, "a running server called unreachable"


def test_inspect_reaches_a_mutual_tls_server_with_a_client_certificate(
    server_factory: Factory, pki: Pki, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in ("LADLE_TLS_CERT", "LADLE_TLS_KEY", "LADLE_TOKEN", "LADLE_TOKEN_FILE"):
        monkeypatch.delenv(name, raising=False)
    server = server_factory(
        [
            "--tls-cert", str(pki.server_cert), "--tls-key", str(pki.server_key),
            "--tls-client-ca", str(pki.ca),
        ]
    )  # fmt: skip
    address = f"127.0.0.1:{server.http_port}"
    # plain text to the TLS port: the server hangs up, which is no sign of the gRPC port
    err = inspect_refusal(capsys, "--server", address)
    assert f"http://{address} closed the connection without answering" in err, err
    assert "try https:// or --tls-ca" in err, err
    assert "gRPC" not in err, "plain text to a TLS port blamed on the gRPC port"
    # TLS without a client certificate: says which options are missing
    err = inspect_refusal(capsys, "--server", address, "--tls-ca", str(pki.ca))
    assert "--tls-cert and --tls-key" in err, err
    assert "gRPC" not in err, "a missing client certificate blamed on the gRPC port"
    # a client certificate the server does not accept (no clientAuth use), a server from another CA
    refused = ["--tls-cert", str(pki.server_cert), "--tls-key", str(pki.server_key)]
    err = inspect_refusal(capsys, "--server", address, "--tls-ca", str(pki.ca), *refused)
    assert "wants a client certificate signed by its CA: --tls-cert and --tls-key" in err, err
    err = inspect_refusal(capsys, "--server", address, "--tls-ca", str(pki.other_ca))
    assert f"https://{address}'s certificate is not trusted (" in err, err
    assert "is `ladle serve` running there?" not in err, "a running server called unreachable"
    # with one, from the options and from the environment as BatchClient reads it
    cert = ["--tls-cert", str(pki.client_cert), "--tls-key", str(pki.client_key)]
    assert cli.main(["inspect", "--server", address, "--tls-ca", str(pki.ca), *cert]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"server https://{address}: dataset "), out
    monkeypatch.setenv("LADLE_TLS_CERT", str(pki.client_cert))
    monkeypatch.setenv("LADLE_TLS_KEY", str(pki.client_key))
    assert cli.main(["inspect", "--server", address, "--tls-ca", str(pki.ca), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["server"] == f"https://{address}"
