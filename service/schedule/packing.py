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
) -> tuple[I64, I64, I64, int]:
    """Rows ordered by (bucket, random chunk, length, row).

    Returns the rows, their lengths, a segment id per row (bucket and chunk;
    equal ids are one sorted chunk) and the number of low bits of the segment
    id that hold the chunk (so ``segment >> chunk_bits`` is the bucket).
    """
    n = len(rows)
    per_bucket = np.bincount(buckets, minlength=num_buckets)
    chunks = np.maximum(1, -(-per_bucket // config.sort_chunk)).astype(np.uint64)
    row_bits = _bits(num_rows_total)
    len_bits = _bits(int(config.max_seq_len))
    chunk_bits = _bits(int(chunks.max()))
    bucket_bits = _bits(num_buckets)
    # chunk = floor(u * chunks[bucket]) for a uniform 32-bit u, computed in place
    seg = chunks[buckets]
    seg *= random_u64(n, config.seed, epoch, STAGE_CHUNKS) >> np.uint64(32)
    seg >>= np.uint64(32)
    chunk = seg.view(np.int64)
    bucket_base = np.arange(num_buckets, dtype=np.int64) << chunk_bits
    chunk += bucket_base[buckets]  # now bucket << chunk_bits | chunk
    if row_bits + len_bits + chunk_bits + bucket_bits <= 63:
        key = chunk
        key <<= len_bits
        key |= lengths
        key <<= row_bits
        key |= rows
        key.sort()
        rows_sorted = key & ((1 << row_bits) - 1)
        key >>= row_bits
        lengths_sorted = key & ((1 << len_bits) - 1)
        key >>= len_bits
        return rows_sorted, lengths_sorted, key, chunk_bits
    # very large datasets: the same order, without packing into one word
    order = np.lexsort((rows, lengths, chunk))
    return rows[order], lengths[order], chunk[order], chunk_bits


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
    rows_s, len_s, segment, chunk_bits = _sorted_rows(
        rows, lengths, buckets, num_buckets, config, epoch, num_rows_total
    )
    n = len(rows_s)
    pad = config.pad_to_multiple_of
    every = np.arange(config.max_seq_len + 1, dtype=np.int64)
    padded_of = -(-every // pad) * pad
    cap_of = np.minimum(config.max_batch_size, config.token_budget // np.maximum(padded_of, 1))
    # A batch starting at s in a sorted segment ends after the last j with
    # j + 1 - cap[j] <= s; that quantity rises strictly within a segment, so
    # adding a per-segment offset makes it searchable with one sorted array.
    seg_start = np.flatnonzero(segment[1:] != segment[:-1]) + 1
    seg_start = np.r_[0, seg_start]
    seg_end = np.r_[seg_start[1:], n]
    big = n + config.max_batch_size + 2
    reach = np.repeat(np.arange(len(seg_start), dtype=np.int64) * big, seg_end - seg_start)
    reach += np.arange(1, n + 1, dtype=np.int64)
    reach -= cap_of[len_s]
    starts = []
    pointer = seg_start
    end = seg_end
    seg_ids = np.arange(len(seg_start), dtype=np.int64)
    while len(pointer):
        starts.append(pointer)
        nxt = np.searchsorted(reach, pointer + seg_ids * big, side="right")
        np.minimum(nxt, end, out=nxt)
        alive = nxt < end
        pointer, end, seg_ids = nxt[alive], end[alive], seg_ids[alive]
    del reach
    start = np.sort(np.concatenate(starts))
    size = np.diff(np.r_[start, n])
    last = start + size - 1
    bucket = segment[start] >> chunk_bits
    return Packed(rows_s, len_s, start, size, bucket, padded_of[len_s[last]])


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
