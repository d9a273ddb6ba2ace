"""open_dataset (validation, lengths, fingerprint) and the synthetic dataset writer."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import datasets
import numpy as np
import numpy.typing as npt
import pyarrow as pa
import pytest
from datasets.table import InMemoryTable

from ladle.service import _writer, synth
from ladle.service.dataset import FINGERPRINT_SAMPLE, TokenDataset, open_dataset
from ladle.service.errors import (
    ConfigError,
    DatasetChangedError,
    DatasetError,
    DatasetNotFoundError,
    EmptyDatasetError,
    LengthMismatchError,
    MissingColumnsError,
    ZeroLengthRowsError,
)
from ladle.service.schedule.config import PRODUCTION_BOUNDS
from ladle.service.synth import make_dataset, production_lengths

TINY = 1 / 32  # production lengths / 32: at most 384 tokens a row


# --- helpers ---------------------------------------------------------------


def save_table(path: Path, table: pa.Table, **save_kwargs: Any) -> Path:
    """Save an Arrow table exactly as a user's ``Dataset.save_to_disk`` would."""
    datasets.Dataset(InMemoryTable(table)).save_to_disk(str(path), **save_kwargs)
    return path


def token_table(
    rows: list[list[int]],
    masks: list[list[int]] | None = None,
    seq_len: list[int] | None = None,
    list_type: Any = pa.list_,
) -> pa.Table:
    columns: dict[str, pa.Array] = {
        "input_ids": pa.array(rows, type=list_type(pa.int32())),
        "loss_mask": pa.array(
            masks if masks is not None else [[1] * len(r) for r in rows],
            type=list_type(pa.int8()),
        ),
    }
    if seq_len is not None:
        columns["seq_len"] = pa.array(seq_len, type=pa.int32())
    return pa.table(columns)


SMALL_ROWS = [[5, 6, 7], [8], [9, 10, 11, 12, 13], [14, 15]]


def small(path: Path, **kwargs: Any) -> Path:
    return save_table(path, token_table(SMALL_ROWS, seq_len=[len(r) for r in SMALL_ROWS]), **kwargs)


def pack_batches(
    lengths: npt.NDArray[np.integer],
    bounds: tuple[int, ...] = PRODUCTION_BOUNDS,
    max_seq_len: int = 8192,
    token_budget: int = 49152,
    max_rows: int = 64,
) -> npt.NDArray[np.int64]:
    """Batches per bucket: lengths cut to max_seq_len, sorted, filled greedily."""
    cut = np.minimum(np.asarray(lengths, dtype=np.int64), max_seq_len)
    bucket = np.searchsorted(np.asarray(bounds), cut, side="right") - 1
    counts = np.zeros(len(bounds) - 1, dtype=np.int64)
    for b in range(len(bounds) - 1):
        sorted_lengths = np.sort(cut[bucket == b])
        cap = np.minimum(max_rows, token_budget // sorted_lengths)
        # a batch from s ends after the last j with j + 1 - cap[j] <= s (rising in j)
        reach = np.arange(1, len(sorted_lengths) + 1) - cap
        start = 0
        while start < len(sorted_lengths):
            start = int(np.searchsorted(reach, start, side="right"))
            counts[b] += 1
    return counts


# --- make_dataset -> open_dataset round trip -------------------------------


def test_round_trip(tmp_path: Path) -> None:
    ds = make_dataset(tmp_path / "ds", 300, seed=3, scale=TINY, vocab_size=1000)
    assert isinstance(ds, TokenDataset)
    assert ds.num_rows == 300
    assert ds.has_seq_len
    assert len(ds.fingerprint) == 16
    int(ds.fingerprint, 16)
    np.testing.assert_array_equal(ds.lengths, production_lengths(300, 3, scale=TINY))
    table = ds.table
    assert table.schema.field("input_ids").type == pa.list_(pa.int32())
    assert table.schema.field("loss_mask").type == pa.list_(pa.int8())
    assert table.schema.field("seq_len").type == pa.int32()
    np.testing.assert_array_equal(ds.lengths, table.column("seq_len").to_numpy())
    rows = table.to_pylist()
    np.testing.assert_array_equal(ds.lengths, [len(r["input_ids"]) for r in rows])
    for row in rows:
        tokens, mask = np.asarray(row["input_ids"]), np.asarray(row["loss_mask"])
        assert len(mask) == len(tokens)
        assert tokens.min() >= 1
        assert tokens.max() < 1000
        assert set(np.unique(mask)) <= {0, 1}
        assert np.all(np.diff(mask) >= 0), "loss_mask is 0s (prompt) then 1s"
        assert mask[-1] == 1, "every row has a trained token"
    # reopening gives the same view
    again = open_dataset(tmp_path / "ds")
    assert again.fingerprint == ds.fingerprint
    np.testing.assert_array_equal(again.lengths, ds.lengths)


def test_lengths_are_read_only(tmp_path: Path) -> None:
    ds = open_dataset(small(tmp_path / "ds"))
    assert ds.lengths.dtype == np.int32, "list columns' lengths are 4 bytes a row (10^8 rows: 400 MB)"
    with pytest.raises(ValueError, match="read-only"):
        ds.lengths[0] = 99
    assert ds.num_tokens == sum(len(r) for r in SMALL_ROWS)


def test_without_seq_len(tmp_path: Path) -> None:
    ds = make_dataset(tmp_path / "ds", 50, seed=1, scale=TINY, with_seq_len=False)
    assert not ds.has_seq_len
    assert "seq_len" not in ds.table.column_names
    np.testing.assert_array_equal(ds.lengths, production_lengths(50, 1, scale=TINY))


def test_make_dataset_is_deterministic(tmp_path: Path) -> None:
    a = make_dataset(tmp_path / "a", 200, seed=7, scale=TINY)
    b = make_dataset(tmp_path / "b", 200, seed=7, scale=TINY)
    c = make_dataset(tmp_path / "c", 200, seed=8, scale=TINY)
    assert a.fingerprint == b.fingerprint
    assert a.table.equals(b.table)
    assert c.fingerprint != a.fingerprint


def test_make_dataset_blocks_do_not_change_rows(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    whole = make_dataset(tmp_path / "whole", 400, seed=2, scale=TINY)
    monkeypatch.setattr(_writer, "BLOCK_TOKENS", 500)
    blocked = make_dataset(tmp_path / "blocked", 400, seed=2, scale=TINY)
    assert whole.num_tokens > 10 * 500, "several blocks were written"
    assert blocked.fingerprint == whole.fingerprint
    assert blocked.table.equals(whole.table)


def test_make_dataset_large_list(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    small_lists = make_dataset(tmp_path / "small", 60, seed=4, scale=TINY)
    monkeypatch.setattr(_writer, "_LARGE_LIST_TOKENS", 0)
    large = make_dataset(tmp_path / "large", 60, seed=4, scale=TINY)
    assert large.table.schema.field("input_ids").type == pa.large_list(pa.int32())
    assert large.table.schema.field("loss_mask").type == pa.large_list(pa.int8())
    np.testing.assert_array_equal(large.lengths, small_lists.lengths)
    assert large.table.column("input_ids").to_pylist() == small_lists.table.column("input_ids").to_pylist()


def test_make_dataset_writes_several_shards(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_writer, "_MAX_SHARD_SIZE", 20_000)
    ds = make_dataset(tmp_path / "ds", 500, seed=0, scale=TINY)
    shards = sorted(p.name for p in (tmp_path / "ds").glob("data-*.arrow"))
    assert len(shards) > 1
    np.testing.assert_array_equal(ds.lengths, production_lengths(500, 0, scale=TINY))


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"rows": 0}, "rows"),
        ({"rows": 10, "scale": 0.0}, "scale"),
        ({"rows": 10, "scale": -1.0}, "scale"),
        ({"rows": 10, "seed": -1}, "seed"),
        ({"rows": 10, "vocab_size": 1}, "vocab_size"),
        ({"rows": 10, "max_seq_len": 0}, "max_seq_len"),
    ],
)
def test_make_dataset_refuses_bad_arguments(tmp_path: Path, kwargs: dict[str, Any], field: str) -> None:
    with pytest.raises(ConfigError) as info:
        make_dataset(tmp_path / "ds", **kwargs)
    assert info.value.field == field
    assert not (tmp_path / "ds").exists()


def test_make_dataset_refuses_non_empty_folder(tmp_path: Path) -> None:
    out = tmp_path / "ds"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(ConfigError) as info:
        make_dataset(out, 10, scale=TINY)
    assert info.value.field == "out"
    assert str(out) in str(info.value)
    assert (out / "keep.txt").read_text() == "mine"


def test_make_dataset_accepts_empty_folder_and_leaves_no_temp(tmp_path: Path) -> None:
    out = tmp_path / "ds"
    out.mkdir()
    make_dataset(out, 10, scale=TINY)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ds"]


def expected_rows(
    rows: int, seed: int, scale: float, vocab_size: int = 32000
) -> list[tuple[list[int], list[int]]]:
    """``(tokens, loss_mask)`` of every row as ``make_dataset`` documents them, one row at a time."""
    lengths = production_lengths(rows, seed, scale=scale)
    row_rng = synth._rng(seed, synth._STREAM_ROWS)
    starts = row_rng.integers(0, synth._POOL_TOKENS, size=rows, dtype=np.int64)
    prompt = np.floor(row_rng.random(rows) * synth._PROMPT_MAX_FRACTION * lengths).astype(np.int64)
    pool_size = synth._POOL_TOKENS + int(lengths.max())
    pool = synth._rng(seed, synth._STREAM_TOKENS).integers(1, vocab_size, size=pool_size, dtype=np.int32)
    return [
        (pool[start : start + length].tolist(), [0] * p + [1] * (length - p))
        for start, length, p in zip(starts.tolist(), lengths.tolist(), prompt.tolist(), strict=True)
    ]


def read_json(path: Path) -> Any:
    return json.loads(path.read_text(encoding="utf-8"))


def read_shard(path: Path) -> pa.Table:
    with pa.OSFile(str(path), "rb") as source:
        return pa.ipc.open_stream(source).read_all()


@pytest.mark.parametrize(("with_seq_len", "large"), [(True, False), (False, False), (True, True)])
def test_make_dataset_matches_save_to_disk(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, with_seq_len: bool, large: bool
) -> None:
    """The folder written shard by shard is the one ``Dataset.save_to_disk`` writes for the same rows."""
    monkeypatch.setattr(_writer, "_MAX_SHARD_SIZE", 30_000)
    if large:
        monkeypatch.setattr(_writer, "_LARGE_LIST_TOKENS", 0)
    rows, seed = 500, 6
    ours = tmp_path / "ours"
    make_dataset(ours, rows, seed, scale=TINY, with_seq_len=with_seq_len)
    expected = expected_rows(rows, seed, TINY)
    table = token_table(
        [tokens for tokens, _ in expected],
        [mask for _, mask in expected],
        seq_len=[len(tokens) for tokens, _ in expected] if with_seq_len else None,
        list_type=pa.large_list if large else pa.list_,
    )
    reference = save_table(tmp_path / "reference", table, max_shard_size=_writer._MAX_SHARD_SIZE)

    files = sorted(p.name for p in ours.iterdir())
    assert files == sorted(p.name for p in reference.iterdir())
    shards = [name for name in files if name.startswith("data-")]
    assert len(shards) > 1
    assert shards[-1] == f"data-{len(shards) - 1:05d}-of-{len(shards):05d}.arrow"
    state, reference_state = read_json(ours / "state.json"), read_json(reference / "state.json")
    assert state.keys() == reference_state.keys()
    assert state["_data_files"] == [{"filename": name} for name in shards]
    assert {k: v for k, v in state.items() if k != "_fingerprint"} == {
        k: v for k, v in reference_state.items() if k != "_fingerprint"
    }
    info, reference_info = read_json(ours / "dataset_info.json"), read_json(reference / "dataset_info.json")
    assert info["features"] == reference_info["features"]
    assert info == reference_info
    for name in shards:  # same rows per shard, same schema and huggingface metadata
        ours_shard, reference_shard = read_shard(ours / name), read_shard(reference / name)
        assert ours_shard.schema.equals(reference_shard.schema, check_metadata=True)
        assert ours_shard.equals(reference_shard)

    loaded, reference_loaded = datasets.load_from_disk(str(ours)), datasets.load_from_disk(str(reference))
    assert loaded.features == reference_loaded.features
    assert loaded.num_rows == rows
    assert loaded.data.table.equals(reference_loaded.data.table)
    assert loaded[:3] == reference_loaded[:3]
    assert loaded[rows - 1]["input_ids"] == expected[-1][0]


def test_make_dataset_state_is_deterministic(tmp_path: Path) -> None:
    make_dataset(tmp_path / "a", 200, seed=7, scale=TINY)
    make_dataset(tmp_path / "b", 200, seed=7, scale=TINY)
    make_dataset(tmp_path / "c", 200, seed=8, scale=TINY)
    state = read_json(tmp_path / "a" / "state.json")
    assert state == read_json(tmp_path / "b" / "state.json")
    assert state["_fingerprint"] != read_json(tmp_path / "c" / "state.json")["_fingerprint"]
    assert datasets.load_from_disk(str(tmp_path / "a"))._fingerprint == (
        datasets.load_from_disk(str(tmp_path / "b"))._fingerprint
    )


@pytest.mark.parametrize("where", ["generating", "writing"])
def test_make_dataset_leaves_nothing_when_it_fails(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, where: str
) -> None:
    """A failure while generating rows, or in the writer thread, leaves neither ``out`` nor a temp folder."""
    made = 0
    block = _writer._block

    def failing_block(*args: Any) -> pa.RecordBatch:
        nonlocal made
        made += 1
        batch = block(*args)
        if made <= 5:
            return batch
        if where == "generating":
            raise OSError("disk full")
        return pa.RecordBatch.from_arrays(batch.columns[:1], names=batch.schema.names[:1])

    monkeypatch.setattr(_writer, "_block", failing_block)
    monkeypatch.setattr(_writer, "_MAX_SHARD_SIZE", 20_000)
    with pytest.raises((OSError, ValueError), match="disk full" if where == "generating" else "schema"):
        make_dataset(tmp_path / "ds", 500, seed=0, scale=TINY)
    assert made > 5
    assert list(tmp_path.iterdir()) == []


# --- the production length mix ---------------------------------------------


def test_production_mix_longest_bucket_is_about_half_the_batches() -> None:
    lengths = production_lengths(200_000, seed=0)
    assert lengths.dtype == np.int32
    counts = pack_batches(lengths)
    share = counts[-1] / counts.sum()
    assert 0.45 <= share <= 0.60, f"longest bucket yields {share:.1%} of batches ({counts})"


def test_production_lengths_shape() -> None:
    lengths = production_lengths(200_000, seed=0)
    assert lengths.min() >= 1
    assert lengths.max() <= 12288
    overlong = np.mean(lengths > 8192)
    assert 0.002 <= overlong <= 0.004
    np.testing.assert_array_equal(lengths, production_lengths(200_000, seed=0))
    assert not np.array_equal(lengths, production_lengths(200_000, seed=1))


def test_production_lengths_scale() -> None:
    full = production_lengths(10_000, seed=5)
    tiny = production_lengths(10_000, seed=5, scale=TINY)
    assert tiny.min() >= 1
    np.testing.assert_array_equal(tiny, np.ceil(full * TINY).astype(np.int32))
    # over-long rows stay over-long at the scaled max_seq_len
    np.testing.assert_array_equal(tiny > 8192 * TINY, full > 8192)


# --- fingerprint -----------------------------------------------------------


def test_fingerprint_stable_across_saves_and_sharding(tmp_path: Path) -> None:
    a = open_dataset(small(tmp_path / "a"))
    b = open_dataset(small(tmp_path / "b", num_shards=2))
    assert a.fingerprint == b.fingerprint
    assert len(b.table.column("input_ids").chunks) >= 2


def test_fingerprint_changes_with_a_length(tmp_path: Path) -> None:
    base = open_dataset(small(tmp_path / "base")).fingerprint
    rows = [list(r) for r in SMALL_ROWS]
    rows[2].append(99)
    changed = open_dataset(
        save_table(tmp_path / "changed", token_table(rows, seq_len=[len(r) for r in rows]))
    )
    assert changed.fingerprint != base


def test_fingerprint_changes_with_a_token(tmp_path: Path) -> None:
    base = open_dataset(small(tmp_path / "base")).fingerprint
    rows = [list(r) for r in SMALL_ROWS]
    rows[2][3] += 1  # small data: every token is sampled
    seq = [len(r) for r in rows]
    assert open_dataset(save_table(tmp_path / "tok", token_table(rows, seq_len=seq))).fingerprint != base
    masks = [[1] * len(r) for r in SMALL_ROWS]
    masks[0][0] = 0
    assert (
        open_dataset(save_table(tmp_path / "mask", token_table(SMALL_ROWS, masks, seq))).fingerprint != base
    )


def test_fingerprint_samples_large_data(tmp_path: Path) -> None:
    """Past FINGERPRINT_SAMPLE tokens: sampled tokens count, unsampled ones (documented) do not."""
    rng = np.random.default_rng(0)
    rows = [rng.integers(1, 1000, size=100).tolist() for _ in range(100)]  # 10,000 tokens
    assert sum(map(len, rows)) > FINGERPRINT_SAMPLE
    base = open_dataset(save_table(tmp_path / "base", token_table(rows))).fingerprint

    first = [list(r) for r in rows]
    first[0][0] += 1  # position 0 is always sampled
    assert open_dataset(save_table(tmp_path / "first", token_table(first))).fingerprint != base
    last = [list(r) for r in rows]
    last[-1][-1] += 1  # so is the last position
    assert open_dataset(save_table(tmp_path / "last", token_table(last))).fingerprint != base
    # flattened position 1 lies between the sampled positions 0 and 2
    unsampled = [list(r) for r in rows]
    unsampled[0][1] += 1
    assert open_dataset(save_table(tmp_path / "uns", token_table(unsampled))).fingerprint == base


# --- chunks, shards and sliced chunks --------------------------------------


def test_lengths_across_shards_and_chunks(tmp_path: Path) -> None:
    rng = np.random.default_rng(1)
    lengths = rng.integers(1, 50, size=1000)
    rows = [list(range(1, n + 1)) for n in lengths.tolist()]
    path = save_table(tmp_path / "ds", token_table(rows, seq_len=lengths.tolist()), num_shards=3)
    ds = open_dataset(path)
    assert ds.table.column("input_ids").num_chunks >= 3
    np.testing.assert_array_equal(ds.lengths, lengths)


def test_sliced_chunks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Chunks that are slices of bigger arrays (non-zero offsets) read the right lengths."""
    rng = np.random.default_rng(2)
    lengths = rng.integers(1, 20, size=60)
    rows = [rng.integers(1, 500, size=n).tolist() for n in lengths.tolist()]
    whole = token_table(rows, seq_len=lengths.tolist())
    reference = open_dataset(save_table(tmp_path / "ref", whole))

    def sliced(name: str) -> pa.ChunkedArray:
        # the column as chunks [0, 7) [7, 30) [30, 60), each a slice of a padded array
        padded = pa.concat_arrays([whole.column(name).chunk(0).slice(50), *whole.column(name).chunks])
        shift = len(padded) - len(whole)
        return pa.chunked_array([padded.slice(shift + a, b - a) for a, b in [(0, 7), (7, 30), (30, 60)]])

    table = pa.table({name: sliced(name) for name in whole.column_names})
    assert table.column("input_ids").chunk(1).offset > 0
    monkeypatch.setattr(datasets, "load_from_disk", lambda *a, **k: datasets.Dataset(InMemoryTable(table)))
    ds = open_dataset(tmp_path / "ref")  # the folder is real; its content comes from `table`
    np.testing.assert_array_equal(ds.lengths, lengths)
    assert ds.fingerprint == reference.fingerprint


def test_large_list_columns(tmp_path: Path) -> None:
    ds = open_dataset(save_table(tmp_path / "ds", token_table(SMALL_ROWS, list_type=pa.large_list)))
    np.testing.assert_array_equal(ds.lengths, [len(r) for r in SMALL_ROWS])
    assert not ds.has_seq_len


# --- every refusal ---------------------------------------------------------


def test_missing_path(tmp_path: Path) -> None:
    missing = tmp_path / "nope"
    with pytest.raises(DatasetNotFoundError) as info:
        open_dataset(missing)
    assert str(missing) in str(info.value)
    assert info.value.kind == "not_found"


def test_plain_folder_is_not_a_dataset(tmp_path: Path) -> None:
    (tmp_path / "folder").mkdir()
    (tmp_path / "folder" / "data.txt").write_text("hello")
    with pytest.raises(DatasetError, match="not a saved dataset") as info:
        open_dataset(tmp_path / "folder")
    assert str(tmp_path / "folder") in str(info.value)
    assert type(info.value) is DatasetError


def test_file_is_not_a_dataset(tmp_path: Path) -> None:
    (tmp_path / "file.arrow").write_bytes(b"")
    with pytest.raises(DatasetError, match="is a file"):
        open_dataset(tmp_path / "file.arrow")


def test_a_file_path_is_refused_with_what_to_pass_instead(tmp_path: Path) -> None:
    path = small(tmp_path / "ds")
    shard = next(path.glob("data-*.arrow"))
    with pytest.raises(DatasetError, match=r"belongs to a saved dataset: pass its folder, .*ds$"):
        open_dataset(shard)
    parquet = tmp_path / "data.parquet"
    parquet.write_bytes(b"PAR1")
    with pytest.raises(DatasetError, match=r"Dataset\.from_parquet\('.*data\.parquet'\)\.save_to_disk"):
        open_dataset(parquet)


def test_a_shard_cut_short_says_so(tmp_path: Path) -> None:
    path = small(tmp_path / "ds")
    shard = next(path.glob("data-*.arrow"))
    shard.write_bytes(shard.read_bytes()[:-200])  # as a reader sees a save_to_disk still writing
    with pytest.raises(DatasetError, match="shorter than its header says") as info:
        open_dataset(path)
    assert type(info.value) is DatasetError


def test_a_bool_loss_mask_is_refused_with_the_cast_to_make(tmp_path: Path) -> None:
    table = pa.table(
        {
            "input_ids": pa.array([[1, 2], [3]], type=pa.list_(pa.int32())),
            "loss_mask": pa.array([[True, False], [True]], type=pa.list_(pa.bool_())),
        }
    )
    with pytest.raises(DatasetError, match=r"cast_column\('loss_mask', Sequence\(Value\('int8'\)\)\)"):
        open_dataset(save_table(tmp_path / "ds", table))


def test_other_column_names_get_the_column_option_that_fits(tmp_path: Path) -> None:
    """A tokenizer's output named otherwise (tokens): the error lists the columns and names the option."""
    table = pa.table(
        {
            "tokens": pa.array([[1, 2], [3]], type=pa.list_(pa.int32())),
            "attention_mask": pa.array([[1, 1], [1]], type=pa.list_(pa.int8())),
            "text": ["a b", "c"],
        }
    )
    with pytest.raises(MissingColumnsError) as info:
        open_dataset(save_table(tmp_path / "ds", table))
    message = str(info.value)
    assert "--column input_ids=tokens" in message
    assert "['tokens', 'attention_mask', 'text']" in message
    assert "input_ids=attention_mask" not in message


def test_a_fixed_size_list_gets_the_cast_that_fixes_it(tmp_path: Path) -> None:
    features = datasets.Features(
        {
            "input_ids": datasets.Sequence(datasets.Value("int32"), length=2),
            "loss_mask": datasets.Sequence(datasets.Value("int8")),
        }
    )
    ds = datasets.Dataset.from_dict({"input_ids": [[1, 2], [3, 4]], "loss_mask": [[1, 1], [0, 1]]}, features)
    ds.save_to_disk(str(tmp_path / "fixed"))
    with pytest.raises(DatasetError, match=r"ds\.cast_column\('input_ids', Sequence\(Value\('int32'\)\)\)"):
        open_dataset(tmp_path / "fixed")
    fixed = ds.cast_column("input_ids", datasets.Sequence(datasets.Value("int32")))  # what it says, works
    fixed.save_to_disk(str(tmp_path / "cast"))
    assert open_dataset(tmp_path / "cast").lengths.tolist() == [2, 2]


def test_every_column_of_the_wrong_type_is_named_in_one_error(tmp_path: Path) -> None:
    """One run names them all (it took a run per column), with the cast for a float mask."""
    features = datasets.Features(
        {
            "input_ids": datasets.Sequence(datasets.Value("int32"), length=2),
            "loss_mask": datasets.Sequence(datasets.Value("float32")),
        }
    )
    ds = datasets.Dataset.from_dict({"input_ids": [[1, 2]], "loss_mask": [[1.0, 0.0]]}, features)
    ds.save_to_disk(str(tmp_path / "both"))
    with pytest.raises(DatasetError) as info:
        open_dataset(tmp_path / "both")
    message = str(info.value)
    assert "ds.cast_column('input_ids', Sequence(Value('int32')))" in message, message
    assert "ds.cast_column('loss_mask', Sequence(Value('int8')))" in message, message


def test_columns_ladle_does_not_read_are_named_in_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Rows saved padded (tokenizer(..., padding='max_length')) would be served with padding as tokens;
    an attention_mask of ones (what a tokenizer writes for unpadded rows) is no warning's business."""
    padded = [[1] * len(r) for r in SMALL_ROWS]
    padded[2] = [1, 1, 1, 0, 0]  # right padding
    padded[3] = [0, 1]  # left padding
    table = token_table(SMALL_ROWS).append_column(
        "attention_mask", pa.array(padded, type=pa.list_(pa.int64()))
    )
    table = table.append_column("labels", pa.array(SMALL_ROWS, type=pa.list_(pa.int64())))
    with caplog.at_level("WARNING", logger="ladle.dataset"):
        open_dataset(save_table(tmp_path / "ds", table))
    assert "2 of 4 sampled rows end in padding ('attention_mask' is 0" in caplog.text
    assert "served with their padding as tokens" in caplog.text
    assert "'labels'" not in caplog.text  # beside a loss_mask, which wins, it is usual: an info line
    caplog.clear()
    ones = token_table(SMALL_ROWS).append_column(
        "attention_mask", pa.array([[1] * len(r) for r in SMALL_ROWS], type=pa.list_(pa.int8()))
    )
    with caplog.at_level("WARNING", logger="ladle.dataset"):
        open_dataset(save_table(tmp_path / "ones", ones))
        open_dataset(small(tmp_path / "plain"))
    assert not caplog.text


def test_corrupt_shard(tmp_path: Path) -> None:
    path = small(tmp_path / "ds")
    next(path.glob("data-*.arrow")).write_bytes(b"not arrow")
    with pytest.raises(DatasetError, match="could not be opened"):
        open_dataset(path)


def test_dataset_dict_needs_a_split(tmp_path: Path) -> None:
    train = datasets.Dataset(InMemoryTable(token_table(SMALL_ROWS)))
    datasets.DatasetDict({"train": train}).save_to_disk(str(tmp_path / "dd"))
    with pytest.raises(DatasetError, match="DatasetDict") as info:
        open_dataset(tmp_path / "dd")
    assert "train" in str(info.value)
    assert open_dataset(tmp_path / "dd" / "train").num_rows == len(SMALL_ROWS)


def test_indices_mapping_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = small(tmp_path / "ds")
    shuffled = datasets.Dataset(InMemoryTable(token_table(SMALL_ROWS))).select([3, 1, 0, 2])
    assert shuffled._indices is not None
    monkeypatch.setattr(datasets, "load_from_disk", lambda *a, **k: shuffled)
    with pytest.raises(DatasetError, match="flatten_indices"):
        open_dataset(path)


def test_missing_columns(tmp_path: Path) -> None:
    text = pa.table({"text": ["hello", "world"]})  # not tokenized: the hint is make-dataset
    with pytest.raises(MissingColumnsError) as info:
        open_dataset(save_table(tmp_path / "text", text))
    message = str(info.value)
    assert info.value.missing == ["input_ids"]
    assert str(tmp_path / "text") in message
    assert "tokenize it first" in message, message
    assert "ladle make-dataset OUT --from-hf" in message
    assert "--text-column" in message


def test_empty_dataset(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # save_to_disk writes no shard for zero rows
    with pytest.raises(EmptyDatasetError) as info:
        open_dataset(save_table(tmp_path / "ds", token_table([])))
    assert str(tmp_path / "ds") in str(info.value)
    # a loaded dataset with zero rows (however it came about) is refused the same way
    path = small(tmp_path / "other")
    empty = datasets.Dataset(InMemoryTable(token_table([])))
    monkeypatch.setattr(datasets, "load_from_disk", lambda *a, **k: empty)
    with pytest.raises(EmptyDatasetError, match="no rows"):
        open_dataset(path)


def test_seq_len_mismatch(tmp_path: Path) -> None:
    seq = [len(r) for r in SMALL_ROWS]
    seq[1] += 1
    seq[3] = 7
    with pytest.raises(LengthMismatchError) as info:
        open_dataset(save_table(tmp_path / "ds", token_table(SMALL_ROWS, seq_len=seq)))
    assert "seq_len disagrees with the length of input_ids" in str(info.value)
    assert info.value.count == 2
    assert info.value.first_rows == [1, 3]


def test_loss_mask_length_mismatch(tmp_path: Path) -> None:
    masks = [[1] * len(r) for r in SMALL_ROWS]
    masks[2] = masks[2][:-1]
    with pytest.raises(LengthMismatchError) as info:
        open_dataset(save_table(tmp_path / "ds", token_table(SMALL_ROWS, masks)))
    assert "loss_mask" in str(info.value)
    assert info.value.first_rows == [2]


def test_zero_length_rows(tmp_path: Path) -> None:
    rows = [[1, 2], [], [3], []]
    with pytest.raises(ZeroLengthRowsError) as info:
        open_dataset(save_table(tmp_path / "ds", token_table(rows, seq_len=[2, 0, 1, 0])))
    assert info.value.count == 2
    assert info.value.first_rows == [1, 3]


@pytest.mark.parametrize(
    ("column", "array", "type_text"),
    [
        ("input_ids", pa.array([["a"], ["b", "c"]]), "string"),
        ("input_ids", pa.array([1, 2], type=pa.int32()), "int32"),
        ("loss_mask", pa.array([[1.0], [0.5, 1.0]]), "double"),
        ("seq_len", pa.array([1.0, 2.0]), "double"),
        ("seq_len", pa.array([[1], [2]]), "list"),
    ],
)
def test_wrong_column_types(tmp_path: Path, column: str, array: pa.Array, type_text: str) -> None:
    table = token_table([[1], [2, 3]], seq_len=[1, 2])
    table = table.set_column(table.column_names.index(column), column, array)
    with pytest.raises(DatasetError) as info:
        open_dataset(save_table(tmp_path / "ds", table))
    assert type(info.value) is DatasetError
    assert repr(column) in str(info.value)
    assert type_text in str(info.value)


def test_null_rows_and_tokens(tmp_path: Path) -> None:
    null_row = token_table([[1], [2, 3]]).set_column(
        0, "input_ids", pa.array([[1], None], type=pa.list_(pa.int32()))
    )
    with pytest.raises(DatasetError, match=r"'input_ids' is null in 1 row\(s\) \(first rows: \[1\]\)"):
        open_dataset(save_table(tmp_path / "row", null_row))
    null_token = token_table([[1], [2, 3]]).set_column(
        1, "loss_mask", pa.array([[1], [1, None]], type=pa.list_(pa.int8()))
    )
    with pytest.raises(DatasetError, match=r"'loss_mask' has null token.*first rows: \[1\]"):
        open_dataset(save_table(tmp_path / "token", null_token))


def test_a_batch_checks_the_files_that_hold_its_rows(tmp_path: Path) -> None:
    """One stat per file a batch reads, not per file of the dataset (512 shards cost 5 ms a batch)."""
    rows = [[i + 1] * (1 + i % 7) for i in range(100)]
    folder = save_table(tmp_path / "ds", token_table(rows), num_shards=20)
    ds = open_dataset(folder)
    assert len(ds.files) == 20
    assert ds.file_ends is not None
    assert ds.file_ends.tolist() == list(range(5, 101, 5))
    last = Path(ds.files[19].path)
    with last.open("ab") as out:  # the last shard grows under the mapping
        out.write(b"\0")
    ds.check_files(np.array([0, 4, 5, 9], dtype=np.int64))  # rows of the first two shards only
    for batch in (np.array([5, 95], dtype=np.int64), np.array([99], dtype=np.int64), None):
        with pytest.raises(DatasetChangedError, match="its size changed"):
            ds.check_files(batch)
    # as many rows as files: picking them would cost more than checking all
    with pytest.raises(DatasetChangedError, match="its size changed"):
        ds.check_files(np.arange(10, dtype=np.int64))


def test_paths_that_are_not_a_saved_folder_say_what_to_do(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for url in ("s3://bucket/tokenized", "hf://datasets/org/name"):
        with pytest.raises(DatasetNotFoundError, match=f"^{url} is a URL: ladle reads a local folder"):
            open_dataset(url)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(DatasetNotFoundError, match=r"if 'org/name' is a Hugging Face Hub id.*load_dataset"):
        open_dataset("org/name")
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / "dataset_info.json").write_text("{}")
    (cache / "json-train.arrow").write_bytes(b"")
    with pytest.raises(DatasetError, match=r"a load_dataset cache folder is not one.*no state\.json;"):
        open_dataset(cache)
    with pytest.raises(DatasetError, match=r"Dataset\.from_file\('.*json-train\.arrow'\)\.save_to_disk"):
        open_dataset(cache / "json-train.arrow")


def test_check_values_finds_the_row_a_batch_would_refuse_before_training(tmp_path: Path) -> None:
    """Ids beyond int32 (or mask values beyond int8) were found only when their batch was made."""
    from ladle.service.assemble import check_values

    rows = [[1, 2], [3, 2**31 + 5, 4], [6]]
    table = pa.table(
        {
            "input_ids": pa.array(rows, type=pa.list_(pa.int64())),
            "loss_mask": pa.array([[1] * len(r) for r in rows], type=pa.list_(pa.int64())),
        }
    )
    bad = open_dataset(save_table(tmp_path / "bad", table, num_shards=2))
    with pytest.raises(DatasetError, match=r"row 1 of 'input_ids' holds 2147483653, outside int32"):
        check_values(bad)
    masks = [[1, 1], [0, 200, 1], [-3]]
    weights = pa.table(
        {
            "input_ids": pa.array([[1, 2], [3, -100, 4], [6]], type=pa.list_(pa.int32())),
            "loss_mask": pa.array(masks, type=pa.list_(pa.int64())),
        }
    )
    with pytest.raises(DatasetError, match=r"row 1 of 'loss_mask' holds 200, outside int8.*weights"):
        check_values(open_dataset(save_table(tmp_path / "weights", weights)))
    masks[1][1] = 1
    fine = weights.set_column(1, "loss_mask", pa.array(masks, type=pa.list_(pa.int64())))
    found = check_values(open_dataset(save_table(tmp_path / "fine", fine)))
    assert found == {"input_ids": (-100, 6), "loss_mask": (-3, 1)}
