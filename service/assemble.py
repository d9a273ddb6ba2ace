"""A batch's frame, gathered and padded straight from the memory-mapped Arrow buffers.

``Assembler.frame`` makes the wire frame of a batch with one copy of each
token byte, from the mapped dataset into the frame (in C where
``service/_frame.c`` is built, else by joining the views ``Assembler.pieces``
gives); building the assembler reads each Arrow chunk's first and last list
offset and no token page, and holds nothing a row: a row's tokens are found
in its chunk's own list offsets, in the mapping.
The trade-off is a Python loop over a batch's rows (a few dozen) where the
compiled frame is not built.
"""

from __future__ import annotations

import logging
import sys
import threading
from collections.abc import Iterator
from typing import Any, NamedTuple, NoReturn

import numpy as np
import numpy.typing as npt
import pyarrow as pa
import pyarrow.compute as pc

from ladle.proto import codec

from .dataset import IGNORE_INDEX, LOSS_MASK, TOKENS, TokenDataset
from .errors import DatasetChangedError, DatasetError


def _compiled_frame() -> Any:
    """The frame gather in C (service/_frame.c), or None: it is optional, the bytes are the same."""
    try:
        from . import _frame  # type: ignore[attr-defined]
    except ImportError:  # pragma: no cover - a build without a C compiler
        return None
    return _frame


_frame_c: Any = _compiled_frame()
# plan, header and copy in one call (tests switch it off to compare it with the checked path)
_build: Any = getattr(_frame_c, "build", None)


class _NoMappedReadError(Exception):
    """Stands for ``_frame.MappedReadError`` where the extension is not built (never raised)."""


# a read of the mapped dataset in C that faulted (SIGBUS): a data file was cut under the mapping
_MappedReadError: type[Exception] = getattr(_frame_c, "MappedReadError", _NoMappedReadError)

__all__ = ["Assembler", "BatchFrame", "BatchPieces", "check_values"]

log = logging.getLogger("ladle.server")

I8 = npt.NDArray[np.int8]
I32 = npt.NDArray[np.int32]
I64 = npt.NDArray[np.int64]

_INT32_MIN, _INT32_MAX = -(2**31), 2**31 - 1
# Shared pad rows grow in powers of two (from this size): ever wider batches reallocate rarely.
_MIN_TOKEN_CAPACITY = 1 << 12
# Distinct pad ids whose pad rows are cached (one in practice).
_MAX_PAD_IDS = 4
# Above this many chunks in a column, the compiled frame is given only the chunks a batch's rows lie
# in: it takes a buffer of every chunk it is given, each batch (80 ns each: 1.6 ms a batch for the
# 10^4 chunks of 10^7 rows that save_to_disk writes in record batches of 1,000 rows), and at most
# 65,536 of them (10^8 rows have 10^5). Picking them costs a batch about what 250 buffers do.
_ALL_CHUNKS_MAX = 256
# Per row of a batch: chunk of input_ids, chunk of loss_mask, their start in
# those chunks' values, and the row's length cut to max_len (at most padded_len).
_Plan = Iterator[tuple[int, int, int, int, int]]
# What the compiled plan reads of the dataset: its rows, the first rows and token shifts of the ids'
# chunks and of the mask's, and the ids' chunks' list offsets (views of the dataset's own buffers).
_Tables = tuple[int, I64, I64, I64, I64, list[memoryview]]


_INT32 = (-(2**31), 2**31 - 1, "int32 (the wire's token ids)")
_INT8 = (-(2**7), 2**7 - 1, "int8 (the wire's loss mask)")


class _Wide:
    """One batch's rows of columns wider than the wire's types, checked together at the end.

    One ``min``/``max`` over the batch's values, not two per row (per-row
    checks cost as much as the copy); a row is named only when the batch
    holds a value that does not fit.
    """

    def __init__(self, asm: Assembler) -> None:
        self.asm = asm
        self.ids: list[tuple[int, npt.NDArray[Any]]] = []
        self.mask: list[tuple[int, npt.NDArray[Any]]] = []

    def row(self, row: int, c: int, cm: int, p: int, q: int, n: int) -> tuple[Any, Any]:
        """A row's tokens and mask as stored; remembered for ``check`` when their dtype is wider."""
        asm = self.asm
        tokens = asm._ids[c][p : p + n]
        mask = asm._mask[cm][q : q + n]
        if asm._mask_from == "labels":
            mask = (mask != IGNORE_INDEX).view(np.int8)
        elif asm._mask_from == "none":
            mask = np.ones(n, dtype=np.int8)
        if asm._ids_wide[c]:
            self.ids.append((row, tokens))
        if asm._mask_wide[cm]:
            self.mask.append((row, mask))
        return tokens, mask

    def check(self) -> None:
        """Raise ``DatasetError`` naming the first row with a value outside the wire's type."""
        for column, rows, bounds in ((TOKENS, self.ids, _INT32), (LOSS_MASK, self.mask, _INT8)):
            if not rows:
                continue
            values = np.concatenate([v for _, v in rows]) if len(rows) > 1 else rows[0][1]
            low, high, _ = bounds
            if values.size and (int(values.min()) < low or int(values.max()) > high):
                for row, v in rows:
                    columns = self.asm.dataset.columns
                    name = columns.input_ids if column == TOKENS else columns.mask
                    _check_fits(self.asm.dataset.path, column, row, v, bounds, name)


def _check_fits(
    where: str,
    role: str,
    row: int,
    values: npt.NDArray[Any],
    bounds: tuple[int, int, str],
    column: str | None = None,
) -> None:
    """Refuse a row whose values would wrap when cast to the wire's type (``DatasetError``).

    ``role``: ``input_ids`` or ``loss_mask``; ``column``: the stored column's name (the role's by default).
    """
    if not values.size:
        return
    low, high, what = bounds
    least, most = int(values.min()), int(values.max())
    if least < low or most > high:
        bad = least if least < low else most
        fix = (
            "re-tokenize with a vocabulary that fits, or cast the column after checking its range"
            if role == TOKENS
            else "loss_mask values are weights of -128..127, usually 0 or 1: rescale or recompute the column"
        )
        wrapped = "ladle would send it wrapped" if bounds in (_INT32, _INT8) else "the model cannot embed it"
        raise DatasetError(
            f"dataset {where}: row {row} of {column or role!r} holds {bad}, outside {what} "
            f"[{low}, {high}]; {wrapped} ({fix}). Serving checks values as it makes "
            "batches, so a restarted trainer stops at the same step: fix the dataset, save it to a new "
            "folder and start a new job (ladle plan --check-values finds such rows before training)"
        )


def check_values(dataset: TokenDataset, vocab_size: int | None = None) -> dict[str, tuple[int, int]]:
    """Each served column's smallest and largest value, read from every token (``ladle plan --check-values``).

    Keyed by role (``input_ids``, and ``loss_mask`` when the mask is a stored
    column; a mask derived from labels or none is 0 or 1 by construction).
    ``DatasetError`` naming the first row that does not fit the wire's type,
    as serving that row's batch would raise, but before training starts, or,
    with ``vocab_size``, the first row with a token id outside
    ``[0, vocab_size)`` (an embedding lookup would fail on the GPU). It
    reads the whole dataset once: seconds a GB from page cache, disk speed
    otherwise.
    """
    found: dict[str, tuple[int, int]] = {}
    columns = dataset.columns
    checks = [(TOKENS, columns.input_ids, _INT32)]
    if vocab_size is not None:
        checks = [(TOKENS, columns.input_ids, (0, vocab_size - 1, f"the vocabulary of {vocab_size} ids"))]
    if columns.mask_from == "loss_mask" and columns.mask is not None:
        checks.append((LOSS_MASK, columns.mask, _INT8))
    for role, column, bounds in checks:
        low, high, _ = bounds
        least: int | None = None
        most: int | None = None
        first = 0  # the chunk's first row
        for chunk in dataset.table.column(column).chunks:
            flat = pc.list_flatten(chunk)
            if len(flat):
                span = pc.min_max(flat)
                lo, hi = span["min"].as_py(), span["max"].as_py()
                least = lo if least is None else min(least, lo)
                most = hi if most is None else max(most, hi)
                if lo < low or hi > high:
                    outside = pc.or_(pc.less(flat, pa.scalar(low)), pc.greater(flat, pa.scalar(high)))
                    at = pc.index(outside, True).as_py()
                    ends = np.cumsum(np.asarray(pc.list_value_length(chunk).to_numpy(zero_copy_only=False)))
                    row = int(np.searchsorted(ends, at, side="right"))
                    values = np.asarray(chunk[row].values.to_numpy(zero_copy_only=False))
                    _check_fits(dataset.path, role, first + row, values, bounds, column)
            first += len(chunk)
        found[role] = (least or 0, most or 0)
    return found


def _kind_of(chunks: list[npt.NDArray[Any]]) -> str | None:
    """The chunks' one integer type as ``_frame.build`` names it ("i4", "u2", ...), else None."""
    dtypes = {c.dtype for c in chunks}
    if len(dtypes) != 1:
        return None
    dtype = dtypes.pop()
    if dtype.kind not in "iu" or not dtype.isnative:
        return None
    return f"{dtype.kind}{dtype.itemsize}"


def _byte_view(array: npt.NDArray[Any]) -> memoryview:
    """The bytes of a 1-D contiguous array, without a copy."""
    return array.data.cast("B")


def _grow(need: int, floor: int) -> int:
    return max(floor, 1 << max(0, need - 1).bit_length())


class BatchPieces(NamedTuple):
    """One padded batch as byte pieces (``Assembler.pieces``): views, row by row, to join.

    ``input_ids`` joined is the little-endian int32 ``[rows, padded_len]``
    array's bytes and ``loss_mask`` joined the int8 one's (each row's tokens,
    then its padding); ``lengths`` (int32) holds each row's tokens in the
    batch (``min(length, padded_len)``) and ``sample_ids`` (int64) the
    dataset rows, in the order asked for. The pieces are read-only views of
    the memory-mapped dataset and of shared pad rows: nothing to release.
    """

    input_ids: list[memoryview]
    loss_mask: list[memoryview]
    lengths: I32
    sample_ids: I64

    @property
    def num_tokens(self) -> int:
        """Real (unpadded, cut) tokens of the batch."""
        return int(self.lengths.sum(dtype=np.int64))


class BatchFrame(NamedTuple):
    """One batch encoded as a wire frame (``Assembler.frame``)."""

    data: bytes
    real_tokens: int
    rows: int


def _list_chunks(table: Any, name: str, num_rows: int) -> list[Any]:
    """The non-empty chunks of the integer list column ``name``, or a ``DatasetError``."""
    column = table.column(name)
    value_type = getattr(column.type, "value_type", None)
    if value_type is None or not pa.types.is_integer(value_type):
        raise DatasetError(
            f"column {name!r} has Arrow type {column.type}; the assembler reads lists of integers "
            "only (cast it, e.g. ds.cast_column(name, Sequence(Value('int8'))), before save_to_disk)"
        )
    if len(column) != num_rows:
        raise DatasetError(f"column {name!r} has {len(column)} rows, the dataset {num_rows}")
    return [chunk for chunk in column.chunks if len(chunk)]


def _offsets_view(chunk: Any) -> memoryview:
    """A list chunk's own slice of its offsets buffer (int32 or int64), without a copy.

    A view of the buffer, not of ``chunk.offsets``: that keeps an Arrow
    array object alive a chunk, twice the memory at 10^5 chunks.
    """
    dtype = np.int64 if pa.types.is_large_list(chunk.type) else np.int32
    buffer = chunk.buffers()[1]
    size = np.dtype(dtype).itemsize
    return np.frombuffer(buffer, dtype=dtype, count=len(chunk) + 1, offset=chunk.offset * size).data


def _chunk_views(
    name: str, chunks: list[Any], lengths: npt.NDArray[np.integer]
) -> tuple[list[npt.NDArray[np.integer]], I64, list[memoryview], I64]:
    """Zero-copy values and list offsets of each chunk, the first row of each, and its token shift.

    Row ``r`` of chunk ``c`` is ``values[c][offsets[c][i] : offsets[c][i + 1]]``
    with ``i = r - first_rows[c]``: a chunk's ``values`` child is whole
    (unsliced) and a sliced chunk's offsets point into it. Both are views of
    the dataset's buffers (int32 offsets for ``list<>``, int64 for
    ``large_list<>``; the offsets as memoryviews, which the compiled frame
    takes at a third of an array's cost): nothing a row is copied. A row
    that starts ``t`` tokens into the column starts at ``t + shift[c]`` in
    its chunk's values, so another column chunked otherwise finds the same
    row from one start and two shifts. ``DatasetError`` when a chunk's token
    count is not what ``lengths`` says of its rows.
    """
    values: list[npt.NDArray[np.integer]] = []
    offsets: list[memoryview] = []
    first_rows = np.empty(len(chunks), dtype=np.int64)
    shift = np.empty(len(chunks), dtype=np.int64)
    row = tokens_before = 0
    for c, chunk in enumerate(chunks):
        try:
            values.append(chunk.values.to_numpy(zero_copy_only=True))
            offsets.append(_offsets_view(chunk))
        except pa.ArrowException as exc:  # nulls: open_dataset refuses them
            raise DatasetError(f"column {name!r}: no zero-copy view of its values: {exc}") from exc
        first, last = offsets[c][0], offsets[c][-1]
        # a sum with a dtype casts a block at a time: no int64 copy of the lengths
        expected = int(lengths[row : row + len(chunk)].sum(dtype=np.int64))
        if last - first != expected:
            raise DatasetError(
                f"column {name!r}: rows {row}..{row + len(chunk) - 1} hold {last - first} tokens, "
                f"but the dataset's lengths say {expected} (open it with open_dataset)"
            )
        first_rows[c] = row
        shift[c] = first - tokens_before
        row += len(chunk)
        tokens_before += expected
    return values, first_rows, offsets, shift


class Assembler:
    """Gathers padded batches from one ``TokenDataset`` without a copy of its tokens.

    Holds the zero-copy numpy views of every Arrow chunk's values and list
    offsets (file-backed in a memory-mapped dataset) and a few integers per
    chunk: memory O(chunks), never O(rows) or O(tokens), beyond the
    dataset's own lengths; building it reads no token page. A row's start
    and length are read in its chunk's offsets as its batch is made.
    ``pieces`` and ``frame`` are thread-safe.

    Tokens are expected to be int32 already (the fast path, a plain copy);
    other integer widths are converted by the same per-row copy, and a
    column whose type can hold values outside int32 (int64, uint32, uint64:
    what ``datasets`` stores Python ints as) has each row it copies checked,
    so a token id that does not fit is a ``DatasetError`` naming the row, not
    a wrapped id (only the rows served are read: no start-up scan).
    ``loss_mask`` is emitted as int8: int8 columns are copied byte for byte,
    other integer types (uint8 included) are cast the same way as tokens and
    checked the same way against int8. Boolean
    Arrow columns (bit-packed, no zero-copy view) are refused with
    ``DatasetError``, as ``open_dataset`` refuses them.
    """

    def __init__(self, dataset: TokenDataset) -> None:
        self.dataset = dataset
        self.num_rows = int(dataset.num_rows)
        table = dataset.table
        columns = dataset.columns
        # the mask's source: a stored column (as it is), labels (1 where not -100) or none (all ones);
        # "none" reads the ids' chunks in its place, so every offset and chunk table is the ids'
        self._mask_from = columns.mask_from
        ids_chunks = _list_chunks(table, columns.input_ids, self.num_rows)
        mask_name = columns.mask if columns.mask is not None else columns.input_ids
        mask_chunks = _list_chunks(table, mask_name, self.num_rows)
        # a row's start and length are read in the ids' chunk offsets, where they are (the mapping):
        # a row costs no heap. Its mask starts as many tokens into the mask column (open_dataset
        # checks the two agree row by row): the ids' start and the two chunks' shifts give it,
        # whatever the mask's chunking, without a second read a row.
        self._ids, self._ids_first_rows, self._ids_offsets, self._ids_shift = _chunk_views(
            columns.input_ids, ids_chunks, dataset.lengths
        )
        # a uint8 mask is converted and checked like any other type: a weight of 200 is not sent as -56
        if mask_name == columns.input_ids:  # no mask column: the ids' views, not a second set
            self._mask, self._mask_first_rows = self._ids, self._ids_first_rows
            self._mask_shift = self._ids_shift
        else:
            self._mask, self._mask_first_rows, _, self._mask_shift = _chunk_views(
                mask_name, mask_chunks, dataset.lengths
            )
        self._same_chunks = np.array_equal(self._ids_first_rows, self._mask_first_rows)
        # the mask's chunk tables are the ids' (chunked alike, unsliced): a batch picks them once
        self._same_tables = self._same_chunks and np.array_equal(self._ids_shift, self._mask_shift)
        # past _ALL_CHUNKS_MAX chunks: the first row of each chunk after the first (row r is in chunk
        # searchsorted(ends, r, "right")), for the ids and the mask (the same array when chunked alike)
        self._chunk_ends: tuple[I64, I64] | None = None
        if max(len(self._ids), len(self._mask)) > _ALL_CHUNKS_MAX:
            ids_ends = self._ids_first_rows[1:]
            self._chunk_ends = (ids_ends, ids_ends if self._same_chunks else self._mask_first_rows[1:])
        # chunks whose dtype holds values the wire's int32 ids / int8 masks cannot: rows checked
        self._ids_wide = [not np.can_cast(v.dtype, np.int32) for v in self._ids]
        stored = self._mask_from == "loss_mask"  # a derived mask is 0 or 1: nothing to check
        self._mask_wide = [stored and not np.can_cast(m.dtype, np.int8) for m in self._mask]
        # byte pieces go to the wire as they are (little-endian int32 ids, int8 masks)
        self._wire_bytes = (
            stored
            and sys.byteorder == "little"
            and all(v.dtype == np.int32 for v in self._ids)
            and all(m.dtype == np.int8 for m in self._mask)
        )
        self._ids_bytes = [_byte_view(v) for v in self._ids]
        # what the compiled plan reads of each row: the rows' range, each column's chunks' first rows
        # and shifts, and the ids' chunks' list offsets (a row's start and length)
        self._tables: _Tables = (
            self.num_rows,
            self._ids_first_rows,
            self._ids_shift,
            self._mask_first_rows,
            self._mask_shift,
            self._ids_offsets,
        )
        self._mask_bytes = [_byte_view(m) for m in self._mask]
        # what the compiled one-call frame reads: each column's chunks of one integer type ("i4" ids and
        # "i1" masks are copied as they are, any other converted in C, a value outside the wire's type
        # sent to the checked path, which names its row)
        ids_kind, mask_kind = _kind_of(self._ids), _kind_of(self._mask)
        if mask_kind is not None and not stored:  # the compiled frame's "l" (labels) and "a" (all ones)
            mask_kind = ("l" if self._mask_from == "labels" else "a") + mask_kind[1:]
        self._build_kinds: tuple[str, str] | None = None
        if sys.byteorder == "little" and ids_kind is not None and mask_kind is not None:
            self._build_kinds = (ids_kind, mask_kind)
        slow = [
            f"{name} is {dtype}"
            for name, arrays, wire in ((TOKENS, self._ids, np.int32), (LOSS_MASK, self._mask, np.int8))
            for dtype in sorted({str(a.dtype) for a in arrays if a.dtype != wire})
        ]
        if not stored:
            slow.append(f"the loss mask is derived ({columns.describe()})")
        if slow and (_build is None or self._build_kinds is None):  # else converted in C
            log.warning(
                "dataset %s: %s; batches are converted row by row in Python (the compiled frame, "
                "service/_frame.c, is not built), about 10x the CPU of int32 ids and an int8 mask "
                "(benchmarks/bench_assemble.py): cast before save_to_disk, e.g. "
                "ds.cast_column('loss_mask', Sequence(Value('int8')))",
                dataset.path,
                " and ".join(slow),
            )
        self._pad_lock = threading.Lock()
        self._pad_rows: dict[int, memoryview] = {}
        self._pad_mask = _byte_view(np.zeros(_MIN_TOKEN_CAPACITY, dtype=np.int8))
        self._reported: set[str] = set()  # dataset changes already logged

    def pieces(
        self, rows: npt.ArrayLike, padded_len: int, pad_id: int = 0, *, max_len: int | None = None
    ) -> BatchPieces:
        """The batch of dataset ``rows`` (1-D integers, in order) padded to ``padded_len``, as byte pieces.

        No token is copied. Each row is a view of its tokens in the
        memory-mapped values buffer and, when it is shorter than
        ``padded_len``, a view of a shared pad row of ``pad_id``:
        ``b"".join`` of ``input_ids`` gives the little-endian int32
        ``[rows, padded_len]`` array's bytes, of ``loss_mask`` the int8 one's
        (0 on padding). Joining them straight into a frame
        (``codec.encode_batch_pieces``) copies each byte once. Token or mask
        columns of another dtype (or a big-endian machine) are converted row
        by row, a copy each. The views stay valid as long as the dataset.

        Rows longer than ``max_len`` (the config's ``max_seq_len``; None or
        above ``padded_len``: ``padded_len``) are cut to their first
        ``max_len`` tokens. The schedule's ``padded_len`` is the longest cut
        length rounded up to ``pad_to_multiple_of``, so it can exceed
        ``max_seq_len``: the cut is not the width.

        Raises ``ValueError`` for rows outside ``[0, num_rows)``, a
        ``padded_len`` or ``max_len`` below 1 or a ``pad_id`` outside int32,
        ``DatasetError`` for a row whose values do not fit the wire's types,
        and ``DatasetChangedError`` (logged once) when a data file changed on
        disk since the dataset was opened: no token page is read then.
        """
        row_ids, width, limit, pad = self._checked(rows, padded_len, max_len, pad_id)
        cut, plan = self._plan(row_ids, limit)
        ids: list[memoryview] = []
        mask: list[memoryview] = []
        if self._wire_bytes:
            ids_src, mask_src = self._ids_bytes, self._mask_bytes
            pad_ids, pad_mask = self._pads(pad, width)
            for c, cm, p, q, n in plan:
                ids.append(ids_src[c][4 * p : 4 * (p + n)])
                mask.append(mask_src[cm][q : q + n])
                if n < width:
                    ids.append(pad_ids[: 4 * (width - n)])
                    mask.append(pad_mask[: width - n])
        else:
            wide = _Wide(self)
            for row, (c, cm, p, q, n) in zip(row_ids.tolist(), plan, strict=True):
                tokens, row_mask_src = wide.row(row, c, cm, p, q, n)
                row_tokens = np.full(width, pad, dtype="<i4")
                row_tokens[:n] = tokens
                row_mask = np.zeros(width, dtype="<i1")
                row_mask[:n] = row_mask_src
                ids.append(_byte_view(row_tokens))
                mask.append(_byte_view(row_mask))
            wide.check()
        return BatchPieces(ids, mask, cut.astype(np.int32), row_ids)

    def frame(
        self,
        rows: npt.ArrayLike,
        padded_len: int,
        *,
        epoch: int,
        step: int,
        rank: int,
        bucket: int,
        schedule_fingerprint: str,
        pad_id: int = 0,
        max_len: int | None = None,
    ) -> BatchFrame:
        """The batch ``pieces(rows, padded_len, pad_id, max_len=...)`` makes, as one batch frame.

        With the compiled ``_frame`` extension (built with the package where a
        C compiler is found) the frame is allocated once at its final size and
        every row's tokens and mask are copied into it from the mapped dataset,
        with no Python object per row and without the GIL; without it (or for
        columns of other dtypes) the pieces are joined. The bytes are the same
        either way (tested). Raises as ``pieces``, and ``WireFormatError`` as
        ``encode_batch_pieces``.
        """
        if _build is not None and self._build_kinds is not None:
            self._check_files(np.asarray(rows))  # the files the batch reads, before any of their pages
            try:  # plan, header and copy in one call: no Python between them
                tables, ids_bytes, mask_bytes = self._chunks_of(rows)
                data, real_tokens, count = _build(
                    epoch,
                    step,
                    rank,
                    bucket,
                    schedule_fingerprint,
                    rows,
                    padded_len,
                    padded_len if max_len is None else max_len,
                    pad_id,
                    *tables,
                    ids_bytes,
                    mask_bytes,
                    *self._build_kinds,
                )
                return BatchFrame(data, real_tokens, count)
            except (TypeError, ValueError, OverflowError):
                pass  # not an int64 row array, or a bad field: the checked path converts or names it
            except _MappedReadError:
                self._mapping_failed()
        fields: dict[str, Any] = {
            "epoch": epoch,
            "step": step,
            "rank": rank,
            "bucket": bucket,
            "schedule_fingerprint": schedule_fingerprint,
        }
        if _frame_c is None or not self._wire_bytes:
            pieces = self.pieces(rows, padded_len, pad_id, max_len=max_len)
            data = codec.encode_batch_pieces(
                **fields,
                padded_len=padded_len,
                input_ids=pieces.input_ids,
                loss_mask=pieces.loss_mask,
                lengths=pieces.lengths,
                sample_ids=pieces.sample_ids,
            )
            return BatchFrame(data, pieces.num_tokens, len(pieces.lengths))
        # the rows' bounds are checked by the plan, in the same pass that reads their offsets
        row_ids, width, limit, pad = self._checked(rows, padded_len, max_len, pad_id, bounds=False)
        count = len(row_ids)
        tables, ids_bytes, mask_bytes = self._chunks_of(row_ids)
        try:  # both calls read the mapping
            if count:
                row_ids = np.ascontiguousarray(row_ids)
                plan, real_tokens = _frame_c.plan(row_ids, limit, *tables)
            else:
                plan, real_tokens = b"", 0  # batch_frame_head refuses an empty batch
            head, gap = codec.batch_frame_head(
                **fields, rows=count, padded_len=width, real_tokens=real_tokens
            )
            # plan: cut, ids chunk, mask chunk, ids start, mask start (int64 each), then int32 lengths
            view, size = memoryview(plan), 8 * count
            cut, ids_chunk, mask_chunk, ids_at, mask_at = (view[i * size : (i + 1) * size] for i in range(5))
            lengths = view[5 * size :]
            data = _frame_c.frame(
                head,
                gap,
                row_ids,
                lengths,
                ids_bytes,
                mask_bytes,
                ids_chunk,
                mask_chunk,
                ids_at,
                mask_at,
                cut,
                width,
                pad,
            )
        except _MappedReadError:
            self._mapping_failed()
        return BatchFrame(data, real_tokens, count)

    def _chunks_of(self, rows: npt.ArrayLike) -> tuple[_Tables, list[memoryview], list[memoryview]]:
        """The tables and chunk buffers the compiled frame reads for a batch of ``rows``.

        All of them, or past ``_ALL_CHUNKS_MAX`` chunks only the chunk of
        each row (sorted, repeats kept: the frame finds a row's chunk by
        binary search over the first rows given, and a repeat is the same
        chunk), with their first rows, shifts and list offsets. A row outside the
        dataset gets the first or last chunk and is refused by the frame's
        check of the rows' range.
        """
        if self._chunk_ends is None:
            return self._tables, self._ids_bytes, self._mask_bytes
        at = np.asarray(rows).reshape(-1)
        ids_ends, mask_ends = self._chunk_ends
        ids = np.searchsorted(ids_ends, at if at.size else 0, side="right").reshape(-1)
        ids.sort()
        mask = ids
        if mask_ends is not ids_ends:
            mask = np.searchsorted(mask_ends, at if at.size else 0, side="right").reshape(-1)
            mask.sort()
        picks = ids.tolist()
        mask_picks = picks if mask is ids else mask.tolist()
        ids_first, ids_shift = self._ids_first_rows[ids], self._ids_shift[ids]
        mask_first, mask_shift = ids_first, ids_shift
        if not self._same_tables:
            mask_first, mask_shift = self._mask_first_rows[mask], self._mask_shift[mask]
        tables = (
            self.num_rows,
            ids_first,
            ids_shift,
            mask_first,
            mask_shift,
            list(map(self._ids_offsets.__getitem__, picks)),
        )
        return (
            tables,
            list(map(self._ids_bytes.__getitem__, picks)),
            list(map(self._mask_bytes.__getitem__, mask_picks)),
        )

    def _checked(
        self, rows: npt.ArrayLike, padded_len: int, max_len: int | None, pad_id: int, *, bounds: bool = True
    ) -> tuple[I64, int, int, int]:
        """The arguments of a batch, checked (and the data files unchanged): row ids, width, cut, pad id.

        ``bounds=False`` leaves the rows' range to the caller (the compiled plan checks it).
        """
        row_ids = self._check_rows(rows, bounds=bounds)
        width = _check_int("padded_len", padded_len, 1, None)
        limit = width if max_len is None else min(width, _check_int("max_len", max_len, 1, None))
        pad = _check_int("pad_id", pad_id, _INT32_MIN, _INT32_MAX)
        self._check_files(row_ids)
        return row_ids, width, limit, pad

    def _check_files(self, rows: I64 | None = None) -> None:
        """``DatasetChangedError`` (logged once) if a data file of ``rows`` changed since it was opened."""
        try:
            self.dataset.check_files(rows)
        except DatasetChangedError as exc:
            self._report(exc)

    def _report(self, exc: DatasetChangedError) -> NoReturn:
        """Log ``exc`` (once for each change seen) and raise it."""
        if str(exc) not in self._reported:
            self._reported.add(str(exc))
            log.error("%s", exc)
        raise exc

    def _mapping_failed(self) -> NoReturn:
        """After a read of the mapping faulted: the ``DatasetChangedError`` of the file that changed.

        The compiled frame abandons a read that faults (a data file cut
        shorter between the check before the batch and the copy) instead of
        letting the SIGBUS kill the server. By now ``stat`` sees the cut.
        """
        self._check_files()
        self._report(
            DatasetChangedError(
                self.dataset.path,
                self.dataset.path,
                "a page of its memory mapping could not be read (SIGBUS)",
            )
        )

    def _check_rows(self, rows: npt.ArrayLike, *, bounds: bool = True) -> I64:
        array = np.asarray(rows)
        if array.ndim != 1:
            raise ValueError(f"rows must be a 1-D array of row indices, got shape {array.shape}")
        if array.size and array.dtype.kind not in "iu":  # the kind, not np.issubdtype: cheaper
            raise ValueError(f"rows must be integers, got dtype {array.dtype}")
        row_ids = array.astype(np.int64, copy=False)
        if bounds and row_ids.size:
            low, high = int(row_ids.min()), int(row_ids.max())
            if low < 0 or high >= self.num_rows:
                bad = low if low < 0 else high
                raise ValueError(f"row {bad} is outside the dataset's rows [0, {self.num_rows})")
        return row_ids

    def _plan(self, rows: I64, limit: int) -> tuple[I64, _Plan]:
        """Each row's length cut to ``limit``, and where each row's tokens and mask start."""
        cut, ids_chunk, mask_chunk, ids_at, mask_at = self._where(rows, limit)
        columns = (ids_chunk, mask_chunk, ids_at, mask_at, cut)
        plan = zip(*(column.tolist() for column in columns), strict=True)
        return cut, plan

    def _where(self, rows: I64, limit: int) -> tuple[I64, I64, I64, I64, I64]:
        """Each row's length cut to ``limit``, the chunks of its tokens and mask, where they start (int64).

        A row's start and end are read in its ids chunk's list offsets (a
        loop over the batch's rows: each may lie in another chunk's buffer);
        its mask starts as many tokens into the mask column.
        """
        if len(self._ids) == 1:
            ids_chunk = np.zeros(len(rows), dtype=np.int64)
        else:
            ids_chunk = (np.searchsorted(self._ids_first_rows, rows, side="right") - 1).astype(np.int64)
        if self._same_chunks:
            mask_chunk = ids_chunk
        else:
            mask_chunk = (np.searchsorted(self._mask_first_rows, rows, side="right") - 1).astype(np.int64)
        ids_local = rows - self._ids_first_rows[ids_chunk]
        ids_at, ids_end = _offsets_at(self._ids_offsets, ids_chunk, ids_local)
        cut = np.minimum(ids_end - ids_at, limit)
        mask_at = ids_at - self._ids_shift[ids_chunk] + self._mask_shift[mask_chunk]
        return cut, ids_chunk, mask_chunk, ids_at, mask_at

    def _pads(self, pad: int, width: int) -> tuple[memoryview, memoryview]:
        """Byte views of at least ``width`` pad tokens and ``width`` zero mask bytes."""
        ids = self._pad_rows.get(pad)
        if ids is None or len(ids) < 4 * width or len(self._pad_mask) < width:
            size = _grow(width, _MIN_TOKEN_CAPACITY)
            with self._pad_lock:
                if ids is None or len(ids) < 4 * width:
                    if len(self._pad_rows) >= _MAX_PAD_IDS:
                        self._pad_rows.clear()
                    ids = _byte_view(np.full(size, pad, dtype=np.int32))
                    self._pad_rows[pad] = ids
                if len(self._pad_mask) < width:
                    self._pad_mask = _byte_view(np.zeros(size, dtype=np.int8))
        return ids, self._pad_mask


def _offsets_at(offsets: list[memoryview], chunks: I64, entries: I64) -> tuple[I64, I64]:
    """Entries ``entries[k]`` and ``entries[k] + 1`` of chunk ``chunks[k]``'s list offsets, for each
    ``k``: where each row starts and ends (int64; one pass over the rows)."""
    starts, ends = [], []
    for c, i in zip(chunks.tolist(), entries.tolist(), strict=True):
        view = offsets[c]
        starts.append(view[i])
        ends.append(view[i + 1])
    return np.array(starts, dtype=np.int64), np.array(ends, dtype=np.int64)


def _check_int(name: str, value: Any, low: int, high: int | None) -> int:
    if isinstance(value, bool) or not isinstance(value, int | np.integer):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    number = int(value)
    if number < low or (high is not None and number > high):
        span = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise ValueError(f"{name} must be {span}, got {number}")
    return number
