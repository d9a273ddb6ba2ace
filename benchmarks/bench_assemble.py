"""The Assembler's gather over one epoch of the production schedule, beside two baselines.

The gather is the server's (``Assembler.pieces``), joined into padded arrays
(``benchmarks/padded.py``), as a loader in the trainer would make them. Every
method builds the same padded batches (checked batch by batch on a
sample) from a production-mix dataset written by ``make_dataset``, in the same
process and run, after one untimed pass each (so every method reads warm page
cache). The baselines: the ``datasets`` library's own gather
(``with_format("numpy")[rows]``, then a slice-copy pad), and an index-matrix
gather (``np.take`` with a ``[rows, padded_len]`` index, ``np.where`` for the
padding) from the tokens concatenated into one in-memory array, the setting
most favourable to fancy indexing (no chunk lookup, no page faults).

``python -m benchmarks.bench_assemble [--rows N]`` prints JSON on stdout and
the ratios on stderr. The prefetcher rows measure the hand-off between
threads with no consumer work, then with a consumer that sleeps
``CONSUME_S`` a batch (a stand-in for a network send), serial vs prefetched.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import datasets
import numpy as np
import numpy.typing as npt

from benchmarks.padded import Prefetcher, padded
from ladle.service.assemble import Assembler
from ladle.service.dataset import LOSS_MASK, TOKENS, TokenDataset
from ladle.service.schedule import ScheduleConfig, build_schedule
from ladle.service.synth import make_dataset

I64 = npt.NDArray[np.int64]
Batch = tuple[npt.NDArray[np.int32], npt.NDArray[np.int8]]
Jobs = list[tuple[I64, int]]
PAD_ID = 0
# Batches compared across the three methods before timing.
CHECKED = 200
# A consumer that spends this long per batch without the GIL (as a socket send
# does), to show what the prefetcher overlaps.
CONSUME_S = 200e-6


def hf_gather(path: Path) -> Callable[[I64, int], Batch]:
    """The ``datasets`` gather: one object array of per-row arrays a column, then padding."""
    hf = datasets.load_from_disk(str(path)).with_format("numpy", columns=[TOKENS, LOSS_MASK])

    def gather(rows: I64, padded_len: int) -> Batch:
        got = hf[rows]
        ids = np.empty((len(rows), padded_len), dtype=np.int32)
        mask = np.empty((len(rows), padded_len), dtype=np.int8)
        for i, (toks, bits) in enumerate(zip(got[TOKENS], got[LOSS_MASK], strict=True)):
            n = min(len(toks), padded_len)
            ids[i, :n] = toks[:n]
            ids[i, n:] = PAD_ID
            mask[i, :n] = bits[:n]
            mask[i, n:] = 0
        return ids, mask

    return gather


def take_gather(ds: TokenDataset) -> Callable[[I64, int], Batch]:
    """An index-matrix gather (``np.take``) from the tokens copied into one array."""
    tokens = np.concatenate(
        [np.asarray(c.flatten().to_numpy(), dtype=np.int32) for c in ds.table.column(TOKENS).chunks]
    )
    masks = np.concatenate(
        [np.asarray(c.flatten().to_numpy(), dtype=np.int8) for c in ds.table.column(LOSS_MASK).chunks]
    )
    offsets = np.r_[0, np.cumsum(ds.lengths)]
    last = len(tokens) - 1

    def gather(rows: I64, padded_len: int) -> Batch:
        starts = offsets[rows]
        lengths = offsets[rows + 1] - starts
        column = np.arange(padded_len)
        index = np.minimum(starts[:, None] + column[None, :], last)
        valid = column[None, :] < lengths[:, None]
        ids = np.where(valid, np.take(tokens, index), np.int32(PAD_ID))
        mask = np.where(valid, np.take(masks, index), np.int8(0))
        return ids, mask

    return gather


def assembler_gather(asm: Assembler) -> Callable[[I64, int], None]:
    def gather(rows: I64, padded_len: int) -> None:
        padded(asm, rows, padded_len, PAD_ID)

    return gather


def prefetched(asm: Assembler, jobs: Jobs, workers: int, consume_s: float = 0.0) -> Callable[[], None]:
    def run() -> None:
        work = ((i, rows, padded_len) for i, (rows, padded_len) in enumerate(jobs))
        with Prefetcher(asm, work, depth=4, workers=workers, pad_id=PAD_ID) as prefetch:
            for _ in prefetch:
                if consume_s:
                    time.sleep(consume_s)

    return run


def serial(asm: Assembler, jobs: Jobs, consume_s: float) -> Callable[[], None]:
    def run() -> None:
        for rows, padded_len in jobs:
            padded(asm, rows, padded_len, PAD_ID)
            time.sleep(consume_s)

    return run


def check_same(asm: Assembler, others: dict[str, Callable[[I64, int], Batch]], jobs: Jobs) -> None:
    work = ((i, rows, padded_len) for i, (rows, padded_len) in enumerate(jobs[:CHECKED]))
    with Prefetcher(asm, work, depth=4, workers=2, pad_id=PAD_ID) as prefetch:
        ahead = list(prefetch)
    if [key for key, _ in ahead] != list(range(min(CHECKED, len(jobs)))):
        raise AssertionError("the prefetcher's batches came out of order or went missing")
    for (rows, padded_len), (_, early) in zip(jobs[:CHECKED], ahead, strict=True):
        batch = padded(asm, rows, padded_len, PAD_ID)
        built = {name: gather(rows, padded_len) for name, gather in others.items()}
        built["the prefetcher"] = (early.input_ids, early.loss_mask)
        for name, (ids, mask) in built.items():
            if not (np.array_equal(ids, batch.input_ids) and np.array_equal(mask, batch.loss_mask)):
                raise AssertionError(f"{name} and the assembler built different batches")


def main(rows: int = 50_000, repeat: int = 3) -> dict[str, Any]:
    """Throughput of each method over one epoch (world size 1) of ``rows`` production-mix rows."""
    tmp = Path(tempfile.mkdtemp(prefix="ladle-bench-assemble-"))
    try:
        path = tmp / "ds"
        ds = make_dataset(path, rows, seed=0)
        sched = build_schedule(ds.lengths, ScheduleConfig(), world_size=1)
        jobs: Jobs = [(sched.samples(s, 0), sched.padded_len(s, 0)) for s in range(sched.num_steps)]
        real_tokens = int(sched.batch_real_tokens().sum())
        padded_tokens = sum(len(r) * p for r, p in jobs)

        began = time.perf_counter()
        asm = Assembler(ds)
        build_s = time.perf_counter() - began
        hf, take = hf_gather(path), take_gather(ds)
        check_same(asm, {"datasets gather": hf, "np.take gather": take}, jobs)

        def epoch(gather: Callable[[I64, int], Any]) -> Callable[[], None]:
            def run() -> None:
                for batch_rows, padded_len in jobs:
                    gather(batch_rows, padded_len)

            return run

        methods: dict[str, Callable[[], None]] = {
            "assembler": epoch(assembler_gather(asm)),
            "prefetcher_1_worker": prefetched(asm, jobs, workers=1),
            "prefetcher_2_workers": prefetched(asm, jobs, workers=2),
            "serial_with_consumer": serial(asm, jobs, CONSUME_S),
            "prefetcher_2_workers_with_consumer": prefetched(asm, jobs, workers=2, consume_s=CONSUME_S),
            "datasets_numpy_gather": epoch(hf),
            "np_take_gather": epoch(take),
        }
        times: dict[str, list[float]] = {name: [] for name in methods}
        for run in methods.values():  # warm: page cache, free lists, datasets' caches
            run()
        for _ in range(repeat):  # interleaved, so drift in a noisy machine hits every method
            for name, run in methods.items():
                began = time.perf_counter()
                run()
                times[name].append(time.perf_counter() - began)

        results: dict[str, Any] = {}
        for name, samples in times.items():
            seconds = statistics.median(samples)
            results[name] = {
                "epoch_s": round(seconds, 4),
                "batches_per_s": round(len(jobs) / seconds),
                "real_tokens_per_s_millions": round(real_tokens / seconds / 1e6, 1),
                "padded_tokens_per_s_millions": round(padded_tokens / seconds / 1e6, 1),
            }
        mine = statistics.median(times["assembler"])
        return {
            "rows": rows,
            "tokens": ds.num_tokens,
            "arrow_chunks": ds.table.column(TOKENS).num_chunks,
            "batches": len(jobs),
            "mean_rows_per_batch": round(float(np.mean([len(r) for r, _ in jobs])), 1),
            "padding_efficiency": round(real_tokens / padded_tokens, 3),
            "assembler_build_ms": round(build_s * 1e3, 2),
            "methods": results,
            "ratio_vs_datasets_gather": round(statistics.median(times["datasets_numpy_gather"]) / mine, 1),
            "ratio_vs_np_take_gather": round(statistics.median(times["np_take_gather"]) / mine, 1),
            "consumer_sleep_us": round(CONSUME_S * 1e6),
            "ratio_prefetch_vs_serial_with_consumer": round(
                statistics.median(times["serial_with_consumer"])
                / statistics.median(times["prefetcher_2_workers_with_consumer"]),
                2,
            ),
            "repeat": repeat,
            "wide_columns": wide_columns(tmp, repeat),
        }
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


WIDE_ROWS = 4_000


def wide_columns(tmp: Path, repeat: int = 3) -> dict[str, Any]:
    """``Assembler.frame`` over one epoch of the same rows in other integer types than the wire's.

    int32 ids and an int8 mask are copied as they are. Any other integer
    type (an int64 mask: what ``datasets`` makes of a mask of Python ints;
    uint16 or int64 ids) is converted in the compiled frame; the same int64
    columns through the Python converting path (what a build without the
    extension does), with its range check (a value outside the wire's int32
    or int8 is refused, not wrapped) on and off, are the baseline in the
    same run. A mask derived as batches are made (Hugging Face ``labels``,
    int64, 1 where not -100; no mask column at all) is measured the same way.
    """
    from ladle.service import assemble
    from ladle.service.dataset import open_dataset

    narrow = make_dataset(tmp / "narrow", WIDE_ROWS, seed=1)
    datasets.disable_progress_bars()
    loaded = datasets.load_from_disk(str(tmp / "narrow")).select_columns([TOKENS, LOSS_MASK])

    def typed(name: str, ids: str, mask: str) -> TokenDataset:
        features = datasets.Features(
            {
                TOKENS: datasets.Sequence(datasets.Value(ids)),
                LOSS_MASK: datasets.Sequence(datasets.Value(mask)),
            }
        )
        loaded.cast(features).save_to_disk(str(tmp / name))
        return open_dataset(tmp / name)

    wide_mask = typed("wide_mask", "int32", "int64")  # datasets' default: int32 input_ids
    wide = typed("wide", "int64", "int64")
    short_ids = typed("short_ids", "uint16", "int8")
    byte_mask = typed("byte_mask", "int32", "uint8")
    # labels as a Hugging Face tokenizer pipeline stores them: int64, -100 where the mask is 0
    with_labels = loaded.map(
        lambda batch: {
            "labels": [[t if m else -100 for t, m in zip(ids, mask, strict=True)] for ids, mask in
                       zip(batch[TOKENS], batch[LOSS_MASK], strict=True)]
        },
        batched=True,
        remove_columns=[LOSS_MASK],
    )  # fmt: skip
    with_labels.cast_column("labels", datasets.Sequence(datasets.Value("int64"))).save_to_disk(
        str(tmp / "labels")
    )
    labels = open_dataset(tmp / "labels")
    loaded.select_columns([TOKENS]).save_to_disk(str(tmp / "ids_only"))
    ids_only = open_dataset(tmp / "ids_only")
    sched = build_schedule(narrow.lengths, ScheduleConfig(), world_size=1)
    jobs = [(sched.samples(s, 0), sched.padded_len(s, 0)) for s in range(sched.num_steps)]
    check, build = assemble._Wide.check, assemble._build

    def frames(asm: Assembler, python: bool = False, checked: bool = True) -> Callable[[], None]:
        def run() -> None:
            assemble._Wide.check = check if checked else (lambda self: None)  # type: ignore[method-assign]
            assemble._build = None if python else build
            try:
                for step, (rows, padded_len) in enumerate(jobs):
                    asm.frame(
                        rows, padded_len, epoch=0, step=step, rank=0, bucket=0, schedule_fingerprint="f"
                    )
            finally:
                assemble._Wide.check = check  # type: ignore[method-assign]
                assemble._build = build

        return run

    cases = {
        "int32_int8": frames(Assembler(narrow)),
        "int32_int64_mask": frames(Assembler(wide_mask)),
        "uint16_ids": frames(Assembler(short_ids)),
        "uint8_mask": frames(Assembler(byte_mask)),
        "labels_int64": frames(Assembler(labels)),
        "no_mask_column": frames(Assembler(ids_only)),
        "labels_python": frames(Assembler(labels), python=True),
        "int64_both": frames(Assembler(wide)),
        "int64_python_checked": frames(Assembler(wide), python=True),
        "int64_python_unchecked": frames(Assembler(wide), python=True, checked=False),
    }
    times: dict[str, list[float]] = {name: [] for name in cases}
    for run in cases.values():
        run()
    for _ in range(repeat):
        for name, run in cases.items():
            began = time.process_time()
            run()
            times[name].append(time.process_time() - began)
    us = {name: round(statistics.median(t) / len(jobs) * 1e6, 1) for name, t in times.items()}
    return {
        "rows": WIDE_ROWS,
        "batches": len(jobs),
        "compiled": build is not None,
        "cpu_us_per_batch": us,
        "int64_vs_int32": round(us["int64_both"] / us["int32_int8"], 2),
        "int64_python_vs_compiled": round(us["int64_python_checked"] / us["int64_both"], 2),
        "int64_mask_vs_int8": round(us["int32_int64_mask"] / us["int32_int8"], 2),
        "labels_vs_loss_mask": round(us["labels_int64"] / us["int32_int8"], 2),
        "no_mask_vs_loss_mask": round(us["no_mask_column"] / us["int32_int8"], 2),
        "check_cost": round(us["int64_python_checked"] / us["int64_python_unchecked"], 2),
    }


def summary(result: dict[str, Any]) -> str:
    lines = [
        f"{result['batches']:,} batches ({result['mean_rows_per_batch']} rows, padding efficiency "
        f"{result['padding_efficiency']}) from {result['rows']:,} rows / {result['tokens']:,} tokens "
        f"in {result['arrow_chunks']} Arrow chunks; Assembler built in {result['assembler_build_ms']} ms"
    ]
    for name, figures in result["methods"].items():
        lines.append(
            f"  {name:24} {figures['batches_per_s']:>8,} batches/s  "
            f"{figures['real_tokens_per_s_millions']:>7} M real tokens/s"
        )
    lines.append(
        f"  assembler vs datasets gather {result['ratio_vs_datasets_gather']}x, "
        f"vs np.take gather {result['ratio_vs_np_take_gather']}x; with a "
        f"{result['consumer_sleep_us']} us GIL-free consumer, prefetching is "
        f"{result['ratio_prefetch_vs_serial_with_consumer']}x serial"
    )
    wide = result["wide_columns"]
    us = wide["cpu_us_per_batch"]
    lines.append(
        f"  Assembler.frame, {wide['batches']} batches of {wide['rows']:,} rows, us a batch: int32/int8 "
        f"columns {us['int32_int8']}; converted in C: an int64 mask {us['int32_int64_mask']} "
        f"({wide['int64_mask_vs_int8']}x), uint16 ids {us['uint16_ids']}, a uint8 mask {us['uint8_mask']}, "
        f"int64 both {us['int64_both']} "
        f"({wide['int64_vs_int32']}x); int64 both in Python {us['int64_python_checked']} "
        f"({wide['int64_python_vs_compiled']}x the C conversion), {us['int64_python_unchecked']} without "
        f"the range check"
    )
    lines.append(
        f"  a derived mask, us a batch: from int64 labels {us['labels_int64']} "
        f"({wide['labels_vs_loss_mask']}x an int8 loss_mask), in Python {us['labels_python']}; "
        f"no mask column {us['no_mask_column']} ({wide['no_mask_vs_loss_mask']}x)"
    )
    return "\n".join(lines)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--rows", type=int, default=50_000)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    outcome = main(args.rows, args.repeat)
    print(json.dumps(outcome, indent=2))
    print(summary(outcome), file=sys.stderr)
