"""Scale out: ranks beyond what replicas admit, the scale benchmark's short forms, and its faults.

The benchmark (``benchmarks/bench_scale.py``) starts real ``ladle serve``
replicas on a real redis-server, runs many ``BatchClient`` ranks at a pace and
checks every rank's batches against the schedule (exactly once, equal steps):
its short forms here are the CI run of that benchmark, a replica SIGKILLed under
load and a Redis that stops answering for seconds (``DEBUG SLEEP``).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from benchmarks import bench_scale
from ladle.client import BatchClient, ServerFullError
from tests.support.redis_server import RedisServer, redis_server_available

from .conftest import ServerProcess
from .test_serving import reference

pytestmark = pytest.mark.skipif(not redis_server_available(), reason="redis-server is not installed")


@pytest.fixture
def redis() -> Any:
    with RedisServer() as server:
        yield server


def _replicas(server_factory: Callable[..., ServerProcess], redis: RedisServer, limits: list[int]) -> str:
    """One replica per per-job session limit, on one Redis; their addresses as LADLE_SERVER lists them."""
    started = [
        server_factory(
            ["--redis-url", redis.url, "--max-sessions", "64", "--max-sessions-per-job", str(limit)]
        )
        for limit in limits
    ]
    return ",".join(s.address for s in started)


def test_a_rank_a_full_replica_refuses_moves_to_one_with_room(
    server_factory: Callable[..., ServerProcess], redis: RedisServer, small_dataset: Path
) -> None:
    """Ranks 0, 2, 4 start on replica a (room for 2), ranks 1, 3 on b (room for 3): the rank a
    refuses is served by b, and all five read their whole epoch, each exactly the schedule's."""
    servers = _replicas(server_factory, redis, [2, 3])
    world = 5
    clients = [BatchClient(r, world, servers, "full-moves", timeout=20) for r in range(world)]
    try:
        iters = [iter(c) for c in clients]
        firsts = [next(it) for it in iters]  # every stream open at once: a holds two, b three
        sched = reference(small_dataset, world)
        for rank, (first, it) in enumerate(zip(firsts, iters, strict=True)):
            got = [first, *it]
            assert [b.step for b in got] == list(range(sched.num_steps))
            for b in got:
                assert np.array_equal(b.sample_ids, sched.samples(b.step, rank))
    finally:
        for c in clients:
            c.close()


def test_ranks_beyond_every_replicas_room_get_server_full_error_naming_the_flag(
    server_factory: Callable[..., ServerProcess], redis: RedisServer
) -> None:
    """Six ranks on replicas with room for 2 and 3: the sixth stream is refused by both, at once (not
    after the client's timeout), with ServerFullError that names --max-sessions-per-job; the five
    admitted go on."""
    servers = _replicas(server_factory, redis, [2, 3])
    clients = [BatchClient(r, 6, servers, "full-refused", timeout=60) for r in range(6)]
    try:
        held = [next(iter(c)) for c in clients[:5]]
        assert len(held) == 5
        with pytest.raises(ServerFullError, match="--max-sessions-per-job") as caught:
            next(iter(clients[5]))
        assert caught.value.code == "RESOURCE_EXHAUSTED"
        assert "add a replica" in str(caught.value)
        assert next(iter(clients[0])).step == 1  # the admitted ranks read on
    finally:
        for c in clients:
            c.close()


# --- the benchmark's short forms (real replicas, a real redis-server, BatchClient ranks) ---


def _bench(*args: str) -> dict[str, Any]:
    return bench_scale.main([*args, "--workers", "2", "--steps-per-epoch", "4"])


def test_bench_scale_short_form_reports_every_figure() -> None:
    """8 and 32 ranks on 2 replicas, two epochs each (the full form: 64 and 1,000 ranks on 1, 2 and 4):
    every rank's record is checked against the schedule inside the benchmark (it raises otherwise),
    and every figure is there."""
    results = _bench("--ranks", "8", "32", "--replicas", "2", "--step-ms", "50")
    cases = results["cases"]
    assert [(c["ranks"], c["replicas"]) for c in cases] == [(8, 2), (32, 2)]
    for c in cases:
        assert c["exactly_once"]
        assert c["batches"] == c["ranks"] * sum(c["steps_per_epoch"])
        assert len(c["replica_rss_mib"]) == c["replicas"]
        assert min(c["replica_threads"]) > 0
        assert c["redis_scripts_per_batch"] > 0
        assert c["evalsha_p99_ms"] >= c["evalsha_p50_ms"] > 0
        assert 0 < c["first_batch_median_s"] <= c["first_batch_all_s"]
    assert [g["replicas"] for g in results["growth"]] == [2]
    assert all(g["ranks_ratio"] == 4 for g in results["growth"])


def test_a_replica_killed_under_load_loses_nothing() -> None:
    """48 ranks on 3 replicas, replica 1 SIGKILLed part-way: its ranks move to the others and
    every rank still gets exactly the schedule's batches, every step of both epochs."""
    (case,) = _bench("--ranks", "48", "--replicas", "3", "--step-ms", "100", "--fault", "kill-replica")[
        "cases"
    ]
    assert case["exactly_once"]
    assert case["fault"] == "kill-replica"
    assert case["replica_exits"] == [0, -9, 0], "replica 1 was not the one killed, or another failed"


def test_a_redis_that_stops_answering_for_seconds_loses_nothing() -> None:
    """DEBUG SLEEP 3 part-way through 32 ranks on 2 replicas: the cursor writes wait, the ranks read
    on or wait and resume, and every rank still gets exactly the schedule's batches."""
    (case,) = _bench("--ranks", "32", "--replicas", "2", "--step-ms", "100", "--fault", "slow-redis")["cases"]
    assert case["exactly_once"]
    assert case["fault"] == "slow-redis"
    assert case["replica_exits"] == [0, 0]
