"""What a server keeps of its jobs' schedules is bounded by use, and inspection builds queue.

A long-lived server sees job after job; each schedule of a 10M-row dataset
holds about 100 MB. The cache keeps what streams use and a few more, shares
one schedule between jobs that follow it, and builds for the HTTP face one at
a time, refusing requests beyond a short queue with a 503 and Retry-After.
Builds for Opens and Describes count against a limit per client and one per
server (RESOURCE_EXHAUSTED beyond), what open streams are on never does, and
dropped schedules' memory goes back to the operating system.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
from fastapi.testclient import TestClient

from ladle.service import jobs, schedule_cache
from ladle.service.errors import JobNotFoundError, ScheduleBusyError, ScheduleLimitError
from ladle.service.http import Inspector, create_app
from ladle.service.jobs import JobRegistry, ScheduleCache
from ladle.service.metrics import ServerMetrics
from ladle.service.schedule import ScheduleConfig
from ladle.service.store import EmbeddedStore, Position

CONFIG = ScheduleConfig(max_seq_len=128, bucket_bounds=(0, 32, 129), token_budget=512)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def made(log: list[Any]) -> Any:
    """A build that records its key and returns a fresh object."""

    def build(key: Any) -> Any:
        def run() -> Any:
            log.append(key)
            return SimpleNamespace(key=key)

        return run

    return build


def test_idle_schedules_beyond_the_spare_ones_are_dropped() -> None:
    clock, log = Clock(), list[Any]()
    cache = ScheduleCache(spare=2, hot_s=60, clock=clock)
    build = made(log)
    for epoch in range(5):
        cache.get(("a", epoch), build(("a", epoch)), hot=False)
    assert len(cache) == 2
    assert cache.has(("a", 4)), "the most recently used are kept"
    assert cache.has(("a", 3)), "the most recently used are kept"
    cache.get(("a", 3), build(("a", 3)), hot=False)
    cache.get(("a", 5), build(("a", 5)), hot=False)
    assert cache.has(("a", 3)), "a use moves a schedule to the back"
    assert not cache.has(("a", 4))
    assert log.count(("a", 3)) == 1


def test_what_streams_use_is_kept_until_they_stop_using_it() -> None:
    clock, log = Clock(), list[Any]()
    cache = ScheduleCache(spare=1, hot_s=60, clock=clock)
    build = made(log)
    streamed = [cache.get(("job", e), build(("job", e)), hot=True) for e in range(3)]
    for epoch in range(4):  # an inspector walks through other epochs
        cache.get(("other", epoch), build(("other", epoch)), hot=False)
    assert all(cache.has(("job", e)) for e in range(3)), "a stream's schedules were dropped"
    assert len(cache) == 3 + 1
    clock.now += 50
    cache.get(("job", 0), build(("job", 0)), hot=True)  # still streamed
    clock.now += 20
    cache.get(("new", 0), build(("new", 0)), hot=False)
    assert cache.has(("job", 0)), "a schedule used 20 s ago by a stream was dropped"
    assert cache.has(("job", 1)), "the epoch after one in use was dropped"
    assert not cache.has(("job", 2)), "idle 70 s and kept"
    assert cache.get(("job", 0), build(("job", 0)), hot=True) is streamed[0]
    clock.now += 61
    cache.get(("newer", 0), build(("newer", 0)), hot=False)
    assert len(cache) == 1, "every job idle, more kept than the spare"


def test_the_next_epoch_prepared_ahead_outlives_a_long_epoch() -> None:
    """Warmed at the middle of an epoch of hours, it is still there at the boundary under pressure."""
    clock, log = Clock(), list[Any]()
    cache = ScheduleCache(spare=1, hot_s=60, clock=clock)
    build = made(log)
    cache.get(("job", 7), build(("job", 7)), hot=True)
    cache.get(("job", 8), build(("job", 8)), hot=True)  # what Job.warm does for epoch 8
    for minute in range(1, 180):  # three hours of epoch 7, with inspection of other jobs
        clock.now += 60
        cache.cached(("job", 7), hot=True)
        cache.get(("other", minute), build(("other", minute)), hot=False)
    assert cache.has(("job", 8)), "the next epoch was dropped before the streams reached it"
    assert cache.get(("job", 8), build(("job", 8)), hot=True) is not None
    assert log.count(("job", 8)) == 1, "the next epoch was built twice"
    assert len(cache) == 3, "beyond the streamed epoch, its next one and the spare"


def test_a_failed_build_keeps_nothing_and_the_next_caller_builds_again() -> None:
    cache: Any = ScheduleCache()
    calls = []

    def failing() -> Any:
        calls.append(1)
        raise RuntimeError("no")

    for _ in range(2):
        with pytest.raises(RuntimeError):
            cache.get(("a", 0), failing, hot=False)
    assert len(calls) == 2
    assert len(cache) == 0
    assert cache.get(("a", 0), lambda: "ok", hot=False) == "ok"


def test_inspection_builds_one_at_a_time_and_refuses_beyond_its_queue() -> None:
    cache: Any = ScheduleCache()  # its builds here return stand-ins, not schedules
    release = threading.Event()
    started = threading.Event()

    def slow() -> Any:
        started.set()
        release.wait(30)
        return "slow"

    results: dict[str, Any] = {}

    def ask(name: str, key: tuple[str, int], build: Any, hot: bool) -> None:
        try:
            results[name] = cache.get(key, build, hot=hot)
        except ScheduleBusyError as exc:
            results[name] = exc

    first = threading.Thread(target=ask, args=("first", ("a", 1), slow, False))
    first.start()
    assert started.wait(10)
    waiting = [
        threading.Thread(target=ask, args=(f"wait{i}", ("a", 2 + i), lambda: "later", False))
        for i in range(2)
    ]
    for t in waiting:
        t.start()
    deadline = time.monotonic() + 10
    while cache._cold_waiting < jobs.MAX_COLD_WAITING and time.monotonic() < deadline:
        time.sleep(0.01)
    with pytest.raises(ScheduleBusyError) as busy:
        cache.get(("a", 9), lambda: "refused", hot=False)
    assert busy.value.kind == "unavailable"
    assert busy.value.retry_after > 0
    # the same epoch as the one being built waits for it instead; a stream's build never queues
    same = threading.Thread(target=ask, args=("same", ("a", 1), lambda: "twice", False))
    same.start()
    assert cache.get(("stream", 0), lambda: "streamed", hot=True) == "streamed"
    release.set()
    for t in (first, same, *waiting):
        t.join(30)
    assert results == {"first": "slow", "same": "slow", "wait0": "later", "wait1": "later"}


def test_a_busy_inspection_is_a_503_with_retry_after(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    lengths = (np.arange(4000, dtype=np.int64) * 37) % 128 + 1
    dataset = SimpleNamespace(lengths=lengths, fingerprint="ds", path=str(tmp_path), num_rows=len(lengths))
    store = EmbeddedStore(tmp_path / "state.db")
    registry = JobRegistry(dataset, CONFIG, store)  # type: ignore[arg-type]
    job = registry.open("run", 2)
    release, started = threading.Event(), threading.Event()
    real_plan = jobs.plan_schedule

    def plan(*args: Any) -> Any:
        if args[2] >= 5:  # epochs 5 and later: held until released
            started.set()
            release.wait(30)
        return real_plan(*args)

    monkeypatch.setattr(jobs, "plan_schedule", plan)
    client = TestClient(create_app(Inspector(registry), ServerMetrics()))
    statuses: dict[int, int] = {}

    def get(epoch: int) -> None:
        statuses[epoch] = client.get(f"/v1/jobs/run/buckets?epoch={epoch}").status_code

    threads = [threading.Thread(target=get, args=(5,))]
    threads[0].start()
    assert started.wait(10)
    threads += [threading.Thread(target=get, args=(e,)) for e in (6, 7)]
    for t in threads[1:]:
        t.start()
    deadline = time.monotonic() + 10
    while registry.schedules._cold_waiting < jobs.MAX_COLD_WAITING and time.monotonic() < deadline:
        time.sleep(0.01)
    refused = client.get("/v1/jobs/run/buckets?epoch=8")
    assert refused.status_code == 503, refused.text
    assert refused.headers["Retry-After"].isdigit()
    assert refused.json()["kind"] == "unavailable"
    page = client.get("/?job=run&epoch=9")
    assert page.status_code == 503
    assert "Retry-After" in page.headers
    # a trainer's stream is not held up by the inspection queue
    assert job.batch(Position(0, 0), 0).epoch == 0
    release.set()
    for t in threads:
        t.join(30)
    assert statuses == {5: 200, 6: 200, 7: 200}


def test_jobs_that_follow_one_schedule_share_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    lengths = (np.arange(4000, dtype=np.int64) * 37) % 128 + 1
    dataset = SimpleNamespace(lengths=lengths, fingerprint="ds", path=str(tmp_path), num_rows=len(lengths))
    registry = JobRegistry(dataset, CONFIG, EmbeddedStore(tmp_path / "state.db"))  # type: ignore[arg-type]
    built: list[int] = []
    real_plan = jobs.plan_schedule

    def plan(*args: Any) -> Any:
        built.append(args[3])  # the world size
        return real_plan(*args)

    monkeypatch.setattr(jobs, "plan_schedule", plan)
    runs = [registry.open(f"run-{i}", 2) for i in range(10)]
    other = registry.open("wide", 4)
    scheds = [job.schedule(0, hot=True) for job in runs]
    assert all(s is scheds[0] for s in scheds)
    assert other.schedule(0, hot=True) is not scheds[0]
    assert built == [2, 4], f"built for world sizes {built}"


def test_idle_schedules_go_without_waiting_for_a_build() -> None:
    """After a burst of jobs, a stream's next batch (or a scrape) drops what went idle; no build needed."""
    clock, log = Clock(), list[Any]()
    cache = ScheduleCache(spare=1, hot_s=60, clock=clock)
    build = made(log)
    for job in range(6):
        cache.get((f"burst-{job}", 0), build((f"burst-{job}", 0)), hot=True)
    cache.get(("streaming", 0), build(("streaming", 0)), hot=True)
    assert len(cache) == 7
    clock.now += 61
    cache.cached(("streaming", 0), hot=True)  # a batch of the one job still streaming
    assert len(cache) == 1 + 1, "idle schedules stayed until something was built"
    clock.now += 120
    assert len(cache) == 1, "with every stream idle, the spare one alone is kept"


def test_the_registry_remembers_a_bounded_number_of_jobs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    lengths = (np.arange(4000, dtype=np.int64) * 37) % 128 + 1
    dataset = SimpleNamespace(lengths=lengths, fingerprint="ds", path=str(tmp_path), num_rows=len(lengths))
    store = EmbeddedStore(tmp_path / "state.db")
    registry = JobRegistry(dataset, CONFIG, store)  # type: ignore[arg-type]
    monkeypatch.setattr(registry, "_known", 3)
    first = registry.open("run-0", 2)
    for i in range(1, 6):
        registry.open(f"run-{i}", 2)
        registry.open("run-1", 2)  # opened again: kept as the most recent
    assert len(registry._jobs) == 3
    assert registry.get("run-0") is None  # forgotten by the server ...
    assert {"run-1", "run-5"} <= set(registry._jobs)
    again = registry.open("run-0", 2)  # ... but not by the store: the same job again
    assert again is not first
    assert (again.fingerprint, again.incarnation) == (first.fingerprint, first.incarnation)
    assert len(registry._jobs) == 3


# ------------------------------------------------------------------ limits on builds for requests


def test_builds_for_requests_are_bounded_per_client_and_per_server() -> None:
    """A client opening new world sizes holds ``per_client`` schedules, all of them ``most``; then refused."""
    clock, log = Clock(), list[Any]()
    cache = ScheduleCache(spare=1, hot_s=60, most=4, per_client=2, clock=clock)
    build = made(log)

    def ask(client: str, key: tuple[str, int]) -> Any:
        with cache.admitting(client):
            return cache.get(key, build(key), hot=True)

    ask("a", ("a", 0))
    ask("a", ("a", 1))
    with pytest.raises(ScheduleLimitError) as mine:
        ask("a", ("a", 2))
    assert (mine.value.kind, mine.value.reason) == ("resource_exhausted", "too_many_schedules_per_client")
    assert "client a already holds 2 schedules" in str(mine.value)
    assert "--max-schedules-per-client) is 2" in str(mine.value)
    assert 0 < mine.value.retry_after <= 60
    assert ask("a", ("a", 0)).key == ("a", 0), "a kept schedule is no build: never refused"
    ask("b", ("b", 0))  # another client is not starved by the first
    ask("c", ("c", 0))
    with pytest.raises(ScheduleLimitError) as full:
        ask("d", ("d", 0))
    assert full.value.reason == "too_many_schedules"
    assert "--max-schedules) is 4" in str(full.value)
    assert ("a", 2) not in log, "a refused build ran"
    assert ("d", 0) not in log, "a refused build ran"
    clock.now += 61  # aged: no longer kept for a trainer to come back to
    ask("d", ("d", 0))
    ask("d", ("d", 1))
    assert len(cache) == 2 + 1, "beyond the recent ones, more than the spare one kept"


def test_what_streams_are_on_is_never_dropped_nor_counted() -> None:
    clock, log = Clock(), list[Any]()
    cache = ScheduleCache(spare=0, hot_s=60, most=2, per_client=2, clock=clock)
    build = made(log)
    with cache.admitting("trainer"):
        streamed = cache.get(("job", 0), build(("job", 0)), hot=True)
    lease = cache.lease("job", 0, "trainer")
    cache.get(("job", 1), build(("job", 1)), hot=True)  # Job.warm: the next epoch, prepared ahead
    for i in range(2):  # the limit is all the others'
        with cache.admitting("other"):
            cache.get(("other", i), build(("other", i)), hot=True)
    clock.now += 3600  # an epoch of an hour, its stream paused on a full window: no use at all
    assert len(cache) == 2, "the epoch a stream is on (and the next) were dropped, or idle ones kept"
    assert cache.cached(("job", 0), hot=False) is streamed
    lease.move(1)  # the stream reached epoch 1: epoch 0 is left behind, idle
    assert len(cache) == 1
    assert not cache.has(("job", 0)), "an epoch every stream moved past is still kept (no spare)"
    assert cache.has(("job", 1))
    lease.release()  # the trainer went: its epoch is kept for it to come back, and counted
    lease.release()  # (twice is once)
    assert cache.has(("job", 1))
    with cache.admitting("trainer"):
        cache.get(("job", 5), build(("job", 5)), hot=True)
    clock.now += 61
    assert len(cache) == 0, "nothing in use, nothing recent, no spare: nothing kept"


def test_a_stream_own_builds_are_never_refused_and_what_is_kept_stays_bounded() -> None:
    """Epochs a stream reaches (outside ``admitting``) are built whatever the limits; ``most`` are kept."""
    clock, log = Clock(), list[Any]()
    cache = ScheduleCache(spare=1, hot_s=60, most=3, per_client=2, clock=clock)
    build = made(log)
    with cache.admitting("a"):
        cache.get(("a", 0), build(("a", 0)), hot=True)
        cache.get(("a", 1), build(("a", 1)), hot=True)
    with cache.admitting("b"):
        cache.get(("b", 0), build(("b", 0)), hot=True)
    leases = [cache.lease("s", 0), cache.lease("t", 0)]
    for epoch in range(1, 30):  # two streams race through short epochs, then end
        for lease in leases:
            cache.get((lease.fingerprint, epoch), build((lease.fingerprint, epoch)), hot=True)
            lease.move(epoch)
    for lease in leases:
        lease.release()
    assert len(log) == 3 + 2 * 29, "a stream's build was refused"
    kept = [key for key in log if cache.has(key)]
    assert len(kept) <= 3 + 1, f"kept {kept}: more than the limit and the spare one"
    assert cache.has(("b", 0)), "the client with the most claimed schedules loses one first"


def test_a_build_in_progress_counts_and_the_others_wait_for_it(monkeypatch: pytest.MonkeyPatch) -> None:
    cache = ScheduleCache(spare=0, most=2, per_client=1)
    release, started = threading.Event(), threading.Event()

    def slow() -> Any:
        started.set()
        release.wait(30)
        return "slow"

    results: dict[str, Any] = {}

    def ask(client: str, key: tuple[str, int], make: Any) -> None:
        with cache.admitting(client):
            try:
                results[f"{client}{key[1]}"] = cache.get(key, make, hot=True)
            except ScheduleLimitError as exc:
                results[f"{client}{key[1]}"] = exc

    first = threading.Thread(target=ask, args=("a", ("a", 0), slow))
    first.start()
    assert started.wait(10)
    ask("a", ("a", 1), lambda: "twice")  # its own build in progress counts against its limit
    assert isinstance(results["a1"], ScheduleLimitError)
    assert results["a1"].reason == "too_many_schedules_per_client"
    ask("b", ("b", 0), lambda: "b")  # 1 building + 1 claimed: the server's limit
    assert results["b0"] == "b"
    monkeypatch.setattr(schedule_cache, "BUILD_WAIT_S", 0.2)
    ask("c", ("c", 0), lambda: "c")
    assert isinstance(results["c0"], ScheduleLimitError), "a build beyond the limit ran"
    assert results["c0"].reason == "too_many_schedules"
    monkeypatch.setattr(schedule_cache, "BUILD_WAIT_S", 30.0)
    waiting = threading.Thread(target=ask, args=("d", ("d", 0), lambda: "d"))
    waiting.start()  # a crowd reconnecting: it waits for the build in progress ...
    time.sleep(0.3)
    assert "d0" not in results, "it neither waited nor was refused"
    lease = cache.lease("a", 0, "a")  # ... which its stream then uses: no longer counted
    release.set()
    first.join(30)
    waiting.join(30)
    assert results["a0"] == "slow"
    assert results["d0"] == "d", results["d0"]
    lease.release()


def test_a_refused_world_size_stores_no_job(tmp_path: Path) -> None:
    lengths = (np.arange(4000, dtype=np.int64) * 37) % 128 + 1
    dataset = SimpleNamespace(lengths=lengths, fingerprint="ds", path=str(tmp_path), num_rows=len(lengths))
    store = EmbeddedStore(tmp_path / "state.db")
    registry = JobRegistry(dataset, CONFIG, store, max_schedules=2, schedules_per_client=1)  # type: ignore[arg-type]
    with registry.schedules.admitting("churner"):
        registry.open("w2", 2)
        with pytest.raises(ScheduleLimitError):
            registry.open("w3", 3)
        registry.open("also-w2", 2)  # its schedule is built: no build, no refusal
    with pytest.raises(JobNotFoundError):
        store.get("w3")
    assert registry.get("w3") is None
    assert store.get("also-w2").spec.world_size == 2
    with registry.schedules.admitting("someone-else"):
        registry.open("w3", 3)


def test_dropped_schedules_give_their_memory_back(monkeypatch: pytest.MonkeyPatch) -> None:
    """glibc keeps freed memory in its arenas (the churn left RSS at its peak): dropping trims it."""
    trims: list[int] = []
    trimmed = threading.Event()

    def trim(pad: int) -> int:
        trims.append(pad)
        trimmed.set()
        return 1

    monkeypatch.setattr(schedule_cache, "_malloc_trim", lambda: trim)
    clock = Clock()
    cache = ScheduleCache(spare=1, hot_s=60, clock=clock)
    cache.get(("a", 0), lambda: np.ones(1 << 20), hot=False)  # type: ignore[arg-type,return-value]
    assert not trimmed.wait(0.2), "trimmed with nothing dropped"
    cache.get(("a", 1), lambda: np.ones(1 << 20), hot=False)  # type: ignore[arg-type,return-value]
    assert trimmed.wait(10), "a schedule was dropped and its memory not given back"
    assert trims[0] == 0


def test_the_limits_on_schedules_are_serve_options() -> None:
    from ladle.service.cli import build_parser, limits_from_args
    from ladle.service.errors import ConfigError
    from ladle.service.limits import Limits

    assert (Limits().max_schedules, Limits().schedules_per_client) == (16, 8)
    args = build_parser().parse_args(
        ["serve", "ds", "--max-schedules", "40", "--max-schedules-per-client", "30"]
    )
    limits = limits_from_args(args)
    assert (limits.max_schedules, limits.schedules_per_client) == (40, 30)
    with pytest.raises(
        ConfigError, match=r"max_schedules_per_client.*at most max_schedules \(4\).*--max-schedules"
    ):
        Limits(max_schedules=4, max_schedules_per_client=5)
    with pytest.raises(ConfigError, match="max_schedules"):
        Limits(max_schedules=0)
