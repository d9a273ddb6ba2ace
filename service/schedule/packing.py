"""Packing one epoch's samples into token-budget batches.

Rows of each bucket are dealt into seeded random chunks of about
``sort_chunk`` rows and sorted by padded length inside each chunk; consecutive
rows of a chunk then fill a batch greedily while ``rows * padded_len <=
token_budget`` and ``rows <= max_batch_size``. Sorting inside chunks keeps
padding near zero (shuffle-then-pack wastes about a quarter of all tokens on
the production mix), while the chunks, and a per-epoch random order among rows
of equal padded length, keep which rows meet in a batch random from epoch to
epoch (guarantee 10): a tie is never broken by row id.

Everything is vectorised: one ``np.sort`` of packed 64-bit keys orders all
rows, and the greedy fill advances every chunk at once, one batch per
iteration, so no Python loop runs per sample.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from ..errors import ScheduleError
from ._seeds import STAGE_BATCH_ORDER, STAGE_CHUNKS, STAGE_TIES, BitMixer, permutation
from .config import ScheduleConfig

__all__ = ["Packed", "check_keys", "cut_lengths", "pack", "padded_lengths"]

I64 = npt.NDArray[np.int64]


IntArray = npt.NDArray[np.integer]

# Rows are processed in blocks of this many, so every temporary is small and
# only the 64-bit sort keys and the sorted rows span the dataset.
BLOCK = 1 << 20


@dataclass(frozen=True)
class Packed:
    """Batches as slices of one row array: batch i is ``rows[start[i]:start[i] + size[i]]``.

    Inside a batch, rows are in ascending order of padded length, so the last
    one has the batch's padded length (rows of one padded length are in a
    random order). Batches are disjoint and in ascending order of ``start``.
    ``rows`` are int32 below 2**31 rows (int64 above); the per-batch arrays
    are int64. A row's cut length is not stored but read from ``source``, the
    uncut lengths by row id the batches were packed from (the dataset's own
    array, shared): ``min(source[row], max_seq_len)``, see ``lengths``.
    """

    rows: IntArray
    source: IntArray
    max_seq_len: int
    start: I64
    size: I64
    bucket: I64
    padded_len: I64

    @property
    def num_batches(self) -> int:
        return len(self.start)

    def lengths(self, at: slice | IntArray = slice(None)) -> IntArray:
        """Cut lengths of ``rows[at]``, in the same order (gathered from ``source`` on each call)."""
        return cut_lengths(self.source, self.rows[at], self.max_seq_len)

    def per_batch(self, ufunc: np.ufunc) -> I64:
        """``ufunc`` reduced over each batch's cut lengths (``np.add``: its real tokens), int64.

        Gathers a block of rows' lengths at a time, so no array of every row's
        length is made.
        """
        out = np.empty(self.num_batches, dtype=np.int64)
        end = self.start + self.size
        first = 0
        while first < self.num_batches:
            a = int(self.start[first])
            last = max(first + 1, int(np.searchsorted(self.start, a + BLOCK, side="left")))
            b = int(end[last - 1])
            values = np.r_[self.lengths(slice(a, b)).astype(np.int64), 0]  # a sentinel: the end is an edge
            edges = np.empty(2 * (last - first), dtype=np.int64)
            edges[0::2] = self.start[first:last] - a
            edges[1::2] = end[first:last] - a
            out[first:last] = ufunc.reduceat(values, edges)[0::2]
            first = last
        return out


def _bits(n: int) -> int:
    return max(1, int(n).bit_length())


def _blocks(n: int) -> list[tuple[int, int]]:
    return [(a, min(a + BLOCK, n)) for a in range(0, n, BLOCK)]


def _bucket_counts(buckets: IntArray, num_buckets: int) -> I64:
    if num_buckets <= 16:  # a few passes over int8 beat bincount's cast to intp
        return np.array([np.count_nonzero(buckets == b) for b in range(num_buckets)], dtype=np.int64)
    return np.bincount(buckets, minlength=num_buckets).astype(np.int64)


def _sorted_keys(
    lengths: IntArray,
    buckets: IntArray,
    num_buckets: int,
    config: ScheduleConfig,
    epoch: int,
    tie_bits: int,
    len_bits: int,
    chunk_bits: int,
    chunks: npt.NDArray[np.uint64],
) -> I64:
    """Sorted keys ``bucket | chunk | padded length / pad | tie`` packed into one int64 each.

    ``tie`` is the sample's position mixed by a per-epoch keyed bijection
    (``BitMixer``): samples of equal padded length fall in a random order that
    changes every epoch, and the position is still read back from the key.
    """
    n = len(lengths)
    key = np.empty(n, dtype=np.int64)
    ukey = key.view(np.uint64)
    base = (np.arange(num_buckets, dtype=np.int64) << chunk_bits).astype(np.uint64)
    draws = np.random.PCG64(np.random.SeedSequence([config.seed, epoch, STAGE_CHUNKS]))
    ties = BitMixer(tie_bits, config.seed, epoch, STAGE_TIES)
    pad = np.uint64(config.pad_to_multiple_of)
    for a, b in _blocks(n):
        part = ukey[a:b]
        bk = buckets[a:b]
        np.take(chunks, bk, out=part)
        # chunk = floor(u * chunks[bucket]) for the top 32 bits u of the stream
        part *= np.asarray(draws.random_raw(b - a), dtype=np.uint64) >> np.uint64(32)
        part >>= np.uint64(32)
        part += np.take(base, bk)
        part <<= np.uint64(len_bits)
        length_class = lengths[a:b].astype(np.uint64)
        if pad > 1:  # rows of one padded length cost the same: they are one class
            length_class += pad - np.uint64(1)
            length_class //= pad
        part |= length_class
        part <<= np.uint64(tie_bits)
        tie = np.arange(a, b, dtype=np.uint64)
        ties.mix(tie)
        part |= tie
    key.sort()
    return key


def check_keys(buckets: IntArray, num_buckets: int, config: ScheduleConfig) -> None:
    """``ScheduleError`` unless rows of these bucket ids fit ``pack``'s 62-bit sort keys (any epoch)."""
    _key_fields(buckets, num_buckets, config)


def _key_fields(
    buckets: IntArray, num_buckets: int, config: ScheduleConfig
) -> tuple[npt.NDArray[np.uint64], tuple[int, int, int]]:
    """Chunks per bucket, and the bits of the keys' tie, length class and chunk fields."""
    n = len(buckets)
    per_bucket = _bucket_counts(buckets, num_buckets)
    chunks = np.maximum(1, -(-per_bucket // config.sort_chunk)).astype(np.uint64)
    tie_bits = _bits(n - 1)
    len_bits = _bits(_max_class(config))
    chunk_bits = _bits(int(chunks.max()))
    if tie_bits + len_bits + chunk_bits + _bits(num_buckets) > 62:
        raise ScheduleError(
            f"{n} rows with max_seq_len {config.max_seq_len} and sort_chunk "
            f"{config.sort_chunk} do not fit ladle's 62-bit sort keys; raise sort_chunk or split the dataset"
        )
    return chunks, (tie_bits, len_bits, chunk_bits)


def pack(
    rows: IntArray | None,
    lengths: IntArray,
    buckets: IntArray,
    num_buckets: int,
    config: ScheduleConfig,
    epoch: int,
    num_rows_total: int,
    *,
    source: IntArray | None = None,
) -> Packed:
    """Pack the samples into batches for ``epoch``.

    ``lengths`` are the cut lengths and ``buckets`` the bucket ids of the
    samples; ``rows`` their row indices (``None``: all rows, ``0..n-1``).
    ``source`` holds the uncut lengths by row id, so that ``lengths[i] ==
    min(source[rows[i]], config.max_seq_len)``; the result keeps it, not
    ``lengths``. It defaults to ``lengths`` when ``rows`` is ``None``.
    """
    if source is None:
        if rows is not None:
            raise ValueError("pack: rows given without the source lengths they index")
        source = lengths
    n = len(lengths)
    empty = np.empty(0, dtype=np.int64)
    if n == 0:
        return Packed(empty, source, config.max_seq_len, empty, empty, empty, empty)
    chunks, (tie_bits, len_bits, chunk_bits) = _key_fields(buckets, num_buckets, config)
    key = _sorted_keys(lengths, buckets, num_buckets, config, epoch, tie_bits, len_bits, chunk_bits, chunks)

    # Decode the rows in blocks; the key keeps its segment and length class.
    row_dtype = np.int32 if num_rows_total < 2**31 else np.int64
    rows_sorted: IntArray = np.empty(n, dtype=row_dtype)
    tie_mask = np.int64((1 << tie_bits) - 1)
    ties = BitMixer(tie_bits, config.seed, epoch, STAGE_TIES)
    seg_starts = [np.zeros(1, dtype=np.int64)]
    for a, b in _blocks(n):
        part = key[a:b]
        position = np.bitwise_and(part, tie_mask).view(np.uint64)
        ties.unmix(position)
        index = position.view(np.int64)
        if rows is None:
            rows_sorted[a:b] = index
        else:
            rows_sorted[a:b] = rows[index]
        part >>= tie_bits
        segment = key[max(a - 1, 0) : b] >> len_bits  # one row back: a segment may start at a
        seg_starts.append(np.flatnonzero(segment[1:] != segment[:-1]) + (max(a - 1, 0) + 1))
    del segment

    # A batch starting at s in a sorted segment ends after the last j with
    # j + 1 - cap[j] <= s; that quantity rises strictly within a segment, so
    # adding a per-segment offset makes it searchable with one sorted array.
    seg_start = np.concatenate(seg_starts)
    seg_end = np.r_[seg_start[1:], n]
    seg_raw = key[seg_start] >> len_bits  # a copy: the key array is reused below
    seg_bucket = seg_raw >> chunk_bits
    pad = config.pad_to_multiple_of
    # a row's cap depends on its padded length only, which its length class gives
    padded_of_class = np.arange(_max_class(config) + 1, dtype=np.int64) * pad
    cap_of_class = np.minimum(config.max_batch_size, config.token_budget // np.maximum(padded_of_class, 1))
    len_mask = np.int64((1 << len_bits) - 1)
    big = n + config.max_batch_size + 2
    reach = key  # reused in place: segment id * big + j + 1 - cap[j]
    for a, b in _blocks(n):
        part = reach[a:b]
        length_class = np.bitwise_and(part, len_mask)
        part >>= len_bits
        part *= big
        part += np.arange(a + 1, b + 1, dtype=np.int64)
        part -= np.take(cap_of_class, length_class)
    starts = []
    pointer = seg_start
    end = seg_end
    seg_ids = seg_raw
    while len(pointer):
        starts.append(pointer)
        nxt = np.searchsorted(reach, pointer + seg_ids * big, side="right")
        np.minimum(nxt, end, out=nxt)
        alive = nxt < end
        pointer, end, seg_ids = nxt[alive], end[alive], seg_ids[alive]
    del reach, key
    start = np.sort(np.concatenate(starts))
    size = np.diff(np.r_[start, n])
    last = start + size - 1
    bucket = seg_bucket[np.searchsorted(seg_start, start, side="right") - 1]
    padded = padded_lengths(cut_lengths(source, rows_sorted[last], config.max_seq_len), pad)
    return Packed(rows_sorted, source, config.max_seq_len, start, size, bucket, padded)


def _max_class(config: ScheduleConfig) -> int:
    return -(-int(config.max_seq_len) // config.pad_to_multiple_of)


def cut_lengths(source: IntArray, rows: IntArray, max_seq_len: int) -> IntArray:
    """The lengths of ``rows`` (row ids into ``source``) cut to ``max_seq_len``, as schedules serve them."""
    out: IntArray = np.minimum(source[rows], max_seq_len)
    return out


def padded_lengths(lengths: IntArray, pad: int) -> I64:
    """``lengths`` rounded up to a multiple of ``pad``, int64."""
    out: I64 = -(-lengths.astype(np.int64) // pad) * pad
    return out


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
