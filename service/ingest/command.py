"""The arguments of ``ladle make-dataset`` for real data, and running it from them.

``add_arguments`` defines them on the CLI's parser (the sources join the
group that holds ``--rows``); ``run`` makes the dataset and prints the
summary. Importing this module is cheap: the pipeline is imported by ``run``.
"""

from __future__ import annotations

import argparse
from typing import Any, get_args

from ..errors import ConfigError
from ..text import Split
from .workers import default_workers

__all__ = ["SOURCE_FLAGS", "add_arguments", "run"]

# (flag, format, nargs)
SOURCE_FLAGS = (
    ("--from-text", "text", "+"),
    ("--from-jsonl", "jsonl", "+"),
    ("--from-parquet", "parquet", "+"),
    ("--from-hf", "hf", None),
)


def _fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number, got {text!r}") from None
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"must be in [0, 1], got {value}")
    return value


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def add_arguments(parser: argparse.ArgumentParser, sources: Any) -> None:
    """The real-data options of ``make-dataset``; ``sources`` is the mutually exclusive source group."""
    sources.add_argument(
        "--from-text", nargs="+", metavar="PATH", help="tokenize these text files and folders (.gz read too)"
    )
    sources.add_argument(
        "--from-jsonl", nargs="+", metavar="PATH", help="tokenize these JSON Lines files (.jsonl, .gz, .zst)"
    )
    sources.add_argument("--from-parquet", nargs="+", metavar="PATH", help="tokenize these Parquet files")
    sources.add_argument("--from-hf", metavar="PATH", help="tokenize this untokenized save_to_disk folder")
    what = parser.add_argument_group(
        "what to tokenize (records of JSONL, Parquet, HF; default --text-column text)"
    )
    what.add_argument("--text-column", metavar="NAME", help="a text: loss on every token")
    what.add_argument(
        "--prompt-column", metavar="NAME", help="with --completion-column: loss on the completion"
    )
    what.add_argument("--completion-column", metavar="NAME")
    what.add_argument(
        "--messages-column",
        metavar="NAME",
        help="a list of {role, content}: rendered with the chat template, loss on assistant turns",
    )
    what.add_argument(
        "--ids-column", metavar="NAME", help="pre-tokenized ids (checked, then cut like the rest)"
    )
    what.add_argument(
        "--labels-column", metavar="NAME", help="with --ids-column: loss where the label is not -100"
    )
    what.add_argument("--mask-column", metavar="NAME", help="with --ids-column: loss where the mask is not 0")
    tok = parser.add_argument_group("tokens")
    tok.add_argument(
        "--tokenizer",
        metavar="bpe|bytes|PATH",
        help="bpe (trained here; the default for text), bytes, a tokenizer.json or a local model folder "
        "(read offline, never downloaded)",
    )
    tok.add_argument(
        "--vocab-size", type=int, help="default: 32000 synthetic, 4096 BPE; ids are checked against it"
    )
    tok.add_argument(
        "--bos",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="a BOS token first in each document",
    )
    tok.add_argument(
        "--eos",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="an EOS token last in each document (default: after text and completions, if there is one)",
    )
    tok.add_argument("--max-seq-len", type=_positive, default=8192, help="the longest row (default: 8192)")
    tok.add_argument(
        "--long",
        choices=("chunk", "truncate", "drop"),
        default="chunk",
        help="documents over --max-seq-len: cut into pieces (chunk, the default: none lost), truncate, drop",
    )
    run_group = parser.add_argument_group("the run")
    run_group.add_argument(
        "--workers",
        type=int,
        default=None,
        help=f"tokenizing processes (default: all {default_workers()} cores)",
    )
    run_group.add_argument(
        "--max-skipped-fraction",
        type=_fraction,
        default=None,
        help="fail, writing nothing, if more than this fraction of the records is bad input (default: 0.01)",
    )
    run_group.add_argument(
        "--progress", action=argparse.BooleanOptionalAction, default=True, help="progress on stderr"
    )
    text = parser.add_argument_group("text files (--from-text)")
    text.add_argument(
        "--split",
        choices=get_args(Split),
        default="documents",
        help="a row per file (documents, the default), top-level function or class, or paragraph",
    )
    for flag, help_text in (
        ("--include", "file names to read (default all)"),
        ("--exclude", "names to skip"),
    ):
        text.add_argument(flag, action="append", default=[], metavar="GLOB", help=f"in folders: {help_text}")


def source_of(args: argparse.Namespace) -> Any:
    """The ``Source`` the arguments name, or None (synthetic rows)."""
    from .sources import Source

    for flag, form, nargs in SOURCE_FLAGS:
        value = getattr(args, flag[2:].replace("-", "_"))
        if value:
            paths = value if nargs else [value]
            return Source(form, list(paths), split=args.split, include=args.include, exclude=args.exclude)  # type: ignore[arg-type]
    return None


def options_of(args: argparse.Namespace) -> Any:
    """The ``Options`` the arguments name (``ConfigError`` for a contradiction)."""
    from .encode import Options

    modes = [
        mode
        for mode, given in (
            ("text", args.text_column),
            ("prompt", args.prompt_column or args.completion_column),
            ("messages", args.messages_column),
            ("ids", args.ids_column),
        )
        if given
    ]
    if len(modes) > 1:
        raise ConfigError(
            "columns",
            f"choose one of --text-column, --prompt-column, --messages-column, --ids-column (got {modes})",
        )
    mode = modes[0] if modes else "text"
    if mode == "prompt" and not (args.prompt_column and args.completion_column):
        raise ConfigError("columns", "--prompt-column and --completion-column go together")
    if args.labels_column and args.mask_column:
        raise ConfigError("columns", "give --labels-column or --mask-column, not both")
    if args.from_text and modes:
        raise ConfigError(
            "columns", "text files give text: the column options apply to JSONL, Parquet and HF records"
        )
    named: dict[str, Any] = {
        "text_column": args.text_column,
        "prompt_column": args.prompt_column,
        "completion_column": args.completion_column,
        "messages_column": args.messages_column,
        "ids_column": args.ids_column,
    }
    return Options(
        mode=mode,  # type: ignore[arg-type]
        **{k: v for k, v in named.items() if v},
        labels_column=args.labels_column,
        mask_column=args.mask_column,
        bos=args.bos,
        eos=args.eos,
        long=args.long,
        max_seq_len=args.max_seq_len,
    )


def run(args: argparse.Namespace) -> int:
    """Make the dataset the arguments describe; print its summary (progress on stderr)."""
    from .make import DEFAULT_MAX_SKIPPED_FRACTION, make_dataset_from

    source = source_of(args)
    options = options_of(args)
    tokenizer = args.tokenizer or (None if options.mode == "ids" else "bpe")
    workers = default_workers() if args.workers is None else args.workers
    fraction = (
        DEFAULT_MAX_SKIPPED_FRACTION if args.max_skipped_fraction is None else args.max_skipped_fraction
    )
    if args.progress:
        print(f"tokenizing {source.format} {', '.join(source.paths)} on {workers} worker(s)", flush=True)
    made = make_dataset_from(
        args.out,
        source,
        options,
        tokenizer=tokenizer,
        vocab_size=args.vocab_size,
        workers=workers,
        max_skipped_fraction=fraction,
        progress=args.progress,
    )
    spec = made.tokenizer
    if source.format == "text":
        print(
            f"read {source.files} files ({len(source.skipped)} skipped: see text.json), "
            f"{spec.kind} vocabulary {spec.vocab_size}, {made.dataset.num_tokens:,} tokens"
        )
    print(made.report())
    print(
        f"wrote {made.dataset.num_rows} rows to {args.out} in {made.seconds:.1f}s "
        f"(fingerprint {made.dataset.fingerprint})"
    )
    return 0
