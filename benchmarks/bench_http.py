"""What the HTTP face and the metrics cost the gRPC stream, beside a server without them.

1. Throughput: 2 client processes (ranks 0 and 1 of world size 2) read one
   epoch each from ``ladle serve`` with the HTTP face on and busy (a poller
   asks for /metrics and the job's /cursor every 0.5 s and renders the page
   every 2 s: more than a Prometheus scrape and an open page together),
   beside the same server with ``--no-http``. Repeats alternate the two, and
   the ratio of batches/s is paired per repeat; the server's CPU per batch is
   shown for both.
2. The per-batch metric updates alone (``StreamMeter.batch``, the send
   histogram and the clock reads the stream adds), timed in a loop, beside the
   server's CPU per batch measured in 1.

Every process started here is stopped in a ``finally``, on 127.0.0.1 only.
Run: ``python -m benchmarks.bench_http [--full]``.
"""

from __future__ import annotations

import json
import shutil
import statistics
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

from benchmarks.bench_serving import _Clients, _Ladle, _make, _r, _timed
from ladle.service.metrics import ServerMetrics

SETTINGS = {False: {"rows": 40_000, "repeats": 3}, True: {"rows": 100_000, "repeats": 5}}
POLL_S = 0.5


class _Poller:
    """A thread that reads /metrics and a job's /cursor every POLL_S, and the page every 4th time."""

    def __init__(self, url: str, job: str) -> None:
        self.url, self.job = url, job
        self.requests = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="bench-http-poller", daemon=True)
        self._thread.start()

    def _get(self, path: str) -> None:
        try:
            with urllib.request.urlopen(self.url + path, timeout=10) as response:
                response.read()
            self.requests += 1
        except OSError:
            pass  # the job does not exist until the trainers open it

    def _run(self) -> None:
        tick = 0
        while not self._stop.wait(POLL_S):
            self._get("/metrics")
            self._get(f"/v1/jobs/{self.job}/cursor")
            if tick % 4 == 0:
                self._get(f"/?job={self.job}")
            tick += 1

    def stop(self) -> int:
        self._stop.set()
        self._thread.join(timeout=30)
        return self.requests


def bench_overhead(dataset: Path, workdir: Path, repeats: int) -> dict[str, Any]:
    clients = _Clients(2)
    runs: dict[str, list[dict[str, Any]]] = {"http_polled": [], "no_http": []}
    polled = 0
    servers: list[_Ladle] = []
    try:
        http_ready = workdir / "http.ready"
        with_http = _Ladle(dataset, workdir, "with-http", ("--http-ready-file", str(http_ready)))
        servers.append(with_http)
        without = _Ladle(dataset, workdir, "no-http", ("--no-http",))
        servers.append(without)
        url = f"http://{http_ready.read_text()}"
        for r in range(repeats):
            order = [("http_polled", with_http), ("no_http", without)]
            for case, server in order if r % 2 == 0 else order[::-1]:
                job = f"{case}-{r}"
                poller = _Poller(url, job) if case == "http_polled" else None
                try:
                    kwargs = [
                        {"address": server.address, "job": job, "rank": i, "world_size": 2} for i in range(2)
                    ]
                    got = _timed(clients, server.pid, "ladle_epoch", kwargs)
                finally:
                    polled += poller.stop() if poller is not None else 0
                got.pop("_sizes", None)
                runs[case].append(got)
    finally:
        for server in servers:
            server.stop()
        clients.close()
    paired = [
        h["batches_s"] / n["batches_s"] for h, n in zip(runs["http_polled"], runs["no_http"], strict=True)
    ]
    return {
        "repeats": repeats,
        "http_requests_during_runs": polled,
        "cases": {
            case: {
                "batches_s": _r(statistics.median(r["batches_s"] for r in case_runs), 0),
                "server_cpu_us_per_batch": _r(
                    statistics.median(r["server_cpu_us_per_batch"] for r in case_runs), 0
                ),
                "runs_batches_s": [_r(r["batches_s"], 0) for r in case_runs],
            }
            for case, case_runs in runs.items()
        },
        "ratio_http_polled_vs_no_http_paired": _r(statistics.median(paired)),
        "ratios": [_r(x) for x in paired],
    }


def bench_metric_updates(n: int = 200_000) -> dict[str, Any]:
    """The per-batch work the stream does for metrics, alone."""
    meter = ServerMetrics().stream("bench", 0)
    began = time.perf_counter()
    for _ in range(n):
        t0 = time.perf_counter()
        meter.batch(40_000, 41_000, 200_000, time.perf_counter() - t0)
        t1 = time.perf_counter()
        meter.send.observe(time.perf_counter() - t1)
    return {"updates": n, "us_per_batch": _r((time.perf_counter() - began) / n * 1e6, 2)}


def main(full: bool) -> dict[str, Any]:
    s = SETTINGS[full]
    tmp = Path(tempfile.mkdtemp(prefix="ladle-bench-http-"))
    try:
        ds = tmp / "ds"
        made = _make(ds, s["rows"])
        overhead = bench_overhead(ds, tmp, s["repeats"])
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return {"dataset": made, "throughput": overhead, "metric_updates": bench_metric_updates()}


def summary(results: dict[str, Any]) -> list[str]:
    tp = results["throughput"]
    c = tp["cases"]
    mu = results["metric_updates"]
    cpu = c["no_http"]["server_cpu_us_per_batch"]
    return [
        f"HTTP face busy ({tp['http_requests_during_runs']} requests during the runs): "
        f"{c['http_polled']['batches_s']:,.0f} batches/s vs --no-http {c['no_http']['batches_s']:,.0f} "
        f"-> {tp['ratio_http_polled_vs_no_http_paired']}x paired (runs {tp['ratios']}); server CPU/batch "
        f"{c['http_polled']['server_cpu_us_per_batch']:,.0f} vs {cpu:,.0f} us",
        f"metric updates per batch: {mu['us_per_batch']} us = {100 * mu['us_per_batch'] / cpu:.2f}% of the "
        "server's CPU per batch",
    ]


if __name__ == "__main__":
    out = main("--full" in sys.argv)
    print(json.dumps(out, indent=2))
    print("\n".join(summary(out)), file=sys.stderr)
