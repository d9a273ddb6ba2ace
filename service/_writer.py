"""Writing a token dataset into the folder layout of ``datasets.Dataset.save_to_disk``, every byte once.

``write_dataset`` takes the row lengths and a function that returns the
tokens and loss mask of a range of rows, and writes a folder that
``datasets.load_from_disk`` and ``open_dataset`` read as if ``save_to_disk``
had written it; it never overwrites a non-empty folder and never leaves a
half-written one. Used by the synthetic (``synth``) dataset maker; the
streaming writer of ``ingest`` (real text and records) shares its
``staging`` (the temporary folder, the schema, ``state.json`` and the final
rename).

The shard count is ``save_to_disk``'s (estimated bytes over
``_MAX_SHARD_SIZE``, plus one), known up front from the row lengths; shards
are its contiguous, equal-row ranges, cut into its record batches
(``_BATCH_ROWS`` rows, fewer for very long rows) and written as Arrow IPC
streams ``data-00000-of-000NN.arrow`` with the schema, ``state.json`` and
``dataset_info.json`` of a one-row dataset that ``datasets`` itself saves
first. A record batch holds at most about ``BLOCK_TOKENS`` tokens (a longer
one is split), and one background thread writes each batch while the next
is generated, so besides the per-row arrays at most three batches (tens of
MB) are in memory; the disk then bounds the time.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import tempfile
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import datasets
import numpy as np
import numpy.typing as npt
import pyarrow as pa
from datasets.table import InMemoryTable

from .dataset import LOSS_MASK, SEQ_LEN, TOKENS, TokenDataset, open_dataset
from .errors import ConfigError

__all__ = ["BLOCK_TOKENS", "RowsFn", "Staging", "check_target", "hf_fingerprint", "staging", "write_dataset"]

I32 = npt.NDArray[np.int32]
I64 = npt.NDArray[np.int64]
I8 = npt.NDArray[np.int8]

# ``rows(first, last)``: the flattened tokens (int32) and loss mask (int8) of rows [first, last).
RowsFn = Callable[[int, int], tuple[I32, I8]]

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

_STATE = "state.json"
_INFO = "dataset_info.json"


def check_target(out: str | os.PathLike[str]) -> Path:
    """``out`` as a path, or ``ConfigError("out")`` when it exists and is not an empty folder."""
    target = Path(out)
    if target.exists() and (not target.is_dir() or any(target.iterdir())):
        raise ConfigError("out", f"{target} exists and is not an empty folder; refusing to overwrite it")
    return target


def write_dataset(
    out: str | os.PathLike[str],
    lengths: I32,
    rows: RowsFn,
    *,
    identity: str,
    with_seq_len: bool = True,
    extra: Mapping[str, bytes] | None = None,
) -> TokenDataset:
    """Write the rows of ``lengths`` (all >= 1) into the new folder ``out``; return it opened.

    ``out`` must not exist or be an empty folder; the dataset is saved into a
    temporary sibling folder and renamed into place. ``rows(first, last)``
    must return ``sum(lengths[first:last])`` tokens and mask values. The
    ``datasets`` fingerprint in ``state.json`` is a hash of ``identity``, so
    the same identity and rows always write the same bytes. ``extra`` maps
    file names to contents written beside the dataset (a tokenizer, a
    manifest), in place before the folder appears.
    """
    offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, dtype=np.int64, out=offsets[1:])  # dtype: a cast in the loop, not a buffered copy (6x)
    large = int(offsets[-1]) >= _LARGE_LIST_TOKENS
    shards, batch_rows = _layout(offsets, large, with_seq_len)
    names = [f"data-{k:05d}-of-{len(shards) - 1:05d}.arrow" for k in range(len(shards) - 1)]
    with staging(out, large=large, with_seq_len=with_seq_len) as stage:
        paths = [stage.folder / name for name in names]
        _write_shards(
            paths,
            stage.schema,
            (
                (shard, _block(first, last, offsets, lengths, rows, stage.schema, large))
                for shard, first, last in _blocks(offsets, shards, batch_rows)
            ),
        )
        stage.seal(paths, hf_fingerprint(identity), extra)
    return open_dataset(out)


def hf_fingerprint(identity: str) -> str:
    """The ``datasets`` fingerprint (``state.json``'s ``_fingerprint``) of a dataset of this identity."""
    return hashlib.blake2b(identity.encode(), digest_size=8).hexdigest()


class Staging:
    """A dataset being written in a temporary folder beside its target (see ``staging``).

    Shards go into ``folder`` as Arrow IPC streams of ``schema`` (which
    carries ``datasets``' features metadata); ``seal`` names them, adds
    ``state.json``, ``dataset_info.json`` and the extra files, and renames the
    folder to the target.
    """

    def __init__(self, target: Path, folder: Path, probe: Path, schema: pa.Schema) -> None:
        self.target = target
        self.folder = folder
        self.schema = schema
        self._probe = probe
        self.sealed = False

    def seal(self, shards: list[Path], fingerprint: str, extra: Mapping[str, bytes] | None = None) -> None:
        """Name ``shards`` (in order, in ``folder``) ``data-K-of-N.arrow``; move the folder into place.

        ``fingerprint`` becomes ``state.json``'s ``_fingerprint``; ``extra``
        maps file names to contents written beside the shards first.
        """
        names = [f"data-{k:05d}-of-{len(shards):05d}.arrow" for k in range(len(shards))]
        for path, name in zip(shards, names, strict=True):
            if path.name != name:
                os.replace(path, self.folder / name)
        state = json.loads((self._probe / _STATE).read_text(encoding="utf-8"))
        state["_data_files"] = [{"filename": name} for name in names]
        state["_fingerprint"] = fingerprint
        with open(self.folder / _STATE, "w", encoding="utf-8") as state_file:
            json.dump(state, state_file, indent=2, sort_keys=True)
        os.replace(self._probe / _INFO, self.folder / _INFO)
        for name, content in (extra or {}).items():
            (self.folder / name).write_bytes(content)
        os.replace(self.folder, self.target)
        self.sealed = True


@contextlib.contextmanager
def staging(
    out: str | os.PathLike[str], *, large: bool = False, with_seq_len: bool = True
) -> Iterator[Staging]:
    """A ``Staging`` for the new dataset folder ``out``, its temporary folder removed at exit.

    ``out`` must not exist or be an empty folder (``ConfigError("out")``).
    Everything is written into ``.OUT.ladle-write-*`` beside ``out`` and
    appears at ``out`` only when ``Staging.seal`` renames it there, so a
    failure (an exception here, or a crash) never leaves a folder at ``out``
    that looks like a dataset.
    """
    target = check_target(out)
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=f".{target.name}.ladle-write-", dir=target.parent) as tmp:
        probe = Path(tmp, "probe")
        schema = _save_probe(probe, _probe_row(_schema(large, with_seq_len)), "0" * 16)
        folder = Path(tmp, "dataset")
        folder.mkdir()
        yield Staging(target, folder, probe, schema)


def _probe_row(schema: pa.Schema) -> pa.RecordBatch:
    """One row of ``schema`` (one token): all ``save_to_disk`` needs to write the schema and metadata."""
    columns = [pa.array([[1]], type=schema.field(k).type) for k in range(2)]
    if len(schema) == 3:
        columns.append(pa.array([1], type=pa.int32()))
    return pa.RecordBatch.from_arrays(columns, schema=schema)


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
    first: int, last: int, offsets: I64, lengths: I32, rows: RowsFn, schema: pa.Schema, large: bool
) -> pa.RecordBatch:
    """Rows ``[first, last)`` as one record batch."""
    tokens, mask = rows(first, last)
    local = offsets[first : last + 1] - offsets[first]
    list_array = pa.LargeListArray if large else pa.ListArray
    list_offsets = pa.array(local if large else local.astype(np.int32))
    columns = [
        list_array.from_arrays(list_offsets, pa.array(tokens)),
        list_array.from_arrays(list_offsets, pa.array(mask)),
    ]
    if len(schema) == 3:
        columns.append(pa.array(lengths[first:last]))
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
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="ladle-dataset-writer") as pool:
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
