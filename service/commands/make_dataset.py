"""``ladle make-dataset``: a tokenized dataset, synthetic or from real data (``ingest.command``)."""

from __future__ import annotations

import argparse
import os
import time

from ..errors import ConfigError
from ..ingest.command import add_arguments as ingest_arguments
from ..ingest.command import run as ingest
from ._options import Subparsers


def add_parser(sub: Subparsers) -> argparse.ArgumentParser:
    make = sub.add_parser(
        "make-dataset",
        help="write a tokenized dataset: synthetic (production length mix), or from text, JSONL, Parquet "
        "or a save_to_disk folder",
    )
    make.add_argument("out", help="folder to create")
    source = make.add_mutually_exclusive_group(required=True)
    source.add_argument("--rows", type=int, help="synthetic: this many rows of the production length mix")
    make.add_argument("--seed", type=int, default=0, help="synthetic rows")
    make.add_argument(
        "--scale",
        type=float,
        default=1.0,
        help="synthetic: multiply every length, e.g. 0.03125 for rows 1/32 as long (default: 1.0)",
    )
    ingest_arguments(make, source)
    return make


def run(args: argparse.Namespace) -> int:
    try:
        return _write_dataset(args)
    except OSError as exc:  # the sources' read errors are LadleErrors already: this one is the writing
        where = f" ({exc.filename})" if exc.filename and os.fspath(exc.filename) != args.out else ""
        raise ConfigError("out", f"cannot write {args.out}: {exc.strerror or exc}{where}") from None


def _write_dataset(args: argparse.Namespace) -> int:
    if args.rows is None:
        return ingest(args)
    from ..synth import make_dataset

    began = time.perf_counter()
    vocab_size = 32000 if args.vocab_size is None else args.vocab_size
    ds = make_dataset(args.out, args.rows, args.seed, scale=args.scale, vocab_size=vocab_size)
    took = time.perf_counter() - began
    print(f"wrote {ds.num_rows} rows to {args.out} in {took:.1f}s (fingerprint {ds.fingerprint})")
    return 0
