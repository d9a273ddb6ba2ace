"""Elastic world size (docs/product.md guarantee 7): the rest of an epoch re-planned after a resize.

A world of W ranks stops part-way through an epoch (each rank at its own
step); the rest is re-planned for the new size, which may stop again. Over the
epoch every row is delivered exactly once, or dropped and reported.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt
import pytest
from hypothesis import given
from hypothesis import strategies as st

from ladle.service.jobs import plan_schedule, schedule_fingerprint
from ladle.service.schedule import ScheduleConfig, build_schedule
from ladle.service.store.base import Position, Resize, resize_start

EPOCH = 1


def config_for(mode: str, remainder: str) -> ScheduleConfig:
    return ScheduleConfig(
        max_seq_len=256,
        bucket_bounds=(0, 32, 64, 128, 257),
        token_budget=1024,
        max_batch_size=16,
        rank_mode=mode,  # type: ignore[arg-type]
        remainder=remainder,  # type: ignore[arg-type]
        seed=5,
    )


def delivered(sched_rows: list[npt.NDArray[np.int64]]) -> npt.NDArray[np.int64]:
    return np.concatenate(sched_rows) if sched_rows else np.empty(0, dtype=np.int64)


@st.composite
def histories(draw: st.DrawFn) -> tuple[npt.NDArray[np.int64], ScheduleConfig, list[int], list[list[float]]]:
    n = draw(st.integers(200, 1500))
    seed = draw(st.integers(0, 2**31))
    lengths = np.random.default_rng(seed).integers(1, 300, n).astype(np.int64)
    config = config_for(draw(st.sampled_from(["mixed", "sync"])), draw(st.sampled_from(["split", "drop"])))
    sizes = draw(st.lists(st.integers(1, 9), min_size=2, max_size=4))
    # where each rank of each world but the last stops, as a fraction of the epoch
    stops = [draw(st.lists(st.floats(0, 1), min_size=w, max_size=w)) for w in sizes[:-1]]
    return lengths, config, sizes, stops


@given(histories())
def test_every_row_once_over_an_epoch_with_resizes(
    case: tuple[npt.NDArray[np.int64], ScheduleConfig, list[int], list[list[float]]],
) -> None:
    lengths, config, sizes, stops = case
    try:
        first = build_schedule(lengths, config, epoch=EPOCH, world_size=sizes[0])
    except Exception:
        return  # too few rows for the first world: not what this test is about
    plan: tuple[Resize, ...] = ()
    got: list[npt.NDArray[np.int64]] = []
    sched = first
    for world, fractions in zip(sizes[:-1], stops, strict=True):
        assert sched.world_size == world
        steps = [min(sched.num_steps, int(f * (sched.num_steps + 1))) for f in fractions]
        cut = tuple(Position(EPOCH, s) if s < sched.num_steps else Position(EPOCH + 1, 0) for s in steps)
        got.append(sched.rows_before(np.array(steps)))
        plan = (*plan, Resize(world, cut))
        sched = plan_schedule(lengths, config, EPOCH, sizes[len(plan)], plan)
        again = plan_schedule(lengths, config, EPOCH, sizes[len(plan)], plan)
        assert sched.content_hash() == again.content_hash(), "a re-plan must be deterministic"
        if resize_start(cut).epoch > EPOCH:
            got.append(np.empty(0, dtype=np.int64))
            break  # every rank had finished the epoch: the new world starts the next one
    else:
        got.append(sched.scheduled_rows())  # the last world runs the epoch to its end
    rows = delivered(got)
    assert len(np.unique(rows)) == len(rows), "a row was delivered twice in one epoch"
    # (a world that finished the epoch leaves it as it was: plan_schedule keeps that world's schedule)
    dropped = sched.dropped.rows
    union = np.sort(np.concatenate([rows, dropped]))
    assert np.array_equal(union, np.arange(len(lengths))), "a row was lost (neither delivered nor dropped)"


def test_a_resize_changes_only_the_epochs_it_cuts() -> None:
    lengths = np.random.default_rng(1).integers(1, 300, 3000).astype(np.int64)
    config = config_for("mixed", "split")
    old = build_schedule(lengths, config, epoch=EPOCH, world_size=4)
    plan = (Resize(4, (Position(EPOCH, 3), Position(EPOCH, 3), Position(EPOCH, 4), Position(EPOCH, 2))),)
    before = plan_schedule(lengths, config, EPOCH - 1, 3, plan)
    assert before.content_hash() == build_schedule(lengths, config, epoch=0, world_size=4).content_hash(), (
        "an epoch the old world finished keeps its schedule"
    )
    after = plan_schedule(lengths, config, EPOCH + 1, 3, plan)
    assert after.content_hash() == build_schedule(lengths, config, epoch=2, world_size=3).content_hash()
    rest = plan_schedule(lengths, config, EPOCH, 3, plan)
    assert rest.world_size == 3
    consumed = old.rows_before(np.array([3, 3, 4, 2]))
    assert len(np.intersect1d(rest.scheduled_rows(), consumed)) == 0
    assert rest.bounds == old.bounds
    assert rest.num_steps < old.num_steps * 4 // 3 + 1


def test_the_fingerprint_names_the_resize_history() -> None:
    plain = schedule_fingerprint("d", "c", 3)
    assert plain == schedule_fingerprint("d", "c", 3, ()), "a job never resized keeps its fingerprint"
    one = schedule_fingerprint("d", "c", 3, (Resize(4, (Position(1, 2),) * 4),))
    other = schedule_fingerprint("d", "c", 3, (Resize(4, (Position(1, 3),) * 4),))
    assert len({plain, one, other}) == 3


def test_a_remainder_smaller_than_a_step_is_dropped_and_reported() -> None:
    lengths = np.full(64, 100, dtype=np.int64)
    config = config_for("mixed", "split")
    old = build_schedule(lengths, config, epoch=EPOCH, world_size=2)
    last = old.num_steps - 1
    plan = (Resize(2, (Position(EPOCH, last), Position(EPOCH + 1, 0))),)
    rest = plan_schedule(lengths, config, EPOCH, 64, plan)
    left = old.samples(last, 0)
    if rest.num_steps == 0:
        assert np.array_equal(np.sort(rest.dropped.rows), np.sort(left))
    else:
        assert np.array_equal(
            np.sort(np.concatenate([rest.scheduled_rows(), rest.dropped.rows])), np.sort(left)
        )


def test_rows_before_checks_its_input() -> None:
    sched = build_schedule(np.arange(1, 200, dtype=np.int64), config_for("mixed", "split"), world_size=2)
    with pytest.raises(ValueError, match="non-negative steps"):
        sched.rows_before(np.array([1, 2, 3]))
    assert len(sched.rows_before(np.array([0, 0]))) == 0
    assert np.array_equal(
        np.sort(sched.rows_before(np.array([10**6, 10**6]))), np.sort(sched.scheduled_rows())
    )
