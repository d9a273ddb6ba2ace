"""What a dataset's shard count costs a batch: ``Assembler.frame`` over one epoch, 1 shard vs many.

Before each batch the server stats the data files (a file cut under its
memory mapping would kill it with SIGBUS). It used to stat every file of the
dataset; now only the files that hold the batch's rows. The same rows
(``make_dataset``, production mix at 1/16 scale) are saved once as one shard
and once as ``--shards`` shards, and one epoch of frames is made from each,
in the same process, after an untimed pass (warm page cache). The baseline
beside them: the many-shard dataset with every file checked per batch (what
the server did before), by calling ``check_files()`` before each frame.

``python -m benchmarks.bench_shards [--rows 6000] [--shards 512]`` prints
JSON on stdout and one line on stderr.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import datasets

from ladle.service.assemble import Assembler
from ladle.service.dataset import TokenDataset, open_dataset
from ladle.service.schedule import ScheduleConfig, build_schedule
from ladle.service.synth import make_dataset

CONFIG = ScheduleConfig(
    max_seq_len=512, bucket_bounds=(0, 48, 76, 108, 152, 206, 513), token_budget=3072, max_batch_size=16
)


def _epoch_us(ds: TokenDataset, before: Callable[[], None] | None = None, repeats: int = 3) -> float:
    """Best of ``repeats`` epochs of frames, in microseconds a batch."""
    sched = build_schedule(ds.lengths, CONFIG, epoch=0, world_size=1)
    assembler = Assembler(ds)
    batches = [
        (step, sched.samples(step, 0), int(sched.batch_padded_len()[step, 0]))
        for step in range(sched.num_steps)
    ]
    best = float("inf")
    for attempt in range(repeats + 1):  # the first pass is untimed: page cache warm for every method
        began = time.perf_counter()
        for step, rows, width in batches:
            if before is not None:
                before()
            assembler.frame(rows, width, epoch=0, step=step, rank=0, bucket=0, schedule_fingerprint="f")
        if attempt:
            best = min(best, time.perf_counter() - began)
    return best * 1e6 / len(batches)


def main(rows: int, shards: int) -> dict[str, float | int]:
    root = Path(tempfile.mkdtemp(prefix="ladle-bench-shards-"))
    try:
        make_dataset(root / "one", rows, seed=0, scale=1 / 16)
        datasets.load_from_disk(str(root / "one")).save_to_disk(str(root / "many"), num_shards=shards)
        one, many = open_dataset(root / "one"), open_dataset(root / "many")
        assert len(many.files) == shards
        return {
            "rows": rows,
            "shards": shards,
            "one_shard_us": round(_epoch_us(one), 1),
            "many_shards_us": round(_epoch_us(many), 1),
            "many_shards_every_file_checked_us": round(_epoch_us(many, many.check_files), 1),
        }
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=6000)
    parser.add_argument("--shards", type=int, default=512)
    args = parser.parse_args()
    figures = main(args.rows, args.shards)
    print(json.dumps(figures, indent=2))
    print(
        f"frame a batch: 1 shard {figures['one_shard_us']} us; {args.shards} shards "
        f"{figures['many_shards_us']} us (the files of its rows checked); every file checked per batch "
        f"(before) {figures['many_shards_every_file_checked_us']} us",
        file=sys.stderr,
    )
