"""The HTTP API's response bodies (pydantic); the OpenAPI document is generated from them.

The per-bucket rows, quality figures and simulated-loss figures are the
dataclasses of ``ladle.service.schedule.stats`` themselves, so the API and
``ladle plan --json`` cannot drift apart.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field

from ..schedule import ScheduleConfig
from ..schedule.stats import BucketRow, LossFigures, Quality

__all__ = [
    "BatchInfo",
    "BucketReport",
    "CursorReport",
    "DatasetInfo",
    "ErrorBody",
    "Health",
    "JobDetail",
    "JobList",
    "JobSummary",
    "PositionModel",
    "QualityReport",
    "RankCursor",
    "Readiness",
    "ResizeModel",
    "SchedulePage",
    "StoreCheck",
]


class ErrorBody(BaseModel):
    """Every refusal of a request (4xx) and every server failure (5xx)."""

    detail: str = Field(description="what was wrong, in words")
    kind: str = Field(
        description="invalid_argument, not_found, failed_precondition, unavailable, "
        "resource_exhausted or internal"
    )
    field: str | None = Field(default=None, description="the parameter or option at fault, if one is")


class Health(BaseModel):
    status: Literal["ok"] = "ok"


class DatasetInfo(BaseModel):
    path: str
    rows: int
    fingerprint: str
    columns: str = Field(
        description="the columns served: the token ids and the loss mask's source (loss_mask, labels or none)"
    )


class StoreCheck(BaseModel):
    ok: bool
    store: str = Field(description="the cursor store (its file, or its Redis URL without the password)")
    error: str | None = None


class Readiness(BaseModel):
    ready: bool
    dataset: DatasetInfo
    dataset_ok: bool
    store: StoreCheck


class PositionModel(BaseModel):
    """A rank's cursor: it has consumed every batch before (epoch, step)."""

    epoch: int
    step: int


class ResizeModel(BaseModel):
    """One elastic resize: the world size before it and where each of its ranks stood."""

    world_size: int
    cut: list[PositionModel]


class JobSummary(BaseModel):
    job: str
    world_size: int
    served: bool = Field(
        description="the job runs on this server's dataset and config (its schedule is shown)"
    )
    dataset_fingerprint: str
    config_fingerprint: str
    epoch: int = Field(description="the epoch of the slowest rank")
    min_position: PositionModel
    max_position: PositionModel
    created: float = Field(description="unix time")
    updated: float = Field(description="unix time of the last cursor change")
    incarnation: str
    resizes: int


class JobList(BaseModel):
    dataset: DatasetInfo
    config_fingerprint: str
    jobs: list[JobSummary] = Field(description="at most `limit` jobs, by name, after `after`")
    total: int = Field(description="jobs in the store")
    next_after: str | None = Field(description="pass as `after` for the next page; None on the last")


class JobDetail(JobSummary):
    schedule_fingerprint: str | None = Field(description="None when the job is not served here")
    config: ScheduleConfig | None = Field(description="the schedule config (None when not served here)")
    steps_per_epoch: int | None = Field(description="steps of the slowest rank's epoch")
    progress: float | None = Field(description="share of that epoch the slowest rank has consumed")
    resize_history: list[ResizeModel]


class BucketReport(BaseModel):
    job: str
    epoch: int
    world_size: int
    interleave: str
    num_steps: int
    bucket_bounds: list[int]
    padding_efficiency: float
    dropped: dict[str, int]
    buckets: list[BucketRow] = Field(description="the same rows as `ladle plan --json`'s buckets")


class BatchInfo(BaseModel):
    step: int
    rank: int
    bucket: int
    rows: int
    padded_len: int
    real_tokens: int
    padded_tokens: int
    samples: list[int] | None = Field(default=None, description="row indices, with include=samples")


class SchedulePage(BaseModel):
    job: str
    epoch: int
    world_size: int
    interleave: str
    num_steps: int
    start: int
    limit: int = Field(description="steps this page may hold (the request's limit, lowered by the batch cap)")
    rank: int | None
    next_start: int | None = Field(description="the start of the next page; None after the last")
    batches: list[BatchInfo]


class QualityReport(BaseModel):
    job: str
    epoch: int
    world_size: int
    interleave: str
    quality: Quality
    simulated_loss: LossFigures


class RankCursor(BaseModel):
    rank: int
    epoch: int
    step: int
    steps_in_epoch: int
    progress: float = Field(description="share of its epoch this rank has consumed")
    lag_steps: int = Field(description="steps behind the leading rank")
    generation: int = Field(description="the fencing token of the trainer process holding the rank")
    last_seen: float | None = Field(
        description="unix time of its last join or cursor change; null: no trainer joined it (generation 0)"
    )
    seen_ago_s: float | None = Field(description="seconds since `last_seen`; null: never seen")


class CursorReport(BaseModel):
    job: str
    world_size: int
    schedule_fingerprint: str
    leader: PositionModel
    ranks: list[RankCursor]
    updated: float
    now: float
