"""``ladle demo``: the whole system on one machine, with no setup.

Makes a sample dataset if none is given, starts ``ladle serve`` with the
embedded store, runs ``world_size`` trainer processes that read one epoch
through ``BatchClient`` (a progress bar per rank), then checks and prints what
they received: every sample exactly once, steps, tokens/s, padding efficiency,
and each bucket's longest run beside a random shuffle's.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from .dataset import open_dataset
from .schedule import ScheduleConfig, build_schedule
from .schedule.stats import longest_runs, quality

__all__ = ["run_demo"]

_REPORT_EVERY = 25


def _trainer(rank: int, world: int, address: str, job: str, out: Any) -> None:
    """One trainer process: an epoch through BatchClient, progress and results to the parent."""
    from ladle.client import BatchClient

    samples, buckets = [], []
    real = padded = 0
    try:
        with BatchClient(rank, world, address, job, timeout=120) as client:
            for i, batch in enumerate(client, start=1):
                samples.append(np.array(batch.sample_ids))
                buckets.append(batch.bucket)
                real += batch.real_tokens
                padded += batch.padded_tokens
                if i % _REPORT_EVERY == 0:
                    out.put(("progress", rank, i))
        ids = np.concatenate(samples) if samples else np.empty(0, np.int64)
        out.put(("done", rank, len(buckets), ids, np.asarray(buckets), real, padded))
    except BaseException as exc:
        out.put(("error", rank, f"{type(exc).__name__}: {exc}"))


def _bars(done: list[int], total: int, tty: bool, first: bool) -> None:
    lines = []
    for rank, n in enumerate(done):
        width = 40
        filled = int(width * min(n, total) / max(total, 1))
        lines.append(f"rank {rank:>2} [{'#' * filled}{'.' * (width - filled)}] {n:>6}/{total} steps")
    if tty:
        if not first:
            sys.stdout.write(f"\x1b[{len(lines)}A")
        sys.stdout.write("\n".join(lines) + "\n")
    else:
        sys.stdout.write(" | ".join(f"rank {r}: {n}/{total}" for r, n in enumerate(done)) + "\n")
    sys.stdout.flush()


def run_demo(
    dataset: str | None, world_size: int, config: ScheduleConfig, rows: int, keep: bool = False
) -> int:
    """Run the demo; returns 0 when every check passed."""
    if dataset is None:
        dataset = "data/sample"
        if not Path(dataset).exists():
            from .synth import make_dataset

            print(f"making a sample dataset: {rows} rows of the production length mix in {dataset}")
            make_dataset(dataset, rows, seed=0)
    ds = open_dataset(dataset)
    sched = build_schedule(ds.lengths, config, epoch=0, world_size=world_size)
    work = Path(tempfile.mkdtemp(prefix="ladle-demo-"))
    ready = work / "ready"
    cmd = [
        sys.executable, "-m", "ladle.service.cli", "serve", dataset, "--grpc-port", "0",
        "--state", str(work / "state.db"), "--ready-file", str(ready), "--log-level", "WARNING",
        "--config", str(_write_config(work, config)),
    ]  # fmt: skip
    server = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=(work / "server.log").open("wb"))
    try:
        deadline = time.monotonic() + 120
        while not ready.exists():
            if server.poll() is not None or time.monotonic() > deadline:
                print((work / "server.log").read_text(errors="replace")[-2000:], file=sys.stderr)
                print("ladle demo: the server did not start", file=sys.stderr)
                return 1
            time.sleep(0.05)
        address = ready.read_text()
        print(f"server on {address}; {world_size} trainers, {sched.num_steps} steps each")
        return _run_trainers(address, world_size, sched, ds.lengths, config)
    finally:
        server.send_signal(signal.SIGTERM)
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()
        if not keep:
            shutil.rmtree(work, ignore_errors=True)


def _write_config(work: Path, config: ScheduleConfig) -> Path:
    path = work / "ladle.toml"
    lines = ["[schedule]"]
    for key, value in config.model_dump(mode="json").items():
        lines.append(f"{key} = {_toml(value)}")
    path.write_text("\n".join(lines) + "\n")
    return path


def _toml(value: Any) -> str:
    if isinstance(value, str):
        return f'"{value}"'
    if isinstance(value, list):
        return "[" + ", ".join(str(v) for v in value) + "]"
    return str(value)


def _run_trainers(address: str, world: int, sched: Any, lengths: np.ndarray, config: ScheduleConfig) -> int:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    job = f"demo-{os.getpid()}-{int(time.time())}"
    procs = [ctx.Process(target=_trainer, args=(r, world, address, job, out)) for r in range(world)]
    began = time.perf_counter()
    for p in procs:
        p.start()
    done = [0] * world
    results: dict[int, tuple[Any, ...]] = {}
    tty = sys.stdout.isatty()
    _bars(done, sched.num_steps, tty, True)
    last_draw = time.monotonic()
    failed = False
    while len(results) < world and not failed:
        kind, rank, *rest = out.get(timeout=300)
        if kind == "progress":
            done[rank] = rest[0]
        elif kind == "done":
            done[rank] = rest[0]
            results[rank] = tuple(rest)
        else:
            print(f"rank {rank} failed: {rest[0]}", file=sys.stderr)
            failed = True
        if tty or time.monotonic() - last_draw > 2 or len(results) == world:
            _bars(done, sched.num_steps, tty, False)
            last_draw = time.monotonic()
    elapsed = time.perf_counter() - began
    for p in procs:
        p.join(timeout=30)
        if p.is_alive():
            p.kill()
    if failed:
        return 1
    return _summary(results, world, sched, lengths, config, elapsed)


def _summary(
    results: dict[int, tuple[Any, ...]],
    world: int,
    sched: Any,
    lengths: np.ndarray,
    config: ScheduleConfig,
    elapsed: float,
) -> int:
    ids = np.concatenate([results[r][1] for r in range(world)])
    steps = {results[r][0] for r in range(world)}
    real = sum(int(results[r][3]) for r in range(world))
    padded = sum(int(results[r][4]) for r in range(world))
    k = sched.num_buckets
    runs = np.max([longest_runs(results[r][2], k) for r in range(world)], axis=0)
    naive = build_schedule(lengths, config.replace(interleave="random"), epoch=0, world_size=world)
    unique = len(np.unique(ids))
    expected = len(lengths) - len(sched.dropped)
    once = unique == len(ids) == expected
    print()
    print(f"steps per rank        {', '.join(str(s) for s in sorted(steps))} (schedule: {sched.num_steps})")
    print(f"tokens                {real:,} real, {padded:,} padded in {elapsed:.1f}s")
    print(f"throughput            {real / elapsed:,.0f} tokens/s, {len(ids) / elapsed:,.0f} samples/s")
    print(f"padding efficiency    {real / max(padded, 1):.4f}")
    print(f"longest run / bucket  ladle  {' '.join(str(int(x)) for x in runs)}")
    print(f"                      random {' '.join(str(int(x)) for x in quality(naive).max_run)}")
    print(
        f"exactly once          {'OK' if once else 'FAILED'}: {len(ids):,} samples received, "
        f"{unique:,} distinct, {expected:,} expected ({len(sched.dropped)} dropped by policy)"
    )
    return 0 if once and steps == {sched.num_steps} else 1


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--dataset", help="a saved dataset (default: data/sample, made if missing)")
    parser.add_argument("--world-size", type=int, default=4, help="trainer processes (default 4)")
    parser.add_argument("--rows", type=int, default=200_000, help="rows of the sample dataset if made")
    parser.add_argument("--keep", action="store_true", help="keep the server's state and log")
