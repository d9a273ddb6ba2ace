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

The folder is written the way ``save_to_disk`` lays it out, but every byte
only once: the shard count is ``save_to_disk``'s (estimated bytes over
``_MAX_SHARD_SIZE``, plus one), known up front from the row lengths; shards
are its contiguous, equal-row ranges, cut into its record batches
(``_BATCH_ROWS`` rows, fewer for very long rows) and written as Arrow IPC
streams ``data-00000-of-000NN.arrow`` with the schema, ``state.json`` and
``dataset_info.json`` of a one-row dataset that ``datasets`` itself saves
first. A record batch holds at most about ``BLOCK_TOKENS`` tokens (a longer
one is split), and one background thread writes each batch while the next
is generated, so besides the per-row arrays (about 30 bytes a row) at most
three batches (tens of MB) are in memory: about 150 MB in all for a million
rows. The disk then bounds the time (about 30 s for the 10 GB of a million
production rows at 350 MB/s).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import tempfile
from collections import deque
from collections.abc import Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import datasets
import numpy as np
import numpy.typing as npt
import pyarrow as pa
from datasets.table import InMemoryTable

from .dataset import LOSS_MASK, SEQ_LEN, TOKENS, TokenDataset, open_dataset
from .errors import ConfigError
from .schedule.config import PRODUCTION_BOUNDS

__all__ = [
    "BUCKET_FRACTIONS",
    "OVERLONG_FRACTION",
    "make_dataset",
    "production_lengths",
]

I32 = npt.NDArray[np.int32]
I64 = npt.NDArray[np.int64]

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

# A record batch holds at most about this many tokens (a longer one is split).
BLOCK_TOKENS = 1 << 24
# save_to_disk's defaults: shards of at most about this many bytes ("500MB"), record
# batches of at most _BATCH_ROWS rows and, for long rows, about _BATCH_BYTES bytes.
_MAX_SHARD_SIZE = 500 * 10**6
_BATCH_ROWS = 1000
_BATCH_BYTES = 100 * 10**6
# Record batches generated but not yet written, at most.
_IN_FLIGHT = 2
# At this many tokens or more, list columns need 64-bit offsets (large_list).
_LARGE_LIST_TOKENS = 2**31
# Row tokens are windows of one random pool of this many tokens (plus the longest row).
_POOL_TOKENS = 1 << 22
_PROMPT_MAX_FRACTION = 0.25

# Independent random streams of one seed.
_STREAM_LENGTHS = 1
_STREAM_TOKENS = 2
_STREAM_ROWS = 3

_FORMAT_TAG = "ladle-synth-v1"
_STATE = "state.json"
_INFO = "dataset_info.json"


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
    target = Path(out)
    if target.exists() and (not target.is_dir() or any(target.iterdir())):
        raise ConfigError("out", f"{target} exists and is not an empty folder; refusing to overwrite it")
    target.parent.mkdir(parents=True, exist_ok=True)

    lengths = production_lengths(rows, seed, scale, max_seq_len)
    offsets = np.zeros(rows + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    row_rng = _rng(seed, _STREAM_ROWS)
    starts = row_rng.integers(0, _POOL_TOKENS, size=rows, dtype=np.int64)
    prompt = np.floor(row_rng.random(rows) * _PROMPT_MAX_FRACTION * lengths).astype(np.int64)
    pool_size = _POOL_TOKENS + int(lengths.max())
    pool = _rng(seed, _STREAM_TOKENS).integers(1, vocab_size, size=pool_size, dtype=np.int32)
    large = int(offsets[-1]) >= _LARGE_LIST_TOKENS
    identity = f"{_FORMAT_TAG}:{rows}:{seed}:{scale!r}:{max_seq_len}:{vocab_size}:{with_seq_len}"
    hf_fingerprint = hashlib.blake2b(identity.encode(), digest_size=8).hexdigest()
    shards, batch_rows = _layout(offsets, large, with_seq_len)
    names = [f"data-{k:05d}-of-{len(shards) - 1:05d}.arrow" for k in range(len(shards) - 1)]

    def batch(first: int, last: int, schema: pa.Schema) -> pa.RecordBatch:
        return _block(first, last, offsets, lengths, starts, prompt, pool, schema, large)

    with tempfile.TemporaryDirectory(prefix=f".{target.name}.ladle-synth-", dir=target.parent) as tmp:
        staged = Path(tmp, "dataset")
        probe = Path(tmp, "probe")
        schema = _save_probe(probe, batch(0, 1, _schema(large, with_seq_len)), hf_fingerprint)
        staged.mkdir()
        _write_shards(
            [staged / name for name in names],
            schema,
            (
                (shard, batch(first, last, schema))
                for shard, first, last in _blocks(offsets, shards, batch_rows)
            ),
        )
        state = json.loads((probe / _STATE).read_text(encoding="utf-8"))
        state["_data_files"] = [{"filename": name} for name in names]
        with open(staged / _STATE, "w", encoding="utf-8") as state_file:
            json.dump(state, state_file, indent=2, sort_keys=True)
        os.replace(probe / _INFO, staged / _INFO)
        os.replace(staged, target)
    return open_dataset(target)


def _schema(large: bool, with_seq_len: bool) -> pa.Schema:
    list_type = pa.large_list if large else pa.list_
    fields = [pa.field(TOKENS, list_type(pa.int32())), pa.field(LOSS_MASK, list_type(pa.int8()))]
    if with_seq_len:
        fields.append(pa.field(SEQ_LEN, pa.int32()))
    return pa.schema(fields)


def _layout(offsets: I64, large: bool, with_seq_len: bool) -> tuple[I64, int]:
    """Shard edges ``[0, ..., rows]`` and rows per record batch, as ``save_to_disk`` chooses them.

    ``save_to_disk`` writes ``int(nbytes / max_shard_size) + 1`` shards (at most
    one per row) of contiguous, equal row ranges (the first ``rows % shards``
    one row longer) in record batches of ``min(1000, rows * 100MB // nbytes)``
    rows; ``nbytes`` is the Arrow size of the columns, here computed from the
    lengths (values, list offsets, ``seq_len``) instead of measured.
    """
    rows = len(offsets) - 1
    offset_bytes = 8 if large else 4
    nbytes = 5 * int(offsets[-1]) + 2 * offset_bytes * (rows + 1) + (4 * rows if with_seq_len else 0)
    count = min(rows, int(nbytes / _MAX_SHARD_SIZE) + 1)
    size, extra = divmod(rows, count)
    index = np.arange(count + 1, dtype=np.int64)
    shards = index * size + np.minimum(index, extra)
    batch_rows = min(_BATCH_ROWS, max(1, rows * _BATCH_BYTES // nbytes))
    return shards, batch_rows


def _blocks(offsets: I64, shards: I64, batch_rows: int) -> Iterator[tuple[int, int, int]]:
    """``(shard, first, last)``: the record batches, rows ``[first, last)``, in order.

    Each shard is cut into batches of ``batch_rows`` rows from its first row;
    a batch of more than ``BLOCK_TOKENS`` tokens is cut again at the row
    holding each further multiple of ``BLOCK_TOKENS`` tokens past its start
    (at least one row each: rows are never empty).
    """
    for shard, (begin, end) in enumerate(zip(shards[:-1].tolist(), shards[1:].tolist(), strict=True)):
        for first in range(begin, end, batch_rows):
            last = min(first + batch_rows, end)
            base = int(offsets[first])
            if int(offsets[last]) - base <= BLOCK_TOKENS:
                yield shard, first, last
                continue
            marks = np.arange(base, int(offsets[last]), BLOCK_TOKENS, dtype=np.int64)
            edges = np.unique(np.r_[np.searchsorted(offsets, marks, side="right") - 1, last])
            for a, b in zip(edges[:-1].tolist(), edges[1:].tolist(), strict=True):
                yield shard, a, b


def _block(
    first: int,
    last: int,
    offsets: I64,
    lengths: I32,
    starts: I64,
    prompt: I64,
    pool: I32,
    schema: pa.Schema,
    large: bool,
) -> pa.RecordBatch:
    """Rows ``[first, last)`` as one record batch, built with whole-array numpy operations."""
    local = offsets[first : last + 1] - offsets[first]
    count = lengths[first:last]
    n = int(local[-1])
    index_type = np.int32 if n + len(pool) < 2**31 else np.int64
    position = np.arange(n, dtype=index_type)
    index = np.repeat((starts[first:last] - local[:-1]).astype(index_type), count)
    index += position
    tokens = pool[index]
    del index
    mask = (position >= np.repeat((local[:-1] + prompt[first:last]).astype(index_type), count)).view(np.int8)
    list_array = pa.LargeListArray if large else pa.ListArray
    list_offsets = pa.array(local if large else local.astype(np.int32))
    columns = [
        list_array.from_arrays(list_offsets, pa.array(tokens)),
        list_array.from_arrays(list_offsets, pa.array(mask)),
    ]
    if len(schema) == 3:
        columns.append(pa.array(count))
    return pa.RecordBatch.from_arrays(columns, schema=schema)


def _save_probe(probe: Path, row: pa.RecordBatch, fingerprint: str) -> pa.Schema:
    """Let ``save_to_disk`` save ``row`` into ``probe``; return the schema of its shard.

    The shard schema (with the ``huggingface`` features metadata),
    ``state.json`` (with ``_fingerprint``) and ``dataset_info.json`` it writes
    are those of the full dataset, whose shards are then written directly.
    """
    dataset = datasets.Dataset(InMemoryTable(pa.Table.from_batches([row])), fingerprint=fingerprint)
    with _quiet_progress():
        dataset.save_to_disk(str(probe))
    files = json.loads((probe / _STATE).read_text(encoding="utf-8"))["_data_files"]
    with pa.OSFile(str(probe / files[0]["filename"]), "rb") as source:
        schema: pa.Schema = pa.ipc.open_stream(source).schema
    if not schema.remove_metadata().equals(row.schema.remove_metadata()):
        raise RuntimeError(f"datasets saved the schema {schema} for the rows {row.schema}")
    return schema


def _write_shards(
    paths: list[Path], schema: pa.Schema, batches: Iterable[tuple[int, pa.RecordBatch]]
) -> None:
    """Write ``(shard, batch)`` in order, shard ``k`` as one Arrow IPC stream ``paths[k]``.

    One worker thread writes (Arrow releases the GIL) while the caller's
    thread generates the next batch; at most ``_IN_FLIGHT`` batches wait.
    Every shard must receive at least one batch, shards in increasing order.
    """
    open_shard: list[tuple[int, pa.NativeFile, pa.ipc.RecordBatchStreamWriter]] = []

    def close() -> None:
        while open_shard:
            _, sink, writer = open_shard.pop()
            try:
                writer.close()
            finally:
                sink.close()

    def write(shard: int, batch: pa.RecordBatch) -> None:
        if not open_shard or open_shard[-1][0] != shard:
            close()
            sink = pa.OSFile(str(paths[shard]), "wb")
            try:
                writer = pa.ipc.new_stream(sink, schema)
            except BaseException:
                sink.close()
                raise
            open_shard.append((shard, sink, writer))
        open_shard[-1][2].write_batch(batch)

    pending: deque[Future[None]] = deque()
    try:
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="ladle-synth-writer") as pool:
            try:
                for shard, batch in batches:
                    if len(pending) >= _IN_FLIGHT:
                        pending.popleft().result()
                    pending.append(pool.submit(write, shard, batch))
                while pending:
                    pending.popleft().result()
            finally:
                for future in pending:
                    future.cancel()
    finally:
        close()


@contextlib.contextmanager
def _quiet_progress() -> Iterator[None]:
    """Silence ``datasets``' progress bars for the duration, then restore the previous setting."""
    enabled = datasets.is_progress_bar_enabled()
    datasets.disable_progress_bars()
    try:
        yield
    finally:
        if enabled:
            datasets.enable_progress_bars()
