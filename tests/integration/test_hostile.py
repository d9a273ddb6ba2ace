"""Hostile and broken input against a real ``ladle serve``: each gets a clear answer, the server stays up.

Garbage on the gRPC port, malformed and absurd Stream requests, a client that
stops reading at the transport, absurd HTTP queries, a dataset file truncated
or replaced while it is served, and Redis going away in the middle of an epoch.
After each, the server still answers and a real trainer still gets its exact
stream (compared with ``build_schedule``). docs/hardening.md describes them.
"""

from __future__ import annotations

import http.client
import json
import os
import shutil
import signal
import socket
import threading
import time
import urllib.parse
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest

from ladle.client import BatchClient, BatchClientError
from ladle.proto import codec, rpc
from ladle.proto import ladle_pb2 as pb
from ladle.service.dataset import open_dataset
from ladle.service.errors import DatasetChangedError

from .conftest import ServerProcess
from .test_serving import check_rank_stream, consume, reference

Factory = Callable[..., ServerProcess]


def serves_a_trainer(server: ServerProcess, dataset: Path, job: str) -> None:
    """A real trainer still receives its whole epoch, byte for byte as scheduled."""
    with BatchClient(0, 1, server.address, job, timeout=60) as client:
        got = consume(client)
    check_rank_stream(dataset, reference(dataset, 1), 0, got)
    assert server.proc is not None
    assert server.proc.poll() is None, "the server exited"


def whole_log(server: ServerProcess) -> str:
    return (server.workdir / "server.log").read_text(errors="replace")


def http_get(server: ServerProcess, target: str) -> tuple[int, bytes]:
    """(status, body) of a GET of exactly ``target`` (no quoting or normalising on the way)."""
    conn = http.client.HTTPConnection("127.0.0.1", server.http_port, timeout=60)
    try:
        conn.putrequest("GET", target, skip_accept_encoding=True)
        conn.endheaders()
        response = conn.getresponse()
        return response.status, response.read()
    finally:
        conn.close()


# ------------------------------------------------------------------ the gRPC port


def test_garbage_bytes_on_the_grpc_port(module_server: ServerProcess, small_dataset: Path) -> None:
    host, port = module_server.address.rsplit(":", 1)
    rng = np.random.default_rng(7)

    def connect() -> socket.socket:
        return socket.create_connection((host, int(port)), timeout=10)

    for size in (1, 100, 65536):
        with connect() as sock:
            sock.sendall(rng.bytes(size))
    with connect() as sock:  # half an HTTP/2 preface, then silence, then gone
        sock.sendall(b"PRI * HTTP/2.0\r\n")
        time.sleep(1.0)
    with connect() as sock:  # a whole preface, then garbage frames
        sock.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + rng.bytes(4096))
        time.sleep(0.2)
    with connect() as sock:  # HTTP/1.1 on the HTTP/2 port
        sock.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        time.sleep(0.2)
    serves_a_trainer(module_server, small_dataset, "after-garbage")


def drain_frames(frames: Iterator[bytes]) -> None:
    """Read a call to its end; what comes before a refusal must be well-formed frames."""
    for frame in frames:
        codec.decode_frame(frame)


def open_bytes(**fields: Any) -> bytes:
    data: bytes = pb.StreamRequest(open=pb.Open(**fields)).SerializeToString()
    return data


def varint(value: int) -> bytes:
    """A protobuf varint of ``value`` (negative: the 10-byte two's complement form)."""
    value &= (1 << 64) - 1
    out = bytearray()
    while True:
        byte, value = value & 0x7F, value >> 7
        out.append(byte | (0x80 if value else 0))
        if not value:
            return bytes(out)


def negative_rank_open() -> bytes:
    """An Open whose rank field holds the varint of -1 (no protobuf library would write it)."""
    inner = b"\x0a\x03neg" + b"\x10" + varint(-1) + b"\x18\x02" + b"\x28\x02"
    return b"\x0a" + varint(len(inner)) + inner


CREDIT = pb.StreamRequest(credit=pb.Credit(n=1)).SerializeToString()
HUGE_ACK = pb.StreamRequest(
    ack=pb.Ack(through=pb.Position(epoch=2**64 - 1, step=1), credit=1)
).SerializeToString()
GOOD = {"rank": 0, "world_size": 1, "prefetch": 2}
WIDE = {"rank": 0, "world_size": 1, "prefetch": 64}
CREDIT_64 = pb.StreamRequest(credit=pb.Credit(n=64)).SerializeToString()
FAR_ACK = pb.StreamRequest(ack=pb.Ack(through=pb.Position(epoch=0, step=10**12))).SerializeToString()
PAUSE = b""  # not sent: the client waits a second (the server sends what the credits allow)
BAD_REQUESTS: dict[str, tuple[list[bytes], set[str]]] = {
    "garbage": ([b"\xff\xff\xff\xff"], {"INVALID_ARGUMENT"}),
    "a field of the wrong wire type": ([b"\x0a\x05hello"], {"INVALID_ARGUMENT"}),
    "nothing at all": ([], {"INVALID_ARGUMENT"}),
    "credit before open": ([CREDIT], {"INVALID_ARGUMENT"}),
    "negative rank": ([negative_rank_open()], {"INVALID_ARGUMENT"}),
    "huge rank": ([open_bytes(job="j", rank=2**32 - 1, world_size=2, prefetch=2)], {"INVALID_ARGUMENT"}),
    "world size 2**32-1": (
        [open_bytes(job="j", rank=0, world_size=2**32 - 1, prefetch=2)],
        {"INVALID_ARGUMENT"},
    ),
    "world size 0": ([open_bytes(job="j", rank=0, world_size=0, prefetch=2)], {"INVALID_ARGUMENT"}),
    "prefetch 0": ([open_bytes(job="j", rank=0, world_size=1, prefetch=0)], {"INVALID_ARGUMENT"}),
    "prefetch 10**9": (
        [open_bytes(job="j", rank=0, world_size=1, prefetch=10**9)],
        {"INVALID_ARGUMENT", "RESOURCE_EXHAUSTED"},
    ),
    "empty job name": ([open_bytes(job="", **GOOD)], {"INVALID_ARGUMENT"}),
    "path in the job name": ([open_bytes(job="../../etc/passwd", **GOOD)], {"INVALID_ARGUMENT"}),
    "60 KB job name": ([open_bytes(job="x" * 60_000, **GOOD)], {"INVALID_ARGUMENT", "RESOURCE_EXHAUSTED"}),
    "1 MB job name": ([open_bytes(job="x" * (1 << 20), **GOOD)], {"INVALID_ARGUMENT", "RESOURCE_EXHAUSTED"}),
    "start at epoch 2**64-1": (
        [open_bytes(job="hostile-start", start=pb.Position(epoch=2**64 - 1, step=0), **GOOD)],
        {"INVALID_ARGUMENT"},
    ),
    "garbage after the open": (
        [open_bytes(job="hostile-garbage", **GOOD), b"\xff\xff"],
        {"INVALID_ARGUMENT"},
    ),
    "an ack far past the end": ([open_bytes(job="hostile-ack", **GOOD), HUGE_ACK], {"INVALID_ARGUMENT"}),
    # a step far beyond its epoch's end: refused at once, where carrying it over epoch after
    # epoch built a schedule for each (on the event loop for an ack: the server hung)
    "start a trillion steps into epoch 0": (
        [open_bytes(job="hostile-far-start", start=pb.Position(epoch=0, step=10**12), **GOOD)],
        {"INVALID_ARGUMENT"},
    ),
    "an ack a trillion steps into an epoch already sent": (  # 3 x 64 batches: past epoch 0's 147
        [open_bytes(job="hostile-far-ack", **WIDE), PAUSE, CREDIT_64, PAUSE, CREDIT_64, PAUSE, FAR_ACK],
        {"INVALID_ARGUMENT"},
    ),
    "a credit beyond the window": (
        [
            open_bytes(job="hostile-credit", **GOOD),
            PAUSE,
            pb.StreamRequest(credit=pb.Credit(n=3)).SerializeToString(),
        ],
        {"INVALID_ARGUMENT"},
    ),
    "an ack whose credit is beyond the window": (
        [
            open_bytes(job="hostile-ack-credit", **GOOD),
            PAUSE,
            pb.StreamRequest(ack=pb.Ack(through=pb.Position(epoch=0, step=1), credit=5)).SerializeToString(),
        ],
        {"INVALID_ARGUMENT"},
    ),
    # refused before the join, which would fence the rank's trainer, and not stored: a generation
    # near the store's largest left the rank unable to join again
    "a resume generation of 2**64-1": (
        [open_bytes(job="hostile-resume", resume=pb.Resume(generation=2**64 - 1, incarnation="x"), **GOOD)],
        {"INVALID_ARGUMENT"},
    ),
    "a resume generation of 2**53-2": (
        [open_bytes(job="hostile-resume", resume=pb.Resume(generation=2**53 - 2, incarnation="x"), **GOOD)],
        {"INVALID_ARGUMENT"},
    ),
}
# the reason named in the error trailer, where it says which rule the request broke
REASONS = {
    "huge rank": "bad_rank",
    "world size 0": "bad_world_size",
    "an ack a trillion steps into an epoch already sent": "bad_step",
    "a credit beyond the window": "bad_credit",
    "an ack whose credit is beyond the window": "bad_credit",
    "a resume generation of 2**64-1": "bad_resume",
    "a resume generation of 2**53-2": "bad_resume",
}


def test_malformed_and_absurd_stream_requests(module_server: ServerProcess, small_dataset: Path) -> None:
    """Each gets a clear status (with a ladle error trailer when ladle refused it), never OK or UNKNOWN."""
    limit = ("grpc.max_send_message_length", 4 << 20)
    with grpc.insecure_channel(module_server.address, options=[limit]) as channel:
        call = channel.stream_stream(rpc.STREAM_METHOD, request_serializer=None, response_deserializer=None)
        for name, (requests, codes) in BAD_REQUESTS.items():

            def slowly(items: list[bytes] = requests) -> Iterator[bytes]:
                for item in items:
                    if item is PAUSE:
                        time.sleep(1.0)
                    else:
                        yield item
                time.sleep(1.0)  # the server answers before the client half-closes

            with pytest.raises(grpc.RpcError) as info:
                drain_frames(call(slowly(), timeout=60))
            error = info.value
            assert error.code().name in codes, f"{name}: {error.code()} {error.details()}"
            assert len(error.details() or "") < 4096, (
                f"{name}: the status details are {len(error.details())} chars"
            )
            details = rpc.error_details(error.trailing_metadata())
            if error.code().name == "INVALID_ARGUMENT":
                assert details is not None, f"{name}: no ladle error trailer"
                assert details.message, f"{name}: the trailer explains nothing"
                assert details.reason == REASONS.get(name, details.reason), f"{name}: {details}"
    assert "Unexpected" not in whole_log(module_server), "grpc logged a servicer crash"
    serves_a_trainer(module_server, small_dataset, "after-bad-requests")


def refused_open(server: ServerProcess, **fields: Any) -> pb.Error:
    """Send one Open (raw) and return the ladle error it was refused with."""
    with grpc.insecure_channel(server.address) as channel:
        call = channel.stream_stream(rpc.STREAM_METHOD, request_serializer=None, response_deserializer=None)
        with pytest.raises(grpc.RpcError) as info:
            drain_frames(call(iter([open_bytes(**fields)]), timeout=30))
    details = rpc.error_details(info.value.trailing_metadata())
    assert details is not None, info.value
    return details


def test_a_refused_open_for_a_running_rank_does_not_fence_its_trainer(
    module_server: ServerProcess, small_dataset: Path
) -> None:
    """Checked before the join: a refused Open (here an absurd Resume) leaves the rank's trainer streaming."""
    job = "hostile-resume-victim"
    with BatchClient(0, 1, module_server.address, job, timeout=60) as client:
        batches = iter(client)
        got = [next(batches) for _ in range(3)]
        for generation in (2**64 - 1, 2**53 - 2, 2**32):
            error = refused_open(
                module_server, job=job, resume=pb.Resume(generation=generation, incarnation="x"), **GOOD
            )
            assert (error.code, error.reason) == ("INVALID_ARGUMENT", "bad_resume"), error
            assert error.field == "open.resume.generation", error
        steps = [batch.step for batch in got] + [batch.step for batch in batches]
    assert steps == list(range(len(steps))), "the trainer's epoch was cut or reordered"
    assert len(steps) == reference(small_dataset, 1).num_steps
    # and the rank can still join: its generation was not pushed to the store's largest
    serves_a_trainer(module_server, small_dataset, job + "-again")
    with BatchClient(0, 1, module_server.address, job, timeout=60) as client:
        next(iter(client))


def test_a_client_id_cannot_forge_or_flood_a_log_line(module_server: ServerProcess) -> None:
    forged = "2026-01-01 00:00:00,000 ERROR ladle.server: forged"
    for job, client_id in (("hostile-cid-newline", f"evil\n{forged}"), ("hostile-cid-long", "x" * 60_000)):
        with grpc.insecure_channel(module_server.address) as channel:
            call = channel.stream_stream(
                rpc.STREAM_METHOD, request_serializer=None, response_deserializer=None
            )
            frames = call(iter([open_bytes(job=job, client_id=client_id, **GOOD)]), timeout=30)
            next(frames)  # the stream opened (and logged its client)
            frames.cancel()
    deadline = time.monotonic() + 10
    while "client=x" not in whole_log(module_server) and time.monotonic() < deadline:
        time.sleep(0.05)
    lines = whole_log(module_server).splitlines()
    assert not any(line.startswith(forged[:10]) for line in lines), "a client forged a log line"
    assert any("client=evil\\n2026-01-01" in line for line in lines), "the newline was not escaped"
    longest = max(len(line) for line in lines)
    assert longest < 2000, f"a log line of {longest} characters"


def test_a_client_that_stops_reading_at_the_transport(
    module_server: ServerProcess, small_dataset: Path
) -> None:
    """Clients that read nothing at all: credits beyond the window are refused, and with the widest
    window the server holds ``prefetch`` batches and goes on serving others.

    (``test_serving`` covers the BatchClient that stops consuming: the credit window holds it.)
    """
    stop = threading.Event()

    def requests(prefetch: int, credits: int) -> Iterator[pb.StreamRequest]:
        yield pb.StreamRequest(
            open=pb.Open(job=f"never-reads-{credits}", rank=0, world_size=1, prefetch=prefetch)
        )
        for _ in range(50 if credits else 0):
            yield pb.StreamRequest(credit=pb.Credit(n=credits))
        stop.wait(120)

    with grpc.insecure_channel(module_server.address) as channel:
        greedy = rpc.BatchServiceClient(channel).stream(requests(4, 2**32 - 1))
        with pytest.raises(grpc.RpcError) as info:
            drain_frames(greedy)
        details = rpc.error_details(info.value.trailing_metadata())
        assert details is not None, info.value
        assert details.reason == "bad_credit", details
        call = rpc.BatchServiceClient(channel).stream(requests(64, 0))  # never iterated: nothing is read
        try:
            time.sleep(1.0)
            before = module_server.rss_kib()
            time.sleep(3.0)
            grown = module_server.rss_kib() - before
            assert grown < 50_000, f"server RSS grew {grown} KiB for a client that reads nothing"
            serves_a_trainer(module_server, small_dataset, "beside-a-stalled-client")
            assert module_server.rss_kib() - before < 50_000, "the stalled stream piled up frames"
        finally:
            stop.set()
            call.cancel()


def test_a_trainer_that_goes_away_during_a_send_ends_its_stream_quietly(server_factory: Factory) -> None:
    """A cancel while the server waits on a write: the session is freed at once, no ERROR is logged.

    The server used to be an async generator: the failed write landed in grpc's
    loop, which logged ``ExecuteBatchError`` with a traceback (2 of 4 tries) and
    left the generator's clean-up to the garbage collector (a churn audit saw a
    session held for minutes).
    """
    # a window wider than HTTP/2 lets through unread (4096 batches of ~15 KB): the write stalls
    module_server = server_factory(["--max-prefetch", "4096"])
    logged_before = len(whole_log(module_server))
    for i in range(4):
        job = f"gone-mid-send-{i}"
        stop = threading.Event()

        def requests(job: str = job, stop: threading.Event = stop) -> Iterator[pb.StreamRequest]:
            yield pb.StreamRequest(open=pb.Open(job=job, rank=0, world_size=1, prefetch=4096))
            stop.wait(60)

        with grpc.insecure_channel(module_server.address) as channel:
            call = rpc.BatchServiceClient(channel).stream(requests())  # never read: the write stalls
            time.sleep(0.5)
            stop.set()
            call.cancel()
        deadline = time.monotonic() + 10
        while f"stream end: job={job} " not in whole_log(module_server):
            assert time.monotonic() < deadline, f"{job}: the stream never ended on the server"
            time.sleep(0.05)
        line = next(x for x in whole_log(module_server).splitlines() if f"stream end: job={job} " in x)
        assert "the call ended during a send" in line or "ended by the trainer" in line, line
        status, body = http_get(module_server, "/metrics")
        assert status == 200
        assert f'job="{job}"' not in "".join(
            x for x in body.decode().splitlines(keepends=True) if x.startswith("ladle_stream_prefetch_depth")
        ), f"{job}: still listed as an open stream"
    log = whole_log(module_server)[logged_before:]
    assert "ExecuteBatchError" not in log, log[-3000:]
    assert " ERROR " not in log, log[-3000:]


# ------------------------------------------------------------------ HTTP

HTTP_JOB = "hostile-http"
LONG = "j" * 10_000
HOSTILE_QUERIES = [
    f"/v1/jobs/{HTTP_JOB}/schedule?limit=1000000000000",
    f"/v1/jobs/{HTTP_JOB}/schedule?limit=0",
    f"/v1/jobs/{HTTP_JOB}/schedule?limit=-5",
    f"/v1/jobs/{HTTP_JOB}/schedule?start=-1",
    f"/v1/jobs/{HTTP_JOB}/schedule?start=99999999999999999999999",
    f"/v1/jobs/{HTTP_JOB}/schedule?epoch=abc",
    f"/v1/jobs/{HTTP_JOB}/schedule?epoch=1.5",
    f"/v1/jobs/{HTTP_JOB}/schedule?epoch=-1",
    f"/v1/jobs/{HTTP_JOB}/schedule?epoch=1e400",
    f"/v1/jobs/{HTTP_JOB}/schedule?epoch=100000000000000000000000000000",
    f"/v1/jobs/{HTTP_JOB}/schedule?rank=-1",
    f"/v1/jobs/{HTTP_JOB}/schedule?rank=7",
    f"/v1/jobs/{HTTP_JOB}/schedule?include=everything",
    f"/v1/jobs/{HTTP_JOB}/schedule?interleave=bogus",
    f"/v1/jobs/{HTTP_JOB}/schedule?limit=1&limit=abc",
    f"/v1/jobs/{HTTP_JOB}/buckets?interleave=%00",
    f"/v1/jobs/{HTTP_JOB}/quality?epoch=%F0%9F%92%A9",
    f"/v1/jobs/{LONG}",
    f"/v1/jobs/{LONG}/schedule",
    "/v1/jobs/..%2F..%2F..%2Fetc%2Fpasswd",
    "/v1/jobs/../../../etc/passwd",
    "/v1/jobs/%2e%2e/%2e%2e/etc/passwd/schedule",
    "/v1/jobs/run%00x",
    "/v1/jobs/%ff%fe",
    "/v1/jobs/" + urllib.parse.quote("日本語"),
    "/v1/jobs/no-such-job/quality",
    f"/?job={LONG}",
    "/?job=../../etc/passwd",
    "/?world_size=1000000000",
    "/?world_size=0",
    "/?start=-1",
    "/?epoch=nope",
    "/static/../../../../etc/passwd",
    "/" + "a" * 20_000,
]


def test_absurd_http_queries_get_4xx_never_5xx(module_server: ServerProcess) -> None:
    with BatchClient(0, 2, module_server.address, HTTP_JOB, timeout=60) as client:
        consume(client, limit=2)
    for target in HOSTILE_QUERIES:
        status, body = http_get(module_server, target)
        assert 400 <= status < 500, f"GET {target[:120]}: {status} {body[:300]!r}"
        if body.startswith(b"{"):
            assert json.loads(body), f"GET {target[:120]}: an empty error body"
    # a far epoch of a real job is a schedule like any other, a start past its end an empty page
    for target in (
        "schedule?epoch=9007199254740991&limit=2",
        "schedule?start=9007199254740991",
        "quality?epoch=0",
    ):
        status, body = http_get(module_server, f"/v1/jobs/{HTTP_JOB}/{target}")
        assert status == 200, f"GET {target}: {status} {body[:300]!r}"
    status, _ = http_get(module_server, "/healthz")
    assert status == 200
    assert "ERROR ladle.http" not in whole_log(module_server), "a query crashed a handler"


# ------------------------------------------------------------------ the dataset on disk


def data_files(dataset: Path) -> list[Path]:
    files = sorted(dataset.glob("data-*.arrow"))
    assert files, f"no Arrow files in {dataset}"
    return files


def serve_a_copy(server_factory: Factory, small_dataset: Path, tmp_path: Path) -> tuple[ServerProcess, Path]:
    """A server of a copy of the dataset (the test may change its files), and the copy's first data file."""
    copy = tmp_path / "served-ds"
    shutil.copytree(small_dataset, copy)
    return server_factory(dataset=copy), data_files(copy)[0]


@pytest.mark.parametrize("how", ["truncated", "grown", "replaced", "rewritten", "removed"])
def test_every_change_of_a_data_file_is_detected(small_dataset: Path, tmp_path: Path, how: str) -> None:
    copy = tmp_path / "ds"
    shutil.copytree(small_dataset, copy)
    dataset = open_dataset(copy)
    dataset.check_files()  # as opened: no complaint
    victim = data_files(copy)[0]
    if how == "truncated":
        os.truncate(victim, victim.stat().st_size // 2)
    elif how == "grown":
        with victim.open("ab") as fh:
            fh.write(b"\0" * 100)
    elif how == "replaced":
        shutil.copyfile(victim, tmp_path / "new.arrow")
        os.replace(tmp_path / "new.arrow", victim)
    elif how == "rewritten":  # same size, new bytes, in place
        stat = victim.stat()
        with victim.open("r+b") as fh:
            fh.seek(stat.st_size - 8)
            fh.write(b"\xff" * 8)
        os.utime(victim, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))
    else:
        victim.unlink()
    with pytest.raises(DatasetChangedError) as info:
        dataset.check_files()
    assert info.value.file == str(victim)
    assert str(victim) in str(info.value)


def test_a_dataset_truncated_while_served(
    server_factory: Factory, small_dataset: Path, tmp_path: Path
) -> None:
    """The trainer gets FAILED_PRECONDITION naming the file, the log names it, and the server stays up."""
    server, victim = serve_a_copy(server_factory, small_dataset, tmp_path)
    client = BatchClient(0, 1, server.address, "truncated", timeout=60, prefetch=1)
    try:
        it = iter(client)
        next(it)
        os.truncate(victim, victim.stat().st_size // 3)  # reading the cut pages would be a SIGBUS
        with pytest.raises(BatchClientError) as info:  # noqa: PT012 - a batch or two were already in flight
            for _ in range(10):
                next(it)
        assert info.value.code == "FAILED_PRECONDITION", info.value
        assert str(victim) in str(info.value), f"the error does not name the file: {info.value}"
    finally:
        client.close()

    # the trailer says the same to any new stream
    with grpc.insecure_channel(server.address) as channel:
        stub = rpc.BatchServiceClient(channel)
        opening = pb.StreamRequest(open=pb.Open(job="after-truncation", rank=0, world_size=1, prefetch=1))
        with pytest.raises(grpc.RpcError) as raw:
            list(stub.stream(iter([opening]), timeout=60))
        assert raw.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        details = rpc.error_details(raw.value.trailing_metadata())
        assert details is not None
        assert details.reason == "dataset_changed", details
        assert str(victim) in details.message
        info_reply = stub.describe("after-truncation", timeout=60)  # requests that read no tokens: answered
        assert info_reply.steps_per_epoch > 0

    assert server.proc is not None
    assert server.proc.poll() is None, "the server died"
    assert http_get(server, "/healthz")[0] == 200, "healthz stopped answering"
    status, body = http_get(server, "/readyz")
    assert status == 503, body
    assert json.loads(body)["dataset_ok"] is False, body
    assert http_get(server, "/v1/jobs")[0] == 200
    log = server.log_tail()
    assert f"ERROR ladle.server: dataset file {victim}" in log, f"the log does not name the file: {log}"


# ------------------------------------------------------------------ Redis goes away


class Trainers:
    """``world`` trainer threads reading one epoch each of ``job`` (20 ms a batch), errors kept."""

    def __init__(self, server: ServerProcess, job: str, world: int) -> None:
        self.got: dict[int, list[dict[str, Any]]] = {r: [] for r in range(world)}
        self.errors: list[BaseException] = []
        self.reconnects: dict[int, int] = {}
        self.threads = [
            threading.Thread(target=self._train, args=(server, job, world, r), daemon=True)
            for r in range(world)
        ]
        for t in self.threads:
            t.start()

    def _train(self, server: ServerProcess, job: str, world: int, rank: int) -> None:
        try:
            with BatchClient(rank, world, server.address, job, timeout=120) as client:
                for batch in client:
                    self.got[rank].append({"step": batch.step, "sample_ids": np.array(batch.sample_ids)})
                    time.sleep(0.02)
                self.reconnects[rank] = client.reconnects
        except BaseException as exc:  # surfaced by the test
            self.errors.append(exc)

    def wait_for(self, steps: int) -> None:
        deadline = time.monotonic() + 60
        while min(len(g) for g in self.got.values()) < steps:
            assert not self.errors, self.errors
            assert time.monotonic() < deadline, "the trainers made no progress"
            time.sleep(0.01)

    def join(self, timeout: float) -> None:
        for t in self.threads:
            t.join(timeout=timeout)

    def check_exactly_once(self, dataset: Path) -> None:
        """Every rank got its steps in order, each batch as scheduled, and every row once."""
        assert not self.errors, self.errors
        sched = reference(dataset, len(self.got))
        served = []
        for rank, got in self.got.items():
            steps = [b["step"] for b in got]
            assert steps == list(range(sched.num_steps)), f"rank {rank}: a step lost or repeated"
            for b in got:
                assert np.array_equal(b["sample_ids"], sched.samples(b["step"], rank)), (
                    f"rank {rank}: other samples"
                )
                served.append(b["sample_ids"])
        ids = np.concatenate(served)
        assert len(np.unique(ids)) == len(ids), "duplicate samples"
        assert len(ids) + len(sched.dropped) == open_dataset(dataset).num_rows, "missing samples"


def test_redis_going_away_mid_epoch(
    redis_server_factory: Callable[..., Any], server_factory: Factory, small_dataset: Path
) -> None:
    """/readyz turns 503, the trainers wait (backoff) and finish the epoch exactly once when Redis returns."""
    world = 2
    redis = redis_server_factory(appendonly=True, appendfsync="always")
    server = server_factory(extra=["--redis-url", redis.url])
    sched = reference(small_dataset, world)
    trainers = Trainers(server, "redis-outage", world)
    got = trainers.got
    try:
        trainers.wait_for(sched.num_steps // 4)
        redis.stop()
        deadline = time.monotonic() + 30
        while http_get(server, "/readyz")[0] != 503:
            assert time.monotonic() < deadline, "/readyz stayed ready with Redis gone"
            time.sleep(0.1)
        stalled = {r: len(g) for r, g in got.items()}
        time.sleep(3.0)  # longer than the client's first backoffs
        assert not trainers.errors, f"a trainer failed instead of waiting: {trainers.errors}"
        assert all(t.is_alive() for t in trainers.threads), "a trainer gave up while Redis was away"
        assert all(len(got[r]) <= stalled[r] + 8 for r in got), "batches flowed with no store"
        redis.start()  # same port, the AOF brings the cursors back
        trainers.join(timeout=120)
        assert not trainers.errors, trainers.errors
        reconnects = trainers.reconnects
        assert all(n >= 1 for n in reconnects.values()), f"the outage reached no trainer: {reconnects}"
        assert http_get(server, "/readyz")[0] == 200
    finally:
        redis.start()
        trainers.join(timeout=30)
    trainers.check_exactly_once(small_dataset)


def test_a_redis_that_stops_answering_stops_no_other_call(
    redis_server_factory: Callable[..., Any], server_factory: Factory, small_dataset: Path
) -> None:
    """A Redis that hangs (SIGSTOP: connected, silent) holds up cursor writes, not the server's event loop.

    Each write waits out the store's socket timeout (5 s) on a store thread:
    health checks and Describe still answer at once, and the epoch ends
    exactly once when Redis answers again. (With the writes on the event
    loop, each stream's write froze every call for 5 s, one stream after
    another.)
    """
    world = 3
    redis = redis_server_factory()
    server = server_factory(extra=["--redis-url", redis.url])
    sched = reference(small_dataset, world)
    trainers = Trainers(server, "redis-hangs", world)
    slowest: list[float] = []
    try:
        trainers.wait_for(sched.num_steps // 4)
        with grpc.insecure_channel(server.address) as channel:
            health = channel.unary_unary(
                "/grpc.health.v1.Health/Check", request_serializer=None, response_deserializer=None
            )
            describe = rpc.BatchServiceClient(channel)

            def probe() -> None:
                began = time.monotonic()
                try:
                    health(b"", timeout=10)
                except grpc.RpcError as exc:
                    if exc.code() != grpc.StatusCode.DEADLINE_EXCEEDED:
                        raise  # (10 s without an answer is counted as 10 s)
                slowest.append(time.monotonic() - began)

            probe()
            os.kill(redis.pid, signal.SIGSTOP)
            try:
                stalled = time.monotonic()
                while time.monotonic() - stalled < 8.0:  # the writes of every stream time out
                    probe()
                    time.sleep(0.25)
                with pytest.raises(grpc.RpcError) as refused:
                    describe.describe("no-such-job", timeout=10)
                # a Describe waits for the store on a thread of its own: the loop is free meanwhile
                assert refused.value.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.NOT_FOUND)
                probe()
            finally:
                os.kill(redis.pid, signal.SIGCONT)
        trainers.join(timeout=120)
    finally:
        os.kill(redis.pid, signal.SIGCONT)
        trainers.join(timeout=30)
    assert max(slowest) < 2.0, f"a health check waited {max(slowest):.1f}s while Redis hung"
    trainers.check_exactly_once(small_dataset)


def test_a_hung_redis_ends_a_stream_after_one_write_timeout_with_one_log_line(
    redis_server_factory: Callable[..., Any], server_factory: Factory
) -> None:
    """The stream's last write at its end waited out a second 5 s timeout, and logged the failure again."""
    import datetime

    redis = redis_server_factory()
    server = server_factory(extra=["--redis-url", redis.url])
    stop = threading.Event()

    def train() -> None:
        with BatchClient(0, 1, server.address, "hung-once", timeout=60) as client:
            while not stop.is_set():  # epoch after epoch
                for _batch in client:
                    if stop.is_set():
                        return
                    time.sleep(0.01)

    thread = threading.Thread(target=train, daemon=True)
    thread.start()
    try:
        time.sleep(1.0)  # streaming, its cursor written every 50 ms
        os.kill(redis.pid, signal.SIGSTOP)
        hung = time.time()
        deadline = time.monotonic() + 20
        while "unavailable: cursor store" not in server.log_tail() and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        os.kill(redis.pid, signal.SIGCONT)
        stop.set()
        thread.join(timeout=60)
    log = server.log_tail().splitlines()
    ends = [line for line in log if "stream end:" in line and "unavailable: cursor store" in line]
    assert ends, f"the stream did not end with the store's error: {log}"
    at = datetime.datetime.strptime(ends[0][:23], "%Y-%m-%d %H:%M:%S,%f").timestamp()  # the log's local time
    took = at - hung
    # one write's timeout is 5 s; a second write (an Ack that came after the first one failed, or a
    # last write at the end) took it to 10 s
    assert took < 9.0, f"the stream ended {took:.1f}s after Redis hung"
    # the first stream's own lines (the trainer's reconnect opens a second stream, which may fail too)
    first_stream = log[: log.index(ends[0]) + 1]
    failures = [line for line in first_stream if "the cursor write failed" in line]
    assert len(failures) == 1, failures


def test_a_trainer_that_closes_while_redis_hangs_has_its_position_stored_when_redis_answers(
    redis_server_factory: Callable[..., Any], server_factory: Factory, small_dataset: Path
) -> None:
    """A trainer read its epoch's last batch and closed while a cursor write waited on a hung Redis:
    the write failed after the stream had ended, nobody reconnected to put the position back, and the
    store kept a position an epoch behind for good (a restart without a checkpoint replayed it)."""
    redis = redis_server_factory()
    server = server_factory(extra=["--redis-url", redis.url])
    steps = reference(small_dataset, 1).num_steps
    hung = False
    try:
        with BatchClient(0, 1, server.address, "late-write", timeout=60) as client:
            batches = iter(client)
            for _ in range(3):
                next(batches)
            time.sleep(0.3)  # stored (every 50 ms)
            os.kill(redis.pid, signal.SIGSTOP)
            hung = True
            assert 3 + sum(1 for _ in batches) == steps, "the stream did not go on while the write waited"
        time.sleep(7.0)  # the write in flight fails (5 s) after the trainer closed
        assert http_get(server, "/readyz")[0] == 503
    finally:
        if hung:
            os.kill(redis.pid, signal.SIGCONT)
    deadline = time.monotonic() + 20
    while True:
        status, body = http_get(server, "/v1/jobs/late-write/cursor")
        assert status == 200, body
        rank = json.loads(body)["ranks"][0]
        if (rank["epoch"], rank["step"]) in ((1, 0), (0, steps)):
            break
        assert time.monotonic() < deadline, f"the stored position stayed at {rank}, {steps} steps consumed"
        time.sleep(0.2)
    while "stored after the store came back" not in server.log_tail():  # logged just after the write
        assert time.monotonic() < deadline, f"no log line for the late write: {server.log_tail()}"
        time.sleep(0.1)


def test_a_server_stopped_while_a_last_write_waits_names_the_position(
    redis_server_factory: Callable[..., Any], server_factory: Factory, small_dataset: Path
) -> None:
    """Stopped while the ended stream's write still waited on a hung Redis, it said nothing of it."""
    redis = redis_server_factory()
    server = server_factory(extra=["--redis-url", redis.url])
    try:
        with BatchClient(0, 1, server.address, "in-doubt", timeout=60) as client:
            batches = iter(client)
            next(batches)
            time.sleep(0.3)
            os.kill(redis.pid, signal.SIGSTOP)
            for _ in batches:
                pass
        time.sleep(0.5)  # the stream has ended; its last write waits (5 s)
        assert server.stop() == 0
    finally:
        os.kill(redis.pid, signal.SIGCONT)
    lines = [line for line in whole_log(server).splitlines() if "may not be stored" in line]
    assert lines, f"nothing said of the position in doubt: {server.log_tail()}"
    assert "job in-doubt rank 0" in lines[0], lines[0]


@pytest.mark.parametrize("store_answers", [True, False], ids=["store-back", "store-refusing"])
def test_a_position_left_unwritten_gets_a_last_try_at_shutdown(
    redis_server_factory: Callable[..., Any], server_factory: Factory, store_answers: bool
) -> None:
    """A stream ended with its last position refused by Redis (full: OOM), and the server was stopped
    while the retry waited for its next try: it dropped the position without a try and logged that
    "the store did not answer", though Redis had taken writes again 0.4 s before. Now the retry makes
    its last try at once, within the grace period, and the log says what became of it."""
    from ladle.service.store import open_store
    from ladle.service.store.base import Position

    redis = redis_server_factory()
    server = server_factory(extra=["--redis-url", redis.url, "--grace", "5"])
    with redis.client() as plain:
        with BatchClient(0, 1, server.address, "last-try", timeout=30) as client:
            batches = iter(client)
            for _ in range(3):
                next(batches)  # steps 0 and 1 consumed, 2 held
            time.sleep(0.3)  # stored (every 50 ms)
            plain.config_set("maxmemory", "1")  # noeviction: every write is refused at once (OOM)
            next(batches)  # step 2 consumed: its acknowledgement's write is refused, the stream ends
            deadline = time.monotonic() + 20
            while "stream end: job=last-try" not in server.log_tail():
                assert time.monotonic() < deadline, server.log_tail()
                time.sleep(0.02)
        # the retry tries 0.5 s and 1.5 s after the stream's end, then 3.5 s after it: stopped between
        time.sleep(1.9)
        if store_answers:
            plain.config_set("maxmemory", "0")
        assert server.stop() == 0
        plain.config_set("maxmemory", "0")
    log = whole_log(server)
    assert "did not answer" not in log, log[-3000:]
    store = open_store(redis_url=redis.url, state_path="unused", job_ttl_s=0)
    try:
        stored = store.get("last-try").ranks[0].position
    finally:
        store.close()
    target = "job last-try rank 0 (position Position(epoch=0, step=3))"
    if store_answers:
        assert stored == Position(0, 3), f"the position was not stored at shutdown: {log[-3000:]}"
        assert f"the last write of {target} was written at shutdown" in log, log[-3000:]
    else:
        assert stored == Position(0, 2), stored
        line = next(
            (x for x in log.splitlines() if f"the last write of {target} failed at shutdown" in x), ""
        )
        assert "maxmemory" in line, f"the log does not say how the last try failed: {log[-3000:]}"


def test_readiness_answers_within_a_second_while_redis_hangs(
    redis_server_factory: Callable[..., Any], server_factory: Factory
) -> None:
    """/readyz waited out the store's 5 s socket timeout: a probe's own timeout (1 s) expired first."""
    redis = redis_server_factory()
    server = server_factory(extra=["--redis-url", redis.url])
    assert http_get(server, "/readyz")[0] == 200
    os.kill(redis.pid, signal.SIGSTOP)
    try:
        for _ in range(3):  # the second and third wait on the first one's ping, still in flight
            began = time.monotonic()
            status, body = http_get(server, "/readyz")
            took = time.monotonic() - began
            assert status == 503, body
            assert took < 2.5, f"/readyz took {took:.1f}s with Redis hung"
            assert b"did not answer within 1 s" in body, body
    finally:
        os.kill(redis.pid, signal.SIGCONT)
    deadline = time.monotonic() + 15
    while http_get(server, "/readyz")[0] != 200:
        assert time.monotonic() < deadline, "/readyz did not come back with Redis"
        time.sleep(0.2)


def test_readiness_is_503_while_redis_refuses_every_write(
    redis_server_factory: Callable[..., Any], server_factory: Factory
) -> None:
    """A Redis at maxmemory with noeviction answers PING but refuses every write: streams end, and
    /readyz said ready (200), so the Service kept sending trainers to this replica."""
    redis = redis_server_factory(extra_args=("--maxmemory", "4mb", "--maxmemory-policy", "noeviction"))
    server = server_factory(extra=["--redis-url", redis.url])
    with redis.client() as plain:
        filler = "x" * 1000
        try:
            for i in range(20_000):
                plain.set(f"junk:{i}", filler)
        except Exception:
            pass  # full: "OOM command not allowed when used memory > 'maxmemory'"
        with (
            BatchClient(0, 1, server.address, "full-redis", timeout=3) as client,
            pytest.raises(BatchClientError),
        ):
            next(iter(client))  # its join is refused
        status, body = http_get(server, "/readyz")
        assert status == 503, body
        assert b"maxmemory" in body, body  # the readiness check's own write says why
        plain.delete(*[f"junk:{i}" for i in range(20_000)])  # room again
    with BatchClient(0, 1, server.address, "full-redis", timeout=30) as client:
        assert next(iter(client)).step == 0  # a write succeeds again
    assert http_get(server, "/readyz")[0] == 200
