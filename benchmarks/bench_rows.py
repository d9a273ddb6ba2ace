"""A hundred million rows: ``ladle serve`` from start to first batch, its memory, and the epoch boundary.

``python -m benchmarks.bench_rows`` (10^6 rows) or ``--full`` (10^8 rows; the
boundary on 10^7), or ``--rows N``; ``--data DIR`` keeps the datasets there
and reuses them (default: a temporary folder, removed at the end).

The dataset is ``ladle make-dataset DIR --rows N --scale 1/1024``: tiny rows
(1 to 12 tokens, 2.5 on average) of the production length mix, so 10^8 rows
are 2.4 GB and every batch holds 64 rows. Each part runs in a process of its
own and is printed beside a baseline measured in the same run:

a. ``open_dataset`` (a fresh process: seconds and peak RSS) beside the least
   a reader of the row lengths does: ``datasets.load_from_disk`` and Arrow's
   ``list_value_length`` of ``input_ids``; both with the files in page cache.
b. the schedule of epoch 0 for ``--world-size`` ranks (64): ``bucket_edges``
   (``auto`` edges, resolved once a server) then ``build_schedule`` with them,
   what a server does for each epoch, with the peak RSS over the lengths alone,
   beside ``np.sort`` of the same lengths as int64 and, as these are a dozen
   values that numpy sorts far faster than spread ones, of as many random
   int64 (the build's own sort is of spread 64-bit keys).
c. ``ladle serve`` as a process (its defaults): seconds from its start to
   ready and to the first batch a ``BatchClient`` (rank 0 of ``--world-size``)
   receives, then that trainer reading on (2 ms a step) until the server has
   built the next epoch's schedule in the background; the server's peak RSS
   (VmHWM) and its anonymous (heap) and file-backed (mapped dataset) parts,
   sampled every 50 ms, and the trainer's ``next()`` meanwhile.
d. the epoch boundary: ``--ranks`` trainer processes (ranks 0.. of
   ``--boundary-world-size``, 8; a rank's epoch is then short enough to cross)
   read all of epoch 0 and into epoch 1, sleeping ``--step-ms`` (1 ms) a step
   so the prefetch window stays full; the longest ``next()`` across the
   boundary (the last and first ``BOUNDARY`` batches of the epochs, and the
   call that ends epoch 0's iteration) beside the median, p99 and max of
   ``next()`` mid-epoch, and beside one build of that schedule (what a
   trainer would wait there if the server built an epoch only when asked).
   On the dataset of (c) unless ``--boundary-rows`` (``--full``: 10^7) names
   another.

Results are JSON on stdout and a short table on stderr. The machine is shared
and noisy: the seconds are the figures to read with care, the ratios and the
memory less so.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from contextlib import contextmanager
from multiprocessing import get_context
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.bench_churn import Peak, cached_schedules
from benchmarks.bench_dataset import _folder_bytes
from ladle.client import BatchClient
from ladle.service.launch import ServeProcess

__all__ = ["main", "run", "summary"]

SCALE = 1 / 1024
# (c): the trainer's step while the next epoch builds, and how long to wait for that build at most.
STEP_C_S = 0.002
BUILD_WAIT_S = 600.0
# (d): batches each side of the boundary that count as "across" it (and are left out of mid-epoch).
BOUNDARY = 16
TIMEOUT_S = 900.0
MIB = 1 << 20
TARGETS = {"first_batch_s": 60.0, "server_rss_gb": 6.0}


def _r(x: float, digits: int = 3) -> float:
    return round(float(x), digits)


# ---------------------------------------------------------------- the dataset


def dataset(data: Path, rows: int, scale: float = SCALE) -> tuple[Path, dict[str, Any]]:
    """``ladle make-dataset`` of ``rows`` rows in ``data`` (reused when it is there), and what it cost."""
    path = data / f"rows-{rows}-scale-{scale:g}-seed-0"
    made: dict[str, Any] = {"rows": rows, "scale": scale, "path": str(path), "reused": path.is_dir()}
    if not path.is_dir():
        cmd = [sys.executable, "-m", "ladle.service.cli", "make-dataset", str(path), "--rows", str(rows)]
        began = time.perf_counter()
        proc = subprocess.Popen([*cmd, "--scale", repr(scale)], stdout=subprocess.DEVNULL)
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
        if proc.returncode:
            raise RuntimeError(f"make-dataset exited with {proc.returncode}")
        made.update(
            make_dataset_s=_r(time.perf_counter() - began, 1), make_peak_rss_mib=usage.ru_maxrss >> 10
        )
    made["gb_on_disk"] = _r(_folder_bytes(path) / 1e9, 2)
    return path, made


# ---------------------------------------------------------------- (a) and (b): fresh processes

_STATUS = """
def status():
    return {l.split(":")[0]: int(l.split()[1]) >> 10 for l in open("/proc/self/status")
            if l.startswith(("VmHWM", "RssAnon", "RssFile"))}
"""

_OPEN = (
    _STATUS
    + """
import json, sys, time
import datasets, pyarrow.compute as pc
from ladle.service.dataset import open_dataset
before = status()
began = time.perf_counter()
if sys.argv[2] == "ladle":
    held = open_dataset(sys.argv[1])
    rows = held.num_rows
else:  # the least a reader of the lengths does
    held = datasets.load_from_disk(sys.argv[1]).data.table
    rows = len(pc.list_value_length(held.column("input_ids")).to_numpy())
took = time.perf_counter() - began
print(json.dumps({"seconds": took, "rows": rows, "before": before, "after": status()}))  # while held
"""
)

_BUILD = (
    _STATUS
    + """
import json, sys, time
import numpy as np
from ladle.service.schedule import ScheduleConfig, bucket_edges, build_schedule
lengths = np.load(sys.argv[1])
config, world_size = ScheduleConfig(), int(sys.argv[2])
before = status()
began = time.perf_counter()
edges = bucket_edges(lengths, config)
edges_s = time.perf_counter() - began
began = time.perf_counter()
sched = build_schedule(lengths, config, epoch=0, world_size=world_size, bounds=edges)
build_s = time.perf_counter() - began
built = status()
steps, batches = sched.num_steps, sched.num_batches
del sched
wide = lengths.astype(np.int64)
began = time.perf_counter()
wide.sort()
sort_s = time.perf_counter() - began
keys = np.random.default_rng(0).integers(0, 2**62, size=len(lengths))  # as spread as the build's sort keys
began = time.perf_counter()
keys.sort()
keys_s = time.perf_counter() - began
print(json.dumps({"edges_s": edges_s, "build_s": build_s, "sort_s": sort_s, "keys_s": keys_s,
                  "steps": steps, "batches": batches, "before": before, "built": built}))
"""
)


def _child(code: str, *args: str) -> dict[str, Any]:
    out = subprocess.run(
        [sys.executable, "-c", code, *args], check=True, capture_output=True, text=True, timeout=TIMEOUT_S
    )
    result: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def _read_through(path: Path) -> None:
    """Read every file of ``path`` once, so both sides of (a) open it from page cache."""
    for f in sorted(path.iterdir()):
        with f.open("rb") as fh:
            while fh.read(64 << 20):
                pass


def bench_open(path: Path) -> dict[str, Any]:
    """(a) ``open_dataset`` beside ``load_from_disk`` + Arrow's list lengths, each in a fresh process."""
    _read_through(path)
    ladle, base = _child(_OPEN, str(path), "ladle"), _child(_OPEN, str(path), "baseline")

    def peak(run: dict[str, Any]) -> dict[str, int]:
        after = run["after"]
        # the peak of the heap: VmHWM less the file pages mapped at the end (they only grow here)
        return {"peak_rss_mib": after["VmHWM"], "peak_anon_mib": after["VmHWM"] - after["RssFile"]}

    return {
        "open_dataset_s": _r(ladle["seconds"], 2),
        **peak(ladle),
        "rss_file_mib": ladle["after"]["RssFile"],
        "baseline_s": _r(base["seconds"], 2),
        "baseline": {**peak(base), "rss_file_mib": base["after"]["RssFile"]},
        "ratio_vs_baseline": _r(ladle["seconds"] / base["seconds"], 2),
        "baseline_is": "datasets.load_from_disk + pyarrow.compute.list_value_length(input_ids).to_numpy()",
    }


def bench_build(lengths: Path, world_size: int) -> dict[str, Any]:
    """(b) the edges and epoch 0's schedule (a fresh process) beside ``np.sort`` of the lengths as int64."""
    got = _child(_BUILD, str(lengths), str(world_size))
    before, built = got["before"], got["built"]
    total = got["edges_s"] + got["build_s"]
    return {
        "world_size": world_size,
        "steps": got["steps"],
        "batches": got["batches"],
        "bucket_edges_s": _r(got["edges_s"], 2),
        "build_schedule_s": _r(got["build_s"], 2),
        "np_sort_int64_s": _r(got["sort_s"], 2),
        "ratio_build_vs_np_sort": _r(got["build_s"] / got["sort_s"], 1),
        "ratio_edges_and_build_vs_np_sort": _r(total / got["sort_s"], 1),
        # the lengths of tiny rows are a dozen values, which numpy sorts far faster than spread ones
        "np_sort_random_int64_s": _r(got["keys_s"], 2),
        "ratio_build_vs_np_sort_random": _r(got["build_s"] / got["keys_s"], 1),
        "peak_rss_mib": built["VmHWM"],
        "lengths_only_rss_mib": before["VmHWM"],
        "peak_over_lengths_mib": built["VmHWM"] - before["VmHWM"],
        "schedule_held_mib": built["RssAnon"] - before["RssAnon"],
    }


# ---------------------------------------------------------------- (c) ladle serve


def _hwm_mib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM"):
            return int(line.split()[1]) >> 10
    return 0


def _waits(ns: list[int]) -> dict[str, Any]:
    if not ns:
        return {"batches": 0}
    a = np.asarray(ns, dtype=np.float64) / 1e6
    return {
        "batches": len(ns),
        "median_ms": _r(np.median(a)),
        "p99_ms": _r(np.percentile(a, 99)),
        "max_ms": _r(a.max()),
    }


@contextmanager
def serving(path: Path, workdir: Path) -> Iterator[tuple[ServeProcess, float]]:
    """``ladle serve`` on ``path`` (its defaults, loopback), and when it was started; stopped at the end."""
    began = time.perf_counter()
    with ServeProcess(path, workdir, timeout=TIMEOUT_S, grace=10) as server:
        yield server, began


def bench_serve(server: ServeProcess, began: float, world_size: int) -> dict[str, Any]:
    """(c) ``ladle serve`` started at ``began``: to ready and the first batch, then the next epoch built."""
    ready_s = time.perf_counter() - began
    peak = Peak(server.proc.pid)
    at_ready = _hwm_mib(server.proc.pid)
    with BatchClient(0, world_size, server.address, "rows", timeout=TIMEOUT_S) as client:
        it = iter(client)
        next(it)
        first_s = time.perf_counter() - began
        at_first = _hwm_mib(server.proc.pid)
        # read on, a step at a time, while the server builds the next epoch's schedule behind
        waits: list[int] = []
        deadline = time.monotonic() + BUILD_WAIT_S
        polled = time.monotonic()
        cached = cached_schedules(server.http_address)
        reading = True
        while cached < 2 and time.monotonic() < deadline:
            if reading:
                took = time.perf_counter_ns()
                # at the end of epoch 0 (a small dataset) it only waits: the boundary is (d)'s to measure
                reading = next(it, None) is not None
                if reading:
                    waits.append(time.perf_counter_ns() - took)
            time.sleep(STEP_C_S)
            if time.monotonic() - polled > 0.1:
                polled = time.monotonic()
                cached = cached_schedules(server.http_address)
        next_built_s = time.perf_counter() - began
    top = peak.stop()
    hwm = _hwm_mib(server.proc.pid)
    problems = [
        line for line in server.log_tail(20000).splitlines() if " ERROR " in line or "Traceback" in line
    ]
    return {
        "world_size": world_size,
        "ready_s": _r(ready_s, 1),
        "first_batch_s": _r(first_s, 1),
        "first_batch_after_ready_s": _r(first_s - ready_s, 1),
        "next_epoch_built_s": _r(next_built_s, 1) if cached >= 2 else None,
        "peak_rss_mib": hwm,
        "peak_rss_at_ready_mib": at_ready,
        "peak_rss_at_first_batch_mib": at_first,
        "peak_anon_mib": top.get("RssAnon", 0) >> 10,
        "peak_file_mib": top.get("RssFile", 0) >> 10,
        "next_while_building": _waits(waits[1:]),  # the first after the first batch refills the window
        "server_log_problems": problems[-5:],
        "rss_note": "VmHWM counts the mapped dataset's pages (RssFile: page cache, shared, reclaimable) "
        "beside the heap (RssAnon); a dataset of tiny rows has its every page touched at open",
    }


# ---------------------------------------------------------------- (d) the epoch boundary


def _read_across(address: str, job: str, rank: int, world_size: int, step_s: float) -> dict[str, Any]:
    """One trainer: every ``next()`` of epoch 0 (the last one ends its iteration) and of epoch 1's first."""
    epoch0: list[int] = []
    epoch1: list[int] = []
    with BatchClient(rank, world_size, address, job, timeout=TIMEOUT_S) as client:
        it = iter(client)
        while True:
            began = time.perf_counter_ns()
            batch = next(it, None)
            epoch0.append(time.perf_counter_ns() - began)
            if batch is None:
                break
            time.sleep(step_s)
        it = iter(client)
        for _ in range(BOUNDARY):
            began = time.perf_counter_ns()
            batch = next(it, None)
            epoch1.append(time.perf_counter_ns() - began)
            if batch is None:
                break
            assert batch.epoch == 1, f"rank {rank}: a batch of epoch {batch.epoch} after epoch 0 ended"
            time.sleep(step_s)
    return {"rank": rank, "epoch0_ns": epoch0, "epoch1_ns": epoch1}


def _build_ms(path: Path, world_size: int) -> float:
    """One build of epoch 1's schedule (edges known), as the server makes it, in this process."""
    from ladle.service.dataset import open_dataset
    from ladle.service.schedule import ScheduleConfig, bucket_edges, build_schedule

    lengths, config = open_dataset(path).lengths, ScheduleConfig()
    edges = bucket_edges(lengths, config)
    began = time.perf_counter()
    build_schedule(lengths, config, epoch=1, world_size=world_size, bounds=edges)
    return (time.perf_counter() - began) * 1e3


def bench_boundary(
    server: ServeProcess, path: Path, world_size: int, ranks: int, step_ms: float, rows: int
) -> dict[str, Any]:
    """(d) ``ranks`` trainer processes across the end of epoch 0 of a job of its own (see the module)."""
    build_ms = _build_ms(path, world_size)
    with ProcessPoolExecutor(ranks, mp_context=get_context("spawn")) as pool:
        futures = [
            pool.submit(_read_across, server.address, "boundary", r, world_size, step_ms / 1e3)
            for r in range(ranks)
        ]
        got = [f.result(timeout=TIMEOUT_S) for f in futures]
    per_rank = []
    mid: list[int] = []
    across: list[int] = []
    for g in got:
        e0, e1 = g["epoch0_ns"], g["epoch1_ns"]
        # the first call opens the stream and fills the window: neither mid-epoch nor the boundary
        mid_part = e0[1 : max(1, len(e0) - BOUNDARY)]
        near = e0[-BOUNDARY:] + e1
        mid += mid_part
        across += near
        per_rank.append(
            {
                "rank": g["rank"],
                "steps": len(e0) - 1,
                "epoch_end_ms": _r(e0[-1] / 1e6),  # the next() that ends epoch 0's iteration
                "epoch1_first_ms": _r(e1[0] / 1e6) if e1 else None,
                "boundary_max_ms": _r(max(near) / 1e6),
            }
        )
    middle = _waits(mid)
    worst = max(across) / 1e6
    return {
        "rows": rows,
        "world_size": world_size,
        "ranks": ranks,
        "step_ms": step_ms,
        "steps_per_rank": per_rank[0]["steps"],
        "boundary_max_ms": _r(worst),
        "mid_epoch": middle,
        "ratio_boundary_vs_mid_p99": _r(worst / middle["p99_ms"], 1) if middle["batches"] else None,
        "one_build_ms": _r(build_ms, 1),
        "ratio_boundary_vs_one_build": _r(worst / build_ms, 3),
        "per_rank": per_rank,
    }


# ---------------------------------------------------------------- driver


@contextmanager
def _folder(data: Path | None) -> Iterator[Path]:
    if data is not None:
        data.mkdir(parents=True, exist_ok=True)
        yield data
        return
    tmp = Path(tempfile.mkdtemp(prefix="ladle-rows-"))
    try:
        yield tmp
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def run(
    rows: int,
    *,
    data: Path | None = None,
    world_size: int = 64,
    boundary_rows: int | None = None,
    boundary_world_size: int = 8,
    ranks: int = 2,
    step_ms: float = 1.0,
) -> dict[str, Any]:
    """Every part on ``rows`` rows (the boundary on ``boundary_rows``, default the same dataset)."""
    from ladle.service.dataset import open_dataset

    with _folder(data) as folder:
        path, made = dataset(folder, rows)
        lengths = path.with_name(path.name + "-lengths.npy")
        if not lengths.exists():
            np.save(lengths, open_dataset(path).lengths)
        results: dict[str, Any] = {"dataset": made}
        wall: dict[str, float] = {}
        began = time.perf_counter()
        results["open"] = bench_open(path)
        wall["open"] = time.perf_counter() - began
        results["build"] = bench_build(lengths, world_size)
        wall["build"] = time.perf_counter() - began - sum(wall.values())
        own = boundary_rows is not None and boundary_rows != rows  # (d) on a dataset of its own
        with tempfile.TemporaryDirectory(prefix="ladle-rows-serve-") as work:
            with serving(path, Path(work) / "serve") as (server, started):
                results["serve"] = bench_serve(server, started, world_size)
                wall["serve"] = time.perf_counter() - began - sum(wall.values())
                if not own:  # a job of its own on the same server
                    results["boundary"] = bench_boundary(
                        server, path, boundary_world_size, ranks, step_ms, rows
                    )
                    results["boundary"]["dataset"] = made
            if own:
                assert boundary_rows is not None
                where, boundary_made = dataset(folder, boundary_rows)
                with serving(where, Path(work) / "boundary") as (server, _):
                    results["boundary"] = bench_boundary(
                        server, where, boundary_world_size, ranks, step_ms, boundary_rows
                    )
                results["boundary"]["dataset"] = boundary_made
            wall["boundary"] = time.perf_counter() - began - sum(wall.values())
        results["wall_s"] = {part: _r(seconds, 1) for part, seconds in wall.items()}
    serve = results["serve"]
    results["targets"] = {
        "first_batch_within_60_s": serve["first_batch_s"] <= TARGETS["first_batch_s"],
        "server_rss_under_6_gb": serve["peak_rss_mib"] < TARGETS["server_rss_gb"] * 1024,
        "server_heap_under_6_gb": serve["peak_anon_mib"] < TARGETS["server_rss_gb"] * 1024,
    }
    return results


def summary(results: dict[str, Any]) -> list[str]:
    made, op, b, s, d = (results[k] for k in ("dataset", "open", "build", "serve", "boundary"))
    made_how = "reused" if made["reused"] else f"made in {made['make_dataset_s']} s"
    base, waits, mid = op["baseline"], s["next_while_building"], d["mid_epoch"]
    return [
        f"{made['rows']:,} rows (scale {made['scale']:g}, {made['gb_on_disk']} GB, {made_how}):",
        f"  (a) open_dataset {op['open_dataset_s']} s, peak RSS {op['peak_rss_mib']:,} MiB "
        f"(heap {op['peak_anon_mib']:,}, mapped {op['rss_file_mib']:,}); load_from_disk + list lengths "
        f"{op['baseline_s']} s ({op['ratio_vs_baseline']}x), {base['peak_rss_mib']:,} MiB",
        f"  (b) W={b['world_size']}: bucket_edges {b['bucket_edges_s']} s + build_schedule "
        f"{b['build_schedule_s']} s; np.sort of the lengths as int64 {b['np_sort_int64_s']} s "
        f"-> {b['ratio_build_vs_np_sort']}x ({b['ratio_edges_and_build_vs_np_sort']}x with the edges), of "
        f"random int64 {b['np_sort_random_int64_s']} s -> {b['ratio_build_vs_np_sort_random']}x; "
        f"peak RSS {b['peak_rss_mib']:,} MiB ({b['lengths_only_rss_mib']:,} for the lengths alone), "
        f"one schedule holds {b['schedule_held_mib']:,} MiB",
        f"  (c) ladle serve W={s['world_size']}: ready {s['ready_s']} s, first batch {s['first_batch_s']} s "
        f"(target 60), next epoch built at {s['next_epoch_built_s']} s; peak RSS {s['peak_rss_mib']:,} MiB "
        f"(heap {s['peak_anon_mib']:,} + mapped dataset {s['peak_file_mib']:,}; target 6 GB); "
        f"next() meanwhile median {waits.get('median_ms')} ms, max {waits.get('max_ms')} ms",
        f"  (d) boundary, {d['rows']:,} rows, W={d['world_size']}, {d['ranks']} ranks x "
        f"{d['steps_per_rank']:,} steps, {d['step_ms']} ms a step: longest next() across it "
        f"{d['boundary_max_ms']} ms; mid-epoch median {mid['median_ms']} ms, p99 {mid['p99_ms']} ms, "
        f"max {mid['max_ms']} ms; one build {d['one_build_ms']} ms",
    ]


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.bench_rows", description=__doc__)
    parser.add_argument("--full", action="store_true", help="10^8 rows, the boundary on 10^7")
    parser.add_argument("--rows", type=int, help="rows of the dataset (default 10^6; --full 10^8)")
    parser.add_argument("--data", type=Path, help="keep the datasets here and reuse them")
    parser.add_argument("--world-size", type=int, default=64)
    parser.add_argument("--boundary-rows", type=int, help="(d) on its own dataset (--full: 10^7)")
    parser.add_argument("--boundary-world-size", type=int, default=8)
    parser.add_argument("--ranks", type=int, default=2, help="(d) trainer processes")
    parser.add_argument("--step-ms", type=float, default=1.0, help="(d) a trainer's step")
    args = parser.parse_args(argv)
    rows = args.rows or (10**8 if args.full else 10**6)
    boundary_rows = args.boundary_rows or (10**7 if args.full else None)
    results = run(
        rows,
        data=args.data,
        world_size=args.world_size,
        boundary_rows=boundary_rows,
        boundary_world_size=args.boundary_world_size,
        ranks=args.ranks,
        step_ms=args.step_ms,
    )
    print(json.dumps(results, indent=2))
    for line in summary(results):
        print(line, file=sys.stderr)
    return results


if __name__ == "__main__":
    main(sys.argv[1:])
