"""A rank lease: one trainer process's hold on one rank of a job, and every store call it makes.

``JobRegistry.attach`` turns an Open (a ``Claim``) into a ``RankLease``: the
job opened (created, or resized if elastic), the claim's checkpoint placed in
the job's schedule, the rank joined (a new fencing generation) and positioned
(``decide_start``), in at most three store operations. The lease then moves
the rank's cursor (``advance``), stores a position after its stream ended
(``store_late``) and says why it was fenced (``fenced``). The servicer above
holds leases and never calls the store.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Final

from .errors import (
    CheckpointPositionError,
    ConfigError,
    FencedError,
    JobNotFoundError,
    LadleError,
    StoreUnavailableError,
)
from .start import ALIGNED_START_S, AlignedStart, Note, Resume
from .store.base import Position, RankState

if TYPE_CHECKING:
    from .jobs import Job

__all__ = [
    "AlignedStarts",
    "Claim",
    "Position",
    "RankLease",
    "StreamAbortedError",
    "placed",
]

log = logging.getLogger("ladle.server")

# aligned starts remembered before the stale ones are swept (entries are read for minutes)
_ALIGNED_SWEEP_AT: Final = 10_000


class StreamAbortedError(LadleError):
    """A stream ends on purpose with a status (bad request, replaced, out of credit misuse)."""

    def __init__(self, kind: str, reason: str, message: str, field: str = "") -> None:
        self.kind = kind  # type: ignore[misc]
        self.reason = reason
        self.field = field
        super().__init__(message)


@dataclass(frozen=True, slots=True)
class Claim:
    """What an Open asks of a job: a rank, a world size and what the trainer brings.

    ``start`` with ``fingerprint``: the position of a loaded checkpoint and the
    schedule it was taken on (``fingerprint`` alone: a stream being resumed).
    The wire's checks have passed: ``0 <= rank < world_size``.
    """

    job: str
    rank: int
    world_size: int
    start: Position | None = None
    fingerprint: str | None = None
    resume: Resume | None = None
    own_cursor: bool = False
    elastic: bool = False

    @property
    def checkpoint(self) -> tuple[Position, str] | None:
        """(position, schedule fingerprint) of the loaded checkpoint, None without one."""
        if self.start is None or self.fingerprint is None:
            return None
        return self.start, self.fingerprint


class AlignedStarts:
    """The streams this server began at a job's cursor, by (job, rank), for the ranks that join after.

    Thread-safe: Opens run on threads of their own.
    """

    def __init__(self) -> None:
        # (job, rank) -> (generation, start, monotonic time, store time of the join)
        self._starts: dict[tuple[str, int], tuple[int, Position, float, float]] = {}
        self._lock = threading.Lock()

    def of_others(self, job: str, rank: int, ranks: Sequence[RankState]) -> Mapping[int, AlignedStart]:
        """The starts of ``ranks`` other than ``rank``, aged to now."""
        now = time.monotonic()
        found = {}
        with self._lock:
            for r in ranks:
                began = self._starts.get((job, r.rank))
                if r.rank != rank and began is not None:
                    generation, start, at, store_time = began
                    found[r.rank] = AlignedStart(generation, start, now - at, store_time)
        return found

    def remember(self, job: str, rank: int, joined: RankState, start: Position) -> None:
        now = time.monotonic()
        with self._lock:
            if len(self._starts) > _ALIGNED_SWEEP_AT:
                stale = [k for k, v in self._starts.items() if now - v[2] >= ALIGNED_START_S]
                for key in stale:
                    del self._starts[key]
            self._starts[(job, rank)] = (joined.generation, start, now, joined.last_seen)

    def forget(self, job: str, rank: int, generation: int) -> None:
        """The stream of ``generation`` ended: its start no longer holds back the ranks that join later."""
        with self._lock:
            began = self._starts.get((job, rank))
            if began is not None and began[0] == generation:
                del self._starts[(job, rank)]


def placed(job: Job, claim: Claim) -> Position | None:
    """Where the claim's checkpoint stands in ``job``'s schedule (translated across a resize and
    normalised), None without one; refused (``StreamAbortedError``, ``CheckpointPositionError``)
    if it has no place there."""
    given = claim.start
    if claim.fingerprint is not None and claim.fingerprint != job.fingerprint:
        moved = job.translate(claim.fingerprint, given) if given is not None else None
        if moved is None and given is not None and claim.fingerprint == job.previous_fingerprint:
            cut = job.plan[-1]
            at = ", ".join(f"{p.epoch}:{p.step}" for p in sorted(set(cut.cut)))
            raise StreamAbortedError(
                "failed_precondition",
                "schedule_mismatch",
                f"job {job.name!r} was resized from {cut.world_size} to {job.world_size} ranks at "
                f"{at} (epoch:step; the checkpoint the first new rank loaded, or the stored cursors "
                f"if it loaded none), and this checkpoint of the old world is at {given.epoch}:"
                f"{given.step}: every rank of an elastic restart must load a checkpoint of the same "
                "step (rank 0's will do), or none",
                "open.start",
            )
        if moved is None:
            raise StreamAbortedError(
                "failed_precondition",
                "schedule_mismatch",
                f"the client expects schedule {claim.fingerprint} but job {job.name!r} follows "
                f"{job.fingerprint} (another dataset, config, world size, resize or ladle version)",
                "open.schedule_fingerprint",
            )
        given = moved  # a checkpoint of the world before an elastic resize, taken at its cut
    if given is not None:
        try:
            given = job.normalise(given, hot=True)
        except ConfigError as exc:
            message = f"the loaded state is not a position of this job: {exc}"
            raise CheckpointPositionError(message) from None
    return given


class RankLease:
    """One trainer process's hold on one rank: its generation, where it starts, what the store holds.

    ``start``: the position its stream starts at. ``stored``: the rank's
    stored cursor after the Open. ``notes``: the lines to log for the Open.
    ``advance`` and ``store_late`` run on a store thread; a lease whose rank
    was joined again by a newer process can move nothing (``fenced``).
    """

    __slots__ = ("_aligned", "generation", "job", "notes", "rank", "start", "stored")

    def __init__(
        self,
        job: Job,
        rank: int,
        generation: int,
        start: Position,
        stored: Position | None = None,
        notes: tuple[Note, ...] = (),
        aligned: AlignedStarts | None = None,
    ) -> None:
        self.job = job
        self.rank = rank
        self.generation = generation
        self.start = start
        self.stored = start if stored is None else stored
        self.notes = notes
        self._aligned = aligned

    def advance(self, target: Position) -> Position:
        """Move the stored cursor to ``target``; raises ``StreamAbortedError`` (fenced) or the store's error.

        A store that lost writes it had acknowledged (the rank's generation
        went back, or the job is gone) is given back what this live trainer
        holds.
        """
        store, name = self.job.store, self.job.name
        try:
            store.advance(name, self.rank, self.generation, target)
        except FencedError as exc:
            if exc.current >= self.generation:
                raise self.fenced() from None
            self._reconcile(target, f"it holds generation {exc.current} for a process of {exc.generation}")
        except JobNotFoundError:
            store.open_job(self.job.spec, incarnation=self.job.incarnation or None, plan=self.job.plan)
            self._reconcile(target, "the job was gone: expired by --job-ttl, deleted, or lost by the store")
        return target

    def store_late(self, target: Position) -> bool:
        """One try at storing ``target`` after the stream ended.

        False, with nothing written, when the job is no longer the one this
        lease is of: deleted, expired, reset (a new run under the name, with
        a new incarnation), resized, or the rank held by a newer process. Unlike
        ``advance`` it never re-creates a job or reconciles: no trainer is there
        to vouch for the position. Raises ``StoreUnavailableError``.
        """
        store, name = self.job.store, self.job.name
        try:
            if not self.job.is_stored_as(store.get(name)):
                return False
            store.advance(name, self.rank, self.generation, target)
        except StoreUnavailableError:
            raise
        except LadleError:  # gone, fenced, a rank an elastic resize removed
            return False
        return True

    def _reconcile(self, target: Position, why: str) -> None:
        try:
            self.job.store.reconcile(self.job.name, self.rank, self.generation, target)
        except FencedError:
            raise self.fenced() from None
        log.warning(
            "job %s rank %d: the cursor store lost recent writes (%s); reconciled from the trainer's "
            "position %s, generation %d",
            self.job.name,
            self.rank,
            why,
            target,
            self.generation,
        )

    def fenced(self, now: Job | None = None) -> StreamAbortedError:
        """Why this lease may no longer move the cursor: a newer process, or a resize of the job.

        ``now``: the job as the lease that replaces this one follows it; None
        asks the store (on a store thread only).
        """
        if now is not None:
            resized, world_size = now.fingerprint != self.job.fingerprint, now.world_size
        else:
            try:
                state = self.job.store.get(self.job.name)
                resized = state.spec.world_size != self.job.world_size or state.plan != self.job.plan
                world_size = state.spec.world_size
            except LadleError:
                resized, world_size = False, self.job.world_size
        if resized:
            why = (
                f"job {self.job.name!r} was resized to {world_size} ranks by an elastic restart; "
                f"this stream of rank {self.rank} of the old world of {self.job.world_size} ends"
            )
        else:
            why = (
                f"this stream for rank {self.rank} of job {self.job.name!r} was replaced by a newer "
                "trainer process (a new Open for the same job and rank)"
            )
        return StreamAbortedError("failed_precondition", "fenced", why)

    def end(self) -> None:
        """The lease's stream ended: a start at the job's cursor no longer holds back later ranks."""
        if self._aligned is not None:
            self._aligned.forget(self.job.name, self.rank, self.generation)
