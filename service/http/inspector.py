"""What the HTTP face shows about jobs: schedules, tables, figures and cursors, cached.

Schedules come from each ``Job``'s own cache, the one the gRPC streams use, so
inspecting a running job builds nothing twice. A job's random-shuffle baseline
is a ``Job`` of the same config with ``interleave="random"``; the per-batch
table and the figures derived from a schedule are kept for a few recent
(schedule, epoch) pairs. Every figure comes from ``ladle.service.schedule.stats``,
as ``ladle plan`` computes it. The methods block (a schedule of a big dataset
takes about a second): call them off an event loop.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Final, Literal, TypeVar

import numpy as np
import numpy.typing as npt

from ..errors import AlgorithmVersionError, ConfigError, JobMismatchError, LadleError
from ..jobs import Job, JobRegistry
from ..readiness import Readiness
from ..schedule import Schedule
from ..schedule.stats import BucketRow, LossFigures, Quality, bucket_table, quality, simulate_loss
from ..standing import JobStanding, standing
from ..store.base import JobState, Position

__all__ = [
    "DEFAULT_PAGE_STEPS",
    "MAX_PAGE_BATCHES",
    "MAX_PAGE_BATCHES_WITH_SAMPLES",
    "MAX_PAGE_STEPS",
    "PREVIEW_WORLD_SIZE",
    "BatchTable",
    "Inspector",
    "Interleave",
    "JobNotServedError",
    "page_steps",
]

Interleave = Literal["stride", "random"]
I64 = npt.NDArray[np.int64]
T = TypeVar("T")

# A schedule page holds at most MAX_PAGE_STEPS steps and MAX_PAGE_BATCHES batches
# (fewer with row indices); a shortened page says where to go on in next_start.
DEFAULT_PAGE_STEPS: Final = 200
MAX_PAGE_STEPS: Final = 1000
MAX_PAGE_BATCHES: Final = 4096
MAX_PAGE_BATCHES_WITH_SAMPLES: Final = 1024
# The world size the page shows a dataset's schedule for when no job exists yet.
PREVIEW_WORLD_SIZE: Final = 8


class JobNotServedError(JobMismatchError):
    """A job of another dataset or schedule config than this server's: it cannot derive its schedule.

    The HTTP face's words for the store's ``JobMismatchError`` (same ``kind``,
    a 409): nothing is resumed on a read, and the job may be healthy on its own
    servers, so the advice is to look at it there, not to delete it.
    """

    def __init__(self, job: str, differences: tuple[tuple[str, str, str], ...]) -> None:
        self.job = job
        self.differences = differences
        detail = "; ".join(f"{f}: the job's {old!r}, this server's {new!r}" for f, old, new in differences)
        LadleError.__init__(
            self,
            f"job {job!r} runs on another dataset or schedule config than this server serves ({detail}), "
            "so this server cannot derive its schedule: inspect it on a server started with the job's "
            "dataset and config (the one its trainers connect to)",
        )


@dataclass(frozen=True)
class BatchTable:
    """Per-batch figures of one epoch, each ``[num_steps, world_size]``."""

    buckets: I64
    rows: I64
    padded_len: I64
    real_tokens: I64

    @property
    def padding_efficiency(self) -> float:
        padded = int((self.rows * self.padded_len).sum())
        return round(int(self.real_tokens.sum()) / padded, 4) if padded else 0.0


def page_steps(ranks: int, limit: int = DEFAULT_PAGE_STEPS, *, samples: bool = False) -> int:
    """The steps a page of ``ranks`` ranks holds: ``limit``, lowered so it stays under the batch cap."""
    cap = MAX_PAGE_BATCHES_WITH_SAMPLES if samples else MAX_PAGE_BATCHES
    return max(1, min(limit, cap // max(ranks, 1)))


class _Memo:
    """A small thread-safe LRU of computed values (two threads may compute one value; both agree)."""

    def __init__(self, size: int) -> None:
        self._size = size
        self._items: OrderedDict[tuple[Any, ...], Any] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: tuple[Any, ...], make: Callable[[], T]) -> T:
        with self._lock:
            if key in self._items:
                self._items.move_to_end(key)
                value: T = self._items[key]
                return value
        value = make()
        with self._lock:
            self._items[key] = value
            while len(self._items) > self._size:
                self._items.popitem(last=False)
        return value


class Inspector:
    """Read-only views of the jobs one server serves (thread-safe)."""

    def __init__(self, registry: JobRegistry, readiness: Readiness | None = None) -> None:
        self.registry = registry
        self.dataset = registry.dataset
        self.config = registry.config
        self.store = registry.store
        self._jobs = _Memo(8)  # previews, random baselines and jobs no stream has opened here
        self._figures = _Memo(32)
        # one listing of the store's jobs at a time, shared by the requests that wait for it
        self._listing = threading.Condition()
        self._listing_busy = False
        self._listing_round = 0
        self._listed: list[JobState] | BaseException = []
        # the server's own check when it has one (one store ping at a time for both faces)
        self.readiness = readiness if readiness is not None else Readiness(registry.dataset, registry.store)

    # --- jobs ---

    def job_states(self) -> list[JobState]:
        """Every job in the store; requests that come while one lists them share its listing.

        A store of thousands of jobs takes most of a second to list, holding
        Python's lock that the trainers' streams need too: a dozen page and
        ``/v1/jobs`` requests at once made a dozen listings, and the streams
        slowed to a tenth. Now they make one (its error, if it fails, is
        theirs too).
        """
        with self._listing:
            if self._listing_busy:
                waited_for = self._listing_round
                while self._listing_round == waited_for:
                    self._listing.wait()
                listed = self._listed
                if isinstance(listed, BaseException):
                    raise listed
                return listed
            self._listing_busy = True
        result: list[JobState] | BaseException = []
        try:
            result = self.store.list_jobs()
            return result
        except BaseException as exc:
            result = exc
            raise
        finally:
            with self._listing:
                self._listed = result
                self._listing_busy = False
                self._listing_round += 1
                self._listing.notify_all()

    def state(self, name: str) -> JobState:
        """The stored job (``JobNotFoundError`` if there is none)."""
        return self.store.get(name)

    def served(self, state: JobState) -> bool:
        """Whether this server's dataset and config are the job's (so it can derive the schedule)."""
        return (state.spec.dataset_fingerprint, state.spec.config_fingerprint) == (
            self.dataset.fingerprint,
            self.config.fingerprint(),
        )

    def job(self, state: JobState) -> Job:
        """The job as the gRPC face serves it (``JobMismatchError`` if this server cannot serve it).

        A job no stream of this server has opened is kept here among a few
        recent ones, so its schedules are built once however often it is shown.
        """
        try:
            job = self.registry.view(state)
        except AlgorithmVersionError:
            raise  # its own words: planned by an earlier algorithm, what to do (a 409 too)
        except JobMismatchError as exc:
            raise JobNotServedError(exc.job, exc.differences) from None
        if self.registry.get(state.job) is job:
            return job
        return self._jobs.get(("view", state.job, job.fingerprint, state.incarnation), lambda: job)

    def preview(self, world_size: int = PREVIEW_WORLD_SIZE) -> Job:
        """The schedule a new job of ``world_size`` ranks would follow (no store entry)."""
        if not 1 <= world_size <= 1024:
            raise ConfigError("world_size", f"must be in 1..1024, got {world_size}")
        job = Job("preview", self.dataset, self.config, world_size, self.store, cache=self.registry.schedules)
        return self._jobs.get(("job", job.fingerprint), lambda: job)

    def variant(self, job: Job, interleave: Interleave | None) -> Job:
        """``job`` itself, or the same job with another interleaving (``random``: the naive baseline)."""
        if interleave is None or interleave == job.config.interleave:
            return job
        config = job.config.replace(interleave=interleave)
        other = Job(job.name, job.dataset, config, job.world_size, job.store, plan=job.plan, cache=job.cache)
        return self._jobs.get(("job", other.fingerprint), lambda: other)

    def slowest(self, job: Job, state: JobState | None) -> Position:
        """The slowest rank's position, normalised (``(0, 0)`` for a preview)."""
        if state is None or not state.ranks:
            return Position(0, 0)
        return min(job.normalise(r.position) for r in state.ranks)

    def epoch_of(self, job: Job, state: JobState | None) -> int:
        """The epoch the slowest rank is in (0 for a preview)."""
        return self.slowest(job, state).epoch

    # --- one epoch of a job ---

    def schedule(self, job: Job, epoch: int) -> Schedule:
        return job.schedule(epoch)

    def table(self, job: Job, epoch: int) -> BatchTable:
        def make() -> BatchTable:
            sched = job.schedule(epoch)
            return BatchTable(
                sched.buckets,
                sched.batch_rows(),
                sched.batch_padded_len(),
                sched.batch_real_tokens(),
            )

        return self._figures.get(("table", job.fingerprint, epoch), make)

    def buckets(self, job: Job, epoch: int) -> list[BucketRow]:
        return self._figures.get(
            ("buckets", job.fingerprint, epoch), lambda: bucket_table(job.schedule(epoch))
        )

    def quality(self, job: Job, epoch: int, *, again: bool = True) -> Quality:
        """The epoch's figures; the batch-mates that meet again need the next epoch's schedule too.

        ``again=False`` leaves that figure out and builds no next epoch (the
        page's random baseline: its batches are ladle's, only their order differs).
        """

        def make() -> Quality:
            sched = job.schedule(epoch)
            return quality(sched, job.schedule(epoch + 1) if again else None)

        return self._figures.get(("quality", job.fingerprint, epoch, again), make)

    def loss(self, job: Job, epoch: int) -> LossFigures:
        return self._figures.get(("loss", job.fingerprint, epoch), lambda: simulate_loss(job.schedule(epoch)))

    def page(
        self,
        job: Job,
        epoch: int,
        *,
        start: int = 0,
        limit: int = DEFAULT_PAGE_STEPS,
        rank: int | None = None,
        samples: bool = False,
        ranks: range | None = None,
    ) -> dict[str, Any]:
        """Steps ``start..`` of an epoch: every batch's figures, step-major, for a ``rank``, ``ranks`` or all.

        A page holds at most ``limit`` steps and at most ``MAX_PAGE_BATCHES``
        batches (``MAX_PAGE_BATCHES_WITH_SAMPLES`` with row indices);
        ``next_start`` is the first step of the next page, None after the last.
        A ``start`` at or past the end gives an empty page.
        """
        if rank is not None and not 0 <= rank < job.world_size:
            raise ConfigError(
                "rank", f"{rank} is outside 0..{job.world_size - 1} (world_size={job.world_size})"
            )
        if rank is not None:
            ranks = range(rank, rank + 1)
        elif ranks is None:
            ranks = range(job.world_size)
        if not 1 <= limit <= MAX_PAGE_STEPS:
            raise ConfigError("limit", f"must be in 1..{MAX_PAGE_STEPS}, got {limit}")
        if start < 0:
            raise ConfigError("start", f"must be >= 0, got {start}")
        table = self.table(job, epoch)
        num_steps = int(table.buckets.shape[0])
        steps = page_steps(len(ranks), limit, samples=samples)
        first = min(start, num_steps)
        stop = min(num_steps, first + steps)
        cols = np.asarray(ranks, dtype=np.int64)
        grid = np.arange(first, stop, dtype=np.int64)
        step_ids = np.repeat(grid, len(ranks)).tolist()
        rank_ids = np.tile(cols, len(grid)).tolist()
        rows = table.rows[first:stop][:, cols].ravel()
        padded_len = table.padded_len[first:stop][:, cols].ravel()
        columns = zip(
            step_ids,
            rank_ids,
            table.buckets[first:stop][:, cols].ravel().tolist(),
            rows.tolist(),
            padded_len.tolist(),
            table.real_tokens[first:stop][:, cols].ravel().tolist(),
            (rows * padded_len).tolist(),
            strict=True,
        )
        keys = ("step", "rank", "bucket", "rows", "padded_len", "real_tokens", "padded_tokens")
        batches = [dict(zip(keys, values, strict=True)) for values in columns]
        if samples and batches:
            sched = job.schedule(epoch)
            for batch in batches:
                batch["samples"] = sched.samples(batch["step"], batch["rank"]).tolist()
        return {
            "epoch": epoch,
            "world_size": job.world_size,
            "interleave": job.config.interleave,
            "num_steps": num_steps,
            "start": start,
            "limit": steps,
            "rank": rank,
            "next_start": stop if stop < num_steps else None,
            "batches": batches,
        }

    # --- where the ranks stand ---

    def cursor(self, job: Job, state: JobState) -> dict[str, Any]:
        """Each rank's position (normalised), progress through its epoch, and lag behind the leader."""
        return self.report(standing(job, state))

    @staticmethod
    def report(now: JobStanding) -> dict[str, Any]:
        """``now`` as ``/cursor`` answers it.

        ``last_seen`` and ``seen_ago_s`` are None for a rank no trainer has
        joined yet (generation 0): a trainer that died at start-up shows as never seen.
        """
        job = now.job
        ranks = [
            {
                "rank": r.rank,
                "epoch": r.position.epoch,
                "step": r.position.step,
                "steps_in_epoch": r.steps_in_epoch,
                "progress": round(r.position.step / r.steps_in_epoch, 4) if r.steps_in_epoch else 1.0,
                "lag_steps": r.lag_steps,
                "generation": r.generation,
                # the store's last_seen of a rank no trainer ever joined is the job's creation time
                "last_seen": r.last_seen if r.joined else None,
                "seen_ago_s": r.seen_ago_s if r.joined else None,
            }
            for r in now.ranks
        ]
        return {
            "job": job.name,
            "world_size": job.world_size,
            "schedule_fingerprint": job.fingerprint,
            "leader": {"epoch": now.leader.epoch, "step": now.leader.step},
            "ranks": ranks,
            "updated": now.updated,
            "now": now.now,
        }

    # --- readiness ---

    def dataset_ok(self) -> bool:
        """The dataset's folder and files are as they were when the server opened them."""
        return self.readiness.dataset_ok()

    def store_error(self) -> str | None:
        """Why the cursor store cannot be used now, or None when it answers (within ``STORE_ANSWER_S``)."""
        return self.readiness.store_error()
