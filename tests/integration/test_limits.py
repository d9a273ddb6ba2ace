"""Every limit of a batch server, each against a real server on loopback: refused clearly, or reaped.

The servers here run in the test process (``BatchServer``) so that each
limit can be set low and each test stays short; ``test_soak.py`` runs a real
``ladle serve`` under a crowd of connections.
"""

from __future__ import annotations

import logging
import select
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from ladle.client import BatchClient, BatchClientError, FencedError
from ladle.proto import codec, rpc
from ladle.proto import ladle_pb2 as pb
from ladle.service.cli import build_parser, limits_from_args, main
from ladle.service.errors import ConfigError
from ladle.service.http.server import HttpServer
from ladle.service.limits import RPC_HEADROOM, Limits, connection_cap
from ladle.service.schedule import ScheduleConfig
from ladle.service.server import BatchServer

CONFIG = ScheduleConfig(
    max_seq_len=512, bucket_bounds=(0, 48, 76, 108, 152, 206, 513), token_budget=3072, max_batch_size=16
)
# one connection per channel (grpc shares one between channels with equal options otherwise)
OWN_CONNECTION = [("grpc.use_local_subchannel_pool", 1)]

Serve = Callable[..., BatchServer]


@pytest.fixture
def serve(small_dataset: Path, tmp_path: Path) -> Iterator[Serve]:
    started: list[BatchServer] = []

    def start(tokens: tuple[str, ...] = (), **limits: Any) -> BatchServer:
        state = tmp_path / f"state-{len(started)}.db"
        limits_ = Limits(**limits)
        server = BatchServer(
            small_dataset, CONFIG, grpc_port=0, state=state, limits=limits_, grace=0, tokens=tokens
        )
        started.append(server)
        return server.start()

    yield start
    for server in started:
        server.stop(grace=0)


def metric(server: BatchServer, name: str, labels: str = "") -> float:
    """One sample of the server's /metrics exposition (0 when absent)."""
    prefix = f"{name}{{{labels}}} " if labels else f"{name} "
    for line in server.metrics.exposition().decode().splitlines():
        if line.startswith(prefix):
            return float(line.split()[-1])
    return 0.0


def wait_for(condition: Callable[[], bool], timeout: float, what: str) -> float:
    """Poll ``condition`` until it holds; returns the seconds it took, fails naming ``what``."""
    began = time.monotonic()
    while not condition():
        if time.monotonic() - began > timeout:
            pytest.fail(f"{what} within {timeout:.0f}s")
        time.sleep(0.05)
    return time.monotonic() - began


def trainer(server: BatchServer, job: str, rank: int = 0, world: int = 1, **kwargs: Any) -> BatchClient:
    """A client that has opened its stream (it holds one batch)."""
    client = BatchClient(rank, world, server.address, job, timeout=20, **kwargs)
    next(iter(client))
    return client


def drain(client: BatchClient, most: int = 100) -> None:
    batches = iter(client)
    for _ in range(most):
        next(batches)


def refused(server: BatchServer, job: str, rank: int = 0, world: int = 1, **kwargs: Any) -> BatchClientError:
    with pytest.raises(BatchClientError) as info:
        trainer(server, job, rank, world, **kwargs).close()
    return info.value


# ------------------------------------------------------------------ sessions


def test_sessions_per_server_are_capped_and_a_reconnect_takes_its_own_slot(serve: Serve) -> None:
    server = serve(max_sessions=2)
    a, b = trainer(server, "a"), trainer(server, "b")
    error = refused(server, "c")
    assert error.code == "RESOURCE_EXHAUSTED", f"a third session was not refused: {error.code} {error}"
    assert "--max-sessions) is 2" in str(error), f"the refusal does not explain: {error}"
    assert metric(server, "ladle_streams_refused_total", 'limit="max_sessions"') == 1
    assert metric(server, "ladle_streams_limit", 'scope="server"') == 2
    # a trainer restarted for a rank that holds a slot replaces its old stream, even when full
    a2 = trainer(server, "a")
    with pytest.raises(FencedError):
        drain(a)
    with pytest.raises(FencedError):  # a replaced client never reports a clean end
        a.close()
    b.close()
    wait_for(lambda: metric(server, "ladle_streams_open") == 1, 10, "closed sessions were not released")
    trainer(server, "c").close()  # the slot b held is free again
    a2.close()


def test_one_job_cannot_take_every_session(serve: Serve) -> None:
    server = serve(max_sessions=8, max_sessions_per_job=2)
    held = [trainer(server, "big", rank, 4) for rank in (0, 1)]
    error = refused(server, "big", 2, 4)
    assert error.code == "RESOURCE_EXHAUSTED"
    assert "job 'big' already holds 2 sessions" in str(error), str(error)
    assert "--max-sessions-per-job" in str(error), str(error)
    held.append(trainer(server, "small"))  # another job still gets in
    assert metric(server, "ladle_streams_limit", 'scope="job"') == 2
    for client in held:
        client.close()


def test_the_default_per_job_limit_is_half_the_server() -> None:
    assert Limits(max_sessions=256).per_job == 128
    assert Limits(max_sessions=1).per_job == 1
    assert Limits(max_sessions=10, max_sessions_per_job=10).per_job == 10
    with pytest.raises(ConfigError, match=r"max_sessions_per_job.*at most max_sessions \(10\), got 50"):
        Limits(max_sessions=10, max_sessions_per_job=50)


def test_a_full_server_still_answers_describe_and_health(serve: Serve) -> None:
    """gRPC's own call limit is a backstop above the sessions, not equal to them."""
    server = serve(max_sessions=1)
    assert server.limits.max_concurrent_rpcs == 1 + RPC_HEADROOM
    held = trainer(server, "only")
    with grpc.insecure_channel(server.address) as channel:
        check = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
        assert check.status == health_pb2.HealthCheckResponse.SERVING
        assert rpc.BatchServiceClient(channel).describe("only", timeout=10).job == "only"
    assert refused(server, "other").code == "RESOURCE_EXHAUSTED"
    held.close()


def _silent_calls(channel: grpc.Channel, count: int, quiet: threading.Event) -> list[Any]:
    """``count`` calls that open and send no request until ``quiet`` is set: Streams with no Open,
    Describes and health checks (called request-streaming: a unary stub sends its request at once)."""

    def nothing() -> Iterator[bytes]:
        quiet.wait(60)
        yield from ()

    methods = [
        channel.stream_stream(rpc.STREAM_METHOD),
        channel.stream_unary(rpc.DESCRIBE_METHOD),
        channel.stream_unary("/grpc.health.v1.Health/Check"),
    ]
    calls = []
    for i in range(count):
        method = methods[i % len(methods)]
        if i % len(methods) == 0:
            calls.append(method(nothing(), timeout=60))
        else:
            calls.append(method.future(nothing(), timeout=60))
    return calls


def _ending(call: Any) -> tuple[str, str]:
    """(status code name, ladle reason) a call ended with."""
    if isinstance(call, grpc.Future):
        error = call.exception(timeout=60)
        assert error is not None, "a call that sent nothing was answered"
    else:
        with pytest.raises(grpc.RpcError) as info:
            next(call)
        error = info.value
    details = rpc.error_details(error.trailing_metadata())
    return error.code().name, details.reason if details is not None else ""


@pytest.mark.parametrize("token", [False, True])
def test_calls_that_send_no_request_end_and_lock_nobody_out(serve: Serve, token: bool) -> None:
    """More silent calls than the server's call limit: each ends after the handshake timeout (at once
    when it has no token), so trainers, Describe and health checks still get in."""
    secret = "s3cret-token-of-the-limits-test"
    server = serve(max_sessions=1, handshake_timeout_s=1.0, tokens=(secret,) if token else ())
    # two thirds of them Streams and Describes: 6 more than their budget (--max-sessions + 64)
    count = (server.limits.max_concurrent_rpcs + 6) * 3 // 2
    quiet = threading.Event()
    try:
        with grpc.insecure_channel(server.address) as channel:
            began = time.monotonic()
            calls = _silent_calls(channel, count, quiet)
            endings = {_ending(call) for call in calls}
            took = time.monotonic() - began
            if token:
                # the health service takes no token: its silent checks end at the timeout
                assert endings == {
                    ("UNAUTHENTICATED", "unauthenticated"),
                    ("DEADLINE_EXCEEDED", "no_request"),
                }, endings
                assert took < 10, f"calls with no token waited {took:.1f}s for their requests"
            else:
                assert endings == {
                    ("DEADLINE_EXCEEDED", "no_open"),
                    ("DEADLINE_EXCEEDED", "no_request"),
                    ("RESOURCE_EXHAUSTED", "too_many_calls"),  # the few beyond the limit, refused at once
                }, endings
            check = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
            assert check.status == health_pb2.HealthCheckResponse.SERVING
    finally:
        quiet.set()
    key = secret if token else None
    with BatchClient(0, 1, server.address, "after-silence", timeout=20, token=key) as client:
        assert len(list(client)) > 0


def test_prefetch_window_is_capped(serve: Serve) -> None:
    server = serve(max_prefetch=8)
    error = refused(server, "wide", prefetch=9)
    assert error.code == "INVALID_ARGUMENT", f"prefetch 9 of 8: {error.code} {error}"
    assert "1..8" in str(error), f"the limit is not stated: {error}"
    trainer(server, "wide", prefetch=8).close()


# ------------------------------------------------------------------ messages


def test_requests_over_the_receive_limit_are_refused(serve: Serve) -> None:
    server = serve(max_request_bytes=4096)
    with grpc.insecure_channel(server.address) as channel:
        stub = rpc.BatchServiceClient(channel)
        with pytest.raises(grpc.RpcError) as info:
            stub.describe("x" * 5000, timeout=10)
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, info.value.details()
        with pytest.raises(grpc.RpcError) as info:
            stub.describe("y" * 100, timeout=10)  # small: goes through to a clear NOT_FOUND
        assert info.value.code() == grpc.StatusCode.NOT_FOUND
    client = BatchClient(0, 1, server.address, "big-open", timeout=20)
    client.client_id = "z" * 5000  # past BatchClient's own check: another client may send anything
    with pytest.raises(BatchClientError) as info:
        next(iter(client))
    client.close()
    assert info.value.code == "RESOURCE_EXHAUSTED", f"a 5 KB Open got {info.value.code}"


def test_message_limits_follow_the_largest_batch() -> None:
    limits = Limits()
    large = codec.max_frame_bytes(1_200_000, 64)  # about 6 MB frames
    options = dict(limits.grpc_options(large))
    assert options["grpc.max_send_message_length"] == large, "the send limit is not the largest frame"
    assert options["grpc.max_receive_message_length"] == 64 << 10, "requests may be large"
    small = dict(limits.grpc_options(codec.max_frame_bytes(3072, 16)))
    assert small["grpc.max_send_message_length"] == 64 << 10, "Describe's reply needs 64 KiB at least"


# ------------------------------------------------------------------ connections


def test_idle_connections_are_closed_and_trainers_are_not(serve: Serve) -> None:
    server = serve(idle_timeout_s=1)
    states: list[grpc.ChannelConnectivity] = []
    with grpc.insecure_channel(server.address, options=OWN_CONNECTION) as channel:
        grpc.channel_ready_future(channel).result(timeout=10)
        channel.subscribe(states.append, try_to_connect=False)
        took = wait_for(
            lambda: grpc.ChannelConnectivity.IDLE in states, 15, "an idle connection was not closed"
        )
        assert took > 0.5, f"closed after {took:.2f}s, before the idle timeout"
        # the GOAWAY is not an error: the next call reconnects
        with pytest.raises(grpc.RpcError) as info:
            rpc.BatchServiceClient(channel).describe("none", timeout=10)
        assert info.value.code() == grpc.StatusCode.NOT_FOUND
    slow = BatchClient(0, 1, server.address, "slow", timeout=20, prefetch=1)
    batches = iter(slow)
    for _ in range(3):
        next(batches)
        time.sleep(1.5)  # longer than the idle timeout, with the stream open
    assert slow.reconnects == 0, "the idle timeout cut a trainer's open stream"
    slow.close()


def test_a_connection_that_never_speaks_is_closed(serve: Serve) -> None:
    server = serve(handshake_timeout_s=1)
    host, port = server.address.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=15) as sock:
        began = time.monotonic()
        while sock.recv(4096):  # the server's SETTINGS, then EOF
            pass
        took = time.monotonic() - began
    assert 0.5 < took < 10, f"a silent connection was closed after {took:.1f}s (handshake timeout 1s)"


class _Blackhole:
    """A TCP proxy to ``target`` for one connection; ``freeze()`` drops everything from then on.

    A frozen proxy is a half-open connection as the server sees it: the peer
    neither answers nor closes (a trainer's machine that lost power).
    """

    def __init__(self, target: tuple[str, int]) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.target = target
        self.frozen = threading.Event()
        self.server_closed = threading.Event()
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        client, _ = self.listener.accept()
        upstream = socket.create_connection(self.target)
        try:
            while not self._stop.is_set():
                ready, _, _ = select.select([client, upstream], [], [], 0.1)
                for sock in ready:
                    data = sock.recv(1 << 16)
                    if not data:
                        if sock is upstream:
                            self.server_closed.set()
                        return
                    if not self.frozen.is_set():
                        (upstream if sock is client else client).sendall(data)
        finally:
            client.close()
            upstream.close()

    def close(self) -> None:
        self._stop.set()
        self.thread.join(timeout=5)
        self.listener.close()


def test_a_half_open_trainer_is_reaped_and_its_session_freed(serve: Serve) -> None:
    server = serve(keepalive_s=1, keepalive_timeout_s=1)
    host, port = server.address.rsplit(":", 1)
    proxy = _Blackhole((host, int(port)))
    client = BatchClient(0, 1, f"127.0.0.1:{proxy.port}", "lost", timeout=20, prefetch=2)
    try:
        next(iter(client))
        assert metric(server, "ladle_streams_open") == 1
        proxy.frozen.set()
        took = wait_for(lambda: metric(server, "ladle_streams_open") == 0, 20, "a half-open stream stayed")
        assert proxy.server_closed.wait(10), "the server did not close the half-open connection"
        assert took < 10, f"the half-open stream was reaped after {took:.1f}s (keepalive 1s + 1s)"
    finally:
        client.close()
        proxy.close()


def test_connections_over_the_cap_are_refused_until_one_closes(serve: Serve) -> None:
    server = serve(max_connections=3)
    channels = [grpc.insecure_channel(server.address, options=OWN_CONNECTION) for _ in range(4)]
    try:
        for channel in channels[:3]:
            grpc.channel_ready_future(channel).result(timeout=10)
        with pytest.raises(grpc.FutureTimeoutError):
            grpc.channel_ready_future(channels[3]).result(timeout=2)
        channels[0].close()
        grpc.channel_ready_future(channels[3]).result(timeout=15)  # it retries and gets the slot
    finally:
        for channel in channels:
            channel.close()


def test_the_connection_cap_stays_below_the_descriptor_limit() -> None:
    assert connection_cap(1024) == 1024 - 256
    assert connection_cap(1 << 20) == 4096
    assert connection_cap(100) == 16


# ------------------------------------------------------------------ HTTP


async def _hello(scope: Any, receive: Any, send: Any) -> None:
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
    await send({"type": "http.response.body", "body": b"ok"})


def _get(port: int) -> int:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(b"GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        return int(sock.recv(4096).split(b" ", 2)[1])


def test_http_caps_connections_and_closes_silent_ones() -> None:
    refused: list[float] = []
    http = HttpServer(
        _hello, "127.0.0.1", 0, max_connections=3, idle_timeout_s=1, on_refused=lambda: refused.append(1)
    ).start()
    try:
        assert _get(http.port) == 200
        assert not refused
        silent = [socket.create_connection(("127.0.0.1", http.port), timeout=10) for _ in range(3)]
        time.sleep(0.2)
        assert _get(http.port) == 503, "a fourth connection was served over max_connections=3"
        assert _get(http.port) == 503
        assert len(refused) == 2, "the 503s uvicorn gave over the cap were not counted (its warning changed?)"
        began = time.monotonic()
        for sock in silent:
            assert sock.recv(4096) == b"", "a silent HTTP connection got data instead of being closed"
            sock.close()
        assert time.monotonic() - began < 5, "silent HTTP connections were not closed after 1s"
        assert _get(http.port) == 200
    finally:
        http.stop()


def test_http_closes_a_connection_that_trickles_its_headers(monkeypatch: pytest.MonkeyPatch) -> None:
    """A slow-loris client (a header line every half second) must not hold a connection for ever."""
    from ladle.service.http import server as http_server

    monkeypatch.setattr(http_server._H11, "request_timeout_s", 1.5)
    http = HttpServer(_hello, "127.0.0.1", 0, max_connections=3, idle_timeout_s=1).start()
    try:
        slow = socket.create_connection(("127.0.0.1", http.port), timeout=10)
        slow.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n")
        began = time.monotonic()
        closed = False
        while time.monotonic() - began < 8 and not closed:
            time.sleep(0.5)
            try:
                slow.sendall(b"X-a: b\r\n")
            except OSError:
                closed = True
                break
            slow.settimeout(0.01)
            try:
                closed = slow.recv(4096) == b""
            except TimeoutError:
                pass
            except OSError:
                closed = True
        assert closed, "a connection trickling header lines stayed open"
        assert time.monotonic() - began < 4, "closed, but not within the request timeout"
        slow.close()
        assert _get(http.port) == 200, "a whole request on a fresh connection was not answered"
    finally:
        http.stop()


# ------------------------------------------------------------------ options


def test_serve_options_make_the_limits() -> None:
    args = build_parser().parse_args(
        [
            "serve", "ds", "--max-streams", "9", "--max-sessions-per-job", "3", "--max-prefetch", "5",
            "--max-request-bytes", "2048", "--max-connections", "40", "--keepalive", "7",
            "--idle-timeout", "0", "--handshake-timeout", "2", "--spare-schedules", "0",
        ]
    )  # fmt: skip
    limits = limits_from_args(args)
    assert (limits.max_sessions, limits.per_job, limits.max_prefetch) == (9, 3, 5)
    assert (limits.max_request_bytes, limits.connections, limits.spare_schedules) == (2048, 40, 0)
    options = dict(limits.grpc_options(1000))
    assert options["grpc.keepalive_time_ms"] == 7000
    assert options["grpc.server_handshake_timeout_ms"] == 2000
    assert "grpc.max_connection_idle_ms" not in options, "--idle-timeout 0 must never close idle connections"
    assert limits_from_args(build_parser().parse_args(["serve", "ds"])) == Limits()


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("max_sessions", 0),
        ("max_prefetch", 0),
        ("max_request_bytes", 10),
        ("keepalive_s", 0.0),
        ("spare_schedules", -1),
        ("spare_schedules", 1.5),
    ],
)
def test_bad_limits_are_config_errors(field: str, value: Any) -> None:
    with pytest.raises(ConfigError, match=field):
        Limits(**{field: value})


def test_ladle_serve_refuses_a_bad_limit(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", "no-such-dataset", "--max-sessions", "0"]) == 2
    assert "max_sessions" in capsys.readouterr().err


def test_spare_schedules_bound_what_the_server_keeps(serve: Serve) -> None:
    """``--spare-schedules 0``: a schedule no stream uses (here, an inspected epoch) is not kept."""
    server = serve(spare_schedules=0)
    assert server._servicer is not None
    registry = server._servicer.registry
    job = registry.open("inspected", 2)  # a new job: its epoch 0 is built, for the stream to come
    kept = metric(server, "ladle_schedules_cached")
    assert job.steps(3) > 0
    assert metric(server, "ladle_schedules_cached") == kept, "an inspected epoch was kept with no spares"
    job.steps(3, hot=True)  # as a stream uses it
    assert metric(server, "ladle_schedules_cached") == kept + 1


def test_describes_of_many_world_sizes_keep_no_more_than_the_spare_schedules(serve: Serve) -> None:
    """A Describe of a job no store holds builds as an inspection does: nothing a stream uses, so a
    caller asking for world size after world size leaves the spare schedules behind, not one each."""
    server = serve(spare_schedules=2)
    with grpc.insecure_channel(server.address) as channel:
        calls = rpc.BatchServiceClient(channel)
        for world_size in range(1, 13):  # one at a time: never over the inspection builds' limit
            info = calls.describe(f"nobody-{world_size}", world_size=world_size, timeout=30)
            assert info.world_size == world_size
            assert info.steps_per_epoch > 0
    cached = metric(server, "ladle_schedules_cached")
    assert cached <= 2, f"{cached:.0f} schedules kept after Describes of 12 world sizes (2 spare)"
    with trainer(server, "after-describes", 1, 2) as client:  # a stream's schedule is built and kept
        drain(client, 3)


@pytest.mark.parametrize(
    ("fields", "words"),
    [
        ({"epoch": 2**53}, "epoch: must be in 0..9007199254740991"),
        ({"epoch": 2**64 - 1}, "epoch: must be in 0..9007199254740991"),
        ({"world_size": 2, "rank": 2}, "rank: 2 is outside 0..1"),
        ({"world_size": 1, "rank": 2**32 - 1}, "is outside 0..0"),
    ],
)
def test_describe_refuses_what_open_refuses(serve: Serve, fields: dict[str, int], words: str) -> None:
    server = serve()
    with grpc.insecure_channel(server.address) as channel:
        describe = channel.unary_unary(
            rpc.DESCRIBE_METHOD, request_serializer=None, response_deserializer=None
        )
        request = pb.DescribeRequest(job="described", world_size=fields.get("world_size", 1))
        if "epoch" in fields:
            request.epoch = fields["epoch"]
        if "rank" in fields:
            request.rank = fields["rank"]
        with pytest.raises(grpc.RpcError) as info:
            describe(request.SerializeToString(), timeout=30)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value
    assert words in (info.value.details() or ""), info.value.details()


@pytest.mark.parametrize("method", [rpc.DESCRIBE_METHOD, "/grpc.health.v1.Health/Check"])
def test_a_request_that_does_not_parse_is_invalid_argument(
    serve: Serve, method: str, caplog: pytest.LogCaptureFixture
) -> None:
    """grpc parsed it before the handler: UNKNOWN, and an ERROR with a traceback logged per call."""
    server = serve()
    with grpc.insecure_channel(server.address) as channel:
        call = channel.unary_unary(method, request_serializer=None, response_deserializer=None)
        with pytest.raises(grpc.RpcError) as info:
            call(b"\xff\xff\xff\xff", timeout=30)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value
    details = rpc.error_details(info.value.trailing_metadata())
    assert details is not None, info.value
    assert details.reason == "bad_request", details
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text
