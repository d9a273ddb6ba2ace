"""Readiness on the gRPC health service, against real ``ladle serve`` processes.

The status of ``ladle.v1.BatchService`` follows the readiness check that
``/readyz`` answers (the dataset is as it was opened, the cursor store
answers), so Kubernetes can probe readiness on the gRPC port; the overall
status (service ``""``) stays ``SERVING`` while the process serves, so a
liveness probe never restarts a server whose store is away.
"""

from __future__ import annotations

import http.client
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from ladle.client import BatchClient, ServerUnavailableError
from ladle.proto import rpc
from ladle.service.http.server import HTTP_MAX_CONNECTIONS
from ladle.service.server import READY_CHECK_S
from tests.support.certs import Pki, make_pki, openssl_available

from .conftest import ServerProcess
from .test_hostile import serve_a_copy

Factory = Callable[..., ServerProcess]
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
# the watcher checks every READY_CHECK_S and waits at most 1 s for the store; slack for a busy machine
WITHIN_S = 6 * READY_CHECK_S + 10


@contextmanager
def health_stub(server: ServerProcess) -> Iterator[Any]:
    with grpc.insecure_channel(server.address) as channel:
        yield health_pb2_grpc.HealthStub(channel)


def status(stub: Any, service: str) -> int:
    answer = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=10)
    return int(answer.status)


def wait_for_status(stub: Any, service: str, want: int) -> float:
    """Seconds until ``service`` reports ``want`` (fails after ``WITHIN_S``)."""
    began = time.monotonic()
    while (got := status(stub, service)) != want:
        assert time.monotonic() - began < WITHIN_S, f"{service or 'overall'} stayed {got}, not {want}"
        time.sleep(0.1)
    return time.monotonic() - began


def http_get(server: ServerProcess, path: str) -> tuple[int, str]:
    conn = http.client.HTTPConnection("127.0.0.1", server.http_port, timeout=30)
    try:
        conn.request("GET", path)
        response = conn.getresponse()
        return response.status, response.read().decode()
    finally:
        conn.close()


def readyz(server: ServerProcess) -> int:
    return http_get(server, "/readyz")[0]


def metrics(server: ServerProcess) -> str:
    status, body = http_get(server, "/metrics")
    assert status == 200, body
    return body


class Watch:
    """A ``Health/Watch`` stream of one service on its own thread: every status it was sent."""

    def __init__(self, server: ServerProcess, service: str) -> None:
        self.seen: list[int] = []
        self._channel = grpc.insecure_channel(server.address)
        stub = health_pb2_grpc.HealthStub(self._channel)
        self._call = stub.Watch(health_pb2.HealthCheckRequest(service=service), timeout=300)
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        try:
            for answer in self._call:
                self.seen.append(int(answer.status))
        except grpc.RpcError:
            pass  # cancelled by close()

    def close(self) -> None:
        self._call.cancel()
        self._thread.join(timeout=10)
        self._channel.close()


def test_a_store_that_goes_away_makes_the_batch_service_not_serving_and_back(
    redis_server_factory: Callable[..., Any], server_factory: Factory
) -> None:
    redis = redis_server_factory()
    server = server_factory(extra=["--redis-url", redis.url])
    watch = Watch(server, rpc.SERVICE)
    try:
        with health_stub(server) as stub:
            assert status(stub, rpc.SERVICE) == SERVING
            redis.stop()
            wait_for_status(stub, rpc.SERVICE, NOT_SERVING)
            assert status(stub, "") == SERVING, "the process itself answers: liveness must stay SERVING"
            assert readyz(server) == 503, "/readyz and the gRPC health service disagree"
            assert "\nladle_ready 0.0\n" in metrics(server)
            redis.start()  # the same port
            wait_for_status(stub, rpc.SERVICE, SERVING)
            assert readyz(server) == 200
            assert "\nladle_ready 1.0\n" in metrics(server)
            # a trainer is served again
            with BatchClient(0, 1, server.address, "after-outage", timeout=60) as client:
                assert next(iter(client)).step == 0
    finally:
        redis.start()
        watch.close()
    assert watch.seen == [SERVING, NOT_SERVING, SERVING], watch.seen
    log = server.log_tail()
    assert f"not ready (gRPC health {rpc.SERVICE} NOT_SERVING, /readyz 503): cursor store" in log, log
    assert "ready again" in log, log


def test_a_redis_that_takes_writes_again_is_ready_at_the_next_check(
    redis_server_factory: Callable[..., Any], server_factory: Factory
) -> None:
    """A replica made primary again: ready at the next readiness write, not 10 s after the last refusal.

    The readiness check is itself a write; before, a trainer's write refused
    during the outage kept the server unready for 10 s after it.
    """
    redis = redis_server_factory()
    server = server_factory(extra=["--redis-url", redis.url])
    with health_stub(server) as stub, redis.client() as admin:
        unused = socket.socket()
        unused.bind(("127.0.0.1", 0))  # a primary that is not there: the replica never syncs
        try:
            admin.execute_command("REPLICAOF", "127.0.0.1", str(unused.getsockname()[1]))
            wait_for_status(stub, rpc.SERVICE, NOT_SERVING)
            with pytest.raises(ServerUnavailableError):  # its join is refused: a write that failed
                BatchClient(0, 1, server.address, "refused", timeout=3).state_dict()
        finally:
            admin.execute_command("REPLICAOF", "NO", "ONE")
            unused.close()
        took = wait_for_status(stub, rpc.SERVICE, SERVING)
    assert took < 2 * READY_CHECK_S + 2, f"ready again {took:.1f}s after Redis took writes again"
    with BatchClient(0, 1, server.address, "after-replica", timeout=30) as client:
        assert next(iter(client)).step == 0


def test_a_store_that_hangs_is_not_ready_and_health_still_answers_at_once(
    redis_server_factory: Callable[..., Any], server_factory: Factory
) -> None:
    """A Redis stopped mid-connection (SIGSTOP) answers nothing for the store's 5 s socket timeout."""
    redis = redis_server_factory()
    server = server_factory(extra=["--redis-url", redis.url])
    assert redis.pid is not None
    with health_stub(server) as stub:
        os.kill(redis.pid, signal.SIGSTOP)
        try:
            wait_for_status(stub, rpc.SERVICE, NOT_SERVING)
            for service in ("", rpc.SERVICE):
                began = time.monotonic()
                status(stub, service)
                assert time.monotonic() - began < 1.0, "a health check waited on the hung store"
            assert status(stub, "") == SERVING
        finally:
            os.kill(redis.pid, signal.SIGCONT)
        wait_for_status(stub, rpc.SERVICE, SERVING)


def test_a_dataset_changed_on_disk_makes_the_batch_service_not_serving(
    server_factory: Factory, small_dataset: Path, tmp_path: Path
) -> None:
    server, victim = serve_a_copy(server_factory, small_dataset, tmp_path)
    with health_stub(server) as stub:
        assert status(stub, rpc.SERVICE) == SERVING
        with victim.open("r+b") as fh:  # grown: the file is no longer the one the server checked
            fh.seek(0, os.SEEK_END)
            fh.write(b"\0" * 64)
        wait_for_status(stub, rpc.SERVICE, NOT_SERVING)
        assert status(stub, "") == SERVING
        assert readyz(server) == 503
    log = server.log_tail()
    said = f"not ready (gRPC health {rpc.SERVICE} NOT_SERVING, /readyz 503): dataset {victim.parent}"
    assert said in log, log


def test_held_http_connections_leave_grpc_readiness_serving(server_factory: Factory) -> None:
    """Anyone who reaches the HTTP port can hold its connections: /readyz then fails, the gRPC status not."""
    server = server_factory()
    with ExitStack() as held, health_stub(server) as stub:
        for _ in range(HTTP_MAX_CONNECTIONS + 4):
            held.enter_context(socket.create_connection(("127.0.0.1", server.http_port), timeout=10))
        time.sleep(0.3)
        assert readyz(server) == 503, "the HTTP face served a connection over its cap"
        until = time.monotonic() + 2 * READY_CHECK_S + 0.5  # the watcher looked at least twice
        while time.monotonic() < until:
            assert status(stub, rpc.SERVICE) == SERVING
            time.sleep(0.2)
        with BatchClient(0, 1, server.address, "under-http-flood", timeout=60) as client:
            assert next(iter(client)).step == 0
    # the 503 uvicorn gave over the cap (not the app's: it never saw the request) is counted
    assert '\nladle_errors_total{code="503",face="http"} 1.0\n' in metrics(server)


def test_a_stopping_server_is_not_serving(server_factory: Factory) -> None:
    """From the start of a shutdown both statuses say NOT_SERVING (the watcher cannot undo it)."""
    server = server_factory()
    with BatchClient(0, 1, server.address, "held", timeout=60, prefetch=1) as client:
        it = iter(client)
        next(it)  # a stream is open: the shutdown waits out its grace (1 s in the fixture)
        watch = Watch(server, rpc.SERVICE)
        try:
            assert server.proc is not None
            deadline = time.monotonic() + 10
            while watch.seen != [SERVING]:
                assert time.monotonic() < deadline, watch.seen
                time.sleep(0.05)
            server.proc.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + 20
            while NOT_SERVING not in watch.seen:
                assert time.monotonic() < deadline, f"no NOT_SERVING during the shutdown: {watch.seen}"
                time.sleep(0.05)
        finally:
            watch.close()
    # waited for, not stop()ped: a second SIGTERM after the server restored the default handlers,
    # on its way out, would end it with -15 instead of its own exit code
    assert server.proc.wait(timeout=30) == 0
    assert watch.seen[-1] == NOT_SERVING, watch.seen


# --- `ladle health`: the probe for what Kubernetes' grpc probe cannot reach (TLS) -------------


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    if not openssl_available():
        pytest.skip("the openssl command is not installed")
    return make_pki(tmp_path_factory.mktemp("pki"))


def ladle_health(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    cmd = [str(Path(sys.executable).with_name("ladle")), "health", *args]
    clean = {k: v for k, v in os.environ.items() if not k.startswith("LADLE_TLS_")}
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60, env={**clean, **(env or {})})


def test_ladle_health_exits_as_a_probe_expects(
    redis_server_factory: Callable[..., Any], server_factory: Factory
) -> None:
    redis = redis_server_factory()
    server = server_factory(extra=["--redis-url", redis.url])
    ready = ladle_health("--server", server.address)
    assert ready.returncode == 0, ready
    assert ready.stdout == f"{server.address} {rpc.SERVICE}: SERVING\n"
    alive = ladle_health("--server", server.address, "--service", "")
    assert (alive.returncode, alive.stdout) == (0, f"{server.address} overall: SERVING\n"), alive
    unknown = ladle_health("--server", server.address, "--service", "no.such.Service")
    assert unknown.returncode == 1, unknown
    assert "no service 'no.such.Service'" in unknown.stdout
    redis.stop()
    with health_stub(server) as stub:
        wait_for_status(stub, rpc.SERVICE, NOT_SERVING)
    not_ready = ladle_health("--server", server.address)
    assert (not_ready.returncode, not_ready.stdout) == (1, f"{server.address} {rpc.SERVICE}: NOT_SERVING\n")
    assert ladle_health("--server", server.address, "--service", "").returncode == 0, "liveness failed"


def test_ladle_health_of_no_server_fails_within_its_timeout() -> None:
    with socket.socket() as sock:  # a port nobody listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
        began = time.monotonic()
        run = ladle_health("--server", f"127.0.0.1:{port}", "--timeout", "2")
    assert run.returncode == 2, run
    assert time.monotonic() - began < 30
    assert run.stderr.startswith(f"ladle: error: 127.0.0.1:{port}: "), run.stderr
    bad = ladle_health("--server", "127.0.0.1:99999")
    assert bad.returncode == 2
    assert "not host:port" in bad.stderr, bad.stderr


def test_ladle_health_over_tls(server_factory: Factory, pki: Pki) -> None:
    server = server_factory(["--tls-cert", str(pki.server_cert), "--tls-key", str(pki.server_key)])
    address = server.address  # 127.0.0.1:port; the certificate names localhost and 127.0.0.1
    plain = ladle_health("--server", address)
    assert plain.returncode == 2, "plaintext reached a TLS server"
    assert "if it serves TLS, --tls-ca or --tls?" in plain.stderr, plain.stderr
    assert ladle_health("--server", address, "--tls-ca", str(pki.ca)).returncode == 0
    named = ladle_health("--server", address, "--tls-ca", str(pki.ca), "--tls-server-name", "localhost")
    assert named.returncode == 0, named
    wrong = ladle_health("--server", address, "--tls-ca", str(pki.ca), "--tls-server-name", "other.example")
    assert wrong.returncode == 2, wrong
    assert "TLS: check --tls-ca, the server's name or --tls-server-name" in wrong.stderr, wrong.stderr
    assert ladle_health("--server", address, "--tls-ca", str(pki.other_ca)).returncode == 2
    from_env = ladle_health("--server", address, env={"LADLE_TLS_CA": str(pki.ca)})
    assert from_env.returncode == 0, from_env


def test_ladle_health_with_mutual_tls(server_factory: Factory, pki: Pki) -> None:
    server = server_factory(
        [
            "--tls-cert", str(pki.server_cert), "--tls-key", str(pki.server_key),
            "--tls-client-ca", str(pki.ca),
        ]
    )  # fmt: skip
    anonymous = ladle_health("--server", server.address, "--tls-ca", str(pki.ca))
    assert anonymous.returncode == 2, "a server asking for a client certificate answered without one"
    mine = ("--tls-cert", str(pki.client_cert), "--tls-key", str(pki.client_key))
    assert ladle_health("--server", server.address, "--tls-ca", str(pki.ca), *mine).returncode == 0
    half = ladle_health(
        "--server", server.address, "--tls-ca", str(pki.ca), "--tls-cert", str(pki.client_cert)
    )
    assert half.returncode == 2
    together = "--tls-cert ($LADLE_TLS_CERT) and --tls-key ($LADLE_TLS_KEY) go together"
    assert together in half.stderr, half.stderr
    unreadable = ladle_health("--server", server.address, "--tls-ca", str(pki.ca.with_name("nope.pem")))
    assert unreadable.returncode == 2
    said = "ladle: error: tls: --tls-ca ($LADLE_TLS_CA): cannot read "
    assert unreadable.stderr.startswith(said), unreadable
