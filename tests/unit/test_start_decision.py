"""``decide_start``: where a rank's stream starts, from plain data (no store, server or clock)."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import pytest

from ladle.service.errors import ConfigError
from ladle.service.start import (
    ALIGNED_START_S,
    FAR_BEHIND_STEPS,
    RESUME_CLAIM_LIMIT,
    AlignedStart,
    Opening,
    Resume,
    decide_start,
    steps_apart,
)
from ladle.service.store.base import Position, RankState

STEPS = 100  # steps in every epoch of the fake job


class Epochs:
    """Positions of a job whose every epoch has ``STEPS`` steps (``Job.normalise``'s rule)."""

    def steps(self, epoch: int) -> int:
        return STEPS

    def normalise(self, position: Position) -> Position:
        if position.step > STEPS:
            raise ConfigError("step", f"{position} is beyond the end of its epoch")
        if position.step == STEPS:
            return Position(position.epoch + 1, 0)
        return position


def P(epoch: int, step: int) -> Position:  # noqa: N802 (a position, read as one)
    return Position(epoch, step)


def R(rank: int, position: Position, generation: int = 1, last_seen: float = 900.0) -> RankState:  # noqa: N802
    return RankState(rank, position, generation, last_seen)


@dataclass(frozen=True)
class Case:
    opening: Opening
    joined: RankState
    start: Position
    ranks: tuple[RankState, ...] = ()
    aligned_starts: dict[int, AlignedStart] = field(default_factory=dict)
    incarnation: str = "inc-1"
    describe: bool = False
    # expected
    rewind: bool = False
    reconcile: int | None = None  # the generation reconciled
    aligned: bool = False
    notes: tuple[tuple[int, str], ...] = ()  # (level, a phrase of the line), in order
    refused: bool = False


JOB_CURSOR = (logging.INFO, "no checkpoint, so it starts at the job's cursor")
LOST = (logging.WARNING, "the cursor store lost recent writes")
FIRST = "the store had no record of this rank (its first start"
NOT_FIRST = "the store holds no later position of it"

# two ranks of a DDP job, both streamed since an earlier start: rank 0 a step ahead of rank 1
GROUP = (R(0, P(0, 30), 1, 950.0), R(1, P(0, 29), 1, 950.0))

CASES = {
    "checkpoint claim: starts there, rewound": Case(
        Opening("j", 0, given=P(0, 10)), R(0, P(0, 30), 2), P(0, 10), rewind=True
    ),
    "checkpoint at an epoch's end: the next epoch's start": Case(
        Opening("j", 0, given=P(0, STEPS)), R(0, P(0, 30), 2), P(1, 0), rewind=True
    ),
    "no checkpoint, own_cursor: its own position": Case(
        Opening("j", 0, own_cursor=True), R(0, P(0, 30), 2), P(0, 30)
    ),
    "a rank never opened": Case(Opening("j", 0), R(0, P(0, 0), 1), P(0, 0), ranks=(), aligned=True),
    "a DDP group restarted together: the earliest rank's": Case(
        Opening("j", 0),
        R(0, P(0, 30), 2, 1000.0),
        P(0, 29),
        ranks=(*GROUP, R(2, P(0, 31))),
        rewind=True,
        aligned=True,
        notes=(JOB_CURSOR,),
    ),
    "the rank behind: its own, which is the job's cursor": Case(
        Opening("j", 1), R(1, P(0, 29), 2, 1000.0), P(0, 29), ranks=GROUP, aligned=True
    ),
    "the last of the group: aligned to the first's start, not its stored cursor": Case(
        Opening("j", 2),
        R(2, P(0, 31), 2, 1002.0),
        P(0, 29),
        ranks=(R(0, P(0, 33), 2, 1001.0), R(1, P(0, 29), 2, 1001.0), R(2, P(0, 31), 1, 950.0)),
        aligned_starts={0: AlignedStart(2, P(0, 29), 1.0, 1000.0), 1: AlignedStart(2, P(0, 29), 0.5, 1001.0)},
        rewind=True,
        aligned=True,
        notes=(JOB_CURSOR,),
    ),
    "a rank that came back first and consumed micro-batches: the others align to its start": Case(
        Opening("j", 1),
        R(1, P(0, 21), 2, 1005.0),
        P(0, 20),
        ranks=(R(0, P(0, 23), 2, 1004.0), R(1, P(0, 21), 1, 990.0)),
        aligned_starts={0: AlignedStart(2, P(0, 20), 5.0, 1000.0)},
        rewind=True,
        aligned=True,
        notes=(JOB_CURSOR,),
    ),
    "a rank restarted alone while the others ran on since their aligned start: its own": Case(
        Opening("j", 1),
        R(1, P(0, 50), 3, 1200.0),
        P(0, 50),
        # rank 1 moved (last_seen 1100) after rank 0's aligned start was joined (store time 1000)
        ranks=(R(0, P(0, 52), 2, 1150.0), R(1, P(0, 50), 2, 1100.0)),
        aligned_starts={0: AlignedStart(2, P(0, 10), 30.0, 1000.0)},
        aligned=True,
    ),
    "an aligned start of another stream of that rank counts for nothing": Case(
        Opening("j", 1),
        R(1, P(0, 21), 2, 1005.0),
        P(0, 21),
        ranks=(R(0, P(0, 23), 3, 1004.0), R(1, P(0, 21), 1, 990.0)),
        aligned_starts={0: AlignedStart(2, P(0, 20), 5.0, 1000.0)},
        aligned=True,
    ),
    "an aligned start older than ALIGNED_START_S counts for nothing": Case(
        Opening("j", 1),
        R(1, P(0, 21), 2, 1005.0),
        P(0, 21),
        ranks=(R(0, P(0, 23), 2, 1004.0), R(1, P(0, 21), 1, 990.0)),
        aligned_starts={0: AlignedStart(2, P(0, 20), ALIGNED_START_S, 1000.0)},
        aligned=True,
    ),
    "a rank further than FAR_BEHIND_STEPS ahead keeps its own cursor": Case(
        Opening("j", 1),
        R(1, P(0, 90), 2),
        P(0, 90),
        ranks=(R(0, P(0, 90 - FAR_BEHIND_STEPS - 1)), R(1, P(0, 90))),
        aligned=True,
    ),
    "a rank far behind another, its first start: own cursor and the warning": Case(
        Opening("j", 0),
        R(0, P(0, 10), 1),
        P(0, 10),
        ranks=(R(1, P(0, 10 + FAR_BEHIND_STEPS + 1)),),
        aligned=True,
        notes=((logging.WARNING, f"starts at {P(0, 10)} with no checkpoint, behind rank 1 at"), (0, FIRST)),
    ),
    "a rank far behind another, known before: own cursor and the warning": Case(
        Opening("j", 0),
        R(0, P(0, 10), 4),
        P(0, 10),
        ranks=(R(0, P(0, 10), 3), R(1, P(1, 0))),
        aligned=True,
        notes=((logging.WARNING, "with no checkpoint, behind rank 1"), (0, NOT_FIRST)),
    ),
    "ranks across an epoch's end, within FAR_BEHIND_STEPS: no warning": Case(
        Opening("j", 0),
        R(0, P(0, 90), 3),
        P(0, 90),
        ranks=(R(0, P(0, 90), 2), R(1, P(1, 20))),
        aligned=True,
    ),
    "epochs apart: the warning, whatever their lengths": Case(
        Opening("j", 0),
        R(0, P(0, 99), 3),
        P(0, 99),
        ranks=(R(0, P(0, 99), 2), R(1, P(2, 0))),
        aligned=True,
        notes=((logging.WARNING, "behind rank 1 at"),),
    ),
    "lost writes: reconciled with one more than the trainer's generation": Case(
        Opening("j", 0, resume=Resume(5, "inc-1")),
        R(0, P(0, 0), 1),
        P(0, 0),
        aligned=True,
        reconcile=6,
        notes=(LOST,),
    ),
    "lost writes with a checkpoint: reconciled at it, not rewound": Case(
        Opening("j", 0, given=P(0, 40), resume=Resume(3)),
        R(0, P(0, 0), 3),
        P(0, 40),
        reconcile=4,
        notes=(LOST,),
    ),
    "a reconnecting trainer older than the join: nothing lost": Case(
        Opening("j", 0, own_cursor=True, resume=Resume(2, "inc-1")), R(0, P(0, 7), 3), P(0, 7)
    ),
    "another incarnation: reconciled with the joined generation, if later": Case(
        Opening("j", 0, own_cursor=True, resume=Resume(1, "inc-0")),
        R(0, P(0, 7), 7),
        P(0, 7),
        reconcile=7,
        notes=(LOST, (0, "the job is incarnation inc-1, the trainer knew inc-0")),
    ),
    "a generation the store is never given: refused": Case(
        Opening("j", 0, own_cursor=True, resume=Resume(RESUME_CLAIM_LIMIT)),
        R(0, P(0, 0), 1),
        P(0, 0),
        reconcile=RESUME_CLAIM_LIMIT + 1,
        notes=(LOST,),
        refused=True,
    ),
    "the largest generation restored": Case(
        Opening("j", 0, own_cursor=True, resume=Resume(RESUME_CLAIM_LIMIT - 1)),
        R(0, P(0, 0), 1),
        P(0, 0),
        reconcile=RESUME_CLAIM_LIMIT,
        notes=(LOST,),
    ),
    "Describe: where the group's rank would start, quietly": Case(
        Opening("j", 0),
        R(0, P(0, 30), 1, 950.0),
        P(0, 29),
        ranks=(*GROUP, R(2, P(0, 31))),
        describe=True,
    ),
    "Describe with own_cursor: its own": Case(
        Opening("j", 0, own_cursor=True), R(0, P(0, 30), 1, 950.0), P(0, 30), ranks=GROUP, describe=True
    ),
    "Describe of a rank far behind: no warning": Case(
        Opening("j", 0), R(0, P(0, 10), 1), P(0, 10), ranks=(R(0, P(0, 10)), R(1, P(1, 50))), describe=True
    ),
}


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_decide_start(case: Case) -> None:
    decision = decide_start(
        case.opening,
        joined=case.joined,
        ranks=case.ranks,
        aligned_starts=case.aligned_starts,
        incarnation=case.incarnation,
        positions=Epochs(),
        describe=case.describe,
    )
    assert decision.start == case.start
    assert decision.rewind == case.rewind
    assert decision.aligned == case.aligned
    assert (decision.reconcile.generation if decision.reconcile else None) == case.reconcile
    assert bool(decision.refusal) == case.refused, decision.refusal
    lines = [*decision.notes, *([decision.reconcile.note] if decision.reconcile else [])]
    expected = [(level, phrase) for level, phrase in case.notes if level]
    assert [n.level for n in lines] == [level for level, _ in expected], lines
    for note, (_, phrase) in zip(lines, expected, strict=True):
        assert phrase in note.message, note.message
    for _, phrase in case.notes:  # level 0: a phrase of any line
        assert any(phrase in n.message for n in lines), (phrase, lines)


def test_the_lines_name_the_job_and_rank() -> None:
    decision = decide_start(
        Opening("run-42", 3, resume=Resume(9)),
        joined=R(3, P(0, 31), 2),
        ranks=(R(2, P(0, 30), 1), R(3, P(0, 31), 1)),
        aligned_starts={},
        incarnation="",
        positions=Epochs(),
    )
    assert decision.start == P(0, 30)
    assert decision.notes[0].message.startswith(
        f"job run-42 rank 3: no checkpoint, so it starts at the job's cursor {P(0, 30)} (the earliest "
        f"rank's), not at its own {P(0, 31)}"
    )
    assert decision.reconcile is not None
    assert decision.reconcile.note.message == (
        "job run-42 rank 3: the cursor store lost recent writes (the trainer reconnecting held generation "
        "9, and the store gave the new stream 2, not a newer one: it forgot the trainer's join (a Redis "
        f"restarted without its data)); reconciled from the reconnecting trainer's position {P(0, 30)}, "
        "generation 10"
    )
    assert not decision.rewind, "reconciled, not rewound"


def test_a_stored_position_beyond_its_epoch_is_refused() -> None:
    with pytest.raises(ConfigError):
        decide_start(
            Opening("j", 0, own_cursor=True),
            joined=R(0, P(0, STEPS + 1), 2),
            ranks=(),
            aligned_starts={},
            incarnation="",
            positions=Epochs(),
        )


def test_steps_apart() -> None:
    assert steps_apart(Epochs(), P(0, 10), P(0, 12)) == 2
    assert steps_apart(Epochs(), P(0, 90), P(1, 5)) == 15
    assert steps_apart(Epochs(), P(0, 90), P(2, 0)) > FAR_BEHIND_STEPS
