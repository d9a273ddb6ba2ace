"""make-dataset from JSONL, Parquet, save_to_disk, text: sources, shards, determinism, failures, CLI."""

from __future__ import annotations

import gzip
import io
import json
import os
from pathlib import Path
from typing import Any

import datasets
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from ladle.service.cli import main
from ladle.service.dataset import open_dataset
from ladle.service.errors import (
    CorruptFileError,
    EmptySourceError,
    SourceColumnError,
    UnreadableFileError,
)
from ladle.service.ingest import progress
from ladle.service.ingest.encode import Options
from ladle.service.ingest.make import Made, make_dataset_from
from ladle.service.ingest.sources import Format, Source
from ladle.service.text import load_tokenizer
from tests.unit.test_ingest_encode import STDLIB, write_model_folder

RECORDS = [
    {"text": (STDLIB / "json" / name).read_text(), "n": i}
    for i, name in enumerate(["__init__.py", "decoder.py", "encoder.py", "scanner.py", "tool.py"] * 4)
]


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_model_folder(tmp_path_factory.mktemp("model") / "tiny")


def write_jsonl(path: Path, records: list[dict[str, Any]]) -> Path:
    data = "".join(json.dumps(r) + "\n" for r in records).encode()
    if path.name.endswith(".gz"):
        data = gzip.compress(data, mtime=0)
    elif path.name.endswith(".zst"):
        sink = pa.BufferOutputStream()
        with pa.CompressedOutputStream(sink, "zstd") as stream:
            stream.write(data)
        data = sink.getvalue().to_pybytes()
    path.write_bytes(data)
    return path


def build(
    out: Path, form: Format, paths: list[Path], model: Path | str, *, workers: int = 0, **options: Any
) -> Made:
    shard_bytes = options.pop("shard_bytes", None)
    return make_dataset_from(
        out,
        Source(form, [str(p) for p in paths]),
        Options(**options),
        tokenizer=str(model),
        workers=workers,
        shard_bytes=shard_bytes,
    )


def token_rows(path: Path) -> list[list[int]]:
    rows: list[list[int]] = open_dataset(path).table.column("input_ids").to_pylist()
    return rows


def no_leftovers(folder: Path, out: Path) -> None:
    assert not out.exists(), "nothing is written when a source is refused"
    assert not [p.name for p in folder.iterdir() if ".ladle-write-" in p.name], "a temporary folder was left"


# --- sources -----------------------------------------------------------------------


def test_every_format_gives_the_same_rows(tmp_path: Path, model: Path) -> None:
    plain = build(tmp_path / "jsonl", "jsonl", [write_jsonl(tmp_path / "a.jsonl", RECORDS)], model)
    expected = token_rows(tmp_path / "jsonl")
    for name in ("a.jsonl.gz", "a.jsonl.zst"):
        build(tmp_path / f"out-{name}", "jsonl", [write_jsonl(tmp_path / name, RECORDS)], model)
        assert token_rows(tmp_path / f"out-{name}") == expected, f"{name} reads as the plain file"
    pq.write_table(pa.Table.from_pylist(RECORDS), tmp_path / "a.parquet", row_group_size=7)
    build(tmp_path / "parquet", "parquet", [tmp_path / "a.parquet"], model)
    assert token_rows(tmp_path / "parquet") == expected
    datasets.Dataset.from_list(RECORDS).save_to_disk(str(tmp_path / "hf-in"))
    build(tmp_path / "hf", "hf", [tmp_path / "hf-in"], model)
    assert token_rows(tmp_path / "hf") == expected
    assert plain.summary["records"] == len(RECORDS)


def test_several_jsonl_files_in_order(tmp_path: Path, model: Path) -> None:
    first = write_jsonl(tmp_path / "1.jsonl", RECORDS[:3])
    second = write_jsonl(tmp_path / "2.jsonl.gz", RECORDS[3:5])
    build(tmp_path / "both", "jsonl", [first, second], model)
    build(tmp_path / "all", "jsonl", [write_jsonl(tmp_path / "all.jsonl", RECORDS[:5])], model)
    assert token_rows(tmp_path / "both") == token_rows(tmp_path / "all")


def test_text_files_with_gz(tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.py").write_text("def f():\n    return 1\n")
    (src / "b.py.gz").write_bytes(gzip.compress(b"def g():\n    return 2\n\n\nclass C:\n    pass\n"))
    made = make_dataset_from(
        tmp_path / "out", Source("text", [str(src)], split="functions"), Options(eos=False), tokenizer="bytes"
    )
    tokenizer = load_tokenizer(tmp_path / "out")
    assert [tokenizer.decode(r) for r in token_rows(tmp_path / "out")] == [
        "def f():\n    return 1\n",
        "def g():\n    return 2\n",
        "class C:\n    pass\n",
    ], "a .gz file is read, and split as Python by its name"
    assert made.summary["rows"] == 3


# --- the shards ----------------------------------------------------------------------


def test_small_shards_are_read_by_ladle_and_datasets(tmp_path: Path, model: Path) -> None:
    source = write_jsonl(tmp_path / "a.jsonl", RECORDS * 3)
    one = build(tmp_path / "one", "jsonl", [source], model, max_seq_len=64)
    many = build(tmp_path / "many", "jsonl", [source], model, max_seq_len=64, shard_bytes=100_000)
    shards = sorted(p.name for p in (tmp_path / "many").glob("*.arrow"))
    assert len(shards) >= 3, "a shard ends after the record batch that takes it past shard_bytes"
    assert shards[0] == f"data-00000-of-{len(shards):05d}.arrow"
    assert many.dataset.fingerprint == one.dataset.fingerprint, "the fingerprint does not see the sharding"
    loaded = datasets.load_from_disk(str(tmp_path / "many"))
    assert loaded["input_ids"] == token_rows(tmp_path / "one")
    assert loaded["seq_len"] == [len(r) for r in loaded["input_ids"]]
    assert loaded.features["loss_mask"].feature.dtype == "int8"


@pytest.mark.parametrize("workers", [1, 2])
def test_the_same_bytes_whatever_the_workers(tmp_path: Path, model: Path, workers: int) -> None:
    sources = [write_jsonl(tmp_path / "a.jsonl", RECORDS * 3), write_jsonl(tmp_path / "b.jsonl.gz", RECORDS)]
    here = build(tmp_path / "here", "jsonl", sources, model, max_seq_len=200, shard_bytes=100_000)
    there = build(
        tmp_path / "there", "jsonl", sources, model, workers=workers, max_seq_len=200, shard_bytes=100_000
    )
    assert here.dataset.fingerprint == there.dataset.fingerprint
    names = sorted(p.name for p in (tmp_path / "here").iterdir())
    assert names == sorted(p.name for p in (tmp_path / "there").iterdir())
    for name in names:
        assert (tmp_path / "here" / name).read_bytes() == (tmp_path / "there" / name).read_bytes(), name


# --- whole sources that cannot be used: typed errors, nothing left behind ----------------


def test_a_missing_column_names_the_columns_present(tmp_path: Path, model: Path) -> None:
    source = write_jsonl(tmp_path / "a.jsonl", RECORDS[:3])
    with pytest.raises(SourceColumnError) as info:
        build(tmp_path / "out", "jsonl", [source], model, text_column="body")
    assert info.value.missing == ["body"]
    assert info.value.present == ["n", "text"]
    assert "'body'" in str(info.value)
    assert "['n', 'text']" in str(info.value)
    pq.write_table(pa.Table.from_pylist(RECORDS[:3]), tmp_path / "a.parquet")
    with pytest.raises(SourceColumnError, match=r"'body'.*\['text', 'n'\]"):
        build(tmp_path / "out", "parquet", [tmp_path / "a.parquet"], model, text_column="body")
    datasets.Dataset.from_list(RECORDS[:3]).save_to_disk(str(tmp_path / "hf"))
    with pytest.raises(SourceColumnError, match="'q', 'a'"):
        build(
            tmp_path / "out",
            "hf",
            [tmp_path / "hf"],
            model,
            mode="prompt",
            prompt_column="q",
            completion_column="a",
        )
    no_leftovers(tmp_path, tmp_path / "out")


def test_empty_truncated_and_unreadable_files(tmp_path: Path, model: Path) -> None:
    good = write_jsonl(tmp_path / "good.jsonl", RECORDS[:2])
    (tmp_path / "empty.jsonl").write_bytes(b"")
    (tmp_path / "blank.jsonl").write_bytes(b"\n  \n")
    (tmp_path / "empty.parquet").write_bytes(b"")
    whole = gzip.compress(b"".join(json.dumps(r).encode() + b"\n" for r in RECORDS * 20))
    (tmp_path / "cut.jsonl.gz").write_bytes(whole[: len(whole) // 2])
    (tmp_path / "fake.jsonl.gz").write_bytes(b"not gzip at all")
    (tmp_path / "fake.parquet").write_bytes(b"not parquet at all")
    os.symlink(tmp_path / "nowhere", tmp_path / "dangling.jsonl")
    cases: list[tuple[Format, str, type[Exception], str]] = [
        ("jsonl", "empty.jsonl", EmptySourceError, "is empty"),
        ("jsonl", "blank.jsonl", EmptySourceError, "no records"),
        ("parquet", "empty.parquet", EmptySourceError, "is empty"),
        ("jsonl", "cut.jsonl.gz", CorruptFileError, "truncated or corrupt gzip"),
        ("jsonl", "fake.jsonl.gz", CorruptFileError, "truncated or corrupt gzip"),
        ("parquet", "fake.parquet", CorruptFileError, "not a readable Parquet file"),
        ("jsonl", "dangling.jsonl", UnreadableFileError, "does not exist"),
        ("jsonl", "missing.jsonl", UnreadableFileError, "does not exist"),
        ("hf", "good.jsonl", UnreadableFileError, "not a folder"),
        ("hf", ".", CorruptFileError, "not a datasets save_to_disk folder"),
    ]
    for form, name, error, message in cases:
        paths = [good, tmp_path / name] if form == "jsonl" else [tmp_path / name]
        with pytest.raises(error, match=message) as info:
            build(tmp_path / "out", form, paths, model)
        assert info.value.path == str(tmp_path / name), "the error names the file"  # type: ignore[attr-defined]
        no_leftovers(tmp_path, tmp_path / "out")


def test_a_failure_in_a_worker_leaves_nothing(tmp_path: Path, model: Path) -> None:
    whole = gzip.compress(b"".join(json.dumps(r).encode() + b"\n" for r in RECORDS * 20))
    (tmp_path / "cut.jsonl.gz").write_bytes(whole[: len(whole) - 100])
    with pytest.raises(CorruptFileError):
        build(tmp_path / "out", "jsonl", [tmp_path / "cut.jsonl.gz"], model, workers=1)
    no_leftovers(tmp_path, tmp_path / "out")


# --- progress and the command ------------------------------------------------------------


def test_progress_lines_when_not_a_terminal(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(progress, "LOG_EVERY_S", 0.0)
    stream = io.StringIO()
    shown = progress.Progress(1000, stream=stream)
    shown.update(10, 5000, 250)
    shown.update(10, 5000, 250)
    shown.close()
    lines = stream.getvalue().splitlines()
    assert len(lines) == 2, "a line per update when every update is due"
    assert "20 rows" in lines[-1]
    assert "10.0k tokens" in lines[-1]
    assert "tokens/s" in lines[-1]
    assert "50%" in lines[-1]
    assert "ETA" in lines[-1]
    assert "\r" not in stream.getvalue()


def test_cli_make_dataset_from_jsonl(tmp_path: Path, model: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad: list[dict[str, Any]] = [{"text": 3}]
    source = write_jsonl(tmp_path / "a.jsonl", RECORDS + bad + [{"text": "x"}] * 80)
    out = tmp_path / "ds"
    argv = ["make-dataset", str(out), "--from-jsonl", str(source), "--tokenizer", str(model),
            "--max-seq-len", "256", "--workers", "1", "--bos"]  # fmt: skip
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "read 101 records" in printed
    assert "not_a_string: 1" in printed
    assert "long document(s) into" in printed
    assert f"to {out}" in printed
    assert (out / "tokenizer_config.json").is_file(), "the model folder's config is kept beside the data"
    manifest = json.loads((out / "text.json").read_text())
    assert manifest["tokenizer"]["kind"] == "folder"
    assert manifest["options"]["bos"] is True
    assert manifest["options"]["eos"] is True
    assert open_dataset(out).num_rows > len(RECORDS)


def test_cli_errors_are_one_line(tmp_path: Path, model: Path, capsys: pytest.CaptureFixture[str]) -> None:
    source = write_jsonl(tmp_path / "a.jsonl", RECORDS[:2])
    code = main(["make-dataset", str(tmp_path / "ds"), "--from-jsonl", str(source), "--text-column", "body",
                 "--tokenizer", str(model), "--no-progress"])  # fmt: skip
    assert code == 2
    err = capsys.readouterr().err
    assert err.startswith("ladle: error: ")
    assert "'body'" in err
    assert "['n', 'text']" in err
    assert len(err.strip().splitlines()) == 1
    code = main(["make-dataset", str(tmp_path / "ds"), "--from-jsonl", str(source), "--text-column", "text",
                 "--messages-column", "m", "--no-progress"])  # fmt: skip
    assert code == 2
    assert "choose one of" in capsys.readouterr().err


def test_a_datasetdict_folder_names_its_splits(tmp_path: Path, model: Path) -> None:
    splits = datasets.DatasetDict({"train": datasets.Dataset.from_list(RECORDS[:2])})
    splits.save_to_disk(str(tmp_path / "dd"))
    with pytest.raises(CorruptFileError, match=r"holds the splits \['train'\]"):
        build(tmp_path / "out", "hf", [tmp_path / "dd"], model)
    build(tmp_path / "out", "hf", [tmp_path / "dd" / "train"], model)


def test_cli_text_files_end_with_eos_by_default(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "a.txt").write_text("one\n\ntwo\n")
    out = tmp_path / "ds"
    argv = ["make-dataset", str(out), "--from-text", str(tmp_path / "a.txt"), "--split", "paragraphs",
            "--tokenizer", "bytes", "--workers", "0"]  # fmt: skip
    assert main(argv) == 0
    assert "bytes vocabulary 258" in capsys.readouterr().out
    byte = [b + 2 for b in b"one\n"], [b + 2 for b in b"two\n"]  # BYTE_OFFSET 2
    assert token_rows(out) == [[*byte[0], 1], [*byte[1], 1]], "each row ends with <eos> (id 1)"
