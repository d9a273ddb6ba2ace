"""Real text into a dataset: splitting, both tokenizers, determinism, typed errors, the CLI."""

from __future__ import annotations

import json
import os
import sysconfig
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from ladle.service.cli import main
from ladle.service.dataset import open_dataset
from ladle.service.errors import (
    BinaryFileError,
    ConfigError,
    EmptyDatasetError,
    EmptyTextError,
    TextSourceError,
    UnreadableFileError,
)
from ladle.service.text import (
    BYTE_OFFSET,
    MANIFEST,
    TOKENIZER_FILE,
    BpeTokenizer,
    ByteTokenizer,
    load_tokenizer,
    make_text_dataset,
    read_text,
    split_text,
)

STDLIB = Path(sysconfig.get_paths()["stdlib"])

MODULE = '''"""A module."""

import os
import sys


@decorator
@other(1)
def first(a, b):
    """Doc."""

    def inner():
        return 1

    return a + b


# a comment about the class
class Second:
    x = 1

    def method(self):
        pass

CONSTANT = 3
async def third():
    await thing()
'''


def write(path: Path, content: str | bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        path.write_text(content, encoding="utf-8", newline="")
    return path


def rows_of(path: Path) -> list[list[int]]:
    rows: list[list[int]] = open_dataset(path).table.column("input_ids").to_pylist()
    return rows


# --- splitting ----------------------------------------------------------------


def test_functions_split_takes_top_level_definitions_with_decorators() -> None:
    rows = split_text(MODULE, "functions", python=True)
    assert rows[0] == '"""A module."""\n'
    assert rows[1] == "import os\nimport sys\n"
    assert rows[2].startswith("@decorator\n@other(1)\ndef first(a, b):")
    assert "def inner" in rows[2], "a nested function stays inside its parent"
    assert rows[2].endswith("    return a + b\n")
    assert rows[3] == "# a comment about the class\n"
    assert rows[4].startswith("class Second:")
    assert rows[4].endswith("        pass\n")
    assert rows[5] == "CONSTANT = 3\n"
    assert rows[6] == "async def third():\n    await thing()\n"
    assert len(rows) == 7


def test_functions_split_keeps_every_non_blank_line_once() -> None:
    rows = split_text(MODULE, "functions", python=True)
    kept = [line for row in rows for line in row.splitlines() if line.strip()]
    assert kept == [line for line in MODULE.splitlines() if line.strip()]


def test_functions_split_counts_lines_as_the_parser_does() -> None:
    # a form feed is a line break to str.splitlines but not to Python's parser
    text = "x = 1\n\x0c\ndef f():\n    return '\x0c'\n\r\ndef g():\r\n    pass\r\n"
    assert split_text(text, "functions", python=True) == [
        "x = 1\n",
        "def f():\n    return '\x0c'\n",
        "def g():\r\n    pass\r\n",
    ]


def test_functions_split_falls_back_to_paragraphs() -> None:
    broken = "def f(:\n    pass\n\nx = 1\n"
    assert split_text(broken, "functions", python=True) == ["def f(:\n    pass\n", "x = 1\n"]
    assert split_text(MODULE, "functions", python=False) == split_text(MODULE, "paragraphs")


def test_paragraphs_and_documents() -> None:
    text = "a\nb\n\n  \t\nc\r\n\r\n\nd"
    assert split_text(text, "paragraphs") == ["a\nb\n", "c\r\n", "d"]
    assert split_text(text, "documents") == [text]
    assert split_text(" \n\n", "paragraphs") == []
    assert split_text(" \n\n", "documents") == []


# --- reading files: typed errors ------------------------------------------------


def test_read_text_errors(tmp_path: Path) -> None:
    with pytest.raises(EmptyTextError, match="is empty"):
        read_text(write(tmp_path / "empty.txt", b""))
    with pytest.raises(EmptyTextError, match="only whitespace"):
        read_text(write(tmp_path / "blank.txt", " \n\t\n"))
    with pytest.raises(BinaryFileError, match="NUL bytes"):
        read_text(write(tmp_path / "a.bin", b"abc\x00def"))
    with pytest.raises(BinaryFileError, match=r"not UTF-8 text \(byte 0xff at offset 2"):
        read_text(write(tmp_path / "latin.txt", b"ab\xffcd"))
    with pytest.raises(UnreadableFileError, match="cannot be read"):
        read_text(tmp_path / "missing.txt")
    assert read_text(write(tmp_path / "bom.py", "\ufeffx = 1\n".encode())) == "x = 1\n"


def test_given_files_that_cannot_be_used_are_refused(tmp_path: Path) -> None:
    good = write(tmp_path / "good.txt", "hello\n")
    os.symlink(tmp_path / "nowhere", tmp_path / "dangling.txt")
    cases: list[tuple[Path, type[TextSourceError]]] = [
        (write(tmp_path / "empty.txt", b""), EmptyTextError),
        (write(tmp_path / "binary.dat", b"\x00\x01"), BinaryFileError),
        (tmp_path / "dangling.txt", UnreadableFileError),
        (tmp_path / "not-there.txt", UnreadableFileError),
    ]
    for bad, error in cases:
        out = tmp_path / f"out-{bad.name}"
        with pytest.raises(error) as info:
            make_text_dataset(out, [good, bad], tokenizer="bytes")
        assert info.value.path == str(bad), "the error names the file"
        assert str(bad) in str(info.value)
        assert not out.exists(), "nothing is written when a file is refused"


def test_unreadable_file_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    locked = write(tmp_path / "locked.txt", "secret\n")
    original = Path.read_bytes

    def read_bytes(self: Path) -> bytes:
        if self.name == "locked.txt":
            raise PermissionError(13, "Permission denied")
        return original(self)

    monkeypatch.setattr(Path, "read_bytes", read_bytes)
    with pytest.raises(UnreadableFileError, match="Permission denied"):
        make_text_dataset(tmp_path / "out", [locked], tokenizer="bytes")


def test_folders_skip_and_report_bad_files(tmp_path: Path) -> None:
    src = tmp_path / "src"
    write(src / "a.py", "def f():\n    return 1\n")
    write(src / "b.txt", "one\n\ntwo\n")
    write(src / "empty.py", b"")
    write(src / "blob.bin", b"\x00\xff")
    write(src / ".hidden.py", "def hidden(): pass\n")
    write(src / "__pycache__" / "a.py", "def cached(): pass\n")
    write(src / "vendor" / "v.py", "def vendored(): pass\n")
    write(src / "sub" / "c.py", "class C:\n    pass\n")
    made = make_text_dataset(
        tmp_path / "out", [src], split="functions", tokenizer="bytes", exclude=["vendor"]
    )
    assert made.files == 3
    assert sorted(os.path.basename(path) for path, _ in made.skipped) == ["blob.bin", "empty.py"]
    texts = [made.tokenizer.decode(row) for row in rows_of(tmp_path / "out")]
    assert texts == ["def f():\n    return 1\n", "one\n", "two\n", "class C:\n    pass\n"]
    manifest = json.loads((tmp_path / "out" / MANIFEST).read_text())
    assert manifest["files"] == 3
    assert manifest["rows"] == 4
    assert {os.path.basename(s["path"]) for s in manifest["skipped"]} == {"blob.bin", "empty.py"}

    only_py = make_text_dataset(
        tmp_path / "py", [src], split="functions", tokenizer="bytes", include=["*.py"]
    )
    assert only_py.files == 3  # a.py, v.py, c.py (empty.py skipped)
    assert [made.tokenizer.decode(r) for r in rows_of(tmp_path / "py")] == [
        "def f():\n    return 1\n",
        "class C:\n    pass\n",
        "def vendored(): pass\n",
    ]


def test_no_text_at_all_is_a_typed_error(tmp_path: Path) -> None:
    write(tmp_path / "src" / "blob.bin", b"\x00")
    with pytest.raises(EmptyDatasetError, match="no text to tokenize"):
        make_text_dataset(tmp_path / "out", [tmp_path / "src"])
    (tmp_path / "nothing").mkdir()
    with pytest.raises(EmptyDatasetError):
        make_text_dataset(tmp_path / "out", [tmp_path / "nothing"])


def test_bad_options(tmp_path: Path) -> None:
    text = write(tmp_path / "a.txt", "hello\n")
    with pytest.raises(ConfigError) as info:
        make_text_dataset(tmp_path / "o1", [text], tokenizer="bytes", vocab_size=1000)
    assert info.value.field == "vocab_size"
    with pytest.raises(ConfigError) as info:
        make_text_dataset(tmp_path / "o2", [text], vocab_size=100)
    assert info.value.field == "vocab_size"
    with pytest.raises(ConfigError) as info:
        make_text_dataset(tmp_path / "o3", [])
    assert info.value.field == "from_text"
    taken = tmp_path / "taken"
    write(taken / "keep.txt", "mine")
    with pytest.raises(ConfigError) as info:
        make_text_dataset(taken, [text])
    assert info.value.field == "out"
    assert (taken / "keep.txt").read_text() == "mine"


# --- tokenizers -----------------------------------------------------------------


@given(st.text())
def test_bytes_tokenizer_round_trips(text: str) -> None:
    tokenizer = ByteTokenizer()
    ids = tokenizer.encode(text)
    assert ids.dtype == np.int32
    assert len(ids) == len(text.encode("utf-8"))
    assert (ids >= BYTE_OFFSET).all()
    assert (ids < tokenizer.vocab_size).all()
    assert tokenizer.decode(ids) == text


@pytest.fixture(scope="module")
def bpe() -> BpeTokenizer:
    texts = [(STDLIB / name).read_text(encoding="utf-8") for name in ("json/decoder.py", "json/encoder.py")]
    return BpeTokenizer.train(texts, vocab_size=600)


@given(st.text())
def test_bpe_tokenizer_round_trips(bpe: BpeTokenizer, text: str) -> None:
    ids = bpe.encode(text)
    assert (ids >= BYTE_OFFSET).all(), "reserved ids never appear in a row"
    assert bpe.decode(ids) == text


def test_bpe_training_is_deterministic(bpe: BpeTokenizer) -> None:
    texts = [(STDLIB / name).read_text(encoding="utf-8") for name in ("json/decoder.py", "json/encoder.py")]
    again = BpeTokenizer.train(texts, vocab_size=600)
    assert again.to_json() == bpe.to_json()
    assert bpe.vocab_size == 600
    sample = texts[0][:2000]
    assert len(bpe.encode(sample)) < len(sample.encode()) / 2, "BPE compresses code"


# --- the dataset ----------------------------------------------------------------


@pytest.fixture(scope="module")
def stdlib_parts() -> list[Path]:
    return [STDLIB / "json", STDLIB / "email", STDLIB / "collections"]


def test_stdlib_functions_dataset(tmp_path: Path, stdlib_parts: list[Path]) -> None:
    made = make_text_dataset(tmp_path / "ds", stdlib_parts, split="functions", vocab_size=1024)
    ds = made.dataset
    assert ds.has_seq_len
    assert made.files > 30
    assert ds.num_rows > 500
    lengths = ds.lengths
    assert lengths.max() > 20 * np.median(lengths), "a long-tailed length mix"
    mask = open_dataset(tmp_path / "ds").table.column("loss_mask")
    assert mask.combine_chunks().flatten().to_numpy().min() == 1, "every token is trained"
    tokenizer = load_tokenizer(tmp_path / "ds")
    assert isinstance(tokenizer, BpeTokenizer)
    assert (tmp_path / "ds" / TOKENIZER_FILE).is_file()
    first = (STDLIB / "json" / "__init__.py").read_text(encoding="utf-8")
    expected = split_text(first, "functions", python=True)
    decoded = [tokenizer.decode(row) for row in rows_of(tmp_path / "ds")[: len(expected)]]
    assert decoded == expected, "rows decode to the split text, in file order"


@pytest.mark.parametrize("kind", ["bpe", "bytes"])
def test_same_input_same_dataset(tmp_path: Path, stdlib_parts: list[Path], kind: str) -> None:
    a = make_text_dataset(tmp_path / "a", stdlib_parts[:1], split="functions", tokenizer=kind)  # type: ignore[arg-type]
    b = make_text_dataset(tmp_path / "b", stdlib_parts[:1], split="functions", tokenizer=kind)  # type: ignore[arg-type]
    assert a.dataset.fingerprint == b.dataset.fingerprint
    assert a.dataset.table.equals(b.dataset.table)
    for name in sorted(p.name for p in (tmp_path / "a").iterdir()):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes(), name
    c = make_text_dataset(tmp_path / "c", stdlib_parts[:1], split="paragraphs", tokenizer=kind)  # type: ignore[arg-type]
    assert c.dataset.fingerprint != a.dataset.fingerprint


def test_bytes_dataset_rows_are_the_utf8_bytes(tmp_path: Path) -> None:
    text = "héllo wörld\n\n→ ok\n"
    made = make_text_dataset(
        tmp_path / "ds", [write(tmp_path / "a.txt", text)], split="paragraphs", tokenizer="bytes"
    )
    rows = rows_of(tmp_path / "ds")
    assert rows == [
        list(np.frombuffer(p.encode(), np.uint8) + BYTE_OFFSET) for p in ("héllo wörld\n", "→ ok\n")
    ]
    assert isinstance(load_tokenizer(tmp_path / "ds"), ByteTokenizer)
    assert not (tmp_path / "ds" / TOKENIZER_FILE).exists()
    assert made.tokenizer.vocab_size == 256 + BYTE_OFFSET


# --- the command ----------------------------------------------------------------


def test_cli_make_dataset_from_text(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "ds"
    code = main(
        ["make-dataset", str(out), "--from-text", str(STDLIB / "json"), "--split", "functions",
         "--tokenizer", "bytes", "--include", "*.py"]
    )  # fmt: skip
    assert code == 0
    printed = capsys.readouterr().out
    assert "bytes vocabulary 258" in printed
    assert f"to {out}" in printed
    assert open_dataset(out).num_rows > 20


def test_cli_refuses_a_binary_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    blob = write(tmp_path / "blob.bin", b"\x00\x01\x02")
    assert main(["make-dataset", str(tmp_path / "ds"), "--from-text", str(blob)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("ladle: error: ")
    assert "blob.bin: holds NUL bytes" in err
    assert len(err.strip().splitlines()) == 1


def test_cli_needs_rows_or_text(tmp_path: Path) -> None:
    with pytest.raises(SystemExit):
        main(["make-dataset", str(tmp_path / "ds")])
    with pytest.raises(SystemExit):
        main(["make-dataset", str(tmp_path / "ds"), "--rows", "5", "--from-text", "x"])
