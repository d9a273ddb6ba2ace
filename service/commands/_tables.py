"""The tables ``ladle plan`` and ``ladle inspect`` print: buckets, quality figures, simulated loss."""

from __future__ import annotations

import textwrap
from collections.abc import Sequence
from typing import Any

from ..report import BUCKET_HEADER, bucket_cells, ratio_cell
from ..schedule.stats import BucketRow, LossFigures, Quality, batch_mates_note, bucket_table


def table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(header)]
    lines = ["  ".join(h.rjust(w) for h, w in zip(header, widths, strict=True))]
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) for r in rows]
    return "\n".join(lines)


def format_bucket_table(sched: Any) -> str:
    return format_bucket_rows(bucket_table(sched))


def format_bucket_rows(rows: Sequence[BucketRow]) -> str:
    """The per-bucket table as text (the page and ``ladle inspect`` show the same cells)."""
    return table(list(BUCKET_HEADER), [bucket_cells(r) for r in rows])


def _fmt_list(values: list[int] | None) -> str:
    return " ".join(str(v) for v in values) if values is not None else "-"


def format_quality(q: Quality, baseline: Quality | None = None) -> str:
    def row(name: str, ours: str, theirs: str | None = None) -> list[str]:
        return [name, ours] + ([theirs or "-"] if baseline is not None else [])

    b = baseline
    rows = [
        row("steps per epoch", str(q.num_steps), str(b.num_steps) if b else None),
        row("optimizer steps", str(q.optimizer_steps), str(b.optimizer_steps) if b else None),
        row("world size", str(q.world_size), str(b.world_size) if b else None),
        row(
            "padding efficiency",
            f"{q.padding_efficiency:.4f}",
            f"{b.padding_efficiency:.4f}" if b else None,
        ),
        row("longest run per bucket", _fmt_list(q.max_run), _fmt_list(b.max_run) if b else None),
        row(
            "  its lower bound",
            _fmt_list(q.max_run_lower_bound),
            _fmt_list(b.max_run_lower_bound) if b else None,
        ),
        row("  worst excess over bound", str(q.max_run_excess), str(b.max_run_excess) if b else None),
        row(
            "share deviation, ranks",
            f"{q.share_deviation_ranks:.2f}",
            f"{b.share_deviation_ranks:.2f}" if b else None,
        ),
        row(
            "share deviation, steps",
            f"{q.share_deviation_steps:.2f}",
            f"{b.share_deviation_steps:.2f}" if b else None,
        ),
        row(
            "distinct buckets/step min, mean",
            f"{q.distinct_per_step_min}, {q.distinct_per_step_mean:.2f}",
            f"{b.distinct_per_step_min}, {b.distinct_per_step_mean:.2f}" if b else None,
        ),
        row(
            f"distinct buckets/window min, mean (of {q.distinct_per_window_possible})",
            f"{q.distinct_per_window_min}, {q.distinct_per_window_mean:.2f}",
            f"{b.distinct_per_window_min}, {b.distinct_per_window_mean:.2f}" if b else None,
        ),
        row(
            "buckets run out within (steps)",
            str(q.finish_spread_steps),
            str(b.finish_spread_steps) if b else None,
        ),
        row(
            "batch-mates: row-id span / random's",
            ratio_cell(q.batch_span_ratio),
            ratio_cell(b.batch_span_ratio) if b else None,
        ),
        row(
            "batch-mates: meeting again / chance",
            ratio_cell(q.batch_mates_again),
            ratio_cell(b.batch_mates_again) if b else None,
        ),
        row("dropped samples", _fmt_dropped(q.dropped), _fmt_dropped(b.dropped) if b else None),
    ]
    header = ["figure", "ladle"] + (["random"] if baseline is not None else [])
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]
    lines = [
        "  ".join(
            h.ljust(w) if i == 0 else h.rjust(w) for i, (h, w) in enumerate(zip(header, widths, strict=True))
        )
    ]
    lines.append("  ".join("-" * w for w in widths))
    for r in rows:
        lines.append(
            "  ".join(
                c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths, strict=True))
            )
        )
    lines.append(textwrap.fill(batch_mates_note(q), width=100))
    return "\n".join(lines)


def _fmt_dropped(dropped: dict[str, int]) -> str:
    return ", ".join(f"{k} {v}" for k, v in dropped.items()) if dropped else "none"


def format_loss(ours: LossFigures, random: LossFigures) -> str:
    rows = [
        ["std of windowed loss", f"{ours.windowed_std:.4f}", f"{random.windowed_std:.4f}"],
        [
            "longest streak above mean",
            str(ours.longest_above_mean_streak),
            str(random.longest_above_mean_streak),
        ],
        ["windows (2 steps each)", str(ours.windows), str(random.windows)],
    ]
    return "simulated loss (bucket levels + noise, mean over ranks, windows of 2 steps)\n" + table(
        ["figure", "ladle", "random"], rows
    )
