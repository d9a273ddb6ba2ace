"""The ``make-dataset`` pipeline: read, tokenize on workers, write shards, seal with a manifest.

Guarantee: the same inputs and options write the same bytes (data, manifest,
tokenizer) and the same fingerprint, whatever the number of workers; the
folder appears at ``out`` whole or not at all. Memory is bounded by a few
raw batches per worker and one record batch, not by the input (the BPE
tokenizer, when one is trained here, holds its word counts while it
trains). The trade-off: a whole-source problem found late (a truncated
``.gz`` at its end) fails the whole run after the work before it; that is
the price of never writing a dataset with a silent hole in it.

A run fails, writing nothing, when more than ``max_skipped_fraction`` of
the records read were skipped for bad input (records dropped by
``long="drop"`` are a choice, not bad input, and do not count): a wrong
column or format shows as a large fraction, a few broken lines of a crawl
as a small one, which is kept and reported.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections import deque
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from typing import Any

from ..dataset import TokenDataset, open_dataset
from ..errors import ConfigError, EmptyDatasetError, SourceColumnError
from ..text import MANIFEST, TOKENIZER_FILE
from .encode import Encoded, Options, Skips, Worker
from .progress import Progress, format_summary
from .sources import RawBatch, Source
from .tokenizer import CONFIG_FILE, TokenizerSpec, load_tokenizer_spec, train_bpe
from .workers import ordered_map

__all__ = ["DEFAULT_MAX_SKIPPED_FRACTION", "FORMAT_TAG", "Made", "make_dataset_from"]

FORMAT_TAG = "ladle-ingest-v1"
DEFAULT_MAX_SKIPPED_FRACTION = 0.01


@dataclass(frozen=True)
class Made:
    """What ``make_dataset_from`` wrote: the opened dataset, its tokenizer, the manifest's summary."""

    dataset: TokenDataset
    tokenizer: TokenizerSpec
    summary: dict[str, Any]
    seconds: float

    def report(self) -> str:
        return format_summary(self.summary, self.seconds)


def make_dataset_from(
    out: str | os.PathLike[str],
    source: Source,
    options: Options,
    *,
    tokenizer: str | TokenizerSpec | None = "bpe",
    vocab_size: int | None = None,
    workers: int = 0,
    max_skipped_fraction: float = DEFAULT_MAX_SKIPPED_FRACTION,
    shard_bytes: int | None = None,
    progress: bool = False,
) -> Made:
    """Tokenize ``source`` with ``options`` into the new dataset folder ``out`` (see the module docstring).

    ``tokenizer``: ``bpe`` (trained here on the texts; ``vocab_size``
    tokens), ``bytes``, a ``tokenizer.json`` path, a model folder, a loaded
    ``TokenizerSpec``, or None (pre-tokenized ``ids`` only: ids are then
    checked against ``vocab_size`` when given). ``workers``: processes that
    tokenize (0: this one). Raises ``ConfigError`` for bad options, a
    ``TextSourceError`` for a source or tokenizer that cannot be used,
    ``TooManySkippedError`` and ``EmptyDatasetError``; nothing is written then.
    """
    import time

    from .._writer import check_target, hf_fingerprint, staging
    from .writer import SHARD_BYTES, ShardWriter

    began = time.perf_counter()
    _check(source, options, tokenizer, max_skipped_fraction, workers)
    check_target(out)
    spec = _tokenizer(source, options, tokenizer, vocab_size)
    options = _resolve(options, spec, vocab_size, source)
    Worker(spec, options)  # a template or tokenizer that cannot be used fails here, before any worker
    shown = Progress(source.total_work(), enabled=progress)
    counts = _Counts()
    pending: deque[RawBatch] = deque()

    def read() -> Iterator[RawBatch]:
        for batch in source.batches(options.columns):
            pending.append(_header(batch))
            yield batch

    with staging(out) as stage:
        writer = ShardWriter(stage, shard_bytes=shard_bytes or SHARD_BYTES)
        try:
            for result in ordered_map(Worker, (spec, options), read(), workers):
                batch = pending.popleft()
                counts.add(batch, result, options)
                writer.add(result.tokens, result.mask, result.lengths)
                shown.update(len(result.lengths), len(result.tokens), batch.work)
            shards = writer.close()
        finally:
            writer.abort()
            shown.close()
        if writer.rows == 0:
            raise EmptyDatasetError(_nothing_written(source, counts))
        counts.check(max_skipped_fraction)
        summary = counts.summary(writer.rows, writer.tokens, options)
        manifest = _manifest(source, options, spec, summary)
        identity = json.dumps(manifest, sort_keys=True) + (spec.json or "") + writer.digest.hexdigest()
        digest = hashlib.blake2b(identity.encode(), digest_size=16).hexdigest()
        manifest["digest"] = digest
        extra = {MANIFEST: (json.dumps(manifest, indent=2) + "\n").encode()}
        if spec.json is not None:
            extra[TOKENIZER_FILE] = spec.json.encode()
        if spec.config is not None:
            extra[CONFIG_FILE] = spec.config
        stage.seal(shards, hf_fingerprint(f"{FORMAT_TAG}:{digest}"), extra)
    return Made(open_dataset(out), spec, summary, time.perf_counter() - began)


def _header(batch: RawBatch) -> RawBatch:
    """The batch without its payload (what the main process keeps while workers have it)."""
    return RawBatch(
        batch.kind, batch.source, batch.first, None, batch.work, batch.last_of_source, batch.records
    )


def _check(
    source: Source, options: Options, tokenizer: str | TokenizerSpec | None, fraction: float, workers: int
) -> None:
    if source.format == "text" and options.mode != "text":
        raise ConfigError("from_text", "text files give text: the column options do not apply to them")
    if not source.paths:
        raise ConfigError(f"from_{source.format}", "give at least one path")
    if options.max_seq_len < 1:
        raise ConfigError("max_seq_len", f"must be at least 1, got {options.max_seq_len}")
    if not 0.0 <= fraction <= 1.0:
        raise ConfigError("max_skipped_fraction", f"must be in [0, 1], got {fraction}")
    if workers < 0:
        raise ConfigError("workers", f"must be at least 0, got {workers}")
    if tokenizer is None and options.mode != "ids":
        raise ConfigError(
            "tokenizer", "text needs a tokenizer (bpe, bytes, a tokenizer.json or a model folder)"
        )
    if options.mode == "ids" and tokenizer == "bpe":
        raise ConfigError(
            "tokenizer", "pre-tokenized --ids-column rows need the tokenizer that made them, not bpe"
        )
    if options.mode != "ids" and (options.labels_column or options.mask_column):
        raise ConfigError("labels_column", "--labels-column and --mask-column go with --ids-column")


def _tokenizer(
    source: Source, options: Options, tokenizer: str | TokenizerSpec | None, vocab_size: int | None
) -> TokenizerSpec:
    if isinstance(tokenizer, TokenizerSpec):
        return tokenizer
    if tokenizer is None:
        return TokenizerSpec("none", vocab_size or 0)
    if tokenizer == "bpe":
        return train_bpe(source.texts(options.columns), vocab_size)
    return load_tokenizer_spec(tokenizer, vocab_size=vocab_size if options.mode != "ids" else None)


def _resolve(options: Options, spec: TokenizerSpec, vocab_size: int | None, source: Source) -> Options:
    """``options`` with BOS/EOS decided (None: EOS for text and completions when the tokenizer has one)."""
    from dataclasses import replace

    for flag, token in (("bos", spec.bos), ("eos", spec.eos)):
        if getattr(options, flag) and token is None:
            raise ConfigError(flag, f"the tokenizer ({spec.source or spec.kind}) has no {flag.upper()} token")
    eos = options.eos
    if eos is None:
        eos = options.mode in ("text", "prompt") and spec.eos is not None
    limit = options.vocab_size
    if options.mode == "ids":
        limit = spec.vocab_size if spec.kind != "none" else vocab_size
        if limit is not None and limit < 1:
            raise ConfigError("vocab_size", f"must be at least 1, got {limit}")
    return replace(options, bos=bool(options.bos), eos=eos, vocab_size=limit, split=source.split)


class _Counts:
    """What happened to the records, summed over the batches in order."""

    def __init__(self) -> None:
        self.records = 0
        self.skips = Skips()
        self.chunked = self.chunks = self.truncated = 0
        self._first_of: str | None = None

    def add(self, batch: RawBatch, result: Encoded, options: Options) -> None:
        self.records += result.records
        self.skips.merge(result.skips)
        self.chunked += result.chunked
        self.chunks += result.chunks
        self.truncated += result.truncated
        first = self._first_of != batch.source
        self._first_of = batch.source
        parsed = result.records - result.skips.count("invalid_json") - result.skips.count("not_an_object")
        if first and result.missing and result.missing == parsed:
            # every record of the file's first batch lacks a column: the options name the wrong one
            present = result.keys
            missing = [name for name in options.columns if name not in present] or list(options.columns)
            where = f" (in its first {parsed} record(s))" if not batch.last_of_source else ""
            raise SourceColumnError(batch.source, missing, present, where)

    def check(self, fraction: float) -> None:
        from ..errors import TooManySkippedError

        bad = self.skips.total(chosen=False)
        if bad > fraction * self.records:
            reasons = {r: e["count"] for r, e in self.skips.as_dict().items()}
            first = next(iter(e["first"][0] for e in self.skips.as_dict().values() if e["first"]), "")
            raise TooManySkippedError(bad, self.records, fraction, reasons, first)

    def summary(self, rows: int, tokens: int, options: Options) -> dict[str, Any]:
        return {
            "records": self.records,
            "rows": rows,
            "tokens": tokens,
            "max_seq_len": options.max_seq_len,
            "chunked": self.chunked,
            "chunks": self.chunks,
            "truncated": self.truncated,
            "skipped_records": self.skips.as_dict(),
        }


def _nothing_written(source: Source, counts: _Counts) -> str:
    if source.format == "text":
        skipped = source.skipped
        return (
            f"no text to tokenize in {list(source.paths)}: {source.files} file(s) read, "
            f"{len(skipped)} skipped" + (f" (first: {skipped[0][0]}: {skipped[0][1]})" if skipped else "")
        )
    reasons = ", ".join(f"{r} {e['count']}" for r, e in counts.skips.as_dict().items())
    return f"no rows to write from {list(source.paths)}: {counts.records} record(s) read" + (
        f", all skipped ({reasons})" if reasons else ""
    )


def _manifest(
    source: Source, options: Options, spec: TokenizerSpec, summary: dict[str, Any]
) -> dict[str, Any]:
    """What was read and how (no times, no worker count: the same inputs give the same manifest)."""
    manifest: dict[str, Any] = {
        "format": FORMAT_TAG,
        "source_format": source.format,
        "sources": [os.fspath(p) for p in source.paths],
        "options": {
            k: v
            for k, v in asdict(options).items()
            if k in _COMMON or (k in _USED[options.mode] and source.format != "text")
        },
        "tokenizer": spec.describe(),
    }
    if source.format == "text":
        manifest |= {
            "include": list(source.include),
            "exclude": list(source.exclude),
            "split": source.split,
            "files": source.files,
            "skipped": [{"path": path, "why": why} for path, why in source.skipped],
        }
    return manifest | summary


_COMMON = {"mode", "bos", "eos", "long", "max_seq_len"}
_USED = {
    "text": {"text_column"},
    "prompt": {"prompt_column", "completion_column"},
    "messages": {"messages_column"},
    "ids": {"ids_column", "labels_column", "mask_column", "vocab_size"},
}
