"""Scale out: many ranks of one job on ``ladle serve`` replicas that share one redis-server.

For each number of replicas (1, 2 and 4 in the full form) and each number of
ranks (64 and 1,000), one run: a fresh redis-server (AOF, fsync every second,
as deploy/redis.conf), the replicas (real ``ladle serve`` processes on the same
dataset and config, ``--redis-url``), and the ranks: ``BatchClient``s, one
thread each, spread over a few worker processes, every one given the replicas'
list (rank r starts on replica r mod N). Each rank reads two epochs at a set
pace (``--step-ms``, a training step's time) and records what it got.

Checked for every run: each rank's batches are exactly the schedule's
(``build_schedule`` for that epoch and world size), in order, every step of
both epochs, and every row of the dataset reaches one rank once per epoch.

Figures per run, so the 1,000-rank row reads as a ratio of the 64-rank row:
aggregate batches/s; Redis commands per delivered batch and Redis CPU (INFO,
after the replicas started); the store's latency of its scripts (EVALSHA: the
cursor moves, which are nearly all of them) p50/p99 as Redis measures them
(INFO latencystats); the largest lag of a rank behind the leader, in steps, from
the ranks' own clocks; the time until every rank has its first batch (from the
moment all ranks start at once, connecting included); the longest and the
median wait in ``next()``; per replica, peak RSS, threads and file
descriptors (``/proc``) and its CPU per batch served.

Faults (``--fault``): ``kill-replica`` SIGKILLs replica 1 part-way through
(its ranks move to the next replicas and continue; the check above still
holds), ``slow-redis`` blocks Redis with ``DEBUG SLEEP`` for a few seconds
part-way through (the streams go on, the writes wait, nothing is lost).

The ranks (``--client``): ``batchclient`` (the quick form and the faults)
runs a ``BatchClient`` per rank on a thread; ``lean`` (the full form) runs
each rank as an asyncio task that speaks the same protocol as BatchClient
(Open, then an Ack with one credit a batch, a retried Open when the server
did not take the call up) on a connection of its own. A waiting
``BatchClient`` costs about 1 ms of CPU a second (grpcio's synchronous
iterator wakes its reader every 100 ms), nothing to a trainer process but a
core for 1,000 of them on one machine, so the 1,000-rank rows use lean ranks.

On this 2-core development machine the replicas, Redis and every simulated
trainer share the same two cores, so the pace sets the load. ``--full`` runs
1,000 ranks at 5 s a step (200 batches/s asked, about what the machine serves
and reads in all); ``--full --step-ms 1000 --steps-per-epoch 6`` asks for
1,000 batches/s, five times that: the ranks that started first then take the
cores from the Opens of the rest, and the first-batch figure measures the
saturated machine. The batches/s column says what it did.

Run: ``python -m benchmarks.bench_scale`` (quick: 8 and 32 ranks on 2
replicas) or ``--full`` (64 and 1,000 ranks on 1, 2 and 4 replicas); ``--ranks``,
``--replicas``, ``--step-ms``, ``--fault`` choose one case. Results are JSON on
stdout and a table on stderr. Every process started here is stopped in a
``finally``, on 127.0.0.1 only.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import multiprocessing as mp
import os
import pickle
import resource
import shutil
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.bench_soak import process_stats
from ladle.service.dataset import open_dataset
from ladle.service.launch import ServeProcess
from ladle.service.schedule import ScheduleConfig, build_schedule
from ladle.service.synth import make_dataset

__all__ = ["ScaleSettings", "check_records", "main", "run_case", "summary"]

JOB = "scale"
CONFIG = ScheduleConfig(
    max_seq_len=256, bucket_bounds=(0, 32, 64, 128, 257), token_budget=1024, max_batch_size=16
)
SAMPLE_S = 0.25
ROWS_PER_RANK_STEP = 10  # rows a rank's batch holds, about, at this config on the synthetic mix


@dataclass(frozen=True)
class ScaleSettings:
    """One matrix of runs: every ``ranks`` on every ``replicas``."""

    ranks: tuple[int, ...] = (8, 32)
    replicas: tuple[int, ...] = (2,)
    step_ms: float = 200.0
    steps_per_epoch: int = 6  # about: the dataset is sized for it at each rank count
    epochs: int = 2
    workers: int = 4  # processes that hold the ranks' threads
    fault: str = "none"  # none | kill-replica | slow-redis
    fault_at: float = 0.4  # of the expected run time
    slow_redis_s: float = 3.0
    timeout_s: float = 120.0  # each client's timeout (a replica's ranks wait this long for another)
    server_args: tuple[str, ...] = ()  # more ``ladle serve`` flags
    client: str = "batchclient"  # batchclient | lean (asyncio ranks speaking the same protocol)


QUICK = ScaleSettings()
# 1,000 ranks at 5 s a step ask for 200 batches/s, about what this 2-core machine serves with the
# trainers on it; ``--step-ms 1000`` asks for 5x that (the machine saturated: see the module's text)
FULL = ScaleSettings(
    ranks=(64, 1000), replicas=(1, 2, 4), step_ms=5000.0, steps_per_epoch=3, workers=4, client="lean"
)


# ---------------------------------------------------------------- the ranks (worker processes)


def _rank(
    rank: int, world: int, servers: str, settings: ScaleSettings, go: float, out: dict[int, Any]
) -> None:
    from ladle.client import BatchClient

    record: dict[str, Any] = {"batches": [], "error": None, "first": None, "made": None}
    out[rank] = record
    step_s = settings.step_ms / 1000
    try:
        client = BatchClient(rank, world, server=servers, job=JOB, prefetch=2, timeout=settings.timeout_s)
        record["made"] = time.monotonic() - go
        try:
            due = time.monotonic()
            for _ in range(settings.epochs):
                it = iter(client)
                while True:
                    asked = time.monotonic()
                    try:
                        batch = next(it)
                    except StopIteration:
                        break
                    now = time.monotonic()
                    if record["first"] is None:
                        record["first"] = now - go
                        due = now
                    ids = np.array(batch.sample_ids, dtype=np.int64)
                    record["batches"].append((batch.epoch, batch.step, ids, now, now - asked))
                    due += step_s
                    time.sleep(max(0.0, due - time.monotonic()))
        finally:
            client.close()
    except BaseException as exc:
        record["error"] = f"{type(exc).__name__}: {exc}"


async def _lean_rank(
    rank: int, world: int, channel: Any, settings: ScaleSettings, go: float, record: dict[str, Any]
) -> None:
    """One rank as BatchClient speaks to the server (Open, then one Ack with one credit a batch), on
    asyncio: no threads of its own. Its own connection, as a trainer process has."""
    import grpc

    from ladle.proto import codec, rpc
    from ladle.proto import ladle_pb2 as pb

    step_s = settings.step_ms / 1000
    stream = channel.stream_stream(rpc.STREAM_METHOD, request_serializer=pb.StreamRequest.SerializeToString)
    opening = pb.Open(job=JOB, rank=rank, world_size=world, prefetch=2, client_id=f"lean-{rank}")
    try:
        while True:  # as BatchClient: a call the server did not take up (CANCELLED, UNAVAILABLE) is retried
            call = stream()
            await call.write(pb.StreamRequest(open=opening))
            record["made"] = time.monotonic() - go
            try:
                frame = await call.read()
                break
            except grpc.aio.AioRpcError as exc:
                if exc.code() not in (grpc.StatusCode.CANCELLED, grpc.StatusCode.UNAVAILABLE):
                    raise
                record["retries"] = record.get("retries", 0) + 1
                if time.monotonic() - go > settings.timeout_s:
                    raise
                await asyncio.sleep(0.05)
        ended, due = 0, 0.0
        while ended < settings.epochs:
            asked = time.monotonic()
            if frame is None:
                frame = await call.read()
            if frame is grpc.aio.EOF:
                raise RuntimeError(f"the stream ended after {ended} epochs: {await call.code()}")
            item, frame = codec.decode_frame(frame), None
            if isinstance(item, codec.DecodedEpochEnd):
                ended += 1
                continue
            if not isinstance(item, codec.DecodedBatch):
                record["started"] = time.monotonic() - go
                continue  # the stream's start
            now = time.monotonic()
            if record["first"] is None:
                record["first"] = now - go
                due = now
            record["batches"].append((item.epoch, item.step, np.array(item.sample_ids), now, now - asked))
            due += step_s
            await asyncio.sleep(max(0.0, due - time.monotonic()))  # the training step
            through = pb.Position(epoch=item.epoch, step=item.step + 1)
            await call.write(pb.StreamRequest(ack=pb.Ack(through=through, credit=1)))
        await call.done_writing()
        while await call.read() is not grpc.aio.EOF:
            pass
    except BaseException as exc:
        record["error"] = f"{type(exc).__name__} after {time.monotonic() - go:.1f} s: {exc}"


async def _lean_ranks(ranks: list[int], world: int, servers: str, settings: ScaleSettings, go: float) -> Any:
    """The ranks of one process, each on a connection of its own, as trainer processes have; every
    connection stays open until all of them are done (a closed one would end no other's calls)."""
    import grpc

    addresses = servers.split(",")
    own = [("grpc.use_local_subchannel_pool", 1)]
    channels = {r: grpc.aio.insecure_channel(addresses[r % len(addresses)], options=own) for r in ranks}
    out: dict[int, Any] = {r: {"batches": [], "error": None, "first": None, "made": None} for r in ranks}
    try:
        await asyncio.gather(*(_lean_rank(r, world, channels[r], settings, go, out[r]) for r in ranks))
    finally:
        await asyncio.gather(*(c.close() for c in channels.values()))
    return out


def _worker(
    ranks: list[int],
    world: int,
    servers: str,
    settings: ScaleSettings,
    ready: Any,
    go: Any,
    go_at: Any,
    path: str,
) -> None:
    import ladle.client  # noqa: F401 - imported before the start, so the start times connecting only

    ready.put(os.getpid())
    go.wait()
    start = go_at.value
    out: dict[int, Any] = {}
    if settings.client == "lean":
        out = asyncio.run(_lean_ranks(ranks, world, servers, settings, start))
    else:
        threads = [
            threading.Thread(target=_rank, args=(r, world, servers, settings, start, out), daemon=True)
            for r in ranks
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    usage = resource.getrusage(resource.RUSAGE_SELF)
    with open(path, "wb") as f:
        pickle.dump({"ranks": out, "cpu_s": usage.ru_utime + usage.ru_stime}, f)


# ---------------------------------------------------------------- checks


def check_records(records: dict[int, Any], lengths: Any, world: int, epochs: int) -> dict[str, Any]:
    """Every rank's batches against the schedule; raises AssertionError with the first difference."""
    errors = {r: rec["error"] for r, rec in records.items() if rec["error"]}
    assert not errors, f"{len(errors)} ranks failed, e.g. {sorted(errors.items())[:3]}"
    assert sorted(records) == list(range(world)), "ranks missing from the records"
    steps = []
    for epoch in range(epochs):
        sched = build_schedule(lengths, CONFIG, epoch=epoch, world_size=world)
        steps.append(sched.num_steps)
        seen = np.zeros(len(lengths), dtype=np.int64)
        for rank, rec in records.items():
            got = [b for b in rec["batches"] if b[0] == epoch]
            assert [b[1] for b in got] == list(range(sched.num_steps)), (
                f"rank {rank} epoch {epoch}: steps {[b[1] for b in got][:20]}..., "
                f"want 0..{sched.num_steps - 1}"
            )
            for _, step, ids, _, _ in got:
                assert np.array_equal(ids, sched.samples(step, rank)), f"rank {rank} step {step}: other rows"
                np.add.at(seen, ids, 1)
        assert seen.max() == 1, f"epoch {epoch}: a row reached ranks {int(seen.max())} times"
        assert seen.min() == 1, f"epoch {epoch}: {int((seen == 0).sum())} rows reached no rank"
    return {"steps_per_epoch": steps, "batches": sum(len(r["batches"]) for r in records.values())}


def _lag(records: dict[int, Any]) -> int:
    """The most steps any rank was behind the leader at any moment (both from the ranks' clocks)."""
    times = [np.array([b[3] for b in rec["batches"]]) for rec in records.values()]
    marks = np.unique(np.concatenate(times))
    if len(marks) > 4000:
        marks = marks[np.linspace(0, len(marks) - 1, 4000).astype(np.int64)]
    done = np.stack([np.searchsorted(t, marks, side="right") for t in times])  # batches by each mark
    return int((done.max(axis=0) - done.min(axis=0)).max())


# ---------------------------------------------------------------- one run


def _redis_figures(client: Any) -> dict[str, float]:
    cpu = client.info("cpu")
    stats = client.info("stats")
    return {
        "cpu_s": float(cpu["used_cpu_sys"]) + float(cpu["used_cpu_user"]),
        "commands": float(stats["total_commands_processed"]),
    }


def _latency(client: Any) -> dict[str, float]:
    """EVALSHA's p50/p99 (ms) as Redis measured them since the last CONFIG RESETSTAT."""
    stats = client.info("latencystats").get("latency_percentiles_usec_evalsha", {})
    return {"p50_ms": stats.get("p50", math.nan) / 1000, "p99_ms": stats.get("p99", math.nan) / 1000}


def _evalsha_calls(client: Any) -> int:
    return int(client.info("commandstats").get("cmdstat_evalsha", {}).get("calls", 0))


def _cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class _Peaks:
    """Each replica's peak threads, fds and RSS, sampled every SAMPLE_S."""

    def __init__(self, pids: list[int]) -> None:
        self.pids = pids
        self.peaks: list[dict[str, int]] = [{} for _ in pids]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(SAMPLE_S):
            for i, pid in enumerate(self.pids):
                try:
                    stats = process_stats(pid)
                except (OSError, KeyError):
                    continue  # killed on purpose, or gone (a zombie has no VmRSS)
                for key, value in stats.items():
                    self.peaks[i][key] = max(self.peaks[i].get(key, 0), value)

    def stop(self) -> list[dict[str, int]]:
        self._stop.set()
        self._thread.join(timeout=5)
        return self.peaks


def dataset_for(ranks: int, settings: ScaleSettings, folder: Path) -> Path:
    """The synthetic dataset sized for about ``steps_per_epoch`` steps at ``ranks`` (made once)."""
    rows = ranks * settings.steps_per_epoch * ROWS_PER_RANK_STEP
    path = folder / f"rows-{rows}"
    if not path.exists():
        make_dataset(path, rows, seed=7, scale=1 / 16)
    return path


def run_case(
    ranks: int, replicas: int, settings: ScaleSettings, workdir: Path, dataset: Path
) -> dict[str, Any]:
    """One run: ``replicas`` servers on a fresh redis-server, ``ranks`` ranks for ``epochs`` epochs."""
    from tests.support.redis_server import RedisServer

    lengths = open_dataset(dataset).lengths
    per_replica = math.ceil(ranks / max(1, replicas - (settings.fault == "kill-replica")))
    limit = str(max(256, per_replica * 2))  # room for the ranks of a replica that dies
    workdir.mkdir(parents=True, exist_ok=True)
    config = workdir / "ladle.toml"
    config.write_text(CONFIG.to_toml())
    servers: list[ServeProcess] = []
    procs: list[Any] = []
    ctx = mp.get_context("forkserver")
    with RedisServer(appendonly=True, extra_args=("--enable-debug-command", "local")) as redis_server:
        try:
            for i in range(replicas):
                servers.append(
                    ServeProcess(
                        dataset,
                        workdir / f"replica-{i}",
                        config=config,
                        redis_url=redis_server.url,
                        extra=[
                            "--max-sessions",
                            limit,
                            "--max-sessions-per-job",
                            limit,
                            *settings.server_args,
                        ],
                        grace=10,
                    )
                )
            addresses = ",".join(s.address for s in servers)
            pids = [s.proc.pid for s in servers]
            ready, go, go_at = ctx.Queue(), ctx.Event(), ctx.Value("d", 0.0)
            parts = [list(range(w, ranks, settings.workers)) for w in range(min(settings.workers, ranks))]
            outs = [workdir / f"ranks-{w}.pkl" for w in range(len(parts))]
            for part, out in zip(parts, outs, strict=True):
                p = ctx.Process(
                    target=_worker, args=(part, ranks, addresses, settings, ready, go, go_at, str(out))
                )
                p.start()
                procs.append(p)
            for _ in procs:
                ready.get(timeout=120)
            with redis_server.client() as rc:
                rc.config_resetstat()
                before = _redis_figures(rc)
                cpu_before = [_cpu_s(pid) for pid in pids]
                peaks = _Peaks(pids)
                go_at.value = time.monotonic()
                go.set()
                expected_s = 2 + settings.epochs * settings.steps_per_epoch * settings.step_ms / 1000
                fault = _fault(settings, servers, rc, go_at.value + settings.fault_at * expected_s)
                for p in procs:
                    p.join(timeout=settings.timeout_s * 4 + expected_s * 4)
                    if p.is_alive():
                        raise RuntimeError(f"ranks' worker {p.pid} did not finish")
                replica_peaks = peaks.stop()
                if fault is not None:
                    fault.join()
                after = _redis_figures(rc)
                latency = _latency(rc)
                scripts = _evalsha_calls(rc)  # counted from the CONFIG RESETSTAT above
                cpu_after = [
                    _cpu_s(pid) if s.proc.poll() is None else math.nan
                    for pid, s in zip(pids, servers, strict=False)
                ]
        finally:
            for p in procs:
                if p.is_alive():
                    p.kill()
            exits = [s.stop() for s in servers]
    records: dict[int, Any] = {}
    trainers_cpu = 0.0
    for out in outs:
        with out.open("rb") as f:
            part = pickle.load(f)
        records.update(part["ranks"])
        trainers_cpu += part["cpu_s"]
    checked = check_records(records, lengths, ranks, settings.epochs)
    batches = checked["batches"]
    firsts = [rec["first"] for rec in records.values()]
    ends = [rec["batches"][-1][3] for rec in records.values()]
    waits = np.array([b[4] for rec in records.values() for b in rec["batches"]])
    wall = max(ends) - go_at.value
    served_cpu = [a - b for a, b in zip(cpu_after, cpu_before, strict=True)]
    return {
        "ranks": ranks,
        "replicas": replicas,
        "fault": settings.fault,
        "client": settings.client,
        "replica_exits": exits,  # -9: the one the fault killed
        "step_ms": settings.step_ms,
        "steps_per_epoch": checked["steps_per_epoch"],
        "batches": batches,
        "exactly_once": True,
        "wall_s": round(wall, 2),
        "batches_per_s": round(batches / wall, 1),
        "demand_batches_per_s": round(ranks / (settings.step_ms / 1000), 1),
        "redis_commands_per_batch": round((after["commands"] - before["commands"]) / batches, 3),
        "redis_scripts_per_batch": round(scripts / batches, 3),
        "redis_cpu_us_per_batch": round((after["cpu_s"] - before["cpu_s"]) / batches * 1e6, 1),
        "redis_cpu_share": round((after["cpu_s"] - before["cpu_s"]) / wall, 3),
        "evalsha_p50_ms": latency["p50_ms"],
        "evalsha_p99_ms": latency["p99_ms"],
        "max_lag_steps": _lag(records),
        "first_batch_all_s": round(max(firsts), 2),
        "first_batch_median_s": round(float(np.median(firsts)), 2),
        "opens_retried": sum(1 for rec in records.values() if rec.get("retries")),
        "clients_made_all_s": round(max(rec["made"] for rec in records.values()), 2),
        "next_wait_p50_ms": round(float(np.percentile(waits, 50)) * 1000, 2),
        "next_wait_max_ms": round(float(waits.max()) * 1000, 1),
        "replica_rss_mib": [round(p.get("rss", 0) / (1 << 20), 1) for p in replica_peaks],
        "replica_threads": [p.get("threads", 0) for p in replica_peaks],
        "replica_fds": [p.get("fds", 0) for p in replica_peaks],
        "replica_cpu_us_per_batch": round(float(np.nansum(served_cpu)) / batches * 1e6, 1),
        "trainers_cpu_us_per_batch": round(trainers_cpu / batches * 1e6, 1),  # the simulated ranks' processes
    }


def _fault(
    settings: ScaleSettings, servers: list[ServeProcess], rc: Any, at: float
) -> threading.Thread | None:
    if settings.fault == "none":
        return None

    def act() -> None:
        time.sleep(max(0.0, at - time.monotonic()))
        if settings.fault == "kill-replica":
            servers[1 % len(servers)].proc.send_signal(signal.SIGKILL)
        elif settings.fault == "slow-redis":
            rc.execute_command("DEBUG", "SLEEP", str(settings.slow_redis_s))

    if settings.client == "lean":
        raise ValueError("the lean ranks do not fail over: run faults with --client batchclient")
    if settings.fault not in ("kill-replica", "slow-redis"):
        raise ValueError(f"unknown fault {settings.fault!r} (none, kill-replica or slow-redis)")
    thread = threading.Thread(target=act, daemon=True)
    thread.start()
    return thread


# ---------------------------------------------------------------- the matrix


def run(settings: ScaleSettings, folder: Path | None = None) -> dict[str, Any]:
    own = folder is None
    root = Path(tempfile.mkdtemp(prefix="ladle-scale-")) if folder is None else folder
    try:
        cases = []
        for ranks in settings.ranks:
            dataset = dataset_for(ranks, settings, root / "data")
            for replicas in settings.replicas:
                work = root / f"r{ranks}-x{replicas}"
                shutil.rmtree(work, ignore_errors=True)
                case = run_case(ranks, replicas, settings, work, dataset)
                print(_row(case), file=sys.stderr, flush=True)
                cases.append(case)
        return {"settings": asdict(settings), "cases": cases, "growth": growth(cases)}
    finally:
        if own:
            shutil.rmtree(root, ignore_errors=True)


def growth(cases: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per replica count: the largest rank count's figures over the smallest's, beside the rank ratio."""
    out = []
    for replicas in sorted({c["replicas"] for c in cases}):
        mine = sorted((c for c in cases if c["replicas"] == replicas), key=lambda c: c["ranks"])
        if len(mine) < 2:
            continue
        lo, hi = mine[0], mine[-1]

        def ratio(key: str, lo: dict[str, Any] = lo, hi: dict[str, Any] = hi) -> float:
            return round(float(max(hi[key])) / max(1e-9, float(max(lo[key]))), 2)

        out.append(
            {
                "replicas": replicas,
                "ranks_ratio": round(hi["ranks"] / lo["ranks"], 2),
                "rss_ratio": ratio("replica_rss_mib"),
                "threads_ratio": ratio("replica_threads"),
                "fds_ratio": ratio("replica_fds"),
            }
        )
    return out


HEADER = (
    f"{'ranks':>5} {'repl':>4} {'fault':>12} {'batch/s':>8} {'demand':>7} {'redis cmd/b':>11} "
    f"{'redis cpu':>9} {'evalsha p50/p99 ms':>18} {'lag':>4} {'first(all) s':>12} "
    f"{'next max ms':>11} {'rss MiB':>8} {'threads':>7} {'fds':>5}"
)


def _row(c: dict[str, Any]) -> str:
    return (
        f"{c['ranks']:>5} {c['replicas']:>4} {c['fault']:>12} {c['batches_per_s']:>8.0f} "
        f"{c['demand_batches_per_s']:>7.0f} {c['redis_commands_per_batch']:>11.2f} "
        f"{c['redis_cpu_share']:>9.1%} {c['evalsha_p50_ms']:>8.3f}/{c['evalsha_p99_ms']:<9.3f} "
        f"{c['max_lag_steps']:>4} {c['first_batch_all_s']:>12.2f} {c['next_wait_max_ms']:>11.0f} "
        f"{max(c['replica_rss_mib']):>8.0f} {max(c['replica_threads']):>7} {max(c['replica_fds']):>5}"
    )


def summary(results: dict[str, Any]) -> list[str]:
    lines = [HEADER, *(_row(c) for c in results["cases"])]
    for g in results["growth"]:
        lines.append(
            f"{g['replicas']} replica(s): ranks x{g['ranks_ratio']} -> per-replica RSS x{g['rss_ratio']}, "
            f"threads x{g['threads_ratio']}, fds x{g['fds_ratio']}"
        )
    return lines


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.bench_scale", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--full", action="store_true", help="64 and 1,000 ranks on 1, 2 and 4 replicas")
    parser.add_argument("--ranks", type=int, nargs="+", help="rank counts (default: the form's)")
    parser.add_argument("--replicas", type=int, nargs="+", help="replica counts (default: the form's)")
    parser.add_argument("--step-ms", type=float, help="each rank's step time")
    parser.add_argument("--steps-per-epoch", type=int, help="about; the dataset is sized for it")
    parser.add_argument("--workers", type=int, help="processes that hold the ranks")
    parser.add_argument("--fault", choices=("none", "kill-replica", "slow-redis"), default="none")
    parser.add_argument("--client", choices=("batchclient", "lean"), help="what each rank is")
    parser.add_argument("--server-args", help="more ladle serve flags, e.g. '--ack-flush-ms 1000'")
    parser.add_argument("--keep", type=Path, help="make datasets and runs here and keep them")
    args = parser.parse_args(argv)
    settings = FULL if args.full else QUICK
    chosen = {
        "ranks": tuple(args.ranks) if args.ranks else None,
        "replicas": tuple(args.replicas) if args.replicas else None,
        "step_ms": args.step_ms,
        "steps_per_epoch": args.steps_per_epoch,
        "workers": args.workers,
        "fault": args.fault,
        "client": args.client,
        "server_args": tuple(args.server_args.split()) if args.server_args else None,
    }
    settings = replace(settings, **{k: v for k, v in chosen.items() if v is not None})
    print(HEADER, file=sys.stderr, flush=True)
    results = run(settings, args.keep)
    for line in summary(results)[1 + len(results["cases"]) :]:
        print(line, file=sys.stderr)
    return results


if __name__ == "__main__":
    print(json.dumps(main(), indent=2))
