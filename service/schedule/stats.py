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
  prefix k and bucket b;
* *batch-mates* are the rows of one batch. The *batch span ratio* is the median,
  over the epoch's batches of two rows or more, of the batch's row-id span
  (``max - min``) over the span a batch of as many rows drawn at random from the
  dataset's M rows has on average, ``(M + 1)(k - 1)/(k + 1)``: about 1 when
  batch-mates are random rows, near 0 when they are row-id neighbours (or when
  the dataset is stored in length order: rows of like length are then neighbours).
  *Batch-mates meeting again* follows the pairs of batch-mates of a seeded sample
  of the epoch's batches (every batch when they fit ``BATCH_MATES_MAX_BATCHES``
  and ``BATCH_MATES_MAX_ROWS``) into the next epoch: the pairs that share a batch
  there, over the pairs chance puts together. Chance is counted on controls, not
  by a formula: packing sorts rows by length inside chunks, so rows of like
  length share batches far more often than two random rows (about 27x on the
  production mix, and 2x on two alternating lengths), every epoch, by design.
  A control pair has the lengths of a pair of batch-mates (each row replaced by
  another sampled row of its bucket and padded length) but was not one; when
  every epoch draws its batches afresh, batch-mates and controls meet again
  equally often: about 1. Batches that repeat, or rows of equal length kept in
  row order, read far above it.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

from ._seeds import STAGE_BATCH_MATES, STAGE_LOSS_NOISE, generator, random_u64
from .interleave import run_lower_bound
from .schedule import Schedule

__all__ = [
    "BATCH_MATES_MAX_BATCHES",
    "BATCH_MATES_MAX_ROWS",
    "DEFAULT_LOSS_LEVELS",
    "BatchMates",
    "BucketRow",
    "LossFigures",
    "Quality",
    "batch_mates",
    "batch_mates_note",
    "batch_span_ratio",
    "bucket_table",
    "longest_runs",
    "loss_figures",
    "loss_levels",
    "mates_met_again",
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
    """The longest (cut) row of every batch, ``[num_steps, world_size]``.

    Not simply a batch's last row: rows of one padded length are in a random
    order, so under ``pad_to_multiple_of`` the last may be shorter than another.
    """
    out: I64 = sched._packed.per_batch(np.maximum)[sched.batch_ids]
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


# Batch-mates meeting again follows at most this many of an epoch's batches, holding at
# most this many rows, into the next epoch (every batch when they fit), and compares
# them with this many length-matched controls.
BATCH_MATES_MAX_BATCHES = 65_536
BATCH_MATES_MAX_ROWS = 1 << 18
BATCH_MATES_CONTROLS = 4


@dataclass(frozen=True)
class BatchMates:
    """Whether batch-mates are random rows, and drawn afresh every epoch (module docstring).

    ``span_ratio`` is None when no batch has two rows. ``again_vs_chance`` is
    ``met_again / expected_by_chance``: None without the next epoch, or when no
    control pair met (nothing to compare with; the counts still say what the
    pairs did). The counts say how far to trust it: however big an epoch is,
    few of its pairs meet again by chance (about ``(k - 1)**2 / 2`` in all for
    batches of k rows of one length), so a sample of a big dataset may expect
    only a few and the ratio then moves in large steps.
    """

    span_ratio: float | None
    again_vs_chance: float | None = None
    sampled_batches: int = 0
    pairs: int = 0
    met_again: int = 0
    expected_by_chance: float = 0.0


def _by_start(start: npt.ArrayLike, *more: npt.ArrayLike) -> list[I64]:
    """``start`` and the per-batch arrays ``more`` as int64 arrays, in ascending order of start."""
    arrays = [np.asarray(a, dtype=np.int64).ravel() for a in (start, *more)]
    if any(len(a) != len(arrays[0]) for a in arrays):
        raise ValueError("batches: start and size differ in length")
    st = arrays[0]
    if len(st) > 1 and bool((st[1:] < st[:-1]).any()):
        order = np.argsort(st, kind="stable")
        arrays = [a[order] for a in arrays]
    return arrays


def batch_span_ratio(
    rows: npt.ArrayLike, start: npt.ArrayLike, size: npt.ArrayLike, num_rows: int
) -> float | None:
    """The median over batches of two rows or more of ``span / ((num_rows + 1)(k - 1)/(k + 1))``.

    Batch i is ``rows[start[i]:start[i] + size[i]]`` (disjoint slices, any order)
    of k rows, its span ``max - min`` of its row ids; the divisor is the mean
    span of k distinct rows drawn at random from ``range(num_rows)``. None when
    no batch has two rows. One pass of ``reduceat`` over the rows.
    """
    values = np.asarray(rows).ravel()
    st, sz = _by_start(start, size)
    keep = sz >= 2
    st, sz = st[keep], sz[keep]
    if len(st) == 0 or num_rows < 2:
        return None
    end = st + sz
    n = len(values)
    edges = np.empty(2 * len(st), dtype=np.int64)
    edges[0::2] = st
    # a batch reduces over [start, next edge); an edge at the very end is not a valid
    # index, so a batch ending there stops one row short and takes its last row below
    edges[1::2] = np.minimum(end, n - 1)
    hi = np.maximum.reduceat(values, edges)[0::2].astype(np.int64)
    lo = np.minimum.reduceat(values, edges)[0::2].astype(np.int64)
    at_end = end == n
    if at_end.any():
        hi[at_end] = np.maximum(hi[at_end], int(values[-1]))
        lo[at_end] = np.minimum(lo[at_end], int(values[-1]))
    expected = (num_rows + 1.0) * (sz - 1) / (sz + 1)
    return float(np.median((hi - lo) / expected))


def _pairs_together(batch: I64, other: I64) -> int:
    """Pairs of rows with equal ``batch`` and equal ``other >= 0``."""
    both = other >= 0
    batch, other = batch[both], other[both]
    if len(other) < 2:
        return 0
    shared = np.bincount(other)[other] >= 2  # another sampled row is in that batch
    batch, other = batch[shared], other[shared]
    if len(other) < 2:
        return 0
    key = batch * (int(other.max()) + 1) + other
    key.sort()
    cut = np.flatnonzero(key[1:] != key[:-1]) + 1
    counts = np.diff(np.r_[0, cut, len(key)])
    return int((counts * (counts - 1) // 2).sum())


def mates_met_again(
    rows: npt.ArrayLike,
    batch: npt.ArrayLike,
    classes: npt.ArrayLike,
    next_rows: npt.ArrayLike,
    next_start: npt.ArrayLike,
    next_size: npt.ArrayLike,
    num_rows: int,
    *,
    seed: int = 0,
    epoch: int = 0,
    controls: int = BATCH_MATES_CONTROLS,
) -> tuple[int, int, float]:
    """``(pairs, met_again, expected_by_chance)`` of batch-mates in the next epoch.

    ``rows`` (distinct row ids in ``range(num_rows)``) are the rows of some
    batches of one epoch, ``batch`` their batch (non-negative ids) and
    ``classes`` what the schedule tells rows apart by (bucket and padded
    length; non-negative, below 2**31); they hold ``pairs`` pairs of
    batch-mates, and ``met_again`` of those pairs share one of the next epoch's
    batches (``next_rows[next_start[i]:next_start[i] + next_size[i]]``, all of them).

    ``expected_by_chance`` is the same count for controls: each row replaced by
    another sampled row of its class (``controls`` seeded rotations of a random
    order of each class, averaged), so the controls have the lengths of the
    batch-mates without having been batch-mates. When the next epoch's batches
    do not depend on this epoch's, both counts have the same expectation.
    Vectorised: one gather over the next epoch's rows, a few sorts of the sample.
    """
    r = np.asarray(rows, dtype=np.int64).ravel()
    lab = np.asarray(batch, dtype=np.int64).ravel()
    cls = np.asarray(classes, dtype=np.int64).ravel()
    if not len(r) == len(lab) == len(cls):
        raise ValueError("mates_met_again: rows, batch and classes differ in length")
    n = len(r)
    if n < 2:
        return 0, 0, 0.0
    if int(lab.min()) < 0 or int(cls.min()) < 0 or int(cls.max()) >= 2**31:
        raise ValueError("mates_met_again: batch ids must be >= 0 and classes in 0..2**31-1")
    _, sizes = np.unique(lab, return_counts=True)
    pairs = int((sizes * (sizes - 1) // 2).sum())
    nst, nsz = _by_start(next_start, next_size)
    if pairs == 0 or len(nst) == 0:
        return pairs, 0, 0.0

    # the next epoch's batch of every sampled row (-1: in none), joined on the row id
    by_row = np.argsort(r)
    r, lab, cls = r[by_row], lab[by_row], cls[by_row]
    sampled = np.zeros(num_rows, dtype=bool)
    sampled[r] = True
    nvalues = np.asarray(next_rows).ravel()
    hits = np.flatnonzero(sampled[nvalues])
    del sampled
    found = np.searchsorted(nst, hits, side="right") - 1
    inside = found >= 0
    inside[inside] = hits[inside] < nst[found[inside]] + nsz[found[inside]]
    hit_rows = nvalues[hits[inside]].astype(np.int64)
    hit_batch = found[inside]
    order = np.argsort(hit_rows)
    hit_rows, hit_batch = hit_rows[order], hit_batch[order]
    nxt = np.full(n, -1, dtype=np.int64)
    if len(hit_rows):
        at = np.minimum(np.searchsorted(hit_rows, r), len(hit_rows) - 1)
        there = hit_rows[at] == r
        nxt[there] = hit_batch[at[there]]
    met = _pairs_together(lab, nxt)

    # controls: rotate each class's rows, in a seeded random order, by 1..controls places
    u = random_u64(n, seed, epoch, STAGE_BATCH_MATES, 1) >> np.uint64(33)
    order = np.argsort((cls.astype(np.uint64) << np.uint64(31)) | u)
    grouped = cls[order]
    first = np.r_[0, np.flatnonzero(grouped[1:] != grouped[:-1]) + 1]
    counts = np.diff(np.r_[first, n])
    g_start = np.repeat(first, counts)
    g_size = np.repeat(counts, counts)
    offset = np.arange(n) - g_start
    total = 0
    for shift in range(1, controls + 1):
        control = np.empty(n, dtype=np.int64)
        control[order] = nxt[order[g_start + (offset + shift) % g_size]]
        total += _pairs_together(lab, control)
    return pairs, met, total / max(controls, 1)


def _scheduled(sched: Schedule) -> I64:
    """The packed batches the schedule serves, ascending (each once)."""
    served = np.zeros(sched._packed.num_batches, dtype=bool)
    served[sched.batch_ids.ravel()] = True
    out: I64 = np.flatnonzero(served)
    return out


def _sample_batches(sched: Schedule, ids: I64) -> I64:
    """A seeded sample of ``ids`` within the caps (all of them when they fit), in drawn order."""
    sizes = sched._packed.size[ids]
    if len(ids) <= BATCH_MATES_MAX_BATCHES and int(sizes.sum()) <= BATCH_MATES_MAX_ROWS:
        return ids
    draws = random_u64(2 * BATCH_MATES_MAX_BATCHES, sched.config.seed, sched.epoch, STAGE_BATCH_MATES)
    picks = (draws % np.uint64(len(ids))).astype(np.int64)
    _, first = np.unique(picks, return_index=True)
    picks = picks[np.sort(first)][:BATCH_MATES_MAX_BATCHES]  # distinct, in drawn order
    keep = max(1, int(np.searchsorted(np.cumsum(sizes[picks]), BATCH_MATES_MAX_ROWS, side="right")))
    out: I64 = ids[picks[:keep]]
    return out


def batch_mates(sched: Schedule, next_epoch: Schedule | None = None) -> BatchMates:
    """The batch-mates figures of ``sched``: the span always, meeting again with ``next_epoch``.

    ``next_epoch`` is the schedule of the epoch after (same dataset, config and
    world); the sample of batches is keyed by the config's seed and the epoch.
    """
    packed = sched._packed
    ids = _scheduled(sched)
    span = batch_span_ratio(packed.rows, packed.start[ids], packed.size[ids], sched.num_rows)
    span_ratio = None if span is None else round(span, 4)
    if next_epoch is None or len(ids) == 0:
        return BatchMates(span_ratio)
    chosen = _sample_batches(sched, ids)
    start, size = packed.start[chosen], packed.size[chosen]
    at = np.repeat(start - np.r_[0, np.cumsum(size)[:-1]], size) + np.arange(int(size.sum()))
    pad = sched.config.pad_to_multiple_of
    classes = np.repeat(packed.bucket[chosen], size) * (sched.config.max_seq_len + 1) + (
        -(-packed.lengths(at).astype(np.int64) // pad)
    )
    nxt = next_epoch._packed
    nids = _scheduled(next_epoch)
    pairs, met, expected = mates_met_again(
        packed.rows[at],
        np.repeat(np.arange(len(chosen)), size),
        classes,
        nxt.rows,
        nxt.start[nids],
        nxt.size[nids],
        max(sched.num_rows, next_epoch.num_rows),
        seed=sched.config.seed,
        epoch=sched.epoch,
    )
    again = round(met / expected, 4) if expected > 0 else None
    return BatchMates(span_ratio, again, len(chosen), pairs, met, round(expected, 3))


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
    # batch-mates (``BatchMates``); defaults, so a server's older document still reads
    batch_span_ratio: float | None = None
    batch_mates_again: float | None = None
    batch_mates_sampled_batches: int = 0
    batch_mates_pairs: int = 0
    batch_mates_met_again: int = 0
    batch_mates_expected_by_chance: float = 0.0
    dropped: dict[str, int] = field(default_factory=dict)


def quality(sched: Schedule, next_epoch: Schedule | None = None) -> Quality:
    """The schedule's quality figures (see the module docstring for definitions).

    ``next_epoch``, the schedule of the epoch after, gives the batch-mates that
    meet again (``batch_mates_again``); without it that figure is None.
    """
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
    mates = batch_mates(sched, next_epoch)
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
        batch_span_ratio=mates.span_ratio,
        batch_mates_again=mates.again_vs_chance,
        batch_mates_sampled_batches=mates.sampled_batches,
        batch_mates_pairs=mates.pairs,
        batch_mates_met_again=mates.met_again,
        batch_mates_expected_by_chance=mates.expected_by_chance,
        dropped=sched.dropped.counts,
    )


def batch_mates_note(q: Quality) -> str:
    """What the batch-mates figures mean, with the counts behind the second (``ladle plan``, the page)."""
    note = (
        "batch-mates (the rows of one batch), 1x = as random: the median batch's row-id span over a "
        "random batch's (near 0: row-id neighbours)"
    )
    if q.batch_mates_sampled_batches == 0:
        return note + "; meeting again needs the next epoch"
    return note + (
        f"; the pairs of batch-mates that share a batch again next epoch ({q.batch_mates_met_again:,} "
        f"of {q.batch_mates_pairs:,} in {q.batch_mates_sampled_batches:,} sampled batches) over the "
        "pairs of rows of the same lengths that were not batch-mates and do "
        f"({q.batch_mates_expected_by_chance:,.1f})"
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


def summary(sched: Schedule, next_epoch: Schedule | None = None) -> dict[str, Any]:
    """The machine-readable plan (``ladle plan --json``; the HTTP API uses the same keys).

    ``next_epoch``: the schedule of the epoch after, for the batch-mates that meet again.
    """
    q = quality(sched, next_epoch)
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
        "batch_mates": {
            "span_ratio": q.batch_span_ratio,
            "again_vs_chance": q.batch_mates_again,
            "sampled_batches": q.batch_mates_sampled_batches,
            "pairs": q.batch_mates_pairs,
            "met_again": q.batch_mates_met_again,
            "expected_by_chance": q.batch_mates_expected_by_chance,
        },
        "dropped": q.dropped,
        "dropped_total": sum(q.dropped.values()),
    }
