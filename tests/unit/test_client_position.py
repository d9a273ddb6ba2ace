"""``RankPosition``, the client's pure position state machine: checkpoints round-trip, positions only move
forward, and a state that is not this rank's is refused without changing anything."""

from __future__ import annotations

import copy
from typing import Any

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from ladle.client.config import MAX_INDEX
from ladle.client.errors import BatchClientError, StateDictError
from ladle.client.position import STATE_KEYS, STATE_VERSION, RankPosition

JOB, RANK, WORLD = "job-1", 1, 4
FINGERPRINT = "0123456789abcdef"

indices = st.integers(0, MAX_INDEX)
fingerprints = st.one_of(st.none(), st.text(max_size=16))


def machine(*, elastic: bool = False) -> RankPosition:
    return RankPosition(JOB, RANK, WORLD, elastic=elastic)


def a_state(epoch: int, step: int, fingerprint: str | None = FINGERPRINT, **changes: Any) -> dict[str, Any]:
    state = {
        "version": STATE_VERSION,
        "job": JOB,
        "rank": RANK,
        "world_size": WORLD,
        "epoch": epoch,
        "step": step,
        "schedule_fingerprint": fingerprint,
    }
    state.update(changes)
    return state


def fields(position: RankPosition) -> dict[str, Any]:
    return dict(vars(position))


@given(epoch=indices, step=indices, fingerprint=fingerprints, numpy_ints=st.booleans())
def test_a_loaded_state_is_the_state_dict_and_the_callers_dict_is_unchanged(
    epoch: int, step: int, fingerprint: str | None, numpy_ints: bool
) -> None:
    state = a_state(epoch, step, fingerprint)
    if numpy_ints:
        state.update(epoch=np.int64(epoch), step=np.uint64(step))
    before = copy.deepcopy(state)
    position = machine()
    position.load_state_dict(state)
    assert state == before, "load_state_dict changed the caller's dict"
    assert position.known
    saved = position.state_dict()
    assert saved == a_state(epoch, step, fingerprint), "the checkpoint did not round-trip"
    assert all(type(saved[k]) is int for k in ("epoch", "step")), "a numpy integer leaked into the state"
    again = machine()
    again.load_state_dict(saved)
    assert again.state_dict() == saved
    assert position.claim().start == (epoch, step)
    assert position.claim().generation is None, "a loaded state claims a stream it never had"


# a stream's events: a batch, an epoch's end, a consumed batch, a batch given back
events = st.lists(st.sampled_from(["batch", "end", "consume", "give_back"]), max_size=60)


@given(start=st.tuples(st.integers(0, 5), st.integers(0, 5)), steps=st.integers(1, 8), script=events)
def test_positions_only_move_forward_and_every_state_resumes_where_it_was_taken(
    start: tuple[int, int], steps: int, script: list[str]
) -> None:
    """Batches of a schedule of ``steps`` a epoch, taken, consumed or given back: the position never goes back
    past a consumed batch, and the checkpoint taken after any event loads into a fresh machine as it is."""
    position = machine()
    notes = position.started(start[0], start[1], FINGERPRINT, 7, "inc", WORLD)
    assert notes == [] or start != (0, 0), "a fresh job's start was warned about"
    consumed: tuple[int, int] | None = None  # acknowledged through
    for event in script:
        before = position.next
        assert before is not None
        if event == "batch":
            epoch, step = before
            if step >= steps:  # the server sends the epoch's end instead
                position.ended(epoch, step)
                assert position.next == (epoch + 1, 0), "an epoch end did not move to the next epoch"
                continue
            position.check_batch(RANK, epoch, step, FINGERPRINT)
            position.took(epoch, step)
            assert position.held == (epoch, step)
        elif event == "end":
            position.ended(before[0], steps)
        elif event == "consume":
            through = position.consume()
            if through is not None:
                assert consumed is None or through > consumed, "an acknowledgement went backwards"
                consumed = through
            assert position.held is None
        else:
            position.give_back()
        after = position.next
        assert after is not None
        if event != "give_back":
            assert after >= before, f"{event} moved the position back from {before} to {after}"
        assert consumed is None or after >= consumed, "the position went back past a consumed batch"
        saved = position.state_dict()
        fresh = machine()
        fresh.load_state_dict(saved)
        assert fresh.next == position.next, "a checkpoint does not resume where it was taken"
        assert fresh.fingerprint == FINGERPRINT


def test_a_batch_given_back_is_the_next_one_and_never_acknowledged() -> None:
    position = machine()
    position.started(0, 3, FINGERPRINT, 1, "inc", WORLD)
    position.took(0, 3)
    assert position.give_back()
    assert (position.next, position.held) == ((0, 3), None)
    assert position.consume() is None, "a batch given back was acknowledged"
    assert not position.give_back(), "nothing was held"
    position.took(0, 3)
    position.forget_held()
    assert position.consume() is None
    assert position.next == (0, 4)


def test_a_take_that_starts_at_the_last_epochs_end_goes_on_into_the_next() -> None:
    position = machine()
    position.started(2, 5, FINGERPRINT, 1, "inc", WORLD)
    assert position.ended(2, 5, first=True), "a take at the epoch's end stopped in the ended epoch"
    assert position.next == (3, 0)
    assert position.epochs_ended == 1
    position.started(3, 2, FINGERPRINT, 1, "inc", WORLD)
    assert not position.ended(3, 5, first=True)


def test_the_server_decides_where_a_stream_starts_and_the_generation_is_claimed_back() -> None:
    position = machine()
    assert position.claim().start is None
    assert not position.known
    notes = position.started(1, 4, FINGERPRINT, 3, "inc-a", WORLD)
    assert [args[2:] for _, args in notes] == [(1, 4)], "a restart without a checkpoint was not warned"
    claim = position.claim()
    assert (claim.start, claim.fingerprint, claim.generation, claim.incarnation) == (
        (1, 4),
        FINGERPRINT,
        3,
        "inc-a",
    )
    assert position.started(1, 4, FINGERPRINT, 4, "inc-b", WORLD) == [], "a reconnect was warned about"
    resized = position.started(1, 2, "another", 5, "inc-b", 8)
    assert len(resized) == 1
    assert "resized" in resized[0][0]


@pytest.mark.parametrize(
    ("batch", "error", "message"),
    [
        ((0, 1, 4, FINGERPRINT), BatchClientError, "for rank 0"),
        ((RANK, 1, 6, FINGERPRINT), BatchClientError, "expected"),
        ((RANK, 1, 4, "another"), StateDictError, "schedule"),
    ],
)
def test_a_batch_out_of_place_is_refused(
    batch: tuple[Any, ...], error: type[Exception], message: str
) -> None:
    position = machine()
    position.started(1, 4, FINGERPRINT, 1, "inc", WORLD)
    with pytest.raises(error, match=message):
        position.check_batch(*batch)
    position.check_batch(RANK, 2, 0, FINGERPRINT)  # a step past the epoch's end: the next epoch's first


refusals = [
    ({"epoch": -1}, "non-negative"),
    ({"step": MAX_INDEX + 1}, "non-negative"),
    ({"step": True}, "non-negative"),
    ({"epoch": 1.0}, "non-negative"),
    ({"version": 2}, "version"),
    ({"version": True}, "version"),
    ({"job": "other"}, "job="),
    ({"job": 5}, "must be a string"),
    ({"rank": 0}, "rank="),
    ({"world_size": 2}, "elastic=True"),
    ({"schedule_fingerprint": 5}, "schedule_fingerprint"),
    ({"schedule_fingerprint": "\ud800"}, "schedule_fingerprint"),
    ({"schedule_fingerprint": "f" * 65}, "schedule_fingerprint"),
]


@given(
    refusal=st.sampled_from(refusals),
    loaded=st.one_of(st.none(), st.tuples(indices, indices)),
    missing=st.one_of(st.none(), st.sampled_from(STATE_KEYS)),
)
def test_load_refuses_a_state_that_is_not_this_ranks_and_changes_nothing(
    refusal: tuple[dict[str, Any], str], loaded: tuple[int, int] | None, missing: str | None
) -> None:
    changes, message = refusal
    position = machine()
    if loaded is not None:
        position.load_state_dict(a_state(*loaded))
    before = fields(position)
    state = {**a_state(3, 4), **changes}
    if missing is not None:
        del state[missing]
        message = "lacks"
    snapshot = copy.deepcopy(state)
    with pytest.raises(StateDictError, match=message):
        position.load_state_dict(state)
    assert fields(position) == before, "a refused state changed the position"
    assert state == snapshot, "load_state_dict changed the caller's dict"


def test_load_refuses_what_is_not_a_mapping() -> None:
    with pytest.raises(StateDictError, match="mapping"):
        machine().load_state_dict([("epoch", 1)])  # type: ignore[arg-type]


@given(world=st.integers(1, 64), rank=st.integers(0, 63), epoch=indices, step=indices)
def test_an_elastic_position_takes_any_ranks_state_of_another_world_and_waits_for_the_replan(
    world: int, rank: int, epoch: int, step: int
) -> None:
    position = machine(elastic=True)
    state = a_state(epoch, step, world_size=world, rank=rank % world)
    if world == WORLD and rank % world != RANK:
        with pytest.raises(StateDictError, match="rank="):
            position.load_state_dict(state)
        return
    position.load_state_dict(state)
    resized = world != WORLD
    assert position.replanned is resized
    assert position.known is not resized
    assert position.loaded_epoch == (None if resized else epoch)
    if resized:
        with pytest.raises(StateDictError, match="not known"):
            position.state_dict()
        position.started(0, 0, "replanned", 1, "inc", WORLD)
    assert position.state_dict()["world_size"] == WORLD, "the state is not of this client's world"


def test_a_state_is_refused_until_the_position_is_known() -> None:
    with pytest.raises(StateDictError, match="not known"):
        machine().state_dict()
