"""The epoch schedule: length buckets, token-budget packing, interleaving.

Pure and importable offline::

    from ladle.service.schedule import ScheduleConfig, build_schedule
    sched = build_schedule(lengths, ScheduleConfig(), epoch=0, world_size=8)
    sched.samples(step=0, rank=3)
    quality(sched).padding_efficiency, bucket_table(sched), simulate_loss(sched)

Nothing here imports network, store or web code.
"""

from .config import ALGORITHM_VERSION, PRODUCTION_BOUNDS, ScheduleConfig
from .interleave import run_lower_bound
from .schedule import (
    Cut,
    Dropped,
    Schedule,
    bucket_edges,
    build_schedule,
    cut_samples,
    resolve_bounds,
)
from .stats import (
    BucketRow,
    LossFigures,
    Quality,
    bucket_table,
    loss_figures,
    quality,
    simulate_loss,
    summary,
)

__all__ = [
    "ALGORITHM_VERSION",
    "PRODUCTION_BOUNDS",
    "BucketRow",
    "Cut",
    "Dropped",
    "LossFigures",
    "Quality",
    "Schedule",
    "ScheduleConfig",
    "bucket_edges",
    "bucket_table",
    "build_schedule",
    "cut_samples",
    "loss_figures",
    "quality",
    "resolve_bounds",
    "run_lower_bound",
    "simulate_loss",
    "summary",
]
