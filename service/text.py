"""Real text, tokenized offline into a ladle dataset (``ladle make-dataset OUT --from-text PATH...``).

The same files (bytes and sorted paths) and options always write the same
rows, tokenizer and fingerprint, and nothing is downloaded: the BPE
tokenizer is trained here, on the same text, by the ``tokenizers`` library.
``make_text_dataset`` runs on the streaming pipeline of ``ladle.service.ingest``:
files are read, split and tokenized a batch at a time and the rows written
as they come, so memory does not grow with the corpus (training BPE holds
its word counts, a pass of its own over the files). This module keeps what
text files need: reading, splitting, the two tokenizers and their loading.

Files: a PATH that is a file is used as given and must be readable,
non-empty UTF-8 text, gzip-compressed when its name ends in ``.gz``
(``UnreadableFileError``, ``EmptyTextError``, ``BinaryFileError``,
``CorruptFileError`` otherwise). A PATH that is a folder is walked
recursively in sorted order, without hidden entries, ``__pycache__`` and
the files and folders whose names match ``exclude``, keeping the file names
that match ``include`` (default: every name); files in it that are
unreadable, empty or binary are skipped and reported.

Rows (``split``): ``documents``, one row per file; ``paragraphs``, one row
per maximal run of non-blank lines; ``functions``, one row per top-level
function or class of a Python file (found with ``ast``, decorators
included), the code between them split into paragraphs, and paragraphs for
any other file or a Python file that does not parse. Rows keep their text
verbatim (line endings included) and appear in file order; a row longer
than ``max_seq_len`` tokens is cut into pieces of at most that many.

Tokens (``tokenizer``): ``bpe``, byte-level BPE trained on the rows
(``vocab_size`` tokens at most: 2 reserved, the 256 bytes, then merges),
saved as ``OUT/tokenizer.json``; ``bytes``, one token per UTF-8 byte, its
value plus ``BYTE_OFFSET``. Ids 0 (``<pad>``) and 1 (``<eos>``) are reserved
by both and appear in a row only as its last token, with ``eos``.
``loss_mask`` is 1 on every token. ``OUT/text.json`` records what was read and how.
"""

from __future__ import annotations

import ast
import fnmatch
import gzip
import json
import os
import re
import zlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Protocol, get_args

import numpy as np
import numpy.typing as npt

from .errors import (
    BinaryFileError,
    ConfigError,
    CorruptFileError,
    EmptyTextError,
    UnreadableFileError,
)

if TYPE_CHECKING:
    from .dataset import TokenDataset

__all__ = [
    "BYTE_OFFSET",
    "DEFAULT_VOCAB_SIZE",
    "MANIFEST",
    "RESERVED_TOKENS",
    "TOKENIZER_FILE",
    "BpeTokenizer",
    "ByteTokenizer",
    "Split",
    "TextDataset",
    "TextTokenizer",
    "TokenizerKind",
    "load_tokenizer",
    "make_text_dataset",
    "read_text",
    "split_text",
]

I32 = npt.NDArray[np.int32]

Split = Literal["documents", "functions", "paragraphs"]
TokenizerKind = Literal["bpe", "bytes"]

RESERVED_TOKENS = ("<pad>", "<eos>")
BYTE_OFFSET = len(RESERVED_TOKENS)
DEFAULT_VOCAB_SIZE = 4096
# BPE needs the reserved tokens and the 256 bytes; ids must fit int32.
_MIN_BPE_VOCAB = BYTE_OFFSET + 256
_MAX_BPE_VOCAB = 1 << 20
TOKENIZER_FILE = "tokenizer.json"
MANIFEST = "text.json"
_PYTHON_SUFFIXES = (".py", ".pyi", ".pyw")
# Rows encoded per call of the BPE tokenizer (bounds the memory of its Encoding objects).
_ENCODE_GROUP = 4096
# Files larger than this are refused as binary if their first _PEEK_BYTES hold a NUL.
_PEEK_ABOVE = 1 << 20
_PEEK_BYTES = 1 << 13
# A line and its ending, as Python's parser counts lines (\r\n, \r or \n).
_LINE = re.compile(r"[^\r\n]*(?:\r\n|\r|\n)|[^\r\n]+\Z")


class TextTokenizer(Protocol):
    """What ``make_text_dataset`` needs of a tokenizer, and what a trainer needs to read its rows."""

    @property
    def kind(self) -> TokenizerKind: ...

    @property
    def vocab_size(self) -> int: ...

    def encode_batch(self, texts: Sequence[str]) -> list[I32]: ...

    def decode(self, ids: npt.ArrayLike) -> str: ...


class ByteTokenizer:
    """One token per UTF-8 byte: ``byte + BYTE_OFFSET``; ``decode(encode(x)) == x`` for every string."""

    kind: TokenizerKind = "bytes"
    vocab_size = 256 + BYTE_OFFSET

    def encode(self, text: str) -> I32:
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int32) + BYTE_OFFSET

    def encode_batch(self, texts: Sequence[str]) -> list[I32]:
        return [self.encode(text) for text in texts]

    def decode(self, ids: npt.ArrayLike) -> str:
        values = np.asarray(ids, dtype=np.int64)
        values = values[values >= BYTE_OFFSET] - BYTE_OFFSET
        return values.astype(np.uint8).tobytes().decode("utf-8", errors="replace")


class BpeTokenizer:
    """Byte-level BPE from the ``tokenizers`` library, trained locally; lossless on any string."""

    kind: TokenizerKind = "bpe"

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    @classmethod
    def train(cls, texts: Sequence[str], vocab_size: int = DEFAULT_VOCAB_SIZE) -> BpeTokenizer:
        """Train on ``texts`` (deterministic: the same texts give the same merges)."""
        from tokenizers import Tokenizer

        from .ingest.tokenizer import train_bpe

        trained = train_bpe(texts, vocab_size).json
        assert trained is not None
        return cls(Tokenizer.from_str(trained))

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> BpeTokenizer:
        from tokenizers import Tokenizer

        return cls(Tokenizer.from_file(os.fspath(path)))

    @property
    def vocab_size(self) -> int:
        return int(self.tokenizer.get_vocab_size())

    def to_json(self) -> str:
        return str(self.tokenizer.to_str())

    def encode(self, text: str) -> I32:
        return self.encode_batch([text])[0]

    def encode_batch(self, texts: Sequence[str]) -> list[I32]:
        encode = getattr(self.tokenizer, "encode_batch_fast", self.tokenizer.encode_batch)
        out: list[I32] = []
        for first in range(0, len(texts), _ENCODE_GROUP):
            group = encode(list(texts[first : first + _ENCODE_GROUP]), add_special_tokens=False)
            out += [np.asarray(encoding.ids, dtype=np.int32) for encoding in group]
        return out

    def decode(self, ids: npt.ArrayLike) -> str:
        return str(self.tokenizer.decode(np.asarray(ids, dtype=np.int64).tolist()))


def load_tokenizer(dataset: str | os.PathLike[str]) -> TextTokenizer:
    """The tokenizer of a dataset ``make_text_dataset`` wrote (from its ``text.json``)."""
    folder = Path(dataset)
    try:
        manifest = json.loads((folder / MANIFEST).read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise UnreadableFileError(str(folder / MANIFEST), f"no readable text manifest ({exc})") from None
    if manifest["tokenizer"]["kind"] == "bytes":
        return ByteTokenizer()
    return BpeTokenizer.load(folder / TOKENIZER_FILE)


@dataclass(frozen=True)
class TextDataset:
    """What ``make_text_dataset`` wrote: the opened dataset, its tokenizer, files read and skipped."""

    dataset: TokenDataset
    tokenizer: TextTokenizer
    files: int
    skipped: tuple[tuple[str, str], ...]


# --- reading and splitting ---------------------------------------------------


def read_text(path: str | os.PathLike[str]) -> str:
    """The UTF-8 text of a file (``.gz`` decompressed, a BOM dropped), or a typed ``TextSourceError``."""
    where = os.fspath(path)
    try:
        if not where.endswith(".gz") and os.path.getsize(where) > _PEEK_ABOVE:
            # a large binary (a shared library in a walked folder) is refused without reading it all
            with open(where, "rb") as head:
                if b"\0" in head.read(_PEEK_BYTES):
                    raise BinaryFileError(where, "holds NUL bytes: a binary file, not text")
        data = Path(where).read_bytes()
    except OSError as exc:
        raise UnreadableFileError(where, f"cannot be read: {exc.strerror or exc}") from None
    if where.endswith(".gz") and data:
        try:
            data = gzip.decompress(data)
        except (OSError, EOFError, zlib.error) as exc:
            raise CorruptFileError(where, f"is a truncated or corrupt gzip file ({exc})") from None
    if b"\0" in data:
        raise BinaryFileError(where, "holds NUL bytes: a binary file, not text")
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise BinaryFileError(
            where, f"is not UTF-8 text (byte 0x{data[exc.start]:02x} at offset {exc.start} is invalid)"
        ) from None
    if not text.strip():
        raise EmptyTextError(where, "is empty" if not data else "holds only whitespace")
    return text


def split_text(text: str, split: Split, *, python: bool = False) -> list[str]:
    """The rows of one file's text: verbatim, non-blank, in order (see the module docstring)."""
    if split == "documents":
        return [text] if text.strip() else []
    lines = _LINE.findall(text)
    if split == "functions" and python:
        spans = _definition_spans(text)
        if spans is not None:
            rows: list[str] = []
            at = 0
            for start, end in spans:
                rows += _paragraphs(lines[at:start])
                rows.append("".join(lines[start:end]))
                at = end
            return rows + _paragraphs(lines[at:])
    return _paragraphs(lines)


def _paragraphs(lines: Sequence[str]) -> list[str]:
    rows: list[str] = []
    current: list[str] = []
    for line in lines:
        if line.strip():
            current.append(line)
        elif current:
            rows.append("".join(current))
            current = []
    if current:
        rows.append("".join(current))
    return rows


def _definition_spans(text: str) -> list[tuple[int, int]] | None:
    """0-based ``[start, end)`` line spans of the top-level functions and classes; None if unparsable."""
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return None
    definitions = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)
    spans = []
    for node in tree.body:
        if isinstance(node, definitions) and node.end_lineno is not None:
            start = min([node.lineno, *(d.lineno for d in node.decorator_list)])
            spans.append((start - 1, node.end_lineno))
    return spans


def _files(
    paths: Sequence[str | os.PathLike[str]], include: Sequence[str], exclude: Sequence[str]
) -> Iterator[tuple[str, bool]]:
    """``(path, given)`` for every file to read, each once, in order; ``given``: named on its own."""
    seen: set[str] = set()
    for raw in paths:
        root = os.fspath(raw)
        if os.path.isdir(root):
            found = _walk(root, include, exclude)
            given = False
        elif os.path.lexists(root):
            found = iter([root])
            given = True
        else:
            raise UnreadableFileError(root, "does not exist")
        for path in found:
            key = os.path.realpath(path)
            if key not in seen:
                seen.add(key)
                yield path, given


def _walk(root: str, include: Sequence[str], exclude: Sequence[str]) -> Iterator[str]:
    def matches(name: str, patterns: Sequence[str]) -> bool:
        return any(fnmatch.fnmatchcase(name, pattern) for pattern in patterns)

    for folder, dirs, names in os.walk(root):
        dirs[:] = sorted(
            d for d in dirs if not (d.startswith(".") or d == "__pycache__" or matches(d, exclude))
        )
        for name in sorted(names):
            if name.startswith(".") or matches(name, exclude) or (include and not matches(name, include)):
                continue
            yield os.path.join(folder, name)


# --- the dataset -------------------------------------------------------------


def make_text_dataset(
    out: str | os.PathLike[str],
    paths: Sequence[str | os.PathLike[str]],
    *,
    split: Split = "documents",
    tokenizer: TokenizerKind = "bpe",
    vocab_size: int | None = None,
    include: Sequence[str] = (),
    exclude: Sequence[str] = (),
    max_seq_len: int = 8192,
    eos: bool = False,
    workers: int = 0,
) -> TextDataset:
    """Tokenize the files under ``paths`` into the new dataset folder ``out`` (see the module docstring).

    ``out`` must not exist or be an empty folder (``ConfigError("out")``);
    ``vocab_size`` (BPE only; default ``DEFAULT_VOCAB_SIZE``) is at least 258.
    Rows longer than ``max_seq_len`` tokens are cut into pieces of at most
    that many (no token is lost); ``eos`` ends each row of the split text
    with ``<eos>``; ``workers`` processes tokenize (0: this one). Raises
    ``EmptyDatasetError`` when no file gives a row.
    """
    if split not in get_args(Split):
        raise ConfigError("split", f"must be one of {list(get_args(Split))}, got {split!r}")
    if tokenizer not in get_args(TokenizerKind):
        raise ConfigError("tokenizer", f"must be one of {list(get_args(TokenizerKind))}, got {tokenizer!r}")
    if tokenizer == "bytes" and vocab_size is not None and vocab_size != ByteTokenizer.vocab_size:
        raise ConfigError("vocab_size", f"is fixed at {ByteTokenizer.vocab_size} with the bytes tokenizer")
    size = DEFAULT_VOCAB_SIZE if vocab_size is None else vocab_size
    if not _MIN_BPE_VOCAB <= size <= _MAX_BPE_VOCAB:
        raise ConfigError("vocab_size", f"must be in [{_MIN_BPE_VOCAB}, {_MAX_BPE_VOCAB}], got {size}")
    if not paths:
        raise ConfigError("from_text", "give at least one file or folder")
    # imported here: the CLI imports this module for its option names, and the pipeline is slow to import
    from .ingest.encode import Options
    from .ingest.make import make_dataset_from
    from .ingest.sources import Source

    source = Source("text", [os.fspath(p) for p in paths], split=split, include=include, exclude=exclude)
    made = make_dataset_from(
        out,
        source,
        Options(mode="text", eos=eos, max_seq_len=max_seq_len),
        tokenizer=tokenizer,
        vocab_size=None if tokenizer == "bytes" else size,
        workers=workers,
    )
    coder: TextTokenizer = ByteTokenizer()
    if made.tokenizer.json is not None:
        from tokenizers import Tokenizer

        coder = BpeTokenizer(Tokenizer.from_str(made.tokenizer.json))
    return TextDataset(made.dataset, coder, source.files, tuple(source.skipped))
