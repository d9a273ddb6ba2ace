"""Many jobs in the store: /v1/jobs pages them, requests share one listing, the page caps its links.

A cluster's store keeps every run for its TTL; listing 10,000 jobs took
0.75 s of Python per request, and a dozen requests at once slowed the
trainers' streams to a tenth.
"""

from __future__ import annotations

import re
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
from fastapi.testclient import TestClient

from ladle.service.dataset import Columns
from ladle.service.http import Inspector, create_app
from ladle.service.http.page import PAGE_JOBS
from ladle.service.jobs import JobRegistry
from ladle.service.metrics import ServerMetrics
from ladle.service.schedule import ScheduleConfig
from ladle.service.store import EmbeddedStore

CONFIG = ScheduleConfig(max_seq_len=128, bucket_bounds=(0, 32, 129), token_budget=512)


@pytest.fixture
def registry(tmp_path: Path) -> JobRegistry:
    lengths = (np.arange(2000, dtype=np.int64) * 37) % 128 + 1
    dataset = SimpleNamespace(
        lengths=lengths, fingerprint="ds", path=str(tmp_path), num_rows=len(lengths), columns=Columns()
    )
    return JobRegistry(dataset, CONFIG, EmbeddedStore(tmp_path / "state.db"))  # type: ignore[arg-type]


def test_v1_jobs_pages_by_name(registry: JobRegistry) -> None:
    names = [f"run-{i:02d}" for i in range(7)]
    for name in reversed(names):
        registry.open(name, 2)
    client = TestClient(create_app(Inspector(registry), ServerMetrics()))
    seen: list[str] = []
    after = None
    for _ in range(10):
        reply = client.get("/v1/jobs", params={"limit": 3, **({"after": after} if after else {})})
        assert reply.status_code == 200, reply.text
        body = reply.json()
        assert body["total"] == 7
        assert len(body["jobs"]) <= 3
        seen += [j["job"] for j in body["jobs"]]
        after = body["next_after"]
        if after is None:
            break
    assert seen == names, "pages missed, repeated or reordered jobs"
    whole = client.get("/v1/jobs").json()
    assert [j["job"] for j in whole["jobs"]] == names
    assert whole["next_after"] is None
    for bad in ({"limit": 0}, {"limit": 10**6}, {"after": "no/such"}):
        assert client.get("/v1/jobs", params=bad).status_code == 422, bad


def test_concurrent_requests_share_one_listing(registry: JobRegistry) -> None:
    registry.open("only", 2)
    inspector = Inspector(registry)
    calls: list[float] = []
    real = inspector.store.list_jobs

    def slow() -> Any:
        calls.append(time.monotonic())
        time.sleep(0.3)
        return real()

    inspector.store = SimpleNamespace(list_jobs=slow)  # type: ignore[assignment]
    results: list[list[Any]] = []
    start = threading.Barrier(8)

    def ask() -> None:
        start.wait()
        results.append(inspector.job_states())

    threads = [threading.Thread(target=ask) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert len(results) == 8
    assert all([s.job for s in r] == ["only"] for r in results)
    assert len(calls) <= 2, f"{len(calls)} listings for 8 requests at once"
    inspector.job_states()
    assert len(calls) <= 3, "a request after the others did not list afresh"


def test_a_failed_listing_fails_the_requests_that_waited_for_it(registry: JobRegistry) -> None:
    inspector = Inspector(registry)
    entered = threading.Event()

    def broken() -> Any:
        entered.set()
        time.sleep(0.3)
        raise RuntimeError("store down")

    inspector.store = SimpleNamespace(list_jobs=broken)  # type: ignore[assignment]
    errors: list[BaseException] = []

    def ask() -> None:
        try:
            inspector.job_states()
        except RuntimeError as exc:
            errors.append(exc)

    first = threading.Thread(target=ask)
    first.start()
    assert entered.wait(10)
    second = threading.Thread(target=ask)
    second.start()
    first.join(30)
    second.join(30)
    assert len(errors) == 2


def test_the_page_links_the_jobs_updated_last(registry: JobRegistry) -> None:
    for i in range(PAGE_JOBS + 7):
        registry.open(f"job-{i:03d}", 2)
    client = TestClient(create_app(Inspector(registry), ServerMetrics()))
    page = client.get("/", params={"job": "job-000"})
    assert page.status_code == 200, page.text[:500]
    linked = set(re.findall(r'href="\./\?job=(job-\d+)"', page.text))
    assert len(linked) == PAGE_JOBS + 1, "the shown job and the 50 updated last"
    assert "job-000" in linked
    assert "and 6 more (/v1/jobs)" in page.text
