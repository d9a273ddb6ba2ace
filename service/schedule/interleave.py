"""Ordering batches across buckets, epochs and ranks (guarantees 3 and 4).

The single-stream order (``interleave_1d``) is built by peeling buckets from the
smallest to the largest: each larger bucket is merged into the order of the
smaller ones, either in even groups between their items (when it outnumbers
them) or one item per gap (when it does not), where gaps between two equal
neighbours are filled first. The result meets the lower bound on runs for every
bucket (the largest one's runs are ``ceil(n / (N - n + 1))``, every other
bucket never repeats back to back) and keeps each running share within about
one item. Used for one rank, for the step sequence of ``sync`` mode, and as the
reference order elsewhere.

Dealing one interleaved sequence to several ranks round-robin aliases with its
period (an alternating order dealt to two ranks gives each rank one bucket), so
``mixed`` mode builds the whole step-by-rank grid at once (``interleave_grid``):
a smooth weighted round-robin in two dimensions, where every cell picks the
bucket that is furthest behind both in its rank's own stream and in the job as
a whole, without exceeding a bucket's run bound on that rank. It costs a few
microseconds a batch in pure Python, the price of keeping every rank's stream
and every step proportional at the same time.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

try:  # the compiled grid interleaver; optional, same results
    from . import _grid as _grid_c  # type: ignore[attr-defined]
except ImportError:  # pragma: no cover - exercised where no compiler was available
    _grid_c = None

# Scores stay exact in int64 below this many batches (they reach ~4 * total**2).
_C_LIMIT = 1_000_000_000

__all__ = [
    "interleave_1d",
    "interleave_grid",
    "run_lower_bound",
]

IntArray = npt.NDArray[np.int64]


def run_lower_bound(counts: npt.ArrayLike) -> IntArray:
    """The shortest possible longest run per bucket: ``ceil(n / (N - n + 1))`` (0 if n = 0)."""
    c = np.asarray(counts, dtype=np.int64)
    total = int(c.sum())
    bound = -(-c // np.maximum(total - c + 1, 1))
    return np.where(c > 0, bound, 0).astype(np.int64)


def _merge(bucket: int, n: int, others: IntArray) -> IntArray:
    """Merge ``n`` items of ``bucket`` (at least as many as any bucket in ``others``)."""
    m = len(others)
    out = np.full(n + m, bucket, dtype=np.int64)
    if m == 0:
        return out
    if n > m:
        # m + 1 non-empty groups of `bucket`, sizes as even as possible, with
        # every item of `others` alone between two groups.
        edges = (np.arange(m + 2, dtype=np.int64) * n + (m + 1) // 2) // (m + 1)
        edges[0], edges[-1] = 0, n
        pos_others = np.cumsum(np.diff(edges))[:-1] + np.arange(m)
        out[pos_others] = others
        return out
    if n == m:
        out[1::2] = others
        return out
    # n < m: one item of `bucket` in n of the m + 1 gaps of `others`. A gap
    # between two equal neighbours must be filled (only the previous largest
    # bucket can have them, and there are fewer of them than n); the rest of
    # the items are spread evenly over the remaining gaps.
    gaps = np.zeros(m + 1, dtype=bool)
    gaps[1:m] = others[1:] == others[:-1]
    forced = int(gaps.sum())
    if forced > n:  # cannot happen for the peeling order; kept as a guard
        raise AssertionError("interleave: more forced gaps than items")
    free = np.flatnonzero(~gaps)
    extra = n - forced
    if extra:
        pick = (np.arange(extra, dtype=np.int64) * 2 + 1) * len(free) // (2 * extra)
        gaps[free[pick]] = True
    before = np.cumsum(gaps)[:m]
    out[np.arange(m) + before] = others
    return out


def interleave_1d(counts: npt.ArrayLike) -> IntArray:
    """One stream holding ``counts[b]`` items of each bucket ``b``, in interleaved order."""
    c = np.asarray(counts, dtype=np.int64)
    order = np.lexsort((np.arange(len(c)), c))  # smallest count first, ties by bucket id
    seq = np.empty(0, dtype=np.int64)
    for b in order:
        if c[b] > 0:
            seq = _merge(int(b), int(c[b]), seq)
    return seq


def interleave_grid(counts: npt.ArrayLike, world_size: int) -> IntArray:
    """A ``[steps, world_size]`` grid of buckets for ``mixed`` mode.

    ``sum(counts)`` must be a multiple of ``world_size``. Every cell takes the
    bucket with the largest combined lag (behind its share in this rank's
    stream, and behind its share of the whole job so far), skipping a bucket
    that would exceed its run bound on this rank; ranks take turns starting a
    step so no rank is favoured. Runs in C when the extension is built, with
    the same integer arithmetic as the pure Python version.
    """
    c = [int(x) for x in np.asarray(counts, dtype=np.int64)]
    total = sum(c)
    if total % world_size:
        raise ValueError("interleave_grid: total batches must be a multiple of world_size")
    if world_size == 1:
        return interleave_1d(c).reshape(-1, 1)
    if _grid_c is not None and total < _C_LIMIT:
        cells = np.frombuffer(_grid_c.grid(c, world_size), dtype=np.int64)
        return cells.reshape(-1, world_size).copy()
    return _grid_python(c, world_size)


def _grid_python(c: list[int], world_size: int) -> IntArray:
    total = sum(c)
    steps = total // world_size
    nb = len(c)
    live = [b for b in range(nb) if c[b] > 0]
    per_rank = [-(-x // world_size) for x in c]
    cap = [max(1, -(-n // max(1, steps - n + 1))) for n in per_rank]
    # Scores are lags scaled by 2 * total so they are exact integers:
    #   rank lag  (t + 1) * c_b / total - count_rb
    #   job lag   (done * c_b / total - count_b) / 2   (weight 1/2 found best for
    #   both every rank's smoothness and the steps' on the production mix)
    remaining = list(c)
    rank_count = [[0] * nb for _ in range(world_size)]
    job_count = [0] * nb
    last = [-1] * world_size
    run = [0] * world_size
    grid = np.empty((steps, world_size), dtype=np.int64)
    veto = 4 * total * total + 1  # larger than any score difference
    for t in range(steps):
        row = [0] * world_size
        base = t * world_size
        for i in range(world_size):
            r = (i + t) % world_size
            counts_r = rank_count[r]
            last_r = last[r]
            done = base + i + 1
            best = -1
            best_score = 0
            for b in live:
                if remaining[b] == 0:
                    continue
                cb = c[b]
                score = (2 * (t + 1) + done) * cb - (2 * counts_r[b] + job_count[b]) * total
                if b == last_r and run[r] >= cap[b]:
                    score -= veto
                if best < 0 or score > best_score:
                    best_score = score
                    best = b
            remaining[best] -= 1
            counts_r[best] += 1
            job_count[best] += 1
            if best == last_r:
                run[r] += 1
            else:
                last[r] = best
                run[r] = 1
            row[r] = best
        grid[t] = row
    return grid
