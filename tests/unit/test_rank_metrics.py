"""Where each rank stands, on /metrics and on the page: the values, the bounded series, the alert rule.

A real embedded store with a clock set back for the ranks that stalled; the
figures are checked against ``/cursor``'s, which the store read gives too.
"""

from __future__ import annotations

import functools
import re
import shutil
import subprocess
import time
from pathlib import Path

import pytest
import yaml
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from ladle.service.errors import StoreUnavailableError
from ladle.service.http import create_app
from ladle.service.http import inspector as insp
from ladle.service.http.page import RIBBON_RANKS, TABLE_RANKS
from ladle.service.metrics import METRIC_NAMES, UNSEEN_OVER_S, ServerMetrics
from ladle.service.standing import JobStanding, read_standing
from ladle.service.store import Position
from tests.contract.store_contract import ManualClock

from .test_http_inspector import make_inspector, page_state

DOCS = Path(__file__).resolve().parents[2] / "docs"
Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def scrape(metrics: ServerMetrics) -> Samples:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(metrics.exposition().decode())
        for s in family.samples
    }


def per_rank(samples: Samples, name: str, job: str) -> dict[int, float]:
    """``{rank: value}`` of the per-rank series ``name`` of ``job``."""
    return {
        int(dict(labels)["rank"]): v
        for (n, labels), v in samples.items()
        if n == name and ("job", job) in labels
    }


def watched(inspector: insp.Inspector, *jobs: str, rank_series: int = 32) -> ServerMetrics:
    """Metrics that read where the ranks stand from ``inspector``'s store, with a stream open for each job."""
    metrics = ServerMetrics()
    metrics.watch_ranks(functools.partial(read_standing, inspector.registry), rank_series)
    for job in jobs:
        metrics.stream(job, 0)
    metrics.watch_streams(lambda: [(job, 0, 1) for job in jobs])  # rank 0 of each: a batch in flight
    return metrics


def advance(inspector: insp.Inspector, job: str, world: int, steps: dict[int, int]) -> None:
    for rank, step in steps.items():
        joined = inspector.store.join(job, rank, world)
        inspector.store.advance(job, rank, joined.generation, Position(0, step))


def one(samples: Samples, name: str, **labels: str) -> float:
    return samples[name, tuple(sorted(labels.items()))]


def test_each_rank_step_lag_and_time_since_seen(tmp_path: Path) -> None:
    clock = ManualClock(time.time() - 1000)
    inspector = make_inspector(tmp_path, clock=clock)
    inspector.registry.open("run", 8)
    advance(inspector, "run", 8, {2: 3})  # rank 2 stalls at step 3, 1000 s ago
    clock.now = time.time() - 10
    advance(inspector, "run", 8, {r: 10 + r for r in (0, 1, 3, 4, 6, 7)})  # rank 5: no trainer yet
    metrics = watched(inspector, "run")
    samples = scrape(metrics)
    cursor = inspector.cursor(inspector.job(inspector.state("run")), inspector.state("run"))

    assert per_rank(samples, "ladle_rank_step", "run") == {r["rank"]: r["step"] for r in cursor["ranks"]}
    assert per_rank(samples, "ladle_rank_epoch", "run") == dict.fromkeys(range(8), 0)
    lag = per_rank(samples, "ladle_rank_lag_steps", "run")
    assert lag == {r["rank"]: r["lag_steps"] for r in cursor["ranks"]}, "the lag differs from /cursor's"
    assert (lag[2], lag[5], lag[7]) == (17 - 3, 17, 0)
    seen = per_rank(samples, "ladle_rank_seen_ago_seconds", "run")
    assert seen[2] == pytest.approx(1000, abs=30), "the stalled rank's time since seen"
    assert seen[0] == pytest.approx(10, abs=30)
    assert seen[5] == pytest.approx(1000, abs=30), "a rank never joined: not since the job was created"
    assert one(samples, "ladle_job_ranks", job="run") == 8
    assert (
        one(samples, "ladle_job_leader_epoch", job="run"),
        one(samples, "ladle_job_leader_step", job="run"),
    ) == (
        0,
        17,
    )
    assert one(samples, "ladle_job_lag_steps_max", job="run") == 17
    assert one(samples, "ladle_job_seen_ago_seconds_max", job="run") == pytest.approx(1000, abs=30)
    assert one(samples, "ladle_job_seen_ago_seconds_min", job="run") == pytest.approx(10, abs=30)
    assert [one(samples, "ladle_job_ranks_unseen", job="run", over=str(s)) for s in UNSEEN_OVER_S] == [
        2,
        2,
        0,
    ]


def test_a_thousand_ranks_get_bounded_series_that_always_show_the_stalled_ones(tmp_path: Path) -> None:
    clock = ManualClock(time.time() - 1000)
    inspector = make_inspector(tmp_path, rows=200_000, clock=clock)
    world = 1000
    inspector.registry.open("big", world)
    advance(inspector, "big", world, {700: 38})  # stalled 1000 s ago
    clock.now = time.time()
    advance(inspector, "big", world, {r: 20 if r == 900 else 40 for r in range(world) if r != 700})
    metrics = watched(inspector, "big", rank_series=32)
    samples = scrape(metrics)

    shown = per_rank(samples, "ladle_rank_seen_ago_seconds", "big")
    assert len(shown) == 32, f"{len(shown)} ranks of 1000 have series of their own, not 32"
    assert {700, 900} <= set(shown), "the stalled rank or the one far behind has no series"
    assert set(shown) == {700, 900, *range(30)}, "healthy ranks are not picked by rank"
    for name in ("ladle_rank_step", "ladle_rank_epoch", "ladle_rank_lag_steps"):
        assert set(per_rank(samples, name, "big")) == set(shown), name
    assert one(samples, "ladle_job_ranks", job="big") == world
    assert one(samples, "ladle_job_lag_steps_max", job="big") == 20
    assert one(samples, "ladle_job_ranks_unseen", job="big", over="300") == 1

    # ranks that trade places by a step keep their series (a series a scrape is churn for Prometheus)
    advance(inspector, "big", world, {r: 41 for r in range(40, 60)})
    assert set(per_rank(scrape(metrics), "ladle_rank_step", "big")) == set(shown), "healthy ranks churn"
    # a rank that stalls takes the place of a healthy one at once
    clock.now = time.time() - 100
    advance(inspector, "big", world, {500: 41})
    clock.now = time.time()
    advance(inspector, "big", world, {r: 42 for r in range(world) if r not in (500, 700, 900)})
    again = set(per_rank(scrape(metrics), "ladle_rank_step", "big"))
    assert {500, 700, 900} <= again, f"a rank that stalled has no series: {sorted(again)}"
    assert len(again) == 32

    summary_only = scrape(watched(inspector, "big", rank_series=0))
    assert not per_rank(summary_only, "ladle_rank_step", "big"), "--metrics-ranks 0 still gives rank series"
    assert one(summary_only, "ladle_job_ranks", job="big") == world


def test_only_jobs_streamed_here_are_read_and_an_unreadable_one_is_left_out(tmp_path: Path) -> None:
    inspector = make_inspector(tmp_path)
    for job in ("here", "gone", "old", "elsewhere"):
        inspector.registry.open(job, 2)
        advance(inspector, job, 2, {0: 4, 1: 2})
    now = [0.0]
    metrics = ServerMetrics(meter_linger_s=3600, clock=lambda: now[0])
    metrics.watch_ranks(functools.partial(read_standing, inspector.registry))
    metrics.stream("here", 0)
    metrics.stream("gone", 1)
    old = metrics.stream("old", 0)
    metrics.ended(old)
    inspector.store.delete_job("gone")
    now[0] = 3601.0  # "old" ended more than an hour ago
    samples = scrape(metrics)
    jobs = {dict(labels)["job"] for (name, labels) in samples if name == "ladle_job_ranks"}
    assert jobs == {"here"}, f"read jobs {jobs}: only those with a stream here, and that the store holds"
    assert per_rank(samples, "ladle_rank_lag_steps", "here") == {0: 0, 1: 2}


def rule_file() -> str:
    """The Prometheus rule file docs/deploy.md gives (its ```yaml block of `groups:`)."""
    text = (DOCS / "deploy.md").read_text()
    blocks = [b for b in re.findall(r"```yaml\n(.*?)```", text, re.S) if b.lstrip().startswith("groups:")]
    assert len(blocks) == 1, "docs/deploy.md has no Prometheus rule file (a ```yaml block of groups:)"
    return str(blocks[0])


def alert_rules() -> list[dict[str, object]]:
    doc = yaml.safe_load(rule_file())
    return [rule for group in doc["groups"] for rule in group["rules"]]


def test_the_alert_rules_in_the_docs_use_metrics_the_server_exposes(tmp_path: Path) -> None:
    inspector = make_inspector(tmp_path)
    inspector.registry.open("run", 2)
    advance(inspector, "run", 2, {0: 4, 1: 2})
    exposed = {name for name, _ in scrape(watched(inspector, "run"))}
    rules = alert_rules()
    assert {"LadleRankStalled", "LadleJobStalled"} <= {r.get("alert") for r in rules}, rules
    for rule in rules:
        expr = str(rule["expr"])
        assert expr.count("(") == expr.count(")"), f"{rule['alert']}: unbalanced parentheses"
        assert re.fullmatch(r"\d+[smh]", str(rule["for"])), rule
        assert isinstance(rule["annotations"], dict), rule
        assert "summary" in rule["annotations"], rule
        used = set(re.findall(r"\bladle_[a-z_]+", expr))
        assert used, f"{rule['alert']} uses no ladle metric"
        assert used <= exposed, f"{rule['alert']} uses {sorted(used - exposed)}, which /metrics does not give"
    promtool = shutil.which("promtool")  # Prometheus's own check, where it is installed
    if promtool is not None:
        path = tmp_path / "rules.yml"
        path.write_text(rule_file())
        check = [promtool, "check", "rules", str(path)]
        checked = subprocess.run(check, capture_output=True, text=True, timeout=60)
        assert checked.returncode == 0, f"promtool check rules: {checked.stdout}{checked.stderr}"
    listed = (DOCS / "inspect.md").read_text()
    missing = [name for name in METRIC_NAMES if f"`{name}`" not in listed]
    assert not missing, f"docs/inspect.md does not describe {missing}"


def test_the_page_of_a_thousand_ranks_draws_a_bounded_ribbon_and_lists_the_ranks_to_look_at(
    tmp_path: Path,
) -> None:
    clock = ManualClock(time.time() - 1000)
    inspector = make_inspector(tmp_path, rows=200_000, clock=clock)
    world = 1000
    inspector.registry.open("big", world)
    advance(inspector, "big", world, {700: 38})
    clock.now = time.time()
    advance(inspector, "big", world, {r: 20 if r == 900 else 40 for r in range(world) if r not in (700, 3)})
    html = TestClient(create_app(inspector)).get("/", params={"job": "big"}).text

    rows = len(re.findall(r'<svg id="ribbon-ladle".*?</svg>', html, re.S)[0].split("<text ")) - 1
    assert rows == RIBBON_RANKS, f"the ribbon draws {rows} rank rows"
    state = page_state(html)
    cells = len(re.findall(r'class="cell b\d+"', html))
    assert cells == 2 * RIBBON_RANKS * state["steps"], "not one cell per step and drawn rank in each ribbon"
    listed = [int(r) for r in re.findall(r'<tr id="rank-(\d+)">', html)]
    assert len(listed) == TABLE_RANKS
    assert listed[:3] == [3, 700, 900], (
        f"the rank table does not start with the ranks to look at: {listed[:5]}"
    )
    assert "the 64 of 1000 ranks to look at first" in html
    assert "are at most 0 steps behind" in html
    assert len(html) < 600_000, f"the page of 1000 ranks is {len(html)} bytes"


def test_served_counters_and_depth_have_series_for_the_first_ranks_and_one_for_the_rest() -> None:
    """With ``rank_series`` 2, ranks 0 and 1 of a 6-rank job have served series of their own and ranks
    2-5 add up in ``rank="rest"``; a rest rank whose meter is dropped stays counted (the counter never
    falls), and the series go with the job's last meter."""
    now = [0.0]
    metrics = ServerMetrics(meter_linger_s=10.0, clock=lambda: now[0])
    metrics.watch_ranks(_store_away, 2)  # the standing series are other tests' business
    meters = {rank: metrics.stream("a", rank) for rank in range(6)}
    for rank, meter in meters.items():
        for _ in range(rank + 1):  # rank r is served r + 1 batches of 10 tokens
            meter.batch(10, 16, 100, 0.001)
    metrics.watch_streams(lambda: [("a", rank, rank % 3) for rank in meters])

    samples = scrape(metrics)
    served = per_label(samples, "ladle_batches_served_total", "a")
    assert served == {"0": 1, "1": 2, "rest": 3 + 4 + 5 + 6}
    assert per_label(samples, "ladle_tokens_served_total", "a") == {"0": 10, "1": 20, "rest": 180}
    assert per_label(samples, "ladle_stream_prefetch_depth", "a") == {"0": 0, "1": 1, "rest": 2 + 0 + 1 + 2}

    metrics.ended(meters[3])
    now[0] = 20.0
    metrics.stream("a", 0)  # any new stream drops the meters idle past the linger
    assert ("a", 3) not in metrics.meters
    assert per_label(scrape(metrics), "ladle_batches_served_total", "a")["rest"] == 18, "a counter fell"

    for rank in (0, 1, 2, 4, 5):  # rank 3 ended above
        metrics.ended(meters[rank])
    metrics.ended(meters[0])  # the second stream of rank 0
    now[0] = 40.0
    metrics.stream("b", 0)
    assert per_label(scrape(metrics), "ladle_batches_served_total", "a") == {}
    assert metrics.retired == {}


def _store_away(job: str) -> JobStanding:
    raise StoreUnavailableError(f"no store here (job {job})")


def per_label(samples: Samples, name: str, job: str) -> dict[str, float]:
    """``{rank label: value}`` of the series ``name`` of ``job``."""
    return {
        dict(labels)["rank"]: v for (n, labels), v in samples.items() if n == name and ("job", job) in labels
    }
