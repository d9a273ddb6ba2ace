"""Serving end to end on loopback: ``ladle serve`` and ``BatchClient`` beside their baselines.

Every figure is printed beside a baseline measured in the same run, on
127.0.0.1 only, with the production config (token budget 49152, <= 64 rows):

1. throughput: 2 client processes (ranks 0 and 1 of world size 2) each read
   one epoch through ``BatchClient`` (numpy, prefetch 8). Baselines: a bare
   grpcio server streaming pre-built raw ``bytes`` of exactly the sizes of
   the frames ladle sent, the same number, to 2 client processes (identity
   serializers, no ladle logic), and a raw TCP socket moving the same bytes
   (2 readers, and 1 reader for all of them): the physical limit. Beside
   them, the same frames in ladle's call shape with no ladle logic (a
   grpc.aio server, a bidirectional stream with credits returned at three
   quarters of the window, read through grpcio's iterator by a reader thread
   as BatchClient's is): it splits the gap to the bare stream into what the
   call shape costs and what ladle's own work per batch costs. And ladle and
   the bare stream once more with the server process on one CPU and the
   client processes on the other (``sched_setaffinity``; Linux, 2 CPUs or
   more): a server with a core of its own, as deployed, where the figure's
   setup shares both cores. Every client runs on grpcio's own default
   transport, through its public API. The ratios
   are paired per repeat (runs seconds apart) and their medians reported,
   as in ``bench_wire``. CPU per batch (server process, and the clients'
   processes, all threads) says where the cores went.
2. delivered to a training loop: one rank of world size 1 takes batches as
   torch tensors from ``BatchClient(device="cpu")``, beside a local
   ``DataLoader(num_workers=2, batch_size=None)`` over a map-style dataset
   whose item i is step i of the same schedule, gathered by ``Assembler``
   (``benchmarks/padded.py``) into the same arrays (int32 input_ids, int8 loss_mask and attention mask).
   ``num_workers=0`` (the same assembly in the loop's process, no IPC) is
   shown as a reference, not a target.
3. the time spent inside ``next()`` with a full prefetch window (the loop
   sleeps 2 ms a batch), beside decoding the same frames in the process.
4. the server's memory (VmRSS, RssAnon, RssFile from /proc) while it serves
   every batch of a dataset (4.1 GB in ``--full``; the throughput dataset
   in quick mode).

Rates are steady state: from the first message a client receives to its
last, counting the messages after the first. Datasets live in one temporary
folder, removed at the end; every process started here is stopped in a
``finally``. Run: ``python -m benchmarks.bench_serving [--full]``.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import queue
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent import futures
from contextlib import contextmanager, suppress
from multiprocessing.process import BaseProcess
from multiprocessing.synchronize import Event
from pathlib import Path
from typing import Any, cast

import numpy as np

from benchmarks.bench_dataset import _folder_bytes
from benchmarks.bench_wire import (
    GRPC_WORKERS,
    WAIT_S,
    _cpu_seconds,
    _max_frame,
    _run_tcp,
    _stop_all,
    _tcp_serve,
)
from ladle.proto import rpc
from ladle.service.synth import make_dataset

PREFETCH = 8
BARE_SERVICE = "ladle.bench.Serving"
SETTINGS: dict[bool, dict[str, Any]] = {
    False: {
        "rows": 40_000,
        "repeats": 3,
        "loop_repeats": 2,
        "loop_cap": 3000,
        "latency_batches": 1000,
        "memory_rows": None,
    },
    True: {
        "rows": 100_000,
        "repeats": 5,
        "loop_repeats": 3,
        "loop_cap": None,
        "latency_batches": 3000,
        "memory_rows": 400_000,
    },
}
LATENCY_SLEEP_S = 0.002
LATENCY_SKIP = 20  # batches read before measuring: the window fills
RSS_INTERVAL_S = 0.2
MIB = 1 << 20


def _r(x: float, digits: int = 3) -> float:
    return round(float(x), digits)


def _sleep_until(when: float) -> None:
    time.sleep(max(0.0, when - time.monotonic()))


# ---------------------------------------------------------------- the ladle server


class _Ladle:
    """One ``ladle serve`` child on 127.0.0.1 with the default (production) config."""

    def __init__(self, dataset: Path, workdir: Path, name: str, extra: tuple[str, ...] = ()) -> None:
        self.log = workdir / f"{name}.log"
        ready = workdir / f"{name}.ready"
        ready.unlink(missing_ok=True)  # a stale one would name another server's port
        # one store: the state file unless the caller gives a Redis (serve refuses both)
        store = [] if "--redis-url" in extra else ["--state", str(workdir / f"{name}-state.db")]
        cmd = [
            str(Path(sys.executable).with_name("ladle")), "serve", str(dataset), "--host", "127.0.0.1",
            "--grpc-port", "0", "--ready-file", str(ready), *store,
            "--http-port", "0", "--log-level", "WARNING", *extra,
        ]  # fmt: skip
        with self.log.open("ab") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + WAIT_S
        try:
            while not (ready.exists() and ready.read_text()):
                if self.proc.poll() is not None:
                    raise RuntimeError(f"ladle serve exited with {self.proc.returncode}: {self.log_tail()}")
                if time.monotonic() > deadline:
                    raise RuntimeError(f"ladle serve was not ready within {WAIT_S}s: {self.log_tail()}")
                time.sleep(0.05)
        except BaseException:
            self.stop()
            raise
        self.address = ready.read_text()

    @property
    def pid(self) -> int:
        return int(self.proc.pid)

    def log_tail(self) -> str:
        return self.log.read_text(errors="replace")[-2000:] if self.log.exists() else ""

    def log_problems(self) -> list[str]:
        """The server log's WARNING and ERROR lines (it runs at --log-level WARNING)."""
        return [line for line in self.log_tail().splitlines() if " WARNING " in line or " ERROR " in line]

    def stop(self) -> None:
        """SIGTERM (a graceful shutdown), then SIGKILL if it is still there after 30 s."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=30)


def _memory(pid: int) -> dict[str, int]:
    """VmRSS, RssAnon, RssFile and RssShmem of a process, in bytes."""
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "RssAnon", "RssFile", "RssShmem"):
            out[key] = int(value.split()[0]) * 1024
    return out


# ---------------------------------------------------------------- the bare baseline server


def _bare_server(sizes: list[list[int]], ports: Any, stop: Event, parent: int) -> None:
    """A process serving each rank's frames (pre-built ``bytes`` of ladle's sizes) over gRPC and TCP.

    gRPC: ``/ladle.bench.Serving/Frames`` with the rank (4 bytes) as the
    request streams that rank's messages, identity serializers. TCP: one
    listener per rank and one for both ranks' frames in a row
    (``bench_wire._tcp_serve``). Ends when ``stop`` is set or the parent is gone.
    """
    import grpc

    block = np.random.default_rng(0).bytes(max(max(s) for s in sizes))
    frames = [[block[:n] for n in rank_sizes] for rank_sizes in sizes]  # a copy each: real pages

    def stream(request: bytes, _context: Any) -> Iterator[bytes]:
        yield from frames[int.from_bytes(request, "little")]

    handler = grpc.method_handlers_generic_handler(
        BARE_SERVICE,
        {"Frames": grpc.unary_stream_rpc_method_handler(stream, None, None)},
    )
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=GRPC_WORKERS), options=rpc.message_options(_max_frame())
    )
    server.add_generic_rpc_handlers((handler,))
    grpc_port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    listeners = [socket.create_server(("127.0.0.1", 0)) for _ in range(3)]
    tcp_frames = [frames[0], frames[1], frames[0] + frames[1]]
    threads = [
        threading.Thread(target=_tcp_serve, args=(sock, f, stop), daemon=True)
        for sock, f in zip(listeners, tcp_frames, strict=True)
    ]
    try:
        for thread in threads:
            thread.start()
        ports.put((grpc_port, *(sock.getsockname()[1] for sock in listeners)))
        while not stop.wait(0.5) and os.getppid() == parent:
            pass
    finally:
        stop.set()
        for thread in threads:
            thread.join(timeout=10)
        for sock in listeners:
            sock.close()
        server.stop(grace=None).wait(5)


def _shape_server(sizes: list[list[int]], ports: Any, stop: Event, parent: int) -> None:
    """A process serving each rank's frames in ladle's call shape, with no ladle logic.

    ``/ladle.bench.Serving/Shaped`` on a ``grpc.aio`` server (ladle's server
    API): a bidirectional stream whose first request is the rank and the
    credit window (4 bytes each), whose later requests each return credits
    (4 bytes), and whose responses are the rank's pre-built frames, at most
    the credits ahead: ladle's Open, Ack credits and frames, without the
    schedule, the gather, the header, the cursor or the metrics.
    """
    import asyncio

    import grpc

    block = np.random.default_rng(0).bytes(max(max(s) for s in sizes))
    frames = [[block[:n] for n in rank_sizes] for rank_sizes in sizes]

    async def shaped(requests: Any, _context: Any) -> Any:
        first = await requests.__anext__()
        rank, credits = int.from_bytes(first[:4], "little"), int.from_bytes(first[4:8], "little")
        wake = asyncio.Event()
        done = False

        async def read() -> None:
            nonlocal credits, done
            async for request in requests:
                credits += int.from_bytes(request, "little")
                wake.set()
            done = True
            wake.set()

        reader = asyncio.create_task(read())
        try:
            for frame in frames[rank]:
                while credits <= 0 and not done:
                    wake.clear()
                    await wake.wait()
                if credits <= 0:
                    return
                credits -= 1
                yield frame
        finally:
            reader.cancel()

    async def serve() -> None:
        handler = grpc.method_handlers_generic_handler(
            BARE_SERVICE, {"Shaped": grpc.stream_stream_rpc_method_handler(shaped, None, None)}
        )
        server = grpc.aio.server(options=rpc.message_options(_max_frame()))
        server.add_generic_rpc_handlers((handler,))
        ports.put(server.add_insecure_port("127.0.0.1:0"))
        await server.start()
        try:
            while not stop.is_set() and os.getppid() == parent:
                await asyncio.sleep(0.5)
        finally:
            await server.stop(None)

    asyncio.run(serve())


# ---------------------------------------------------------------- client jobs (run in worker processes)


def _frame_of(batch: Any) -> bytes | None:
    """The received frame a numpy batch's arrays are views of (None if they are not)."""
    base = batch.input_ids
    while isinstance(base, np.ndarray):
        base = base.base
    return base if isinstance(base, bytes) else None


def _frame_len(batch: Any) -> int:
    """Bytes of the frame a numpy batch came in; its arrays' bytes if that cannot be seen."""
    frame = _frame_of(batch)
    if frame is not None:
        return len(frame)
    return sum(int(a.nbytes) for a in (batch.input_ids, batch.loss_mask, batch.lengths, batch.sample_ids))


def _ladle_epoch(
    address: str,
    job: str,
    rank: int,
    world_size: int,
    start_at: float,
    client_kwargs: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """One epoch of one rank through BatchClient (numpy): counts, bytes and times.

    ``client_kwargs`` go to ``BatchClient`` too (a token, TLS certificates).
    """
    from ladle.client import BatchClient

    sizes: list[int] = []
    first = end = 0.0
    payload = real = padded = 0
    _sleep_until(start_at)
    began, cpu = time.monotonic(), time.process_time()
    with BatchClient(
        rank, world_size, address, job, prefetch=PREFETCH, timeout=WAIT_S, **(client_kwargs or {})
    ) as client:
        for batch in client:
            now = time.monotonic()
            if sizes:  # the rates count the messages after the first
                payload += sum(
                    int(a.nbytes) for a in (batch.input_ids, batch.loss_mask, batch.lengths, batch.sample_ids)
                )
                real += batch.real_tokens
                padded += batch.padded_tokens
            else:
                first = now
            sizes.append(_frame_len(batch))
            end = now
        reconnects = client.reconnects
    return {
        "cpu_s": time.process_time() - cpu,  # every thread of this process, gRPC's included
        "began": began,
        "first": first,
        "end": end,
        "messages": len(sizes),
        "counted": len(sizes) - 1,
        "counted_bytes": sum(sizes[1:]),
        "payload_bytes": payload,
        "real_tokens": real,
        "padded_tokens": padded,
        "reconnects": reconnects,
        "sizes": sizes,
    }


class _Count:
    """A client's messages and bytes; the first message starts the clock and is not counted."""

    def __init__(self) -> None:
        self.n = self.nbytes = 0
        self.first = self.end = 0.0

    def add(self, message: bytes) -> None:
        now = time.monotonic()
        if self.n:
            self.nbytes += len(message)
        else:
            self.first = now
        self.n += 1
        self.end = now

    def result(self, began: float, cpu_s: float) -> dict[str, Any]:
        return {
            "cpu_s": cpu_s,
            "began": began,
            "first": self.first,
            "end": self.end,
            "messages": self.n,
            "counted": self.n - 1,
            "counted_bytes": self.nbytes,
        }


@contextmanager
def _raw_channel(port: int) -> Iterator[Any]:
    """A ready channel to a bench server on 127.0.0.1 (raw bytes both ways), closed on exit."""
    import grpc

    channel = grpc.insecure_channel(f"127.0.0.1:{port}", options=rpc.message_options(_max_frame()))
    try:
        grpc.channel_ready_future(channel).result(timeout=WAIT_S)
        yield channel
    finally:
        channel.close()


def _bare_grpc(port: int, rank: int, start_at: float) -> dict[str, Any]:
    """Read one rank's stream of raw messages from the bare server."""
    count = _Count()
    with _raw_channel(port) as channel:
        call = channel.unary_stream(f"/{BARE_SERVICE}/Frames")
        _sleep_until(start_at)
        began, cpu = time.monotonic(), time.process_time()
        for message in call(rank.to_bytes(4, "little"), timeout=WAIT_S):
            count.add(message)
        cpu = time.process_time() - cpu
    return count.result(began, cpu)


def _shape_grpc(port: int, rank: int, start_at: float) -> dict[str, Any]:
    """Read one rank's frames from the shape server as BatchClient reads, with no ladle logic.

    A bidirectional call read through grpcio's iterator by a reader thread
    (as BatchClient's reader is), which queues each frame for the caller's
    thread, and credits returned through the call's request iterator in
    groups of three quarters of the window (``PREFETCH``): the threads and
    upstream messages of ``BatchClient``, without decoding a frame.
    """
    import grpc

    frames: queue.SimpleQueue[Any] = queue.SimpleQueue()
    credits: queue.SimpleQueue[bytes | None] = queue.SimpleQueue()
    group = max(1, PREFETCH * 3 // 4)

    def requests() -> Iterator[bytes]:
        while (message := credits.get()) is not None:
            yield message

    def read(call: Any) -> None:
        try:
            for message in call:
                frames.put(message)
        except grpc.RpcError:  # cancelled at the end
            pass
        finally:
            frames.put(None)

    count = _Count()
    owed = 0
    with _raw_channel(port) as channel:
        _sleep_until(start_at)
        began, cpu = time.monotonic(), time.process_time()
        credits.put(rank.to_bytes(4, "little") + PREFETCH.to_bytes(4, "little"))
        call = channel.stream_stream(f"/{BARE_SERVICE}/Shaped")(requests())
        reader = threading.Thread(target=read, args=(call,), daemon=True)
        reader.start()
        while (message := frames.get(timeout=WAIT_S)) is not None:
            count.add(message)
            owed += 1
            if owed >= group:
                credits.put(owed.to_bytes(4, "little"))
                owed = 0
        cpu = time.process_time() - cpu
        credits.put(None)
        call.cancel()
        reader.join(timeout=WAIT_S)
    return count.result(began, cpu)


def _tcp(port: int, count: int, start_at: float) -> dict[str, Any]:
    """Read ``count`` frames' bytes from one of the bare server's TCP listeners."""
    _sleep_until(start_at)
    began, cpu = time.monotonic(), time.process_time()
    nbytes, n = _run_tcp(port, count)
    end = time.monotonic()
    return {
        "cpu_s": time.process_time() - cpu,
        "began": began,
        "first": began,
        "end": end,
        "messages": n,
        "counted": n,
        "counted_bytes": nbytes,
    }


def _train_loop(batches: Iterable[tuple[Any, int]], cap: int | None) -> dict[str, Any]:
    """The training loop of figure 2: takes (input_ids tensor, real tokens) pairs; times and counts."""
    import torch

    n = real = 0
    began = time.monotonic()
    first = end = 0.0
    for ids, tokens in batches:
        now = time.monotonic()
        if not isinstance(ids, torch.Tensor):
            raise TypeError(f"expected a torch tensor, got {type(ids).__name__}")
        if n:
            real += tokens
        else:
            first = now
        n += 1
        end = now
        if cap is not None and n >= cap:
            break
    seconds = end - first
    return {
        "batches": n,
        "real_tokens_counted": real,
        "seconds": _r(seconds),
        "startup_s": _r(first - began),
        "tokens_s": real / seconds if seconds > 0 else 0.0,
        "batches_s": (n - 1) / seconds if seconds > 0 else 0.0,
    }


def _loop_ladle(address: str, job: str, cap: int | None) -> dict[str, Any]:
    import torch

    torch.set_num_threads(1)
    from ladle.client import BatchClient

    with BatchClient(0, 1, address, job, prefetch=PREFETCH, device="cpu", timeout=WAIT_S) as client:
        return _train_loop(((b.input_ids, b.real_tokens) for b in client), cap)


class ScheduleBatches:
    """A map-style dataset: item i is step i (rank 0 of world size 1), assembled as the server does.

    The same arrays BatchClient gives, as torch tensors: int32 input_ids,
    int8 loss_mask and attention_mask, int32 lengths, int64 sample_ids. Each
    worker opens its own Assembler on first use; it pickles (a DataLoader's
    spawned workers). The baseline of figure 2 here and of ``bench_gpu``.
    ``config``: the server's ``ScheduleConfig`` (the default one when None).
    """

    def __init__(self, dataset: str, steps: int | None = None, config: Any = None) -> None:
        from ladle.service.assemble import Assembler
        from ladle.service.dataset import open_dataset
        from ladle.service.schedule import ScheduleConfig, build_schedule

        self.dataset = dataset
        self.config = ScheduleConfig() if config is None else config
        sched = build_schedule(open_dataset(dataset).lengths, self.config, world_size=1)
        count = sched.num_steps if steps is None else min(steps, sched.num_steps)
        self.steps = [(sched.samples(s, 0), sched.padded_len(s, 0)) for s in range(count)]
        self.assembler: Assembler | None = None

    def __getstate__(self) -> dict[str, Any]:
        return dict(self.__dict__, assembler=None)

    def __len__(self) -> int:
        return len(self.steps)

    def __getitem__(self, i: int) -> dict[str, Any]:
        import torch

        from benchmarks.padded import padded
        from ladle.service.assemble import Assembler
        from ladle.service.dataset import open_dataset

        if self.assembler is None:
            self.assembler = Assembler(open_dataset(self.dataset))
        rows, padded_len = self.steps[i]
        b = padded(self.assembler, rows, padded_len, max_len=self.config.max_seq_len)
        mask = (np.arange(padded_len, dtype=np.int32)[None, :] < b.lengths[:, None]).astype(np.int8)
        arrays = {
            "input_ids": b.input_ids,
            "loss_mask": b.loss_mask,
            "attention_mask": mask,
            "lengths": b.lengths,
            "sample_ids": b.sample_ids,
        }
        return {k: torch.from_numpy(v) for k, v in arrays.items()}


def _loop_dataloader(dataset: str, cap: int | None, workers: int) -> dict[str, Any]:
    import torch
    from torch.utils.data import DataLoader, Dataset

    torch.set_num_threads(1)
    data = cast("Dataset[dict[str, Any]]", ScheduleBatches(dataset, cap))
    # fork, the Linux default of a plain process (this one was spawned, so its default is spawn)
    loader: DataLoader[dict[str, Any]] = DataLoader(
        data, batch_size=None, num_workers=workers, multiprocessing_context="fork" if workers else None
    )
    return _train_loop(((b["input_ids"], int(b["lengths"].sum())) for b in loader), cap)


def _latency(address: str, job: str, batches: int, device: Any = None) -> dict[str, Any]:
    """Time inside ``next()`` while the loop sleeps 2 ms a batch (the window stays full).

    ``device``: BatchClient's (``bench_gpu`` times ``"cuda"``); the decoding floor is
    measured on numpy batches only.
    """
    from ladle.client import BatchClient
    from ladle.proto import codec

    waits: list[int] = []
    queued: list[int] = []
    frames: list[bytes] = []
    with BatchClient(0, 1, address, job, prefetch=PREFETCH, timeout=WAIT_S, device=device) as client:
        it = iter(client)
        for i in range(batches + LATENCY_SKIP):
            stream = client._stream  # a benchmark-only look at the received frames not yet taken
            waiting = stream.buffered() if stream is not None else -1
            began = time.perf_counter_ns()
            try:
                batch = next(it)
            except StopIteration:
                break
            took = time.perf_counter_ns() - began
            if i >= LATENCY_SKIP:
                waits.append(took)
                queued.append(waiting)
                frame = _frame_of(batch)
                if frame is not None and len(frames) < 200:
                    frames.append(frame)
            time.sleep(LATENCY_SLEEP_S)
    # the floor: decoding the same frames and making their attention masks, in this process
    floor: list[int] = []
    for _ in range(5):
        for frame in frames:
            began = time.perf_counter_ns()
            decoded = codec.decode_frame(frame)
            if isinstance(decoded, codec.DecodedBatch):
                decoded.attention_mask(np.int8)
            floor.append(time.perf_counter_ns() - began)
    ns = np.asarray(waits, dtype=np.int64)
    return {
        "batches": len(waits),
        "median_us": _r(np.median(ns) / 1e3, 1),
        "p90_us": _r(np.percentile(ns, 90) / 1e3, 1),
        "p99_us": _r(np.percentile(ns, 99) / 1e3, 1),
        "max_us": _r(ns.max() / 1e3, 1),
        "mean_us": _r(ns.mean() / 1e3, 1),
        "frames_waiting_median": float(np.median(queued)),
        "share_with_no_frame_waiting": _r(float(np.mean(np.asarray(queued) == 0))),
        "decode_and_mask_median_us": _r(float(np.median(floor)) / 1e3, 1) if floor else None,
    }


_SYNCED = frozenset({"ladle_epoch", "bare_grpc", "shape_grpc", "tcp"})  # jobs that take start_at


_JOBS: dict[str, Callable[..., dict[str, Any]]] = {
    "ladle_epoch": _ladle_epoch,
    "bare_grpc": _bare_grpc,
    "shape_grpc": _shape_grpc,
    "tcp": _tcp,
    "loop_ladle": _loop_ladle,
    "loop_dataloader": _loop_dataloader,
    "latency": _latency,
}


def _worker(jobs: Any, results: Any) -> None:
    """A client process: runs ``(job name, kwargs)`` until it gets None or waits WAIT_S for nothing."""
    while True:
        try:
            job = jobs.get(timeout=WAIT_S)
        except queue.Empty:
            return
        if job is None:
            return
        name, kwargs = job
        try:
            results.put(("ok", _JOBS[name](**kwargs)))
        except Exception as exc:
            results.put(("error", f"{name}: {type(exc).__name__}: {exc}"))


# ---------------------------------------------------------------- driver


class _Clients:
    """``n`` worker processes (spawn: grpc and fork do not mix); ``run`` starts jobs on them together."""

    def __init__(self, n: int, daemon: bool = True) -> None:
        self.ctx = mp.get_context("spawn")
        self.results = self.ctx.Queue()
        self.jobs = [self.ctx.Queue() for _ in range(n)]
        self.processes: list[BaseProcess] = [
            self.ctx.Process(
                target=_worker, args=(q, self.results), name=f"bench-serving-client-{i}", daemon=daemon
            )
            for i, q in enumerate(self.jobs)
        ]
        for process in self.processes:
            process.start()

    def run(self, name: str, kwargs: list[dict[str, Any]], delay: float = 0.5) -> list[dict[str, Any]]:
        """Run ``name`` on the first len(kwargs) workers, starting together after ``delay`` seconds."""
        start_at = time.monotonic() + delay
        for q, kw in zip(self.jobs, kwargs, strict=False):
            q.put((name, {**kw, "start_at": start_at} if name in _SYNCED else kw))
        got: list[tuple[str, Any]] = []
        deadline = time.monotonic() + WAIT_S * 3
        while len(got) < len(kwargs):
            try:
                got.append(self.results.get(timeout=1.0))
            except queue.Empty:
                dead = [p.name for p in self.processes if not p.is_alive()]
                if dead or time.monotonic() > deadline:
                    raise RuntimeError(
                        f"{name}: no result (exited: {dead or 'none'}; waited to the deadline)"
                    ) from None
        errors = [g[1] for g in got if g[0] != "ok"]
        if errors:
            raise RuntimeError("; ".join(errors))
        return [g[1] for g in got]

    def close(self) -> None:
        for q in self.jobs:
            with suppress(Exception):
                q.put(None)
        _stop_all(self.processes)


def _rates(got: list[dict[str, Any]], server_cpu_s: float) -> dict[str, Any]:
    seconds = max(g["end"] for g in got) - min(g["first"] for g in got)
    counted = sum(g["counted"] for g in got)
    out = {
        "messages": sum(g["messages"] for g in got),
        "seconds": _r(seconds),
        "batches_s": counted / seconds,
        "gb_s": sum(g["counted_bytes"] for g in got) / seconds / 1e9,
        "server_cpu_us_per_batch": server_cpu_s / sum(g["messages"] for g in got) * 1e6,
        "client_cpu_us_per_batch": sum(g["cpu_s"] for g in got) / sum(g["messages"] for g in got) * 1e6,
    }
    if "payload_bytes" in got[0]:
        out["payload_gb_s"] = sum(g["payload_bytes"] for g in got) / seconds / 1e9
        out["real_tokens_s"] = sum(g["real_tokens"] for g in got) / seconds
        out["padded_tokens_s"] = sum(g["padded_tokens"] for g in got) / seconds
        out["wall_with_connect_s"] = _r(max(g["end"] for g in got) - min(g["began"] for g in got))
        out["reconnects"] = sum(g["reconnects"] for g in got)
    return out


def _timed(clients: _Clients, pid: int, name: str, kwargs: list[dict[str, Any]]) -> dict[str, Any]:
    """Run a job on the clients and the rates, with the server's CPU time over the run."""
    cpu = _cpu_seconds(pid)
    got = clients.run(name, kwargs)
    rates = _rates(got, _cpu_seconds(pid) - cpu)
    rates["_sizes"] = [g.get("sizes") for g in got]
    return rates


def _two_cpus() -> tuple[int, int] | None:
    """Two CPUs this process may use (the servers' and the trainers'), or None where there are fewer."""
    try:
        cpus = sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        return None
    return (cpus[0], cpus[1]) if len(cpus) >= 2 else None


def _set_affinity(pid: int, cpus: set[int]) -> None:
    """Every thread of process ``pid`` (threads started later inherit it from the one that starts them)."""
    for task in Path(f"/proc/{pid}/task").iterdir():
        with suppress(OSError):  # a thread that just ended
            os.sched_setaffinity(int(task.name), cpus)


@contextmanager
def _pinned(servers: Iterable[int], clients: Iterable[int], cpus: tuple[int, int]) -> Iterator[None]:
    """The server processes on one CPU and the client processes on the other, for the block's runs."""
    servers, clients = list(servers), list(clients)
    every = os.sched_getaffinity(0)
    try:
        for pid in servers:
            _set_affinity(pid, {cpus[0]})
        for pid in clients:
            _set_affinity(pid, {cpus[1]})
        yield
    finally:
        for pid in (*servers, *clients):
            with suppress(OSError):
                _set_affinity(pid, every)


def _median(runs: list[dict[str, Any]], key: str, digits: int = 3) -> float:
    return _r(statistics.median(r[key] for r in runs), digits)


def bench_throughput(dataset: Path, workdir: Path, repeats: int) -> dict[str, Any]:
    """Figure 1: 2 ranks of world size 2, one epoch each, beside bare gRPC and raw TCP."""
    clients = _Clients(2)
    ctx = clients.ctx
    stop = ctx.Event()
    ports = ctx.Queue()
    bare: BaseProcess | None = None
    shape: BaseProcess | None = None
    server: _Ladle | None = None
    runs: dict[str, list[dict[str, Any]]] = {
        "ladle": [],
        "bare_grpc": [],
        "shape_grpc": [],
        "tcp_2_readers": [],
        "tcp_1_reader": [],
        "ladle_own_core": [],
        "bare_grpc_own_core": [],
    }
    cpus = _two_cpus()
    try:
        server = _Ladle(dataset, workdir, "throughput")
        for r in range(repeats):
            # Repeats outermost: a burst of load from elsewhere hits every case once.
            ladle = _timed(
                clients,
                server.pid,
                "ladle_epoch",
                [
                    {"address": server.address, "job": f"throughput-{r}", "rank": i, "world_size": 2}
                    for i in range(2)
                ],
            )
            sizes: list[list[int]] = ladle.pop("_sizes")
            runs["ladle"].append(ladle)
            if bare is None:
                frame_bytes = [n for rank_sizes in sizes for n in rank_sizes]
                bare = ctx.Process(
                    target=_bare_server, args=(sizes, ports, stop, os.getpid()), name="bench-serving-bare"
                )
                bare.start()
                grpc_port, tcp0, tcp1, tcp_both = ports.get(timeout=WAIT_S)
                counts = [len(s) for s in sizes]
                shape = ctx.Process(
                    target=_shape_server, args=(sizes, ports, stop, os.getpid()), name="bench-serving-shape"
                )
                shape.start()
                shape_port = ports.get(timeout=WAIT_S)
            assert bare.pid is not None
            assert shape is not None
            assert shape.pid is not None
            runs["bare_grpc"].append(
                _timed(
                    clients,
                    bare.pid,
                    "bare_grpc",
                    [{"port": grpc_port, "rank": i} for i in range(2)],
                )
            )
            runs["shape_grpc"].append(
                _timed(clients, shape.pid, "shape_grpc", [{"port": shape_port, "rank": i} for i in range(2)])
            )
            runs["tcp_2_readers"].append(
                _timed(
                    clients,
                    bare.pid,
                    "tcp",
                    [{"port": p, "count": c} for p, c in zip((tcp0, tcp1), counts, strict=True)],
                )
            )
            runs["tcp_1_reader"].append(
                _timed(clients, bare.pid, "tcp", [{"port": tcp_both, "count": sum(counts)}])
            )
            # each server on a core of its own, as in a deployment, the trainers on the other
            if cpus is not None:
                client_pids = [p.pid for p in clients.processes if p.pid is not None]
                with _pinned([server.pid], client_pids, cpus):
                    runs["ladle_own_core"].append(
                        _timed(
                            clients,
                            server.pid,
                            "ladle_epoch",
                            [
                                {
                                    "address": server.address,
                                    "job": f"throughput-own-{r}",
                                    "rank": i,
                                    "world_size": 2,
                                }
                                for i in range(2)
                            ],
                        )
                    )
                with _pinned([bare.pid], client_pids, cpus):
                    runs["bare_grpc_own_core"].append(
                        _timed(
                            clients, bare.pid, "bare_grpc", [{"port": grpc_port, "rank": i} for i in range(2)]
                        )
                    )
        problems = server.log_problems()
    finally:
        stop.set()
        if server is not None:
            server.stop()
        clients.close()
        _stop_all([p for p in (bare, shape) if p is not None])
    for case_runs in runs.values():
        for run in case_runs:
            run.pop("_sizes", None)

    def paired_ratio(case: str, base: str) -> list[float]:
        return [a["gb_s"] / b["gb_s"] for a, b in zip(runs[case], runs[base], strict=True)]

    paired = paired_ratio("ladle", "bare_grpc")
    shape_paired = paired_ratio("shape_grpc", "bare_grpc")
    in_shape = paired_ratio("ladle", "shape_grpc")
    own_core = paired_ratio("ladle_own_core", "bare_grpc_own_core") if cpus is not None else []
    first = runs["ladle"][0]
    out: dict[str, Any] = {
        "rows": None,
        "clients": 2,
        "prefetch": PREFETCH,
        "repeats": repeats,
        "batches_per_epoch": first["messages"],
        "mean_frame_kib": _r(statistics.mean(frame_bytes) / 1024, 1),
        "cases": {
            case: {
                "batches_s": _median(case_runs, "batches_s", 0),
                "gb_s": _median(case_runs, "gb_s"),
                "server_cpu_us_per_batch": _median(case_runs, "server_cpu_us_per_batch", 0),
                "client_cpu_us_per_batch": _median(case_runs, "client_cpu_us_per_batch", 0),
                "runs_gb_s": [_r(run["gb_s"]) for run in case_runs],
                "runs_seconds": [run["seconds"] for run in case_runs],
            }
            for case, case_runs in runs.items()
            if case_runs
        },
        "ladle_real_tokens_s": _median(runs["ladle"], "real_tokens_s", 0),
        "ladle_padded_tokens_s": _median(runs["ladle"], "padded_tokens_s", 0),
        "ladle_payload_gb_s": _median(runs["ladle"], "payload_gb_s"),
        "ladle_wall_with_connect_s": [run["wall_with_connect_s"] for run in runs["ladle"]],
        "ladle_reconnects": sum(run["reconnects"] for run in runs["ladle"]),
        "ratio_ladle_vs_bare_grpc_paired": _r(statistics.median(paired), 2),
        "ratio_runs": [_r(p, 2) for p in paired],
        "ratio_shape_vs_bare_grpc_paired": _r(statistics.median(shape_paired), 2),
        "ratio_ladle_vs_shape_paired": _r(statistics.median(in_shape), 2),
        "shape_ratio_runs": [_r(p, 2) for p in shape_paired],
        "ratio_own_core_paired": _r(statistics.median(own_core), 2) if own_core else None,
        "own_core_ratio_runs": [_r(p, 2) for p in own_core],
        "own_core_cpus": list(cpus) if cpus is not None else None,
        "server_log_problems": problems[-10:],
        "target": "ladle / bare gRPC >= 0.70 (GB/s of the same messages); TCP: the physical limit",
        "own_core_note": (
            "ladle_own_core and bare_grpc_own_core: the same streams with the server process on one CPU and "
            "the 2 client processes on the other (sched_setaffinity), as when the server has cores of its "
            "own; the issue's figure is ladle / bare gRPC with everything sharing both cores"
        ),
        "shape_note": (
            "shape_grpc: the same frames in ladle's call shape with no ladle logic (grpc.aio server, "
            "bidirectional stream with credits grouped at 3/4 of the window, read through grpcio's "
            "iterator by a reader thread as BatchClient's is): "
            "what the call shape alone costs against bare gRPC"
        ),
    }
    return out


def bench_training_loop(dataset: Path, workdir: Path, cap: int | None, repeats: int) -> dict[str, Any]:
    """Figure 2: tokens/s delivered to a loop as torch tensors, ladle vs a local DataLoader."""
    server: _Ladle | None = None
    runs: dict[str, list[dict[str, Any]]] = {"ladle": [], "dataloader": [], "dataloader_0_workers": []}
    try:
        server = _Ladle(dataset, workdir, "loop")
        for r in range(repeats):
            for case, name, kwargs in (
                ("ladle", "loop_ladle", {"address": server.address, "job": f"loop-{r}", "cap": cap}),
                ("dataloader", "loop_dataloader", {"dataset": str(dataset), "cap": cap, "workers": 2}),
                # a reference: the same assembly in the loop's own process, no IPC
                (
                    "dataloader_0_workers",
                    "loop_dataloader",
                    {"dataset": str(dataset), "cap": cap, "workers": 0},
                ),
            ):
                # a fresh process per run (a DataLoader forks its workers: no grpc in that parent
                # beyond the import, and not daemonic, which may not have children)
                clients = _Clients(1, daemon=False)
                try:
                    runs[case].extend(clients.run(name, [kwargs]))
                finally:
                    clients.close()
        problems = server.log_problems()
    finally:
        if server is not None:
            server.stop()
    paired = [
        lad["tokens_s"] / dl["tokens_s"] for lad, dl in zip(runs["ladle"], runs["dataloader"], strict=True)
    ]
    return {
        "world_size": 1,
        "cap": cap,
        "repeats": repeats,
        "cases": {
            case: {
                "batches": case_runs[0]["batches"],
                "real_tokens_counted": case_runs[0]["real_tokens_counted"],
                "tokens_s": _median(case_runs, "tokens_s", 0),
                "batches_s": _median(case_runs, "batches_s", 0),
                "startup_s": [run["startup_s"] for run in case_runs],
                "runs_tokens_s": [round(run["tokens_s"]) for run in case_runs],
            }
            for case, case_runs in runs.items()
        },
        "ratio_ladle_vs_dataloader_paired": _r(statistics.median(paired), 2),
        "ratio_runs": [_r(p, 2) for p in paired],
        "server_log_problems": problems[-10:],
        "target": "ladle / DataLoader(num_workers=2) >= 0.8 (num_workers=0: a reference, not a target)",
    }


def bench_latency(dataset: Path, workdir: Path, batches: int) -> dict[str, Any]:
    """Figure 3: time inside next() with a warm prefetch window."""
    server: _Ladle | None = None
    clients: _Clients | None = None
    try:
        server = _Ladle(dataset, workdir, "latency")
        clients = _Clients(1)
        (got,) = clients.run("latency", [{"address": server.address, "job": "latency", "batches": batches}])
        got["server_log_problems"] = server.log_problems()[-10:]
    finally:
        if clients is not None:
            clients.close()
        if server is not None:
            server.stop()
    got.update({"prefetch": PREFETCH, "loop_sleep_ms": LATENCY_SLEEP_S * 1e3, "target": "median < 100 us"})
    return got


def bench_memory(dataset: Path, workdir: Path, note: str) -> dict[str, Any]:
    """Figure 4: the server's RSS (anonymous and file-backed) while it serves every batch once."""
    size = _folder_bytes(dataset)
    server: _Ladle | None = None
    clients: _Clients | None = None
    done = threading.Event()
    peak: dict[str, int] = {}
    samples = 0

    def sample(pid: int) -> None:
        nonlocal samples
        while not done.wait(RSS_INTERVAL_S):
            with suppress(OSError):
                for key, value in _memory(pid).items():
                    peak[key] = max(peak.get(key, 0), value)
                samples += 1

    sampler: threading.Thread | None = None
    try:
        clients = _Clients(2)
        server = _Ladle(dataset, workdir, "memory")
        before = _memory(server.pid)
        peak.update(before)
        sampler = threading.Thread(target=sample, args=(server.pid,), daemon=True)
        sampler.start()
        rates = _timed(
            clients,
            server.pid,
            "ladle_epoch",
            [{"address": server.address, "job": "memory", "rank": i, "world_size": 2} for i in range(2)],
        )
        after = _memory(server.pid)
        problems = server.log_problems()
    finally:
        done.set()
        if sampler is not None:
            sampler.join(timeout=5)
        if clients is not None:
            clients.close()
        if server is not None:
            server.stop()
    for key, value in after.items():
        peak[key] = max(peak.get(key, 0), value)

    def mib(d: dict[str, int]) -> dict[str, float]:
        return {k: _r(v / MIB, 1) for k, v in d.items()}

    return {
        "dataset": note,
        "dataset_gb": _r(size / 1e9, 2),
        "batches_served": rates["messages"],
        "serve_seconds": rates["seconds"],
        "gb_s": _r(rates["gb_s"]),
        "before_mib": mib(before),
        "end_mib": mib(after),
        "peak_mib": mib(peak),
        "samples": samples,
        "rss_anon_growth_mib": _r((after["RssAnon"] - before["RssAnon"]) / MIB, 1),
        "rss_anon_growth_pct_of_dataset": _r(100 * (after["RssAnon"] - before["RssAnon"]) / size, 2),
        "rss_anon_peak_growth_pct_of_dataset": _r(100 * (peak["RssAnon"] - before["RssAnon"]) / size, 2),
        "rss_file_end_pct_of_dataset": _r(100 * after["RssFile"] / size, 1),
        "rss_file_peak_pct_of_dataset": _r(100 * peak["RssFile"] / size, 1),
        "server_log_problems": problems[-10:],
        "note": "RssFile counts the file pages mapped into the server: the memory-mapped dataset's pages "
        "it has touched (page cache, shared and reclaimable under pressure, not memory ladle allocated) "
        "plus its libraries (~70 MiB); RssAnon is the heap",
        "target": "RssAnon growth < 10% of the dataset",
    }


def _make(path: Path, rows: int) -> dict[str, Any]:
    began = time.perf_counter()
    make_dataset(path, rows, seed=0)
    seconds = time.perf_counter() - began
    return {"rows": rows, "gb_on_disk": _r(_folder_bytes(path) / 1e9, 2), "make_dataset_s": _r(seconds, 1)}


def main(full: bool) -> dict[str, Any]:
    s = SETTINGS[full]
    load_before = os.getloadavg()[0]
    tmp = Path(tempfile.mkdtemp(prefix="ladle-bench-serving-"))
    results: dict[str, Any] = {"mode": "full" if full else "quick", "cpus": os.cpu_count(), "datasets": []}
    try:
        ds = tmp / "ds"
        results["datasets"].append(_make(ds, s["rows"]))
        tp = bench_throughput(ds, tmp, s["repeats"])
        tp["rows"] = s["rows"]
        results["throughput"] = tp
        results["training_loop"] = bench_training_loop(ds, tmp, s["loop_cap"], s["loop_repeats"])
        results["next_latency"] = bench_latency(ds, tmp, s["latency_batches"])
        if s["memory_rows"]:
            shutil.rmtree(ds)  # the disk is limited: one dataset at a time
            big = tmp / "ds-big"
            results["datasets"].append(_make(big, s["memory_rows"]))
            results["server_memory"] = bench_memory(big, tmp, f"{s['memory_rows']:,} production rows")
        else:
            results["server_memory"] = bench_memory(
                ds, tmp, f"the throughput dataset ({s['rows']:,} rows; --full serves 400,000 rows, 4.1 GB)"
            )
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    results["load_average_before_after"] = [_r(load_before, 2), _r(os.getloadavg()[0], 2)]
    return results


def summary(results: dict[str, Any]) -> list[str]:
    """One line per figure, for stderr."""
    tp = results["throughput"]
    c = tp["cases"]
    lines = [
        f"serving {tp['rows']:,} rows, {tp['batches_per_epoch']:,} batches over 2 ranks: ladle "
        f"{c['ladle']['batches_s']:,.0f} batches/s {c['ladle']['gb_s']} GB/s "
        f"({tp['ladle_real_tokens_s'] / 1e6:.1f}M real tokens/s); bare gRPC {c['bare_grpc']['gb_s']} GB/s "
        f"-> {tp['ratio_ladle_vs_bare_grpc_paired']}x (target >= 0.70); raw TCP "
        f"{c['tcp_2_readers']['gb_s']} GB/s (2 readers), {c['tcp_1_reader']['gb_s']} GB/s (1)",
        "serving CPU per batch (server + clients): "
        + "; ".join(
            f"{case} {c[case]['server_cpu_us_per_batch']:,.0f} + {c[case]['client_cpu_us_per_batch']:,.0f} us"
            for case in ("ladle", "shape_grpc", "bare_grpc", "tcp_2_readers")
        )
        + f" ({results['cpus']} cores)",
        "ladle's call shape with no ladle logic (asyncio server, bidirectional with credits, reader "
        f"thread): {c['shape_grpc']['gb_s']} GB/s -> "
        f"{tp['ratio_shape_vs_bare_grpc_paired']}x bare gRPC; "
        f"ladle is {tp['ratio_ladle_vs_shape_paired']}x of it",
    ]
    if tp["ratio_own_core_paired"] is not None:
        lines.append(
            f"the servers on CPU {tp['own_core_cpus'][0]}, the trainers on CPU {tp['own_core_cpus'][1]} (a "
            f"server with a core of its own; not the target's setup): ladle "
            f"{c['ladle_own_core']['batches_s']:,.0f} batches/s {c['ladle_own_core']['gb_s']} GB/s; "
            f"bare gRPC {c['bare_grpc_own_core']['gb_s']} GB/s -> {tp['ratio_own_core_paired']}x "
            f"(runs {', '.join(str(x) for x in tp['own_core_ratio_runs'])})"
        )
    loop = results["training_loop"]
    lc = loop["cases"]
    lines.append(
        f"training loop W=1, {lc['ladle']['batches']:,} batches as torch tensors: ladle "
        f"{lc['ladle']['tokens_s'] / 1e6:.1f}M tokens/s; DataLoader(num_workers=2) "
        f"{lc['dataloader']['tokens_s'] / 1e6:.1f}M tokens/s -> {loop['ratio_ladle_vs_dataloader_paired']}x "
        f"(target >= 0.8); num_workers=0 {lc['dataloader_0_workers']['tokens_s'] / 1e6:.1f}M tokens/s"
    )
    lat = results["next_latency"]
    lines.append(
        f"next() with a full window (prefetch {lat['prefetch']}, 2 ms/batch), {lat['batches']:,} batches: "
        f"median {lat['median_us']} us, p99 {lat['p99_us']} us (target median < 100); decode+mask of the "
        f"same frames {lat['decode_and_mask_median_us']} us"
    )
    mem = results["server_memory"]
    lines.append(
        f"server memory serving {mem['dataset_gb']} GB ({mem['batches_served']:,} batches): RssAnon "
        f"+{mem['rss_anon_growth_mib']} MiB = {mem['rss_anon_growth_pct_of_dataset']}% of the dataset "
        f"(peak {mem['rss_anon_peak_growth_pct_of_dataset']}%; target < 10%); RssFile (mapped dataset "
        f"pages, reclaimable page cache, + libraries) {mem['before_mib']['RssFile']:,.0f} MiB before the "
        "first batch, "
        f"{mem['end_mib']['RssFile']:,.0f} MiB = {mem['rss_file_end_pct_of_dataset']}% at the end"
    )
    made = ", ".join(
        f"{d['rows']:,} rows {d['gb_on_disk']} GB in {d['make_dataset_s']}s" for d in results["datasets"]
    )
    lines.append(f"make_dataset: {made}")
    return lines


if __name__ == "__main__":
    out = main("--full" in sys.argv)
    print(json.dumps(out, indent=2))
    for line in summary(out):
        print(line, file=sys.stderr)
