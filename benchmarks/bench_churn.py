"""Schedule churn: a client opening streams of ever new world sizes against one ``ladle serve``.

Every Open of a world size the server has not built a schedule for builds
that epoch's schedule, and the stream prepares the next. Before the schedule
limits, nothing bounded how many a client could have built: the adversarial
review measured 300 such Opens on the 200,000-row sample take the server's
RSS from 239 MB to 1.47 GB in 9 s (1,000: 4.2 GB), and RSS stayed there.

This reproduces that measurement. It makes the sample (``ladle make-dataset
DIR --rows 200000 --seed 0``; or ``--dataset DIR`` reuses one), starts
``ladle serve`` on it with its defaults (plus ``--server-arg`` options), runs
one trainer to reach a steady state, then sends ``--opens`` raw gRPC Opens,
one after another, each for a new job of world size 2, 3, 4, ... (rank 0,
prefetch 1) reading one batch and cancelling. By default each Open names a
client_id of its own (``--one-client`` sends one for all), the worst case for
the server-wide bound: a client that varies its client_id escapes the
per-client one. The server's VmRSS and RssAnon (``/proc/PID/status``) are
read before, during (the peak, sampled every 50 ms) and after the loop, and
again after ``--settle`` seconds (past HOT_SECONDS, so the kept schedules
have gone idle), beside the bound: ``--max-schedules`` + ``--spare-schedules``
schedules of the size one of this dataset holds. A trainer then reads
batches, to show the server still serves.

Run: ``python -m benchmarks.bench_churn`` (300 Opens, 65 s settle), or e.g.
``--opens 1000 --settle 0``. The server binds 127.0.0.1 and is stopped in a
``finally``.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import threading
import time
import tracemalloc
import urllib.request
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc

from ladle.client import BatchClient
from ladle.proto import ladle_pb2 as pb
from ladle.proto import rpc
from ladle.service.launch import ServeProcess

__all__ = ["main", "run_churn"]

MIB = 1 << 20


def status_kib(pid: int) -> dict[str, int]:
    """VmRSS, RssAnon and RssFile of a process in KiB."""
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        name, _, value = line.partition(":")
        if name in ("VmRSS", "RssAnon", "RssFile"):
            out[name] = int(value.split()[0])
    return out


def schedule_mib(dataset: Path) -> float:
    """What one schedule of ``dataset`` holds (the server's default config, world size 2)."""
    from ladle.service.dataset import open_dataset
    from ladle.service.schedule import ScheduleConfig, build_schedule

    lengths = open_dataset(dataset).lengths
    tracemalloc.start()
    sched = build_schedule(lengths, ScheduleConfig(), epoch=0, world_size=2)
    held, _ = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    del sched
    return held / MIB


def open_once(channel: Any, job: str, world_size: int, client_id: str, timeout: float) -> str:
    """One Open of rank 0 of ``job``, one batch read, then cancelled: 'OK' or the status code's name."""

    stop = threading.Event()

    def requests() -> Iterator[pb.StreamRequest]:
        yield pb.StreamRequest(
            open=pb.Open(job=job, rank=0, world_size=world_size, prefetch=1, client_id=client_id)
        )
        stop.wait(timeout)

    call = rpc.BatchServiceClient(channel).stream(requests(), timeout=timeout)
    try:
        for frames, _ in enumerate(call, 1):
            if frames == 2:  # the StreamStart, then one batch
                return "OK"
        return "ENDED"
    except grpc.RpcError as exc:
        return str(exc.code().name)
    finally:
        stop.set()
        call.cancel()


class Peak:
    """The largest VmRSS and RssAnon of a process, sampled on a thread until ``stop``."""

    def __init__(self, pid: int, every: float = 0.05) -> None:
        self.pid, self.every = pid, every
        self.peak = status_kib(pid)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.every):
            try:
                now = status_kib(self.pid)
            except OSError:
                return
            for name, value in now.items():
                self.peak[name] = max(self.peak.get(name, 0), value)

    def stop(self) -> dict[str, int]:
        self._stop.set()
        self._thread.join(5)
        return self.peak


def trainer_reads(address: str, job: str, batches: int) -> int:
    with BatchClient(0, 1, address, job, timeout=60, client_id="bench-trainer") as client:
        it = iter(client)
        for _ in range(batches):
            next(it)
    return batches


def cached_schedules(http: str) -> float:
    """The server's ``ladle_schedules_cached`` gauge (a scrape also drops schedules gone idle)."""
    with urllib.request.urlopen(f"http://{http}/metrics", timeout=30) as response:
        for line in response.read().decode().splitlines():
            if line.startswith("ladle_schedules_cached "):
                return float(line.split()[-1])
    return -1.0


def run_churn(
    dataset: Path,
    workdir: Path,
    *,
    opens: int = 300,
    settle: float = 65.0,
    one_client: bool = False,
    server_args: tuple[str, ...] = (),
) -> dict[str, Any]:
    one = schedule_mib(dataset)
    with ServeProcess(dataset, workdir, extra=server_args, grace=10) as server:
        pid = server.proc.pid
        trainer_reads(server.address, "steady", 20)  # grpc, the store, one schedule: the steady state
        time.sleep(1.0)
        before = status_kib(pid)
        peak = Peak(pid)
        outcomes: Counter[str] = Counter()
        first_refused = None
        began = time.monotonic()
        with grpc.insecure_channel(server.address) as channel:
            for i in range(opens):
                world = 2 + i
                client_id = "churn" if one_client else f"churn-{i}"
                outcome = open_once(channel, f"churn-{world}", world, client_id, 60.0)
                outcomes[outcome] += 1
                if outcome != "OK" and first_refused is None:
                    first_refused = i + 1
        loop_s = time.monotonic() - began
        time.sleep(1.0)
        after = status_kib(pid)
        top = peak.stop()
        cached_after = cached_schedules(server.http_address)
        trainer_ok = trainer_reads(server.address, "after-churn", 20) == 20
        settled: dict[str, int] = {}
        cached_settled = cached_after
        if settle > 0:
            time.sleep(settle)
            cached_settled = cached_schedules(server.http_address)  # sweeps the idle ones
            time.sleep(1.0)
            settled = status_kib(pid)

    def mib(kib: dict[str, int], name: str) -> float:
        return round(kib.get(name, 0) / 1024, 1)

    result: dict[str, Any] = {
        "rows": None,
        "opens": opens,
        "client_ids": "one" if one_client else "one per Open",
        "server_args": list(server_args),
        "loop_s": round(loop_s, 1),
        "outcomes": dict(outcomes),
        "first_refused_open": first_refused,
        "schedule_mib": round(one, 2),
        "rss_before_mib": mib(before, "VmRSS"),
        "rss_peak_mib": mib(top, "VmRSS"),
        "rss_after_mib": mib(after, "VmRSS"),
        "anon_before_mib": mib(before, "RssAnon"),
        "anon_peak_mib": mib(top, "RssAnon"),
        "anon_after_mib": mib(after, "RssAnon"),
        "schedules_cached_after": cached_after,
        "trainer_after_churn": trainer_ok,
    }
    if settled:
        result.update(
            settle_s=settle,
            rss_settled_mib=mib(settled, "VmRSS"),
            anon_settled_mib=mib(settled, "RssAnon"),
            schedules_cached_settled=cached_settled,
        )
    return result


def _bound(server_args: tuple[str, ...]) -> tuple[int, int]:
    """(--max-schedules, --spare-schedules) as the server runs them (its defaults unless given)."""
    try:
        from ladle.service.limits import Limits

        defaults = Limits()
        most, spare = getattr(defaults, "max_schedules", 0), defaults.spare_schedules
    except Exception:  # an older server: no bound
        most, spare = 0, 4
    args = list(server_args)
    for i, arg in enumerate(args[:-1]):
        if arg == "--max-schedules":
            most = int(args[i + 1])
        if arg == "--spare-schedules":
            spare = int(args[i + 1])
    return most, spare


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.bench_churn", description=__doc__)
    parser.add_argument("--rows", type=int, default=200_000)
    parser.add_argument("--opens", type=int, default=300)
    parser.add_argument("--settle", type=float, default=65.0, help="seconds to wait after the loop")
    parser.add_argument("--dataset", type=Path, help="reuse this dataset instead of making the sample")
    parser.add_argument("--one-client", action="store_true", help="one client_id for every Open")
    parser.add_argument("--server-arg", action="append", default=[], help="passed to ladle serve")
    args = parser.parse_args(argv)
    server_args = tuple(a for arg in args.server_arg for a in arg.split())
    with tempfile.TemporaryDirectory(prefix="ladle-churn-") as tmp:
        dataset = args.dataset
        if dataset is None:
            from ladle.service.synth import make_dataset

            dataset = Path(tmp) / "ds"
            make_dataset(dataset, args.rows, seed=0)
        result = run_churn(
            dataset,
            Path(tmp) / "server",
            opens=args.opens,
            settle=args.settle,
            one_client=args.one_client,
            server_args=server_args,
        )
    from ladle.service.dataset import open_dataset

    result["rows"] = open_dataset(dataset).num_rows if args.dataset else args.rows
    most, spare = _bound(server_args)
    result["bound_schedules"] = most + spare if most else None
    result["bound_mib"] = round((most + spare) * result["schedule_mib"], 1) if most else None
    print(json.dumps(result, indent=2))
    bound = (
        f"bound {most} + {spare} spare schedules x {result['schedule_mib']} MiB = {result['bound_mib']} MiB"
        if most
        else "no bound"
    )
    print(
        f"{result['opens']} Opens of new world sizes on {result['rows']:,} rows in {result['loop_s']} s "
        f"({result['outcomes']}): RSS {result['rss_before_mib']} -> peak {result['rss_peak_mib']} -> "
        f"{result['rss_after_mib']} MiB, RssAnon {result['anon_before_mib']} -> peak "
        f"{result['anon_peak_mib']} -> {result['anon_after_mib']} MiB"
        + (
            f", after {result['settle_s']:.0f} s {result['rss_settled_mib']} / "
            f"{result['anon_settled_mib']} MiB"
            if "settle_s" in result
            else ""
        )
        + f"; {bound}; a trainer after: {'ok' if result['trainer_after_churn'] else 'FAILED'}",
        file=sys.stderr,
    )
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
