"""Where a rank's stream starts: one decision, from plain data.

``decide_start`` takes what an Open brings (its rank, the checkpoint position it
claims, ``own_cursor``, the generation and incarnation of a reconnecting
trainer), what the store said (the job's ranks read before the rank's join,
the rank's state after it) and what the server remembers (the other ranks'
recent starts at the job's cursor), and says where the rank starts, what the
store is to be told (a rewind, or a reconcile after lost writes), what to log
and whether the start is one at the job's cursor that later Opens align to.
It reads no store, clock or log: the caller (``JobRegistry.attach``, and
``JobRegistry.preview`` asking where a rank would start) gathers the data and
applies the result.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Final, Protocol

from .store.base import Position, RankState

if TYPE_CHECKING:
    from .jobs import Job

__all__ = [
    "ALIGNED_START_S",
    "FAR_BEHIND_STEPS",
    "RESUME_CLAIM_LIMIT",
    "AlignedStart",
    "HotPositions",
    "Note",
    "Opening",
    "Positions",
    "Reconcile",
    "Resume",
    "StartDecision",
    "decide_start",
    "steps_apart",
]

# a rank with no checkpoint that starts further than this behind another is named in a warning, and
# ranks further apart than this are not a DDP group in step: each keeps its own cursor
FAR_BEHIND_STEPS: Final = 64
# how long the start of a stream begun at the job's cursor counts for the ranks that join after it
ALIGNED_START_S: Final = 120.0
# A Resume.generation the store lost is written back (one more, for the new stream), and every later join
# adds one: only a claim below this is, so that 2**31 joins pass before a trainer of the rank would
# reconnect with a generation at RESUME_GENERATION_LIMIT (and be refused after every restart)
RESUME_CLAIM_LIMIT: Final = 2**31


class Positions(Protocol):
    """How a job measures positions: its epochs' lengths (schedule builds, no store access)."""

    def normalise(self, position: Position) -> Position:
        """``Job.normalise``: the end of an epoch is the start of the next."""
        ...

    def steps(self, epoch: int) -> int:
        """Steps in ``epoch``."""
        ...


@dataclass(frozen=True, slots=True)
class HotPositions:
    """``Positions`` of a job as a trainer's stream uses them (its schedules kept hot).

    One is made for one decision, which normalises every rank's position: the
    answers are kept (a thousand ranks stand at a few positions), so a decision
    asks the schedule cache once per position, not once per rank.
    """

    job: Job
    _normalised: dict[tuple[int, int], Position] = field(default_factory=dict)

    def normalise(self, position: Position) -> Position:
        key = (position.epoch, position.step)  # a tuple of ints hashes in C, a dataclass in Python
        known = self._normalised.get(key)
        if known is None:
            known = self._normalised[key] = self.job.normalise(position, hot=True)
        return known

    def steps(self, epoch: int) -> int:
        return self.job.steps(epoch, hot=True)


@dataclass(frozen=True, slots=True)
class Resume:
    """A reconnecting trainer's last StreamStart: its generation, and the job's incarnation ('' unknown)."""

    generation: int
    incarnation: str = ""


@dataclass(frozen=True, slots=True)
class Opening:
    """What an Open asks: ``given`` is its checkpoint's position, already of this job's schedule
    (translated across a resize and normalised), None without a checkpoint."""

    job: str
    rank: int
    given: Position | None = None
    own_cursor: bool = False
    resume: Resume | None = None

    @property
    def aligned(self) -> bool:
        """No checkpoint and no ``own_cursor``: a start at the job's cursor (``decide_start`` needs
        the job's ranks read before the join)."""
        return self.given is None and not self.own_cursor


@dataclass(frozen=True, slots=True)
class AlignedStart:
    """A stream of another rank that this server began at the job's cursor."""

    generation: int  # the stream's generation
    start: Position
    age_s: float  # seconds since it began (monotonic clock)
    store_time: float  # the store's time of its join (its RankState.last_seen then)


@dataclass(frozen=True, slots=True)
class Note:
    """A line for the server's log."""

    level: int  # logging.INFO, logging.WARNING
    message: str


@dataclass(frozen=True, slots=True)
class Reconcile:
    """The store lost writes: store ``generation`` and the start for the rank, then log ``note``."""

    generation: int
    why: str
    note: Note


@dataclass(frozen=True, slots=True)
class StartDecision:
    """Where a rank starts and what follows from it.

    ``start``: the position its stream starts at (normalised). ``rewind``:
    write ``start`` as the rank's stored cursor (a checkpoint's claim, or the
    job's cursor). ``reconcile``: instead, the store lost writes (None if it
    did not). ``notes``: log lines, logged once decided. ``aligned``: the
    start is at the job's cursor, remembered for the ranks that join after it.
    ``refusal``: the Open is refused (its Resume.generation is one that must
    not be stored), why; '' if it is not.
    """

    start: Position
    rewind: bool = False
    reconcile: Reconcile | None = None
    notes: tuple[Note, ...] = ()
    aligned: bool = False
    refusal: str = ""


def steps_apart(positions: Positions, behind: Position, ahead: Position) -> int:
    """Steps from ``behind`` to ``ahead`` (normalised, ``behind <= ahead``); past one epoch, a bound."""
    if ahead.epoch == behind.epoch:
        return ahead.step - behind.step
    if ahead.epoch == behind.epoch + 1:
        return positions.steps(behind.epoch) - behind.step + ahead.step
    return FAR_BEHIND_STEPS * 1_000_000  # epochs apart: far, whatever their lengths


def decide_start(
    opening: Opening,
    *,
    joined: RankState,
    ranks: Sequence[RankState],
    aligned_starts: Mapping[int, AlignedStart],
    incarnation: str,
    positions: Positions,
    describe: bool = False,
) -> StartDecision:
    """Where the rank of ``opening`` starts.

    ``joined``: the rank's state after its join (for ``describe``, as stored:
    nothing joins). ``ranks``: the job's ranks as the store had them before
    the join (read only for a start at the job's cursor, else may be empty).
    ``aligned_starts``: by rank, the latest start at the job's cursor this
    server began for the other ranks. ``incarnation``: the job's.
    ``describe``: Describe asking where the rank would start: no notes, no
    store operation, nothing to remember.

    With a checkpoint the rank starts at it. Without one it starts at its
    own stored cursor, or, unless ``own_cursor``, at the job's cursor when
    another rank is just behind it (``_job_cursor``), and it is named in a
    warning when it starts far behind another rank. A reconnecting trainer
    whose Resume shows that the store forgot its joins (another incarnation,
    or a generation not older than the one the join gave) has its position
    and generation written back (``reconcile``) instead of a rewind.
    ``positions.normalise`` may raise ``ConfigError`` for a stored position
    that is not one of the job's.
    """
    given = opening.given
    aligned = opening.aligned  # no checkpoint: the job's cursor
    notes: list[Note] = []
    if aligned:
        cursor = _job_cursor(opening, joined, ranks, aligned_starts, positions)
        if cursor is not None:
            given, note = cursor
            notes.append(note)
    start = positions.normalise(given if given is not None else joined.position)
    if describe:
        return StartDecision(start)
    if aligned:
        far = _far_behind(opening, start, ranks, positions, first=joined.generation == 1)
        if far is not None:
            notes.append(far)
    lost = _lost_writes(opening.resume, incarnation, joined.generation)
    reconcile = None
    refusal = ""
    if lost and opening.resume is not None:
        generation = max(joined.generation, opening.resume.generation + 1)
        if generation > max(joined.generation, RESUME_CLAIM_LIMIT):  # never store what is refused later
            refusal = (
                f"Open.resume.generation must be below {RESUME_CLAIM_LIMIT} to be restored ({lost}), "
                f"got {opening.resume.generation}"
            )
        message = (
            f"job {opening.job} rank {opening.rank}: the cursor store lost recent writes ({lost}); "
            f"reconciled from the reconnecting trainer's position {start}, generation {generation}"
        )
        reconcile = Reconcile(generation, lost, Note(logging.WARNING, message))
    return StartDecision(
        start,
        rewind=reconcile is None and given is not None,
        reconcile=reconcile,
        notes=tuple(notes),
        aligned=aligned,
        refusal=refusal,
    )


def _job_cursor(
    opening: Opening,
    joined: RankState,
    ranks: Sequence[RankState],
    aligned_starts: Mapping[int, AlignedStart],
    positions: Positions,
) -> tuple[Position, Note] | None:
    """Where a rank with no checkpoint starts when another rank of the job is just behind it (and
    the line that says so), else None.

    That is the job's cursor, the earliest position of its ranks: a DDP job
    restarted without a checkpoint (torchrun kills and restarts every rank)
    has its ranks a step or two apart, and each continuing at its own
    cursor would leave them unequal steps to the epoch's end, where the
    ranks with more would hang in their last collective (docs/product.md
    guarantee 2). The ranks ahead get again what they consumed beyond it.
    Counted: ranks that have joined (a rank no trainer ever opened is at
    0:0 and says nothing), each at the start of a stream this server began
    at the job's cursor lately if that is earlier (a rank that consumed
    micro-batches before the others came back, under gradient
    accumulation), and only within ``FAR_BEHIND_STEPS``: ranks further
    apart do not train in step, and each keeps its own cursor. Such a
    start holds this rank back only if this rank has not moved since it
    (its ``last_seen`` in ``ranks``, read before its join, is not later):
    a rank that streamed beside the others and comes back alone continues
    with them, at the earliest stored position, instead of replaying the
    epoch from where they all began.
    """
    rank = opening.rank
    own = positions.normalise(joined.position)
    mine = next((r for r in ranks if r.rank == rank), None)
    moved_at = mine.last_seen if mine is not None and mine.generation > 0 else float("-inf")
    found = []
    for r in ranks:
        if r.rank == rank or r.generation == 0:
            continue
        position = positions.normalise(r.position)
        began = aligned_starts.get(r.rank)
        if (
            began is not None
            and began.generation == r.generation
            and began.age_s < ALIGNED_START_S
            and moved_at <= began.store_time
        ):
            position = min(position, began.start)
        found.append(position)
    earliest = min(found, default=own)
    if earliest >= own or steps_apart(positions, earliest, own) > FAR_BEHIND_STEPS:
        return None
    message = (
        f"job {opening.job} rank {rank}: no checkpoint, so it starts at the job's cursor {earliest} (the "
        f"earliest rank's), not at its own {own}, as every rank restarted without one does: the batches "
        "between are served to it again (BatchClient(own_cursor=True) keeps a rank's own cursor)"
    )
    return earliest, Note(logging.INFO, message)


def _far_behind(
    opening: Opening, start: Position, ranks: Sequence[RankState], positions: Positions, *, first: bool
) -> Note | None:
    """A warning when a rank with no checkpoint starts far behind another (the store lost its
    position, or a job expired while one rank was away): it replays what that rank trained.

    ``first``: the store had no record of this rank (its first start, or one the store lost).
    """
    ahead = [(positions.normalise(r.position), r.rank) for r in ranks if r.rank != opening.rank]
    if not ahead:
        return None
    lead, leader = max(ahead)
    if not (lead > start and steps_apart(positions, start, lead) > FAR_BEHIND_STEPS):
        return None
    why = (
        "the store had no record of this rank (its first start, or a store that lost its data)"
        if first
        else "the store holds no later position of it (lost, or never written)"
    )
    message = (
        f"job {opening.job} rank {opening.rank} starts at {start} with no checkpoint, behind rank {leader} "
        f"at {lead}: {why}; if it trained before, resume it with load_state_dict from its checkpoint"
    )
    return Note(logging.WARNING, message)


def _lost_writes(resume: Resume | None, incarnation: str, generation: int) -> str:
    """Why a reconnecting client shows that the store lost writes ('' if it does not)."""
    if resume is None:
        return ""
    if resume.incarnation and resume.incarnation != incarnation:
        return f"the job is incarnation {incarnation}, the trainer knew {resume.incarnation}"
    if generation <= resume.generation:
        return (
            f"the trainer reconnecting held generation {resume.generation}, and the store gave the "
            f"new stream {generation}, not a newer one: it forgot the trainer's join (a Redis restarted "
            "without its data)"
        )
    return ""
