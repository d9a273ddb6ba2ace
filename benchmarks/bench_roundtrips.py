"""Redis round trips per delivered batch, amortized over an epoch (issue 4's figure: at most 1).

Trainers consume one epoch from a ``ladle serve --redis-url`` process; a
MONITOR connection counts the commands clients send (a Lua script's inner
commands run inside Redis and are not round trips). ladle writes acknowledged positions behind each stream
(at most every ``--ack-flush-ms``, 50 by default); the baseline in the same
run is the same server writing every acknowledgement at once
(``--ack-flush-ms 0``), the naive one-write-per-batch design. Each is run
with trainers that take no time per batch (a data-only pass: acks grouped)
and with a 10 ms training step.

``python -m benchmarks.bench_roundtrips [--full]`` (JSON on stdout, a summary on stderr).
"""

from __future__ import annotations

import json
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from benchmarks.bench_serving import _Ladle
from ladle.client import BatchClient
from ladle.service.synth import make_dataset
from tests.support.redis_server import RedisServer

WORLD = 2


def _epoch(address: str, job: str, step_s: float) -> tuple[int, float]:
    """Every rank reads one epoch in its own thread; (batches, seconds)."""
    counts = [0] * WORLD
    errors: list[BaseException] = []

    def trainer(rank: int) -> None:
        try:
            with BatchClient(rank, WORLD, address, job, timeout=60) as client:
                for _ in client:
                    if step_s:
                        time.sleep(step_s)
                    counts[rank] += 1
        except BaseException as exc:
            errors.append(exc)

    start = time.perf_counter()
    threads = [threading.Thread(target=trainer, args=(r,)) for r in range(WORLD)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
    return sum(counts), time.perf_counter() - start


class _RoundTrips:
    """Counts the commands clients send to Redis (MONITOR), not those a Lua script runs inside Redis.

    ``INFO stats`` counts a script's inner HGET/HSET calls too; a round trip
    is one command on the wire (an EVALSHA, a SCRIPT LOAD after a restart).
    """

    def __init__(self, redis: RedisServer) -> None:
        self._client = redis.client()
        self._monitor = self._client.monitor()  # type: ignore[no-untyped-call]
        self._monitor.__enter__()
        self.counts: dict[str, int] = {}
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            while True:
                command = self._monitor.next_command()
                if command.get("client_type") == "lua":
                    continue
                name = str(command.get("command", "")).split(" ", 1)[0].upper()
                self.counts[name] = self.counts.get(name, 0) + 1
        except Exception:  # the connection closed: done
            return

    def total(self) -> int:
        time.sleep(0.2)  # let MONITOR catch up
        return sum(self.counts.values())

    def close(self) -> None:
        self._monitor.connection.disconnect()
        self._thread.join(timeout=5)
        self._client.close()


def main(full: bool = False) -> dict[str, Any]:
    rows = 40_000 if full else 10_000
    out: dict[str, Any] = {"rows": rows, "world_size": WORLD, "cases": []}
    with tempfile.TemporaryDirectory(prefix="ladle-rt-") as tmp, RedisServer(appendonly=True) as redis:
        work = Path(tmp)
        dataset = work / "ds"
        make_dataset(dataset, rows, seed=11, scale=1 / 16)
        for flush_ms in (50, 0):
            server = _Ladle(
                dataset, work, f"flush{flush_ms}", ("--redis-url", redis.url, "--ack-flush-ms", str(flush_ms))
            )
            try:
                for step_ms in (0, 10):
                    job = f"rt-{flush_ms}-{step_ms}"
                    monitor = _RoundTrips(redis)
                    try:
                        batches, seconds = _epoch(server.address, job, step_ms / 1000)
                        used = monitor.total()
                    finally:
                        monitor.close()
                    out["cases"].append(
                        {
                            "ack_flush_ms": flush_ms,
                            "train_step_ms": step_ms,
                            "batches": batches,
                            "redis_round_trips": used,
                            "by_command": dict(sorted(monitor.counts.items())),
                            "round_trips_per_batch": round(used / batches, 3),
                            "batches_per_s": round(batches / seconds, 1),
                        }
                    )
            finally:
                server.stop()
    return out


def summary(result: dict[str, Any]) -> list[str]:
    lines = []
    by = {(c["ack_flush_ms"], c["train_step_ms"]): c for c in result["cases"]}
    for step in (0, 10):
        ladle, naive = by[(50, step)], by[(0, step)]
        lines.append(
            f"redis round trips per batch, {step} ms steps: {ladle['round_trips_per_batch']} "
            f"(writing every ack at once: {naive['round_trips_per_batch']}); "
            f"{ladle['batches_per_s']} vs {naive['batches_per_s']} batches/s"
        )
    return lines


if __name__ == "__main__":
    res = main("--full" in sys.argv[1:])
    print(json.dumps(res, indent=2))
    for line in summary(res):
        print(line, file=sys.stderr)
