"""How long a ``BatchClient`` takes to connect and to close, beside a bare grpcio channel.

A trainer opens a client, reads, and closes it at the end of its run; tests,
evaluations and short jobs do that many times. One ``ladle serve`` child;
each repeat opens a client, takes 3 batches and closes it, alternating with
the baseline: a bare grpcio channel made ready with ``grpc.channel_ready_future``
(as the client makes its own) and closed at once. grpcio's thread renews a
0.2 s connectivity watch until it sees the future go, and ``channel.close()``
waits it out; the client's ``close()`` does not (its channel closes on a thread
of its own while that watch may still run).

``python -m benchmarks.bench_client_lifetime [--full]`` (JSON on stdout, a summary on stderr).
"""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import grpc

from benchmarks.bench_serving import _Ladle
from ladle.client import BatchClient
from ladle.service.synth import make_dataset

CASES = ("BatchClient", "grpc channel")


def _once(address: str, job: str, bare: bool) -> tuple[float, float]:
    """(seconds to connect and take 3 batches, seconds to close) for one client, or a bare channel's."""
    start = time.perf_counter()
    if bare:  # the baseline: connect and close, nothing read
        channel = grpc.insecure_channel(address)
        grpc.channel_ready_future(channel).result(timeout=60)
        opened = time.perf_counter()
        channel.close()
        return opened - start, time.perf_counter() - opened
    client = BatchClient(0, 1, address, job, timeout=60)
    batches = iter(client)
    for _ in range(3):
        next(batches)
    opened = time.perf_counter()
    client.close()
    return opened - start, time.perf_counter() - opened


def main(full: bool = False) -> dict[str, Any]:
    repeats = 60 if full else 20
    samples: dict[str, dict[str, list[float]]] = {case: {"open": [], "close": []} for case in CASES}
    with tempfile.TemporaryDirectory(prefix="ladle-life-") as tmp:
        work = Path(tmp)
        make_dataset(work / "ds", 2_000, seed=3, scale=1 / 16)
        server = _Ladle(work / "ds", work, "life")
        try:
            _once(server.address, "warm-up", False)
            for i in range(repeats):
                for case in CASES if i % 2 == 0 else reversed(CASES):
                    opened, closed = _once(server.address, f"life-{i}-{case[:3]}", case == CASES[1])
                    samples[case]["open"].append(opened)
                    samples[case]["close"].append(closed)
        finally:
            server.stop()
    out: dict[str, Any] = {"repeats": repeats, "cases": {}}
    for case, times in samples.items():
        out["cases"][case] = {
            f"{what}_ms_{stat}": round(1e3 * fn(values), 2)
            for what, values in times.items()
            for stat, fn in (("median", statistics.median), ("max", max))
        }
    return out


def summary(result: dict[str, Any]) -> list[str]:
    client, channel = (result["cases"][case] for case in CASES)
    return [
        f"BatchClient close(): median {client['close_ms_median']} ms (max {client['close_ms_max']}); a bare "
        f"grpcio channel's close() right after its ready future: {channel['close_ms_median']} ms (max "
        f"{channel['close_ms_max']}); connect + 3 batches {client['open_ms_median']} ms, the channel's "
        f"connect {channel['open_ms_median']} ms ({result['repeats']} alternated repeats)"
    ]


if __name__ == "__main__":
    res = main("--full" in sys.argv[1:])
    print(json.dumps(res, indent=2))
    for line in summary(res):
        print(line, file=sys.stderr)
