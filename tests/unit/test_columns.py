"""Tokenized datasets served as they are: the token ids and the loss mask's source (``Columns``).

A ``save_to_disk`` folder with ``input_ids`` and a mask from ``loss_mask``,
from Hugging Face ``labels`` (no loss where -100) or none at all (loss on
every token), any of them under another name with ``--column ROLE=NAME``:
no copy, the mask derived as batches are made, in C and in the fallbacks
alike, and the choice in the fingerprint.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import datasets
import numpy as np
import pyarrow as pa
import pytest
from datasets.table import InMemoryTable
from hypothesis import given, settings
from hypothesis import strategies as st

from ladle.proto import codec
from ladle.service import assemble
from ladle.service.assemble import Assembler, check_values
from ladle.service.cli import main
from ladle.service.dataset import IGNORE_INDEX, Columns, open_dataset, parse_columns
from ladle.service.errors import (
    ConfigError,
    DatasetError,
    LengthMismatchError,
    MissingColumnsError,
)

FIELDS: dict[str, Any] = {"epoch": 1, "step": 9, "rank": 0, "bucket": 0, "schedule_fingerprint": "ab" * 8}
IDS = [[5, 6, 7, 8], [9, 10], [11, 12, 13]]
LABELS = [[-100, -100, 7, 8], [-100, 10], [11, 12, -100]]
# ladle's own format, hashed before columns could be chosen: a job made then must keep its fingerprint
OWN_FORMAT_FINGERPRINT = "75702d6900249e9e"


def save(path: Path, columns: dict[str, Any]) -> Path:
    datasets.Dataset(InMemoryTable(pa.table(columns))).save_to_disk(str(path))
    return path


def ids_column(rows: list[list[int]] = IDS, kind: Any = None) -> pa.Array:
    return pa.array(rows, type=pa.list_(kind or pa.int32()))


def expected(
    rows: list[list[int]], masks: list[list[int]], picks: list[int], width: int
) -> tuple[bytes, bytes]:
    """The padded ids and mask of ``picks``, built the obvious way."""
    ids = np.zeros((len(picks), width), dtype="<i4")
    mask = np.zeros((len(picks), width), dtype="<i1")
    for i, row in enumerate(picks):
        n = min(len(rows[row]), width)
        ids[i, :n] = rows[row][:n]
        mask[i, :n] = masks[row][:n]
    return ids.tobytes(), mask.tobytes()


def frames(asm: Assembler, picks: list[int], width: int) -> list[bytes]:
    """The batch's frame by every path there is: compiled (one call), compiled pieces, Python pieces."""
    rows = np.asarray(picks, dtype=np.int64)
    out = [asm.frame(rows, width, **FIELDS).data]
    if assemble._build is not None and asm._build_kinds is not None:
        built, _, _ = assemble._build(
            *FIELDS.values(),
            rows,
            width,
            width,
            0,
            *asm._tables,
            asm._ids_bytes,
            asm._mask_bytes,
            *asm._build_kinds,
        )
        out.append(built)  # called directly: a refusal would otherwise fall back without a sound
    pieces = asm.pieces(rows, width)
    fields = {**FIELDS, "padded_len": width}
    out.append(
        codec.encode_batch_pieces(
            **fields,
            input_ids=pieces.input_ids,
            loss_mask=pieces.loss_mask,
            lengths=pieces.lengths,
            sample_ids=pieces.sample_ids,
        )
    )
    return out


def assert_served(
    ds: Any, rows: list[list[int]], masks: list[list[int]], picks: list[int], width: int
) -> None:
    asm = Assembler(ds)
    want_ids, want_mask = expected(rows, masks, picks, width)
    pieces = asm.pieces(np.asarray(picks), width)
    assert b"".join(pieces.input_ids) == want_ids, "the input_ids pieces differ"
    assert b"".join(pieces.loss_mask) == want_mask, "the loss_mask pieces differ"
    for data in frames(asm, picks, width):
        batch = codec.decode_batch(data)
        assert batch.input_ids.tobytes() == want_ids, "the frame's input_ids differ"
        assert batch.loss_mask.tobytes() == want_mask, (batch.loss_mask.tolist(), want_mask)


# --- choosing the columns ----------------------------------------------------------------


def test_labels_give_the_mask_where_not_minus_100(tmp_path: Path) -> None:
    ds = open_dataset(
        save(tmp_path / "ds", {"input_ids": ids_column(), "labels": ids_column(LABELS, pa.int64())})
    )
    assert ds.columns == Columns("input_ids", "labels", "labels")
    masks = [[int(v != IGNORE_INDEX) for v in row] for row in LABELS]
    assert_served(ds, IDS, masks, [2, 0, 1], 5)
    assert check_values(ds) == {"input_ids": (5, 13)}  # a derived mask is 0 or 1: not read


def test_no_mask_column_puts_loss_on_every_token(tmp_path: Path) -> None:
    ds = open_dataset(save(tmp_path / "ds", {"input_ids": ids_column()}))
    assert ds.columns.mask_from == "none"
    assert ds.columns.mask is None
    assert "loss on every token" in ds.columns.describe()
    assert_served(ds, IDS, [[1] * len(r) for r in IDS], [1, 2, 0], 4)


def test_loss_mask_wins_over_labels_unless_labels_are_named(tmp_path: Path) -> None:
    weights = [[1, 0, 1, 0], [0, 1], [1, 1, 1]]
    path = save(
        tmp_path / "ds",
        {
            "input_ids": ids_column(),
            "loss_mask": ids_column(weights, pa.int8()),
            "labels": ids_column(LABELS, pa.int64()),
        },
    )
    own = open_dataset(path)
    assert own.columns == Columns()
    assert own.fingerprint == OWN_FORMAT_FINGERPRINT
    assert_served(own, IDS, weights, [0, 1, 2], 4)
    from_labels = open_dataset(path, ["labels=labels"])
    assert from_labels.columns.mask_from == "labels"
    assert from_labels.fingerprint != own.fingerprint  # a job on one is not resumed on the other
    assert_served(from_labels, IDS, [[int(v != -100) for v in r] for r in LABELS], [0, 1, 2], 4)


def test_other_names_are_served_with_the_column_option(tmp_path: Path) -> None:
    path = save(
        tmp_path / "ds",
        {
            "tokens": ids_column(),
            "targets": ids_column(LABELS, pa.int32()),
            "input_ids": ids_column([[1]] * 3),
        },
    )
    ds = open_dataset(path, {"input_ids": "tokens", "labels": "targets"})
    assert ds.columns == Columns("tokens", "labels", "targets")
    assert ds.lengths.tolist() == [4, 2, 3]
    assert ds.columns.describe() == "token ids from 'tokens', loss where 'targets' is not -100"
    assert_served(ds, IDS, [[int(v != -100) for v in r] for r in LABELS], [2, 1], 3)
    assert open_dataset(path, ["input_ids=tokens", "labels=targets"]).fingerprint == ds.fingerprint


@pytest.mark.parametrize("kind", [pa.int8(), pa.int16(), pa.int32(), pa.int64()])
def test_every_signed_labels_type_is_read_in_c_and_python(
    tmp_path: Path, kind: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    ds = open_dataset(save(tmp_path / "ds", {"input_ids": ids_column(), "labels": ids_column(LABELS, kind)}))
    masks = [[int(v != -100) for v in r] for r in LABELS]
    if assemble._build is not None:
        assert Assembler(ds)._build_kinds == ("i4", f"l{kind.byte_width}")
    assert_served(ds, IDS, masks, [0, 2, 1], 6)
    monkeypatch.setattr(assemble, "_build", None)
    monkeypatch.setattr(assemble, "_frame_c", None)
    assert_served(ds, IDS, masks, [0, 2, 1], 6)


@given(
    rows=st.lists(
        st.lists(st.sampled_from([-100, -100, 0, 1, 99, 2**15 - 1, -(2**15)]), min_size=1, max_size=12),
        min_size=1,
        max_size=8,
    ),
    picks=st.lists(st.integers(0, 7), min_size=1, max_size=6),
    width=st.integers(1, 14),
)
@settings(max_examples=40, deadline=None)
def test_property_labels_masks_match_the_obvious_one(
    rows: list[list[int]], picks: list[int], width: int
) -> None:
    picks = [p % len(rows) for p in picks]
    ids = [[abs(v) % 1000 + 1 for v in row] for row in rows]
    table = pa.table({"input_ids": ids_column(ids), "labels": ids_column(rows, pa.int16())})
    ds = open_dataset_in_memory(table, Columns("input_ids", "labels", "labels"))
    masks = [[int(v != -100) for v in row] for row in rows]
    assert_served(ds, ids, masks, picks, width)


def open_dataset_in_memory(table: pa.Table, columns: Columns) -> Any:
    from ladle.service.dataset import TokenDataset

    lengths = np.asarray([len(r) for r in table.column("input_ids").to_pylist()], dtype=np.int64)
    return TokenDataset("<memory>", table.num_rows, lengths, "0" * 16, False, table, columns=columns)


# --- what is refused ---------------------------------------------------------------------


def test_labels_of_another_length_are_refused(tmp_path: Path) -> None:
    bad = [list(r) for r in LABELS]
    bad[1] = [-100]
    with pytest.raises(
        LengthMismatchError, match=r"labels length disagrees with the length of input_ids.*\[1\]"
    ):
        open_dataset(
            save(tmp_path / "ds", {"input_ids": ids_column(), "labels": ids_column(bad, pa.int64())})
        )


def test_unsigned_or_non_list_labels_are_refused(tmp_path: Path) -> None:
    unsigned = {"input_ids": ids_column(), "labels": ids_column([[1] * len(r) for r in IDS], pa.uint32())}
    with pytest.raises(DatasetError, match="unsigned labels cannot hold -100"):
        open_dataset(save(tmp_path / "u", unsigned))
    text = {"input_ids": ids_column(), "labels": pa.array(["a", "b", "c"])}
    with pytest.raises(DatasetError, match=r"column 'labels' has Arrow type string"):
        open_dataset(save(tmp_path / "t", text))


def test_a_named_column_that_is_missing_names_the_role_and_the_columns(tmp_path: Path) -> None:
    path = save(tmp_path / "ds", {"input_ids": ids_column(), "text": pa.array(["a", "b", "c"])})
    with pytest.raises(MissingColumnsError) as info:
        open_dataset(path, ["labels=targets"])
    assert info.value.missing == ["targets"]
    assert info.value.role == "labels"
    assert "(named for labels)" in str(info.value)
    assert "['input_ids', 'text']" in str(info.value)
    with pytest.raises(MissingColumnsError, match=r"lacks column\(s\) \['tokens'\]"):
        open_dataset(path, {"input_ids": "tokens"})


@pytest.mark.parametrize(
    ("specs", "match"),
    [
        (["input_ids"], "expected ROLE=NAME"),
        (["input_ids="], "expected ROLE=NAME"),
        (["mask=m"], "the role must be one of"),
        (["loss_mask=a", "labels=b"], "not both"),
        (["input_ids=a", "input_ids=b"], "named twice"),
    ],
)
def test_bad_column_options_are_config_errors(specs: list[str], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        parse_columns(specs)


def test_labels_stored_shifted_are_named_in_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    rng = np.random.default_rng(0)
    rows = [rng.integers(3, 500, size=int(n)).tolist() for n in rng.integers(20, 60, size=40)]
    shifted = [[*row[1:], -100] for row in rows]
    path = save(tmp_path / "ds", {"input_ids": ids_column(rows), "labels": ids_column(shifted, pa.int64())})
    with caplog.at_level("WARNING", logger="ladle.dataset"):
        open_dataset(path)
    assert "differ from the token at their position" in caplog.text
    caplog.clear()
    unshifted = [[-100] * 5 + row[5:] for row in rows]
    with caplog.at_level("WARNING", logger="ladle.dataset"):
        open_dataset(save(tmp_path / "ok", {"input_ids": ids_column(rows), "labels": ids_column(unshifted)}))
    assert not caplog.text


def test_check_values_refuses_ids_outside_the_vocabulary(tmp_path: Path) -> None:
    ds = open_dataset(save(tmp_path / "ds", {"input_ids": ids_column()}))
    assert check_values(ds, vocab_size=14) == {"input_ids": (5, 13)}
    with pytest.raises(DatasetError, match=r"row 2 of 'input_ids' holds 13, outside the vocabulary of 13"):
        check_values(ds, vocab_size=13)


# --- the CLI ------------------------------------------------------------------------------


def test_plan_shows_and_records_the_columns(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rows = [[7] * (4 + i % 9) for i in range(64)]
    path = save(tmp_path / "ds", {"tokens": ids_column(rows), "labels": ids_column(rows, pa.int64())})
    assert (
        main(["plan", str(path), "--column", "input_ids=tokens", "--check-values", "--vocab-size", "8"]) == 0
    )
    out = capsys.readouterr().out
    assert "columns: token ids from 'tokens', loss where 'labels' is not -100" in out
    assert "loss mask derived (0 or 1)" in out
    assert main(["plan", str(path), "--column", "input_ids=tokens", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["dataset"]["columns"] == {"input_ids": "tokens", "mask_from": "labels", "mask": "labels"}
    assert main(["plan", str(path)]) == 2
    assert "--column input_ids=tokens" in capsys.readouterr().err
    assert main(["plan", str(path), "--column", "input_ids=tokens", "--vocab-size", "8"]) == 2
    assert "give both" in capsys.readouterr().err
