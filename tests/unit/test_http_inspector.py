"""The pieces behind the HTTP face, in process: page caps, lag, previews, colours and metrics."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from ladle.service.errors import ConfigError
from ladle.service.http import inspector as insp
from ladle.service.http.page import bucket_colour
from ladle.service.jobs import JobRegistry
from ladle.service.metrics import LoopHistogram, ServerMetrics
from ladle.service.schedule import ScheduleConfig, build_schedule
from ladle.service.store import EmbeddedStore, Position

CONFIG = ScheduleConfig(max_seq_len=128, bucket_bounds=(0, 32, 64, 129), token_budget=256, max_batch_size=4)


@pytest.fixture
def inspector(tmp_path: Path) -> insp.Inspector:
    from types import SimpleNamespace

    lengths = (np.arange(40_000, dtype=np.int64) * 37) % 128 + 1
    dataset = SimpleNamespace(
        lengths=lengths, fingerprint="ds-test", path=str(tmp_path), num_rows=len(lengths)
    )
    store = EmbeddedStore(tmp_path / "state.db")
    return insp.Inspector(JobRegistry(dataset, CONFIG, store))  # type: ignore[arg-type]


def test_a_page_never_exceeds_its_batch_cap(inspector: insp.Inspector) -> None:
    job = inspector.preview(64)
    page = inspector.page(job, 0, start=0, limit=1000)
    assert page["limit"] == insp.MAX_PAGE_BATCHES // 64
    assert len(page["batches"]) == page["limit"] * 64
    assert page["next_start"] == page["limit"]
    with_rows = inspector.page(job, 0, start=0, limit=1000, samples=True)
    assert len(with_rows["batches"]) == insp.MAX_PAGE_BATCHES_WITH_SAMPLES
    one_rank = inspector.page(job, 0, start=0, limit=1000, rank=5, samples=True)
    sched = build_schedule(job.dataset.lengths, CONFIG, epoch=0, world_size=64)
    assert len(one_rank["batches"]) == min(1000, sched.num_steps)
    assert one_rank["batches"][3]["samples"] == sched.samples(3, 5).tolist()


def test_page_arguments_are_checked(inspector: insp.Inspector) -> None:
    job = inspector.preview(2)
    for kwargs, field in (({"rank": 2}, "rank"), ({"limit": 0}, "limit"), ({"start": -1}, "start")):
        with pytest.raises(ConfigError) as failed:
            inspector.page(job, 0, **kwargs)  # type: ignore[arg-type]
        assert failed.value.field == field
    with pytest.raises(ConfigError):
        inspector.preview(0)


def test_lag_counts_steps_across_epochs(inspector: insp.Inspector) -> None:
    job = inspector.preview(2)
    steps = [job.steps(e) for e in range(3)]
    between = inspector._steps_between
    assert between(job, Position(0, 3), Position(0, 10)) == 7
    assert between(job, Position(0, 3), Position(1, 2)) == steps[0] - 3 + 2
    assert between(job, Position(0, 3), Position(2, 1)) == steps[0] - 3 + steps[1] + 1


def test_the_random_baseline_is_the_same_config_shuffled(inspector: insp.Inspector) -> None:
    job = inspector.preview(2)
    baseline = inspector.variant(job, "random")
    assert baseline.config == CONFIG.replace(interleave="random")
    assert inspector.variant(job, "random") is baseline, "the baseline is rebuilt on every request"
    assert inspector.variant(job, None) is job
    assert inspector.variant(job, "stride") is job


def test_bucket_colours_run_from_dark_to_light() -> None:
    assert bucket_colour(0, 6) == "#440154"
    assert bucket_colour(5, 6) == "#fde725"
    assert bucket_colour(0, 1) == "#440154"
    assert len({bucket_colour(b, 64) for b in range(64)}) > 50


def test_metrics_parse_and_count(tmp_path: Path) -> None:
    metrics = ServerMetrics()
    meter = metrics.stream("j", 1)
    for seconds in (0.00001, 0.0003, 0.002, 9.0):
        meter.batch(10, 12, 100, seconds)
    assert metrics.stream("j", 1) is meter, "a later stream of the same rank starts from zero"
    metrics.watch_streams(lambda: [("j", 1, 3)])
    metrics.error("http", "404")
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(metrics.exposition().decode())
        for s in family.samples
    }
    labels = (("job", "j"), ("rank", "1"))
    assert samples["ladle_batches_served_total", labels] == 4
    assert samples["ladle_tokens_served_total", labels] == 40
    assert samples["ladle_padded_tokens_served_total", labels] == 48
    assert samples["ladle_bytes_served_total", labels] == 400
    assert samples["ladle_batch_assembly_seconds_bucket", (("le", "5e-05"),)] == 1
    assert samples["ladle_batch_assembly_seconds_bucket", (("le", "0.0005"),)] == 2
    assert samples["ladle_batch_assembly_seconds_bucket", (("le", "0.5"),)] == 3
    assert samples["ladle_batch_assembly_seconds_bucket", (("le", "+Inf"),)] == 4
    assert samples["ladle_batch_assembly_seconds_count", ()] == 4
    assert samples["ladle_stream_prefetch_depth", labels] == 3
    assert samples["ladle_streams_open", ()] == 1
    assert samples["ladle_errors_total", (("code", "404"), ("face", "http"))] == 1


def test_a_loop_histogram_puts_a_bound_in_its_own_bucket() -> None:
    h = LoopHistogram((1.0, 2.0))
    for value in (1.0, 1.5, 2.0, 3.0):
        h.observe(value)
    assert h.counts == [1, 2, 1]
    assert h.total == 7.5


def test_a_ranks_series_go_an_hour_after_its_last_stream(tmp_path: Path) -> None:
    now = [0.0]
    metrics = ServerMetrics(meter_linger_s=3600, clock=lambda: now[0])

    def series() -> set[tuple[str, str]]:
        return {
            (s.labels["job"], s.labels["rank"])
            for family in text_string_to_metric_families(metrics.exposition().decode())
            if family.name == "ladle_batches_served"
            for s in family.samples
        }

    old = metrics.stream("old", 0)
    old.batch(10, 12, 100, 0.001)
    held = metrics.stream("held", 0)  # a stream that stays open
    metrics.ended(old)
    now[0] = 3000.0
    again = metrics.stream("old", 0)
    assert again is old, "a rank that comes back within the hour keeps counting"
    assert again.batches == 1
    metrics.ended(again)
    now[0] = 3000.0 + 3601
    metrics.stream("new", 0)
    assert series() == {("held", "0"), ("new", "0")}, "an idle rank's series outlived the hour"
    assert held.streams == 1
