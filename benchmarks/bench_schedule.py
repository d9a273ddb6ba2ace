"""Schedule benchmarks: build time and memory, quality on the production mix, auto bounds.

Every figure is printed beside a baseline measured in the same process:
``np.sort`` of the same lengths for the build time, a naive random shuffle for
the quality figures, shuffle-then-pack for padding, the production bounds for
``auto``.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import tracemalloc
from typing import Any

import numpy as np

from ladle.service.schedule import PRODUCTION_BOUNDS, ScheduleConfig, build_schedule
from ladle.service.schedule.stats import quality, simulate_loss
from ladle.service.synth import production_lengths

# The production run's edges (docs/product.md): the case every figure here is measured on.
PRODUCTION = ScheduleConfig(bucket_bounds=PRODUCTION_BOUNDS)


def _median_time(fn: Any, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        began = time.perf_counter()
        fn()
        times.append(time.perf_counter() - began)
    return statistics.median(times)


def _child_peak_rss(code: str) -> float:
    """Peak RSS (MiB) of a fresh interpreter running ``code``."""
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True)
    return float(out.stdout.strip().splitlines()[-1])


_RSS_CODE = """
import numpy as np
from ladle.service.schedule import PRODUCTION_BOUNDS, ScheduleConfig, build_schedule
lengths = np.load({path!r})
{body}
# VmHWM belongs to this process image (ru_maxrss would include the parent's at fork)
print([int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmHWM")][0] / 1024)
"""


def bench_build(rows: int, world_size: int = 8, repeat: int = 3) -> dict[str, Any]:
    lengths = production_lengths(rows, 0)
    config = PRODUCTION
    sort_s = _median_time(lambda: np.sort(lengths), repeat)
    sort64_s = _median_time(lambda: np.sort(lengths.astype(np.int64)), repeat)
    build_s = _median_time(lambda: build_schedule(lengths, config, world_size=world_size), repeat)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "lengths.npy")
        np.save(path, lengths)
        base_rss = _child_peak_rss(_RSS_CODE.format(path=path, body="pass"))
        body = (
            "s = build_schedule(lengths, ScheduleConfig(bucket_bounds=PRODUCTION_BOUNDS), "
            f"world_size={world_size})"
        )
        build_rss = _child_peak_rss(_RSS_CODE.format(path=path, body=body))
    tracemalloc.start()  # what one schedule holds once built (a server keeps a few: ScheduleCache)
    sched = build_schedule(lengths, config, world_size=world_size)
    held, traced_peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    return {
        "rows": rows,
        "world_size": world_size,
        "lengths_dtype": str(lengths.dtype),
        "batches": sched.num_batches,
        "np_sort_s": round(sort_s, 4),
        "np_sort_int64_s": round(sort64_s, 4),
        "build_schedule_s": round(build_s, 4),
        "ratio_vs_np_sort": round(build_s / sort_s, 1),
        "ratio_vs_np_sort_int64": round(build_s / sort64_s, 1),
        "peak_rss_mib": round(build_rss, 1),
        "peak_rss_lengths_only_mib": round(base_rss, 1),
        "schedule_held_mib": round(held / 2**20, 1),
        "schedule_held_bytes_per_row": round(held / rows, 1),
        "build_allocated_peak_mib": round(traced_peak / 2**20, 1),
        "target": "<= 5x np.sort, peak RSS < 1024 MiB",
    }


def _shuffle_then_pack_efficiency(lengths: np.ndarray, config: ScheduleConfig) -> float:
    """The naive packer: shuffle inside each bucket, fill batches in that order."""
    cut = np.minimum(lengths, config.max_seq_len).astype(np.int64)
    edges = np.asarray(PRODUCTION_BOUNDS)
    bucket = np.searchsorted(edges, cut, side="right") - 1
    rng = np.random.default_rng(0)
    real = padded = 0
    for b in range(len(edges) - 1):
        lens = cut[bucket == b]
        rng.shuffle(lens)
        i = 0
        # per-batch loop: a baseline, not ladle's code
        while i < len(lens):
            longest = 0
            j = i
            while j < len(lens):
                cand = max(longest, int(lens[j]))
                if (j - i + 1) * cand > config.token_budget or j - i + 1 > config.max_batch_size:
                    break
                longest = cand
                j += 1
            real += int(lens[i:j].sum())
            padded += (j - i) * longest
            i = j
    return real / padded


def bench_quality(rows: int) -> dict[str, Any]:
    lengths = production_lengths(rows, 0)
    out: dict[str, Any] = {"rows": rows, "cases": []}
    for mode in ("mixed", "sync"):
        for world in (1, 2, 3, 8):
            config = PRODUCTION.replace(rank_mode=mode)
            ours = build_schedule(lengths, config, world_size=world)
            naive = build_schedule(lengths, config.replace(interleave="random"), world_size=world)
            q, qn = quality(ours), quality(naive)
            lo, ln = simulate_loss(ours), simulate_loss(naive)
            out["cases"].append(
                {
                    "rank_mode": mode,
                    "world_size": world,
                    "steps": q.num_steps,
                    "padding_efficiency": q.padding_efficiency,
                    "max_run": q.max_run,
                    "max_run_lower_bound": q.max_run_lower_bound,
                    "max_run_excess": q.max_run_excess,
                    "random_max_run": qn.max_run,
                    "share_dev_ranks": q.share_deviation_ranks,
                    "share_dev_steps": q.share_deviation_steps,
                    "random_share_dev_ranks": qn.share_deviation_ranks,
                    "distinct_per_step_mean": q.distinct_per_step_mean,
                    "loss_std": lo.windowed_std,
                    "random_loss_std": ln.windowed_std,
                    "loss_std_ratio": round(lo.windowed_std / ln.windowed_std, 3)
                    if ln.windowed_std
                    else None,
                    "above_mean_streak": lo.longest_above_mean_streak,
                    "random_above_mean_streak": ln.longest_above_mean_streak,
                }
            )
    sample = lengths[: min(rows, 200_000)]
    config = PRODUCTION
    out["packing"] = {
        "sorted_chunks_efficiency": quality(build_schedule(sample, config)).padding_efficiency,
        "shuffle_then_pack_efficiency": round(_shuffle_then_pack_efficiency(sample, config), 4),
        "sorted_chunks_batches": build_schedule(sample, config).num_batches,
    }
    auto = build_schedule(lengths, config.replace(bucket_bounds="auto"))
    prod = build_schedule(lengths, config)
    out["auto_bounds"] = {
        "bounds": list(auto.bounds),
        "auto_efficiency": quality(auto).padding_efficiency,
        "production_bounds_efficiency": quality(prod).padding_efficiency,
    }
    return out


def main(full: bool) -> dict[str, Any]:
    build_rows = 10_000_000 if full else 1_000_000
    quality_rows = 1_000_000 if full else 200_000
    results = {"build": bench_build(build_rows), "quality": bench_quality(quality_rows)}
    return results


if __name__ == "__main__":
    print(json.dumps(main("--full" in sys.argv), indent=2))
