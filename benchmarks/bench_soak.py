"""A soak of ``ladle serve``: a crowd of idle connections and fast connection churn beside a trainer.

One ``ladle serve`` process (its default limits) serves one trainer process
that reads batches as fast as it can (``BatchClient``, numpy, prefetch 4).
Its throughput is measured in three windows of the same length: before the
crowd (the baseline), during it, and after it has gone. The crowd, in a
third process: ``idle`` gRPC connections that connect (``channel_ready``)
and then hold, ``silent`` TCP connections that connect and never send a
byte (the server closes them at its handshake timeout), and ``churn_per_s``
connections a second that open and close, half of them gRPC channels doing
one call (a health check or a Describe of the trainer's job) and half bare
TCP connects. Before, during and after, the server's threads, file
descriptors, sockets and RSS are read from /proc; after the crowd has gone
they are waited for (up to ``settle_s``) to come back to where they were.
The cursor store's descriptors are counted apart: its SQLite connections
are pooled, and the database file keeps one descriptor per connection that
was ever open at once (SQLite reuses them), so they follow the largest
number of threads that read the store together, not the connections served.

The ratio is trainer batches/s during the crowd over the mean of the windows
before and after it (so a machine that gets slower or faster over the run
does not pass for an effect of the crowd). On a shared 2-core machine the
crowd's own process competes for the same cores, so the ratio also counts
the client side's CPU, not only the server's.

Run: ``python -m benchmarks.bench_soak`` (quick: 100 idle, 25 silent,
50 connections/s for 15 s) or ``--full`` (200 idle, 50 silent, 50/s for 60 s).
Every process started here is stopped in a ``finally``, on 127.0.0.1 only.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import select
import shutil
import socket
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from ladle.service.launch import ServeProcess
from ladle.service.synth import make_dataset

__all__ = ["SoakSettings", "main", "run_soak", "summary"]

JOB = "soak"
CONFIG = [
    "--max-seq-len", "512",
    "--bucket-bounds", "0,48,76,108,152,206,513",
    "--token-budget", "3072",
    "--max-batch-size", "16",
]  # fmt: skip
OWN_CONNECTION = [("grpc.use_local_subchannel_pool", 1)]  # one TCP connection per channel
SAMPLE_S = 0.25
MIB = 1 << 20


@dataclass(frozen=True)
class SoakSettings:
    """How big and how long; ``server_args`` go to ``ladle serve`` after the schedule config."""

    idle: int = 100
    silent: int = 25
    churn_per_s: float = 50.0
    churn_s: float = 15.0
    window_s: float = 6.0  # each throughput window (before, after); ``churn_s`` is the one during
    warmup_s: float = 2.0
    settle_s: float = 30.0
    rows: int = 20_000
    server_args: tuple[str, ...] = ()


QUICK = SoakSettings()
FULL = SoakSettings(idle=200, silent=50, churn_s=60.0, window_s=20.0)


# ---------------------------------------------------------------- the server, seen from /proc


def process_stats(pid: int, store: str | os.PathLike[str] = "") -> dict[str, int]:
    """Threads, open descriptors, sockets among them, and RSS (bytes) of process ``pid``.

    ``fds`` leaves out the descriptors of the cursor store file ``store``
    (with its -wal and -shm), counted in ``store_fds``.
    """
    status = Path(f"/proc/{pid}/status").read_text().splitlines()
    fields = {key: value.split() for key, _, value in (line.partition(":") for line in status)}
    store_files = {os.path.realpath(store) + suffix for suffix in ("", "-wal", "-shm")} if store else set()
    fds = store_fds = sockets = 0
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue  # closed while we looked
        if target in store_files:
            store_fds += 1
            continue
        fds += 1
        sockets += target.startswith("socket:")
    return {
        "threads": int(fields["Threads"][0]),
        "fds": fds,
        "store_fds": store_fds,
        "sockets": sockets,
        "rss": int(fields["VmRSS"][0]) * 1024,
    }


class _Sampler:
    """Samples ``process_stats`` every SAMPLE_S on a thread; ``peak`` of a phase, ``last`` now."""

    def __init__(self, pid: int, store: Path) -> None:
        self.pid = pid
        self.store = store
        self.phase = "before"
        self.peaks: dict[str, dict[str, int]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="soak-sampler", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(SAMPLE_S):
            try:
                self.sample()
            except OSError:  # the server is gone; the soak reports that itself
                return

    def sample(self) -> dict[str, int]:
        stats = process_stats(self.pid, self.store)
        peak = self.peaks.setdefault(self.phase, dict(stats))
        for key, value in stats.items():
            peak[key] = max(peak[key], value)
        return stats

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


# ---------------------------------------------------------------- the trainer process


def _trainer(address: str, count: Any, gaps: Any, phase: Any, stop: Any) -> None:
    """Read batches as fast as possible, epoch after epoch, until ``stop``; count them."""
    from ladle.client import BatchClient

    with BatchClient(0, 1, address, JOB, prefetch=4, timeout=60) as client:
        last = None
        while not stop.is_set():
            for _ in client:
                now = time.monotonic()
                if last is not None:
                    gaps[phase.value] = max(gaps[phase.value], now - last)
                last = now
                count.value += 1
                if stop.is_set():
                    break
        gaps[len(gaps) - 1] = client.reconnects  # the last slot: reconnects


# ---------------------------------------------------------------- the crowd process


def _crowd(address: str, settings: SoakSettings, ready: Any, go: Any, stop: Any, results: Any) -> None:
    """Hold the idle and silent connections, churn while ``go`` and not ``stop``, then close them all."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from ladle.proto import rpc

    host, port = address.rsplit(":", 1)
    target = (host, int(port))
    held = []
    for _ in range(settings.idle):
        channel = grpc.insecure_channel(address, options=OWN_CONNECTION)
        grpc.channel_ready_future(channel).result(timeout=30)
        held.append(channel)
    opened = time.monotonic()
    silent = [socket.create_connection(target, timeout=10) for _ in range(settings.silent)]
    closed_after: list[float] = []

    def watch_silent() -> None:  # the server should close these: EOF after its SETTINGS frame
        left = list(silent)
        while left and not stop.is_set():
            readable, _, _ = select.select(left, [], [], 0.2)
            for sock in readable:
                try:
                    data = sock.recv(4096)
                except OSError:
                    data = b""
                if not data:
                    closed_after.append(time.monotonic() - opened)
                    left.remove(sock)

    watcher = threading.Thread(target=watch_silent, daemon=True)
    watcher.start()
    ready.set()
    go.wait()
    ops = [0, 0]  # grpc calls, tcp connects
    errors: list[str] = []
    workers = 2
    interval = workers / settings.churn_per_s

    def churn(worker: int) -> None:
        n = worker
        due = time.monotonic() + worker * interval / workers
        while not stop.is_set():
            due = max(due + interval, time.monotonic() - interval)  # never bursts to catch up
            time.sleep(max(0.0, due - time.monotonic()))
            n += 1
            try:
                if n % 2:
                    with socket.create_connection(target, timeout=10):
                        pass
                    ops[1] += 1
                    continue
                with grpc.insecure_channel(address, options=OWN_CONNECTION) as channel:
                    if n % 4:
                        health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
                    else:
                        rpc.BatchServiceClient(channel).describe(JOB, timeout=10)
                ops[0] += 1
            except Exception as exc:  # counted and reported, never fatal to the soak
                errors.append(f"{type(exc).__name__}: {exc}"[:200])

    began = time.monotonic()
    threads = [threading.Thread(target=churn, args=(w,), daemon=True) for w in range(workers)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    churned_s = time.monotonic() - began
    for channel in held:
        channel.close()
    watcher.join(timeout=5)
    for sock in silent:
        sock.close()
    results.put(
        {
            "idle_held": len(held),
            "silent_opened": len(silent),
            "silent_closed_by_server": len(closed_after),
            "silent_closed_after_s": round(max(closed_after), 2) if closed_after else None,
            "churn_grpc_calls": ops[0],
            "churn_tcp_connects": ops[1],
            "churn_per_s": round(sum(ops) / churned_s, 1),
            "churn_errors": len(errors),
            "churn_error_examples": errors[:3],
        }
    )


# ---------------------------------------------------------------- the soak


def run_soak(dataset: Path, workdir: Path, settings: SoakSettings) -> dict[str, Any]:
    """Run the soak once against a fresh ``ladle serve`` of ``dataset``; returns its figures."""
    ctx = mp.get_context("spawn")  # grpc and fork do not mix
    count = ctx.Value("q", 0, lock=False)
    phase = ctx.Value("i", 0, lock=False)
    gaps = ctx.Array("d", 4, lock=False)  # the longest wait for a batch: before, during, after; reconnects
    stop_trainer, crowd_ready, go, stop_crowd = ctx.Event(), ctx.Event(), ctx.Event(), ctx.Event()
    results = ctx.Queue()
    processes = []
    server = ServeProcess(
        dataset, workdir, extra=[*CONFIG, "--no-http", *settings.server_args], log_level="WARNING", grace=10
    )
    sampler = None
    try:
        trainer = ctx.Process(target=_trainer, args=(server.address, count, gaps, phase, stop_trainer))
        trainer.start()
        processes.append(trainer)
        _wait(lambda: count.value > 0, 60, "the trainer received no batch")
        time.sleep(settings.warmup_s)
        sampler = _Sampler(server.proc.pid, server.state)
        before_stats = sampler.sample()
        before_bps, before_cpu = _rate(count, settings.window_s, server.proc.pid)

        crowd = ctx.Process(
            target=_crowd, args=(server.address, settings, crowd_ready, go, stop_crowd, results)
        )
        sampler.phase = "during"
        phase.value = 1
        crowd.start()
        processes.append(crowd)
        _wait(crowd_ready.is_set, 120, "the idle connections did not connect")
        held = sampler.sample()
        crowd_cpu = _cpu_s(crowd.pid or 0)
        go.set()
        during_bps, during_cpu = _rate(count, settings.churn_s, server.proc.pid)
        crowd_cpu = (_cpu_s(crowd.pid or 0) - crowd_cpu) / settings.churn_s
        held_at_end = sampler.sample()
        stop_crowd.set()
        crowd_figures = results.get(timeout=60)
        crowd.join(timeout=30)

        sampler.phase = "after"
        phase.value = 2
        began = time.monotonic()
        settled = _settle(sampler, before_stats, settings.settle_s)
        settle_s = time.monotonic() - began
        after_stats = sampler.sample()
        after_bps, after_cpu = _rate(count, settings.window_s, server.proc.pid)
        end_stats = sampler.sample()
        stop_trainer.set()
        trainer.join(timeout=30)
    finally:
        try:
            if sampler is not None:
                sampler.stop()
            for event in (stop_trainer, stop_crowd, go):
                event.set()
            for process in processes:
                process.join(timeout=10)
                if process.is_alive():
                    process.kill()
                    process.join(timeout=10)
        finally:
            server.stop()
    peak = sampler.peaks.get("during", held)
    baseline = (before_bps + after_bps) / 2
    return {
        "settings": asdict(settings),
        "connections": {
            **crowd_figures,
            "server_sockets_before": before_stats["sockets"],
            "server_sockets_with_crowd": held["sockets"],
            "server_sockets_at_churn_end": held_at_end["sockets"],
            "server_sockets_peak": peak["sockets"],
        },
        "trainer": {
            "before_batches_per_s": round(before_bps, 1),
            "during_batches_per_s": round(during_bps, 1),
            "after_batches_per_s": round(after_bps, 1),
            "ratio_during_vs_without": round(during_bps / baseline, 3) if baseline else 0.0,
            "longest_wait_s": {
                name: round(gaps[i], 3) for i, name in enumerate(("before", "during", "after"))
            },
            "reconnects": int(gaps[3]),
        },
        "cpu": {
            "server_cores": {"before": before_cpu, "during": during_cpu, "after": after_cpu},
            "server_us_per_batch": {
                "before": _per_batch(before_cpu, before_bps),
                "during": _per_batch(during_cpu, during_bps),
                "after": _per_batch(after_cpu, after_bps),
            },
            "crowd_cores_during": round(crowd_cpu, 2),
        },
        "server": {
            key: {
                "before": _unit(key, before_stats[key]),
                "peak_during": _unit(key, peak[key]),
                "after": _unit(key, after_stats[key]),
                "end": _unit(key, end_stats[key]),
            }
            for key in ("threads", "fds", "store_fds", "sockets", "rss")
        },
        "settled": settled,
        "settle_s": round(settle_s, 1),
    }


def settled_within(before: dict[str, int], now: dict[str, int]) -> bool:
    """Back to the baseline: threads and descriptors within 2, RSS within 10% + 16 MiB."""
    return (
        now["threads"] <= before["threads"] + 2
        and now["fds"] <= before["fds"] + 2
        and now["rss"] <= before["rss"] * 1.10 + 16 * MIB
    )


def _settle(sampler: _Sampler, before: dict[str, int], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if settled_within(before, sampler.sample()):
            return True
        time.sleep(0.5)
    return False


def _rate(count: Any, seconds: float, pid: int) -> tuple[float, float]:
    """Batches a second the trainer took over ``seconds``, and the cores process ``pid`` used."""
    first, cpu, began = int(count.value), _cpu_s(pid), time.monotonic()
    time.sleep(seconds)
    took = time.monotonic() - began
    return (int(count.value) - first) / took, round((_cpu_s(pid) - cpu) / took, 2)


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` (all its threads) so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _per_batch(cores: float, batches_per_s: float) -> float:
    return round(cores * 1e6 / batches_per_s, 1) if batches_per_s else 0.0


def _wait(condition: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise RuntimeError(what)
        time.sleep(0.05)


def _unit(key: str, value: int) -> float | int:
    return round(value / MIB, 1) if key == "rss" else value


def summary(results: dict[str, Any]) -> list[str]:
    c, t, s = results["connections"], results["trainer"], results["server"]
    waits, cpu = t["longest_wait_s"], results["cpu"]

    def trio(key: str) -> str:
        return f"{s[key]['before']} -> {s[key]['peak_during']} -> {s[key]['after']} -> {s[key]['end']}"

    return [
        f"soak: {c['idle_held']} idle gRPC connections held + {c['silent_opened']} silent TCP "
        f"({c['silent_closed_by_server']} closed by the server, the last after "
        f"{c['silent_closed_after_s']}s); server sockets {c['server_sockets_before']} -> "
        f"{c['server_sockets_with_crowd']} with the crowd, {c['server_sockets_at_churn_end']} at the end "
        f"of the churn, peak {c['server_sockets_peak']}",
        f"soak: churn {c['churn_per_s']} connections/s ({c['churn_grpc_calls']} gRPC calls, "
        f"{c['churn_tcp_connects']} TCP connects, {c['churn_errors']} errors)",
        f"soak: trainer {t['during_batches_per_s']} batches/s during the crowd vs "
        f"{t['before_batches_per_s']} before and {t['after_batches_per_s']} after -> "
        f"{t['ratio_during_vs_without']}x; longest wait for a batch {waits['during']}s "
        f"(before {waits['before']}s, after {waits['after']}s); {t['reconnects']} reconnects",
        f"soak: server CPU {cpu['server_us_per_batch']['during']} us/batch during the crowd vs "
        f"{cpu['server_us_per_batch']['before']} before and {cpu['server_us_per_batch']['after']} after "
        f"({cpu['server_cores']['during']} cores vs {cpu['server_cores']['before']}); the crowd's own "
        f"process used {cpu['crowd_cores_during']} cores of this machine's {os.cpu_count()}",
        f"soak: server (before -> peak during -> after -> after the last window) threads {trio('threads')}, "
        f"fds {trio('fds')} (and the cursor store's {trio('store_fds')}), "
        f"RSS {trio('rss')} MiB ({'settled' if results['settled'] else 'NOT settled'} "
        f"in {results['settle_s']}s)",
    ]


def main(full: bool, settings: SoakSettings | None = None) -> dict[str, Any]:
    settings = settings or (FULL if full else QUICK)
    root = Path(tempfile.mkdtemp(prefix="ladle-bench-soak-"))
    try:
        make_dataset(root / "ds", settings.rows, seed=0, scale=1 / 16)
        return run_soak(root / "ds", root / "work", settings)
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    argv: Sequence[str] = sys.argv[1:]
    figures = main("--full" in argv)
    print(json.dumps(figures, indent=2))
    for line in summary(figures):
        print(line, file=sys.stderr)
