"""The HTTP face of a real ``ladle serve`` process: every endpoint, paging edges, errors, metrics, inspect.

Numbers are checked against the schedule built here (``build_schedule``) and
against ``ladle plan --json``, so the API shows what trainers receive.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from ladle.client import BatchClient, BatchClientError
from ladle.service import cli
from ladle.service.dataset import open_dataset
from ladle.service.schedule import Schedule, build_schedule
from ladle.service.schedule.stats import quality, simulate_loss

from .conftest import SMALL_CONFIG, ServerProcess
from .test_serving import CONFIG

Factory = Callable[..., ServerProcess]


def get(server: ServerProcess, path: str) -> tuple[int, Any]:
    """(status, decoded JSON body) of a GET; 4xx and 5xx are returned, not raised."""
    try:
        with urllib.request.urlopen(server.http_url + path, timeout=30) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def ok(server: ServerProcess, path: str) -> Any:
    status, body = get(server, path)
    assert status == 200, f"GET {path}: {status} {body}"
    return body


def head(server: ServerProcess, path: str) -> tuple[int, bytes]:
    """(status, body) of a HEAD request; 4xx and 5xx are returned, not raised."""
    request = urllib.request.Request(server.http_url + path, method="HEAD")
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def metrics(server: ServerProcess) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of /metrics, parsed by prometheus-client's own parser."""
    with urllib.request.urlopen(server.http_url + "/metrics", timeout=30) as response:
        assert response.headers["Content-Type"].startswith("text/plain")
        text = response.read().decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return out


def reference(dataset: Path, world: int, epoch: int = 0, interleave: str = "stride") -> Schedule:
    config = CONFIG.replace(interleave=interleave)
    return build_schedule(open_dataset(dataset).lengths, config, epoch=epoch, world_size=world)


def wait_for_cursor(server: ServerProcess, job: str, steps: list[int]) -> dict[str, Any]:
    """The job's cursor once every rank's stored step is ``steps[rank]`` (written behind the stream)."""
    deadline = time.monotonic() + 10
    while True:
        cursor = ok(server, f"/v1/jobs/{job}/cursor")
        if [r["step"] for r in cursor["ranks"]] == steps or time.monotonic() > deadline:
            return cursor  # type: ignore[no-any-return]
        time.sleep(0.05)


def test_health_ready_and_no_jobs_yet(module_server: ServerProcess) -> None:
    assert ok(module_server, "/healthz") == {"status": "ok"}
    for path in ("/healthz", "/readyz"):
        assert head(module_server, path) == (200, b""), f"HEAD {path}"
    ready = ok(module_server, "/readyz")
    assert ready["ready"], ready
    assert ready["dataset_ok"]
    assert ready["store"]["ok"]
    assert ready["dataset"]["rows"] == 2000
    listing = ok(module_server, "/v1/jobs")
    assert listing["jobs"] == [], "a fresh store lists jobs"
    assert listing["dataset"]["fingerprint"] == open_dataset(module_server.dataset).fingerprint
    with urllib.request.urlopen(module_server.http_url + "/", timeout=30) as response:
        page = response.read().decode()
    assert 'id="preview"' in page, "no preview of the schedule when there is no job"
    doc = ok(module_server, "/openapi.json")
    assert {"/v1/jobs/{job}/schedule", "/v1/jobs/{job}/cursor", "/metrics", "/readyz"} <= set(doc["paths"])


def test_every_job_endpoint_against_the_schedule(module_server: ServerProcess, small_dataset: Path) -> None:
    server, job = module_server, "http-run"
    before = metrics(server)
    clients = [BatchClient(r, 2, server.address, job, timeout=30, prefetch=4) for r in range(2)]
    try:
        taken = [10, 4]
        for client, n in zip(clients, taken, strict=True):
            it = iter(client)
            for _ in range(n):
                next(it)
            client.state_dict()  # acknowledges the batch held, so the cursor is at n
        sched = reference(small_dataset, 2)
        cursor = wait_for_cursor(server, job, taken)
        assert cursor["leader"] == {"epoch": 0, "step": 10}
        assert [r["lag_steps"] for r in cursor["ranks"]] == [0, 6], "lag behind the leader is wrong"
        assert [r["steps_in_epoch"] for r in cursor["ranks"]] == [sched.num_steps] * 2
        assert cursor["ranks"][1]["progress"] == pytest.approx(4 / sched.num_steps, abs=1e-4)
        assert all(r["generation"] == 1 and r["seen_ago_s"] < 60 for r in cursor["ranks"])

        # metrics moved while both streams are open (parsed by prometheus-client's parser)
        after = metrics(server)
        for rank, n in enumerate(taken):
            labels = (("job", job), ("rank", str(rank)))
            sent = after[("ladle_batches_served_total", labels)]
            assert n <= sent <= n + 4, f"rank {rank}: {sent} batches counted, {n} consumed, prefetch 4"
            assert after[("ladle_tokens_served_total", labels)] > 0
            assert (
                after[("ladle_padded_tokens_served_total", labels)]
                >= after[("ladle_tokens_served_total", labels)]
            )
            assert after[("ladle_bytes_served_total", labels)] > 100 * sent
            assert 0 <= after[("ladle_stream_prefetch_depth", labels)] <= 4
        assert after[("ladle_streams_open", ())] == 2
        assert 1 <= after[("ladle_schedules_cached", ())] <= 2 + 4, "epoch 0 (and 1 ahead), a few spare"
        count = ("ladle_batch_assembly_seconds_count", ())
        assert after[count] - before.get(count, 0) >= sum(taken)
        assert after[("ladle_stream_send_seconds_count", ())] >= sum(taken)
        assert after[("ladle_store_seconds_count", (("op", "join"),))] >= 2
        # where each rank stands, read from the store when scraped: the same figures as /cursor
        for r in cursor["ranks"]:
            labels = (("job", job), ("rank", str(r["rank"])))
            assert after[("ladle_rank_step", labels)] == r["step"], f"rank {r['rank']}: step"
            assert after[("ladle_rank_epoch", labels)] == r["epoch"]
            assert after[("ladle_rank_lag_steps", labels)] == r["lag_steps"], f"rank {r['rank']}: lag"
            assert 0 <= after[("ladle_rank_seen_ago_seconds", labels)] < 60
        assert after[("ladle_job_ranks", (("job", job),))] == 2
        assert after[("ladle_job_leader_step", (("job", job),))] == 10
        assert after[("ladle_job_lag_steps_max", (("job", job),))] == 6

        # the job, its config and progress
        listing = ok(server, "/v1/jobs")
        (row,) = [j for j in listing["jobs"] if j["job"] == job]
        assert row["served"]
        assert row["world_size"] == 2
        assert (row["min_position"], row["max_position"]) == (
            {"epoch": 0, "step": 4},
            {"epoch": 0, "step": 10},
        )
        detail = ok(server, f"/v1/jobs/{job}")
        assert detail["steps_per_epoch"] == sched.num_steps
        assert detail["config"]["token_budget"] == CONFIG.token_budget
        assert detail["config_fingerprint"] == CONFIG.fingerprint()
        assert detail["progress"] == pytest.approx(4 / sched.num_steps, abs=1e-4)
        assert detail["resize_history"] == []

        check_buckets_and_quality(server, job, small_dataset)
        check_schedule_pages(server, job, sched)
        check_inspect(server, job, sched)
    finally:
        for client in clients:
            client.close()


def check_buckets_and_quality(server: ServerProcess, job: str, dataset: Path) -> None:
    """/buckets equals `ladle plan --json`; /quality equals the stats of the same schedule."""
    buckets = ok(server, f"/v1/jobs/{job}/buckets?epoch=0")
    plan = plan_json(dataset, 2, 0)
    assert buckets["buckets"] == plan["buckets"], "/buckets differs from ladle plan --json"
    assert buckets["bucket_bounds"] == plan["bucket_bounds"]
    assert buckets["num_steps"] == plan["num_steps"]
    assert buckets["padding_efficiency"] == plan["padding_efficiency"]
    assert ok(server, f"/v1/jobs/{job}/buckets")["epoch"] == 0, "the default epoch is the slowest rank's"
    for interleave in ("stride", "random"):
        doc = ok(server, f"/v1/jobs/{job}/quality?epoch=0&interleave={interleave}")
        sched = reference(dataset, 2, 0, interleave)
        after = reference(dataset, 2, 1, interleave)  # the batch-mates that meet again
        assert doc["interleave"] == interleave
        assert doc["quality"] == json.loads(json.dumps(asdict(quality(sched, after))))
        assert doc["quality"]["batch_mates_again"] is not None
        assert doc["simulated_loss"] == asdict(simulate_loss(sched))
    epoch1 = ok(server, f"/v1/jobs/{job}/buckets?epoch=1")
    assert epoch1["buckets"] == plan_json(dataset, 2, 1)["buckets"]


def plan_json(dataset: Path, world: int, epoch: int) -> dict[str, Any]:
    import contextlib
    import io

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = cli.main(
            ["plan", str(dataset), "--json", "--world-size", str(world), "--epoch", str(epoch), *SMALL_CONFIG]
        )
    assert code == 0
    return json.loads(out.getvalue())  # type: ignore[no-any-return]


def check_schedule_pages(server: ServerProcess, job: str, sched: Schedule) -> None:
    base = f"/v1/jobs/{job}/schedule?epoch=0"
    seen: list[dict[str, Any]] = []
    start: int | None = 0
    pages = 0
    while start is not None:
        page = ok(server, f"{base}&start={start}&limit=7")
        assert page["num_steps"] == sched.num_steps
        assert page["limit"] == 7
        seen += page["batches"]
        start = page["next_start"]
        pages += 1
    assert pages == -(-sched.num_steps // 7)
    assert [(b["step"], b["rank"]) for b in seen] == [
        (s, r) for s in range(sched.num_steps) for r in range(2)
    ]
    for b in seen:
        s, r = b["step"], b["rank"]
        rows = sched.samples(s, r)
        assert b["bucket"] == sched.bucket(s, r)
        assert b["rows"] == len(rows)
        assert b["padded_len"] == sched.padded_len(s, r)
        assert b["padded_tokens"] == len(rows) * sched.padded_len(s, r)
        assert b["real_tokens"] == int(sched.lengths(s, r).sum())
        assert b["samples"] is None
    # paging edges
    last = ok(server, f"{base}&start={sched.num_steps - 1}&limit=5")
    assert [b["step"] for b in last["batches"]] == [sched.num_steps - 1] * 2
    assert last["next_start"] is None
    past = ok(server, f"{base}&start={sched.num_steps}")
    assert past["batches"] == []
    assert past["next_start"] is None
    assert ok(server, f"{base}&start={10**9}")["batches"] == []
    assert len(ok(server, f"{base}&limit=1000")["batches"]) == 2 * sched.num_steps
    one = ok(server, f"{base}&rank=1&start=3&limit=2&include=samples")
    assert [(b["step"], b["rank"]) for b in one["batches"]] == [(3, 1), (4, 1)]
    assert [b["samples"] for b in one["batches"]] == [
        sched.samples(3, 1).tolist(),
        sched.samples(4, 1).tolist(),
    ]
    default = ok(server, f"/v1/jobs/{job}/schedule")
    assert (default["start"], default["epoch"], default["limit"]) == (0, 0, 200)
    # bad parameters: 4xx with a message, never 5xx
    for query, status in [
        ("limit=0", 422),
        ("limit=1001", 422),
        ("start=-1", 422),
        ("epoch=-1", 422),
        ("epoch=x", 422),
        ("rank=2", 400),
        ("rank=-1", 422),
        ("include=rows", 422),
        ("interleave=sorted", 422),
    ]:
        code, body = get(server, f"/v1/jobs/{job}/schedule?{query}")
        assert code == status, f"?{query}: {code} {body}"
        assert body["detail"], f"?{query}: no message"
    code, body = get(server, f"/v1/jobs/{job}/schedule?rank=2")
    assert body["field"] == "rank"
    assert "outside" in body["detail"]


def check_inspect(server: ServerProcess, job: str, sched: Schedule) -> None:
    import contextlib
    import io

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert cli.main(["inspect", "--server", f"127.0.0.1:{server.http_port}", "--job", job]) == 0
    text = out.getvalue()
    assert cli.format_bucket_table(sched) in text, "inspect's bucket table differs from ladle plan's"
    ours = quality(sched, reference(server.dataset, 2, 1))
    random = quality(reference(server.dataset, 2, 0, "random"), reference(server.dataset, 2, 1, "random"))
    assert cli.format_quality(ours, random) in text
    assert "ranks (leader at 0:10)" in text
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert cli.main(["inspect", "--server", server.http_url, "--json"]) == 0
    doc = json.loads(out.getvalue())
    assert doc["job"]["job"] == job, "inspect without --job shows the job updated last"
    assert [r["step"] for r in doc["cursor"]["ranks"]] == [10, 4]


def test_unknown_jobs_and_bad_names(module_server: ServerProcess, capsys: pytest.CaptureFixture[str]) -> None:
    for suffix in ("", "/buckets", "/schedule", "/quality", "/cursor"):
        status, body = get(module_server, f"/v1/jobs/no-such-job{suffix}")
        assert status == 404, f"{suffix}: {status}"
        assert body["kind"] == "not_found"
        assert "no-such-job" in body["detail"]
        status, body = get(module_server, f"/v1/jobs/bad%20name{suffix}")
        assert status == 422, f"a bad job name{suffix}: {status}"
    status, _ = get(module_server, "/v1/nothing")
    assert status == 404
    with pytest.raises(urllib.error.HTTPError) as failed:
        urllib.request.urlopen(module_server.http_url + "/?job=no-such-job", timeout=30)
    assert failed.value.code == 404
    assert "no-such-job" in failed.value.read().decode()
    assert cli.main(["inspect", "--server", module_server.http_url, "--job", "no-such-job"]) == 2
    assert "HTTP 404" in capsys.readouterr().err
    # a gRPC refusal counts too: a job of 2 ranks (made here, so the test runs alone) asked for 3
    with BatchClient(0, 2, module_server.address, "http-refused", timeout=10) as client:
        next(iter(client))
    with (
        BatchClient(0, 3, module_server.address, "http-refused", timeout=10) as client,
        pytest.raises(BatchClientError),
    ):
        next(iter(client))
    after = metrics(module_server)
    assert after[("ladle_errors_total", (("code", "404"), ("face", "http")))] >= 5
    assert after[("ladle_errors_total", (("code", "FAILED_PRECONDITION"), ("face", "grpc")))] >= 1


def test_the_page_answers_a_bad_parameter_with_its_error_page(module_server: ServerProcess) -> None:
    for query, field in (
        ("world_size=100000", "world_size"),
        ("start=-1", "start"),
        ("job=bad%20name", "job"),
    ):
        with pytest.raises(urllib.error.HTTPError) as failed:
            urllib.request.urlopen(f"{module_server.http_url}/?{query}", timeout=30)
        assert failed.value.code == 422, query
        assert failed.value.headers["content-type"].startswith("text/html"), f"?{query}: not the page's HTML"
        body = failed.value.read().decode()
        assert '<p id="error">' in body
        assert f"{field}: " in body, f"?{query}: the error does not name the parameter: {body}"
    status, body = get(module_server, "/v1/jobs/x/buckets?epoch=-1")
    assert status == 422, "the API keeps FastAPI's JSON 422"
    assert body["detail"][0]["loc"] == ["query", "epoch"]


def test_inspect_without_a_server(capsys: pytest.CaptureFixture[str]) -> None:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # closed at once: nothing listens there
    assert cli.main(["inspect", "--server", f"127.0.0.1:{port}"]) == 2
    assert "cannot reach" in capsys.readouterr().err


def test_readyz_is_503_when_the_store_is_down(server_factory: Factory, redis_server_factory: Any) -> None:
    redis = redis_server_factory()
    server = server_factory(["--redis-url", redis.url])
    assert ok(server, "/readyz")["ready"]
    redis.kill()
    status, body = get(server, "/readyz")
    assert status == 503, body
    assert not body["ready"]
    assert not body["store"]["ok"]
    assert body["store"]["error"]
    assert head(server, "/readyz") == (503, b""), "HEAD /readyz"
    assert head(server, "/healthz") == (200, b"")
    status, body = get(server, "/v1/jobs")
    assert status == 503
    assert body["kind"] == "unavailable"
    assert ok(server, "/healthz") == {"status": "ok"}, "a process whose store is down is still alive"


def test_replicas_on_one_redis_report_the_same_ranks_and_none_while_it_is_down(
    server_factory: Factory, redis_server_factory: Any
) -> None:
    """Each replica reads every rank of a job it streams to from Redis: `max by (job, rank)` combines them."""
    redis = redis_server_factory()
    replicas = [server_factory(["--redis-url", redis.url]) for _ in range(2)]
    job = "replicated"
    clients = [BatchClient(r, 2, replicas[r].address, job, timeout=30) for r in range(2)]
    try:
        for client, n in zip(clients, (7, 3), strict=True):
            it = iter(client)
            for _ in range(n):
                next(it)
            client.state_dict()
        wait_for_cursor(replicas[0], job, [7, 3])
        for replica in replicas:
            seen = metrics(replica)
            steps = {rank: seen[("ladle_rank_step", (("job", job), ("rank", str(rank))))] for rank in (0, 1)}
            assert steps == {0: 7, 1: 3}, f"a replica reports only the ranks it streams to: {steps}"
            assert seen[("ladle_rank_lag_steps", (("job", job), ("rank", "1")))] == 4
        redis.kill()
        for replica in replicas:
            with urllib.request.urlopen(replica.http_url + "/metrics", timeout=30) as response:
                body = response.read().decode()  # a 200 still: the store's series are left out
            assert "ladle_rank_step{" not in body, "rank series while the store does not answer"
            assert "ladle_ready " in body
    finally:
        for client in clients:
            client.close()


def test_http_port_taken(small_dataset: Path, tmp_path: Path) -> None:
    import socket

    from ladle.service.errors import ConfigError
    from ladle.service.server import BatchServer

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen(1)
        port = sock.getsockname()[1]
        server = BatchServer(small_dataset, CONFIG, grpc_port=0, http_port=port, state=tmp_path / "s.db")
        with pytest.raises(ConfigError, match=f"http_port: cannot listen on 127.0.0.1:{port}"):
            server.start()


def test_a_loopback_server_without_a_token_refuses_another_host_name(module_server: ServerProcess) -> None:
    """A DNS-rebinding page (Host: attacker.example, resolving to 127.0.0.1) read a token-less API."""
    url = module_server.http_url + "/v1/jobs"
    forged = urllib.request.Request(url, headers={"Host": "attacker.example:8080"})
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(forged, timeout=30)
    assert refused.value.code == 400
    assert json.loads(refused.value.read())["field"] == "host"
    for name in ("localhost", "localhost.", "LOCALHOST", "127.0.0.1", "[::1]"):
        local = urllib.request.Request(url, headers={"Host": f"{name}:{module_server.http_port}"})
        with urllib.request.urlopen(local, timeout=30) as answer:
            assert answer.status == 200, name
    for name in ("localhost..", "127.0.0.1.evil.example", "localhost.evil.example"):
        forged = urllib.request.Request(url, headers={"Host": name})
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(forged, timeout=30)
        assert refused.value.code == 400, name


def test_the_page_works_under_a_path_prefix(module_server: ServerProcess) -> None:
    """Behind an ingress path or kubectl proxy (/api/v1/.../proxy/), its links went to the host's root."""
    import http.server
    import re
    import threading
    import urllib.parse

    prefix = "/api/v1/namespaces/ml/services/ladle:http/proxy"
    upstream = module_server.http_url

    class Proxy(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            if not self.path.startswith(prefix + "/"):
                self.send_error(404, "outside the prefix")
                return
            try:
                with urllib.request.urlopen(upstream + self.path[len(prefix) :], timeout=30) as answer:
                    status, body, kind = answer.status, answer.read(), answer.headers["content-type"]
            except urllib.error.HTTPError as exc:
                status, body, kind = exc.code, exc.read(), exc.headers["content-type"]
            self.send_response(status)
            self.send_header("content-type", kind)
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:
            pass

    with BatchClient(0, 1, module_server.address, "prefixed", timeout=30) as client:
        next(iter(client))
        proxy = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Proxy)
        thread = threading.Thread(target=proxy.serve_forever, daemon=True)
        thread.start()
        try:
            base = f"http://127.0.0.1:{proxy.server_address[1]}{prefix}/"
            with urllib.request.urlopen(base + "?job=prefixed", timeout=30) as page:
                html = page.read().decode()
                page_url = page.url
            assert 'href="/' not in html, "a link from the root of the host"
            links = set(re.findall(r'href="([^"#]+)"', html)) - {"data:,"}
            assert links, "no links on the page"
            for link in links:
                with urllib.request.urlopen(urllib.parse.urljoin(page_url, link.replace("&amp;", "&"))) as to:
                    assert to.status == 200, link
            # what the page's script fetches: new URL("v1/jobs/<job>/cursor", origin + pathname)
            assert '"v1/jobs/" + encodeURIComponent(state.job) + "/cursor"' in html
            with urllib.request.urlopen(urllib.parse.urljoin(base, "v1/jobs/prefixed/cursor")) as cursor:
                assert json.loads(cursor.read())["ranks"][0]["rank"] == 0
        finally:
            proxy.shutdown()
            proxy.server_close()
            thread.join(timeout=10)


@pytest.mark.parametrize("host", ["::1", "[::1]"])
def test_an_ipv6_loopback_host_serves_both_faces(small_dataset: Path, tmp_path: Path, host: str) -> None:
    """--host ::1 was "grpc_port: cannot listen on ::1:0" (grpc read it as a name), [::1] "cannot resolve"."""
    import socket

    from ladle.service.server import BatchServer

    try:
        with socket.socket(socket.AF_INET6) as probe:
            probe.bind(("::1", 0))
    except OSError:
        pytest.skip("no IPv6 loopback here")
    server = BatchServer(small_dataset, CONFIG, host=host, grpc_port=0, http_port=0, state=tmp_path / "s.db")
    server.start()
    try:
        assert server.address.startswith("[::1]:"), server.address
        with BatchClient(0, 1, server.address, "v6", timeout=30) as client:
            assert next(iter(client)).step == 0
        assert server.http_url is not None
        with urllib.request.urlopen(server.http_url + "/healthz", timeout=30) as answer:
            assert answer.status == 200
    finally:
        server.stop(grace=0)
