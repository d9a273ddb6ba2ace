"""A job builds each epoch's schedule once, however many streams ask at once."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from ladle.service import jobs
from ladle.service.errors import ConfigError
from ladle.service.schedule import ScheduleConfig, build_schedule
from ladle.service.store.base import Position


def make_job(monkeypatch: pytest.MonkeyPatch, calls: list[int]) -> jobs.Job:
    def slow_build(lengths: Any, config: ScheduleConfig, *, epoch: int, world_size: int, **kw: Any) -> Any:
        calls.append(epoch)
        time.sleep(0.2)
        return build_schedule(lengths, config, epoch=epoch, world_size=world_size, **kw)

    monkeypatch.setattr(jobs, "build_schedule", slow_build)
    dataset = SimpleNamespace(lengths=np.arange(1, 400, dtype=np.int64) % 97 + 1, fingerprint="ds")
    config = ScheduleConfig(max_seq_len=128, bucket_bounds=(0, 32, 129), token_budget=512)
    return jobs.Job("j", dataset, config, 2, store=None)  # type: ignore[arg-type]


def test_one_build_for_many_streams(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []
    job = make_job(monkeypatch, calls)
    results: list[Any] = []
    threads = [threading.Thread(target=lambda: results.append(job.schedule(1))) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert calls == [1], f"epoch 1 was built {len(calls)} times"
    assert all(r is results[0] for r in results)


def test_the_next_epoch_is_prepared_ahead(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []
    job = make_job(monkeypatch, calls)
    job.batch(Position(0, 0), rank=0)
    deadline = time.monotonic() + 10
    while 1 not in calls and time.monotonic() < deadline:
        time.sleep(0.01)
    assert 1 in calls, "epoch 1 was not prepared while epoch 0 started"
    job.schedule(1)
    assert calls.count(1) == 1


def test_a_stream_resumed_past_the_middle_prepares_the_next_epoch(monkeypatch: pytest.MonkeyPatch) -> None:
    """A trainer resumed late in an epoch (or a restarted server) must not meet an unbuilt boundary."""
    calls: list[int] = []
    job = make_job(monkeypatch, calls)
    last = job.steps(0) - 1
    assert last > 2
    job.batch(Position(0, last - 1), rank=0)  # the first batch of a stream resumed near the end
    deadline = time.monotonic() + 10
    while not job.has_schedule(1) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert job.has_schedule(1), "epoch 1 was not prepared before the stream reached the end of epoch 0"
    job.batch(Position(0, last), rank=0)
    job.batch(Position(1, 0), rank=0)
    assert calls.count(1) == 1, "epoch 1 was built again at the boundary"


def test_a_position_past_its_epochs_end_is_refused_not_carried_on(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []
    job = make_job(monkeypatch, calls)
    steps = job.steps(0)
    assert job.normalise(Position(0, steps - 1)) == Position(0, steps - 1)
    assert job.normalise(Position(0, steps)) == Position(1, 0)  # the end of epoch 0
    with pytest.raises(ConfigError, match=f"beyond the end of epoch 0, which has {steps} steps"):
        job.normalise(Position(0, steps + 1))
    with pytest.raises(ConfigError, match="step"):
        job.normalise(Position(0, 10**12))  # once carried over epoch after epoch: one build each
    assert set(calls) <= {0, 1}, f"schedules built for epochs {sorted(set(calls))}"


def test_rows_left_out_of_an_epoch_are_logged(caplog: pytest.LogCaptureFixture) -> None:
    """remainder='split' falls back to dropping rows it cannot place: only the API said so."""
    lengths = np.array([100, 60000, 50], dtype=np.int64)  # the long row has no partner for rank 1
    dataset = SimpleNamespace(lengths=lengths, fingerprint="ds", num_rows=3)
    config = ScheduleConfig(max_seq_len=60000, bucket_bounds=(0, 100, 60001), token_budget=100000)
    job = jobs.Job("short", dataset, config, 2, store=None)  # type: ignore[arg-type]
    with caplog.at_level("INFO", logger="ladle.server"):
        sched = job.schedule(0)
    assert sched.dropped.counts == {"remainder": 1}
    warned = [r for r in caplog.records if r.levelname == "WARNING"]
    assert len(warned) == 1, caplog.text
    message = warned[0].getMessage()
    assert "job short epoch 0: 1 of 3 rows left out of the epoch (remainder 1)" in message
    assert "remainder='split'" in message
    caplog.clear()
    with caplog.at_level("INFO", logger="ladle.server"):
        full = SimpleNamespace(lengths=lengths[[0, 2]], fingerprint="d2", num_rows=2)
        jobs.Job("full", full, config, 2, store=None).schedule(0)  # type: ignore[arg-type]
    assert "left out" not in caplog.text
