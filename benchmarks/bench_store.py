"""Cursor-store benchmark: 64 ranks advancing one job at once, beside a raw round trip of the same backend.

Every rank is a thread with its own rank and generation calling ``advance``
with ``step += 1`` (the write a trainer's acknowledgement causes); the threads
are spread over several processes, each with ONE store object shared by its
threads, as a batch server holds one store for all its streams. The baseline
runs in the same harness, the same processes and threads and the same
backend in the same run: a plain ``INCR`` per call for Redis (one round trip,
no script), a one-row ``UPDATE`` transaction for SQLite. The ratio is store
operations per second over baseline operations per second.

``python -m benchmarks.bench_store [--full] [--processes P] [--threads T] [--seconds S]``
(JSON on stdout, a summary on stderr). Processes rather than threads alone:
the Python client's work per call, not Redis, is the limit, and one process
would measure the GIL.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing
import os
import shutil
import sqlite3
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ladle.service.store import CursorStore, EmbeddedStore, JobSpec, Position, RedisCursorStore

JOB = "bench"
SETTINGS: dict[bool, dict[str, Any]] = {
    False: {"processes": 4, "threads": 16, "seconds": 1.5, "rounds": 1},
    True: {"processes": 4, "threads": 16, "seconds": 5.0, "rounds": 3},
}


def _r(x: float, digits: int = 3) -> float:
    return round(float(x), digits)


# --- what one thread does (module level: spawned processes import it) ---------


def _open(kind: str, target: str) -> Any:
    if kind == "redis-store":
        return RedisCursorStore(target)
    if kind == "redis-incr":
        from ladle.service.store.redis import redis_client

        return redis_client(target)
    if kind == "embedded-store":
        return EmbeddedStore(target)
    if kind == "sqlite-update":
        db = sqlite3.connect(target, timeout=10, isolation_level=None, check_same_thread=False)
        db.execute("PRAGMA journal_mode = WAL")
        db.execute("PRAGMA synchronous = NORMAL")
        return (db, threading.Lock())
    raise ValueError(kind)


def _close(kind: str, handle: Any) -> None:
    if kind == "sqlite-update":
        handle[0].close()
    else:
        handle.close()


def _prepare(kind: str, handle: Any, rank: int, world_size: int) -> Callable[[], None]:
    """The call one rank repeats, already made once (connected, script loaded, rank joined)."""
    if kind in ("redis-store", "embedded-store"):
        store: CursorStore = handle
        generation = store.join(JOB, rank, world_size).generation
        step = store.get(JOB).ranks[rank].position.step

        def advance() -> None:
            nonlocal step
            step += 1
            store.advance(JOB, rank, generation, Position(0, step))

        call = advance
    elif kind == "redis-incr":
        key = f"bench:incr:{rank}"

        def incr() -> None:
            handle.incr(key)

        call = incr
    else:
        db, lock = handle

        def update() -> None:
            # What the embedded store's lock and transaction cost, without its checks.
            with lock:
                db.execute("BEGIN IMMEDIATE")
                db.execute("UPDATE counters SET n = n + 1 WHERE id = ?", (rank,))
                db.execute("COMMIT")

        call = update
    call()
    return call


def _process(
    kind: str, target: str, ranks: list[int], world_size: int, seconds: float, ready: Any, go: Any, out: Any
) -> None:
    """One process: a thread per rank, ONE handle shared by them; puts (calls, longest elapsed) on ``out``."""
    handle = _open(kind, target)
    results: list[tuple[int, float]] = []
    errors: list[str] = []
    warm = threading.Barrier(len(ranks) + 1)
    local_go = threading.Event()

    def thread(rank: int) -> None:
        try:
            call = _prepare(kind, handle, rank, world_size)
            warm.wait()
            local_go.wait()
            calls, began = 0, time.perf_counter()
            deadline = began + seconds
            while time.perf_counter() < deadline:
                call()
                calls += 1
            results.append((calls, time.perf_counter() - began))
        except BaseException as exc:
            errors.append(f"rank {rank}: {exc!r}")
            warm.abort()

    pool = [threading.Thread(target=thread, args=(r,)) for r in ranks]
    for t in pool:
        t.start()
    with contextlib.suppress(threading.BrokenBarrierError):  # a thread failed: reported below
        warm.wait()
    ready.put(os.getpid())
    go.wait()
    local_go.set()
    for t in pool:
        t.join()
    _close(kind, handle)
    elapsed = max((e for _, e in results), default=0.0)
    out.put({"calls": sum(c for c, _ in results), "elapsed": elapsed, "errors": errors})


def run_case(kind: str, target: str, processes: int, threads: int, seconds: float) -> dict[str, Any]:
    """``processes`` x ``threads`` ranks calling at once for ``seconds``; calls per second in all."""
    world_size = processes * threads
    ctx = multiprocessing.get_context("spawn")
    ready, out, go = ctx.Queue(), ctx.Queue(), ctx.Event()
    procs = [
        ctx.Process(
            target=_process,
            args=(
                kind,
                target,
                list(range(p * threads, (p + 1) * threads)),
                world_size,
                seconds,
                ready,
                go,
                out,
            ),
        )
        for p in range(processes)
    ]
    for proc in procs:
        proc.start()
    try:
        for _ in procs:
            ready.get(timeout=120)
        go.set()
        got = [out.get(timeout=seconds + 120) for _ in procs]
    finally:
        for proc in procs:
            proc.join(timeout=30)
            if proc.is_alive():
                proc.kill()
    errors = [e for g in got for e in g["errors"]]
    if errors:
        raise RuntimeError(f"{kind}: {errors[:3]}")
    calls = sum(g["calls"] for g in got)
    elapsed = max(g["elapsed"] for g in got)
    return {"calls": calls, "ops_per_s": _r(calls / elapsed, 0)}


def _check_cursors(store: CursorStore, world_size: int, before: int, calls: int) -> None:
    """Every acknowledged advance landed: the ranks' steps grew by exactly the calls made."""
    after = sum(r.position.step for r in store.get(JOB).ranks)
    if after - before != calls:
        raise RuntimeError(
            f"lost updates: steps grew by {after - before}, {calls} advances were acknowledged"
        )


def _pair(
    store_kind: str,
    base_kind: str,
    store: CursorStore,
    store_target: str,
    base_target: str,
    settings: dict[str, Any],
) -> dict[str, Any]:
    world_size = settings["processes"] * settings["threads"]
    args = (settings["processes"], settings["threads"], settings["seconds"])
    store_runs, base_runs = [], []
    for _ in range(settings["rounds"]):  # alternate, so drift (a warming page cache, load) hits both
        base_runs.append(run_case(base_kind, base_target, *args))
        before = sum(r.position.step for r in store.get(JOB).ranks)
        run = run_case(store_kind, store_target, *args)
        # the warm-up call of each rank is an acknowledged advance too
        _check_cursors(store, world_size, before, run["calls"] + world_size)
        store_runs.append(run)
    ops = statistics.median(r["ops_per_s"] for r in store_runs)
    base = statistics.median(r["ops_per_s"] for r in base_runs)
    return {
        f"{store_kind}_ops_per_s": _r(ops, 0),
        f"{base_kind}_ops_per_s": _r(base, 0),
        "ratio": _r(ops / base, 3),
        "runs": {store_kind: store_runs, base_kind: base_runs},
    }


def bench_redis(settings: dict[str, Any]) -> dict[str, Any]:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from tests.support.redis_server import RedisServer, redis_server_available

    if not redis_server_available():
        return {"skipped": "redis-server is not installed"}
    world_size = settings["processes"] * settings["threads"]
    # The recommended durability (deploy/redis.conf): the AOF, fsynced every second, for both cases.
    with (
        RedisServer(appendonly=True, appendfsync="everysec") as server,
        RedisCursorStore(server.url) as store,
    ):
        store.open_job(JobSpec(JOB, "dataset", "config", world_size), reset=True)
        out = _pair("redis-store", "redis-incr", store, server.url, server.url, settings)
        with server.client() as client:
            out["redis_version"] = client.info("server")["redis_version"]
    out["backend"] = "redis-server on loopback, appendonly yes, appendfsync everysec"
    out["target"] = "ratio >= 0.30"
    return out


def bench_embedded(settings: dict[str, Any]) -> dict[str, Any]:
    world_size = settings["processes"] * settings["threads"]
    tmp = Path(tempfile.mkdtemp(prefix="ladle-bench-store-"))
    try:
        path, raw = tmp / "cursors.db", tmp / "raw.db"
        db = sqlite3.connect(raw, isolation_level=None)
        db.execute("PRAGMA journal_mode = WAL")
        db.execute("CREATE TABLE counters (id INTEGER PRIMARY KEY, n INTEGER NOT NULL)")
        db.executemany("INSERT INTO counters VALUES (?, 0)", ((r,) for r in range(world_size)))
        db.close()
        with EmbeddedStore(path) as store:
            store.open_job(JobSpec(JOB, "dataset", "config", world_size))
            out = _pair("embedded-store", "sqlite-update", store, str(path), str(raw), settings)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    out["backend"] = (
        f"SQLite {sqlite3.sqlite_version} file (WAL, synchronous NORMAL) in {tempfile.gettempdir()}"
    )
    return out


def main(full: bool, **overrides: Any) -> dict[str, Any]:
    settings = {**SETTINGS[full], **{k: v for k, v in overrides.items() if v is not None}}
    return {
        "mode": "full" if full else "quick",
        "cpus": os.cpu_count(),
        "ranks": settings["processes"] * settings["threads"],
        "processes": settings["processes"],
        "threads_per_process": settings["threads"],
        "seconds": settings["seconds"],
        "rounds": settings["rounds"],
        "redis": bench_redis(settings),
        "embedded": bench_embedded(settings),
    }


def summary(results: dict[str, Any]) -> list[str]:
    r, e = results["redis"], results["embedded"]
    if "skipped" in r:
        r = {"redis-store_ops_per_s": 0, "redis-incr_ops_per_s": 0, "ratio": r["skipped"]}
    layout = f"{results['ranks']} ranks ({results['processes']} processes x {results['threads_per_process']})"
    return [
        f"store advance, {layout}: redis {r['redis-store_ops_per_s']:,.0f}/s vs INCR "
        f"{r['redis-incr_ops_per_s']:,.0f}/s -> {r['ratio']} (target >= 0.30)",
        f"store advance, {layout}: embedded {e['embedded-store_ops_per_s']:,.0f}/s vs raw SQLite UPDATE "
        f"{e['sqlite-update_ops_per_s']:,.0f}/s -> {e['ratio']}",
    ]


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--full", action="store_true", help="longer runs, three rounds, medians")
    parser.add_argument("--processes", type=int)
    parser.add_argument("--threads", type=int, help="threads (ranks) per process")
    parser.add_argument("--seconds", type=float, help="seconds each measurement runs")
    args = parser.parse_args()
    found = main(args.full, processes=args.processes, threads=args.threads, seconds=args.seconds)
    print(json.dumps(found, indent=2))
    for line in summary(found):
        print(line, file=sys.stderr)
