"""``ladle demo``: the whole system on one machine, with no setup.

Makes a sample dataset if none is given (or tokenizes ``--text`` files),
starts ``ladle serve`` with the embedded store (``launch.ServeProcess``), runs
``world_size`` trainer processes that read one epoch through ``BatchClient``
(a progress bar per rank), then checks and prints what they received: every
sample exactly once, steps, tokens/s, padding efficiency, and each bucket's
longest run beside a random shuffle's.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, get_args

import numpy as np

from .launch import ServeProcess, ServerStartError
from .schedule import ScheduleConfig, build_schedule, cut_samples
from .schedule.stats import longest_runs, quality
from .text import Split

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
    dataset: str | None,
    world_size: int,
    config: ScheduleConfig,
    rows: int,
    keep: bool = False,
    text: Sequence[str] = (),
    split: Split = "functions",
) -> int:
    """Run the demo; returns 0 when every check passed.

    With ``text``, the dataset is those files tokenized by ``make_text_dataset``
    (BPE, rows split by ``split``) into the demo's work folder.
    """
    work = Path(tempfile.mkdtemp(prefix="ladle-demo-"))
    try:
        return _serve_and_train(work, dataset, world_size, config, rows, text, split)
    finally:
        if not keep:
            shutil.rmtree(work, ignore_errors=True)


def _serve_and_train(
    work: Path,
    dataset: str | None,
    world_size: int,
    config: ScheduleConfig,
    rows: int,
    text: Sequence[str],
    split: Split,
) -> int:
    if text:
        from .text import make_text_dataset

        dataset = str(work / "text")
        print(f"tokenizing {', '.join(text)} (split into {split}, BPE trained here) into {dataset}")
        made = make_text_dataset(dataset, text, split=split)
        print(
            f"{made.dataset.num_rows:,} rows, {made.dataset.num_tokens:,} tokens from {made.files} files "
            f"({len(made.skipped)} skipped), vocabulary {made.tokenizer.vocab_size}"
        )
    elif dataset is None:
        dataset = "data/sample"
        if not Path(dataset).exists():
            from .synth import make_dataset

            print(f"making a sample dataset: {rows} rows of the production length mix in {dataset}")
            make_dataset(dataset, rows, seed=0)
    from .dataset import open_dataset  # here: `ladle --help` and the other commands need no datasets

    ds = open_dataset(dataset)
    sched = build_schedule(ds.lengths, config, epoch=0, world_size=world_size)
    cut = cut_samples(ds.lengths, config)
    if cut:
        print(f"note: {cut.sentence()}")
    (work / "ladle.toml").write_text(config.to_toml())
    try:
        server = ServeProcess(dataset, work, config=work / "ladle.toml")
    except ServerStartError as exc:
        print(exc, file=sys.stderr)
        print("ladle demo: the server did not start", file=sys.stderr)
        return 1
    with server:
        print(f"server on {server.address}; {world_size} trainers, {sched.num_steps} steps each")
        http = server.http_address
        print(
            f"while the epoch runs (seconds), the page is at http://{http}/ and `ladle inspect --server "
            f"{http}` reads it; to look around at leisure, `ladle serve DATASET` keeps a server up"
        )
        return _run_trainers(server.address, world_size, sched, ds.lengths, config)


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
    parser.add_argument(
        "dataset_path",
        nargs="?",
        metavar="DATASET",
        help="a saved dataset, as ladle plan and serve take it (default: data/sample, made if missing)",
    )
    parser.add_argument(
        "--text",
        nargs="+",
        metavar="PATH",
        default=[],
        help="tokenize these files or folders (BPE trained here) and serve them (bucket bounds: auto)",
    )
    parser.add_argument(
        "--split",
        choices=get_args(Split),
        default="functions",
        help="rows of --text: Python functions/classes, paragraphs or documents (default functions)",
    )
    parser.add_argument("--world-size", type=int, default=4, help="trainer processes (default 4)")
    parser.add_argument("--rows", type=int, default=200_000, help="rows of the sample dataset if made")
    parser.add_argument("--keep", action="store_true", help="keep the server's state and log")
