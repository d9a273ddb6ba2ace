"""Elastic world size (docs/product.md guarantee 7): the rest of an epoch re-planned after a resize.

A world of W ranks stops part-way through an epoch (each rank at its own
step); the rest is re-planned for the new size, which may stop again. Over the
epoch every row is delivered exactly once, or dropped and reported.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Iterator
from types import SimpleNamespace

import numpy as np
import numpy.typing as npt
import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st

from ladle.service.errors import CheckpointMismatchError
from ladle.service.jobs import JobRegistry, plan_schedule, schedule_fingerprint
from ladle.service.schedule import Schedule, ScheduleConfig, build_schedule
from ladle.service.store import EmbeddedStore
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


# --- a resize at a checkpoint's position, against the stored cursors -------------------------
# Four trainers stopped at steps 894-917 and three resumed from rank 0's checkpoint at step 900:
# the resize was cut at 900 for every old rank, and old rank 1's batches 894-899 (its stored cursor
# said it never acknowledged them) were lost without a word. A stored cursor behind the checkpoint
# now refuses the resize, naming the ranks (JobRegistry._resize says why neither cut is safe).

LENGTHS = np.random.default_rng(3).integers(1, 300, 1500).astype(np.int64)
CONFIG = config_for("mixed", "split")


@pytest.fixture(scope="module")
def registry(tmp_path_factory: pytest.TempPathFactory) -> Iterator[JobRegistry]:
    root = tmp_path_factory.mktemp("elastic")
    dataset = SimpleNamespace(lengths=LENGTHS, fingerprint="ds", path=str(root), num_rows=len(LENGTHS))
    with EmbeddedStore(root / "state.db") as store:
        yield JobRegistry(dataset, CONFIG, store)  # type: ignore[arg-type]


_names = itertools.count()


def stopped_world(registry: JobRegistry, cursors: list[Position | None]) -> tuple[str, str]:
    """A new job whose rank r stopped at ``cursors[r]`` (None: never joined); its name and fingerprint."""
    name = f"job-{next(_names)}"
    fingerprint = registry.open(name, len(cursors)).fingerprint
    for rank, cursor in enumerate(cursors):
        if cursor is not None:
            generation = registry.store.join(name, rank, len(cursors)).generation
            registry.store.advance(name, rank, generation, cursor)
    return name, fingerprint


def served_once(old: Schedule, steps: list[int], plan: tuple[Resize, ...], size: int) -> None:
    """The old world's batches before ``steps`` and the re-planned rest hold every row once (or dropped)."""
    rest = plan_schedule(LENGTHS, CONFIG, 0, size, plan)
    rows = np.concatenate([old.rows_before(np.array(steps)), rest.scheduled_rows()])
    assert len(np.unique(rows)) == len(rows), "a row is served twice in the epoch"
    union = np.sort(np.concatenate([rows, rest.dropped.rows]))
    assert np.array_equal(union, np.arange(len(LENGTHS))), "a row is lost (neither served nor dropped)"


def test_a_rank_behind_the_checkpoint_refuses_the_resize_and_names_it(
    registry: JobRegistry, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(registry, "RESIZE_SETTLE_S", 0.2)
    s = 40  # the checkpoint's step; old rank 1 stopped 6 steps before it, the others after it
    steps = [s + 3, s - 6, s + 17, s + 5]
    name, fingerprint = stopped_world(registry, [Position(0, p) for p in steps])
    before = registry.store.get(name)
    with (
        caplog.at_level(logging.WARNING, logger="ladle.server"),
        pytest.raises(CheckpointMismatchError) as info,
    ):
        registry.open(name, 3, elastic=True, checkpoint=(Position(0, s), fingerprint))
    message = str(info.value)
    assert f"rank 1 (batches 0:{s - 6} up to 0:{s})" in message, message
    assert [r for r in range(4) if f"rank {r} (" in message] == [1], message
    assert "the job is unchanged" in message, message
    assert f"at or before 0:{s - 6}" in message, message
    assert f"rank 1 (batches 0:{s - 6} up to 0:{s})" in caplog.text, "the refusal is not logged"
    after = registry.store.get(name)
    assert (after.spec, after.plan, [r.position for r in after.ranks]) == (
        before.spec,
        before.plan,
        [r.position for r in before.ranks],
    ), "a refused resize changed the job"

    # started without the checkpoint's position, the cut is each rank's stored cursor: old rank 1's
    # batches 34-39 are in the re-plan, and every row of the epoch is served once
    registry.open(name, 3, elastic=True)
    state = registry.store.get(name)
    assert state.plan == (Resize(4, tuple(Position(0, p) for p in steps)),)
    served_once(build_schedule(LENGTHS, CONFIG, epoch=0, world_size=4), steps, state.plan, 3)


def test_cursors_past_the_checkpoint_are_cut_there_and_logged(
    registry: JobRegistry, caplog: pytest.LogCaptureFixture
) -> None:
    s = 40
    steps = [s + 3, s, s + 17, s + 5]
    name, fingerprint = stopped_world(registry, [Position(0, p) for p in steps])
    with caplog.at_level(logging.WARNING, logger="ladle.server"):
        registry.open(name, 3, elastic=True, checkpoint=(Position(0, s), fingerprint))
    state = registry.store.get(name)
    assert state.plan == (Resize(4, (Position(0, s),) * 4),)
    assert [r.position for r in state.ranks] == [Position(0, 0)] * 3
    served_once(build_schedule(LENGTHS, CONFIG, epoch=0, world_size=4), [s] * 4, state.plan, 3)
    warned = [r.getMessage() for r in caplog.records if "past the checkpoint" in r.getMessage()]
    assert len(warned) == 1, caplog.text
    for rank, step in ((0, s + 3), (2, s + 17), (3, s + 5)):
        assert f"rank {rank} (batches 0:{s} up to 0:{step})" in warned[0], warned[0]
    assert "rank 1 " not in warned[0], "a rank at the checkpoint disagrees with nothing"


def test_a_cursor_write_on_its_way_is_waited_for(registry: JobRegistry) -> None:
    """The old world's last acknowledgements reach the store just after the new world's first Open."""
    s = 40
    name, fingerprint = stopped_world(registry, [Position(0, s), Position(0, s - 1)])
    generation = registry.store.get(name).ranks[1].generation

    def late() -> None:
        time.sleep(0.2)
        registry.store.advance(name, 1, generation, Position(0, s))

    writer = threading.Thread(target=late)
    writer.start()
    try:
        registry.open(name, 3, elastic=True, checkpoint=(Position(0, s), fingerprint))
    finally:
        writer.join()
    assert registry.store.get(name).plan == (Resize(2, (Position(0, s),) * 2),)


def test_a_rank_no_trainer_joined_is_refused_at_once(
    registry: JobRegistry, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(registry, "RESIZE_SETTLE_S", 30.0)  # nothing is on its way for it: no wait
    name, fingerprint = stopped_world(registry, [Position(0, 4), None])
    began = time.monotonic()
    with pytest.raises(
        CheckpointMismatchError, match=r"rank 1 \(batches 0:0 up to 0:4, a rank no trainer ever"
    ):
        registry.open(name, 3, elastic=True, checkpoint=(Position(0, 4), fingerprint))
    assert time.monotonic() - began < 10


@st.composite
def stopped_worlds(draw: st.DrawFn) -> tuple[int, int, list[Position | None], Position]:
    """An old world's stored cursors (None: never joined), a checkpoint's position, a new size."""
    old = draw(st.integers(1, 6))
    new = draw(st.integers(1, 7).filter(lambda n: n != old))
    end = build_schedule(LENGTHS, CONFIG, epoch=0, world_size=old).num_steps
    # cursors near the checkpoint, on an epoch's end ((0, end) is (1, 0)) or in the next epoch
    position = st.one_of(
        st.builds(Position, st.just(0), st.integers(0, end)),
        st.builds(Position, st.just(1), st.integers(0, 3)),
    )
    cursors = draw(st.lists(st.one_of(st.none(), position), min_size=old, max_size=old))
    checkpoint = draw(st.builds(Position, st.just(0), st.integers(0, end)))
    return old, new, cursors, checkpoint


@settings(max_examples=60, deadline=None)
@given(stopped_worlds())
def test_a_checkpoint_resize_serves_every_row_once_or_names_the_ranks_behind(
    registry: JobRegistry, case: tuple[int, int, list[Position | None], Position]
) -> None:
    old_size, new_size, cursors, checkpoint = case
    old = build_schedule(LENGTHS, CONFIG, epoch=0, world_size=old_size)

    def normal(p: Position) -> Position:
        return Position(1, 0) if p == Position(0, old.num_steps) else p

    at = normal(checkpoint)
    behind = [r for r, c in enumerate(cursors) if normal(c or Position(0, 0)) < at]
    name, fingerprint = stopped_world(registry, cursors)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(registry, "RESIZE_SETTLE_S", 0.0)
        event("refused" if behind else "resized")
        if behind:
            with pytest.raises(CheckpointMismatchError) as info:
                registry.open(name, new_size, elastic=True, checkpoint=(checkpoint, fingerprint))
            named = [r for r in range(old_size) if f"rank {r} (" in str(info.value)]
            assert named == behind[:8], str(info.value)
            assert registry.store.get(name).spec.world_size == old_size, "a refused resize changed the job"
            return
        registry.open(name, new_size, elastic=True, checkpoint=(checkpoint, fingerprint))
    state = registry.store.get(name)
    assert state.plan == (Resize(old_size, (at,) * old_size),)
    if at.epoch == 0:  # the checkpoint's model has the old world's batches before it, the new world the rest
        served_once(old, [at.step] * old_size, state.plan, new_size)
