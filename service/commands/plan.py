"""``ladle plan``: the per-bucket table and the schedule's quality figures for a dataset."""

from __future__ import annotations

import argparse
import json
from typing import Any

from ..errors import ConfigError
from ..schedule import PRODUCTION_BOUNDS, ScheduleConfig, build_schedule, cut_samples
from ..schedule.stats import bucket_table, quality, simulate_loss, summary
from ._options import Subparsers, add_column_option, add_config_options, config_from_args
from ._tables import format_bucket_table, format_loss, format_quality


def add_parser(sub: Subparsers) -> argparse.ArgumentParser:
    plan = sub.add_parser("plan", help="print the per-bucket table and the schedule's quality figures")
    plan.add_argument("dataset", help="a dataset folder written by save_to_disk")
    plan.add_argument(
        "--world-size", type=int, default=1, metavar="W", help="ranks the epoch is planned for (default 1)"
    )
    plan.add_argument("--epoch", type=int, default=0, help="the epoch to plan, from 0 (default 0)")
    plan.add_argument("--json", action="store_true", help="machine-readable output")
    plan.add_argument("--compare", choices=["random"], help="show the naive random shuffle beside ladle")
    plan.add_argument("--simulate-loss", action="store_true", help="simulate the logged loss (the ladder)")
    plan.add_argument(
        "--check-values",
        action="store_true",
        help="read every token: refuse ids beyond int32 and mask values beyond int8 now, not at their batch, "
        "and name negative ids and masks other than 0/1 (reads the whole dataset once)",
    )
    plan.add_argument(
        "--vocab-size",
        type=int,
        metavar="N",
        help="with --check-values: refuse token ids outside [0, N), the model's vocabulary",
    )
    add_column_option(plan)
    add_config_options(plan)
    return plan


def run(args: argparse.Namespace) -> int:
    from ..assemble import check_values
    from ..dataset import open_dataset, parse_columns

    config = config_from_args(args)
    if args.vocab_size is not None and args.vocab_size < 1:
        raise ConfigError("vocab_size", f"--vocab-size must be >= 1, got {args.vocab_size}")
    if args.vocab_size is not None and not args.check_values:
        raise ConfigError("vocab_size", "--vocab-size is checked by --check-values: give both")
    ds = open_dataset(args.dataset, parse_columns(args.column))
    sched = build_schedule(ds.lengths, config, epoch=args.epoch, world_size=args.world_size)
    # the epoch after, for the batch-mates that meet again
    after = build_schedule(ds.lengths, config, epoch=args.epoch + 1, world_size=args.world_size)
    baseline = None
    if args.compare == "random" or args.simulate_loss:
        baseline = build_schedule(
            ds.lengths,
            config.replace(interleave="random"),
            epoch=args.epoch,
            world_size=args.world_size,
        )
    cut = cut_samples(ds.lengths, config)
    ranges = check_values(ds, args.vocab_size) if args.check_values else None
    if args.json:
        doc = summary(sched, after)
        doc["dataset"] = {
            "path": ds.path,
            "rows": ds.num_rows,
            "fingerprint": ds.fingerprint,
            "columns": ds.columns.as_dict(),
        }
        doc["cut"] = {"samples": cut.samples, "tokens_cut": cut.tokens_cut, "tokens": cut.tokens}
        if ranges is not None:
            doc["values"] = {column: {"min": lo, "max": hi} for column, (lo, hi) in ranges.items()}
        if baseline is not None and args.compare == "random":
            doc["compare"] = {"random": summary(baseline)}
        if args.simulate_loss and baseline is not None:
            doc["simulated_loss"] = {
                "ladle": vars(simulate_loss(sched)),
                "random": vars(simulate_loss(baseline)),
            }
        print(json.dumps(doc, indent=2))
        return 0
    print(f"dataset {ds.path}: {ds.num_rows} rows, fingerprint {ds.fingerprint}")
    print(f"columns: {ds.columns.describe()}")
    print(
        f"config {config.fingerprint()}: budget {config.token_budget} tokens, "
        f"<= {config.max_batch_size} rows, max_seq_len {config.max_seq_len}, "
        f"{config.rank_mode} ranks, seed {config.seed}, epoch {args.epoch}"
    )
    print(f"bucket bounds {_bounds_source(config)}: {', '.join(str(b) for b in sched.bounds)}")
    print()
    print(format_bucket_table(sched))
    print()
    q = quality(sched, after)
    qb = quality(baseline) if baseline is not None and args.compare == "random" else None
    print(format_quality(q, qb))
    if cut:
        print(f"\nnote: {cut.sentence()}")
    crowded = _crowded_bucket(sched, config)
    if crowded:
        print(f"\nnote: {crowded}")
    if ranges is not None:
        print(f"\n{_values_line(ranges)}")
    if args.simulate_loss and baseline is not None:
        print()
        print(format_loss(simulate_loss(sched), simulate_loss(baseline)))
    return 0


def _bounds_source(config: ScheduleConfig) -> str:
    """How the edges were chosen: 'auto' (fitted), the production preset, or given."""
    if config.bucket_bounds == "auto":
        return f"(auto, {config.num_buckets} buckets at most, fitted to this dataset)"
    if config.bucket_bounds == PRODUCTION_BOUNDS:
        return "(the production preset)"
    return "(given)"


def _values_line(ranges: dict[str, tuple[int, int]]) -> str:
    """What ``--check-values`` found: the ranges, and what in them is odd (every value fits the wire)."""
    ids_low, ids_high = ranges["input_ids"]
    mask_low, mask_high = ranges.get("loss_mask", (0, 1))
    mask = f", loss_mask {mask_low}..{mask_high}" if "loss_mask" in ranges else ", loss mask derived (0 or 1)"
    line = f"values: input_ids {ids_low}..{ids_high}{mask}: all fit the wire"
    if ids_low < 0:
        line += "\nnote: input_ids holds negative values (a -100 copied from labels?): they are served as is"
    if mask_low < 0 or mask_high > 1:
        line += "\nnote: loss_mask holds values other than 0 and 1: they reach the trainer as weights"
    return line


def _crowded_bucket(sched: Any, config: ScheduleConfig) -> str:
    """A hint when fixed edges put most samples in one bucket (nothing left to interleave), else ''."""
    rows = bucket_table(sched)
    total = sum(r.samples for r in rows)
    if config.bucket_bounds == "auto" or len(rows) < 2 or not total:
        return ""
    top = max(rows, key=lambda r: r.samples)
    if top.samples < 0.9 * total:
        return ""
    return (
        f"{top.samples / total:.0%} of the samples fall in one bucket ([{top.lo}, {top.hi})) with these "
        "edges, so batches barely mix lengths; --bucket-bounds auto fits edges to this dataset"
    )
