"""A job planned by an earlier schedule algorithm is refused on resume, saying so and what to do."""

from __future__ import annotations

import pickle
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from ladle.service.errors import AlgorithmVersionError, CheckpointMismatchError, JobMismatchError
from ladle.service.jobs import JobRegistry, schedule_fingerprint
from ladle.service.schedule import ALGORITHM_VERSION, PRODUCTION_BOUNDS, ScheduleConfig
from ladle.service.store import EmbeddedStore
from ladle.service.store.base import JobSpec

CONFIG = ScheduleConfig(max_seq_len=128, bucket_bounds=(0, 32, 129), token_budget=512)


def registry(tmp_path: Path, config: ScheduleConfig = CONFIG) -> JobRegistry:
    lengths = (np.arange(2000, dtype=np.int64) * 37) % 128 + 1
    dataset = SimpleNamespace(lengths=lengths, fingerprint="ds", path=str(tmp_path), num_rows=len(lengths))
    return JobRegistry(dataset, config, EmbeddedStore(tmp_path / "state.db"))  # type: ignore[arg-type]


def test_the_version_is_past_the_first() -> None:
    assert ALGORITHM_VERSION >= 2, "these tests store a job as version 1 planned it"


def test_a_job_planned_by_version_1_is_refused_with_what_to_do(tmp_path: Path) -> None:
    reg = registry(tmp_path)
    reg.store.open_job(JobSpec("old", "ds", CONFIG.fingerprint(1), 2))
    with pytest.raises(AlgorithmVersionError) as info:
        reg.open("old", 2)
    message = str(info.value)
    assert "planned by version 1 of ladle's schedule algorithm" in message, message
    assert f"runs version {ALGORITHM_VERSION}" in message, message
    assert "ladle jobs --delete old" in message, message
    assert "new job name" in message, message
    assert isinstance(info.value, JobMismatchError), "gRPC and HTTP map it as the mismatch it is"
    assert info.value.reason == "config_mismatch"
    assert reg.store.get("old").spec.config_fingerprint == CONFIG.fingerprint(1), "the job is unchanged"
    again = pickle.loads(pickle.dumps(info.value))
    assert str(again) == message, "crosses process boundaries intact"


def test_the_old_default_config_is_recognised_under_the_new_default(tmp_path: Path) -> None:
    """Version 1's default edges were the production preset; auto is the default now."""
    reg = registry(tmp_path, ScheduleConfig())
    old_default = ScheduleConfig(bucket_bounds=PRODUCTION_BOUNDS).fingerprint(1)
    reg.store.open_job(JobSpec("run-42", "ds", old_default, 1))
    with pytest.raises(AlgorithmVersionError, match="version 1"):
        reg.open("run-42", 1)


def test_a_job_of_another_config_is_still_a_plain_mismatch(tmp_path: Path) -> None:
    reg = registry(tmp_path)
    reg.store.open_job(JobSpec("other", "ds", CONFIG.replace(seed=7).fingerprint(1), 2))
    with pytest.raises(JobMismatchError) as info:
        reg.open("other", 2)
    assert not isinstance(info.value, AlgorithmVersionError), "only this very config, planned earlier"
    assert "config_fingerprint differs" in str(info.value)


def test_a_version_1_job_is_refused_for_inspection_too(tmp_path: Path) -> None:
    reg = registry(tmp_path)
    state = reg.store.open_job(JobSpec("old", "ds", CONFIG.fingerprint(1), 2))
    with pytest.raises(AlgorithmVersionError):
        reg.view(state)


def test_a_version_1_checkpoint_into_a_new_job_is_refused_saying_why(tmp_path: Path) -> None:
    reg = registry(tmp_path)
    old = schedule_fingerprint("ds", CONFIG.fingerprint(1), 2, (), 1)
    with pytest.raises(CheckpointMismatchError, match=r"version 1 of ladle's schedule algorithm"):
        reg.check_restorable("fresh", 2, old)
    with pytest.raises(Exception, match="not in the cursor store"):
        reg.check_restorable("fresh", 2, "0123456789abcdef")
    reg.check_restorable("fresh", 2, schedule_fingerprint("ds", CONFIG.fingerprint(), 2))


def test_the_http_face_answers_409_with_the_versions(tmp_path: Path) -> None:
    from fastapi.testclient import TestClient

    from ladle.service.http import create_app
    from ladle.service.http.inspector import Inspector

    reg = registry(tmp_path)
    reg.store.open_job(JobSpec("old", "ds", CONFIG.fingerprint(1), 2))
    client = TestClient(create_app(Inspector(reg)))
    answer = client.get("/v1/jobs/old/quality")
    assert answer.status_code == 409, answer.text
    assert "version 1 of ladle's schedule algorithm" in answer.text, answer.text
