"""Records into rows: tokens (int32) and a loss mask (int8), cut to ``max_seq_len``.

Guarantee: a raw batch always gives the same rows, in record order, and
every record either becomes rows or is a counted skip with its location
(``file:line`` or ``file row N``); nothing is lost silently. What is
trained on: every token of ``text`` (and the EOS); the completion's tokens
(and the EOS) after an untrained prompt; the assistant turns of
``messages`` as the chat template renders them (content and end-of-turn
tokens); the positions of pre-tokenized ``ids`` whose label is not -100 (or
whose mask is not 0). A BOS is never trained on. The trade-off: the prompt
and completion are tokenized apart (the join is a token boundary), as
trainers of completions do.

``long`` (documents over ``max_seq_len`` tokens): ``chunk`` cuts them into
pieces of at most ``max_seq_len`` (a piece with no trained token is
skipped as ``chunk_without_loss``), ``truncate`` keeps the first ``max_seq_len``,
``drop`` skips them (``too_long``).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
import numpy.typing as npt

from ..errors import ChatTemplateError
from ..text import Split, split_text
from .sources import RawBatch, arrow_batch
from .tokenizer import Encoder, TokenizerSpec, require_template

__all__ = [
    "FIRST_KEPT",
    "Encoded",
    "Long",
    "Mode",
    "Options",
    "Skips",
    "Worker",
    "text_values",
]

I32 = npt.NDArray[np.int32]
I8 = npt.NDArray[np.int8]
Mode = Literal["text", "prompt", "messages", "ids"]
Long = Literal["chunk", "truncate", "drop"]

# Locations kept per skip reason.
FIRST_KEPT = 5
IGNORE_LABEL = -100
_MISSING: Any = object()
# Skips that are not bad records (a chosen drop, a chunk of a kept record): not counted
# against --max-skipped-fraction.
CHOSEN = frozenset({"too_long", "chunk_without_loss"})


@dataclass(frozen=True)
class Options:
    """What to read of each record and how to turn it into rows (see ``ladle make-dataset --help``)."""

    mode: Mode = "text"
    text_column: str = "text"
    prompt_column: str = "prompt"
    completion_column: str = "completion"
    messages_column: str = "messages"
    ids_column: str = "input_ids"
    labels_column: str | None = None
    mask_column: str | None = None
    bos: bool = False
    eos: bool | None = None  # None: EOS after text and completions when the tokenizer has one
    long: Long = "chunk"
    max_seq_len: int = 8192
    vocab_size: int | None = None
    split: Split = "documents"  # text files (the pipeline sets the source's)

    @property
    def columns(self) -> tuple[str, ...]:
        """The record fields these options read."""
        if self.mode == "text":
            return (self.text_column,)
        if self.mode == "prompt":
            return (self.prompt_column, self.completion_column)
        if self.mode == "messages":
            return (self.messages_column,)
        extra = self.labels_column or self.mask_column
        return (self.ids_column,) if extra is None else (self.ids_column, extra)


@dataclass
class Skips:
    """Skipped records by reason: ``{reason: [count, [first locations]]}``, mergeable in order."""

    by_reason: dict[str, list[Any]] = field(default_factory=dict)

    def add(self, reason: str, where: str, count: int = 1) -> None:
        entry = self.by_reason.setdefault(reason, [0, []])
        entry[0] += count
        if len(entry[1]) < FIRST_KEPT:
            entry[1].append(where)

    def merge(self, other: Skips) -> None:
        for reason, (count, first) in other.by_reason.items():
            entry = self.by_reason.setdefault(reason, [0, []])
            entry[0] += count
            entry[1].extend(first[: FIRST_KEPT - len(entry[1])])

    def count(self, reason: str) -> int:
        return int(self.by_reason.get(reason, [0])[0])

    def total(self, *, chosen: bool = True) -> int:
        return sum(c for r, (c, _) in self.by_reason.items() if chosen or r not in CHOSEN)

    def as_dict(self) -> dict[str, dict[str, Any]]:
        return {r: {"count": c, "first": list(f)} for r, (c, f) in sorted(self.by_reason.items())}


@dataclass
class Encoded:
    """The rows of one raw batch, flattened, and what happened to its records."""

    tokens: I32
    mask: I8
    lengths: I32
    records: int = 0
    skips: Skips = field(default_factory=Skips)
    chunked: int = 0
    chunks: int = 0
    truncated: int = 0
    missing: int = 0  # records that lack a named column
    keys: list[str] = field(default_factory=list)  # the fields of the first records (for a missing column)


class Worker:
    """Turns raw batches into ``Encoded`` rows; one per worker process (it holds the tokenizer)."""

    def __init__(self, spec: TokenizerSpec, options: Options) -> None:
        self.spec = spec
        self.options = options
        self.encoder: Encoder = spec.build()
        self.chat: ChatTemplate | None = None
        if options.mode == "messages":
            self.chat = ChatTemplate(
                require_template(spec),
                spec.bos.text if spec.bos else "",
                spec.eos.text if spec.eos else "",
                spec.source or spec.kind,
            )

    def __call__(self, batch: RawBatch) -> Encoded:
        rows = _Rows(self.options)
        if batch.kind == "text":
            self._text_files(batch, rows)
        else:
            records = _records(batch, self.options.columns, rows)
            if self.options.mode == "text":
                self._texts(records, rows)
            elif self.options.mode == "prompt":
                self._prompts(records, rows)
            elif self.options.mode == "messages":
                self._messages(records, rows)
            else:
                self._ids(records, rows)
        return rows.encoded()

    # --- the modes ---------------------------------------------------------------

    def _text_files(self, batch: RawBatch, rows: _Rows) -> None:
        texts: list[str] = []
        where: list[str] = []
        for path, text, python in batch.payload:
            pieces = split_text(text, self.options.split, python=python)
            texts += pieces
            where += [path] * len(pieces)
        rows.result.records += len(texts)
        for ids, at in zip(self.encoder.encode(texts), where, strict=True):
            rows.document(ids, None, at, self.spec)

    def _texts(self, records: _Records, rows: _Rows) -> None:
        texts, where = _strings(records, self.options.text_column, rows)
        for ids, at in zip(self.encoder.encode(texts), where, strict=True):
            rows.document(ids, None, at, self.spec)

    def _prompts(self, records: _Records, rows: _Rows) -> None:
        prompts = records.column(self.options.prompt_column)
        completions = records.column(self.options.completion_column)
        keep: list[int] = []
        for i, (prompt, completion) in enumerate(zip(prompts, completions, strict=True)):
            if prompt is _MISSING or completion is _MISSING:
                rows.skip("missing_column", records.where(i))
                rows.result.missing += 1
            elif not isinstance(prompt, str) or not isinstance(completion, str):
                rows.skip("not_a_string", records.where(i))
            else:
                keep.append(i)
        encoded = self.encoder.encode([prompts[i] for i in keep] + [completions[i] for i in keep])
        for k, i in enumerate(keep):
            prompt_ids, completion_ids = encoded[k], encoded[len(keep) + k]
            ids = np.concatenate([prompt_ids, completion_ids])
            mask = np.zeros(len(ids), dtype=np.int8)
            mask[len(prompt_ids) :] = 1
            rows.document(ids, mask, records.where(i), self.spec)

    def _messages(self, records: _Records, rows: _Rows) -> None:
        assert self.chat is not None
        texts: list[str] = []
        spans: list[list[tuple[int, int]]] = []
        where: list[str] = []
        for i, messages in enumerate(records.column(self.options.messages_column)):
            if messages is _MISSING:
                rows.skip("missing_column", records.where(i))
                rows.result.missing += 1
                continue
            if not _is_conversation(messages):
                rows.skip("bad_messages", records.where(i))
                continue
            try:
                text, found = self.chat.spans(messages)
            except _RefusedError:
                rows.skip("template_refused", records.where(i))
                continue
            texts.append(text)
            spans.append(found)
            where.append(records.where(i))
        for (ids, offsets), found, at in zip(self.encoder.encode_offsets(texts), spans, where, strict=True):
            mask = np.zeros(len(ids), dtype=np.int8)
            for start, end in found:
                mask[(offsets[:, 1] > start) & (offsets[:, 0] < end)] = 1
            rows.document(ids, mask, at, self.spec)

    def _ids(self, records: _Records, rows: _Rows) -> None:
        options = self.options
        ids_values = records.column(options.ids_column)
        extra_name = options.labels_column or options.mask_column
        extra = records.column(extra_name) if extra_name else None
        limit = options.vocab_size
        for i, value in enumerate(ids_values):
            at = records.where(i)
            if value is _MISSING or (extra is not None and extra[i] is _MISSING):
                rows.skip("missing_column", at)
                rows.result.missing += 1
                continue
            ids = _int_list(value)
            if ids is None:
                rows.skip("not_a_list" if not isinstance(value, list | tuple) else "bad_ids", at)
                continue
            if len(ids) and int(ids.min()) < 0:
                rows.skip("bad_ids", at)
                continue
            if len(ids) and int(ids.max()) >= (limit if limit is not None else 2**31):
                rows.skip("id_out_of_vocabulary" if limit is not None else "bad_ids", at)
                continue
            mask: I8 | None = None
            if extra is not None:
                other = _int_list(extra[i])
                if other is None or len(other) != len(ids):
                    rows.skip(
                        "labels_length_mismatch" if options.labels_column else "mask_length_mismatch", at
                    )
                    continue
                mask = (other != IGNORE_LABEL if options.labels_column else other != 0).view(np.int8)
            rows.document(ids.astype(np.int32), mask, at, self.spec)


# --- records of a raw batch ------------------------------------------------------


class _Records:
    """The records of a raw batch, read column by column (``_MISSING`` where a record lacks one)."""

    def __init__(self, columns: dict[str, list[Any]], where: Callable[[int], str]) -> None:
        self._columns = columns
        self.where = where

    def column(self, name: str) -> list[Any]:
        return self._columns[name]


def _records(batch: RawBatch, names: Sequence[str], rows: _Rows) -> _Records:
    if batch.kind == "arrow":
        if batch.payload is None:
            return _Records({name: [] for name in names}, lambda i: "")
        table = arrow_batch(batch)
        rows.result.records += table.num_rows
        columns = {name: table.column(name).to_pylist() for name in names}
        return _Records(columns, lambda i: f"{batch.source} row {batch.first + i}")
    parsed: list[dict[str, Any]] = []
    lines: list[int] = []
    for k, line in enumerate(batch.payload):
        if not line.strip():
            continue
        rows.result.records += 1
        try:
            record = json.loads(line)
        except ValueError:
            rows.skip("invalid_json", f"{batch.source}:{batch.first + k}")
            continue
        if not isinstance(record, dict):
            rows.skip("not_an_object", f"{batch.source}:{batch.first + k}")
            continue
        if len(rows.result.keys) == 0:
            rows.result.keys = sorted(record)
        parsed.append(record)
        lines.append(batch.first + k)
    columns = {name: [r.get(name, _MISSING) for r in parsed] for name in names}
    return _Records(columns, lambda i: f"{batch.source}:{lines[i]}")


def _strings(records: _Records, name: str, rows: _Rows) -> tuple[list[str], list[str]]:
    texts: list[str] = []
    where: list[str] = []
    for i, value in enumerate(records.column(name)):
        if isinstance(value, str):
            texts.append(value)
            where.append(records.where(i))
        elif value is _MISSING:
            rows.skip("missing_column", records.where(i))
            rows.result.missing += 1
        else:
            rows.skip("not_a_string", records.where(i))
    return texts, where


def _int_list(value: Any) -> npt.NDArray[np.int64] | None:
    """A list of integers as an int64 array, or None (not a list, or not all integers)."""
    if not isinstance(value, list | tuple):
        return None
    try:
        array = np.asarray(value)
    except (ValueError, TypeError, OverflowError):
        return None
    if array.ndim != 1 or (len(array) and array.dtype.kind not in "iub"):
        return None
    return array.astype(np.int64)


def _is_conversation(messages: Any) -> bool:
    return isinstance(messages, list) and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) for m in messages
    )


def text_values(batch: RawBatch, columns: Sequence[str], split: Split) -> Iterator[str]:
    """The texts of a raw batch, as a tokenizer is trained on them (bad records passed over)."""
    if batch.kind == "text":
        for _, text, python in batch.payload:
            yield from split_text(text, split, python=python)
        return
    rows = _Rows(Options())
    records = _records(batch, columns, rows)
    for name in columns:
        for value in records.column(name):
            if isinstance(value, str):
                yield value
            elif isinstance(value, list):  # messages: their contents
                for message in value:
                    content = message.get("content") if isinstance(message, dict) else None
                    if isinstance(content, str):
                        yield content


# --- rows: special tokens and the long policy ------------------------------------------


class _Rows:
    """Collects a batch's rows: adds BOS/EOS, applies ``long``, counts what it skips."""

    def __init__(self, options: Options) -> None:
        self.options = options
        self.tokens: list[I32] = []
        self.masks: list[I8] = []
        self.result = Encoded(np.empty(0, np.int32), np.empty(0, np.int8), np.empty(0, np.int32))

    def skip(self, reason: str, where: str) -> None:
        self.result.skips.add(reason, where)

    def document(self, ids: I32, mask: I8 | None, where: str, spec: TokenizerSpec) -> None:
        """One record's tokens (``mask`` None: trained on every token)."""
        options = self.options
        if len(ids) == 0:
            self.skip("empty", where)
            return
        if mask is None:
            mask = np.ones(len(ids), dtype=np.int8)
        if options.bos and spec.bos is not None:
            ids = np.concatenate([np.array([spec.bos.id], np.int32), ids])
            mask = np.concatenate([np.zeros(1, np.int8), mask])
        if options.eos and spec.eos is not None:
            ids = np.concatenate([ids, np.array([spec.eos.id], np.int32)])
            mask = np.concatenate([mask, np.ones(1, np.int8)])
        limit = options.max_seq_len
        if len(ids) <= limit:
            self._add(ids, mask, where)
        elif options.long == "drop":
            self.skip("too_long", where)
        elif options.long == "truncate":
            self.result.truncated += 1
            self._add(ids[:limit], mask[:limit], where)
        else:
            self.result.chunked += 1
            for start in range(0, len(ids), limit):
                self.result.chunks += 1
                self._add(ids[start : start + limit], mask[start : start + limit], where, chunk=True)

    def _add(self, ids: I32, mask: I8, where: str, *, chunk: bool = False) -> None:
        if not mask.any():
            self.skip("chunk_without_loss" if chunk else "no_loss", where)
            return
        self.tokens.append(ids)
        self.masks.append(mask)

    def encoded(self) -> Encoded:
        result = self.result
        if self.tokens:
            result.tokens = np.concatenate(self.tokens).astype(np.int32, copy=False)
            result.mask = np.concatenate(self.masks).astype(np.int8, copy=False)
            result.lengths = np.fromiter((len(t) for t in self.tokens), np.int32, len(self.tokens))
        return result


# --- chat templates ----------------------------------------------------------------


class _RefusedError(Exception):
    """The template's ``raise_exception`` refused a conversation (a counted skip)."""


class ChatTemplate:
    """A chat template rendered as ``transformers`` renders it, and the assistant turns it marks.

    The environment is the one ``transformers`` uses (a sandbox, ``trim_blocks``,
    ``lstrip_blocks``, ``loopcontrols``, ``tojson``, ``raise_exception``,
    ``strftime_now``). An assistant turn ``i`` spans the text from the
    render of the messages before it with ``add_generation_prompt=True`` to
    the render of the messages up to it, so its content and its end-of-turn
    tokens are trained on; a template whose renders are not prefixes of the
    whole conversation's cannot be marked this way (``ChatTemplateError``).
    """

    def __init__(self, source: str, bos: str, eos: str, where: str) -> None:
        import jinja2
        from jinja2 import ext
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message: str) -> None:
            raise _RefusedError(message)

        def tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
                   sort_keys: bool = False) -> str:  # fmt: skip
            return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                              sort_keys=sort_keys)  # fmt: skip

        def strftime_now(format: str) -> str:
            # a fixed date: the same records must give the same rows on every run
            import datetime

            return datetime.datetime(2024, 1, 1).strftime(format)

        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=[ext.loopcontrols]
        )
        env.filters["tojson"] = tojson
        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = strftime_now
        self._where = where
        try:
            self._template = env.from_string(source)
        except jinja2.TemplateError as exc:
            raise ChatTemplateError(where, f"has a chat template jinja2 cannot read ({exc})") from None
        self._tokens = {"bos_token": bos, "eos_token": eos}

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool) -> str:
        import jinja2

        try:
            return str(
                self._template.render(
                    messages=messages, add_generation_prompt=add_generation_prompt, **self._tokens
                )
            )
        except _RefusedError:
            raise
        except (jinja2.TemplateError, TypeError, ValueError, KeyError, AttributeError) as exc:
            raise _RefusedError(str(exc)) from None

    def spans(self, messages: list[dict[str, Any]]) -> tuple[str, list[tuple[int, int]]]:
        """The conversation's text and the ``[start, end)`` character spans of its assistant turns."""
        text = self.render(messages, False)
        spans: list[tuple[int, int]] = []
        for i, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            before = self.render(messages[:i], True)
            through = self.render(messages[: i + 1], False)
            if not (text.startswith(before) and text.startswith(through) and len(before) <= len(through)):
                raise ChatTemplateError(
                    self._where,
                    f"has a chat template whose render of the first {i} message(s) (with the generation "
                    f"prompt) or first {i + 1} is not a prefix of the whole conversation's, so the "
                    "assistant turns cannot be found in it; use --prompt-column/--completion-column "
                    "or pre-tokenized --ids-column with --labels-column instead",
                )
            spans.append((len(before), len(through)))
        return text, spans
