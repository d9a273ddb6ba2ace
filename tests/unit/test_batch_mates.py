"""The batch-mates figures: random rows in a batch (row-id span), drawn afresh every epoch (meeting again).

``quality(sched, next_epoch)`` shows them beside the other figures, in ``ladle
plan``, ``/quality`` and the page. Here: they read about 1 on schedules whose
batch-mates are random (equal lengths, two alternating lengths, both rank
modes), far from 1 on batches of row-id neighbours that meet again (what ladle
did before ties of equal length were broken at random), the same for the same
inputs, no division by zero on a tiny dataset, and finite and non-negative on
any input.
"""

from __future__ import annotations

import json
import warnings
from dataclasses import asdict
from pathlib import Path
from types import MappingProxyType, SimpleNamespace
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from ladle.service.cli import format_quality, main
from ladle.service.errors import ScheduleError
from ladle.service.http import inspector as insp
from ladle.service.http.page import render
from ladle.service.jobs import JobRegistry
from ladle.service.schedule import Schedule, ScheduleConfig, build_schedule, stats
from ladle.service.schedule.packing import Packed
from ladle.service.schedule.schedule import Dropped
from ladle.service.schedule.stats import (
    BatchMates,
    Quality,
    batch_mates,
    batch_span_ratio,
    mates_met_again,
    quality,
    summary,
)
from ladle.service.store import EmbeddedStore

from .conftest import SMALL

ROWS = 20_000
CONFIG = ScheduleConfig(bucket_bounds=(0, 257), max_seq_len=256, token_budget=4096)

LENGTHS = {
    "equal": np.full(ROWS, 200, dtype=np.int64),
    "two alternating": np.where(np.arange(ROWS) % 2 == 0, 100, 200).astype(np.int64),
}


def epochs(
    lengths: np.ndarray, config: ScheduleConfig, world: int, epoch: int = 0
) -> tuple[Schedule, Schedule]:
    return (
        build_schedule(lengths, config, epoch=epoch, world_size=world),
        build_schedule(lengths, config, epoch=epoch + 1, world_size=world),
    )


# --- schedules whose batch-mates are random ---


@pytest.mark.parametrize("rank_mode", ["mixed", "sync"])
@pytest.mark.parametrize("shape", sorted(LENGTHS))
@pytest.mark.parametrize("world", [1, 4])
def test_random_batch_mates_read_about_one(shape: str, rank_mode: str, world: int) -> None:
    config = CONFIG.replace(rank_mode=rank_mode)
    sched, after = epochs(LENGTHS[shape], config, world)
    q = quality(sched, after)
    assert q.batch_span_ratio is not None
    assert q.batch_span_ratio >= 0.8, q
    assert q.batch_mates_again is not None
    assert 1 / 3 <= q.batch_mates_again <= 3, q
    # 20,000 rows fit the caps: every batch is followed, and chance expects plenty of pairs
    assert q.batch_mates_sampled_batches == sched.num_batches
    assert q.batch_mates_expected_by_chance > 50
    assert q.batch_mates_met_again <= q.batch_mates_pairs


def test_two_buckets_in_sync_mode_read_about_one() -> None:
    """Batch-mates are of one bucket; chance is counted among rows of the same lengths."""
    config = CONFIG.replace(bucket_bounds=(0, 150, 257), rank_mode="sync")
    q = quality(*epochs(LENGTHS["two alternating"], config, 4))
    assert q.batch_span_ratio is not None
    assert q.batch_span_ratio >= 0.8
    assert q.batch_mates_again is not None
    assert 1 / 3 <= q.batch_mates_again <= 3


# --- batches of row-id neighbours, meeting again: the figure fails ---


def neighbour_schedule(num_rows: int, rows_per_batch: int, epoch: int) -> Schedule:
    """Every epoch the same batches of consecutive rows (ladle before ties were broken at random)."""
    rows = np.arange(num_rows, dtype=np.int32)
    start = np.arange(0, num_rows, rows_per_batch, dtype=np.int64)
    size = np.minimum(rows_per_batch, num_rows - start)
    packed = Packed(
        rows,
        np.full(num_rows, 200, dtype=np.int32),
        CONFIG.max_seq_len,
        start,
        size,
        np.zeros(len(start), dtype=np.int64),
        np.full(len(start), 200, dtype=np.int64),
    )
    return Schedule(
        config=CONFIG,
        epoch=epoch,
        world_size=1,
        bounds=(0, 257),
        num_rows=num_rows,
        packed=packed,
        batch_ids=np.arange(len(start), dtype=np.int64).reshape(-1, 1),
        dropped=Dropped(MappingProxyType({})),
    )


def test_batches_of_neighbours_that_meet_again_fail_both_figures() -> None:
    sched, after = neighbour_schedule(ROWS, 20, 0), neighbour_schedule(ROWS, 20, 1)
    q = quality(sched, after)
    assert q.batch_span_ratio is not None
    assert q.batch_span_ratio < 0.1
    assert q.batch_mates_again is not None
    assert q.batch_mates_again > 30
    assert q.batch_mates_met_again == q.batch_mates_pairs, "every pair meets again"
    # the same neighbours, redrawn into other batches next epoch: the span still fails, meeting again passes
    mixed = build_schedule(LENGTHS["equal"], CONFIG, epoch=1)
    q = quality(sched, mixed)
    assert q.batch_span_ratio is not None
    assert q.batch_span_ratio < 0.1
    assert q.batch_mates_again is not None
    assert q.batch_mates_again <= 3


def test_the_helpers_on_arrays_of_neighbours() -> None:
    rows = np.arange(ROWS)
    start, size = np.arange(0, ROWS, 16), np.full(ROWS // 16, 16)
    span = batch_span_ratio(rows, start, size, ROWS)
    assert span is not None
    assert span < 0.01  # 15 over (ROWS + 1) * 15 / 17
    batch = np.repeat(np.arange(ROWS // 16), 16)
    pairs, met, expected = mates_met_again(rows, batch, np.zeros(ROWS), rows, start, size, ROWS)
    assert pairs == met == (ROWS // 16) * 120
    assert 0 < expected < 0.01 * pairs
    assert met / expected > 100


def test_batch_span_ratio_matches_a_direct_count() -> None:
    """Batches in any order, gaps between them, one ending at the array's end (the ``reduceat`` edge)."""
    rng = np.random.default_rng(7)
    for _ in range(20):
        n = int(rng.integers(2, 300))
        rows = rng.permutation(n * 3)[:n]
        cuts = np.sort(rng.choice(np.arange(1, n), size=min(n - 1, int(rng.integers(1, 12))), replace=False))
        start, end = np.r_[0, cuts], np.r_[cuts, n]
        served = rng.random(len(start)) < 0.8
        served[-1] = True  # a batch ends at the end of the rows
        order = rng.permutation(int(served.sum()))
        st, sz = start[served][order], (end - start)[served][order]
        ratios = [
            (rows[a : a + k].max() - rows[a : a + k].min()) / ((3 * n + 1) * (k - 1) / (k + 1))
            for a, k in zip(st, sz, strict=True)
            if k >= 2
        ]
        got = batch_span_ratio(rows, st, sz, 3 * n)
        if ratios:
            assert got == pytest.approx(float(np.median(ratios)))
        else:
            assert got is None


def test_mates_met_again_matches_a_direct_count() -> None:
    rng = np.random.default_rng(3)
    for _ in range(20):
        m = int(rng.integers(10, 400))
        this = rng.permutation(m)
        cut = np.sort(rng.choice(np.arange(1, m), size=int(rng.integers(1, m // 3)), replace=False))
        batch = np.repeat(np.arange(len(cut) + 1), np.diff(np.r_[0, cut, m]))
        take = batch < max(1, len(cut) // 2)  # a sample: the first batches
        nxt = rng.permutation(m)
        ncut = np.sort(rng.choice(np.arange(1, m), size=int(rng.integers(1, m // 2)), replace=False))
        nstart = np.r_[0, ncut]
        nsize = np.diff(np.r_[nstart, m])
        next_of = np.empty(m, dtype=np.int64)
        next_of[nxt] = np.repeat(np.arange(len(nstart)), nsize)
        pairs = met = 0
        for b in np.unique(batch[take]):
            members = this[batch == b]
            for i in range(len(members)):
                for j in range(i + 1, len(members)):
                    pairs += 1
                    met += int(next_of[members[i]] == next_of[members[j]])
        got = mates_met_again(
            this[take], batch[take], rng.integers(0, 3, int(take.sum())), nxt, nstart, nsize, m
        )
        assert got[:2] == (pairs, met)
        assert 0 <= got[2] <= pairs


# --- determinism, the sample, tiny datasets ---


def test_the_same_inputs_give_the_same_figures() -> None:
    a = quality(*epochs(LENGTHS["equal"], CONFIG, 4))
    b = quality(*epochs(LENGTHS["equal"], CONFIG, 4))
    assert a == b
    assert quality(*epochs(LENGTHS["equal"], CONFIG.replace(seed=1), 4)) != a


def test_a_sample_within_the_caps_is_seeded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(stats, "BATCH_MATES_MAX_BATCHES", 100)
    monkeypatch.setattr(stats, "BATCH_MATES_MAX_ROWS", 1000)
    sched, after = epochs(LENGTHS["equal"], CONFIG, 1)
    first = batch_mates(sched, after)
    assert 0 < first.sampled_batches <= 100
    assert first.sampled_batches * 20 <= 1000, "batches of 20 rows, 1000 rows at most"
    assert first.pairs == first.sampled_batches * 20 * 19 // 2
    assert batch_mates(sched, after) == first
    other = epochs(LENGTHS["equal"], CONFIG.replace(seed=5), 1)
    assert batch_mates(*other).pairs != first.pairs or batch_mates(*other).met_again != first.met_again


@pytest.mark.parametrize("rows", [1, 2, 3])
def test_a_tiny_dataset_divides_by_nothing(rows: int) -> None:
    """One row: no batch of two rows, so no span (None) and no pair (None). Two or three rows in one
    batch: the span is every row's, as a random batch's (1.0), and the pairs meet again as chance says."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        sched, after = epochs(np.full(rows, 10), CONFIG, 1)
        q = quality(sched, after)
    if rows == 1:
        assert (q.batch_span_ratio, q.batch_mates_again, q.batch_mates_pairs) == (None, None, 0)
    else:
        assert q.batch_span_ratio == 1.0
        assert q.batch_mates_again == 1.0
    assert "batch-mates" in format_quality(q)


def test_without_the_next_epoch_only_the_span_is_there() -> None:
    sched, _ = epochs(LENGTHS["equal"], CONFIG, 2)
    q = quality(sched)
    assert q.batch_span_ratio is not None
    assert (q.batch_mates_again, q.batch_mates_sampled_batches) == (None, 0)
    assert "meeting again needs the next epoch" in format_quality(q)


def test_an_empty_epoch_has_no_figure() -> None:
    sched = Schedule.empty(CONFIG, 0, 2, (0, 257), 10, Dropped(MappingProxyType({})))
    assert batch_mates(sched, sched) == BatchMates(None)


@st.composite
def schedules(draw: st.DrawFn) -> tuple[Schedule, Schedule]:
    n = draw(st.integers(1, 300))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    lengths = rng.integers(1, draw(st.integers(2, 80)), n)
    config = ScheduleConfig(
        bucket_bounds=draw(st.sampled_from([(0, 65), (0, 20, 40, 65), (1, 8, 65)])),
        max_seq_len=64,
        token_budget=draw(st.integers(64, 600)),
        max_batch_size=draw(st.integers(1, 30)),
        pad_to_multiple_of=draw(st.sampled_from([1, 8])),
        rank_mode=draw(st.sampled_from(["mixed", "sync"])),
        remainder=draw(st.sampled_from(["split", "drop"])),
        sort_chunk=draw(st.sampled_from([1, 7, 2048])),
        seed=draw(st.integers(0, 100)),
    )
    world, epoch = draw(st.integers(1, 5)), draw(st.integers(0, 3))
    try:
        return epochs(lengths, config, world, epoch)
    except ScheduleError:
        assume(False)
        raise


@given(schedules())
@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_the_figures_are_finite_and_not_negative(pair: tuple[Schedule, Schedule]) -> None:
    sched, after = pair
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        m = batch_mates(sched, after)
    for value in (m.span_ratio, m.again_vs_chance, m.expected_by_chance):
        assert value is None or (np.isfinite(value) and value >= 0), m
    assert 0 <= m.met_again <= m.pairs
    assert m.expected_by_chance <= m.pairs
    assert m.sampled_batches == len(np.unique(sched.batch_ids))
    assert (m.span_ratio is None) == bool((sched.batch_rows() < 2).all())
    json.dumps(asdict(quality(sched, after)), allow_nan=False)


# --- where the figures are shown (``sample``: tests/unit/conftest.py) ---


def test_plan_shows_the_figures_with_the_next_epoch(sample: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", str(sample), "--world-size", "2", "--epoch", "1", "--json", *SMALL]) == 0
    doc = json.loads(capsys.readouterr().out)
    mates = doc["batch_mates"]
    assert set(mates) == {
        "span_ratio",
        "again_vs_chance",
        "sampled_batches",
        "pairs",
        "met_again",
        "expected_by_chance",
    }
    assert 0.8 <= mates["span_ratio"] <= 1.25
    assert 1 / 3 <= mates["again_vs_chance"] <= 3
    assert mates["sampled_batches"] == 2 * doc["num_steps"]

    assert main(["plan", str(sample), "--world-size", "2", "--compare", "random", *SMALL]) == 0
    text = capsys.readouterr().out
    span = next(line for line in text.splitlines() if line.startswith("batch-mates: row-id span"))
    again = next(line for line in text.splitlines() if line.startswith("batch-mates: meeting again"))
    assert span.split()[-1].endswith("x"), span
    assert span.split()[-2].endswith("x"), span
    assert again.split()[-1] == "-", "the random baseline's next epoch is not built"
    assert "sampled batches" in text


def test_a_servers_older_quality_document_still_reads() -> None:
    """``ladle inspect`` rebuilds ``Quality`` from the server's JSON: one without the new keys too."""
    q = quality(*epochs(LENGTHS["equal"], CONFIG, 2))
    doc: dict[str, Any] = json.loads(json.dumps(asdict(q)))
    assert Quality(**doc) == q
    older = {k: v for k, v in doc.items() if not k.startswith("batch_")}
    assert Quality(**older).batch_span_ratio is None
    assert "needs the next epoch" in format_quality(Quality(**older))
    assert (
        summary(*epochs(LENGTHS["equal"], CONFIG, 2))["batch_mates"]["again_vs_chance"] == q.batch_mates_again
    )


@pytest.fixture
def inspector(tmp_path: Path) -> insp.Inspector:
    lengths = (np.arange(8_000, dtype=np.int64) * 37) % 128 + 1
    dataset = SimpleNamespace(
        lengths=lengths, fingerprint="ds-test", path=str(tmp_path), num_rows=len(lengths)
    )
    config = ScheduleConfig(
        max_seq_len=128, bucket_bounds=(0, 32, 64, 129), token_budget=256, max_batch_size=4
    )
    return insp.Inspector(JobRegistry(dataset, config, EmbeddedStore(tmp_path / "state.db")))  # type: ignore[arg-type]


def test_the_http_figures_follow_the_next_epoch(inspector: insp.Inspector) -> None:
    job = inspector.preview(2)
    q = inspector.quality(job, 1)
    assert q == quality(job.schedule(1), job.schedule(2))
    assert q.batch_mates_again is not None
    html = render(inspector, epoch=1)
    assert "batch-mates: meeting again / chance" in html
    assert f"{q.batch_mates_again:.2f}x" in html
    assert 'id="batch-mates-note"' in html
