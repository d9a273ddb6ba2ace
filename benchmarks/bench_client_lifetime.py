"""How long a ``BatchClient`` takes to connect and to close, beside grpcio's ready future.

A trainer opens a client, reads, and closes it at the end of its run; tests,
evaluations and short jobs do that many times. One ``ladle serve`` child;
each repeat opens a client, takes 3 batches and closes it, alternating the
client's own connectivity watch (``_direct.wait_ready``, the default) with
``grpc.channel_ready_future`` (the baseline, what the client used before:
grpcio's thread renews a 0.2 s watch, and ``channel.close()`` waits it out).

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

from benchmarks.bench_serving import _Ladle
from ladle.client import BatchClient
from ladle.service.synth import make_dataset

CASES = ("own watch", "grpc ready future")


def _once(address: str, job: str, own_watch: bool) -> tuple[float, float]:
    """(seconds to connect and take 3 batches, seconds to close) for one client."""
    start = time.perf_counter()
    client = BatchClient(0, 1, address, job, timeout=60)
    if not own_watch:
        client._connection._watch_here = lambda channel: False  # type: ignore[method-assign]  # the baseline
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
            _once(server.address, "warm-up", True)
            for i in range(repeats):
                for case in CASES if i % 2 == 0 else reversed(CASES):
                    opened, closed = _once(server.address, f"life-{i}-{case[:3]}", case == CASES[0])
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
    own, future = (result["cases"][case] for case in CASES)
    return [
        f"BatchClient close(): median {own['close_ms_median']} ms (max {own['close_ms_max']}) with its own "
        f"connectivity watch, {future['close_ms_median']} ms (max {future['close_ms_max']}) with grpc's "
        f"ready future; connect + 3 batches {own['open_ms_median']} vs {future['open_ms_median']} ms "
        f"({result['repeats']} alternated repeats)"
    ]


if __name__ == "__main__":
    res = main("--full" in sys.argv[1:])
    print(json.dumps(res, indent=2))
    for line in summary(res):
        print(line, file=sys.stderr)
