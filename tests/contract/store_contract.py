"""The cursor-store contract as a reusable test suite: every store must pass all of it.

A store's test module subclasses ``StoreContract`` and provides the fixture
``make_store``: a ``MakeStore`` that, called with a clock, returns a new
handle on ONE backing store, empty at the start of each test (for example
several ``EmbeddedStore`` objects on one file in ``tmp_path``); the fixture
closes what it made. A store that several processes can open also overrides
``process_factory`` with a picklable zero-argument callable that opens
another handle on the same backing store (for a spawned process).

This module is not collected by itself (its name and classes do not match
pytest's patterns); it is imported as ``tests.contract.store_contract``.
"""

from __future__ import annotations

import multiprocessing
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ladle.service.errors import (
    ConfigError,
    CursorRegressionError,
    FencedError,
    JobMismatchError,
    JobNotFoundError,
    LadleError,
    StoreUnavailableError,
    WorldSizeMismatchError,
)
from ladle.service.store.base import (
    Clock,
    CursorStore,
    JobSpec,
    JobState,
    Position,
    RankState,
    Resize,
    resize_start,
)

__all__ = ["SPEC", "MakeStore", "ManualClock", "StoreContract", "StoreFactory"]

MakeStore = Callable[[Clock], CursorStore]
StoreFactory = Callable[[], CursorStore]

SPEC = JobSpec("run-42", "dataset-aaaa", "config-bbbb", 4)
T0 = 1_000_000.0


class ManualClock:
    """A clock that moves only when told (every read inside one operation sees the same time)."""

    def __init__(self, now: float = T0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def tick(self, seconds: float = 1.0) -> float:
        self.now += seconds
        return self.now


# --- concurrency workers (module level so that spawned processes can import them) ---


@dataclass
class WorkerResult:
    final: Position
    shared_generations: list[int]
    errors: list[str] = field(default_factory=list)
    # (began, ended, generation) of each join of the shared rank, on the system-wide monotonic clock
    claims: list[tuple[float, float, int]] = field(default_factory=list)


def advance_and_join(
    store: CursorStore, job: str, rank: int, shared_rank: int, world_size: int, steps: int, join_every: int
) -> WorkerResult:
    """Advance ``rank`` by one step ``steps`` times; join ``shared_rank`` every ``join_every`` steps."""
    generation = store.join(job, rank, world_size).generation
    result = WorkerResult(Position(0, 0), [])
    for i in range(steps):
        state = store.advance(job, rank, generation, Position(0, i + 1))
        if state.position != Position(0, i + 1) or state.generation != generation:
            result.errors.append(f"advance {i + 1} of rank {rank} returned {state}")
        result.final = state.position
        if i % join_every == 0:
            began = time.monotonic()
            claimed = store.join(job, shared_rank, world_size).generation
            result.claims.append((began, time.monotonic(), claimed))
            result.shared_generations.append(claimed)
    return result


def check_real_time_order(claims: list[tuple[float, float, int]]) -> None:
    """A claim that ended before another began holds the smaller number (linearizable claims)."""
    by_end = sorted(claims, key=lambda c: c[1])
    ended, highest = 0, 0
    for began, _, number in sorted(claims):
        while ended < len(by_end) and by_end[ended][1] < began:
            highest = max(highest, by_end[ended][2])
            ended += 1
        assert highest < number, f"claim {number} began after claim {highest} had ended, yet is not larger"


def process_worker(
    factory: StoreFactory, job: str, rank: int, shared_rank: int, world_size: int, steps: int, join_every: int
) -> WorkerResult:
    with factory() as store:
        return advance_and_join(store, job, rank, shared_rank, world_size, steps, join_every)


# --- a model of the contract for the property test ---------------------------


@dataclass
class ModelJob:
    spec: JobSpec
    created: float
    updated: float
    ranks: list[RankState]
    plan: tuple[Resize, ...] = ()

    def state(self) -> JobState:
        return JobState(self.spec, tuple(self.ranks), self.created, self.updated, "", self.plan)


def anonymous(value: Any) -> Any:
    """``value`` with every JobState's random incarnation blanked (the model has none)."""
    if isinstance(value, JobState):
        return replace(value, incarnation="")
    if isinstance(value, list):
        return [anonymous(v) for v in value]
    return value


class Model:
    """The contract in a few lines of plain Python, one job dict, no concurrency."""

    def __init__(self) -> None:
        self.jobs: dict[str, ModelJob] = {}

    def open_job(self, spec: JobSpec, reset: bool, now: float) -> JobState:
        if reset:
            self.jobs.pop(spec.job, None)
        if spec.job in self.jobs:
            stored = self.jobs[spec.job]
            fields = [
                f
                for f in ("dataset_fingerprint", "config_fingerprint")
                if getattr(stored.spec, f) != getattr(spec, f)
            ]
            if fields:
                raise JobMismatchError(spec.job, tuple((f, "", "") for f in fields))
            if stored.spec.world_size != spec.world_size:
                raise WorldSizeMismatchError(spec.job, stored.spec.world_size, spec.world_size)
            return stored.state()
        ranks = [RankState(r, Position(0, 0), 0, now) for r in range(spec.world_size)]
        self.jobs[spec.job] = ModelJob(spec, now, now, ranks)
        return self.jobs[spec.job].state()

    def job(self, job: str) -> ModelJob:
        if job not in self.jobs:
            raise JobNotFoundError(job)
        return self.jobs[job]

    def join(self, job: str, rank: int, world_size: int, now: float) -> RankState:
        if not 0 <= rank < world_size:
            raise ConfigError("rank", "outside")
        stored = self.job(job)
        if stored.spec.world_size != world_size:
            raise WorldSizeMismatchError(job, stored.spec.world_size, world_size)
        old = stored.ranks[rank]
        stored.ranks[rank] = replace(old, generation=old.generation + 1, last_seen=now)
        stored.updated = now
        return stored.ranks[rank]

    def move(self, job: str, rank: int, generation: int, to: Position, kind: str, now: float) -> RankState:
        if generation < 1:
            raise ConfigError("generation", "< 1")
        stored = self.job(job)
        if rank >= stored.spec.world_size:
            raise ConfigError("rank", "outside")
        old = stored.ranks[rank]
        if generation != old.generation and not (kind == "reconcile" and generation > old.generation):
            raise FencedError(job, rank, generation, old.generation)
        if kind == "advance" and to < old.position:
            raise CursorRegressionError(job, rank, (0, 0), (0, 0))
        stored.ranks[rank] = replace(old, position=to, generation=generation, last_seen=now)
        stored.updated = now
        return stored.ranks[rank]

    def resize(self, job: str, old: int, new: int, cut: tuple[Position, ...] | None, now: float) -> JobState:
        stored = self.job(job)
        if stored.spec.world_size == new:
            return stored.state()
        if stored.spec.world_size != old:
            raise WorldSizeMismatchError(job, stored.spec.world_size, old)
        cut = cut if cut is not None else tuple(r.position for r in stored.ranks)
        generation = max(r.generation for r in stored.ranks) + 1
        stored.ranks = [RankState(r, resize_start(cut), generation, now) for r in range(new)]
        stored.plan = (*stored.plan, Resize(old, cut))
        stored.spec = replace(stored.spec, world_size=new)
        stored.updated = now
        return stored.state()


@dataclass(frozen=True)
class Op:
    kind: str
    job: str
    spec: JobSpec
    reset: bool
    rank: int
    world_size: int
    generation_delta: int
    to: Position


JOB_NAMES = ("job-a", "job-b")
# Both jobs are opened with START_SPECS and every rank joined first; the draws below lean towards
# requests that succeed (the same spec, world size 3, the current generation)
# so that long sequences of cursor moves are compared, not just refusals.
START_SPECS = tuple(JobSpec(job, "d1", "c1", 3) for job in JOB_NAMES)
OPS = st.builds(
    Op,
    kind=st.sampled_from(
        ["join"] * 3 + ["advance"] * 5 + ["rewind"] * 2 + ["open", "get", "delete", "resize", "reconcile"]
    ),
    job=st.sampled_from(JOB_NAMES),
    spec=st.builds(
        JobSpec,
        job=st.sampled_from(JOB_NAMES),
        dataset_fingerprint=st.sampled_from(["d1", "d1", "d2"]),
        config_fingerprint=st.sampled_from(["c1", "c1", "c2"]),
        world_size=st.sampled_from([3, 3, 2]),
    ),
    reset=st.booleans(),
    rank=st.sampled_from([0, 1, 2, 0, 1, 2, 3]),
    world_size=st.sampled_from([3, 3, 3, 2]),
    generation_delta=st.sampled_from([0, 0, 0, 0, -1, 1]),
    to=st.builds(Position, epoch=st.integers(0, 2), step=st.integers(0, 4)),
)


def _outcome(call: Callable[..., Any], *args: Any) -> tuple[str, Any]:
    """``("ok", result)`` or ``("error", the LadleError's type)``."""
    try:
        return ("ok", anonymous(call(*args)))
    except LadleError as exc:
        return ("error", type(exc))


def _on_store(store: CursorStore, op: Op, generation: int) -> Any:
    if op.kind == "open":
        return store.open_job(op.spec, reset=op.reset)
    if op.kind == "join":
        return store.join(op.job, op.rank, op.world_size)
    if op.kind == "advance":
        return store.advance(op.job, op.rank, generation, op.to)
    if op.kind == "rewind":
        return store.rewind(op.job, op.rank, generation, op.to)
    if op.kind == "reconcile":
        return store.reconcile(op.job, op.rank, generation, op.to)
    if op.kind == "resize":
        return store.resize(op.job, op.world_size, 5 - op.world_size, _cut(op))
    if op.kind == "get":
        return store.get(op.job)
    return store.delete_job(op.job)


def _cut(op: Op) -> tuple[Position, ...] | None:
    """Resize ops take the stored cursors when ``reset`` is drawn, else a checkpoint's position."""
    return None if op.reset else (op.to,) * op.world_size


def _on_model(model: Model, op: Op, generation: int, now: float) -> Any:
    if op.kind == "open":
        return model.open_job(op.spec, op.reset, now)
    if op.kind == "join":
        return model.join(op.job, op.rank, op.world_size, now)
    if op.kind in ("advance", "rewind", "reconcile"):
        return model.move(op.job, op.rank, generation, op.to, op.kind, now)
    if op.kind == "resize":
        return model.resize(op.job, op.world_size, 5 - op.world_size, _cut(op), now)
    if op.kind == "get":
        return model.job(op.job).state()
    return model.jobs.pop(op.job, None) is not None


class StoreContract:
    """Subclass as ``class TestMyStore(StoreContract)`` and provide the ``make_store`` fixture."""

    # Subclasses override these two fixtures, asking for the fixtures they need.

    @pytest.fixture
    def make_store(self, *args: Any, **kwargs: Any) -> Iterator[MakeStore]:
        """Yield a ``MakeStore`` on one fresh backing store; afterwards close every handle it made."""
        pytest.fail("a StoreContract subclass must provide the make_store fixture")

    @pytest.fixture
    def process_factory(self, *args: Any, **kwargs: Any) -> StoreFactory | None:
        """A picklable opener of the same backing store for spawned processes; None skips that test."""
        return None

    @pytest.fixture
    def clock(self) -> ManualClock:
        return ManualClock()

    @pytest.fixture
    def store(self, make_store: MakeStore, clock: ManualClock) -> CursorStore:
        return make_store(clock)

    @pytest.fixture
    def opened(self, store: CursorStore) -> CursorStore:
        store.open_job(SPEC)
        return store

    # --- open_job -----------------------------------------------------------

    def test_open_creates_every_rank_at_the_start(self, store: CursorStore, clock: ManualClock) -> None:
        state = store.open_job(SPEC)
        assert state.spec == SPEC
        assert state.job == SPEC.job
        assert state.created == state.updated == clock.now
        assert state.ranks == tuple(RankState(r, Position(0, 0), 0, clock.now) for r in range(4)), (
            "a new job must start every rank at (0, 0), generation 0"
        )
        assert store.get(SPEC.job) == state

    def test_reopen_with_the_same_spec_returns_the_stored_state(
        self, opened: CursorStore, clock: ManualClock
    ) -> None:
        generation = opened.join(SPEC.job, 2, 4).generation
        opened.advance(SPEC.job, 2, generation, Position(0, 5))
        before = opened.get(SPEC.job)
        clock.tick()
        assert opened.open_job(SPEC) == before, "reopening a job must not change it"
        assert opened.get(SPEC.job) == before

    @pytest.mark.parametrize("field_name", ["dataset_fingerprint", "config_fingerprint"])
    def test_mismatch_names_the_field_and_both_values(self, opened: CursorStore, field_name: str) -> None:
        before = opened.get(SPEC.job)
        if field_name == "dataset_fingerprint":
            other = replace(SPEC, dataset_fingerprint="other-value")
        else:
            other = replace(SPEC, config_fingerprint="other-value")
        with pytest.raises(JobMismatchError) as info:
            opened.open_job(other)
        assert info.value.kind == "failed_precondition"
        assert info.value.fields == (field_name,)
        message = str(info.value)
        assert field_name in message
        assert repr(getattr(SPEC, field_name)) in message, "the message must give the stored value"
        assert "'other-value'" in message, "the message must give the new value"
        assert opened.get(SPEC.job) == before, "a refused open must change nothing"

    def test_mismatch_of_both_fingerprints_names_both(self, opened: CursorStore) -> None:
        with pytest.raises(JobMismatchError) as info:
            opened.open_job(replace(SPEC, dataset_fingerprint="d2", config_fingerprint="c2"))
        assert info.value.fields == ("dataset_fingerprint", "config_fingerprint")

    def test_world_size_mismatch_is_its_own_error(self, opened: CursorStore) -> None:
        with pytest.raises(WorldSizeMismatchError) as info:
            opened.open_job(replace(SPEC, world_size=8))
        assert not issubclass(WorldSizeMismatchError, JobMismatchError), "keep the two errors apart"
        assert info.value.kind == "failed_precondition"
        assert (info.value.stored, info.value.given) == (4, 8)
        assert "world_size=4" in str(info.value)
        assert "world_size=8" in str(info.value)

    def test_reset_recreates_the_job(self, opened: CursorStore, clock: ManualClock) -> None:
        generation = opened.join(SPEC.job, 0, 4).generation
        opened.advance(SPEC.job, 0, generation, Position(1, 3))
        clock.tick()
        other = replace(SPEC, dataset_fingerprint="dataset-new", world_size=2)
        state = opened.open_job(other, reset=True)
        assert state.spec == other
        assert state.created == clock.now
        assert state.ranks == tuple(RankState(r, Position(0, 0), 0, clock.now) for r in range(2))
        assert opened.get(SPEC.job) == state
        # reset of a job with the same spec also starts it over
        generation = opened.join(SPEC.job, 1, 2).generation
        opened.advance(SPEC.job, 1, generation, Position(0, 9))
        assert opened.open_job(other, reset=True).ranks[1] == RankState(1, Position(0, 0), 0, clock.now)

    # --- join and fencing ---------------------------------------------------

    def test_join_increments_the_generation_and_keeps_the_position(
        self, opened: CursorStore, clock: ManualClock
    ) -> None:
        first = opened.join(SPEC.job, 1, 4)
        assert first.generation == 1
        opened.advance(SPEC.job, 1, first.generation, Position(0, 7))
        clock.tick()
        second = opened.join(SPEC.job, 1, 4)
        assert second == RankState(1, Position(0, 7), 2, clock.now)
        assert opened.get(SPEC.job).ranks[0].generation == 0, "join changed another rank"

    def test_join_errors(self, opened: CursorStore) -> None:
        with pytest.raises(JobNotFoundError) as not_found:
            opened.join("no-such-job", 0, 4)
        assert not_found.value.kind == "not_found"
        for rank in (-1, 4, 100):
            with pytest.raises(ConfigError) as bad_rank:
                opened.join(SPEC.job, rank, 4)
            assert bad_rank.value.field == "rank"
        with pytest.raises(WorldSizeMismatchError):
            opened.join(SPEC.job, 0, 2)
        assert all(r.generation == 0 for r in opened.get(SPEC.job).ranks), "a refused join changed state"

    def test_a_replaced_process_cannot_advance_or_rewind(self, opened: CursorStore) -> None:
        old = opened.join(SPEC.job, 3, 4).generation
        opened.advance(SPEC.job, 3, old, Position(0, 2))
        new = opened.join(SPEC.job, 3, 4).generation
        assert new == old + 1
        before = opened.get(SPEC.job)
        for op in (opened.advance, opened.rewind):
            with pytest.raises(FencedError) as info:
                op(SPEC.job, 3, old, Position(0, 5))
            assert info.value.kind == "failed_precondition"
            assert "replaced" in str(info.value), "a FencedError must say the process was replaced"
            assert (info.value.generation, info.value.current) == (old, new)
        assert opened.get(SPEC.job) == before, "a fenced call changed state"
        assert opened.advance(SPEC.job, 3, new, Position(0, 5)).position == Position(0, 5)

    def test_a_generation_from_the_future_is_fenced(self, opened: CursorStore) -> None:
        generation = opened.join(SPEC.job, 0, 4).generation
        with pytest.raises(FencedError) as info:
            opened.advance(SPEC.job, 0, generation + 1, Position(0, 1))
        assert info.value.current == generation
        assert "lost" in str(info.value)

    # --- advance and rewind -------------------------------------------------

    def test_advance_moves_forward_and_accepts_batched_acknowledgements(
        self, opened: CursorStore, clock: ManualClock
    ) -> None:
        generation = opened.join(SPEC.job, 0, 4).generation
        for to in (Position(0, 1), Position(0, 6), Position(2, 0), Position(2, 3)):
            clock.tick()
            assert opened.advance(SPEC.job, 0, generation, to) == RankState(0, to, generation, clock.now)
        clock.tick()
        same = opened.advance(SPEC.job, 0, generation, Position(2, 3))
        assert same == RankState(0, Position(2, 3), generation, clock.now), "equal must refresh last_seen"
        assert opened.get(SPEC.job).updated == clock.now

    @pytest.mark.parametrize("to", [Position(2, 2), Position(1, 9), Position(0, 0)])
    def test_advance_backwards_is_refused_and_keeps_the_position(
        self, opened: CursorStore, to: Position
    ) -> None:
        generation = opened.join(SPEC.job, 0, 4).generation
        opened.advance(SPEC.job, 0, generation, Position(2, 3))
        before = opened.get(SPEC.job)
        with pytest.raises(CursorRegressionError) as info:
            opened.advance(SPEC.job, 0, generation, to)
        assert info.value.kind == "failed_precondition"
        assert (info.value.stored, info.value.given) == ((2, 3), (to.epoch, to.step))
        assert opened.get(SPEC.job) == before, "a refused advance changed state"

    def test_rewind_moves_only_this_rank_either_way(self, opened: CursorStore, clock: ManualClock) -> None:
        generations = [opened.join(SPEC.job, r, 4).generation for r in range(4)]
        for r in range(4):
            opened.advance(SPEC.job, r, generations[r], Position(1, 10 + r))
        before = opened.get(SPEC.job)
        clock.tick()
        assert opened.rewind(SPEC.job, 1, generations[1], Position(0, 2)).position == Position(0, 2)
        assert opened.rewind(SPEC.job, 1, generations[1], Position(3, 7)).position == Position(3, 7)
        after = opened.get(SPEC.job)
        assert after.ranks[1] == RankState(1, Position(3, 7), generations[1], clock.now)
        for r in (0, 2, 3):
            assert after.ranks[r] == before.ranks[r], f"rewinding rank 1 changed rank {r}"

    def test_advance_and_rewind_errors(self, opened: CursorStore) -> None:
        generation = opened.join(SPEC.job, 0, 4).generation
        for op in (opened.advance, opened.rewind):
            with pytest.raises(JobNotFoundError):
                op("no-such-job", 0, 1, Position(0, 1))
            with pytest.raises(ConfigError) as rank:
                op(SPEC.job, 4, generation, Position(0, 1))
            assert rank.value.field == "rank"
            with pytest.raises(ConfigError) as negative:
                op(SPEC.job, -1, generation, Position(0, 1))
            assert negative.value.field == "rank"
            with pytest.raises(ConfigError) as gen:
                op(SPEC.job, 0, 0, Position(0, 1))
            assert gen.value.field == "generation"

    # --- get, list, delete --------------------------------------------------

    def test_get_list_delete(self, store: CursorStore) -> None:
        assert store.list_jobs() == []
        b = store.open_job(replace(SPEC, job="b-job"))
        a = store.open_job(replace(SPEC, job="a-job", world_size=2))
        assert store.list_jobs() == [a, b], "list_jobs must give every job, sorted by name"
        assert store.delete_job("a-job") is True
        assert store.delete_job("a-job") is False
        assert store.list_jobs() == [b]
        with pytest.raises(JobNotFoundError):
            store.get("a-job")
        with pytest.raises(JobNotFoundError):
            store.join("a-job", 0, 2)
        # a deleted name can be opened afresh, with another spec
        assert store.open_job(replace(SPEC, job="a-job")).spec.world_size == 4

    def test_unknown_jobs(self, store: CursorStore) -> None:
        with pytest.raises(JobNotFoundError) as info:
            store.get("nothing-here")
        assert info.value.kind == "not_found"
        assert "nothing-here" in str(info.value)
        assert store.delete_job("nothing-here") is False

    # --- validation ---------------------------------------------------------

    @pytest.mark.parametrize("name", ["", "x" * 201, "has space", "a/b", "ünï", "tab\t", "new\nline"])
    def test_bad_job_names_are_refused(self, store: CursorStore, name: str) -> None:
        with pytest.raises(ConfigError) as info:
            JobSpec(name, "d", "c", 1)
        assert info.value.field == "job"
        assert info.value.kind == "invalid_argument"
        for call in (
            lambda: store.get(name),
            lambda: store.delete_job(name),
            lambda: store.join(name, 0, 1),
            lambda: store.advance(name, 0, 1, Position(0, 0)),
            lambda: store.rewind(name, 0, 1, Position(0, 0)),
        ):
            with pytest.raises(ConfigError) as again:
                call()
            assert again.value.field == "job"

    def test_good_job_names_are_accepted(self, store: CursorStore) -> None:
        for name in ("x" * 200, "a", "run-42:stage.1_b", "A.B-C:D_E"):
            assert store.open_job(replace(SPEC, job=name)).job == name

    def test_bad_values_are_refused(self) -> None:
        for args, name in (
            ((-1, 0), "epoch"),
            ((0, -1), "step"),
            ((2**53, 0), "epoch"),
            ((True, 0), "epoch"),
        ):
            with pytest.raises(ConfigError) as info:
                Position(*args)
            assert info.value.field == name
        for kwargs, name in (
            ({"world_size": 0}, "world_size"),
            ({"world_size": 65537}, "world_size"),
            ({"dataset_fingerprint": ""}, "dataset_fingerprint"),
            ({"config_fingerprint": "x" * 257}, "config_fingerprint"),
        ):
            with pytest.raises(ConfigError) as info:
                replace(SPEC, **kwargs)
            assert info.value.field == name

    def test_positions_are_ordered_by_epoch_then_step(self) -> None:
        assert Position(0, 9) < Position(1, 0) < Position(1, 1)
        assert max(Position(2, 0), Position(1, 99)) == Position(2, 0)

    # --- time, ping, lifetime -----------------------------------------------

    def test_last_seen_and_updated_use_the_clock(self, opened: CursorStore, clock: ManualClock) -> None:
        created = clock.now
        clock.now = T0 + 100
        generation = opened.join(SPEC.job, 2, 4).generation
        clock.now = T0 + 250
        opened.advance(SPEC.job, 2, generation, Position(0, 1))
        state = opened.get(SPEC.job)
        assert state.ranks[2].last_seen == T0 + 250
        assert [r.last_seen for r in state.ranks if r.rank != 2] == [created] * 3
        assert (state.created, state.updated) == (created, T0 + 250)

    def test_ping_close_and_context_manager(self, make_store: MakeStore) -> None:
        with make_store(time.time) as store:
            store.ping()
            store.open_job(SPEC)
        with pytest.raises(StoreUnavailableError) as info:
            store.ping()
        assert info.value.kind == "unavailable"
        with pytest.raises(StoreUnavailableError):
            store.get(SPEC.job)
        store.close()  # idempotent
        with make_store(time.time) as other:
            assert other.get(SPEC.job).spec == SPEC, "state must outlive the handle that wrote it"

    # --- concurrency --------------------------------------------------------

    def test_threads_lose_no_update(self, make_store: MakeStore) -> None:
        threads, steps, join_every = 8, 60, 6
        shared_rank = world_size = threads
        spec = replace(SPEC, world_size=world_size + 1)
        shared = make_store(time.time)
        shared.open_job(spec)
        # half the threads share one handle, half open their own
        handles = [shared if t % 2 == 0 else make_store(time.time) for t in range(threads)]
        barrier = threading.Barrier(threads)
        results: list[WorkerResult | BaseException] = [RuntimeError("did not run")] * threads

        def work(t: int) -> None:
            try:
                barrier.wait(timeout=30)
                results[t] = advance_and_join(
                    handles[t], spec.job, t, shared_rank, world_size + 1, steps, join_every
                )
            except BaseException as exc:
                results[t] = exc

        pool = [threading.Thread(target=work, args=(t,)) for t in range(threads)]
        for thread in pool:
            thread.start()
        for thread in pool:
            thread.join(timeout=120)
        self._check_no_lost_update(shared, spec, results, steps, join_every)

    def test_processes_lose_no_update(
        self, make_store: MakeStore, process_factory: StoreFactory | None
    ) -> None:
        if process_factory is None:
            pytest.skip("this store is not shared between processes")
        processes, steps, join_every = 4, 60, 6
        shared_rank = world_size = processes
        spec = replace(SPEC, world_size=world_size + 1)
        store = make_store(time.time)
        store.open_job(spec)
        args = [
            (process_factory, spec.job, p, shared_rank, world_size + 1, steps, join_every)
            for p in range(processes)
        ]
        with multiprocessing.get_context("spawn").Pool(processes) as pool:
            results: list[WorkerResult | BaseException] = list(
                pool.starmap_async(process_worker, args).get(timeout=240)
            )
        self._check_no_lost_update(store, spec, results, steps, join_every)

    @staticmethod
    def _check_no_lost_update(
        store: CursorStore,
        spec: JobSpec,
        results: list[WorkerResult | BaseException],
        steps: int,
        join_every: int,
    ) -> None:
        failures = [r for r in results if isinstance(r, BaseException)]
        assert not failures, f"workers failed: {failures!r}"
        done = [r for r in results if isinstance(r, WorkerResult)]
        assert not [e for r in done for e in r.errors], "an advance returned a wrong state"
        state = store.get(spec.job)
        workers = len(done)
        for w in range(workers):
            assert state.ranks[w].position == Position(0, steps), (
                f"lost update: rank {w} is not at step {steps}"
            )
            assert state.ranks[w].generation == 1
        check_real_time_order([c for r in done for c in r.claims])
        generations = sorted(g for r in done for g in r.shared_generations)
        joins = workers * len(range(0, steps, join_every))
        assert generations == list(range(1, joins + 1)), "concurrent joins returned duplicate generations"
        assert state.ranks[workers].generation == joins, "a concurrent join was lost"

    def test_exactly_one_of_two_racing_advances_wins(self, make_store: MakeStore) -> None:
        """Two processes of one rank join, then both advance from the same position: only the newer wins."""
        rounds = 40
        store = make_store(time.time)
        store.open_job(SPEC)
        handles = [store, make_store(time.time)]
        barrier = threading.Barrier(2)
        outcomes: list[list[tuple[int, str]]] = [[], []]
        errors: list[BaseException] = []

        def racer(i: int) -> None:
            try:
                for n in range(rounds):
                    barrier.wait(timeout=30)
                    generation = handles[i].join(SPEC.job, 0, 4).generation
                    barrier.wait(timeout=30)
                    try:
                        handles[i].advance(SPEC.job, 0, generation, Position(0, n + 1))
                        outcomes[i].append((generation, "won"))
                    except FencedError:
                        outcomes[i].append((generation, "fenced"))
            except BaseException as exc:
                errors.append(exc)
                barrier.abort()

        pool = [threading.Thread(target=racer, args=(i,)) for i in range(2)]
        for thread in pool:
            thread.start()
        for thread in pool:
            thread.join(timeout=120)
        assert not errors, f"racers failed: {errors!r}"
        for n, (a, b) in enumerate(zip(*outcomes, strict=True)):
            assert sorted([a[1], b[1]]) == ["fenced", "won"], f"round {n}: {a}, {b} (want exactly one winner)"
            assert max(a, b)[1] == "won", f"round {n}: the older process won"
        state = store.get(SPEC.job).ranks[0]
        assert state.position == Position(0, rounds)
        assert state.generation == 2 * rounds

    def test_a_join_racing_an_advance_is_linearizable(self, make_store: MakeStore) -> None:
        """An advance racing a join either lands first (and counts) or is fenced (and changes nothing)."""
        rounds = 40
        store = make_store(time.time)
        store.open_job(SPEC)
        other = make_store(time.time)
        barrier = threading.Barrier(2)
        won: list[bool] = []
        errors: list[BaseException] = []

        def advancer() -> None:
            try:
                for _ in range(rounds):
                    generation = store.join(SPEC.job, 0, 4).generation
                    barrier.wait(timeout=30)
                    try:
                        store.advance(SPEC.job, 0, generation, Position(0, sum(won) + 1))
                        won.append(True)
                    except FencedError:
                        won.append(False)
                    barrier.wait(timeout=30)
            except BaseException as exc:
                errors.append(exc)
                barrier.abort()

        def joiner() -> None:
            try:
                for _ in range(rounds):
                    barrier.wait(timeout=30)
                    other.join(SPEC.job, 0, 4)
                    barrier.wait(timeout=30)
            except BaseException as exc:
                errors.append(exc)
                barrier.abort()

        pool = [threading.Thread(target=advancer), threading.Thread(target=joiner)]
        for thread in pool:
            thread.start()
        for thread in pool:
            thread.join(timeout=120)
        assert not errors, f"threads failed: {errors!r}"
        state = store.get(SPEC.job).ranks[0]
        assert state.position == Position(0, sum(won)), "an advance was lost, or applied while fenced"
        assert state.generation == 2 * rounds, "a join was lost"

    # --- incarnation, resize, reconcile ------------------------------------

    def test_a_new_job_gets_a_fresh_incarnation(self, store: CursorStore) -> None:
        first = store.open_job(SPEC)
        assert len(first.incarnation) >= 8
        assert store.open_job(SPEC).incarnation == first.incarnation, "reopening keeps the incarnation"
        again = store.open_job(SPEC, reset=True)
        assert again.incarnation != first.incarnation, "a reset job is a new incarnation"

    def test_a_lost_job_comes_back_with_what_the_server_knew(self, store: CursorStore) -> None:
        plan = (Resize(2, (Position(1, 3), Position(1, 4))),)
        state = store.open_job(SPEC, incarnation="abc123", plan=plan)
        assert (state.incarnation, state.plan) == ("abc123", plan)
        assert store.get(SPEC.job).plan == plan
        assert store.open_job(SPEC, incarnation="other").incarnation == "abc123", "ignored for a known job"
        with pytest.raises(ConfigError):
            store.open_job(replace(SPEC, job="x"), incarnation="")

    def test_resize_records_the_cut_and_restarts_every_rank(
        self, opened: CursorStore, clock: ManualClock
    ) -> None:
        generations = [opened.join(SPEC.job, r, 4).generation for r in range(4)]
        for r, g in enumerate(generations):
            opened.advance(SPEC.job, r, g, Position(2, 10 + r))
        opened.join(SPEC.job, 1, 4)  # rank 1 is at generation 2 now: the highest
        clock.tick()
        state = opened.resize(SPEC.job, 4, 3)
        cut = (Position(2, 10), Position(2, 11), Position(2, 12), Position(2, 13))
        assert state.plan == (Resize(4, cut),)
        assert state.spec == replace(SPEC, world_size=3)
        assert state.ranks == tuple(RankState(r, Position(2, 0), 3, clock.now) for r in range(3))
        assert opened.get(SPEC.job) == state
        for r, g in enumerate(generations):
            if r < 3:
                with pytest.raises(FencedError):
                    opened.advance(SPEC.job, r, g, Position(2, 20))
        with pytest.raises(WorldSizeMismatchError):
            opened.join(SPEC.job, 0, 4)
        assert opened.join(SPEC.job, 2, 3).generation == 4

    def test_resize_from_a_checkpoint_and_twice(self, opened: CursorStore) -> None:
        checkpoint = (Position(1, 7),) * 4
        first = opened.resize(SPEC.job, 4, 6, checkpoint)
        assert [r.position for r in first.ranks] == [Position(1, 0)] * 6
        assert opened.resize(SPEC.job, 4, 6, checkpoint) == first, "resizing to the same size again: no-op"
        with pytest.raises(WorldSizeMismatchError):
            opened.resize(SPEC.job, 4, 2)
        second = opened.resize(SPEC.job, 6, 2, (Position(1, 3),) * 5 + (Position(2, 0),))
        assert second.plan == (Resize(4, checkpoint), Resize(6, (Position(1, 3),) * 5 + (Position(2, 0),)))
        assert [r.position for r in second.ranks] == [Position(1, 0)] * 2

    def test_resize_errors(self, opened: CursorStore) -> None:
        with pytest.raises(JobNotFoundError):
            opened.resize("nope", 4, 3)
        with pytest.raises(ConfigError):
            opened.resize(SPEC.job, 4, 4)
        with pytest.raises(ConfigError):
            opened.resize(SPEC.job, 4, 0)
        with pytest.raises(ConfigError):
            opened.resize(SPEC.job, 4, 3, (Position(0, 1),) * 3)
        assert opened.get(SPEC.job).spec == SPEC, "a refused resize changes nothing"

    def test_reconcile_restores_a_forgotten_rank(self, opened: CursorStore, clock: ManualClock) -> None:
        """The live process holds generation 5 and position (3, 9); the store forgot both."""
        clock.tick()
        state = opened.reconcile(SPEC.job, 2, 5, Position(3, 9))
        assert state == RankState(2, Position(3, 9), 5, clock.now)
        assert opened.get(SPEC.job).ranks[2] == state
        assert opened.advance(SPEC.job, 2, 5, Position(3, 10)).position == Position(3, 10)
        assert opened.reconcile(SPEC.job, 2, 5, Position(3, 4)).position == Position(3, 4), "either way"
        for _ in range(3):
            opened.join(SPEC.job, 2, 4)  # generation 8: the process at 5 was really replaced
        with pytest.raises(FencedError):
            opened.reconcile(SPEC.job, 2, 5, Position(9, 9))
        assert opened.get(SPEC.job).ranks[2].position == Position(3, 4)
        with pytest.raises(JobNotFoundError):
            opened.reconcile("nope", 0, 1, Position(0, 0))
        with pytest.raises(ConfigError):
            opened.reconcile(SPEC.job, 4, 1, Position(0, 0))

    # --- the whole contract against a model ---------------------------------

    # Every store's subclass runs this one test in the same session (differing executors): the
    # subclass only supplies the store fixture, so examples replayed across stores stay valid.
    @settings(
        suppress_health_check=[
            *settings().suppress_health_check,
            HealthCheck.function_scoped_fixture,
            HealthCheck.differing_executors,
        ]
    )
    @given(ops=st.lists(OPS, max_size=40))
    def test_matches_the_model(self, store: CursorStore, clock: ManualClock, ops: list[Op]) -> None:
        for job in store.list_jobs():
            store.delete_job(job.job)
        model = Model()
        for spec in START_SPECS:
            assert anonymous(store.open_job(spec)) == model.open_job(spec, False, clock())
            for rank in range(spec.world_size):
                assert store.join(spec.job, rank, 3) == model.join(spec.job, rank, 3, clock())
        for i, op in enumerate(ops):
            now = clock.tick()
            # a generation near the current one: mostly current, sometimes stale or from the future
            ranks = model.jobs[op.job].ranks if op.job in model.jobs else []
            generation = (ranks[op.rank].generation if op.rank < len(ranks) else 1) + op.generation_delta
            got = _outcome(_on_store, store, op, generation)
            want = _outcome(_on_model, model, op, generation, now)
            assert got == want, f"op {i} {op}: store gave {got}, the model {want}"
            assert anonymous(store.list_jobs()) == [model.jobs[j].state() for j in sorted(model.jobs)], (
                f"state differs from the model after op {i} {op}"
            )
