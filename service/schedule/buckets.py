"""Assigning samples to length buckets, and choosing bucket edges automatically.

Assignment is one table look-up per sample (a bucket id for every possible
length), so it costs a gather, not a binary search. ``auto_bounds`` finds the K
edges that minimise the tokens padded when every sample is padded to the
longest length of its bucket, by dynamic programming over at most
``MAX_CANDIDATES`` candidate edges taken from the sorted length histogram.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

__all__ = ["MAX_CANDIDATES", "assign_buckets", "auto_bounds", "quantile_bounds"]

MAX_CANDIDATES = 512
# Lengths are counted this many at a time: bincount casts its input to intp, a copy of each block
# instead of one of all the lengths (800 MB for 10^8).
_COUNT_BLOCK = 1 << 22


def assign_buckets(lengths: npt.NDArray[np.integer], bounds: tuple[int, ...]) -> npt.NDArray[np.int8]:
    """Bucket id of every length (lengths already within ``[bounds[0], bounds[-1])``)."""
    edges = np.asarray(bounds, dtype=np.int64)
    every = np.arange(int(edges[-1]), dtype=np.int64)
    table: npt.NDArray[np.int8] = (np.searchsorted(edges, every, side="right") - 1).astype(np.int8)
    out: npt.NDArray[np.int8] = np.take(table, lengths)
    return out


def _histogram(lengths: npt.NDArray[np.integer], minlength: int) -> npt.NDArray[np.int64]:
    """``np.bincount(lengths, minlength=minlength)``, counted a block at a time."""
    size = max(minlength, int(lengths.max()) + 1 if lengths.size else 0)
    hist = np.zeros(size, dtype=np.int64)
    for first in range(0, len(lengths), _COUNT_BLOCK):
        part = np.bincount(lengths[first : first + _COUNT_BLOCK], minlength=size)
        hist += part
    return hist


def _round_up(values: npt.NDArray[np.int64], multiple: int) -> npt.NDArray[np.int64]:
    return -(-values // multiple) * multiple


def auto_bounds(
    lengths: npt.NDArray[np.integer],
    num_buckets: int,
    max_seq_len: int,
    pad_to_multiple_of: int = 1,
    *,
    token_budget: int | None = None,
    max_batch_size: int | None = None,
    objective: str = "sorted_chunks",
) -> tuple[int, ...]:
    """Edges ``(0, e1, ..., max_seq_len + 1)`` minimising expected padded tokens.

    ``objective="pad_to_max"``: every sample padded to the longest length of its
    bucket (the classic model). ``objective="sorted_chunks"`` (default) models
    ladle's packer: rows are sorted inside random chunks of a fixed size, so a
    chunk spans its whole bucket and the padding of a sample of length x is
    proportional to the bucket's share of rows times the rows a batch holds at
    x, integrated over the bucket: cost = P(bucket) * sum_x rows_per_batch(x).
    Lengths are expected already cut to ``max_seq_len``. Fewer buckets come out
    when there are fewer distinct lengths than ``num_buckets``.
    """
    hist = _histogram(np.asarray(lengths), max_seq_len + 1)
    values = np.flatnonzero(hist)
    if len(values) == 0:
        return (0, max_seq_len + 1)
    counts = hist[values]
    sums = counts * values
    if len(values) > MAX_CANDIDATES:
        # Keep the candidate edges where the cumulative count crosses evenly
        # spaced quantiles, and always the largest length.
        cum = np.cumsum(counts)
        marks = np.searchsorted(cum, np.linspace(0, cum[-1], MAX_CANDIDATES + 1)[1:], side="left")
        keep = np.unique(np.r_[marks, len(values) - 1])
        counts = np.diff(np.r_[0, cum[keep]])
        sums = np.diff(np.r_[0, np.cumsum(sums)[keep]])
        values = values[keep]
    v = len(values)
    cum_n = np.r_[0, np.cumsum(counts)].astype(np.float64)
    i = np.arange(v + 1)[:, None]
    j = np.arange(v + 1)[None, :]
    if objective == "pad_to_max":
        cum_s = np.r_[0, np.cumsum(sums)].astype(np.float64)
        top = _round_up(values.astype(np.int64), pad_to_multiple_of)[np.maximum(j - 1, 0)]
        cost = (cum_n[j] - cum_n[i]) * top - (cum_s[j] - cum_s[i])
    elif objective == "sorted_chunks":
        budget = token_budget or max_seq_len
        rows_cap = max_batch_size or budget
        every = np.arange(max_seq_len + 2, dtype=np.int64)
        rows_at = np.minimum(rows_cap, budget // np.maximum(_round_up(every, pad_to_multiple_of), 1))
        cum_rows = np.r_[0, np.cumsum(rows_at)].astype(np.float64)
        # bucket of candidates i..j-1 spans lengths (values[i-1], values[j-1]]
        lo = np.r_[0, values + 1]
        hi = np.r_[0, values + 1]
        width_rows = cum_rows[hi[j]] - cum_rows[lo[i]]
        cost = (cum_n[j] - cum_n[i]) * width_rows
    else:
        raise ValueError(f"unknown objective {objective!r}")
    cost = np.where(i < j, cost, np.inf)
    k_max = min(num_buckets, v)
    best = np.full(v + 1, np.inf)
    best[0] = 0.0
    choice = np.zeros((k_max + 1, v + 1), dtype=np.int64)
    for k in range(1, k_max + 1):
        total = best[:, None] + cost
        choice[k] = np.argmin(total, axis=0)
        best = total[choice[k], np.arange(v + 1)]
    edges = [max_seq_len + 1]
    jj = v
    for k in range(k_max, 0, -1):
        ii = int(choice[k, jj])
        if ii > 0:
            edges.append(int(values[ii - 1]) + 1)
        jj = ii
        if jj == 0:
            break
    edges.append(0)
    return tuple(sorted(set(edges)))


def quantile_bounds(lengths: npt.NDArray[np.integer], num_buckets: int, max_seq_len: int) -> tuple[int, ...]:
    """Edges at equal-count quantiles of the lengths (the simple baseline for ``auto``)."""
    qs = np.quantile(np.asarray(lengths), np.linspace(0, 1, num_buckets + 1)[1:-1])
    inner = sorted({int(q) + 1 for q in qs if 0 < int(q) + 1 <= max_seq_len})
    return (0, *inner, max_seq_len + 1)
