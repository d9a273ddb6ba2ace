"""A job: one training run's schedule, cursor and fencing on top of a store.

A job is named by its trainers. Its identity (dataset fingerprint, schedule
config hash, world size) is stored the first time it is opened; a server on
another dataset or config is refused with an error naming what differs. The
schedule of every epoch is derived (``build_schedule``) and cached, never
stored: the state in the store is a few integers per rank.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Final

import numpy as np
import numpy.typing as npt

from .dataset import TokenDataset
from .errors import (
    AlgorithmVersionError,
    CheckpointMismatchError,
    CheckpointPositionError,
    ConfigError,
    JobMismatchError,
    JobNotFoundError,
    LadleError,
    ScheduleError,
    WorldSizeMismatchError,
)
from .lease import AlignedStarts, Claim, RankLease, StreamAbortedError, placed
from .limits import MAX_SCHEDULES, SPARE_SCHEDULES
from .schedule import ALGORITHM_VERSION, Dropped, Schedule, ScheduleConfig, bucket_edges, build_schedule
from .schedule_cache import (
    BUILD_WAIT_S,
    COLD_WAIT_S,
    HOT_SECONDS,
    MAX_COLD_WAITING,
    ScheduleCache,
    ScheduleLease,
)
from .start import HotPositions, Opening, StartDecision, decide_start
from .store.base import (
    MAX_INDEX,
    CursorStore,
    JobSpec,
    JobState,
    Position,
    RankState,
    Resize,
    check_identity,
    plan_to_json,
    resize_start,
)

log = logging.getLogger("ladle.server")

__all__ = [
    "BUILD_WAIT_S",
    "COLD_WAIT_S",
    "HOT_SECONDS",
    "KNOWN_JOBS",
    "MAX_COLD_WAITING",
    "MAX_SCHEDULES",
    "SPARE_SCHEDULES",
    "BatchRef",
    "Job",
    "JobRegistry",
    "ScheduleCache",
    "ScheduleLease",
    "plan_schedule",
    "schedule_fingerprint",
]

# Jobs a server remembers (JobRegistry): the most recently opened, about 0.5 KiB each. A job
# forgotten is read from the store again when a trainer opens it; only a job that both this
# server forgot and the store lost is created again as new rather than restored.
KNOWN_JOBS: Final = 10_000


def schedule_fingerprint(
    dataset_fp: str,
    config_fp: str,
    world_size: int,
    plan: tuple[Resize, ...] = (),
    algorithm_version: int = ALGORITHM_VERSION,
) -> str:
    """Names the schedule every epoch of a job follows (changes with any input, resize or the algorithm)."""
    text = f"ladle-schedule:v{algorithm_version}:{dataset_fp}:{config_fp}:{world_size}"
    if plan:
        text += ":resized:" + plan_to_json(plan)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _merge(a: Dropped, b: Dropped) -> Dropped:
    reasons = {**a.by_reason}
    for reason, rows in b.by_reason.items():
        reasons[reason] = np.concatenate([reasons[reason], rows]) if reason in reasons else rows
    return Dropped(MappingProxyType(reasons))


def plan_schedule(
    lengths: npt.NDArray[np.integer],
    config: ScheduleConfig,
    epoch: int,
    world_size: int,
    plan: tuple[Resize, ...] = (),
    bounds: tuple[int, ...] | None = None,
) -> Schedule:
    """The schedule of ``epoch`` for a job whose world size changed along ``plan`` (guarantee 7).

    Without a resize it is ``build_schedule``. Each resize re-plans the epoch
    it cuts through: the rows the old world had not consumed when it stopped
    (each old rank up to its own position in the cut) are scheduled afresh,
    deterministically, for the new world size, with the epoch's bucket edges.
    An epoch the old world had finished keeps its schedule (history: no new
    rank is ever in it); an epoch it had not begun is planned for the new
    world as usual. A remainder too small to give every new rank a batch is
    dropped and reported (``Dropped`` reason ``remainder``), like any other.
    ``bounds``: the edges ``config`` resolves for ``lengths`` (``bucket_edges``), if known.
    """
    sizes = [r.world_size for r in plan] + [world_size]
    sched = build_schedule(lengths, config, epoch=epoch, world_size=sizes[0], bounds=bounds)
    bounds = tuple(sched.bounds)
    replanned = False
    for resize, size in zip(plan, sizes[1:], strict=True):
        steps = np.array(
            [sched.num_steps if p.epoch > epoch else p.step if p.epoch == epoch else 0 for p in resize.cut],
            dtype=np.int64,
        )
        if (steps >= sched.num_steps).all():
            continue  # the old world finished this epoch
        rows: npt.NDArray[np.int64] | None = None
        if steps.any():
            rows = np.setdiff1d(sched.scheduled_rows(), sched.rows_before(steps))
        elif replanned:
            rows = np.sort(sched.scheduled_rows())
        prior = sched.dropped
        if rows is None:
            sched = build_schedule(lengths, config, epoch=epoch, world_size=size, bounds=bounds)
            continue
        try:
            sched = build_schedule(lengths, config, epoch=epoch, world_size=size, rows=rows, bounds=bounds)
        except ScheduleError:  # fewer rows left than one step needs
            sched = Schedule.empty(
                config, epoch, size, bounds, len(lengths), Dropped(MappingProxyType({"remainder": rows}))
            )
        sched.dropped = _merge(prior, sched.dropped)
        replanned = True
    return sched


def _edges(dataset: TokenDataset, config: ScheduleConfig, cache: ScheduleCache) -> tuple[int, ...]:
    """The bucket edges of every schedule of ``dataset`` under ``config``, kept in ``cache`` once resolved.

    Raises what ``bucket_edges`` raises: a config the dataset cannot be scheduled with.
    """
    return cache.edges(
        (dataset.fingerprint, config.fingerprint()), lambda: bucket_edges(dataset.lengths, config)
    )


@dataclass(frozen=True)
class BatchRef:
    """Where one batch comes from: its position and the rows to assemble."""

    epoch: int
    step: int
    rank: int
    bucket: int
    rows: npt.NDArray[np.int64]
    padded_len: int
    steps_in_epoch: int

    @property
    def next(self) -> Position:
        """The position after this batch (step 0 of the next epoch after the last step)."""
        if self.step + 1 < self.steps_in_epoch:
            return Position(self.epoch, self.step + 1)
        return Position(self.epoch + 1, 0)


class Job:
    """One job's schedules and cursor operations (thread-safe).

    Its schedules live in ``cache`` (the registry's, shared by every job of a
    server; a cache of its own if none is given). ``hot=True`` marks a use by
    a trainer's stream, which keeps a schedule cached while it is in use.
    """

    def __init__(
        self,
        name: str,
        dataset: TokenDataset,
        config: ScheduleConfig,
        world_size: int,
        store: CursorStore,
        *,
        plan: tuple[Resize, ...] = (),
        incarnation: str = "",
        cache: ScheduleCache | None = None,
    ) -> None:
        self.name = name
        self.dataset = dataset
        self.config = config
        self.world_size = world_size
        self.store = store
        self.plan = plan
        self.incarnation = incarnation
        self.spec = JobSpec(name, dataset.fingerprint, config.fingerprint(), world_size)
        self.fingerprint = schedule_fingerprint(dataset.fingerprint, config.fingerprint(), world_size, plan)
        self.cache = cache if cache is not None else ScheduleCache()

    def schedule(self, epoch: int, *, hot: bool = False) -> Schedule:
        """The schedule of ``epoch``, built once however many streams and requests ask at the same time.

        ``hot``: a stream's use (see ``ScheduleCache``); a request that only
        inspects may get ``ScheduleBusyError`` while other inspection builds run.
        """
        key = (self.fingerprint, epoch)
        sched = self.cache.cached(key, hot=hot)  # once a batch: no closure made when it is kept
        if sched is None:
            sched = self.cache.get(key, lambda: self._plan(epoch), hot=hot)
        return sched

    def edges(self) -> tuple[int, ...]:
        """The bucket edges of every epoch of this job (resolved once for all the cache's jobs)."""
        return _edges(self.dataset, self.config, self.cache)

    def _plan(self, epoch: int) -> Schedule:
        sched = plan_schedule(
            self.dataset.lengths, self.config, epoch, self.world_size, self.plan, self.edges()
        )
        counts = sched.dropped.counts
        if counts:  # rows no rank will see this epoch: said where the operator looks, not only in the API
            lost = counts.get("remainder", 0)
            log.log(
                logging.WARNING if lost else logging.INFO,
                "job %s epoch %d: %d of %d rows left out of the epoch (%s)%s",
                self.name,
                epoch,
                sum(counts.values()),
                self.dataset.num_rows,
                ", ".join(f"{reason} {n}" for reason, n in sorted(counts.items())),
                f"; {lost} rows could not fill a step on every rank (remainder={self.config.remainder!r} "
                "drops them when splitting cannot place them)"
                if lost
                else "",
            )
        return sched

    def has_schedule(self, epoch: int) -> bool:
        return self.cache.has((self.fingerprint, epoch))

    def warm(self, epoch: int) -> None:
        """Build ``epoch``'s schedule in the background, so streams do not pause at the boundary."""
        self.cache.warm((self.fingerprint, epoch), lambda: self._plan(epoch))

    def steps(self, epoch: int, *, hot: bool = False) -> int:
        return self.schedule(epoch, hot=hot).num_steps

    def normalise(self, position: Position, *, hot: bool = False) -> Position:
        """The position ``(epoch, steps in epoch)`` is the start of the next epoch; others are as given.

        A step beyond the epoch's end comes from no trainer of this job (a
        position from another job or world size, or a bad checkpoint): it
        raises ``ConfigError`` instead of being carried into later epochs,
        which would build one schedule per epoch it crosses.
        """
        epoch, step = position.epoch, position.step
        steps = self.steps(epoch, hot=hot)
        if step <= steps:
            while step >= steps:  # the end of an epoch (or an empty one, which a resize can leave)
                epoch, step = epoch + 1, 0
                steps = self.steps(epoch, hot=hot)
            return Position(epoch, step)
        raise ConfigError(
            "step",
            f"position (epoch {position.epoch}, step {position.step}) is beyond the end of epoch "
            f"{position.epoch}, which has {steps} steps in job {self.name!r} "
            f"(world size {self.world_size}): not a position of this job",
        )

    def batch(self, position: Position, rank: int) -> BatchRef:
        """The batch of ``rank`` at ``position``; from the middle of an epoch on, the next epoch's
        schedule is built (or being built) in the background, and at its start already, so no stream
        waits for a build at the boundary: a stream that starts past the middle (a trainer resumed
        there, or a restarted server) prepares it on its first batch."""
        sched = self.schedule(position.epoch, hot=True)
        if position.step == 0 or position.step >= sched.num_steps // 2:
            self.warm(position.epoch + 1)  # a look-up once it is kept
        rows, padded_len, bucket = sched.batch(position.step, rank)
        return BatchRef(
            epoch=position.epoch,
            step=position.step,
            rank=rank,
            bucket=bucket,
            rows=rows,
            padded_len=padded_len,
            steps_in_epoch=sched.num_steps,
        )

    def is_stored_as(self, state: JobState) -> bool:
        """True if ``state`` is this job as it was built: same world size, resize history and incarnation."""
        return (self.world_size, self.plan, self.incarnation) == (
            state.spec.world_size,
            state.plan,
            state.incarnation,
        )

    @property
    def previous_fingerprint(self) -> str | None:
        """The schedule fingerprint of this job before its latest resize (None if never resized)."""
        return self.before_resize().fingerprint if self.plan else None

    def translate(self, fingerprint: str, position: Position) -> Position | None:
        """Where a checkpoint of the world before the latest resize continues, or None if it cannot.

        A checkpoint taken at the cut (every rank of a DDP job saves the same
        step, and the resize was cut there) continues at the start of the
        re-planned rest of the epoch.
        """
        if fingerprint != self.previous_fingerprint:
            return None
        cut = self.plan[-1].cut
        try:  # a checkpoint on an epoch's last batch says (e, steps): the cut holds it as (e + 1, 0)
            position = self.before_resize().normalise(position, hot=True)
        except ConfigError:
            return None
        if any(p != position for p in cut):
            return None
        return resize_start(cut)

    def before_resize(self) -> Job:
        """This job as it was before its latest resize (its world size and resize history then)."""
        if not self.plan:
            raise ValueError(f"job {self.name!r} was never resized")
        return Job(
            self.name,
            self.dataset,
            self.config,
            self.plan[-1].world_size,
            self.store,
            plan=self.plan[:-1],
            incarnation=self.incarnation,
            cache=self.cache,
        )

    def state(self) -> JobState:
        return self.store.get(self.name)


class JobRegistry:
    """The jobs one server serves: one dataset and config, any number of named jobs."""

    def __init__(
        self,
        dataset: TokenDataset,
        config: ScheduleConfig,
        store: CursorStore,
        *,
        spare: int = SPARE_SCHEDULES,
        max_schedules: int = MAX_SCHEDULES,
        schedules_per_client: int | None = None,
    ) -> None:
        self.dataset = dataset
        self.config = config
        self.store = store
        self._jobs: OrderedDict[str, Job] = OrderedDict()  # least recently opened first
        self._known = KNOWN_JOBS
        self._lock = threading.Lock()
        self.schedules = ScheduleCache(spare, most=max_schedules, per_client=schedules_per_client)
        self.aligned = AlignedStarts()

    def edges(self) -> tuple[int, ...]:
        """The bucket edges of this server's schedules, resolved once, with the config checked against the
        dataset (``bucket_edges``): a server calls it at start-up so that a bad config fails there."""
        return _edges(self.dataset, self.config, self.schedules)

    def attach(self, claim: Claim) -> RankLease:
        """Join ``claim``'s rank as a new trainer process and place it: the lease its stream holds.

        The job is opened (created, or resized if ``claim.elastic``), the
        claim's checkpoint placed in its schedule, then the rank joined (a new
        generation, which fences the rank's earlier process) and positioned by
        ``decide_start``. Store operations: a read and the join, and one of a
        create, a resize, a rewind or a reconcile (two for a job the store
        lost that a trainer resumes). Every refusal that does not depend on the
        join comes before it.
        """
        job, state = self._open_for(claim)
        given = placed(job, claim)
        opening = Opening(job.name, claim.rank, given, claim.own_cursor, claim.resume)
        joined = self.store.join(job.name, claim.rank, job.world_size)
        # a start at the job's cursor decides on the ranks as read before the join: the rank's own
        # entry then still says when it last moved, which tells its earlier stream from a stale cursor
        decision = self._decide(job, opening, joined, state.ranks if opening.aligned else ())
        start = decision.start
        if decision.aligned:
            self.aligned.remember(job.name, claim.rank, joined, start)
        notes = decision.notes
        try:
            if decision.refusal:
                raise StreamAbortedError(
                    "invalid_argument", "bad_resume", decision.refusal, "open.resume.generation"
                )
            if decision.reconcile is not None:
                joined = self.store.reconcile(job.name, claim.rank, decision.reconcile.generation, start)
                notes += (decision.reconcile.note,)
            elif decision.rewind and start != joined.position:  # equal: a write that changes nothing
                joined = self.store.rewind(job.name, claim.rank, joined.generation, start)
        except LadleError:
            for note in notes:  # decided before the refusal: said as an Open that succeeds says them
                log.log(note.level, "%s", note.message)
            raise
        return RankLease(job, claim.rank, joined.generation, start, joined.position, notes, self.aligned)

    def _open_for(self, claim: Claim) -> tuple[Job, JobState]:
        """The job ``claim`` opens and its state before the rank joins: one store read, and a store
        write only to create the job (as ``open`` does) or to resize it."""
        name, world_size = claim.job, claim.world_size
        spec = JobSpec(name, self.dataset.fingerprint, self.config.fingerprint(), world_size)
        known = self.get(name)
        state: JobState | None
        try:
            state = self.store.get(name)
        except JobNotFoundError:
            state = None
        try:
            if state is not None:
                check_identity(state.spec, spec)
            else:
                if known is None:
                    if claim.fingerprint is not None:
                        self._refuse_unrestorable(name, world_size, claim.fingerprint)
                    self._build_first(name, world_size)
                state = self.store.open_job(
                    spec,
                    incarnation=(known.incarnation or None) if known else None,
                    plan=known.plan if known else (),
                )
        except JobMismatchError as exc:
            raise self._explained(exc) from None
        except WorldSizeMismatchError as exc:
            if not claim.elastic:
                raise
            state = self._resize(name, exc.stored, world_size, claim.checkpoint, state)
        return self._job_for(state), state

    def preview(
        self, name: str, world_size: int, epoch: int | None, rank: int | None = None, own_cursor: bool = False
    ) -> tuple[Job, int, Schedule]:
        """The job ``name``, the epoch described and its schedule (Describe; nothing joins).

        ``epoch`` None: the epoch of the job's slowest rank, or with ``rank``
        the epoch its stream would start in if it opened now with no
        checkpoint (as ``attach`` starts it). A job the store does not hold is
        ``JobNotFoundError`` unless ``world_size`` is given (0: not given):
        then it is the job a trainer of that world size would create, built
        here and stored nowhere, as an inspection builds (``ScheduleBusyError``
        when too many builds run: nothing a stream uses, so anyone asking for
        many world sizes holds no more schedules than the spare ones). An epoch
        other than the job's own is built the same way. ``ConfigError`` for
        an epoch or rank no Open would take (a rank is checked against the
        ``world_size`` asked for: an elastic restart's new rank may be beyond
        the stored job's).
        """
        if epoch is not None and epoch > MAX_INDEX:
            raise ConfigError("epoch", f"must be in 0..{MAX_INDEX}, got {epoch}")
        if rank is not None and world_size and rank >= world_size:
            raise ConfigError("rank", f"{rank} is outside 0..{world_size - 1} (world_size={world_size})")
        try:
            job = self.get(name)
            state = self.store.get(name)  # (a job this server knew may be gone from the store since)
            if job is None:
                self.view(state)  # refuses a job of another dataset or config
                job = self._job_for(state)
        except JobNotFoundError:
            if not world_size:
                raise
            job = self.unstored(name, world_size)
            at = 0 if epoch is None else epoch
            return job, at, job.schedule(at)
        current = min(r.position.epoch for r in state.ranks) if state.ranks else 0
        at = current if epoch is None else epoch
        mine = next((r for r in state.ranks if r.rank == rank), None) if epoch is None else None
        if mine is not None:  # where attach would start it (the job's cursor unless own_cursor)
            opening = Opening(job.name, mine.rank, own_cursor=own_cursor)
            at = self._decide(job, opening, mine, state.ranks, describe=True).start.epoch
        return job, at, job.schedule(at, hot=at == current)

    def _decide(
        self,
        job: Job,
        opening: Opening,
        joined: RankState,
        ranks: Sequence[RankState],
        *,
        describe: bool = False,
    ) -> StartDecision:
        """``decide_start`` with the other ranks' recent starts at the job's cursor this server began."""
        return decide_start(
            opening,
            joined=joined,
            ranks=ranks,
            aligned_starts=self.aligned.of_others(job.name, opening.rank, ranks),
            incarnation=job.incarnation,
            positions=HotPositions(job),
            describe=describe,
        )

    def open(
        self,
        name: str,
        world_size: int,
        *,
        reset: bool = False,
        elastic: bool = False,
        checkpoint: tuple[Position, str] | None = None,
    ) -> Job:
        """The job ``name`` as the store has it, registered with this server's identity if new.

        A job stored with another world size raises ``WorldSizeMismatchError``
        unless ``elastic``: then it is resized (``resize``) and the rest of the
        epoch re-planned. ``checkpoint`` is (position, schedule fingerprint) of
        the trainer asking; when it names the job's current schedule, the cut
        is that position for every old rank, else the stored cursors (refused,
        ``CheckpointMismatchError``, while an old rank's stored cursor is
        behind the checkpoint: ``_resize`` says why).
        A job that the store lost is created again with the incarnation and
        resize history this server knew of it.
        """
        if world_size < 1:
            raise ConfigError("world_size", f"must be at least 1, got {world_size}")
        spec = JobSpec(name, self.dataset.fingerprint, self.config.fingerprint(), world_size)
        known = self.get(name)
        restore = known is not None and not reset
        if known is None or reset:
            self._check_new(name, world_size)
        try:
            state = self.store.open_job(
                spec,
                reset=reset,
                incarnation=(known.incarnation or None) if restore and known else None,
                plan=known.plan if restore and known else (),
            )
        except JobMismatchError as exc:
            raise self._explained(exc) from None
        except WorldSizeMismatchError as exc:
            if not elastic:
                raise
            state = self._resize(name, exc.stored, world_size, checkpoint)
        return self._job_for(state)

    def _explained(self, exc: JobMismatchError) -> JobMismatchError:
        """``AlgorithmVersionError`` for a job of this very config planned by an earlier algorithm."""
        if exc.fields != ("config_fingerprint",) or isinstance(exc, AlgorithmVersionError):
            return exc
        stored = exc.differences[0][1]
        version = self.config.planned_by(stored)
        if version is None:
            return exc
        return AlgorithmVersionError(exc.job, version, ALGORITHM_VERSION, exc.differences)

    def check_restorable(self, name: str, world_size: int, fingerprint: str) -> None:
        """Refuse, before anything is stored, a client whose schedule a job created now would not be.

        A client that names a schedule (a loaded checkpoint, or a stream it is
        resuming) for a job neither the store nor this server knows would get
        a new job of the plain schedule, then be refused for following another:
        the job left behind would then refuse the client's checkpoint too. That
        happens when a resized job's history went with the store's data (a
        Redis without persistence) and the server that knew it restarted, or
        for a checkpoint of another dataset or config.
        """
        if self.get(name) is not None:
            return
        try:
            self.store.get(name)
            return
        except JobNotFoundError:
            pass
        self._refuse_unrestorable(name, world_size, fingerprint)

    def _refuse_unrestorable(self, name: str, world_size: int, fingerprint: str) -> None:
        """``check_restorable`` for a job neither the store nor this server knows."""
        plain = schedule_fingerprint(self.dataset.fingerprint, self.config.fingerprint(), world_size)
        for version in range(ALGORITHM_VERSION - 1, 0, -1):
            old = schedule_fingerprint(
                self.dataset.fingerprint, self.config.fingerprint(version), world_size, (), version
            )
            if fingerprint == old:
                raise CheckpointMismatchError(
                    f"this client's state is of job {name!r} as version {version} of ladle's schedule "
                    f"algorithm planned it; this server runs version {ALGORITHM_VERSION}, which orders "
                    "the same config's batches differently, so the position cannot be continued. Finish "
                    "the job with the ladle release that started it, or start it over without loading "
                    "the state. Nothing was stored"
                )
        if fingerprint != plain:
            raise CheckpointMismatchError(
                f"job {name!r} is not in the cursor store, and this client follows schedule {fingerprint}, "
                f"not {plain}, which a job created now would follow: a job that was resized, whose resize "
                "history went with the store's data (a Redis that lost everything while the servers that "
                "knew the job restarted), or a checkpoint of another dataset or config. Nothing was "
                "stored; resume the world from a checkpoint taken before the resize, or start a new job"
            )

    def _check_new(self, name: str, world_size: int) -> None:
        """``_build_first`` unless the store holds the job already."""
        try:
            self.store.get(name)
            return  # stored already: its schedule was built before
        except JobNotFoundError:
            pass
        self._build_first(name, world_size)

    def _build_first(self, name: str, world_size: int) -> None:
        """Build epoch 0 of a job the store does not hold yet before creating it there.

        A world size the dataset cannot fill (``ScheduleError``: no complete
        step) is then refused with nothing stored, rather than left behind as
        a job the page and ``ladle inspect`` fail on. So is a build beyond the
        limits on schedules (``ScheduleLimitError``, inside
        ``ScheduleCache.admitting``): a client churning through world sizes
        leaves no job behind. The schedule is the one the job's first stream
        uses next (the cache keeps it).
        """
        self.unstored(name, world_size).schedule(0, hot=True)

    def unstored(self, name: str, world_size: int) -> Job:
        """The job ``name`` as a trainer of ``world_size`` ranks would create it, not stored nor registered.

        Its schedules share this server's cache, so the first stream of the
        job, if one comes, finds epoch 0 built.
        """
        if world_size < 1:
            raise ConfigError("world_size", f"must be at least 1, got {world_size}")
        return Job(name, self.dataset, self.config, world_size, self.store, cache=self.schedules)

    # How long a resize from a checkpoint re-reads a stored cursor that is behind the checkpoint
    # before refusing: a write on its way (a server writes acknowledged positions at most
    # --ack-flush-ms late, 50 ms by default, and when a stream ends) catches up within it.
    RESIZE_SETTLE_S: Final = 1.0
    RESIZE_SETTLE_POLL_S: Final = 0.05

    def _resize(
        self,
        name: str,
        old_size: int,
        new_size: int,
        checkpoint: tuple[Position, str] | None,
        state: JobState | None = None,
    ) -> JobState:
        """Resize job ``name`` from ``old_size`` to ``new_size`` ranks (``open``'s elastic path).

        Without a checkpoint the cut is every old rank's stored cursor: the
        rows each rank did not acknowledge are re-planned. With a checkpoint of
        the job's current schedule at position S, the cut is S for every old
        rank: by the checkpoint's contract (a DDP job, whose every step holds
        a batch of every rank) the model trained on every rank's batches
        before S and on none after. Where a stored cursor disagrees:

        * past S (the world trained on after the checkpoint): those batches
          are served again, re-planned, as the model was rolled back; logged
          (WARNING) with each rank's steps;
        * behind S: the store says that rank never acknowledged its batches
          from its cursor up to S. Either the cursor is stale (a DDP rank that
          died in the checkpoint round holding its last batch, a write the
          store lost) and the model did train on them, or the rank really
          stopped there (ranks that do not train in step, a rank no trainer
          joined) and it did not. The server cannot tell which: cut at S it
          would lose those rows without a word, cut at the cursor it would
          serve twice rows the model may have trained on. So the resize is
          refused (``CheckpointMismatchError``, logged) with the job
          unchanged, naming the ranks behind and their cursors; the user
          loads a checkpoint at or before every cursor, or starts without
          the checkpoint's position (the cut is then the stored cursors).
          A cursor behind S is first read again for up to
          ``RESIZE_SETTLE_S``: a write on its way is no reason to refuse.

        The cut stays one position for every rank, so a checkpoint of the
        old world at it continues the re-plan (``Job.translate``). The check
        and the store's resize are two operations: a rank of the old world
        still streaming may move in between (forward only, which never turns
        an accepted cut into a lossy one). ``state``: the job as just read, if it was.
        """
        if state is None:
            state = self.store.get(name)
        old = self._job_for(state)
        cut = None
        past: list[tuple[int, Position]] = []
        if checkpoint is not None and checkpoint[1] != old.fingerprint:
            # refused before the store changes: a resize cut at the stored cursors would leave a job
            # that the trainers' checkpoint (the one matching their model) can never be loaded into
            raise CheckpointMismatchError(
                f"the checkpoint is of schedule {checkpoint[1]}, but job {name!r} follows {old.fingerprint} "
                f"({old_size} ranks{self._since(old)}): its ranks went on past that checkpoint, so "
                f"it cannot be resized to {new_size} ranks from it. Load a checkpoint of the world of "
                f"{old_size} ranks, or start without one (the rest of the epoch is then re-planned "
                "from the stored cursors); the job is unchanged"
            )
        if checkpoint is not None and old.world_size == old_size:
            try:
                at = old.normalise(checkpoint[0], hot=True)
            except ConfigError as exc:
                message = f"the loaded state is not a position of job {name!r}: {exc}; the job is unchanged"
                raise CheckpointPositionError(message) from None
            past = self._check_cursors(name, old, state, at, new_size)
            cut = (at,) * old_size
        state = self.store.resize(name, old_size, new_size, cut)
        if state.plan and len(state.plan) > len(old.plan):
            last = state.plan[-1].cut
            cut_at = ", ".join(f"{p.epoch}:{p.step}" for p in sorted(set(last)))
            log.warning(
                "job %s resized from %d to %d ranks: the rows not yet served at %s (%s, epoch:step) are "
                "re-planned for the new world, which starts at epoch %d step 0 of the re-planned schedule",
                name,
                old_size,
                new_size,
                cut_at,
                "a checkpoint's position" if cut is not None else "the stored cursors",
                resize_start(last).epoch,
            )
            if past and cut is not None:
                log.warning(
                    "job %s: the stored cursors of %s are past the checkpoint's position %s: the batches "
                    "those ranks acknowledged after it (epoch:step ranges) are served again, re-planned "
                    "for the new world, as the checkpoint's model did not train on them",
                    name,
                    self._ranks_between(past, cut[0]),
                    f"{cut[0].epoch}:{cut[0].step}",
                )
        return state

    def _check_cursors(
        self, name: str, old: Job, state: JobState, at: Position, new_size: int
    ) -> list[tuple[int, Position]]:
        """The old ranks whose stored cursor is past ``at`` (a checkpoint's position, normalised).

        Raises ``CheckpointMismatchError`` (logged) if a stored cursor is behind
        ``at`` and stays so for ``RESIZE_SETTLE_S`` (see ``_resize``).
        """
        behind, past = self._against(old, state, at)
        deadline = time.monotonic() + self.RESIZE_SETTLE_S
        # a rank no trainer joined (generation 0) has no write on its way: no wait for it
        while any(state.ranks[r].generation > 0 for r, _ in behind) and time.monotonic() < deadline:
            time.sleep(self.RESIZE_SETTLE_POLL_S)
            state = self.store.get(name)
            if state.spec.world_size != old.world_size:
                return []  # resized meanwhile: the store's resize returns it, or refuses
            behind, past = self._against(old, state, at)
        if not behind:
            return past
        earliest = min(p for _, p in behind)
        ranks = self._ranks_between(behind, at, state)
        here = f"{at.epoch}:{at.step}"
        log.warning(
            "job %s: refused to resize from %d to %d ranks at a checkpoint's position %s: the stored "
            "cursors of %s are behind it (those ranks never acknowledged the batches in these epoch:step "
            "ranges); the job is unchanged",
            name,
            old.world_size,
            new_size,
            here,
            ranks,
        )
        raise CheckpointMismatchError(
            f"job {name!r} cannot be resized from {old.world_size} to {new_size} ranks at this "
            f"checkpoint's position {here} (epoch:step): the stored cursors of {ranks} are behind it. "
            "Cut at the checkpoint, the rows of those batches would be lost if the ranks never trained "
            "on them (ranks that do not train in step, a rank that stopped early or never started), "
            "and re-planned they would be trained on twice if the model has them (a DDP rank that "
            "died during the checkpoint round, a store that lost writes); the server cannot tell "
            f"which, so the job is unchanged. Load a checkpoint taken at or before {earliest.epoch}:"
            f"{earliest.step}, which every rank has reached, or start the new world without loading "
            "the data position (the rest is then re-planned from each rank's stored cursor)"
        )

    @staticmethod
    def _against(
        old: Job, state: JobState, at: Position
    ) -> tuple[list[tuple[int, Position]], list[tuple[int, Position]]]:
        """(behind, past): the old ranks whose stored cursor is before / after ``at``, with the cursor.

        A cursor of an earlier epoch is normalised first (``(e, steps of e)`` is
        ``(e + 1, 0)``, the form ``at`` is in; only its epoch's schedule is
        built); one that is not a position of the job is taken as it is.
        """
        behind: list[tuple[int, Position]] = []
        past: list[tuple[int, Position]] = []
        for rank in state.ranks:
            position = rank.position
            if position.epoch < at.epoch:  # (e, steps of e) may be ``at``; within at's epoch it is behind
                try:
                    position = old.normalise(position, hot=True)
                except ConfigError:
                    position = rank.position  # not a position of the job: taken as it is
            if position < at:
                behind.append((rank.rank, position))
            elif position > at:
                past.append((rank.rank, position))
        return behind, past

    @staticmethod
    def _ranks_between(ranks: list[tuple[int, Position]], at: Position, state: JobState | None = None) -> str:
        """'rank 1 (batches 0:894 up to 0:900), ...': each rank's batches between its cursor and ``at``."""
        shown = []
        for rank, position in ranks[:8]:
            lo, hi = sorted((position, at))
            never = ""
            if state is not None and state.ranks[rank].generation == 0:
                never = ", a rank no trainer ever joined"
            shown.append(f"rank {rank} (batches {lo.epoch}:{lo.step} up to {hi.epoch}:{hi.step}{never})")
        if len(ranks) > 8:
            shown.append(f"and {len(ranks) - 8} more ranks")
        return ", ".join(shown)

    @staticmethod
    def _since(job: Job) -> str:
        """', since its resize from N ranks at E:S' for a job that was resized, else ''."""
        if not job.plan:
            return ""
        at = ", ".join(f"{p.epoch}:{p.step}" for p in sorted(set(job.plan[-1].cut)))
        return f", since its resize from {job.plan[-1].world_size} ranks at {at}"

    def _job_for(self, state: JobState) -> Job:
        with self._lock:
            job = self._jobs.get(state.job)
            if job is None or not job.is_stored_as(state):
                job = self._new_job(state)
                self._jobs[state.job] = job
            self._jobs.move_to_end(state.job)
            while len(self._jobs) > self._known:  # bounded however many job names trainers use
                self._jobs.popitem(last=False)
            return job

    def _new_job(self, state: JobState) -> Job:
        return Job(
            state.job,
            self.dataset,
            self.config,
            state.spec.world_size,
            self.store,
            plan=state.plan,
            incarnation=state.incarnation,
            cache=self.schedules,
        )

    def get(self, name: str) -> Job | None:
        with self._lock:
            return self._jobs.get(name)

    def view(self, state: JobState) -> Job:
        """The job the store holds as ``state``, for reading its schedule (no join, no store write).

        The job this server serves, when it serves it as stored (its schedules
        are cached already); else a new ``Job`` that is not registered, so
        inspecting old jobs never changes what the streams use. Raises
        ``JobMismatchError`` if the job was started on another dataset or
        schedule config than this server's (it cannot derive that schedule).
        """
        here = JobSpec(state.job, self.dataset.fingerprint, self.config.fingerprint(), state.spec.world_size)
        try:
            check_identity(state.spec, here)
        except JobMismatchError as exc:
            raise self._explained(exc) from None
        known = self.get(state.job)
        if known is not None and known.is_stored_as(state):
            return known
        return self._new_job(state)
