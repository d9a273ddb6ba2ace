"""The single-stream interleaving meets the run lower bound exactly and stays near its shares."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from ladle.service.schedule.interleave import interleave_1d, interleave_grid, run_lower_bound
from ladle.service.schedule.stats import longest_runs


def share_deviation(seq: np.ndarray, k: int) -> float:
    onehot = np.zeros((len(seq), k))
    onehot[np.arange(len(seq)), seq] = 1
    cum = onehot.cumsum(axis=0)
    prefix = np.arange(1, len(seq) + 1)[:, None]
    return float(np.abs(cum - prefix * cum[-1] / len(seq)).max())


counts_strategy = st.lists(st.integers(0, 300), min_size=1, max_size=8).filter(lambda c: sum(c) > 0)


@given(counts_strategy)
def test_1d_keeps_counts_and_meets_run_bound(counts: list[int]) -> None:
    seq = interleave_1d(counts)
    k = len(counts)
    assert np.array_equal(np.bincount(seq, minlength=k), counts), "counts changed: lost or added batches"
    runs = longest_runs(seq, k)
    bound = run_lower_bound(counts)
    assert np.array_equal(runs, bound), f"runs {runs.tolist()} differ from lower bound {bound.tolist()}"


@given(counts_strategy)
def test_1d_share_deviation_below_two(counts: list[int]) -> None:
    seq = interleave_1d(counts)
    assert share_deviation(seq, len(counts)) < 2.0, "a bucket drifted two items from its share"


def test_1d_skewed_production_counts() -> None:
    # 61% in one bucket (the measured case): the bound is 2, a random shuffle gives ~17.
    counts = [2600, 2900, 3100, 2700, 3000, 22700]
    seq = interleave_1d(counts)
    assert longest_runs(seq, 6).tolist() == [1, 1, 1, 1, 1, 2]


def test_bound_formula() -> None:
    assert run_lower_bound([5, 0, 1]).tolist() == [3, 0, 1]
    assert run_lower_bound([1]).tolist() == [1]
    assert run_lower_bound([3, 3]).tolist() == [1, 1]


@given(counts_strategy, st.integers(1, 6))
def test_grid_keeps_counts_and_shape(counts: list[int], world: int) -> None:
    total = sum(counts)
    counts = list(counts)
    counts[0] += (-total) % world
    grid = interleave_grid(counts, world)
    assert grid.shape == (sum(counts) // world, world), "ranks got different numbers of steps"
    assert np.array_equal(np.bincount(grid.ravel(), minlength=len(counts)), counts), "lost or added batches"


def test_grid_alternating_does_not_alias() -> None:
    # Dealing ABAB.. to two ranks round-robin would give each rank one bucket.
    grid = interleave_grid([100, 100], 2)
    for rank in range(2):
        col = grid[:, rank]
        assert set(col.tolist()) == {0, 1}, "a rank saw only one bucket"
        assert longest_runs(col, 2).max() == 1


@given(counts_strategy, st.integers(2, 9))
def test_compiled_and_python_grids_agree(counts: list[int], world: int) -> None:
    from ladle.service.schedule import interleave

    counts = list(counts)
    counts[0] += (-sum(counts)) % world
    python = interleave._grid_python(counts, world)
    assert np.array_equal(interleave.interleave_grid(counts, world), python), "C and Python grids differ"


def test_grid_without_the_extension(monkeypatch: pytest.MonkeyPatch) -> None:
    from ladle.service.schedule import interleave

    counts = [40, 7, 13, 4]
    with_c = interleave.interleave_grid(counts, 4)
    monkeypatch.setattr(interleave, "_grid_c", None)
    assert np.array_equal(interleave.interleave_grid(counts, 4), with_c)


# --- the end of a rank's stream (mixed mode) ---------------------------------------------------


def own_excess(grid: np.ndarray, k: int) -> np.ndarray:
    """[ranks, buckets]: each rank's longest run of each bucket minus its own bound."""
    return np.array(
        [
            longest_runs(grid[:, r], k) - run_lower_bound(np.bincount(grid[:, r], minlength=k))
            for r in range(grid.shape[1])
        ]
    )


def caps(counts: list[int], world: int) -> np.ndarray:
    """The run bound of a rank holding ceil(c / world) of a bucket (at least 1): the grid's cap."""
    c = np.asarray(counts, dtype=np.int64)
    steps = int(c.sum()) // world
    per_rank = -(-c // world)
    return np.maximum(1, -(-per_rank // np.maximum(1, steps - per_rank + 1)))


def most_that_fits(length: int, cap: int, run: int) -> int:
    """By brute force: the most cells of one bucket among ``length`` with runs of at most ``cap``,
    after a stream that ends in a run of ``run`` of it."""
    best = 0
    for mask in range(1 << length):
        current, ok = run, True
        for i in range(length):
            current = current + 1 if mask >> i & 1 else 0
            ok = ok and current <= cap
        if ok:
            best = max(best, bin(mask).count("1"))
    return best


def fits(counts: tuple[int, ...], cap: tuple[int, ...], last: int, run: int) -> bool:
    """By brute force: can a stream hold exactly ``counts`` more cells, runs within ``cap``?"""
    if sum(counts) == 0:
        return True
    for b, n in enumerate(counts):
        nxt = run + 1 if b == last else 1
        if n and nxt <= cap[b]:
            rest = (*counts[:b], n - 1, *counts[b + 1 :])
            if fits(rest, cap, b, nxt):
                return True
    return False


def test_room_is_the_most_a_stream_can_still_hold() -> None:
    from ladle.service.schedule.interleave import _room

    for length in range(8):
        for cap in range(1, 4):
            for run in range(cap + 1):
                assert _room(length, cap, run) == most_that_fits(length, cap, run), (length, cap, run)


def test_a_stream_can_hold_any_mix_that_no_bucket_overfills() -> None:
    """The lookahead's premise: a mix fits a stream exactly when each bucket fits on its own."""
    from itertools import product

    from ladle.service.schedule.interleave import _room

    for nb in (2, 3):
        for cap in product((1, 2, 3), repeat=nb):
            for length in range(7):
                for counts in product(range(length + 1), repeat=nb):
                    if sum(counts) != length:
                        continue
                    for last in range(-1, nb):
                        for run in range(1, cap[last] + 1) if last >= 0 else (0,):
                            room = [_room(length, cap[b], run if b == last else 0) for b in range(nb)]
                            each = all(n <= r for n, r in zip(counts, room, strict=True))
                            assert each == fits(counts, cap, last, run), (counts, cap, last, run)


@given(counts_strategy, st.integers(2, 9))
def test_looking_ahead_over_the_whole_epoch_keeps_every_run_within_its_cap(
    counts: list[int], world: int
) -> None:
    """The lookahead's invariant, over the whole epoch: no run passes max(cap, own bound).

    So a rank's excess over its own bound is at most cap - own bound, which is 0 for every
    bucket whose cap is 1 and in every stream holding ceil(c / world) of the bucket.
    """
    from ladle.service.schedule import interleave

    counts = list(counts)
    counts[0] += (-sum(counts)) % world
    steps = sum(counts) // world
    grid = interleave._grid_python(counts, world, end_steps=steps)
    compiled = interleave._grid_compiled(counts, world, end_steps=steps)
    assert compiled is None or np.array_equal(compiled, grid), "C and Python grids differ"
    k = len(counts)
    excess = own_excess(grid, k)
    own = np.array([run_lower_bound(np.bincount(grid[:, r], minlength=k)) for r in range(world)])
    allowed = np.maximum(0, caps(counts, world)[None, :] - own)
    assert (excess <= allowed).all(), (
        f"runs over max(cap, own bound): {np.argwhere(excess > allowed).tolist()}"
    )


@given(counts_strategy, st.integers(2, 9))
def test_when_the_last_steps_start_with_room_every_rank_ends_within_bounds(
    counts: list[int], world: int
) -> None:
    """With the lookahead over the last END_STEPS steps: if, where it starts, every bucket's
    batches left fit the ranks' remaining cells (counted here by brute force), no run reaching
    those steps passes max(cap, own bound)."""
    from ladle.service.schedule.interleave import END_STEPS

    counts = list(counts)
    counts[0] += (-sum(counts)) % world
    grid = interleave_grid(counts, world)
    steps, k = grid.shape[0], len(counts)
    start = max(0, steps - END_STEPS)
    cap = caps(counts, world)
    left = np.asarray(counts) - np.bincount(grid[:start].ravel(), minlength=k)
    room = np.zeros(k, dtype=np.int64)
    for r in range(world):
        col = grid[:start, r]
        run = 0
        while run < len(col) and col[len(col) - 1 - run] == col[-1]:
            run += 1
        for b in range(k):
            room[b] += most_that_fits(steps - start, int(cap[b]), run if run and col[-1] == b else 0)
    if (left > room).any():
        return  # the rule left less room than the counts need: nothing is promised
    for r in range(world):
        col = grid[:, r]
        own = run_lower_bound(np.bincount(col, minlength=k))
        end = len(col)
        while end > start:  # every run that reaches the last END_STEPS steps
            begin = end - 1
            while begin > 0 and col[begin - 1] == col[end - 1]:
                begin -= 1
            b = col[end - 1]
            assert end - begin <= max(cap[b], own[b]), f"rank {r}: a run of {end - begin} x bucket {b}"
            end = begin


@given(counts_strategy, st.integers(2, 9), st.integers(0, 8))
def test_compiled_and_python_grids_agree_with_any_lookahead(
    counts: list[int], world: int, end_steps: int
) -> None:
    from ladle.service.schedule import interleave

    counts = list(counts)
    counts[0] += (-sum(counts)) % world
    compiled = interleave._grid_compiled(counts, world, end_steps=end_steps)
    if compiled is None:
        pytest.skip("the compiled interleaver is not built")
    python = interleave._grid_python(counts, world, end_steps=end_steps)
    assert np.array_equal(compiled, python), "C and Python grids differ"


@pytest.mark.parametrize(
    ("counts", "world"),
    [
        # 120,000 production-mix rows, production bounds, 16 ranks: rank 10 ended 5, 5, 5 (bound 2)
        ([508, 417, 510, 568, 646, 2919], 16),
        # lognormal ("real-text-like") lengths, auto bounds, 2 ranks: rank 0 ended 0, 0 (bound 1)
        ([121, 87, 54, 32, 28, 26], 2),
        # the last two steps would hold 5 batches of bucket 5 for 4 ranks: one must move earlier,
        # which the last step alone cannot do (the lookahead of the steps before it does)
        ([160, 168, 245, 384, 652, 1163], 4),
        # 5,000 lognormal lengths, auto bounds, 2 ranks: rank 0 ended 0, 0 (bound 1); also needs
        # the steps before the last
        ([41, 22, 11, 5, 3, 2], 2),
    ],
)
def test_end_of_stream_regressions(counts: list[int], world: int) -> None:
    from ladle.service.schedule import interleave

    k = len(counts)
    rule_alone = interleave._grid_python(counts, world, end_steps=0)  # the grid before the fix
    assert own_excess(rule_alone, k).max() == 1, "this case no longer shows the defect"
    grid = interleave_grid(counts, world)
    assert own_excess(grid, k).max() == 0, (
        f"runs over the ranks' bounds: {np.argwhere(own_excess(grid, k) > 0)}"
    )
    assert np.array_equal(np.bincount(grid.ravel(), minlength=k), counts)
    for g in (grid, rule_alone):  # the fix leaves all but the last steps as they were
        assert np.array_equal(g[: -interleave.END_STEPS], rule_alone[: -interleave.END_STEPS])


def test_production_mix_ends_within_each_ranks_bound() -> None:
    """The reported case: 120,000 production-mix rows on the production bounds."""
    from ladle.service.schedule import PRODUCTION_BOUNDS, ScheduleConfig, build_schedule
    from ladle.service.schedule.stats import quality
    from ladle.service.synth import production_lengths

    lengths = production_lengths(120_000, 0)
    for world in (8, 16):  # 16 ranks: rank 10 ended on a run of 3 of the largest bucket (bound 2)
        sched = build_schedule(lengths, ScheduleConfig(bucket_bounds=PRODUCTION_BOUNDS), world_size=world)
        q = quality(sched)
        assert q.max_run_excess == 0, f"W={world}: longest runs {q.max_run}, bounds {q.max_run_lower_bound}"


def test_text_like_lengths_with_auto_bounds_end_within_each_ranks_bound() -> None:
    """The reported case: auto bounds on real-text-like (lognormal) lengths, 2 ranks."""
    from ladle.service.schedule import ScheduleConfig, build_schedule
    from ladle.service.schedule.stats import quality

    rng = np.random.default_rng(3)
    lengths = np.minimum(np.ceil(rng.lognormal(5.0, 1.2, 20_000)).astype(np.int64), 8192)
    sched = build_schedule(lengths, ScheduleConfig(bucket_bounds="auto"), world_size=2)
    q = quality(sched)
    assert q.max_run_excess == 0, f"longest runs {q.max_run}, bounds {q.max_run_lower_bound}"
