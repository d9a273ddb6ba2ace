"""Batch transport on loopback: the two wire layouts beside bare gRPC and raw TCP.

Every case streams the same production-shape batches (<= 49152 padded tokens,
225-241 KiB a frame) from one server process to 1 and 2 client processes on
127.0.0.1 and reports the aggregate GB/s and batches/s (median of the
repeats). The cases, in the order the README's table lists them:

- ``tcp``: a raw TCP socket carrying the frames' bytes: the physical limit.
- ``grpc_raw``: a bare grpcio server stream of the identical pre-encoded
  frames with identity serializers, no codec: gRPC's own limit.
- ``frame``: layout (b): the server runs ``codec.encode_batch`` per batch,
  identity serializers, the client runs ``codec.decode_batch`` (all checks,
  zero-copy views).
- ``protobuf``: layout (a): a ``ladle.v1.Batch`` message with ``bytes``
  fields built per batch and serialized by protobuf; the client parses it
  and views the fields with ``np.frombuffer``.
- ``frame_bidi``, ``frame_bidi_64``: layout (b) through the production call
  shape: a bidirectional stream opened with ``Open{prefetch}`` and fed
  ``Credit`` messages, so at most ``prefetch`` batches are in flight (16 with
  a credit every 4 batches; 64 with a credit every 16).

Ratios ("x grpc_raw", "x protobuf") are medians of per-repeat ratios: each
case is paired with the baseline run of the same repeat, seconds apart, which
holds up better than a ratio of medians on a machine whose load changes. "CPU
us/batch" is the server's and the clients' CPU time (all threads) per batch.
It also times encode and decode alone in this process. Bounded loops only;
every socket binds 127.0.0.1; the server and client processes are stopped in
``finally`` blocks. Run: ``python -m benchmarks.bench_wire`` (``--quick``
for a smoke run); JSON on stdout, a table on stderr.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import queue
import socket
import statistics
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from contextlib import suppress
from itertools import cycle, islice
from multiprocessing.process import BaseProcess
from multiprocessing.synchronize import Event
from pathlib import Path
from typing import Any

import numpy as np

from ladle.proto import codec, rpc
from ladle.proto import ladle_pb2 as pb

CASES = ("tcp", "grpc_raw", "frame", "protobuf", "frame_bidi", "frame_bidi_64")
TOKEN_BUDGET = 49152
MAX_BATCH_SIZE = 64
# (rows, padded_len) of the production buckets' full batches: rows x padded_len <= 49152.
SHAPES = ((64, 768), (40, 1216), (28, 1728), (20, 2432), (14, 3296), (6, 8192))
FINGERPRINT = "0123456789abcdef"
# (prefetch, credit every n batches) of the bidirectional cases
WINDOWS = {"frame_bidi": (16, 4), "frame_bidi_64": (64, 16)}
SERVICE = "ladle.bench.Wire"
GRPC_WORKERS = 4
WAIT_S = 120.0  # the longest any step of the benchmark waits for a process


# ---------------------------------------------------------------- batches


def make_batches(seed: int = 0) -> list[dict[str, Any]]:
    """One random batch of each production shape, as the arrays the server holds."""
    rng = np.random.default_rng(seed)
    out = []
    for step, (rows, padded_len) in enumerate(SHAPES):
        lengths = rng.integers(max(1, padded_len * 3 // 4), padded_len + 1, size=rows).astype(np.int32)
        lengths[0] = padded_len
        keep = np.arange(padded_len)[None, :] < lengths[:, None]
        ids = np.where(keep, rng.integers(0, 128_000, size=(rows, padded_len)), 0).astype(np.int32)
        out.append(
            {
                "epoch": 0,
                "step": step,
                "rank": 0,
                "bucket": step % 6,
                "schedule_fingerprint": FINGERPRINT,
                "input_ids": ids,
                "loss_mask": keep.astype(np.int8),
                "lengths": lengths,
                "sample_ids": rng.integers(0, 10_000_000, size=rows, dtype=np.int64),
            }
        )
    return out


def to_protobuf(batch: dict[str, Any]) -> Any:
    """Layout (a): the batch as a ``ladle.v1.Batch`` with raw little-endian bytes fields."""
    ids = batch["input_ids"]
    rows, padded_len = ids.shape
    return pb.Batch(
        epoch=batch["epoch"],
        step=batch["step"],
        rank=batch["rank"],
        bucket=batch["bucket"],
        rows=rows,
        padded_len=padded_len,
        real_tokens=int(batch["lengths"].sum()),
        padded_tokens=rows * padded_len,
        schedule_fingerprint=batch["schedule_fingerprint"],
        input_ids_dtype=pb.DTYPE_INT32,
        loss_mask_dtype=pb.DTYPE_INT8,
        lengths_dtype=pb.DTYPE_INT32,
        sample_ids_dtype=pb.DTYPE_INT64,
        input_ids=ids.astype("<i4", copy=False).tobytes(),
        loss_mask=batch["loss_mask"].astype("<i1", copy=False).tobytes(),
        lengths=batch["lengths"].astype("<i4", copy=False).tobytes(),
        sample_ids=batch["sample_ids"].astype("<i8", copy=False).tobytes(),
    )


def from_protobuf(message: Any) -> tuple[np.ndarray[Any, Any], ...]:
    """The client side of layout (a): numpy views of the parsed message's bytes fields."""
    rows, padded_len = message.rows, message.padded_len
    if message.input_ids_dtype != pb.DTYPE_INT32 or message.loss_mask_dtype != pb.DTYPE_INT8:
        raise ValueError("unexpected dtype")
    return (
        np.frombuffer(message.input_ids, dtype="<i4").reshape(rows, padded_len),
        np.frombuffer(message.loss_mask, dtype="<i1").reshape(rows, padded_len),
        np.frombuffer(message.lengths, dtype="<i4"),
        np.frombuffer(message.sample_ids, dtype="<i8"),
    )


def _max_frame() -> int:
    return codec.max_frame_bytes(TOKEN_BUDGET, MAX_BATCH_SIZE)


# ---------------------------------------------------------------- server process


def _grpc_handlers(batches: list[dict[str, Any]], frames: list[bytes]) -> Any:
    import grpc

    def count_of(request: bytes) -> int:
        return int.from_bytes(request, "little")

    def raw(request: bytes, _context: Any) -> Iterator[bytes]:
        yield from islice(cycle(frames), count_of(request))

    def frame(request: bytes, _context: Any) -> Iterator[bytes]:
        for batch in islice(cycle(batches), count_of(request)):
            yield codec.encode_batch(**batch)

    def protobuf(request: bytes, _context: Any) -> Iterator[Any]:
        for batch in islice(cycle(batches), count_of(request)):
            yield to_protobuf(batch)

    def frame_bidi(requests: Iterator[Any], _context: Any) -> Iterator[bytes]:
        first = next(requests)
        credit = first.open.prefetch
        count = first.open.start.step  # the benchmark's stand-in for "how many batches"
        for batch in islice(cycle(batches), count):
            while credit == 0:
                credit += next(requests).credit.n
            credit -= 1
            yield codec.encode_batch(**batch)

    identity: dict[str, Any] = {"request_deserializer": None, "response_serializer": None}
    return grpc.method_handlers_generic_handler(
        SERVICE,
        {
            "grpc_raw": grpc.unary_stream_rpc_method_handler(raw, **identity),
            "frame": grpc.unary_stream_rpc_method_handler(frame, **identity),
            "protobuf": grpc.unary_stream_rpc_method_handler(
                protobuf, request_deserializer=None, response_serializer=pb.Batch.SerializeToString
            ),
            "frame_bidi": grpc.stream_stream_rpc_method_handler(
                frame_bidi, request_deserializer=pb.StreamRequest.FromString, response_serializer=None
            ),
        },
    )


def _tcp_serve(listener: socket.socket, frames: list[bytes], stop: Event) -> None:
    def send(conn: socket.socket) -> None:
        with conn:
            request = conn.recv(8)
            if len(request) != 8:
                return
            count = int.from_bytes(request, "little")
            parts = list(islice(cycle(frames), count))
            conn.sendall(sum(len(p) for p in parts).to_bytes(8, "little"))
            for part in parts:
                conn.sendall(part)

    listener.settimeout(0.2)
    workers: list[threading.Thread] = []
    while not stop.is_set():
        try:
            conn, _ = listener.accept()
        except TimeoutError:
            continue
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        worker = threading.Thread(target=send, args=(conn,), daemon=True)
        worker.start()
        workers.append(worker)
    for worker in workers:
        worker.join(timeout=5)


def serve(ports: Any, stop: Event) -> None:
    """The server process: one gRPC server and one TCP listener on 127.0.0.1, until ``stop``."""
    import grpc

    batches = make_batches()
    frames = [codec.encode_batch(**b) for b in batches]
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=GRPC_WORKERS),
        options=rpc.message_options(_max_frame()),
    )
    server.add_generic_rpc_handlers((_grpc_handlers(batches, frames),))
    grpc_port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    listener = socket.create_server(("127.0.0.1", 0))
    try:
        ports.put((grpc_port, listener.getsockname()[1]))
        _tcp_serve(listener, frames, stop)
    finally:
        listener.close()
        server.stop(grace=None).wait(5)


# ---------------------------------------------------------------- client process


def _run_tcp(port: int, count: int) -> tuple[int, int]:
    with socket.create_connection(("127.0.0.1", port), timeout=WAIT_S) as conn:
        conn.sendall(count.to_bytes(8, "little"))
        total = int.from_bytes(_recv_exactly(conn, 8), "little")
        buffer = memoryview(bytearray(1 << 20))
        left = total
        while left:
            got = conn.recv_into(buffer, min(left, len(buffer)))
            if not got:
                raise ConnectionError("server closed the connection early")
            left -= got
    return total, count


def _tcp_runner(port: int) -> Callable[[int], tuple[int, int]]:
    return lambda count: _run_tcp(port, count)


def _recv_exactly(conn: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        part = conn.recv(n - len(data))
        if not part:
            raise ConnectionError("server closed the connection early")
        data += part
    return data


def _bidi_requests(count: int, prefetch: int, credits: queue.SimpleQueue[int]) -> Iterator[Any]:
    start = pb.Position(epoch=0, step=count)  # the server reads the count from here
    yield pb.StreamRequest(open=pb.Open(job="bench", rank=0, world_size=1, start=start, prefetch=prefetch))
    while (n := credits.get()) > 0:
        yield pb.StreamRequest(credit=pb.Credit(n=n))


def _grpc_runner(channel: Any, case: str) -> Callable[[int], tuple[int, int]]:
    method = f"/{SERVICE}/{case}"
    if case in WINDOWS:
        method = f"/{SERVICE}/frame_bidi"
        call = channel.stream_stream(
            method, request_serializer=pb.StreamRequest.SerializeToString, response_deserializer=None
        )

        prefetch, credit_every = WINDOWS[case]

        def bidi(count: int) -> tuple[int, int]:
            credits: queue.SimpleQueue[int] = queue.SimpleQueue()
            nbytes = batches = 0
            try:
                for message in call(_bidi_requests(count, prefetch, credits), timeout=WAIT_S):
                    codec.decode_batch(message)
                    nbytes += len(message)
                    batches += 1
                    if batches % credit_every == 0:
                        credits.put(credit_every)
            finally:
                credits.put(0)
            return nbytes, batches

        return bidi

    def sized_batch(data: bytes) -> tuple[int, Any]:
        return len(data), pb.Batch.FromString(data)

    deserialize = sized_batch if case == "protobuf" else None
    stream = channel.unary_stream(method, request_serializer=None, response_deserializer=deserialize)

    def unary(count: int) -> tuple[int, int]:
        nbytes = batches = 0
        for message in stream(count.to_bytes(8, "little"), timeout=WAIT_S):
            if case == "frame":
                codec.decode_batch(message)
                nbytes += len(message)
            elif case == "protobuf":
                size, batch = message
                from_protobuf(batch)
                nbytes += size
            else:
                nbytes += len(message)
            batches += 1
        return nbytes, batches

    return unary


def client(jobs: Any, results: Any) -> None:
    """A client process: runs (case, port, count, start_at) jobs until it gets None."""
    import grpc

    channels: dict[int, Any] = {}
    try:
        while (job := jobs.get(timeout=WAIT_S)) is not None:
            case, port, count, warmup, start_at = job
            try:
                if case != "tcp" and port not in channels:
                    channels[port] = grpc.insecure_channel(
                        f"127.0.0.1:{port}", options=rpc.message_options(_max_frame())
                    )
                run = _tcp_runner(port) if case == "tcp" else _grpc_runner(channels[port], case)
                run(warmup)
                time.sleep(max(0.0, start_at - time.monotonic()))
                began, cpu = time.monotonic(), time.process_time()
                nbytes, batches = run(count)
                cpu = time.process_time() - cpu  # every thread of this process, gRPC's included
                results.put(("ok", began, time.monotonic(), nbytes, batches, cpu))
            except Exception as exc:
                results.put(("error", f"{case}: {type(exc).__name__}: {exc}", 0.0, 0, 0, 0.0))
    finally:
        for channel in channels.values():
            channel.close()


# ---------------------------------------------------------------- driver


def _cpu_seconds(pid: int | None) -> float:
    """CPU seconds (user + system, all threads) a process has used; NaN where /proc is missing."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return float("nan")
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _paired(
    measured: list[tuple[float, float, float]], baseline: list[tuple[float, float, float]] | None
) -> float | None:
    """Median over repeats of this case's GB/s over the baseline's GB/s in the same repeat."""
    if not baseline:
        return None
    return round(statistics.median(m[0] / b[0] for m, b in zip(measured, baseline, strict=True)), 2)


def _stop_all(processes: list[BaseProcess]) -> None:
    for process in processes:
        process.join(timeout=5)
        if process.is_alive():
            process.terminate()
            process.join(timeout=5)
        if process.is_alive():
            process.kill()
            process.join()


def bench_transport(
    batches_per_client: int,
    repeats: int,
    client_counts: tuple[int, ...],
    cases: tuple[str, ...] = CASES,
) -> dict[str, Any]:
    ctx = mp.get_context("spawn")  # grpc and fork do not mix
    stop = ctx.Event()
    ports = ctx.Queue()
    results = ctx.Queue()
    jobs = [ctx.Queue() for _ in range(max(client_counts))]
    server = ctx.Process(target=serve, args=(ports, stop), name="bench-wire-server", daemon=True)
    clients = [
        ctx.Process(target=client, args=(q, results), name=f"bench-wire-client-{i}", daemon=True)
        for i, q in enumerate(jobs)
    ]
    processes: list[BaseProcess] = [server, *clients]
    table: dict[str, Any] = {}
    try:
        server.start()
        for process in clients:
            process.start()
        grpc_port, tcp_port = ports.get(timeout=WAIT_S)
        runs: dict[tuple[str, int], list[tuple[float, float, float]]] = {}
        # Repeats outermost: a burst of load from elsewhere on the machine then
        # hits every case once instead of all the repeats of one case.
        for repeat in range(repeats):
            # every other repeat runs the cases backwards, so a drift in load favours none
            for case in cases if repeat % 2 == 0 else cases[::-1]:
                port = tcp_port if case == "tcp" else grpc_port
                for n_clients in client_counts:
                    start_at = time.monotonic() + 1.0
                    warmup = max(20, batches_per_client // 30)
                    for q in jobs[:n_clients]:
                        q.put((case, port, batches_per_client, warmup, start_at))
                    time.sleep(max(0.0, start_at - time.monotonic()))
                    server_cpu = _cpu_seconds(server.pid)
                    got = [results.get(timeout=WAIT_S) for _ in range(n_clients)]
                    server_cpu = _cpu_seconds(server.pid) - server_cpu
                    errors = [g[1] for g in got if g[0] != "ok"]
                    if errors:
                        raise RuntimeError("; ".join(errors))
                    seconds = max(g[2] for g in got) - min(g[1] for g in got)
                    nbytes = sum(g[3] for g in got)
                    count = sum(g[4] for g in got)
                    cpu_us = (server_cpu + sum(g[5] for g in got)) / count * 1e6
                    runs.setdefault((case, n_clients), []).append(
                        (nbytes / seconds / 1e9, count / seconds, cpu_us)
                    )
        for (case, n_clients), measured in runs.items():
            table[f"{case}/{n_clients}"] = {
                "clients": n_clients,
                "gb_s": round(statistics.median(m[0] for m in measured), 3),
                "batches_s": round(statistics.median(m[1] for m in measured)),
                "cpu_us_per_batch": round(statistics.median(m[2] for m in measured), 1),
                "runs_gb_s": [round(m[0], 3) for m in measured],
                # paired with the baseline run of the same repeat, seconds apart: steadier than
                # a ratio of medians when the machine's load changes during the benchmark
                "x_grpc_raw_paired": _paired(measured, runs.get(("grpc_raw", n_clients))),
                "x_protobuf_paired": _paired(measured, runs.get(("protobuf", n_clients))),
            }
        return table
    finally:
        stop.set()
        for q in jobs:
            with suppress(Exception):
                q.put(None)
        _stop_all(processes)


def _per_batch_us(fn: Callable[[int], object], n: int, rounds: int) -> float:
    """Median over ``rounds`` of the time to call ``fn(i)`` for every i < n, per call, in µs."""
    times = []
    for _ in range(rounds):
        began = time.perf_counter()
        for i in range(n):
            fn(i)
        times.append((time.perf_counter() - began) / n)
    return round(statistics.median(times) * 1e6, 1)


def bench_codec(rounds: int) -> dict[str, Any]:
    """Per-batch encode and decode cost in this process, over every production shape."""
    batches = make_batches()
    frames = [codec.encode_batch(**b) for b in batches]
    messages = [to_protobuf(b).SerializeToString() for b in batches]
    n = len(batches)
    return {
        "frame_bytes": [len(f) for f in frames],
        "max_frame_bytes": _max_frame(),
        "encode_batch_us": _per_batch_us(lambda i: codec.encode_batch(**batches[i]), n, rounds),
        "decode_batch_us": _per_batch_us(lambda i: codec.decode_batch(frames[i]), n, rounds),
        "protobuf_build_serialize_us": _per_batch_us(
            lambda i: to_protobuf(batches[i]).SerializeToString(), n, rounds
        ),
        "protobuf_parse_view_us": _per_batch_us(
            lambda i: from_protobuf(pb.Batch.FromString(messages[i])), n, rounds
        ),
        "one_copy_of_a_frame_us": _per_batch_us(lambda i: bytearray(frames[i]), n, rounds),
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.bench_wire", description=__doc__)
    parser.add_argument("--batches", type=int, default=3000, help="batches per client per run")
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--quick", action="store_true", help="a smoke run: 300 batches, 1 repeat")
    args = parser.parse_args(argv)
    batches, repeats = (300, 1) if args.quick else (args.batches, args.repeats)
    load_before = os.getloadavg()
    transport = bench_transport(batches, repeats, (1, 2))
    results: dict[str, Any] = {
        "load_average_before_after": [round(load_before[0], 2), round(os.getloadavg()[0], 2)],
        "batches_per_client": batches,
        "repeats": repeats,
        "codec": bench_codec(200 if not args.quick else 20),
        "transport": transport,
    }
    print(
        f"{'case':14} {'clients':>7} {'GB/s':>7} {'batches/s':>10} {'x grpc_raw':>10} {'x protobuf':>10} "
        f"{'CPU us/batch':>12}",
        file=sys.stderr,
    )
    for key, row in transport.items():
        case, clients = key.split("/")
        print(
            f"{case:14} {clients:>7} {row['gb_s']:7.3f} {row['batches_s']:10,} "
            f"{row['x_grpc_raw_paired']:10.2f} {row['x_protobuf_paired']:10.2f} "
            f"{row['cpu_us_per_batch']:12,.0f}",
            file=sys.stderr,
        )
    c = results["codec"]
    print(
        f"per batch: encode_batch {c['encode_batch_us']} us, decode_batch {c['decode_batch_us']} us; "
        f"protobuf build+serialize {c['protobuf_build_serialize_us']} us, parse+view "
        f"{c['protobuf_parse_view_us']} us; one copy of a frame {c['one_copy_of_a_frame_us']} us",
        file=sys.stderr,
    )
    return results


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1:]), indent=2))
