"""The inputs of ``ladle make-dataset``, read as a stream of raw batches in a fixed order.

Guarantee: the same files (bytes, and the order given; folders walked in
sorted order) give the same batches, so the output does not depend on how
many workers tokenize them; memory is a few batches (about ``BATCH_BYTES``
of input each), whatever the input size. The trade-off: batches are raw
(JSONL lines as bytes, Arrow record batches as IPC bytes, text files'
text), so the main process does no parsing and the workers do it all, but a
record's problems are found only when a worker reaches it.

A problem with a whole source is raised as it is found: a path that does not
exist or cannot be read (``UnreadableFileError``), an empty file or one with
no records (``EmptySourceError``), a truncated or corrupt compressed file or
Parquet file, or a folder that is not a ``save_to_disk`` dataset
(``CorruptFileError``), a named column the schema lacks
(``SourceColumnError``, naming the columns present).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import pyarrow as pa

from ..errors import (
    CorruptFileError,
    EmptySourceError,
    SourceColumnError,
    TextSourceError,
    UnreadableFileError,
)
from ..text import _PYTHON_SUFFIXES, Split, _files, read_text

__all__ = [
    "BATCH_BYTES",
    "BATCH_ROWS",
    "Format",
    "RawBatch",
    "Source",
    "arrow_batch",
    "jsonl_records",
]

Format = Literal["jsonl", "parquet", "hf", "text"]

# A raw batch holds about this much input, or at most BATCH_ROWS records.
BATCH_BYTES = 1 << 20
BATCH_ROWS = 4096
_READ_BYTES = 1 << 20
_CODECS = {".gz": "gzip", ".zst": "zstd", ".zstd": "zstd", ".bz2": "bz2", ".lz4": "lz4"}


@dataclass
class RawBatch:
    """Input for one worker task: ``kind`` says how ``payload`` is read.

    ``jsonl``: a list of lines (bytes), line ``first`` first (1-based, blank
    lines kept so the numbers hold); ``arrow``: one record batch as Arrow IPC
    stream bytes, row ``first`` first (0-based); ``text``: a list of
    ``(path, text, is_python)`` files. ``work`` is the progress it stands for
    (input bytes, or rows for Arrow sources); ``source`` names the file.
    """

    kind: Literal["jsonl", "arrow", "text"]
    source: str
    first: int
    payload: Any
    work: int
    last_of_source: bool = False
    records: int = 0


@dataclass
class Source:
    """Where the records come from: one format, its paths, and what to read of them.

    For text: ``split``,
    ``include``, ``exclude`` as ``make_text_dataset`` takes them;
    ``skipped`` collects the ``(path, why)`` of files in folders that could
    not be used.
    """

    format: Format
    paths: Sequence[str]
    split: Split = "documents"
    include: Sequence[str] = ()
    exclude: Sequence[str] = ()
    skipped: list[tuple[str, str]] = field(default_factory=list)
    files: int = 0

    def total_work(self) -> int | None:
        """The ``work`` all batches add up to (for the ETA), or None when unknown before reading."""
        if self.format in ("jsonl", "text"):
            return _disk_size(self._file_list())
        if self.format == "parquet":
            import pyarrow.parquet as pq

            rows = 0
            for path in self.paths:
                try:
                    rows += pq.ParquetFile(path).metadata.num_rows
                except (OSError, pa.ArrowException):
                    return None
            return rows
        return None

    def _file_list(self) -> list[str]:
        if self.format == "text":
            try:
                return [path for path, _ in _files(self.paths, self.include, self.exclude)]
            except TextSourceError:
                return []
        return list(self.paths)

    def batches(self, columns: Sequence[str]) -> Iterator[RawBatch]:
        """The raw batches of every path, in order (see the module docstring for the errors).

        ``columns`` are the record fields the options name (checked against a
        Parquet or ``save_to_disk`` schema up front, and all an Arrow batch holds).
        """
        if self.format == "jsonl":
            for path in self.paths:
                yield from _jsonl_batches(path)
        elif self.format == "parquet":
            for path in self.paths:
                yield from _parquet_batches(path, columns)
        elif self.format == "hf":
            for path in self.paths:
                yield from _hf_batches(path, columns)
        else:
            yield from self._text_batches()

    def texts(self, columns: Sequence[str]) -> Iterator[str]:
        """Every text of ``columns``, in order, read here (for training a BPE tokenizer)."""
        from .encode import text_values

        for batch in self.batches(columns):
            yield from text_values(batch, columns, self.split)

    def _text_batches(self) -> Iterator[RawBatch]:
        self.skipped.clear()
        self.files = 0
        files: list[tuple[str, str, bool]] = []
        size = 0
        first = 0
        for path, given in _files(self.paths, self.include, self.exclude):
            try:
                text = read_text(path)
            except TextSourceError as exc:
                if given:
                    raise
                self.skipped.append((path, exc.detail))
                continue
            self.files += 1
            files.append((path, text, path.removesuffix(".gz").endswith(_PYTHON_SUFFIXES)))
            size += len(text)
            if size >= BATCH_BYTES:
                yield RawBatch(
                    "text", path, first, files, _disk_size(f[0] for f in files), records=len(files)
                )
                first += len(files)
                files, size = [], 0
        if files:
            yield RawBatch(
                "text", files[-1][0], first, files, _disk_size(f[0] for f in files), records=len(files)
            )


def _disk_size(paths: Any) -> int:
    total = 0
    for path in paths:
        with contextlib.suppress(OSError):
            total += os.path.getsize(path)
    return total


def _check_file(path: str) -> int:
    """The size of a regular, readable, non-empty file, or its typed error."""
    try:
        size = os.stat(path).st_size
    except OSError as exc:
        raise UnreadableFileError(
            path,
            "does not exist"
            if isinstance(exc, FileNotFoundError)
            else (f"cannot be read: {exc.strerror or exc}"),
        ) from None
    if os.path.isdir(path):
        raise UnreadableFileError(path, "is a folder, not a file")
    if size == 0:
        raise EmptySourceError(path, "is empty")
    return size


def _jsonl_batches(path: str) -> Iterator[RawBatch]:
    """A JSONL file's lines in batches, ``.gz``/``.zst``/``.bz2`` decompressed as they stream."""
    _check_file(path)
    codec = next((c for suffix, c in _CODECS.items() if path.endswith(suffix)), None)
    try:
        raw = pa.OSFile(path, "rb")
    except OSError as exc:
        raise UnreadableFileError(path, f"cannot be read: {exc}") from None
    with raw:
        stream: Any = pa.CompressedInputStream(raw, codec) if codec else raw
        line_no = 1  # of the batch's first line
        records = 0  # in the batch
        seen = 0  # in the file
        done = 0  # bytes of the file read by the batches out
        rest = b""
        lines: list[bytes] = []
        size = 0
        while True:
            try:
                chunk = stream.read(_READ_BYTES)
            except (OSError, pa.ArrowException) as exc:
                kind = f"{codec} " if codec else ""
                raise CorruptFileError(path, f"is a truncated or corrupt {kind}file ({exc})") from None
            if not chunk:
                break
            parts = (rest + chunk).split(b"\n")
            rest = parts.pop()
            for line in parts:
                lines.append(line)
                size += len(line) + 1
                if line.strip():
                    records += 1
                if size >= BATCH_BYTES or len(lines) >= BATCH_ROWS:
                    now = raw.tell()
                    yield RawBatch("jsonl", path, line_no, lines, now - done, records=records)
                    seen += records
                    line_no += len(lines)
                    done, lines, size, records = now, [], 0, 0
        if rest:
            lines.append(rest)
            records += bool(rest.strip())
        if seen + records == 0:
            raise EmptySourceError(path, "holds no records (only blank lines)")
        yield RawBatch("jsonl", path, line_no, lines, raw.tell() - done, True, records)


def jsonl_records(lines: Sequence[bytes]) -> Iterator[bytes]:
    """The non-blank lines (the records) of a JSONL batch."""
    return (line for line in lines if line.strip())


def arrow_batch(batch: RawBatch) -> pa.RecordBatch:
    """The record batch of an ``arrow`` raw batch."""
    with pa.ipc.open_stream(pa.BufferReader(batch.payload)) as reader:
        return reader.read_next_batch()


def _ipc(batch: pa.RecordBatch) -> bytes:
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, batch.schema) as writer:
        writer.write_batch(batch)
    return bytes(sink.getvalue())


def _check_columns(path: str, schema: pa.Schema, columns: Sequence[str]) -> None:
    missing = [name for name in columns if name not in schema.names]
    if missing:
        raise SourceColumnError(path, missing, list(schema.names))


def _batch_rows(row_bytes: float) -> int:
    """Rows per Arrow batch: about ``BATCH_BYTES`` of them, at least 1 and at most ``BATCH_ROWS``."""
    return max(1, min(BATCH_ROWS, int(BATCH_BYTES / max(row_bytes, 1.0))))


def _parquet_batches(path: str, columns: Sequence[str]) -> Iterator[RawBatch]:
    import pyarrow.parquet as pq

    _check_file(path)
    try:
        parquet = pq.ParquetFile(path)
    except (OSError, pa.ArrowException) as exc:
        raise CorruptFileError(path, f"is not a readable Parquet file ({exc})") from None
    with parquet:
        _check_columns(path, parquet.schema_arrow, columns)
        if parquet.metadata.num_rows == 0:
            raise EmptySourceError(path, "holds no rows")
        first = 0
        metadata = parquet.metadata
        row_bytes = sum(metadata.row_group(k).total_byte_size for k in range(metadata.num_row_groups))
        size = _batch_rows(row_bytes / metadata.num_rows)
        try:
            for batch in parquet.iter_batches(batch_size=size, columns=list(columns)):
                yield RawBatch("arrow", path, first, _ipc(batch), batch.num_rows, records=batch.num_rows)
                first += batch.num_rows
        except (OSError, pa.ArrowException) as exc:
            raise CorruptFileError(path, f"cannot be read past row {first} ({exc})") from None
    yield RawBatch("arrow", path, first, None, 0, True)


def _hf_batches(path: str, columns: Sequence[str]) -> Iterator[RawBatch]:
    import datasets

    if not Path(path).is_dir():
        raise UnreadableFileError(path, "is not a folder (--from-hf takes a save_to_disk folder)")
    try:
        loaded = datasets.load_from_disk(path)
    except (OSError, ValueError, pa.ArrowException) as exc:
        raise CorruptFileError(path, f"is not a datasets save_to_disk folder ({exc})") from None
    if isinstance(loaded, datasets.DatasetDict):
        raise CorruptFileError(
            path,
            f"holds the splits {list(loaded)}: give one of them (e.g. {path}/{next(iter(loaded), 'train')})",
        )
    table = loaded.data.table
    _check_columns(path, table.schema, columns)
    if loaded.num_rows == 0:
        raise EmptySourceError(path, "holds no rows")
    first = 0
    table = table.select(list(columns))
    for batch in table.to_batches(max_chunksize=_batch_rows(table.nbytes / table.num_rows)):
        yield RawBatch("arrow", path, first, _ipc(batch), batch.num_rows, records=batch.num_rows)
        first += batch.num_rows
    yield RawBatch("arrow", path, first, None, 0, True)
