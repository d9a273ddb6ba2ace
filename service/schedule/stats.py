"""Statistics of a schedule: the per-bucket table and the quality figures.

One module serves ``ladle plan`` now and the HTTP API later, so both show the
same numbers. Everything is computed from the schedule's arrays with numpy.

Definitions used throughout:

* a rank's *stream* is its column of ``sched.buckets``; its *run bound* for a
  bucket with n of its S batches is ``ceil(n / (S - n + 1))``;
* the *step sequence* is the sequence of steps. In ``sync`` mode each step is
  one bucket and runs and shares are counted in steps. In ``mixed`` mode a step
  holds several buckets, so runs are counted per rank only, and the step
  sequence's share deviation is counted in batches after each whole step;
* a *share deviation* is ``max |count_b(first k) - k * n_b / N|`` over every
  prefix k and bucket b.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

from ._seeds import STAGE_LOSS_NOISE, generator
from .interleave import run_lower_bound
from .schedule import Schedule

__all__ = [
    "DEFAULT_LOSS_LEVELS",
    "BucketRow",
    "LossFigures",
    "Quality",
    "bucket_table",
    "longest_runs",
    "loss_figures",
    "loss_levels",
    "quality",
    "simulate_loss",
    "summary",
]

I64 = npt.NDArray[np.int64]
F64 = npt.NDArray[np.float64]

# One loss level per bucket, shortest first: the bands of the original bug.
DEFAULT_LOSS_LEVELS = (0.55, 0.8, 1.1, 1.4, 1.65, 2.2)


@dataclass(frozen=True)
class BucketRow:
    bucket: int
    lo: int
    hi: int
    samples: int
    pct_samples: float
    avg_len: float
    max_len: int
    rows_per_batch: float
    batches: int
    pct_batches: float
    padding_efficiency: float


def bucket_table(sched: Schedule) -> list[BucketRow]:
    """One row per bucket over the batches of this epoch (dropped samples excluded)."""
    k = sched.num_buckets
    buckets = sched.buckets.ravel()
    rows = sched.batch_rows().ravel()
    real = sched.batch_real_tokens().ravel()
    padded = rows * sched.batch_padded_len().ravel()
    longest = _batch_max_len(sched).ravel()
    n_batches = np.bincount(buckets, minlength=k)
    n_rows = np.bincount(buckets, weights=rows, minlength=k)
    n_real = np.bincount(buckets, weights=real, minlength=k)
    n_padded = np.bincount(buckets, weights=padded, minlength=k)
    max_len = np.zeros(k, dtype=np.int64)
    if len(buckets):
        np.maximum.at(max_len, buckets, longest)
    total_rows = max(1.0, float(n_rows.sum()))
    total_batches = max(1, int(n_batches.sum()))
    out = []
    for b in range(k):
        out.append(
            BucketRow(
                bucket=b,
                lo=int(sched.bounds[b]),
                hi=int(sched.bounds[b + 1]),
                samples=int(n_rows[b]),
                pct_samples=round(100.0 * n_rows[b] / total_rows, 2),
                avg_len=round(float(n_real[b] / n_rows[b]), 1) if n_rows[b] else 0.0,
                max_len=int(max_len[b]),
                rows_per_batch=round(float(n_rows[b] / n_batches[b]), 2) if n_batches[b] else 0.0,
                batches=int(n_batches[b]),
                pct_batches=round(100.0 * n_batches[b] / total_batches, 2),
                padding_efficiency=round(float(n_real[b] / n_padded[b]), 4) if n_padded[b] else 0.0,
            )
        )
    return out


def _batch_max_len(sched: Schedule) -> I64:
    packed = sched._packed
    last = packed.start + packed.size - 1
    out: I64 = packed.lengths[last][sched.batch_ids]
    return out


def _runs_by_column(grid: I64, num_buckets: int) -> I64:
    """Longest run per (column, bucket) of a ``[steps, columns]`` grid."""
    steps, cols = grid.shape
    out = np.zeros((cols, num_buckets), dtype=np.int64)
    if steps == 0:
        return out
    seq = grid.T.ravel()
    col = np.repeat(np.arange(cols), steps)
    brk = np.flatnonzero((seq[1:] != seq[:-1]) | (col[1:] != col[:-1])) + 1
    starts = np.r_[0, brk]
    ends = np.r_[brk, len(seq)]
    np.maximum.at(out, (col[starts], seq[starts]), ends - starts)
    return out


def longest_runs(seq: npt.ArrayLike, num_buckets: int) -> I64:
    """Longest run of each bucket in one stream of bucket ids."""
    arr = np.asarray(seq, dtype=np.int64)
    runs: I64 = _runs_by_column(arr.reshape(-1, 1), num_buckets)[0]
    return runs


def _share_deviation(onehot_cum: F64, totals: F64, length: int) -> float:
    """max |cum[k] - (k+1) * total / length| over prefixes (axis 0) and the rest."""
    if length == 0:
        return 0.0
    k = np.arange(1, length + 1, dtype=np.float64).reshape((-1,) + (1,) * (onehot_cum.ndim - 1))
    return float(np.abs(onehot_cum - k * totals / length).max())


def _bound_per_column(counts: I64, length: int) -> I64:
    return np.where(counts > 0, -(-counts // np.maximum(length - counts + 1, 1)), 0)


def _longest_run_and_its_bound(runs: I64, bounds: I64) -> tuple[I64, I64]:
    """Per bucket, the longest run over streams, and the bound of the stream that has it.

    The bound is that stream's own, not the largest over streams, so the two
    figures side by side say whether that stream meets its bound; where
    several streams have the longest run, the smallest of their bounds (the
    largest excess among them).
    """
    longest = runs.max(axis=0)
    holders = runs == longest[None, :]
    return longest, np.where(holders, bounds, np.iinfo(np.int64).max).min(axis=0)


@dataclass(frozen=True)
class Quality:
    num_steps: int
    world_size: int
    optimizer_steps: int
    max_run: list[int]
    max_run_lower_bound: list[int]
    max_run_excess: int
    step_max_run: list[int] | None
    step_max_run_lower_bound: list[int] | None
    share_deviation_ranks: float
    share_deviation_steps: float
    max_share_deviation: float
    distinct_per_step_min: int
    distinct_per_step_mean: float
    distinct_per_window_min: int
    distinct_per_window_mean: float
    distinct_per_window_possible: int
    finish_spread_steps: int
    padding_efficiency: float
    dropped: dict[str, int] = field(default_factory=dict)


def quality(sched: Schedule) -> Quality:
    """The schedule's quality figures (see the module docstring for definitions)."""
    grid = sched.buckets
    steps, world = grid.shape
    k = sched.num_buckets
    onehot = np.zeros((steps, world, k), dtype=np.float64)
    if steps:
        onehot[np.arange(steps)[:, None], np.arange(world)[None, :], grid] = 1.0
    rank_cum = onehot.cumsum(axis=0)
    rank_counts = rank_cum[-1] if steps else np.zeros((world, k))
    share_ranks = _share_deviation(rank_cum, rank_counts, steps)

    runs = _runs_by_column(grid, k)
    bounds = _bound_per_column(rank_counts.astype(np.int64), steps)
    excess = int((runs - bounds).max()) if steps else 0
    step_runs: list[int] | None = None
    step_bounds: list[int] | None = None
    if sched.config.rank_mode == "sync":
        seq = grid[:, :1]
        step_runs = _runs_by_column(seq, k)[0].tolist()
        step_counts = np.bincount(seq[:, 0], minlength=k)
        step_bounds = run_lower_bound(step_counts).tolist()
        excess = max(excess, max(r - b for r, b in zip(step_runs, step_bounds, strict=True)))
        step_cum = onehot[:, 0, :].cumsum(axis=0)
        share_steps = _share_deviation(step_cum, step_cum[-1], steps)
    else:
        step_cum = onehot.sum(axis=1).cumsum(axis=0)
        share_steps = _share_deviation(step_cum, step_cum[-1], steps)  # batches, per whole step

    present = onehot.sum(axis=1) > 0  # [steps, k]
    distinct = present.sum(axis=1)
    accum = sched.config.grad_accum
    n_windows = max(1, steps // accum) if steps else 0
    if steps >= accum:
        win = present[: n_windows * accum].reshape(n_windows, accum, k).any(axis=1).sum(axis=1)
    else:
        win = present.any(axis=0, keepdims=True).sum(axis=1)
    live = int((np.bincount(grid.ravel(), minlength=k) > 0).sum())
    possible = min(live, accum * (1 if sched.config.rank_mode == "sync" else world))

    # How far apart the buckets run out: the spread of each bucket's last step.
    last_step = np.full(k, -1, dtype=np.int64)
    if steps:
        np.maximum.at(last_step, grid.ravel(), np.repeat(np.arange(steps), world))
    used = last_step[last_step >= 0]
    finish_spread = int(used.max() - used.min()) if len(used) else 0

    real = float(sched.batch_real_tokens().sum())
    padded = float((sched.batch_rows() * sched.batch_padded_len()).sum())
    stream_runs, stream_bounds = runs, bounds  # [streams, k]: the ranks, and the step sequence in sync mode
    if step_runs is not None and step_bounds is not None:
        stream_runs = np.vstack([runs, np.asarray(step_runs)[None, :]])
        stream_bounds = np.vstack([bounds, np.asarray(step_bounds)[None, :]])
    run_worst, bound_worst = _longest_run_and_its_bound(stream_runs, stream_bounds)
    return Quality(
        num_steps=steps,
        world_size=world,
        optimizer_steps=steps // accum,
        max_run=run_worst.astype(int).tolist(),
        max_run_lower_bound=bound_worst.astype(int).tolist(),
        max_run_excess=excess,
        step_max_run=step_runs,
        step_max_run_lower_bound=step_bounds,
        share_deviation_ranks=round(share_ranks, 3),
        share_deviation_steps=round(share_steps, 3),
        max_share_deviation=round(max(share_ranks, share_steps), 3),
        distinct_per_step_min=int(distinct.min()) if steps else 0,
        distinct_per_step_mean=round(float(distinct.mean()), 3) if steps else 0.0,
        distinct_per_window_min=int(win.min()) if len(win) else 0,
        distinct_per_window_mean=round(float(win.mean()), 3) if len(win) else 0.0,
        distinct_per_window_possible=possible,
        finish_spread_steps=finish_spread,
        padding_efficiency=round(real / padded, 4) if padded else 0.0,
        dropped=sched.dropped.counts,
    )


@dataclass(frozen=True)
class LossFigures:
    """The loss a monitor would log, simulated from bucket loss levels."""

    windowed_std: float
    longest_above_mean_streak: int
    windows: int


def loss_levels(num_buckets: int) -> F64:
    if num_buckets == len(DEFAULT_LOSS_LEVELS):
        return np.asarray(DEFAULT_LOSS_LEVELS, dtype=np.float64)
    return np.linspace(DEFAULT_LOSS_LEVELS[0], DEFAULT_LOSS_LEVELS[-1], num_buckets)


def simulate_loss(
    sched: Schedule, *, window: int = 2, noise: float = 0.05, levels: npt.ArrayLike | None = None
) -> LossFigures:
    """Each bucket has its own loss level plus noise; average over ranks, then over windows of steps.

    The ladder of the original bug shows as a high std of the windowed loss and
    long streaks of windows above the mean.
    """
    lv = loss_levels(sched.num_buckets) if levels is None else np.asarray(levels, dtype=np.float64)
    rng = generator(sched.config.seed, sched.epoch, STAGE_LOSS_NOISE)
    per_batch = lv[sched.buckets] + rng.normal(0.0, noise, size=sched.buckets.shape)
    return loss_figures(per_batch.mean(axis=1), window=window)


def loss_figures(per_step: npt.ArrayLike, *, window: int = 2) -> LossFigures:
    """The ladder's figures of a logged loss (one value per step, simulated or measured).

    The steps are averaged over consecutive, non-overlapping windows of
    ``window`` steps (a last partial window is left out); the figures are the
    std of those windowed values and the longest streak of windows above
    their mean.
    """
    values = np.asarray(per_step, dtype=np.float64)
    n = len(values) // window
    if n == 0:
        return LossFigures(0.0, 0, 0)
    windowed = values[: n * window].reshape(n, window).mean(axis=1)
    above = windowed > windowed.mean()
    return LossFigures(round(float(windowed.std()), 4), _longest_true_run(above), n)


def _longest_true_run(mask: npt.NDArray[np.bool_]) -> int:
    if not mask.any():
        return 0
    padded = np.r_[False, mask, False].astype(np.int8)
    edges = np.flatnonzero(np.diff(padded))
    return int((edges[1::2] - edges[::2]).max())


def summary(sched: Schedule) -> dict[str, Any]:
    """The machine-readable plan (``ladle plan --json``; the HTTP API uses the same keys)."""
    q = quality(sched)
    return {
        "config_fingerprint": sched.config.fingerprint(),
        "epoch": sched.epoch,
        "world_size": sched.world_size,
        "rank_mode": sched.config.rank_mode,
        "interleave": sched.config.interleave,
        "bucket_bounds": list(sched.bounds),
        "buckets": [asdict(row) for row in bucket_table(sched)],
        "num_steps": q.num_steps,
        "optimizer_steps": q.optimizer_steps,
        "padding_efficiency": q.padding_efficiency,
        "max_run": q.max_run,
        "max_run_lower_bound": q.max_run_lower_bound,
        "max_run_excess": q.max_run_excess,
        "max_share_deviation": q.max_share_deviation,
        "share_deviation": {"ranks": q.share_deviation_ranks, "steps": q.share_deviation_steps},
        "distinct_buckets_per_step": {
            "min": q.distinct_per_step_min,
            "mean": q.distinct_per_step_mean,
        },
        "distinct_buckets_per_window": {
            "window_steps": sched.config.grad_accum,
            "min": q.distinct_per_window_min,
            "mean": q.distinct_per_window_mean,
            "possible": q.distinct_per_window_possible,
        },
        "finish_spread_steps": q.finish_spread_steps,
        "dropped": q.dropped,
        "dropped_total": sum(q.dropped.values()),
    }
