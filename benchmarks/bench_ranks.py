"""What a /metrics scrape costs with where the ranks stand in it: 1,000 ranks beside 8.

In process, with a real cursor store (the embedded SQLite file, and Redis
when ``redis-server`` is installed): a job of 8 ranks and one of 1,000, every
rank joined and advanced, one metered stream of the job so the scrape reads
it. Each case times ``ServerMetrics.exposition()`` (what ``GET /metrics``
sends) with the rank series, beside the same metrics without them (the
baseline: the scrape as it was), alternating the two; and the store read
alone (``get``), which the rank series add once per job. The page (``GET
/``, server-side rendering only) is timed for the same two jobs.

``python -m benchmarks.bench_ranks [--full]`` (JSON on stdout, a summary on stderr).
"""

from __future__ import annotations

import contextlib
import functools
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from ladle.service.dataset import open_dataset
from ladle.service.jobs import JobRegistry
from ladle.service.metrics import ServerMetrics
from ladle.service.schedule import ScheduleConfig
from ladle.service.standing import read_standing
from ladle.service.store import CursorStore, EmbeddedStore, Position, RedisCursorStore
from ladle.service.synth import make_dataset

WORLDS = (8, 1000)
# the production mix at 1/16 scale; at most 2 rows a batch, so 1,000 ranks have 10 steps an epoch
CONFIG = ScheduleConfig(
    max_seq_len=512, bucket_bounds=(0, 48, 76, 108, 152, 206, 513), token_budget=3072, max_batch_size=2
)


def _median_ms(fn: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        began = time.perf_counter()
        fn()
        times.append(time.perf_counter() - began)
    return round(1e3 * statistics.median(times), 2)


@contextlib.contextmanager
def _stores(work: Path) -> Iterator[dict[str, CursorStore]]:
    from tests.support.redis_server import RedisServer, redis_server_available

    stores: dict[str, CursorStore] = {"embedded": EmbeddedStore(work / "state.db")}
    with contextlib.ExitStack() as stack:
        if redis_server_available():
            server = stack.enter_context(RedisServer())
            stores["redis"] = RedisCursorStore(server.url)
        try:
            yield stores
        finally:
            for store in stores.values():
                store.close()


def _case(registry: JobRegistry, world: int, repeats: int) -> dict[str, float]:
    from fastapi.testclient import TestClient

    from ladle.service.http import Inspector, create_app

    job, store = f"ranks-{world}", registry.store
    registry.open(job, world)
    for rank in range(world):
        joined = store.join(job, rank, world)
        store.advance(job, rank, joined.generation, Position(0, 3 if rank % 97 == 5 else 6))
    plain, watched = ServerMetrics(), ServerMetrics()
    watched.watch_ranks(functools.partial(read_standing, registry))
    for metrics in (plain, watched):
        metrics.stream(job, 0)
    page = TestClient(create_app(Inspector(registry)))
    page.get("/", params={"job": job})  # the schedules and figures the page caches
    out = {"scrape_ms": 0.0, "baseline_scrape_ms": 0.0}
    for i in range(4):  # alternate the two, the median of each round's median
        order = (("scrape_ms", watched), ("baseline_scrape_ms", plain))
        for key, metrics in order if i % 2 == 0 else reversed(order):
            out[key] += _median_ms(metrics.exposition, repeats) / 4
    out["store_get_ms"] = _median_ms(lambda: store.get(job), repeats)
    out["page_ms"] = _median_ms(lambda: page.get("/", params={"job": job}), max(3, repeats // 4))
    out["scrape_bytes"] = len(watched.exposition())
    return {key: round(value, 2) for key, value in out.items()}


def main(full: bool = False) -> dict[str, Any]:
    repeats = 40 if full else 12
    out: dict[str, Any] = {"repeats": repeats, "stores": {}}
    with tempfile.TemporaryDirectory(prefix="ladle-ranks-") as tmp:
        work = Path(tmp)
        make_dataset(work / "ds", 20_000, seed=3, scale=1 / 16)
        dataset = open_dataset(work / "ds")
        with _stores(work) as stores:
            for name, store in stores.items():
                registry = JobRegistry(dataset, CONFIG, store)
                out["stores"][name] = {str(world): _case(registry, world, repeats) for world in WORLDS}
    return out


def summary(result: dict[str, Any]) -> list[str]:
    lines = []
    for name, cases in result["stores"].items():
        small, big = (cases[str(w)] for w in WORLDS)
        lines.append(
            f"{name}: /metrics {small['scrape_ms']} ms at {WORLDS[0]} ranks, {big['scrape_ms']} ms at "
            f"{WORLDS[1]} ({big['scrape_ms'] / small['scrape_ms']:.1f}x; without rank series "
            f"{small['baseline_scrape_ms']} and {big['baseline_scrape_ms']} ms; the store read "
            f"{small['store_get_ms']} and {big['store_get_ms']} ms); the page {small['page_ms']} and "
            f"{big['page_ms']} ms"
        )
    return lines


if __name__ == "__main__":
    result = main("--full" in sys.argv[1:])
    print(json.dumps(result, indent=2))
    print("\n".join(summary(result)), file=sys.stderr)
