"""The HTTP face in process: page caps, lag, previews, colours, metrics; the page's paging, refusals."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from ladle.service.errors import ConfigError
from ladle.service.http import create_app
from ladle.service.http import inspector as insp
from ladle.service.http.page import bucket_colour
from ladle.service.jobs import JobRegistry
from ladle.service.metrics import LoopHistogram, ServerMetrics
from ladle.service.schedule import ScheduleConfig, build_schedule
from ladle.service.standing import steps_between
from ladle.service.store import EmbeddedStore, Position
from ladle.service.store.base import Clock

CONFIG = ScheduleConfig(max_seq_len=128, bucket_bounds=(0, 32, 64, 129), token_budget=256, max_batch_size=4)


def make_inspector(tmp_path: Path, rows: int = 40_000, clock: Clock = time.time) -> insp.Inspector:
    """An inspector of ``rows`` rows of lengths 1..128 (no dataset files), its store's clock ``clock``."""
    from types import SimpleNamespace

    from ladle.service.dataset import Columns

    lengths = (np.arange(rows, dtype=np.int64) * 37) % 128 + 1
    dataset = SimpleNamespace(
        lengths=lengths, fingerprint="ds-test", path=str(tmp_path), num_rows=len(lengths), columns=Columns()
    )
    store = EmbeddedStore(tmp_path / "state.db", clock=clock)
    return insp.Inspector(JobRegistry(dataset, CONFIG, store))  # type: ignore[arg-type]


@pytest.fixture
def inspector(tmp_path: Path) -> insp.Inspector:
    return make_inspector(tmp_path)


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
    between = steps_between
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


# --- the app in process: the page's paging, never-seen ranks, refusals, HEAD ---


def started(inspector: insp.Inspector, job: str, steps: dict[int, int], world: int = 2) -> None:
    """A job of ``world`` ranks whose ranks in ``steps`` joined and consumed that many steps of epoch 0."""
    inspector.registry.open(job, world)
    for rank, step in steps.items():
        joined = inspector.store.join(job, rank, world)
        inspector.store.advance(job, rank, joined.generation, Position(0, step))


def pager(html: str) -> dict[str, int]:
    """The pager's step links: {"prev": start, "next": start}."""
    nav = re.search(r'<nav class="pager">(.*?)</nav>', html)
    assert nav is not None, "no pager"
    return {m[1]: int(m[2]) for m in re.finditer(r'id="(prev|next)" href="[^"]*start=(\d+)"', nav[1])}


def ribbon_start(html: str) -> int:
    found = re.search(r'<svg id="ribbon-ladle"[^>]* data-start="(\d+)"', html)
    assert found is not None, "no ribbon"
    return int(found[1])


def test_earlier_steps_go_back_a_full_page_from_the_epochs_end_at_most(inspector: insp.Inspector) -> None:
    started(inspector, "paged", {0: 0, 1: 0})
    client = TestClient(create_app(inspector))
    steps = inspector.job(inspector.state("paged")).steps(0)
    size = insp.DEFAULT_PAGE_STEPS
    assert steps > 2 * size

    def links(start: int) -> dict[str, int]:
        reply = client.get("/", params={"job": "paged", "start": start})
        assert reply.status_code == 200, reply.text
        return pager(reply.text)

    assert links(size) == {"prev": 0, "next": 2 * size}
    assert links(steps - 50) == {"prev": steps - 50 - size}, "a short last page goes back less than a page"
    assert links(10**6) == {"prev": steps - size}, "a page past the end does not lead back to the last"
    assert links(steps) == {"prev": steps - size}
    assert links(30) == {"prev": 0, "next": 30 + size}


def page_state(html: str) -> dict[str, Any]:
    found = re.search(r'<script id="ladle-state" type="application/json">(.*?)</script>', html)
    assert found is not None, "no state for the page's script"
    doc: dict[str, Any] = json.loads(found[1])
    return doc


def test_the_page_opens_where_the_leader_is_and_follows_it_unless_told_where(
    inspector: insp.Inspector,
) -> None:
    size = insp.DEFAULT_PAGE_STEPS
    started(inspector, "midway", {0: 2 * size + 70, 1: size + 30})
    client = TestClient(create_app(inspector))
    html = client.get("/", params={"job": "midway"}).text
    assert ribbon_start(html) == 2 * size, "the page does not open at the leading rank's window"
    assert pager(html) == {"prev": size, "next": 3 * size}
    assert page_state(html)["follow"] is True, "a page opened without start= or epoch= does not follow"
    assert 'id="follow"' not in html, "a page that follows offers to follow"
    assert ribbon_start(client.get("/").text) == 2 * size, "the default job's page neither"
    for params, start in (({"start": 0}, 0), ({"epoch": 1}, 0), ({"epoch": 0}, 2 * size)):
        navigated = client.get("/", params={"job": "midway", **params}).text
        assert ribbon_start(navigated) == start, params
        assert page_state(navigated)["follow"] is False, f"a page opened with {params} moves by itself"
        assert re.search(r'<a id="follow" href="\./\?job=midway">', navigated), "no way back to following"


def test_a_rank_no_trainer_joined_was_never_seen(inspector: insp.Inspector) -> None:
    started(inspector, "half", {0: 3})
    client = TestClient(create_app(inspector))
    reply = client.get("/v1/jobs/half/cursor")
    assert reply.status_code == 200, reply.text
    ranks = reply.json()["ranks"]
    assert ranks[1]["generation"] == 0
    assert (ranks[1]["last_seen"], ranks[1]["seen_ago_s"]) == (None, None), "a rank never joined was seen"
    assert ranks[0]["last_seen"] is not None
    assert ranks[0]["seen_ago_s"] < 60
    html = client.get("/", params={"job": "half"}).text
    assert re.search(r'<tr id="rank-1">.*?<td class="seen">never</td>', html), "the page says it was seen"
    assert re.search(r'<tr id="rank-0">.*?<td class="seen">\d+ s ago</td>', html)
    assert 'if (s === null) return "never";' in html, "the page's refreshes show a time for never"


def test_a_job_of_another_config_is_refused_without_advice_to_delete_it(inspector: insp.Inspector) -> None:
    from ladle.service.store import JobSpec

    inspector.store.open_job(JobSpec("elsewhere", "ds-test", "another-config", 2))
    client = TestClient(create_app(inspector))
    for path in ("/v1/jobs/elsewhere/cursor", "/v1/jobs/elsewhere/schedule", "/?job=elsewhere"):
        reply = client.get(path)
        assert reply.status_code == 409, path
        text = reply.json()["detail"] if path.startswith("/v1") else reply.text
        assert "cannot derive its schedule" in text, f"{path}: {text}"
        assert "another dataset or schedule config" in text, f"{path}: {text}"
        for advice in ("delete", "reset=True", "resume"):
            assert advice not in text, f"{path} tells the reader to {advice}: {text}"
    body = client.get("/v1/jobs/elsewhere/buckets").json()
    assert body["kind"] == "failed_precondition"
    assert set(body) == {"detail", "kind", "field"}
    # the landing page: no job of this server's yet, and it says what the store does hold
    banner = re.search(r'<p class="banner" id="preview">(.*?)</p>', client.get("/").text)
    assert banner is not None, "no preview"
    assert "No jobs yet" not in banner.group(1), banner.group(1)
    assert "(1 of another dataset or config in the store)" in banner.group(1), banner.group(1)


def test_the_page_asks_a_browser_for_the_token_in_html(inspector: insp.Inspector) -> None:
    from ladle.service.security import TokenCheck

    client = TestClient(create_app(inspector, token=TokenCheck(["a-token-of-32-characters-or-more!"])))
    page = client.get("/")
    assert page.status_code == 401
    assert page.headers["content-type"].startswith("text/html"), "a browser gets the API's JSON"
    assert page.headers["www-authenticate"].startswith("Basic")
    assert "password" in page.text
    api = client.get("/v1/jobs")
    assert api.status_code == 401
    assert api.json()["kind"] == "unauthenticated"
    assert api.headers["www-authenticate"].startswith("Bearer")
    assert client.head("/healthz").status_code == 200, "HEAD needs a token"


def test_health_and_readiness_answer_head(inspector: insp.Inspector, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(inspector, "dataset_ok", lambda: True)  # the fixture's dataset has no files
    client = TestClient(create_app(inspector))
    for path in ("/healthz", "/readyz"):
        reply = client.head(path)
        assert reply.status_code == 200, f"HEAD {path}: {reply.status_code}"
        assert reply.content == b"", f"HEAD {path} has a body"
    monkeypatch.setattr(inspector, "store_error", lambda: "the store is down")
    assert client.head("/readyz").status_code == 503
    assert client.get("/readyz").status_code == 503


def test_the_openapi_document_names_the_token_when_there_is_one(inspector: insp.Inspector) -> None:
    """/docs had no Authorize button and generated clients never sent the token."""
    from ladle.service.security import TokenCheck

    secret = "a-token-of-32-characters-or-more!"
    client = TestClient(create_app(inspector, token=TokenCheck([secret])))
    document = client.get("/openapi.json").json()
    schemes = document["components"]["securitySchemes"]
    assert [s["scheme"].lower() for s in schemes.values()] == ["bearer"], schemes
    assert document["paths"]["/v1/jobs"]["get"]["security"], "the API's operations name no token"
    assert client.get("/v1/jobs", headers={"authorization": f"Bearer {secret}"}).status_code == 200
    assert client.get("/", auth=("anyone", secret)).status_code in (200, 503), "Basic stopped working"
    plain = TestClient(create_app(inspector)).get("/openapi.json").json()
    assert "securitySchemes" not in plain.get("components", {}), "a server without a token asks for one"


def test_an_unknown_path_or_method_gets_the_refusal_body_with_a_kind(inspector: insp.Inspector) -> None:
    """They answered FastAPI's bare {"detail": "Not Found"}, unlike every other refusal."""
    client = TestClient(create_app(inspector))
    missing = client.get("/v1/nothing-here")
    assert missing.status_code == 404
    assert missing.json() == {"detail": "Not Found", "kind": "not_found", "field": None}
    wrong = client.post("/v1/jobs")
    assert wrong.status_code == 405
    assert wrong.json()["kind"] == "method_not_allowed"
    assert "GET" in wrong.headers["allow"]


def test_a_loopback_server_without_a_token_answers_only_local_names(inspector: insp.Inspector) -> None:
    """Any Host was answered: a web page could read the API through a DNS name pointing at 127.0.0.1."""
    app = create_app(inspector, local_hosts_only=True)
    for host in ("127.0.0.1:8080", "localhost:8080", "LOCALHOST", "[::1]:8080", "127.0.0.1"):
        assert TestClient(app).get("/v1/jobs", headers={"host": host}).status_code == 200, host
    for host in ("attacker.example:8080", "127.0.0.1.nip.io", "[::1", "", "10.0.0.1:8080"):
        reply = TestClient(app).get("/v1/jobs", headers={"host": host})
        assert reply.status_code == 400, host
        assert reply.json()["kind"] == "invalid_argument"
        assert reply.json()["field"] == "host"
    open_app = create_app(inspector)  # a token, or a reachable host: no such check
    assert TestClient(open_app).get("/v1/jobs", headers={"host": "ladle.internal:8080"}).status_code == 200


def test_an_unexpected_error_is_one_counted_logged_500(
    inspector: insp.Inspector, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A 500 used to escape the error counter (an alert on 5xx never fired) and be logged twice."""

    def broken(name: str) -> None:
        raise KeyError("dataset_fingerprint")  # e.g. a malformed job in the store

    monkeypatch.setattr(inspector, "state", broken)
    metrics = ServerMetrics()
    client = TestClient(create_app(inspector, metrics), raise_server_exceptions=False)
    with caplog.at_level("ERROR"):
        answer = client.get("/v1/jobs/j")
    assert answer.status_code == 500
    assert answer.json() == {"detail": "internal error: KeyError", "kind": "internal", "field": None}
    assert len([r for r in caplog.records if r.exc_info]) == 1, [r.getMessage() for r in caplog.records]
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(metrics.exposition().decode())
        for s in family.samples
    }
    assert samples["ladle_errors_total", (("code", "500"), ("face", "http"))] == 1


def test_the_metrics_name_the_release_and_the_process() -> None:
    """What an operator needs to tell replicas apart and watch the process: no per-job series needed."""
    import ladle

    body = ServerMetrics().exposition().decode()
    assert 'ladle_build_info{grpcio="' in body
    assert f'version="{ladle.__version__}"' in body
    for name in ("process_resident_memory_bytes", "process_open_fds", "process_cpu_seconds_total"):
        assert f"\n{name} " in body, name
