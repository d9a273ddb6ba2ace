"""Assembler: a batch's pieces and frame, gathered and padded from the Arrow buffers, against a reference."""

from __future__ import annotations

import gc
import itertools
import shutil
import tracemalloc
from pathlib import Path
from typing import Any

import datasets
import numpy as np
import numpy.typing as npt
import pyarrow as pa
import pyarrow.compute as pc
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ladle.proto import codec
from ladle.service import assemble
from ladle.service.assemble import Assembler
from ladle.service.dataset import TokenDataset, open_dataset
from ladle.service.errors import DatasetError
from ladle.service.schedule import ScheduleConfig, build_schedule
from ladle.service.synth import make_dataset

TINY = 1 / 16  # production lengths / 16: at most 768 tokens a row
# The production schedule shrunk by the same factor.
TINY_SCHEDULE = ScheduleConfig(
    max_seq_len=512,
    bucket_bounds=(0, 48, 76, 108, 152, 206, 513),
    token_budget=3072,
    max_batch_size=64,
    sort_chunk=256,
)
I64 = npt.NDArray[np.int64]


# --- helpers ---------------------------------------------------------------


def reference(
    ds: TokenDataset, rows: npt.ArrayLike, padded_len: int, pad_id: int = 0, max_len: int | None = None
) -> tuple[npt.NDArray[np.int32], npt.NDArray[np.int8], npt.NDArray[np.int32]]:
    """The batch built the slow, obvious way: one Python list per row from Arrow."""
    cut = padded_len if max_len is None else min(max_len, padded_len)
    row_list = [int(r) for r in np.asarray(rows).tolist()]
    ids = np.full((len(row_list), padded_len), pad_id, dtype=np.int32)
    mask = np.zeros((len(row_list), padded_len), dtype=np.int8)
    lengths = np.zeros(len(row_list), dtype=np.int32)
    tokens, masks = ds.table.column("input_ids"), ds.table.column("loss_mask")
    for i, row in enumerate(row_list):
        toks = tokens[row].as_py()[:cut]
        ids[i, : len(toks)] = toks
        mask[i, : len(toks)] = masks[row].as_py()[:cut]
        lengths[i] = len(toks)
    return ids, mask, lengths


def assert_matches(
    asm: Assembler,
    ds: TokenDataset,
    rows: npt.ArrayLike,
    padded_len: int,
    pad_id: int = 0,
    max_len: int | None = None,
) -> None:
    """``Assembler.pieces`` joined gives the reference arrays' little-endian bytes, and the frame the same."""
    ids, mask, lengths = reference(ds, rows, padded_len, pad_id, max_len)
    pieces = asm.pieces(rows, padded_len, pad_id, max_len=max_len)
    assert b"".join(pieces.input_ids) == ids.astype("<i4").tobytes(), "input_ids pieces differ"
    assert b"".join(pieces.loss_mask) == mask.astype("<i1").tobytes(), "loss_mask pieces differ"
    assert pieces.lengths.dtype == np.int32, "lengths is not int32"
    assert pieces.lengths.tobytes() == lengths.tobytes(), "lengths differ from the reference"
    assert pieces.sample_ids.tolist() == np.asarray(rows).tolist(), "sample_ids are not the rows"
    assert pieces.num_tokens == int(lengths.sum()), "num_tokens is not the sum of lengths"
    if len(pieces.lengths):
        assert_frame_matches(asm, rows, padded_len, pad_id, max_len)
        decoded = served(asm, rows, padded_len, pad_id, max_len)
        assert decoded.input_ids.tobytes() == ids.tobytes(), "the frame's input_ids differ"
        assert decoded.loss_mask.tobytes() == mask.tobytes(), "the frame's loss_mask differs"
        assert decoded.lengths.tobytes() == lengths.tobytes(), "the frame's lengths differ"
        assert decoded.sample_ids.tolist() == np.asarray(rows).tolist(), "the frame's sample_ids differ"


def served(
    asm: Assembler, rows: npt.ArrayLike, padded_len: int, pad_id: int = 0, max_len: int | None = None
) -> codec.DecodedBatch:
    """The batch as the server sends it (``Assembler.frame``), decoded as a trainer reads it."""
    return codec.decode_batch(asm.frame(rows, padded_len, pad_id=pad_id, max_len=max_len, **FIELDS).data)


FIELDS: dict[str, Any] = {"epoch": 3, "step": 70000, "rank": 1, "bucket": 2, "schedule_fingerprint": "0f" * 8}


def assert_frame_matches(
    asm: Assembler, rows: npt.ArrayLike, padded_len: int, pad_id: int = 0, max_len: int | None = None
) -> None:
    """``Assembler.frame`` (compiled where built) is byte for byte the pieces joined by the codec."""
    pieces = asm.pieces(rows, padded_len, pad_id, max_len=max_len)
    joined = codec.encode_batch_pieces(
        padded_len=padded_len,
        input_ids=pieces.input_ids,
        loss_mask=pieces.loss_mask,
        lengths=pieces.lengths,
        sample_ids=pieces.sample_ids,
        **FIELDS,
    )
    framed = asm.frame(rows, padded_len, pad_id=pad_id, max_len=max_len, **FIELDS)
    assert type(framed.data) is bytes, "the frame is not bytes"
    assert framed.data == joined, "the frame differs from the joined pieces"
    assert framed.real_tokens == pieces.num_tokens, "real_tokens is not the pieces' token count"
    assert framed.rows == len(pieces.lengths), "rows is not the row count"


def in_memory(table: pa.Table) -> TokenDataset:
    """A TokenDataset over an in-memory table, exactly as ``open_dataset`` would describe it."""
    parts = [
        np.diff(np.asarray(c.offsets.to_numpy(), dtype=np.int64)) for c in table.column("input_ids").chunks
    ]
    lengths: I64 = np.concatenate(parts).astype(np.int64) if parts else np.zeros(0, dtype=np.int64)
    return TokenDataset(
        path="<memory>",
        num_rows=table.num_rows,
        lengths=lengths,
        fingerprint="0" * 16,
        has_seq_len=False,
        table=table,
    )


def list_chunk(
    rows: list[npt.NDArray[Any]],
    value_type: pa.DataType,
    large: bool,
    rng: np.random.Generator,
    before: int = 0,
    after: int = 0,
    child_shift: int = 0,
) -> pa.Array:
    """A list array of ``rows``, sliced out of a bigger one whose values child is itself sliced."""
    junk = [rng.integers(0, 100, size=int(rng.integers(1, 5))) for _ in range(before + after)]
    every = junk[:before] + rows + junk[before:]
    lengths = np.array([len(r) for r in every], dtype=np.int64)
    offsets = np.r_[0, np.cumsum(lengths)]
    flat = np.concatenate(every) if every else np.zeros(0, dtype=np.int64)
    values = pa.array(np.r_[rng.integers(0, 100, size=child_shift), flat], type=value_type)
    values = values.slice(child_shift)
    if large:
        whole = pa.LargeListArray.from_arrays(pa.array(offsets, type=pa.int64()), values)
    else:
        whole = pa.ListArray.from_arrays(pa.array(offsets, type=pa.int32()), values)
    return whole.slice(before, len(rows))


def chunked(
    rows: list[npt.NDArray[Any]],
    cuts: list[int],
    value_type: pa.DataType,
    large: bool,
    rng: np.random.Generator,
    sliced: bool,
) -> pa.ChunkedArray:
    edges = [0, *sorted(set(cuts)), len(rows)]
    chunks = []
    for lo, hi in itertools.pairwise(edges):
        pad = (
            (int(rng.integers(0, 3)), int(rng.integers(0, 3)), int(rng.integers(0, 7)))
            if sliced
            else (0, 0, 0)
        )
        chunks.append(list_chunk(rows[lo:hi], value_type, large, rng, *pad))
    list_type = pa.large_list(value_type) if large else pa.list_(value_type)
    return pa.chunked_array(chunks, type=list_type)


def rss_kib(field: str) -> int:
    """One ``/proc/self/status`` memory figure (KiB), e.g. RssFile or RssAnon."""
    with open("/proc/self/status", encoding="ascii") as fh:
        for line in fh:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    pytest.skip(f"/proc/self/status has no {field}")


def save(
    path: Path, columns: dict[str, Any], features: datasets.Features | None = None, **kwargs: Any
) -> TokenDataset:
    datasets.disable_progress_bars()
    datasets.Dataset.from_dict(columns, features=features).save_to_disk(str(path), **kwargs)
    return open_dataset(path)


def random_rows(rng: np.random.Generator, count: int, low: int = 1, high: int = 40) -> list[list[int]]:
    return [rng.integers(1, 50_000, size=int(rng.integers(low, high))).tolist() for _ in range(count)]


# --- fixtures --------------------------------------------------------------


@pytest.fixture(scope="module")
def synth(tmp_path_factory: pytest.TempPathFactory) -> TokenDataset:
    return make_dataset(tmp_path_factory.mktemp("assemble") / "synth", 4000, seed=3, scale=TINY)


@pytest.fixture(scope="module")
def shards(tmp_path_factory: pytest.TempPathFactory) -> TokenDataset:
    """Three shards (so three Arrow chunks), int32 tokens, uint8 (bool-as-int) masks."""
    rng = np.random.default_rng(11)
    rows = random_rows(rng, 300)
    masks = [(rng.random(len(r)) < 0.7).tolist() for r in rows]  # Python bools, stored as uint8
    features = datasets.Features(
        {
            "input_ids": datasets.Sequence(datasets.Value("int32")),
            "loss_mask": datasets.Sequence(datasets.Value("uint8")),
        }
    )
    ds = save(
        tmp_path_factory.mktemp("assemble") / "shards",
        {"input_ids": rows, "loss_mask": masks},
        features,
        num_shards=3,
    )
    assert ds.table.column("input_ids").num_chunks >= 3, "the dataset should span several Arrow chunks"
    return ds


# --- correctness -----------------------------------------------------------


def test_matches_reference_on_synthetic_rows(synth: TokenDataset) -> None:
    asm = Assembler(synth)
    rng = np.random.default_rng(0)
    for _ in range(40):
        rows = np.sort(rng.choice(synth.num_rows, size=int(rng.integers(1, 65)), replace=False))
        padded_len = int(synth.lengths[rows].max()) + int(rng.integers(0, 5))
        assert_matches(asm, synth, rows, padded_len)


def test_matches_reference_across_shards(shards: TokenDataset) -> None:
    asm = Assembler(shards)
    chunk_rows = np.cumsum([len(c) for c in shards.table.column("input_ids").chunks])[:-1]
    edges = np.unique(np.r_[0, chunk_rows - 1, chunk_rows, shards.num_rows - 1])
    padded_len = int(shards.lengths.max())
    assert_matches(asm, shards, edges, padded_len)
    rng = np.random.default_rng(1)
    for _ in range(30):
        rows = rng.integers(0, shards.num_rows, size=int(rng.integers(1, 40)))  # any order, repeats
        assert_matches(asm, shards, rows, padded_len, pad_id=-1)


def test_serves_a_whole_schedule_epoch(synth: TokenDataset) -> None:
    sched = build_schedule(synth.lengths, TINY_SCHEDULE, world_size=2)
    asm = Assembler(synth)
    seen = []
    for step in range(sched.num_steps):
        for rank in range(sched.world_size):
            rows, padded_len = sched.samples(step, rank), sched.padded_len(step, rank)
            assert_matches(asm, synth, rows, padded_len)
            batch = served(asm, rows, padded_len)
            assert batch.lengths.tolist() == sched.lengths(step, rank).tolist(), "lengths != schedule's cut"
            seen.append(rows)
    assert len(np.unique(np.concatenate(seen))) == len(sched.scheduled_rows()), "missing samples"


def test_truncates_rows_longer_than_padded_len(synth: TokenDataset) -> None:
    asm = Assembler(synth)
    rows = np.argsort(synth.lengths)[-8:]  # the longest rows
    for padded_len in (1, 7, int(synth.lengths[rows].min()) - 1):
        assert_matches(asm, synth, rows, padded_len)
        assert (served(asm, rows, padded_len).lengths == padded_len).all(), "rows were not cut to padded_len"


@pytest.mark.parametrize("compiled", [True, False])
def test_rows_are_cut_to_max_len_when_the_width_is_more(
    synth: TokenDataset, compiled: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """max_seq_len 10 and pad_to_multiple_of 8 make batches 16 wide: rows reached trainers 16 long."""
    if not compiled:
        monkeypatch.setattr(assemble, "_build", None)
        monkeypatch.setattr(assemble, "_frame_c", None)
    asm = Assembler(synth)
    rows = np.argsort(synth.lengths)[-8:]  # the longest rows, all longer than 16
    assert int(synth.lengths[rows].min()) > 16
    for padded_len, max_len in [(16, 10), (16, 16), (16, 40), (9, 1), (64, 63)]:
        cut = min(padded_len, max_len)
        batch = served(asm, rows, padded_len, max_len=max_len)
        ids, mask, _ = reference(synth, rows, padded_len, 0, max_len)
        assert batch.input_ids.tobytes() == ids.tobytes(), (padded_len, max_len)
        assert batch.loss_mask.tobytes() == mask.tobytes(), (padded_len, max_len)
        assert (batch.lengths == cut).all(), "rows were not cut to max_len"
        assert (batch.input_ids[:, cut:] == 0).all(), "past max_len is not padding"
        assert_matches(asm, synth, rows, padded_len, 0, max_len)  # and the frame, by both paths
        frame = asm.frame(rows, padded_len, max_len=max_len, **FIELDS)
        assert frame.real_tokens == cut * len(rows)
    with pytest.raises(ValueError, match="max_len"):
        asm.pieces(rows, 16, max_len=0)
    with pytest.raises(ValueError, match="max_len"):
        asm.frame(rows, 16, max_len=0, **FIELDS)
    if compiled and assemble._build is not None:  # most batches are narrower than max_seq_len
        fast = Assembler(synth)

        def checked(*args: Any, **kwargs: Any) -> Any:
            raise AssertionError("a batch narrower than max_len left the one-call frame")

        monkeypatch.setattr(fast, "_checked", checked)
        assert fast.frame(rows, 16, max_len=8192, **FIELDS) == asm.frame(rows, 16, **FIELDS)


def test_pad_id_and_padding_mask(shards: TokenDataset) -> None:
    asm = Assembler(shards)
    rows = np.arange(10)
    padded_len = int(shards.lengths[rows].max()) + 3
    for pad_id in (0, 7, -1, 2**31 - 1, -(2**31)):
        assert_matches(asm, shards, rows, padded_len, pad_id)
        batch = served(asm, rows, padded_len, pad_id)
        tail = np.arange(padded_len)[None, :] >= batch.lengths[:, None]
        assert (batch.input_ids[tail] == pad_id).all(), "padding is not pad_id"
        assert (batch.loss_mask[tail] == 0).all(), "loss_mask is not 0 on padding"


def test_padding_wider_than_the_first_buffers(synth: TokenDataset) -> None:
    asm = Assembler(synth)
    rows = np.arange(3)
    for padded_len, pad_id in [(10, 1), (5000, 2), (9000, 1), (300, 3), (20_000, 4), (17, 5), (9000, 2)]:
        assert_matches(asm, synth, rows, padded_len, pad_id)


@pytest.mark.parametrize(
    ("token_type", "mask_type"),
    [
        ("int64", "int8"),
        ("int16", "uint8"),
        ("uint16", "int32"),
        ("int32", "int64"),
        ("int32", "int32"),
        ("int32", "int16"),
        ("int32", "uint8"),
    ],
)
def test_other_integer_widths_are_converted(tmp_path: Path, token_type: str, mask_type: str) -> None:
    rng = np.random.default_rng(5)
    rows = [rng.integers(1, 30_000, size=int(rng.integers(1, 30))).tolist() for _ in range(60)]
    masks = [(rng.random(len(r)) < 0.5).astype(int).tolist() for r in rows]
    features = datasets.Features(
        {
            "input_ids": datasets.Sequence(datasets.Value(token_type)),
            "loss_mask": datasets.Sequence(datasets.Value(mask_type)),
        }
    )
    ds = save(tmp_path / "ds", {"input_ids": rows, "loss_mask": masks}, features, num_shards=2)
    asm = Assembler(ds)
    picks = np.array([0, 5, 29, 30, 31, 59])
    assert_matches(asm, ds, picks, 40, pad_id=3)
    if assemble._build is not None:  # every integer type is converted in C
        assert asm._build_kinds is not None, f"{token_type} ids did not take the one-call frame"


@pytest.mark.parametrize(
    ("token_type", "mask_type", "bad_token", "bad_mask", "column"),
    [
        ("int64", "int8", 2**31, 1, "input_ids"),
        ("int64", "int8", -(2**31) - 1, 1, "input_ids"),
        ("uint32", "int8", 3_000_000_000, 1, "input_ids"),
        ("uint64", "int8", 2**40, 1, "input_ids"),
        ("uint64", "int8", 2**63 + 5, 1, "input_ids"),  # beyond int64 as well
        ("int64", "int64", 2**31, 1, "input_ids"),  # both columns converted, the ids named
        ("uint16", "int32", 7, 128, "loss_mask"),
        ("int32", "uint8", 7, 200, "loss_mask"),  # was sent as -56
        ("int32", "int64", 7, 256, "loss_mask"),
        ("int32", "int16", 7, -129, "loss_mask"),
    ],
)
def test_values_that_do_not_fit_the_wire_are_refused_not_wrapped(
    tmp_path: Path, token_type: str, mask_type: str, bad_token: int, bad_mask: int, column: str
) -> None:
    """A token id of 2**31 used to reach the trainer as -2**31 (and a mask of 256 as 0)."""
    rows = [[1, 2, 3], [4, bad_token, 6], [7, 8]]
    masks = [[1, 1, 1], [1, bad_mask, 1], [0, 1]]
    features = datasets.Features(
        {
            "input_ids": datasets.Sequence(datasets.Value(token_type)),
            "loss_mask": datasets.Sequence(datasets.Value(mask_type)),
        }
    )
    typed = {  # numpy rows: pyarrow cannot infer a Python int beyond int64
        "input_ids": [np.array(r, dtype=token_type) for r in rows],
        "loss_mask": [np.array(m, dtype=mask_type) for m in masks],
    }
    ds = save(tmp_path / "ds", typed, features)
    asm = Assembler(ds)
    fine = np.array([0, 2])
    assert_matches(asm, ds, fine, 4)  # the other rows still serve
    for make in (
        lambda: asm.pieces(np.array([0, 1]), 4),
        lambda: asm.pieces(np.array([1]), 4),
        lambda: asm.frame(np.array([2, 1]), 4, epoch=0, step=0, rank=0, bucket=0, schedule_fingerprint="f"),
    ):
        with pytest.raises(DatasetError, match=rf"row 1 of '{column}' holds -?\d+, outside int"):
            make()


def test_inferred_types_match(tmp_path: Path) -> None:
    rng = np.random.default_rng(6)
    rows = random_rows(rng, 50)
    ds = save(tmp_path / "ds", {"input_ids": rows, "loss_mask": [[1] * len(r) for r in rows]}, num_shards=3)
    # datasets infers int32 for a column named input_ids, int64 for other Python ints
    assert pa.types.is_int64(ds.table.schema.field("loss_mask").type.value_type)
    picks = np.arange(50)
    assert_matches(Assembler(ds), ds, picks, 45)


def test_sliced_chunks_and_different_chunkings() -> None:
    rng = np.random.default_rng(7)
    rows = [rng.integers(0, 1000, size=int(rng.integers(1, 20))) for _ in range(50)]
    masks = [rng.integers(0, 2, size=len(r)) for r in rows]
    for large in (False, True):
        table = pa.table(
            {
                "input_ids": chunked(rows, [7, 8, 30], pa.int32(), large, rng, sliced=True),
                "loss_mask": chunked(masks, [3, 25, 26, 49], pa.int8(), large, rng, sliced=True),
            }
        )
        ds = in_memory(table)
        asm = Assembler(ds)
        every = np.arange(50)
        assert_matches(asm, ds, every, 20)
        assert_matches(asm, ds, every[::-1], 5, pad_id=9)


@pytest.mark.parametrize("compiled", [True, False])
def test_a_frame_given_only_its_rows_chunks_is_the_same(
    monkeypatch: pytest.MonkeyPatch, compiled: bool
) -> None:
    """Past ``_ALL_CHUNKS_MAX`` chunks the compiled frame gets only the chunks of the batch's rows."""
    monkeypatch.setattr(assemble, "_ALL_CHUNKS_MAX", 0)
    if not compiled:
        monkeypatch.setattr(assemble, "_build", None)  # the checked path: plan, then frame
    test_sliced_chunks_and_different_chunkings()
    rng = np.random.default_rng(8)
    rows = [rng.integers(0, 1000, size=int(rng.integers(1, 9))) for _ in range(40)]
    table = pa.table(
        {
            "input_ids": chunked(rows, list(range(1, 40, 3)), pa.int32(), False, rng, sliced=True),
            "loss_mask": chunked([np.ones(len(r)) for r in rows], [20], pa.int8(), False, rng, sliced=False),
        }
    )
    ds = in_memory(table)
    asm = Assembler(ds)
    assert_matches(asm, ds, np.array([39, 0, 0, 17, 20, 19], dtype=np.int64), 12)  # any order, repeats
    with pytest.raises(ValueError, match="40"):
        asm.frame(np.array([3, 40], dtype=np.int64), 8, **FIELDS)


def test_list_ids_beside_a_large_list_mask_chunked_otherwise() -> None:
    """int32 list offsets for the ids, int64 for the mask, the two chunked and sliced otherwise."""
    rng = np.random.default_rng(11)
    rows = [rng.integers(0, 1000, size=int(rng.integers(1, 20))) for _ in range(60)]
    masks = [rng.integers(0, 2, size=len(r)) for r in rows]
    table = pa.table(
        {
            "input_ids": chunked(rows, [5, 33, 34], pa.int32(), False, rng, sliced=True),
            "loss_mask": chunked(masks, [1, 20, 40, 59], pa.int8(), True, rng, sliced=True),
        }
    )
    ds = in_memory(table)
    asm = Assembler(ds)
    assert {o.itemsize for o in asm._ids_offsets} == {4}, "the ids' offsets are not their own (int32)"
    assert pa.types.is_large_list(ds.table.schema.field("loss_mask").type), "the mask is not a large_list"
    every = np.arange(60)
    assert_matches(asm, ds, every, 20)
    assert_matches(asm, ds, np.array([59, 0, 33, 34, 33, 19, 20], dtype=np.int64), 7, pad_id=3)


def _ids_and_mask(count: int, cycle: int) -> tuple[pa.ListArray, pa.ListArray]:
    """``count`` rows of 1 to ``cycle`` tokens (ids counting up, the mask their parity), as list arrays."""
    lengths = np.arange(count) % cycle + 1
    offsets = pa.array(np.r_[0, np.cumsum(lengths)], type=pa.int32())
    values = np.arange(int(lengths.sum()), dtype=np.int32)
    ids = pa.ListArray.from_arrays(offsets, pa.array(values))
    return ids, pa.ListArray.from_arrays(offsets, pa.array((values % 2).astype(np.int8)))


def test_a_column_of_more_chunks_than_the_compiled_frame_takes() -> None:
    """save_to_disk writes a record batch per 1,000 rows: 10^8 rows are 10^5 chunks, over its 65,536."""
    count = 70_000
    ids, mask = _ids_and_mask(count, 5)
    table = pa.table(
        {
            "input_ids": pa.chunked_array([ids.slice(i, 1) for i in range(count)]),
            "loss_mask": pa.chunked_array([mask.slice(i, 1) for i in range(count)]),
        }
    )
    ds = in_memory(table)
    asm = Assembler(ds)
    assert len(asm._ids) == count
    assert_matches(asm, ds, np.array([0, 1, 65_535, 65_536, 69_999], dtype=np.int64), 6)


@given(
    seed=st.integers(0, 2**32 - 1),
    num_rows=st.integers(1, 60),
    ids_cuts=st.lists(st.integers(1, 59), max_size=5),
    mask_cuts=st.lists(st.integers(1, 59), max_size=5) | st.none(),
    large=st.booleans(),
    sliced=st.booleans(),
    token_type=st.sampled_from([pa.int32(), pa.int64(), pa.uint16()]),
    mask_type=st.sampled_from([pa.int8(), pa.uint8(), pa.int16()]),
    padded_len=st.integers(1, 40),
    pad_id=st.integers(-(2**31), 2**31 - 1),
)
def test_property_matches_reference(
    seed: int,
    num_rows: int,
    ids_cuts: list[int],
    mask_cuts: list[int] | None,
    large: bool,
    sliced: bool,
    token_type: pa.DataType,
    mask_type: pa.DataType,
    padded_len: int,
    pad_id: int,
) -> None:
    rng = np.random.default_rng(seed)
    rows = [rng.integers(0, 60_000, size=int(rng.integers(1, 30))) for _ in range(num_rows)]
    masks = [rng.integers(0, 2, size=len(r)) for r in rows]
    ids_cuts = [c for c in ids_cuts if c < num_rows]
    mask_cuts = ids_cuts if mask_cuts is None else [c for c in mask_cuts if c < num_rows]
    table = pa.table(
        {
            "input_ids": chunked(rows, ids_cuts, token_type, large, rng, sliced),
            "loss_mask": chunked(masks, mask_cuts, mask_type, large, rng, sliced),
        }
    )
    ds = in_memory(table)
    picks = rng.integers(0, num_rows, size=int(rng.integers(0, 40)))
    assert_matches(Assembler(ds), ds, picks, padded_len, pad_id)


@pytest.mark.skipif(not (shutil.which("cc") or shutil.which("gcc")), reason="no C compiler here")
def test_the_compiled_frame_is_built_here() -> None:
    """Where a C compiler is (CI, development), the fast path is built and is the one tested."""
    assert assemble._frame_c is not None, "service/_frame.c was not built (pip install -e . with gcc)"
    assert assemble._build is not None, "service/_frame.c is an old build without build()"


def test_frame_without_the_extension(synth: TokenDataset, monkeypatch: pytest.MonkeyPatch) -> None:
    rows = np.array([5, 1, 3999, 7, 7])
    padded_len = int(synth.lengths[rows].max()) + 3
    compiled = Assembler(synth).frame(rows, padded_len, pad_id=-7, **FIELDS)
    monkeypatch.setattr(assemble, "_frame_c", None)
    assert Assembler(synth).frame(rows, padded_len, pad_id=-7, **FIELDS) == compiled
    decoded = codec.decode_batch(compiled.data)
    ids, mask, lengths = reference(synth, rows, padded_len, -7)
    assert decoded.input_ids.tobytes() == ids.tobytes()
    assert decoded.loss_mask.tobytes() == mask.tobytes()
    assert decoded.lengths.tolist() == lengths.tolist()
    assert decoded.sample_ids.tolist() == rows.tolist()
    assert (decoded.epoch, decoded.step, decoded.rank, decoded.bucket) == (3, 70000, 1, 2)


def test_frame_refuses_what_the_codec_refuses(synth: TokenDataset) -> None:
    asm = Assembler(synth)
    with pytest.raises(ValueError, match="outside the dataset"):
        asm.frame([synth.num_rows], 8, **FIELDS)
    with pytest.raises(codec.WireFormatError):
        asm.frame(np.zeros(0, dtype=np.int64), 8, **FIELDS)
    with pytest.raises(codec.WireFormatError):
        asm.frame([1, 2], 8, **{**FIELDS, "rank": -1})


@pytest.mark.skipif(assemble._frame_c is None, reason="the compiled frame is not built")
@given(
    picks=st.lists(st.integers(0, 3999), min_size=1, max_size=40),
    width=st.integers(1, 600),
)
@settings(max_examples=60, deadline=None)
def test_the_compiled_plan_equals_the_numpy_one(synth: TokenDataset, picks: list[int], width: int) -> None:
    """``_frame.plan`` gives what ``Assembler._where`` gives, and the real token count."""
    asm = Assembler(synth)
    rows = np.array(picks, dtype=np.int64)
    plan, real = assemble._frame_c.plan(rows, width, *asm._tables)
    n = len(rows)
    got = np.frombuffer(plan, dtype=np.int64, count=5 * n).reshape(5, n)
    names = ("cut", "ids chunk", "mask chunk", "ids at", "mask at")
    for name, mine, theirs in zip(names, got, asm._where(rows, width), strict=True):
        assert mine.tolist() == theirs.tolist(), name
    assert np.frombuffer(plan, dtype=np.int32, offset=40 * n).tolist() == got[0].tolist()
    assert real == int(got[0].sum())


@pytest.mark.skipif(assemble._frame_c is None, reason="the compiled frame is not built")
def test_the_compiled_plan_refuses_rows_outside_the_dataset(synth: TokenDataset) -> None:
    asm = Assembler(synth)
    tables = asm._tables
    for rows, bad in (([0, synth.num_rows], synth.num_rows), ([-3, 5, 2**40], -3), ([7, 2**40], 2**40)):
        with pytest.raises(
            ValueError, match=rf"row {bad} is outside the dataset's rows \[0, {synth.num_rows}\)"
        ):
            assemble._frame_c.plan(np.array(rows, dtype=np.int64), 8, *tables)
    with pytest.raises(ValueError, match="do not agree"):
        assemble._frame_c.plan(np.zeros(0, dtype=np.int64), 8, *tables)
    with pytest.raises(ValueError, match="do not agree"):
        assemble._frame_c.plan(np.array([1], dtype=np.int64), 0, *tables)


def test_batch_frame_head_checks_its_fields() -> None:
    head, gap = codec.batch_frame_head(rows=1, padded_len=9, real_tokens=9, **FIELDS)
    assert len(gap) == 4, "36 bytes of ids need 4 of gap before the int64 sample ids"
    frame = codec.encode_batch(
        input_ids=np.zeros((1, 9), dtype=np.int32),
        loss_mask=np.zeros((1, 9), dtype=np.int8),
        lengths=np.array([9], dtype=np.int32),
        sample_ids=np.array([0], dtype=np.int64),
        **FIELDS,
    )
    assert frame.startswith(head), "the head is not encode_batch's"
    assert frame[len(head) + 36 : len(head) + 40] == gap, "the gap is not encode_batch's"
    good: dict[str, Any] = {"rows": 2, "padded_len": 8, "real_tokens": 9, **FIELDS}
    for change in ({"rows": 0}, {"padded_len": 0}, {"real_tokens": 17}, {"real_tokens": -1}, {"rows": -2}):
        with pytest.raises(codec.WireFormatError):
            codec.batch_frame_head(**{**good, **change})


@pytest.mark.skipif(assemble._frame_c is None, reason="the compiled frame is not built")
def test_the_compiled_frame_checks_every_slice(synth: TokenDataset) -> None:
    """Slices outside their chunk are refused before any byte is copied, never read out of bounds."""
    asm = Assembler(synth)
    c = assemble._frame_c
    rows = np.array([0, 1], dtype=np.int64)
    cut, ids_chunk, mask_chunk, ids_at, mask_at = asm._where(rows, 8)
    head, gap = codec.batch_frame_head(rows=2, padded_len=8, real_tokens=int(cut.sum()), **FIELDS)

    def call(**change: Any) -> bytes:
        args = {
            "ids_chunk": ids_chunk, "mask_chunk": mask_chunk, "ids_at": ids_at, "mask_at": mask_at,
            "cut": cut, "width": 8,
        }  # fmt: skip
        args.update(change)
        return bytes(
            c.frame(
                head,
                gap,
                rows,
                cut.astype(np.int32),
                asm._ids_bytes,
                asm._mask_bytes,
                args["ids_chunk"],
                args["mask_chunk"],
                args["ids_at"],
                args["mask_at"],
                args["cut"],
                args["width"],
                0,
            )
        )

    assert call() == asm.frame(rows, 8, **FIELDS).data
    end = len(asm._ids_bytes[0]) // 4
    for change in (
        {"ids_at": np.array([0, end], dtype=np.int64)},
        {"ids_at": np.array([0, 2**62], dtype=np.int64)},
        {"mask_at": np.array([-1, 0], dtype=np.int64)},
        {"ids_chunk": np.array([0, len(asm._ids_bytes)], dtype=np.int64)},
        {"mask_chunk": np.array([-1, 0], dtype=np.int64)},
        {"cut": np.array([9, 1], dtype=np.int64)},
    ):
        with pytest.raises(ValueError, match="outside its data chunk"):
            call(**change)
    with pytest.raises(ValueError, match="do not agree"):
        call(cut=np.array([1], dtype=np.int64))
    with pytest.raises(ValueError, match="do not agree"):
        call(width=0)


def test_empty_row_set(synth: TokenDataset) -> None:
    pieces = Assembler(synth).pieces(np.zeros(0, dtype=np.int64), 16)
    assert pieces.input_ids == [], "an empty batch has token pieces"
    assert pieces.loss_mask == [], "an empty batch has mask pieces"
    assert len(pieces.lengths) == 0, "an empty batch has lengths"
    assert pieces.num_tokens == 0


# --- validation ------------------------------------------------------------


@pytest.mark.parametrize(
    ("rows", "padded_len", "pad_id", "message"),
    [
        ([0, -1], 8, 0, "outside the dataset's rows"),
        ([0, 4000], 8, 0, "outside the dataset's rows"),
        ([[0, 1]], 8, 0, "1-D"),
        ([0.0, 1.0], 8, 0, "integers"),
        ([0], 0, 0, "padded_len"),
        ([0], -3, 0, "padded_len"),
        ([0], 2.5, 0, "padded_len"),
        ([0], True, 0, "padded_len"),
        ([0], 8, 2**31, "pad_id"),
        ([0], 8, -(2**31) - 1, "pad_id"),
    ],
)
def test_bad_arguments_are_refused(
    synth: TokenDataset, rows: Any, padded_len: Any, pad_id: Any, message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        Assembler(synth).pieces(np.asarray(rows), padded_len, pad_id)


def test_bool_and_float_columns_are_refused() -> None:
    rows = [[1, 2], [3]]
    for mask in (pa.array([[True, False], [True]]), pa.array([[1.0, 0.0], [1.0]])):
        table = pa.table({"input_ids": pa.array(rows, type=pa.list_(pa.int32())), "loss_mask": mask})
        with pytest.raises(DatasetError, match="loss_mask"):
            Assembler(in_memory(table))


def test_lengths_that_disagree_with_the_offsets_are_refused() -> None:
    table = pa.table(
        {
            "input_ids": pa.array([[1, 2], [3]], type=pa.list_(pa.int32())),
            "loss_mask": pa.array([[1, 0], [1]], type=pa.list_(pa.int8())),
        }
    )
    ds = in_memory(table)
    wrong = TokenDataset(ds.path, 2, np.array([2, 2], dtype=np.int64), ds.fingerprint, False, table)
    with pytest.raises(DatasetError, match="lengths"):
        Assembler(wrong)


# --- memory ----------------------------------------------------------------


def mapped_fresh(path: Path) -> TokenDataset:
    """The saved dataset in a new memory map, its lengths read from the offsets alone.

    ``open_dataset`` samples tokens for the fingerprint, and the kernel maps
    the pages around each sample (fault-around), which on a small dataset is
    every page; this leaves the token pages unmapped, so that RssFile shows
    what the assembler itself touches.
    """
    gc.collect()  # unmap an earlier mapping of the same files
    table = datasets.load_from_disk(str(path)).data.table
    lengths = np.asarray(pc.list_value_length(table.column("input_ids")).to_numpy(), dtype=np.int64)
    return TokenDataset(str(path), table.num_rows, lengths, "0" * 16, False, table)


def test_construction_reads_no_token_page_and_allocates_per_row(tmp_path: Path) -> None:
    rows = 5000
    peaks = {}
    for scale in (1 / 32, 1.0):  # 32x the tokens, the same rows
        make_dataset(tmp_path / f"s{scale}", rows, seed=4, scale=scale)
        ds = mapped_fresh(tmp_path / f"s{scale}")
        file_before = rss_kib("RssFile")
        tracemalloc.start()
        try:
            asm = Assembler(ds)
            peaks[scale] = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        mapped = (rss_kib("RssFile") - file_before) * 1024
        token_bytes = ds.num_tokens * 5
    # the larger dataset, last: building touched next to nothing of its 50 MB of tokens...
    assert mapped < token_bytes // 8, f"building the assembler mapped {mapped} bytes of token pages"
    # ...and the measure is not blind: serving every row maps them
    every = np.arange(rows)
    for first in range(0, rows, 64):
        asm.frame(every[first : first + 64], 8192, **FIELDS)
    mapped = (rss_kib("RssFile") - file_before) * 1024
    assert mapped > token_bytes // 2, f"serving every row mapped only {mapped} bytes: RssFile is blind"
    assert peaks[1.0] < 24 * rows + (1 << 20), f"construction allocated {peaks[1.0]} bytes for {rows} rows"
    assert peaks[1.0] < 1.5 * peaks[1 / 32] + (256 << 10), f"allocation grew with tokens: {peaks}"


def _owned_arrays(value: Any) -> list[npt.NDArray[Any]]:
    """The numpy arrays in ``value`` (lists, tuples, dicts of them) whose memory numpy allocated.

    A view of the dataset's Arrow buffers has a pyarrow object at the end of its ``base`` chain;
    an array numpy allocated (or a view of one) ends in an array that owns its data.
    """
    if isinstance(value, memoryview) and isinstance(value.obj, np.ndarray):
        return _owned_arrays(value.obj)
    if isinstance(value, np.ndarray):
        root = value
        while isinstance(root.base, np.ndarray):
            root = root.base
        return [value] if root.flags.owndata else []
    if isinstance(value, list | tuple):
        return [a for item in value for a in _owned_arrays(item)]
    if isinstance(value, dict):
        return [a for item in value.values() for a in _owned_arrays(item)]
    return []


def test_the_assembler_holds_nothing_a_row() -> None:
    """No per-row table: the assembler's heap grows with chunks, not rows (8 bytes a row: 800 MB at 10^8)."""
    count = 300_000
    ids, mask = _ids_and_mask(count, 7)
    cuts, mask_cuts = [0, 100_000, 200_000, count], [0, 150_000, count]
    table = pa.table(
        {
            "input_ids": pa.chunked_array([ids.slice(a, b - a) for a, b in itertools.pairwise(cuts)]),
            "loss_mask": pa.chunked_array([mask.slice(a, b - a) for a, b in itertools.pairwise(mask_cuts)]),
        }
    )
    ds = in_memory(table)
    tracemalloc.start()
    try:
        asm = Assembler(ds)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < count, f"building the assembler allocated {peak} bytes for {count} rows: a per-row table"
    held = _owned_arrays([v for k, v in vars(asm).items() if k != "dataset"])
    big = [a.shape for a in held if a.size >= count // 4]
    assert not big, f"the assembler holds arrays of its own as long as the rows: {big}"
    assert_matches(asm, ds, np.array([0, 99_999, 100_000, 299_999, 150_000], dtype=np.int64), 8)


def test_serving_an_epoch_keeps_memory_flat(tmp_path: Path) -> None:
    ds = make_dataset(tmp_path / "ds", 20_000, seed=5, scale=1 / 4)
    sched = build_schedule(
        ds.lengths, ScheduleConfig(max_seq_len=2048, bucket_bounds=(0, 2049), token_budget=12288)
    )
    jobs = [(sched.samples(s, 0), sched.padded_len(s, 0)) for s in range(sched.num_steps)]
    asm = Assembler(ds)
    for rows, padded_len in jobs[:5]:  # warm the shared pad rows
        asm.frame(rows, padded_len, **FIELDS)
    gc.collect()
    anon_before = rss_kib("RssAnon")
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        for rows, padded_len in jobs:
            asm.frame(rows, padded_len, **FIELDS)
        current, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    anon_growth = (rss_kib("RssAnon") - anon_before) * 1024
    token_bytes = ds.num_tokens * 5
    assert current - base < 256 << 10, f"{current - base} bytes still held after an epoch"
    assert peak - base < 4 << 20, f"peak {peak - base} bytes while serving"
    assert anon_growth < min(32 << 20, token_bytes // 4), f"anonymous memory grew {anon_growth} bytes"


def frame_checked(asm: Assembler, rows: Any, padded_len: Any, pad_id: Any, **fields: Any) -> Any:
    """``Assembler.frame`` through its checked path (plan, ``codec.batch_frame_head``, copy), or its error."""
    build, assemble._build = assemble._build, None
    try:
        return asm.frame(rows, padded_len, pad_id=pad_id, **fields)
    except (ValueError, codec.WireFormatError) as exc:
        return type(exc), str(exc)
    finally:
        assemble._build = build


@pytest.mark.skipif(assemble._frame_c is None, reason="the compiled frame is not built")
@given(
    picks=st.lists(st.integers(0, 3999), min_size=1, max_size=40),
    width=st.integers(1, 700),
    max_len=st.none() | st.integers(1, 800),
    pad_id=st.sampled_from([0, -1, 7, 2**31 - 1, -(2**31)]),
    epoch=st.sampled_from([0, 1, 2**32, 2**63, 2**64 - 1]),
    step=st.sampled_from([0, 70000, 2**64 - 1]),
    rank=st.sampled_from([0, 1, 2**32 - 1]),
    bucket=st.sampled_from([0, 2, 2**32 - 1]),
    fingerprint=st.text(max_size=20).filter(lambda t: len(t.encode()) <= codec.MAX_FINGERPRINT_BYTES),
)
@settings(max_examples=80, deadline=None)
def test_the_one_call_frame_is_the_checked_one(
    synth: TokenDataset,
    picks: list[int],
    width: int,
    max_len: int | None,
    pad_id: int,
    epoch: int,
    step: int,
    rank: int,
    bucket: int,
    fingerprint: str,
) -> None:
    """``_frame.build`` (plan, header and copy in one call) writes the checked path's bytes."""
    asm = Assembler(synth)
    rows = np.array(picks, dtype=np.int64)
    fields: dict[str, Any] = {"epoch": epoch, "step": step, "rank": rank, "bucket": bucket}
    fields["schedule_fingerprint"] = fingerprint
    got = asm.frame(rows, width, pad_id=pad_id, max_len=max_len, **fields)
    assert got == frame_checked(asm, rows, width, pad_id, max_len=max_len, **fields)
    head, _ = codec.batch_frame_head(rows=len(rows), padded_len=width, real_tokens=got.real_tokens, **fields)
    assert got.data.startswith(head)


@pytest.mark.skipif(assemble._frame_c is None, reason="the compiled frame is not built")
@pytest.mark.parametrize(
    ("rows", "change"),
    [
        ([1, 2], {"rank": -1}),  # out of a field's range: the checked path names it
        ([1, 2], {"epoch": 2**64}),
        ([1, 2], {"bucket": True}),
        ([1, 2], {"schedule_fingerprint": "x" * 65}),
        ([1, 2], {"schedule_fingerprint": b"bytes"}),
        ([1, 2], {"padded_len": 0}),
        ([1, 2], {"padded_len": 2**32}),
        ([1, 2], {"pad_id": 2**31}),
        ([4000], {}),  # a row outside the dataset
        ([-1, 3], {}),
        ([], {}),  # no rows
        ([1.5], {}),
        ([[1, 2]], {}),
        # what the fast case does not take but the checked path converts: the same frame
        ([1, 2], {"epoch": np.uint64(5), "padded_len": np.int32(9), "pad_id": np.int16(-2)}),
        (np.array([3, 1, 2], dtype=np.int32), {}),
        (np.arange(12, dtype=np.int64)[::3], {}),
        ([5, 9], {}),
    ],
)
def test_the_one_call_frame_refuses_or_converts_as_the_checked_one(
    synth: TokenDataset, rows: Any, change: dict[str, Any]
) -> None:
    asm = Assembler(synth)
    args: dict[str, Any] = {**FIELDS, "padded_len": 8, "pad_id": 0, **change}
    padded_len, pad_id = args.pop("padded_len"), args.pop("pad_id")
    expected = frame_checked(asm, rows, padded_len, pad_id, **args)
    try:
        got: Any = asm.frame(rows, padded_len, pad_id=pad_id, **args)
    except (ValueError, codec.WireFormatError) as exc:
        got = type(exc), str(exc)
    assert got == expected


def test_columns_off_the_fast_path_are_named_in_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A loss_mask of Python ints is int64 in datasets: every batch then took the slow path unannounced.

    The compiled frame converts every integer type, so only a build without it warns.
    """
    rows = [[1, 2, 3], [4, 5]]
    wide = datasets.Features(
        {
            "input_ids": datasets.Sequence(datasets.Value("int64")),
            "loss_mask": datasets.Sequence(datasets.Value("int64")),
        }
    )
    wide_ds = save(tmp_path / "wide", {"input_ids": rows, "loss_mask": [[1, 1, 1], [0, 1]]}, wide)
    default_ds = save(tmp_path / "default", {"input_ids": rows, "loss_mask": [[1, 1, 1], [0, 1]]})
    features = datasets.Features(
        {
            "input_ids": datasets.Sequence(datasets.Value("int32")),
            "loss_mask": datasets.Sequence(datasets.Value("int8")),
        }
    )
    fast_ds = save(tmp_path / "fast", {"input_ids": rows, "loss_mask": [[1, 1, 1], [0, 1]]}, features)
    for build in (assemble._build, None):
        monkeypatch.setattr(assemble, "_build", build)
        caplog.clear()
        with caplog.at_level("WARNING", logger="ladle.server"):
            Assembler(wide_ds)
        expected = "input_ids is int64 and loss_mask is int64; batches are converted row by row"
        assert (expected in caplog.text) == (build is None), caplog.text
        caplog.clear()
        with caplog.at_level("WARNING", logger="ladle.server"):  # datasets' default: int32 ids, int64 mask
            Assembler(default_ds)
        assert ("loss_mask is int64; batches are converted row by row" in caplog.text) == (build is None)
        caplog.clear()
        with caplog.at_level("WARNING", logger="ladle.server"):
            Assembler(fast_ds)
        assert not caplog.text


@pytest.mark.skipif(assemble._build is None, reason="the compiled frame is not built")
@pytest.mark.parametrize(
    ("token_type", "mask_type"),
    [
        ("int8", "int8"),
        ("uint8", "int8"),
        ("int16", "int8"),
        ("uint16", "int8"),  # nanoGPT-style ids of a vocabulary under 65,536
        ("uint32", "int8"),
        ("int64", "int8"),  # numpy's and pandas' default
        ("uint64", "int8"),
        ("int64", "int64"),  # Python ints in both columns through Dataset.from_pandas or a cast
        ("uint16", "uint8"),
    ],
)
def test_ids_of_every_integer_type_are_converted_in_c_byte_for_byte(
    tmp_path: Path, token_type: str, mask_type: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The one-call frame converts the ids itself (no fallback to the checked path), extremes included."""
    info = np.iinfo(np.dtype(token_type))
    low, high = max(int(info.min), -(2**31)), min(int(info.max), 2**31 - 1)
    rng = np.random.default_rng(12)
    sizes = rng.integers(1, 300, size=40)
    rows = [rng.integers(low, high, size=int(n), endpoint=True).tolist() for n in sizes]
    rows[3][0], rows[4][-1] = low, high
    masks = [rng.integers(0, 2, size=len(r)).tolist() for r in rows]
    features = datasets.Features(
        {
            "input_ids": datasets.Sequence(datasets.Value(token_type)),
            "loss_mask": datasets.Sequence(datasets.Value(mask_type)),
        }
    )
    ds = save(tmp_path / "ds", {"input_ids": rows, "loss_mask": masks}, features, num_shards=3)
    asm = Assembler(ds)
    assert asm._build_kinds is not None, "the columns did not take the one-call frame"
    cases = (np.arange(40), np.array([39, 3, 4, 0]), np.array([7]))
    expected = []
    for picks in cases:
        assert_matches(asm, ds, picks, 300, pad_id=5)
        pieces = asm.pieces(picks, 300, 5)
        joined = codec.encode_batch_pieces(
            padded_len=300,
            input_ids=pieces.input_ids,
            loss_mask=pieces.loss_mask,
            lengths=pieces.lengths,
            sample_ids=pieces.sample_ids,
            **FIELDS,
        )
        expected.append(joined)

    def no_fallback(*_args: Any, **_kwargs: Any) -> Any:
        raise AssertionError("the frame fell back to the checked path")

    monkeypatch.setattr(asm, "pieces", no_fallback)
    monkeypatch.setattr(asm, "_checked", no_fallback)
    for picks, joined in zip(cases, expected, strict=True):
        assert asm.frame(picks, 300, pad_id=5, **FIELDS).data == joined


@pytest.mark.parametrize("mask_type", ["int16", "int32", "int64"])
def test_a_wide_mask_is_converted_in_c_byte_for_byte(tmp_path: Path, mask_type: str) -> None:
    """Every int8 value (-128..127) survives the conversion; one outside is a DatasetError naming its row."""
    rng = np.random.default_rng(11)
    rows = [rng.integers(1, 30_000, size=int(rng.integers(1, 300))).tolist() for _ in range(40)]
    masks = [rng.integers(-128, 128, size=len(r)).tolist() for r in rows]
    masks[3][0], masks[4][-1] = -128, 127
    features = datasets.Features(
        {
            "input_ids": datasets.Sequence(datasets.Value("int32")),
            "loss_mask": datasets.Sequence(datasets.Value(mask_type)),
        }
    )
    ds = save(tmp_path / "ds", {"input_ids": rows, "loss_mask": masks}, features, num_shards=3)
    asm = Assembler(ds)
    for picks in (np.arange(40), np.array([39, 3, 4, 0]), np.array([7])):
        assert_matches(asm, ds, picks, 300, pad_id=5)
    masks[5][1] = 128
    bad = save(tmp_path / "bad", {"input_ids": rows, "loss_mask": masks}, features)
    with pytest.raises(DatasetError, match=r"row 5 of 'loss_mask' holds 128, outside int8"):
        Assembler(bad).frame(np.array([2, 5]), 300, **FIELDS)
