"""Synthetic tokenized datasets with the production length mix.

``make_dataset`` writes a real ``datasets.Dataset.save_to_disk`` folder whose
rows depend only on ``(rows, seed, scale, max_seq_len, vocab_size)`` and whose
lengths are exactly ``production_lengths(rows, seed, scale, max_seq_len)``;
it never overwrites a non-empty folder and never leaves a half-written one.
Columns: ``input_ids`` (list of int32 tokens in ``[1, vocab_size)``),
``loss_mask`` (list of int8: 0 on a short random prompt prefix, 1 after) and,
unless ``with_seq_len=False``, ``seq_len`` (int32).

The length mix has one component per production bucket (``PRODUCTION_BOUNDS``,
stretched by ``max_seq_len / 8192``): log-uniform lengths inside each of the
five shorter buckets (the first from 32 tokens), an exponential tail (decay
2000 tokens) from 3296 up to ``max_seq_len`` in the longest, and
``OVERLONG_FRACTION`` (0.3%) of rows log-uniform in
``(max_seq_len, 1.5 * max_seq_len]`` so that the overlong policy is exercised.
``BUCKET_FRACTIONS`` was tuned so that packing each bucket by sorted length
under the production limits (max_seq_len 8192, over-long rows cut to it, token
budget 49152, at most 64 rows a batch) gives, on 1M rows of seed 0:

=========  =====  ========  =========  =========  =========  ==========
bucket     <770   770-1215  1216-1727  1728-2431  2432-3295  3296-8192
=========  =====  ========  =========  =========  =========  ==========
rows %     26.0   17.0      13.9       10.9       8.9        23.3
batches %  8.8    7.4       9.1        10.2       11.5       52.9
=========  =====  ========  =========  =========  =========  ==========

i.e. the longest bucket yields about 53% of all batches (52.7% with the
schedule's chunked packer), at a mean length of about 2,050 tokens.

``scale`` multiplies every length (``ceil(length * scale)``, so at least 1) to
make tiny datasets for tests; the caller chooses the ``max_seq_len`` it serves
them with. Everything is vectorised numpy, with no Python loop per row.

The folder is written by ``_writer.write_dataset`` (the layout of
``save_to_disk``, every byte once), one record batch generated while the
previous one is written, so besides the per-row arrays (20 bytes a row:
lengths, window starts and prompt lengths as int32, the writer's int64
offsets) at most three batches (tens of MB) are in memory: about 150 MB in
all for a million rows. 10^8 rows of ``scale`` 1/1024 (2.5 GB on disk) took
81 s with a peak RSS of 5.6 GB, 2.5 GB of it the written files' pages mapped
when the result is opened (``benchmarks/bench_rows.py``). The disk then
bounds the time (about 30 s for the 10 GB of a million production rows at
350 MB/s).
"""

from __future__ import annotations

import math
import os

import numpy as np
import numpy.typing as npt

from ._writer import check_target, write_dataset
from .dataset import TokenDataset
from .errors import ConfigError
from .schedule.config import PRODUCTION_BOUNDS

__all__ = [
    "BUCKET_FRACTIONS",
    "OVERLONG_FRACTION",
    "make_dataset",
    "production_lengths",
]

I32 = npt.NDArray[np.int32]

# The mix is defined on the production max_seq_len and stretched for others.
_REFERENCE_MAX_SEQ_LEN = 8192
# Shortest row of the first bucket (production units).
_SHORTEST = 32
# Decay length of the longest bucket's exponential tail (production units).
_TAIL_SCALE = 2000.0
# Row fractions of the six production buckets; OVERLONG_FRACTION more rows are
# longer than max_seq_len (the fractions are renormalised to 1 - OVERLONG_FRACTION).
BUCKET_FRACTIONS: tuple[float, ...] = (0.26, 0.17, 0.14, 0.11, 0.09, 0.23)
OVERLONG_FRACTION = 0.003
# Over-long rows reach up to this multiple of max_seq_len.
_OVERLONG_MAX = 1.5

# Row tokens are windows of one random pool of this many tokens (plus the longest row).
_POOL_TOKENS = 1 << 22
_PROMPT_MAX_FRACTION = 0.25

# Independent random streams of one seed.
_STREAM_LENGTHS = 1
_STREAM_TOKENS = 2
_STREAM_ROWS = 3

_FORMAT_TAG = "ladle-synth-v1"


def _rng(seed: int, stream: int) -> np.random.Generator:
    return np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed, stream])))


def _check_common(rows: int, seed: int, scale: float, max_seq_len: int) -> None:
    if rows < 1:
        raise ConfigError("rows", f"must be at least 1, got {rows}")
    if seed < 0:
        raise ConfigError("seed", f"must be non-negative, got {seed}")
    if not (scale > 0 and math.isfinite(scale)):
        raise ConfigError("scale", f"must be a positive finite number, got {scale}")
    if max_seq_len < 1:
        raise ConfigError("max_seq_len", f"must be at least 1, got {max_seq_len}")
    longest = math.ceil(math.floor(_OVERLONG_MAX * max_seq_len) * scale)
    if longest >= 2**31:
        raise ConfigError(
            "scale",
            f"rows of up to {longest} tokens do not fit int32 (max_seq_len x scale too large)",
        )


def production_lengths(
    rows: int, seed: int, scale: float = 1.0, max_seq_len: int = 8192
) -> npt.NDArray[np.int32]:
    """``rows`` lengths of the production mix (int32, all >= 1), the same for the same inputs.

    Before ``scale``, about ``OVERLONG_FRACTION`` of them lie in
    ``(max_seq_len, 1.5 * max_seq_len]`` and the rest in ``[1, max_seq_len]``;
    with ``scale`` each length becomes ``ceil(length * scale)``. Fully
    vectorised (a loop over the seven mixture components, none per row).
    """
    _check_common(rows, seed, scale, max_seq_len)
    lo, log_ratio, cumulative = _mixture(max_seq_len)
    # float32 is exact enough while lengths stay far below 2**24, and twice as fast.
    ftype = np.float32 if _OVERLONG_MAX * max_seq_len < 2**20 else np.float64
    rng = _rng(seed, _STREAM_LENGTHS)
    pick = rng.random(rows, dtype=ftype)
    u = rng.random(rows, dtype=ftype)
    component = np.zeros(rows, dtype=np.int8)
    for edge in cumulative.astype(ftype):
        component += (pick >= edge).view(np.int8)
    del pick
    # log-uniform inside each component: lo * (hi / lo) ** u
    out = np.take(lo.astype(ftype), component)
    out *= np.exp(u * np.take(log_ratio.astype(ftype), component))
    # the longest bucket instead decays exponentially from its lower edge up to max_seq_len
    tail = component == len(BUCKET_FRACTIONS) - 1
    first, tau = float(lo[-2]), _TAIL_SCALE * max_seq_len / _REFERENCE_MAX_SEQ_LEN
    keep = -math.expm1(-(max_seq_len + 1 - first) / tau)
    out[tail] = first - tau * np.log1p(-keep * u[tail].astype(np.float64))
    over = component == len(BUCKET_FRACTIONS)
    lengths = np.floor(out, out=out)
    # guard the max_seq_len boundary against rounding, and keep every length >= 1
    np.minimum(lengths, max_seq_len, out=lengths, where=~over)
    np.maximum(lengths, max_seq_len + 1, out=lengths, where=over)
    np.maximum(lengths, 1, out=lengths)
    if scale != 1.0:
        return np.ceil(lengths.astype(np.float64) * scale).astype(np.int32)
    return lengths.astype(np.int32)


def _mixture(
    max_seq_len: int,
) -> tuple[npt.NDArray[np.float64], npt.NDArray[np.float64], npt.NDArray[np.float64]]:
    """Per-component lower edge, log(upper / lower), and cumulative weights between components.

    Components 0..5 are the production buckets stretched by
    ``max_seq_len / 8192`` (the first starting at ``_SHORTEST``, the last
    ending at ``max_seq_len + 1``); component 6 is the over-long rows
    ``(max_seq_len, 1.5 * max_seq_len]``.
    """
    stretch = max_seq_len / _REFERENCE_MAX_SEQ_LEN
    edges = np.asarray(PRODUCTION_BOUNDS[:-1], dtype=np.float64) * stretch
    edges[0] = _SHORTEST * stretch
    edges = np.minimum(np.maximum(edges, 1.0), max_seq_len)
    lo = np.r_[edges, max_seq_len + 1.0]
    hi = np.r_[edges[1:], max_seq_len + 1.0, math.floor(_OVERLONG_MAX * max_seq_len) + 1.0]
    hi = np.maximum(hi, lo + 1.0)
    weights = np.asarray(BUCKET_FRACTIONS, dtype=np.float64)
    weights = np.r_[weights / weights.sum() * (1.0 - OVERLONG_FRACTION), OVERLONG_FRACTION]
    return lo, np.log(hi / lo), np.cumsum(weights)[:-1]


def make_dataset(
    out: str | os.PathLike[str],
    rows: int,
    seed: int = 0,
    *,
    scale: float = 1.0,
    max_seq_len: int = 8192,
    vocab_size: int = 32000,
    with_seq_len: bool = True,
) -> TokenDataset:
    """Write ``rows`` synthetic rows of the production mix into the new folder ``out``.

    ``out`` must not exist or be an empty folder; the dataset is saved into a
    temporary sibling folder and renamed into place, so ``out`` never holds a
    half-written dataset. The same arguments always write the same rows (and
    so the same ``TokenDataset.fingerprint``); the lengths are
    ``production_lengths(rows, seed, scale, max_seq_len)``. Row ``i`` holds a
    window of one seeded pool of ``_POOL_TOKENS`` random tokens starting at a
    random offset, and its ``loss_mask`` is 0 on a random prefix of under a
    quarter of the row and 1 after (so every row has a trained token).

    Returns the written dataset, opened and validated with ``open_dataset``.
    """
    _check_common(rows, seed, scale, max_seq_len)
    if not 2 <= vocab_size <= 2**31:
        raise ConfigError("vocab_size", f"must be in [2, 2**31] for int32 tokens, got {vocab_size}")
    check_target(out)
    lengths = production_lengths(rows, seed, scale, max_seq_len)
    row_rng = _rng(seed, _STREAM_ROWS)
    # kept as int32 (4 bytes a row each: 10^8 rows fit in a few GB); drawn as they always were
    starts = row_rng.integers(0, _POOL_TOKENS, size=rows, dtype=np.int64).astype(np.int32)
    fraction = row_rng.random(rows)
    fraction *= _PROMPT_MAX_FRACTION
    fraction *= lengths
    prompt = np.floor(fraction, out=fraction).astype(np.int32)
    del fraction
    pool_size = _POOL_TOKENS + int(lengths.max())
    pool = _rng(seed, _STREAM_TOKENS).integers(1, vocab_size, size=pool_size, dtype=np.int32)

    def rows_of(first: int, last: int) -> tuple[I32, npt.NDArray[np.int8]]:
        return _rows(first, last, lengths, starts, prompt, pool)

    identity = f"{_FORMAT_TAG}:{rows}:{seed}:{scale!r}:{max_seq_len}:{vocab_size}:{with_seq_len}"
    return write_dataset(out, lengths, rows_of, identity=identity, with_seq_len=with_seq_len)


def _rows(
    first: int, last: int, lengths: I32, starts: I32, prompt: I32, pool: I32
) -> tuple[I32, npt.NDArray[np.int8]]:
    """Tokens and loss mask of rows ``[first, last)``, built with whole-array numpy operations."""
    count = lengths[first:last]
    local = np.zeros(len(count) + 1, dtype=np.int64)
    np.cumsum(count, dtype=np.int64, out=local[1:])
    n = int(local[-1])
    index_type = np.int32 if n + len(pool) < 2**31 else np.int64
    position = np.arange(n, dtype=index_type)
    index = np.repeat((starts[first:last] - local[:-1]).astype(index_type), count)
    index += position
    tokens = pool[index]
    del index
    mask = (position >= np.repeat((local[:-1] + prompt[first:last]).astype(index_type), count)).view(np.int8)
    return tokens, mask
