"""Packing one epoch's samples into token-budget batches.

Rows of each bucket are dealt into seeded random chunks of about
``sort_chunk`` rows and sorted by length inside each chunk; consecutive rows of
a chunk then fill a batch greedily while ``rows * padded_len <= token_budget``
and ``rows <= max_batch_size``. Sorting inside chunks keeps padding near zero
(shuffle-then-pack wastes about a quarter of all tokens on the production mix),
while the chunks keep which rows meet in a batch random from epoch to epoch.

Everything is vectorised: one ``np.sort`` of packed 64-bit keys orders all
rows, and the greedy fill advances every chunk at once, one batch per
iteration, so no Python loop runs per sample.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from ._seeds import STAGE_BATCH_ORDER, STAGE_CHUNKS, permutation, random_u64
from .config import ScheduleConfig

__all__ = ["Packed", "pack"]

I64 = npt.NDArray[np.int64]


@dataclass(frozen=True)
class Packed:
    """Batches as slices of one row array: batch i is ``rows[start[i]:start[i] + size[i]]``.

    Inside a batch, rows are in ascending length order, so the last one is the
    longest. ``order`` lists batch ids bucket by bucket, each bucket's batches
    in a seeded random order.
    """

    rows: I64
    lengths: I64
    start: I64
    size: I64
    bucket: I64
    padded_len: I64

    @property
    def num_batches(self) -> int:
        return len(self.start)


def _bits(n: int) -> int:
    return max(1, int(n).bit_length())


def _sorted_rows(
    rows: I64,
    lengths: I64,
    buckets: npt.NDArray[np.integer],
    num_buckets: int,
    config: ScheduleConfig,
    epoch: int,
    num_rows_total: int,
) -> tuple[I64, I64, I64, I64]:
    """Rows ordered by (bucket, random chunk, length, row): rows, lengths, segments, buckets."""
    n = len(rows)
    b = buckets.astype(np.int64)
    per_bucket = np.bincount(b, minlength=num_buckets)
    chunks = np.maximum(1, -(-per_bucket // config.sort_chunk))
    draw = random_u64(n, config.seed, epoch, STAGE_CHUNKS) >> np.uint64(32)
    chunk = ((draw * chunks[b].astype(np.uint64)) >> np.uint64(32)).astype(np.int64)
    row_bits = _bits(num_rows_total)
    len_bits = _bits(int(config.max_seq_len))
    chunk_bits = _bits(int(chunks.max()))
    bucket_bits = _bits(num_buckets)
    if row_bits + len_bits + chunk_bits + bucket_bits <= 63:
        key = b << (chunk_bits + len_bits + row_bits)
        key |= chunk << (len_bits + row_bits)
        key |= lengths << row_bits
        key |= rows
        key.sort()
        row_mask = (1 << row_bits) - 1
        len_mask = (1 << len_bits) - 1
        rows_sorted = key & row_mask
        lengths_sorted = (key >> row_bits) & len_mask
        segment = key >> (len_bits + row_bits)
        bucket_sorted = segment >> chunk_bits
    else:  # very large datasets: the same order, without packing into one word
        order = np.lexsort((rows, lengths, chunk, b))
        rows_sorted, lengths_sorted = rows[order], lengths[order]
        bucket_sorted = b[order]
        segment = bucket_sorted * (int(chunks.max()) + 1) + chunk[order]
    return rows_sorted, lengths_sorted, segment, bucket_sorted


def pack(
    rows: I64,
    lengths: I64,
    buckets: npt.NDArray[np.integer],
    num_buckets: int,
    config: ScheduleConfig,
    epoch: int,
    num_rows_total: int,
) -> Packed:
    """Pack ``rows`` (with their cut lengths and bucket ids) into batches for ``epoch``."""
    if len(rows) == 0:
        empty = np.empty(0, dtype=np.int64)
        return Packed(empty, empty, empty, empty, empty, empty)
    rows_s, len_s, segment, bucket_s = _sorted_rows(
        rows, lengths, buckets, num_buckets, config, epoch, num_rows_total
    )
    n = len(rows_s)
    pad = config.pad_to_multiple_of
    padded = -(-len_s // pad) * pad
    cap = np.minimum(config.max_batch_size, config.token_budget // padded)
    # A batch starting at s in a sorted segment ends after the last j with
    # j + 1 - cap[j] <= s; that quantity rises strictly within a segment, so
    # adding a per-segment offset makes it searchable with one sorted array.
    seg_start = np.flatnonzero(np.r_[True, segment[1:] != segment[:-1]])
    seg_end = np.r_[seg_start[1:], n]
    seg_index = np.repeat(np.arange(len(seg_start), dtype=np.int64), np.diff(np.r_[seg_start, n]))
    big = n + config.max_batch_size + 2
    reach = np.arange(1, n + 1, dtype=np.int64) - cap + seg_index * big
    starts = []
    pointer = seg_start.copy()
    end = seg_end
    seg_ids = np.arange(len(seg_start), dtype=np.int64)
    while len(pointer):
        starts.append(pointer)
        nxt = np.searchsorted(reach, pointer + seg_ids * big, side="right")
        nxt = np.minimum(nxt, end)
        alive = nxt < end
        pointer, end, seg_ids = nxt[alive], end[alive], seg_ids[alive]
    start = np.sort(np.concatenate(starts))
    size = np.diff(np.r_[start, n])
    last = start + size - 1
    return Packed(rows_s, len_s, start, size, bucket_s[start], padded[last])


def batch_order(packed: Packed, num_buckets: int, config: ScheduleConfig, epoch: int) -> list[I64]:
    """Each bucket's batch ids in a seeded random order (stream keyed by seed, epoch, bucket)."""
    by_bucket = np.argsort(packed.bucket, kind="stable")
    counts = np.bincount(packed.bucket, minlength=num_buckets)
    out: list[I64] = []
    offset = 0
    for b in range(num_buckets):
        ids = by_bucket[offset : offset + counts[b]].astype(np.int64)
        offset += counts[b]
        out.append(ids[permutation(len(ids), config.seed, epoch, STAGE_BATCH_ORDER, b)])
    return out
