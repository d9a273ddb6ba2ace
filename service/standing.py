"""Where a job's ranks stand: each rank's position, its lag behind the leader, when it was last seen.

One read of the cursor store gives every figure, so ``/cursor``, the page and
the per-rank metrics show the same numbers. Nobody reads a thousand rows, so
``attention`` orders the ranks that need a look first: never joined by a
trainer, then not seen for longest, then furthest behind, both by decades (under 10 s, 10-99 s, ...; under 10
steps, 10-99 steps, ...), so ranks that keep pace keep their order instead of
trading places at every refresh.
"""

from __future__ import annotations

import heapq
import time
from collections.abc import Collection, Iterable
from dataclasses import dataclass
from typing import Final, NamedTuple

from .jobs import Job, JobRegistry
from .store.base import JobState, Position

__all__ = ["JobStanding", "RankStanding", "attention", "decade", "read_standing", "standing", "steps_between"]

# Epochs apart beyond which a rank's lag is estimated from its own epoch's length.
_EXACT_LAG_EPOCHS: Final = 3
# attention's decade of a rank no trainer joined: before any rank that was seen
_NEVER: Final = 99


class RankStanding(NamedTuple):
    """One rank: its position (normalised), its lag behind the leader in steps, when it was last seen.

    "Seen" is the store's ``last_seen``: the rank's last join, advance or
    rewind, i.e. the last batch its trainer acknowledged (written behind the
    stream within ``--ack-flush-ms``) or the last time a trainer opened a
    stream for it. ``seen_ago_s`` of a rank no trainer joined yet
    (``generation`` 0) counts from the job's creation.
    """

    rank: int
    position: Position
    steps_in_epoch: int
    lag_steps: int
    generation: int
    last_seen: float
    seen_ago_s: float

    @property
    def joined(self) -> bool:
        return self.generation > 0


@dataclass(frozen=True, slots=True)
class JobStanding:
    """Every rank of one job at one moment (``now``, the reader's clock)."""

    job: Job
    leader: Position
    ranks: tuple[RankStanding, ...]
    updated: float
    now: float


def steps_between(job: Job, a: Position, b: Position) -> int:
    """Steps from ``a`` to ``b`` (``a <= b``); exact across up to a few epochs, estimated beyond."""
    if a.epoch == b.epoch:
        return b.step - a.step
    first = job.steps(a.epoch)
    between = b.epoch - a.epoch - 1
    if between <= _EXACT_LAG_EPOCHS:
        middle = sum(job.steps(e) for e in range(a.epoch + 1, b.epoch))
    else:
        middle = between * first
    return first - a.step + middle + b.step


def standing(job: Job, state: JobState, now: float | None = None) -> JobStanding:
    """Where every rank of ``state`` stands in ``job``: a dictionary look-up per rank, the schedule's
    figures asked once per epoch the ranks are in."""
    now = time.time() if now is None else now
    steps: dict[int, int] = {}

    def normalised(position: Position) -> Position:
        if position.epoch not in steps:
            steps[position.epoch] = job.steps(position.epoch)
        if position.step < steps[position.epoch]:
            return position
        position = job.normalise(position)  # the end of an epoch is the start of the next
        steps.setdefault(position.epoch, job.steps(position.epoch))
        return position

    positions = [normalised(r.position) for r in state.ranks]
    leader = max(positions, key=lambda p: (p.epoch, p.step), default=Position(0, 0))
    to_leader: dict[int, int] = {}  # epoch: steps from its first step to the leader
    ranks = []
    for r, pos in zip(state.ranks, positions, strict=True):
        if pos.epoch not in to_leader:
            to_leader[pos.epoch] = steps_between(job, Position(pos.epoch, 0), leader)
        ranks.append(
            RankStanding(
                rank=r.rank,
                position=pos,
                steps_in_epoch=steps[pos.epoch],
                lag_steps=to_leader[pos.epoch] - pos.step,
                generation=r.generation,
                last_seen=r.last_seen,
                seen_ago_s=round(max(0.0, now - r.last_seen), 3),
            )
        )
    return JobStanding(job, leader, tuple(ranks), state.updated, now)


def read_standing(registry: JobRegistry, name: str) -> JobStanding:
    """The standing of the stored job ``name``: one store read (``LadleError`` if it cannot be shown)."""
    state = registry.store.get(name)
    return standing(registry.view(state), state)


def decade(value: float) -> int:
    """0 under 10, 1 for 10-99, 2 for 100-999, ... (the coarse size ``attention`` compares)."""
    return len(str(int(value))) - 1 if value >= 10 else 0


def attention(ranks: Iterable[RankStanding], n: int, *, shown: Collection[int] = ()) -> list[RankStanding]:
    """The ``n`` ranks to look at first, first first: never joined, then not seen for longest, then
    furthest behind (by decades), then ranks in ``shown`` (the ones shown last time, so a list does
    not churn), then by rank. The page's script orders its rank table the same way."""

    def key(r: RankStanding) -> tuple[int, int, bool, int]:
        seen = decade(r.seen_ago_s) if r.joined else _NEVER
        return (-seen, -decade(r.lag_steps), r.rank not in shown, r.rank)

    return heapq.nsmallest(n, ranks, key=key)
