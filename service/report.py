"""How the per-bucket table reads, in one place: ``ladle plan``, ``ladle inspect`` and the page.

The three show the same row with the same rounding, so a number on the page
can be checked against the terminal and against ``/v1/jobs/{job}/buckets``.
"""

from __future__ import annotations

from typing import Final

from .schedule.stats import BucketRow

__all__ = ["BUCKET_HEADER", "bucket_cells", "ratio_cell"]

BUCKET_HEADER: Final = (
    "bucket",
    "lengths",
    "samples",
    "% samples",
    "avg len",
    "max len",
    "rows/batch",
    "batches",
    "% batches",
    "pad eff",
)


def bucket_cells(row: BucketRow) -> list[str]:
    """One bucket's row of the table, as text (the columns of ``BUCKET_HEADER``)."""
    return [
        str(row.bucket),
        f"[{row.lo}, {row.hi})",
        str(row.samples),
        f"{row.pct_samples:.1f}%",
        f"{row.avg_len:.0f}",
        str(row.max_len),
        f"{row.rows_per_batch:.1f}",
        str(row.batches),
        f"{row.pct_batches:.1f}%",
        f"{row.padding_efficiency:.3f}",
    ]


def ratio_cell(ratio: float | None) -> str:
    """A figure read as a multiple (the batch-mates' ``1.01x``), ``-`` when there is none."""
    return "-" if ratio is None else f"{ratio:.2f}x"
