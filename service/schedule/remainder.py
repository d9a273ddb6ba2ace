"""Making the batch count fit the world size, so every rank gets the same steps (guarantee 2).

``split`` (the default) halves the largest batches until the count is a
multiple of the world size (per bucket in ``sync`` mode, where a step is one
bucket), so nothing is lost; a half never exceeds the budget of the batch it
came from. When there are too few rows left to give every rank a batch, it
falls back to ``drop``. ``drop`` removes the smallest leftover batches and
reports their rows with the reason ``"remainder"``.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import numpy.typing as npt

from .packing import Packed, padded_lengths

__all__ = ["fit_to_world"]

I64 = npt.NDArray[np.int64]


def _split_largest(packed: Packed, members: I64, splits: int) -> tuple[I64, I64]:
    """Halve the largest of ``members`` until there are ``splits`` more; new (start, size) arrays."""
    start = packed.start[members].copy()
    size = packed.size[members].copy()
    while splits:
        # the `splits` largest batches (ties: earlier first), each halved once
        order = np.lexsort((start, -size))[:splits]
        order = order[size[order] >= 2]
        if len(order) == 0:  # guarded by the caller: enough rows for every split
            raise AssertionError("remainder: nothing left to split")
        half = size[order] // 2
        start = np.r_[start, start[order] + half]
        size = np.r_[size, size[order] - half]
        size[order] = half
        splits -= len(order)
    return start, size


def fit_to_world(
    packed: Packed, num_buckets: int, world_size: int, rank_mode: str, policy: str, pad: int
) -> tuple[Packed, I64]:
    """Return batches whose count fits ``world_size`` and the rows dropped doing it."""
    if rank_mode == "sync":
        groups = [np.flatnonzero(packed.bucket == b) for b in range(num_buckets)]
    else:
        groups = [np.arange(packed.num_batches)]
    keep_start: list[I64] = []
    keep_size: list[I64] = []
    dropped: list[npt.NDArray[np.integer]] = []
    for members in groups:
        count = len(members)
        short = (-count) % world_size
        rows_here = int(packed.size[members].sum())
        if short == 0:
            keep_start.append(packed.start[members])
            keep_size.append(packed.size[members])
        elif policy == "split" and rows_here >= count + short:
            starts, sizes = _split_largest(packed, members, short)
            keep_start.append(starts)
            keep_size.append(sizes)
        else:
            extra = count % world_size
            order = np.lexsort((-members, packed.size[members]))  # smallest first, later first
            gone = members[order[:extra]]
            kept = np.sort(members[order[extra:]])
            keep_start.append(packed.start[kept])
            keep_size.append(packed.size[kept])
            for g in gone:
                dropped.append(packed.rows[packed.start[g] : packed.start[g] + packed.size[g]])
    start = np.concatenate(keep_start) if keep_start else np.empty(0, np.int64)
    size = np.concatenate(keep_size) if keep_size else np.empty(0, np.int64)
    order = np.argsort(start, kind="stable")
    start, size = start[order], size[order]
    last = start + size - 1
    padded = padded_lengths(packed.lengths(last), pad)
    # a (possibly halved) slice keeps the bucket of the batch it came from
    origin = np.searchsorted(packed.start, start, side="right") - 1
    fitted = replace(packed, start=start, size=size, bucket=packed.bucket[origin], padded_len=padded)
    dropped_rows = np.sort(np.concatenate(dropped)).astype(np.int64) if dropped else np.empty(0, np.int64)
    return fitted, dropped_rows
