"""Opening and validating a tokenized dataset saved with ``datasets.Dataset.save_to_disk``.

``open_dataset`` either returns a ``TokenDataset`` whose ``input_ids`` and
``loss_mask`` agree row by row (and with ``seq_len`` when present), with no
null and no empty row, or raises a typed ``DatasetError`` that names the path,
the column and the first offending rows. It reads only Arrow metadata, list
offsets and a fixed sample of tokens from the memory-mapped shards, so opening
costs time and memory proportional to the number of rows, never to the number
of tokens (the sampled reads do pull the kernel's read-ahead around each of
them into page cache: up to ``FINGERPRINT_SAMPLE`` x 8 MiB per column). The
checks run in Arrow's compute kernels over whole columns, not in a Python
loop over record batches (``save_to_disk`` writes one per 1,000 rows: 10^5
of them for 10^8 rows), and the row lengths are kept as 4 bytes a row.

Token values themselves are not scanned (no vocabulary or sign check): that
would read every token, and it is left to whoever assembles batches.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import stat
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import datasets
import numpy as np
import numpy.typing as npt
import pyarrow as pa
import pyarrow.compute as pc

from .errors import (
    ConfigError,
    DatasetChangedError,
    DatasetError,
    DatasetNotFoundError,
    EmptyDatasetError,
    LengthMismatchError,
    MissingColumnsError,
    ZeroLengthRowsError,
)

__all__ = [
    "FINGERPRINT_SAMPLE",
    "IGNORE_INDEX",
    "LABELS",
    "LOSS_MASK",
    "REQUIRED_COLUMNS",
    "SEQ_LEN",
    "TOKENS",
    "Columns",
    "DataFile",
    "TokenDataset",
    "open_dataset",
    "parse_columns",
]

I64 = npt.NDArray[np.int64]
# Row lengths: int32 from a list column (32-bit offsets), int64 from a large_list one.
Lengths = npt.NDArray[np.int32] | npt.NDArray[np.int64]
log = logging.getLogger("ladle.dataset")

TOKENS = "input_ids"
LOSS_MASK = "loss_mask"
SEQ_LEN = "seq_len"
LABELS = "labels"
# A label of this value carries no loss (the Hugging Face convention: torch's cross-entropy ignore_index).
IGNORE_INDEX = -100
# The columns of ladle's own format (what `ladle make-dataset` writes), read when nothing else is said.
REQUIRED_COLUMNS: tuple[str, ...] = (TOKENS, LOSS_MASK)
MaskFrom = Literal["loss_mask", "labels", "none"]
# The roles `--column ROLE=NAME` can name.
_ROLES = (TOKENS, LOSS_MASK, LABELS)

# Tokens of each list column hashed into the fingerprint, at evenly spaced
# positions of the column's flattened values. Few on purpose: each read of a
# memory-mapped shard makes the kernel read ahead (8 MiB here), so 4096 samples
# pulled a whole multi-GB dataset into page cache at start-up; 64 read at most
# about 0.5 GiB per column.
FINGERPRINT_SAMPLE = 64
_FINGERPRINT_TAG = b"ladle-dataset-v1"
# How many offending rows an error message lists.
_FIRST_ROWS = 5


@dataclass(frozen=True)
class DataFile:
    """One memory-mapped Arrow file of a dataset, as it was when the dataset was opened."""

    path: str
    size: int
    mtime_ns: int
    inode: int

    @classmethod
    def of(cls, path: str) -> DataFile:
        st = os.stat(path)
        return cls(path, st.st_size, st.st_mtime_ns, st.st_ino)

    def change(self) -> str | None:
        """How the file on disk differs from when it was opened (one ``stat``), or None."""
        try:
            st = os.stat(self.path)
        except OSError as exc:
            return f"it can no longer be found or read ({exc.strerror or exc})"
        if st.st_ino != self.inode:
            return "it was replaced by another file"
        if st.st_size < self.size:
            return f"it was truncated from {self.size} to {st.st_size} bytes"
        if st.st_size != self.size:
            return f"its size changed from {self.size} to {st.st_size} bytes"
        if st.st_mtime_ns != self.mtime_ns:
            return "it was rewritten in place (its modification time changed)"
        return None


@dataclass(frozen=True)
class Columns:
    """Which stored columns are served: the token ids, and where each token's loss weight comes from.

    ``mask_from`` is ``"loss_mask"`` (the weights stored in the column
    ``mask``), ``"labels"`` (the column ``mask`` holds Hugging Face labels:
    weight 1 where the label is not ``IGNORE_INDEX``, 0 where it is; no other
    label value is read, the trainer shifts ``input_ids``) or ``"none"`` (no
    such column: every token carries loss, as in pretraining). The default is
    ladle's own format: ``input_ids`` and ``loss_mask``.
    """

    input_ids: str = TOKENS
    mask_from: MaskFrom = "loss_mask"
    mask: str | None = LOSS_MASK

    @property
    def default(self) -> bool:
        return self == Columns()

    def describe(self) -> str:
        """One line for people: ``token ids from 'input_ids', loss where 'labels' is not -100``."""
        where = f"token ids from {self.input_ids!r}, "
        if self.mask_from == "loss_mask":
            return where + f"loss weights from {self.mask!r}"
        if self.mask_from == "labels":
            return where + f"loss where {self.mask!r} is not {IGNORE_INDEX}"
        return where + "loss on every token (no loss_mask or labels column)"

    def as_dict(self) -> dict[str, str | None]:
        return {"input_ids": self.input_ids, "mask_from": self.mask_from, "mask": self.mask}


def parse_columns(specs: Sequence[str]) -> dict[str, str]:
    """``["input_ids=tokens", "labels=targets"]`` as ``{role: column}``, or ``ConfigError("column")``.

    Roles: ``input_ids``, ``loss_mask`` and ``labels`` (at most one of the last two).
    """
    found: dict[str, str] = {}
    for spec in specs:
        role, sep, name = spec.partition("=")
        role, name = role.strip(), name.strip()
        if not sep or not name:
            raise ConfigError("column", f"expected ROLE=NAME (e.g. input_ids=tokens), got {spec!r}")
        if role not in _ROLES:
            raise ConfigError("column", f"{spec!r}: the role must be one of {list(_ROLES)}, got {role!r}")
        if role in found and found[role] != name:
            raise ConfigError("column", f"{role} is named twice ({found[role]!r} and {name!r})")
        found[role] = name
    if LOSS_MASK in found and LABELS in found:
        raise ConfigError(
            "column",
            f"give loss_mask= or labels=, not both: the loss mask comes from one column "
            f"(got loss_mask={found[LOSS_MASK]!r} and labels={found[LABELS]!r})",
        )
    return found


@dataclass(frozen=True, eq=False)
class TokenDataset:
    """A validated, memory-mapped token dataset.

    Guarantees: ``num_rows >= 1``; ``lengths[i]`` (read-only; int32, or int64
    when ``input_ids`` is a large_list column) is the number of tokens of row
    ``i`` in ``input_ids``, equal to the length of its
    ``loss_mask`` and to its ``seq_len`` when ``has_seq_len``, and ``>= 1``;
    neither list column holds a null row or a null token. ``fingerprint`` (16
    hex characters) is the same for the same data in every process and on every
    machine, however the data was sharded; see ``open_dataset`` for what it
    covers. ``files`` are the memory-mapped Arrow files as they were when
    opened (empty for a table built in memory); ``file_ends[i]`` is the row
    after the last of ``files[i]`` (None when unknown: every file is checked).
    ``columns`` names the columns served (the token ids and the loss mask's
    source); "``input_ids``" and "``loss_mask``" above mean those columns.
    """

    path: str
    num_rows: int
    lengths: Lengths = field(repr=False)
    fingerprint: str
    has_seq_len: bool
    table: pa.Table = field(repr=False)
    files: tuple[DataFile, ...] = field(default=(), repr=False)
    file_ends: I64 | None = field(default=None, repr=False)
    columns: Columns = field(default_factory=Columns)

    def check_files(self, rows: I64 | None = None) -> None:
        """Raise ``DatasetChangedError`` if a data file was truncated, resized, rewritten or replaced.

        Costs one ``stat`` per file: with ``rows``, when there are more than
        twice as many files as rows, per file that holds one of those rows
        (the files a batch of them reads), so a dataset of 512 shards costs a
        batch about what one of 10 does. Call it before reading token pages: a read
        past the end of a truncated mapping is a SIGBUS that kills the process,
        and a file rewritten in place changes the bytes under the mapping. It
        narrows the window rather than closing it: a truncation between this
        check and the read still hits the mapping, which the compiled frame
        (``Assembler.frame``) turns into this error instead of a SIGBUS.
        """
        files: Sequence[DataFile] = self.files
        # picking the files costs about 10 us: worth it only when the rows can touch few of them
        if rows is not None and self.file_ends is not None and len(files) > 2 * max(len(rows), 4):
            held = np.unique(np.searchsorted(self.file_ends, rows, side="right"))
            files = [files[i] for i in held[held < len(files)].tolist()]
        for data_file in files:
            detail = data_file.change()
            if detail is not None:
                raise DatasetChangedError(self.path, data_file.path, detail)

    @property
    def num_tokens(self) -> int:
        """Total tokens over all rows."""
        return int(self.lengths.sum(dtype=np.int64))


def open_dataset(
    path: str | os.PathLike[str], columns: Mapping[str, str] | Sequence[str] | None = None
) -> TokenDataset:
    """Open and validate the dataset ``save_to_disk`` wrote into the folder ``path``.

    ``columns`` maps roles to column names (``{"input_ids": "tokens"}``, or the
    CLI's ``["input_ids=tokens"]``); unnamed, the token ids are ``input_ids``
    and the loss mask comes from ``loss_mask`` if the dataset has it, else from
    ``labels`` (1 where the label is not -100), else every token carries loss
    (see ``Columns``). No column is copied or converted: the mask is derived
    as batches are made.

    Raises ``DatasetNotFoundError`` when ``path`` does not exist,
    ``DatasetError`` when it is not one saved ``Dataset`` (a ``DatasetDict``
    folder, a plain folder, a dataset with an indices mapping, a column of the
    wrong type, a null row or token), ``MissingColumnsError``,
    ``EmptyDatasetError``, ``LengthMismatchError`` (``loss_mask``, ``labels`` or
    ``seq_len`` disagreeing with ``input_ids``), ``ZeroLengthRowsError`` or,
    for a bad ``columns``, ``ConfigError``.

    The fingerprint is a blake2b digest of a format tag, the row count, the
    column names and Arrow types, every row length, and ``FINGERPRINT_SAMPLE``
    tokens of ``input_ids`` and of ``loss_mask`` at evenly spaced positions of
    the flattened values. It changes whenever a length, a column, a type or a
    sampled token changes; it does NOT change when only tokens between the
    sampled positions change (same lengths), nor with the ``seq_len`` values
    (they must equal the lengths) or with metadata such as ``dataset_info.json``.
    When the columns served are not ``input_ids`` and ``loss_mask``, it also
    covers their names and the mask's source, and samples those columns.
    """
    if isinstance(columns, Mapping):  # checked as the CLI's are
        overrides = parse_columns([f"{role}={name}" for role, name in columns.items()])
    else:
        overrides = parse_columns(columns or ())
    given = os.fspath(path)
    if "://" in given:  # abspath would make /cwd/s3:/bucket/... of it
        raise DatasetNotFoundError(
            f"{given} is a URL: ladle reads a local folder that datasets' save_to_disk wrote "
            "(copy it to local disk or a mount first)"
        )
    where = os.path.abspath(given)
    if not os.path.exists(where) and re.fullmatch(r"[\w.-]+/[\w.-]+", given):
        raise DatasetNotFoundError(
            f"no dataset at {where}: the path does not exist; if {given!r} is a Hugging Face Hub id, "
            f"ladle reads local folders only (nothing is downloaded): save it once, tokenized, with "
            f"datasets.load_dataset({given!r}, split=...).map(...).save_to_disk(DIR)"
        )
    ds = _load(where)
    try:
        files = tuple(DataFile.of(str(entry["filename"])) for entry in ds.cache_files)
    except OSError as exc:
        raise DatasetError(f"{where}: a data file cannot be read: {exc}") from exc
    table = ds.data.table
    chosen = _choose_columns(where, table, overrides)
    _check_columns(where, table, chosen)
    _warn_ignored(where, table, chosen)
    num_rows = int(table.num_rows)
    if num_rows == 0:
        raise EmptyDatasetError(f"dataset {where} has no rows; ladle needs at least one")
    served = _served(chosen)
    for name in served:
        _check_list_nulls(where, name, table.column(name))
    row_lengths = pc.list_value_length(table.column(chosen.input_ids))
    if chosen.mask is not None:
        _check_equal(
            where,
            f"{chosen.mask} length disagrees with the length of {chosen.input_ids}",
            pc.list_value_length(table.column(chosen.mask)),
            row_lengths,
        )
    has_seq_len = SEQ_LEN in table.column_names
    if has_seq_len:
        seq = table.column(SEQ_LEN)
        if seq.null_count:
            rows = np.flatnonzero(_is_null(seq))
            raise DatasetError(
                f"dataset {where}: column {SEQ_LEN!r} is null in {len(rows)} row(s) "
                f"(first rows: {rows[:_FIRST_ROWS].tolist()})"
            )
        _check_equal(where, f"seq_len disagrees with the length of {chosen.input_ids}", seq, row_lengths)
    lengths: Lengths = row_lengths.to_numpy()
    del row_lengths
    pa.default_memory_pool().release_unused()  # the checks' column-long temporaries: 8 bytes a row
    if int(lengths.min()) == 0:
        empty = np.flatnonzero(lengths == 0)
        raise ZeroLengthRowsError(where, len(empty), empty[:_FIRST_ROWS].tolist())
    lengths.flags.writeable = False
    if chosen.mask_from == "labels":
        _check_labels(where, table, chosen, lengths)
    return TokenDataset(
        path=where,
        num_rows=num_rows,
        lengths=lengths,
        fingerprint=_fingerprint(table, lengths, chosen),
        has_seq_len=has_seq_len,
        table=table,
        files=files,
        file_ends=_file_ends(files, num_rows, ds.data),
        columns=chosen,
    )


def _served(columns: Columns) -> tuple[str, ...]:
    """The stored columns read for batches: the ids, and the mask's column if there is one."""
    return (columns.input_ids,) if columns.mask is None else (columns.input_ids, columns.mask)


def _choose_columns(where: str, table: Any, overrides: Mapping[str, str]) -> Columns:
    """The columns to serve: those named, else input_ids with loss_mask, labels or no mask column."""
    present = list(table.column_names)
    for role, name in overrides.items():
        if name not in present:
            token_lists = [n for n in present if _is_list_of_int(table.schema.field(n).type)]
            raise MissingColumnsError(where, [name], present, token_lists, role=role)
    ids = overrides.get(TOKENS, TOKENS)
    if ids not in present:
        token_lists = [n for n in present if _is_list_of_int(table.schema.field(n).type)]
        raise MissingColumnsError(where, [ids], present, token_lists, role=TOKENS)
    if LOSS_MASK in overrides:
        return Columns(ids, "loss_mask", overrides[LOSS_MASK])
    if LABELS in overrides:
        return Columns(ids, "labels", overrides[LABELS])
    if LOSS_MASK in present:
        return Columns(ids, "loss_mask", LOSS_MASK)
    if LABELS in present:
        return Columns(ids, "labels", LABELS)
    return Columns(ids, "none", None)


# Sampled labels that are neither -100 nor the token at their position, above which a warning says so.
_LABELS_DIFFER = 0.5


def _check_labels(where: str, table: Any, columns: Columns, lengths: Lengths) -> None:
    """Warn when sampled labels are mostly neither -100 nor their own token: labels stored shifted.

    ladle reads labels for the mask only (the trainer shifts input_ids), so
    labels already shifted by one would put every row's mask one token off.
    """
    assert columns.mask is not None
    positions = _sample_positions(int(lengths.sum(dtype=np.int64)))
    labels = _sample_values(table.column(columns.mask), positions)
    ids = _sample_values(table.column(columns.input_ids), positions)
    scored = labels != IGNORE_INDEX
    differ = int((scored & (labels != ids)).sum())
    if scored.any() and differ > _LABELS_DIFFER * int(scored.sum()):
        log.warning(
            "dataset %s: %d of %d sampled %r values that are not %d differ from the token at their "
            "position: ladle reads labels only for the loss mask (%d: no loss) and sends input_ids, which "
            "the trainer shifts; if these labels were stored already shifted by one, the mask is one token "
            "off (store them unshifted, as Hugging Face does, or store a loss_mask column)",
            where,
            differ,
            int(scored.sum()),
            columns.mask,
            IGNORE_INDEX,
            IGNORE_INDEX,
        )


def _file_ends(files: Sequence[DataFile], num_rows: int, data: Any = None) -> I64 | None:
    """The row after the last of each file (files hold the rows in order), or None if they do not add up.

    ``data`` is the ``datasets`` table: its memory-mapped blocks say how many
    rows each file holds. Without it (or when its blocks are not one file
    each), each file's record batches are counted from their headers, which
    maps the whole of a file of small rows into the process once more.
    """
    counts = _rows_by_block(data, files) if data is not None else None
    try:
        if counts is None:
            counts = []
            for data_file in files:
                with pa.memory_map(data_file.path) as source:  # the batches' headers only: no token page
                    counts.append(sum(batch.num_rows for batch in pa.ipc.open_stream(source)))
    except (OSError, pa.ArrowException):
        return None
    ends = np.cumsum(np.asarray(counts, dtype=np.int64))
    if not ends.size or int(ends[-1]) != num_rows:
        return None
    ends.flags.writeable = False
    return ends


def _rows_by_block(data: Any, files: Sequence[DataFile]) -> list[int] | None:
    """Rows of each file, from the ``datasets`` table's memory-mapped blocks (one a file, in order), or None.

    ``datasets.load_from_disk`` concatenates one ``MemoryMappedTable`` a file
    (a ``ConcatenationTable`` of one block a row) or, for one file, returns
    that table itself.
    """
    blocks = getattr(data, "blocks", None)
    rows = [[data]] if blocks is None else blocks
    if any(len(row) != 1 for row in rows):
        return None
    paths = [getattr(row[0], "path", None) for row in rows]
    if paths != [data_file.path for data_file in files]:
        return None
    return [int(row[0].num_rows) for row in rows]


def _load(where: str) -> Any:
    """The ``datasets.Dataset`` in ``where``, memory-mapped, or a typed error."""
    folder = Path(where)
    if not folder.exists():
        raise DatasetNotFoundError(f"no dataset at {where}: the path does not exist")
    if not folder.is_dir():
        if (folder.parent / "state.json").is_file():
            hint = f"; this file belongs to a saved dataset: pass its folder, {folder.parent}"
        elif folder.suffix == ".arrow":  # a load_dataset cache file
            hint = f"; convert it once: datasets.Dataset.from_file({str(folder)!r}).save_to_disk(OUT)"
        elif folder.suffix in (".parquet", ".jsonl", ".json", ".csv"):
            kind = {".jsonl": "json"}.get(folder.suffix, folder.suffix[1:])
            hint = f"; convert it once: datasets.Dataset.from_{kind}({str(folder)!r}).save_to_disk(OUT)"
        else:
            hint = ""
        raise DatasetError(
            f"{where} is a file; pass the folder that datasets.Dataset.save_to_disk wrote{hint}"
        )
    dict_json = folder / "dataset_dict.json"
    if dict_json.is_file() and not (folder / "state.json").is_file():
        splits = _splits(dict_json)
        example = folder / (splits[0] if splits else "<split>")
        raise DatasetError(
            f"{where} holds a DatasetDict (splits {splits}); pass one split's folder, e.g. {example}"
        )
    for name in ("state.json", "dataset_info.json"):
        _check_regular(where, folder / name, missing_ok=True)
    missing = [name for name in ("state.json", "dataset_info.json") if not (folder / name).is_file()]
    if missing:
        cache = " (a load_dataset cache folder is not one)" if any(folder.glob("*.arrow")) else ""
        raise DatasetError(
            f"{where} is not a saved dataset{cache}: it has no {' and no '.join(missing)}; write it "
            "with datasets.Dataset.save_to_disk and pass that folder"
        )
    state = _json_object(where, folder / "state.json")
    _json_object(where, folder / "dataset_info.json")  # datasets.load_from_disk fails with a traceback
    data_files = state.get("_data_files")
    if data_files == []:
        # save_to_disk writes no shard at all for a dataset without rows
        raise EmptyDatasetError(f"dataset {where} has no rows; ladle needs at least one")
    if not isinstance(data_files, list) or not all(
        isinstance(entry, dict) and isinstance(entry.get("filename"), str) and entry["filename"]
        for entry in data_files
    ):
        found = _shown(data_files) if "_data_files" in state else "missing"
        raise DatasetError(
            f"{where}: state.json's _data_files is {found}, not the list of "
            '{"filename": ...} that save_to_disk writes'
        )
    for entry in data_files:  # as datasets.load_from_disk joins them
        _check_regular(where, folder / entry["filename"], missing_ok=False)
    try:
        ds = datasets.load_from_disk(where, keep_in_memory=False)
    except (OSError, ValueError, KeyError, IndexError, TypeError, pa.ArrowException) as exc:
        short = re.search(r"Expected to (be able to )?read \d+", str(exc)) is not None
        hint = " (a data file is shorter than its header says: still being written, or cut short?)"
        raise DatasetError(
            f"{where} could not be opened as a saved dataset{hint if short else ''}: {exc}"
        ) from exc
    if isinstance(ds, datasets.DatasetDict):
        raise DatasetError(f"{where} holds a DatasetDict (splits {sorted(ds)}); pass one split's folder")
    if getattr(ds, "_indices", None) is not None:
        raise DatasetError(
            f"dataset {where} has an indices mapping (from select/shuffle/filter); call "
            "ds.flatten_indices() before save_to_disk so rows are stored in order"
        )
    return ds


def _check_regular(where: str, path: Path, *, missing_ok: bool) -> None:
    """``DatasetError`` naming ``path`` unless it is a regular file (or a link to one), checked with
    one ``stat`` before anything opens it: opening a FIFO waits for a writer, and serve hung silently."""
    named = str(path) if len(str(path)) <= 300 else str(path)[:297] + "..."  # a name state.json gave
    try:
        mode = os.stat(path).st_mode
    except (FileNotFoundError, NotADirectoryError):
        if missing_ok:
            return
        raise DatasetError(f"{where}: the data file {named} does not exist (state.json lists it)") from None
    except (OSError, ValueError) as exc:  # ValueError: a name with a NUL character
        raise DatasetError(
            f"{where}: {named} cannot be read: {getattr(exc, 'strerror', None) or exc}"
        ) from exc
    if stat.S_ISREG(mode):
        return
    kinds = (
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISFIFO, "a FIFO (named pipe)"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
    )
    kind = next((kind for test, kind in kinds if test(mode)), "not a regular file")
    raise DatasetError(
        f"{where}: {named} is {kind}, not a regular file: ladle reads only files save_to_disk wrote"
    )


def _json_object(where: str, path: Path) -> dict[str, Any]:
    """The JSON object in ``path`` (a metadata file of the dataset), else ``DatasetError`` naming it."""
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise DatasetError(f"{where}: {path.name} is unreadable: {exc}") from exc
    if not isinstance(value, dict):
        raise DatasetError(
            f"{where}: {path.name} holds {_shown(value)}, not the JSON object save_to_disk writes"
        )
    return value


def _shown(value: object) -> str:
    """A JSON value for an error message: its kind, and itself if short."""
    kind = {list: "an array", dict: "an object", str: "a string", bool: "a boolean", type(None): "null"}
    name = kind.get(type(value), "a number")
    text = json.dumps(value)
    return name if value is None else f"{name}, {text if len(text) <= 60 else text[:57] + '...'}"


def _splits(dict_json: Path) -> list[str]:
    try:
        splits = json.loads(dict_json.read_text(encoding="utf-8")).get("splits", [])
    except (OSError, ValueError, AttributeError):
        return []
    return [str(s) for s in splits] if isinstance(splits, list) else []


def _is_list_of_int(arrow_type: Any) -> bool:
    return bool(
        (pa.types.is_list(arrow_type) or pa.types.is_large_list(arrow_type))
        and pa.types.is_integer(arrow_type.value_type)
    )


def _check_columns(where: str, table: Any, columns: Columns) -> None:
    present = list(table.column_names)
    schema = table.schema
    problems = []  # every column's, so one run names them all
    for name in _served(columns):
        arrow_type = schema.field(name).type
        if (
            columns.mask_from == "labels"
            and name == columns.mask
            and _is_list_of_int(arrow_type)
            and not pa.types.is_signed_integer(arrow_type.value_type)
        ):
            problems.append(
                f"column {name!r} (labels) has Arrow type {arrow_type}: unsigned labels cannot hold "
                f"{IGNORE_INDEX}, the value that marks a token without loss"
            )
        elif not _is_list_of_int(arrow_type):
            value_type = getattr(arrow_type, "value_type", None)
            hint = ""
            if value_type is not None and pa.types.is_boolean(value_type):
                hint = f" (cast it before save_to_disk: ds.cast_column({name!r}, Sequence(Value('int8'))))"
            elif pa.types.is_fixed_size_list(arrow_type) and pa.types.is_integer(value_type):
                hint = (
                    f" (cast it to a variable-length list before save_to_disk: "
                    f"ds.cast_column({name!r}, Sequence(Value({str(value_type)!r}))))"
                )
            elif (
                columns.mask_from == "loss_mask"
                and name == columns.mask
                and value_type is not None
                and pa.types.is_floating(value_type)
            ):
                hint = (
                    " (the mask goes to the trainer as int8 weights, usually 0 or 1: if those are its values,"
                    f" ds.cast_column({name!r}, Sequence(Value('int8'))) before save_to_disk)"
                )
            problems.append(f"column {name!r} has Arrow type {arrow_type}{hint}")
    if problems:
        raise DatasetError(
            f"dataset {where}: {'; '.join(problems)}; expected lists (or large_lists) of integers"
            + (" (signed, for labels)" if columns.mask_from == "labels" else "")
        )
    if SEQ_LEN in present:
        arrow_type = schema.field(SEQ_LEN).type
        if not pa.types.is_integer(arrow_type):
            raise DatasetError(
                f"dataset {where}: column {SEQ_LEN!r} has Arrow type {arrow_type}; "
                "expected an integer (one length per row)"
            )


# Columns a tokenized dataset often has that ladle does not read, and what it does instead.
_IGNORED = {
    "attention_mask": "attention_mask comes from each row's length: every stored token is taken as "
    "real, so rows saved padded are served with their padding as tokens (save them unpadded)",
    LABELS: "the loss mask comes from loss_mask; labels would be read only without one "
    "(or with --column labels=labels)",
}
# Rows of an attention_mask column whose two ends are read for padding (evenly spaced: a few pages).
PADDING_SAMPLE = 256


def _warn_ignored(where: str, table: pa.Table, columns: Columns) -> None:
    if not columns.default:
        log.info("dataset %s: %s", where, columns.describe())
    for name in table.column_names:
        if name not in _IGNORED or name in _served(columns):
            continue
        if name == LABELS:  # beside a loss_mask, which wins: usual, nothing to fix
            log.info("dataset %s: column %r is not read: %s", where, name, _IGNORED[name])
            continue
        padded, sampled = _padded_ends(table.column(name)) if name == "attention_mask" else (0, 0)
        if sampled and not padded:  # what a tokenizer writes for unpadded rows (all ones): nothing to fix
            log.info(
                "dataset %s: column %r is not read (no padding in %d rows sampled)", where, name, sampled
            )
        elif padded:
            log.warning(
                "dataset %s: %d of %d sampled rows end in padding (%r is 0 at a row's start or end): %s",
                where,
                padded,
                sampled,
                name,
                _IGNORED[name],
            )
        else:
            log.warning("dataset %s: column %r is not read: %s", where, name, _IGNORED[name])


def _padded_ends(column: Any) -> tuple[int, int]:
    """(rows with a 0 at either end, non-empty rows looked at) among ``PADDING_SAMPLE`` rows of a list column.

    (0, 0) when the column is not a list of numbers.
    """
    rows = len(column)
    if not rows:
        return 0, 0
    picks = np.unique(np.linspace(0, rows - 1, num=min(rows, PADDING_SAMPLE)).astype(np.int64))
    try:
        taken = column.take(pa.array(picks)).combine_chunks()
        offsets = np.asarray(taken.offsets.to_numpy(), dtype=np.int64)
        starts, ends = offsets[:-1], offsets[1:]
        full = ends > starts
        firsts = pc.take(taken.values, pa.array(starts[full])).to_numpy(zero_copy_only=False)
        lasts = pc.take(taken.values, pa.array(ends[full] - 1)).to_numpy(zero_copy_only=False)
    except (pa.ArrowException, AttributeError, TypeError, ValueError):
        return 0, 0
    return int(((firsts == 0) | (lasts == 0)).sum()), int(full.sum())


def _is_null(column: Any) -> npt.NDArray[np.bool_]:
    return np.asarray(column.is_null().to_numpy(zero_copy_only=False), dtype=np.bool_)


def _values(chunk: Any) -> Any:
    """The flattened values of one list chunk, respecting the chunk's own slice."""
    offsets = chunk.offsets
    first = offsets[0].as_py()
    return chunk.values.slice(first, offsets[len(offsets) - 1].as_py() - first)


def _check_list_nulls(where: str, name: str, column: Any) -> None:
    """No null row and no null token in the list column ``name``."""
    if column.null_count:
        rows = np.flatnonzero(_is_null(column))
        raise DatasetError(
            f"dataset {where}: column {name!r} is null in {len(rows)} row(s) "
            f"(first rows: {rows[:_FIRST_ROWS].tolist()})"
        )
    if not pc.list_flatten(column).null_count:  # each chunk's own slice of its values, in Arrow
        return
    base = 0
    for chunk in column.chunks:
        if chunk.values.null_count and _values(chunk).null_count:
            parents = np.asarray(pc.list_parent_indices(chunk).to_numpy(), dtype=np.int64)
            nulls = _is_null(pc.list_flatten(chunk))
            rows = np.unique(parents[nulls]) + base
            raise DatasetError(
                f"dataset {where}: column {name!r} has null token(s) in {len(rows)} row(s) "
                f"of one Arrow chunk (first rows: {rows[:_FIRST_ROWS].tolist()})"
            )
        base += len(chunk)


def _check_equal(where: str, what: str, actual: Any, expected: Any) -> None:
    """``LengthMismatchError`` naming the rows where two integer columns (Arrow, chunked) differ."""
    try:
        if pc.all(pc.equal(actual, expected)).as_py():
            return
    except pa.ArrowNotImplementedError:  # types without a common one (uint64 against int32): numpy
        pass
    bad = np.flatnonzero(
        np.asarray(actual.to_numpy(), dtype=np.int64) != np.asarray(expected.to_numpy(), dtype=np.int64)
    )
    if len(bad):
        raise LengthMismatchError(where, what, len(bad), bad[:_FIRST_ROWS].tolist())


def _sample_positions(total: int, count: int = FINGERPRINT_SAMPLE) -> I64:
    """``min(total, count)`` evenly spaced positions in ``[0, total)``, first and last included."""
    if total <= count:
        return np.arange(total, dtype=np.int64)
    return (np.arange(count, dtype=np.int64) * (total - 1)) // (count - 1)


def _sample_values(column: Any, positions: I64) -> I64:
    """The flattened values of a list column at sorted ``positions``, reading only the chunks they fall in."""
    flat = pc.list_flatten(column)  # each chunk's values, as its offsets slice them
    sizes = np.fromiter((len(chunk) for chunk in flat.chunks), dtype=np.int64, count=flat.num_chunks)
    starts = np.cumsum(sizes) - sizes
    which = np.searchsorted(starts + sizes, positions, side="right")
    out = np.empty(len(positions), dtype=np.int64)
    for c in np.unique(which).tolist():
        picked = which == c
        values = np.asarray(flat.chunk(c).to_numpy(zero_copy_only=False))
        out[picked] = values[positions[picked] - starts[c]]
    return out


# Lengths are hashed as int64 in blocks of this many rows (no copy of the whole array).
_HASH_BLOCK = 1 << 20


def _fingerprint(table: Any, lengths: Lengths, columns: Columns) -> str:
    digest = hashlib.blake2b(_FINGERPRINT_TAG, digest_size=8)
    digest.update(struct.pack("<q", int(table.num_rows)))
    for schema_field in table.schema:
        digest.update(f"\0{schema_field.name}\0{schema_field.type}".encode())
    digest.update(b"\0lengths")
    for first in range(0, len(lengths), _HASH_BLOCK):  # the bytes of lengths.astype("<i8"), a block at a time
        digest.update(np.ascontiguousarray(lengths[first : first + _HASH_BLOCK], dtype="<i8").data)
    positions = _sample_positions(int(lengths.sum(dtype=np.int64)))
    if not columns.default:  # ladle's own columns hash as before: their jobs keep their fingerprint
        digest.update(f"\0columns\0{columns.input_ids}\0{columns.mask_from}\0{columns.mask or ''}".encode())
    for name in _served(columns):
        digest.update(f"\0{name}".encode())
        digest.update(_sample_values(table.column(name), positions).astype("<i8").tobytes())
    return digest.hexdigest()
