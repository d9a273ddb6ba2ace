"""``ladle.ScheduleSampler`` beside transformers' ``LengthGroupedSampler`` (``group_by_length``), same run.

``python -m benchmarks.bench_sampler [--rows N] [--json]``

Both make one epoch of one rank's batches over the same lengths, the
production mix (``synth.production_lengths``) cut at ``max_seq_len``:

* ladle: ``ScheduleSampler(lengths, ScheduleConfig())``: batches of at most
  ``token_budget`` padded tokens, buckets interleaved;
* the baseline: ``LengthGroupedSampler(batch_size=B, lengths=...)`` cut into
  batches of ``B`` rows (what ``Trainer(group_by_length=True)`` does), each
  padded to its longest row; ``B`` is ladle's mean rows per batch, so both
  make about as many batches.

Figures: padding efficiency (real over padded tokens); the share of batches
whose padded tokens exceed the token budget (the batch a GPU sized for the
budget runs out of memory on); the longest run of batches from one bucket
(ladle's bucket edges) over its lower bound (``run_lower_bound``); and tokens
a second delivered by ``DataLoader(num_workers=2)`` with ``pad_collate`` from
an in-memory dataset of those lengths.

``--paths`` (and ``paths()``) times one epoch of a saved production-mix
dataset read three ways by one trainer, in the same run: a ``ladle serve``
process and ``BatchClient``; ``BatchClient(dataset=PATH)`` (the server on a
thread of the trainer's process); and ``DataLoader(num_workers=2)`` over
``ScheduleSampler`` with ``pad_collate`` (no gRPC).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

import numpy as np
import numpy.typing as npt
import torch
from torch.utils.data import DataLoader, Dataset

from ladle.client.sampler import ScheduleSampler, lengths_of, pad_collate
from ladle.service.schedule import ScheduleConfig, resolve_bounds, run_lower_bound
from ladle.service.schedule.stats import longest_runs
from ladle.service.synth import production_lengths

I64 = npt.NDArray[np.int64]


class Tokens(Dataset[dict[str, Any]]):
    """Row i: ``lengths[i]`` token ids, held in one flat array."""

    def __init__(self, lengths: I64) -> None:
        self.offsets = np.concatenate([[0], np.cumsum(lengths)])
        self.flat = np.random.default_rng(0).integers(1, 32000, size=int(self.offsets[-1]), dtype=np.int32)

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def __getitem__(self, i: int) -> dict[str, Any]:
        return {"input_ids": self.flat[self.offsets[i] : self.offsets[i + 1]]}


def figures(
    batches: list[list[int]], lengths: I64, config: ScheduleConfig, bounds: tuple[int, ...]
) -> dict[str, Any]:
    cut = np.minimum(lengths, config.max_seq_len)
    longest = np.array([int(cut[b].max()) for b in batches], dtype=np.int64)
    padded = np.array([len(b) for b in batches], dtype=np.int64) * longest
    real = np.array([int(cut[b].sum()) for b in batches], dtype=np.int64)
    buckets = np.searchsorted(np.asarray(bounds), longest, side="right") - 1
    counts = np.bincount(buckets, minlength=len(bounds) - 1)
    runs, bound = longest_runs(buckets, len(bounds) - 1), run_lower_bound(counts)
    return {
        "batches": len(batches),
        "mean_rows": round(float(np.mean([len(b) for b in batches])), 2),
        "padding_efficiency": round(float(real.sum() / padded.sum()), 4),
        "over_budget": round(float((padded > config.token_budget).mean()), 4),
        "max_padded_tokens": int(padded.max()),
        "longest_run": runs.tolist(),
        "run_lower_bound": bound.tolist(),
        "worst_run_over_bound": int((runs - bound).max()),
    }


def delivered(dataset: Tokens, batches: list[list[int]], repeat: int = 2) -> float:
    """Real tokens a second through ``DataLoader(num_workers=2)`` and ``pad_collate``, best of ``repeat``."""
    best = 0.0
    for _ in range(repeat):
        loader = DataLoader(dataset, batch_sampler=batches, collate_fn=pad_collate(0), num_workers=2)
        began, tokens = time.perf_counter(), 0
        for batch in loader:
            tokens += int(batch["attention_mask"].sum())
        best = max(best, tokens / (time.perf_counter() - began))
    return best


def main(rows: int = 20_000) -> dict[str, Any]:
    from transformers.trainer_pt_utils import LengthGroupedSampler

    config = ScheduleConfig()
    lengths = production_lengths(rows, seed=0).astype(np.int64)
    sampler = ScheduleSampler(lengths, config, rank=0, world_size=1)
    ladle = list(sampler)
    bounds = tuple(int(b) for b in resolve_bounds(lengths, config))
    rows_per_batch = max(1, round(rows / len(ladle)))
    grouped = list(
        LengthGroupedSampler(
            rows_per_batch,
            lengths=np.minimum(lengths, config.max_seq_len).tolist(),
            generator=torch.Generator().manual_seed(0),
        )
    )
    hf = [grouped[i : i + rows_per_batch] for i in range(0, len(grouped), rows_per_batch)]
    dataset = Tokens(np.minimum(lengths, config.max_seq_len))
    result: dict[str, Any] = {
        "rows": rows,
        "token_budget": config.token_budget,
        "bounds": list(bounds),
        "ladle": {
            **figures(ladle, lengths, config, bounds),
            "tokens_per_s": round(delivered(dataset, ladle)),
        },
        "group_by_length": {
            **figures(hf, lengths, config, bounds),
            "batch_size": rows_per_batch,
            "tokens_per_s": round(delivered(dataset, hf)),
        },
    }
    result["delivered_ratio"] = round(
        result["ladle"]["tokens_per_s"] / result["group_by_length"]["tokens_per_s"], 2
    )
    return result


def paths(rows: int = 20_000) -> dict[str, Any]:
    """Batches and real tokens a second of one epoch, one trainer, the three ways (see the module)."""
    import shutil
    import subprocess
    import tempfile
    from pathlib import Path

    import datasets

    from ladle.client import BatchClient
    from ladle.service.synth import make_dataset

    root = Path(tempfile.mkdtemp(prefix="ladle-bench-paths-"))
    server = None
    try:
        make_dataset(root / "ds", rows, seed=1, scale=0.25)
        ready = root / "ready"
        server = subprocess.Popen(
            [str(Path(sys.executable).with_name("ladle")), "serve", str(root / "ds"), "--grpc-port", "0",
             "--no-http", "--state", str(root / "state.db"), "--ready-file", str(ready)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        deadline = time.monotonic() + 120
        while not ready.exists():
            if server.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("ladle serve did not start")
            time.sleep(0.05)
        address = ready.read_text()

        def clients(make: Any) -> tuple[int, int, float]:
            began, batches, tokens = time.perf_counter(), 0, 0
            with make() as client:
                for batch in client:
                    batches += 1
                    tokens += int(batch.lengths.sum())
            return batches, tokens, time.perf_counter() - began

        def loader() -> tuple[int, int, float]:
            ds = datasets.load_from_disk(str(root / "ds")).with_format("numpy")
            sampler = ScheduleSampler(lengths_of(ds), rank=0, world_size=1)
            began, batches, tokens = time.perf_counter(), 0, 0
            for batch in DataLoader(ds, batch_sampler=sampler, collate_fn=sampler.collate(0), num_workers=2):
                batches += 1
                tokens += int(batch["attention_mask"].sum())
            return batches, tokens, time.perf_counter() - began

        cases = {
            "served": lambda: clients(lambda: BatchClient(0, 1, address, "bench-served", timeout=60)),
            "in_process": lambda: clients(lambda: BatchClient(0, 1, job="bench-local", dataset=root / "ds")),
            "dataloader": loader,
        }
        out: dict[str, Any] = {"rows": rows}
        for name, case in cases.items():
            case()  # warm: page cache, imports, the schedule
            batches, tokens, seconds = case()
            out[name] = {"batches": batches, "batches_per_s": round(batches / seconds, 1),
                         "tokens_per_s": round(tokens / seconds)}  # fmt: skip
        return out
    finally:
        if server is not None:
            server.terminate()
            server.wait(timeout=30)
        shutil.rmtree(root, ignore_errors=True)


def summary(result: dict[str, Any]) -> list[str]:
    lines = [
        f"sampler, {result['rows']:,} rows of the production mix, token budget {result['token_budget']:,}:"
    ]
    for name in ("ladle", "group_by_length"):
        f = result[name]
        lines.append(
            f"  {name:16} {f['batches']:>5} batches ({f['mean_rows']} rows), "
            f"padding eff {f['padding_efficiency']}, "
            f"over budget {100 * f['over_budget']:.1f}% (largest {f['max_padded_tokens']:,} tokens), "
            f"longest run - bound {f['worst_run_over_bound']} (runs {f['longest_run']}, bounds "
            f"{f['run_lower_bound']}), DataLoader(num_workers=2) {f['tokens_per_s'] / 1e6:.1f}M tokens/s"
        )
    lines.append(f"  delivered: ladle {result['delivered_ratio']}x group_by_length")
    if "paths" in result:
        p = result["paths"]
        lines.append(
            f"  one trainer, one epoch of {p['rows']:,} rows: "
            + "; ".join(
                f"{name} {p[name]['batches_per_s']:,} batches/s {p[name]['tokens_per_s'] / 1e6:.1f}M tokens/s"
                for name in ("served", "in_process", "dataloader")
            )
        )
    return lines


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--rows", type=int, default=20_000)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--paths", action="store_true", help="also time served, in-process and DataLoader")
    args = parser.parse_args()
    outcome = main(args.rows)
    if args.paths:
        outcome["paths"] = paths(args.rows)
    if args.json:
        print(json.dumps(outcome, indent=2))
    print("\n".join(summary(outcome)), file=sys.stderr)
