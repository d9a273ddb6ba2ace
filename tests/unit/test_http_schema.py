"""schemathesis over the HTTP app's own OpenAPI document: no 5xx, every answer matches its schema.

The app runs in process (ASGI) over a small dataset and an embedded store
holding a served job (``run-42``, the name the document gives as an
example), a resized one, and a job of another dataset (409 on its schedule).
"""

from __future__ import annotations

from typing import Any

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ladle.service.dataset import open_dataset
from ladle.service.http import Inspector, create_app
from ladle.service.jobs import JobRegistry
from ladle.service.metrics import ServerMetrics
from ladle.service.schedule import ScheduleConfig
from ladle.service.security import TokenCheck
from ladle.service.store import EmbeddedStore, JobSpec, Position
from ladle.service.synth import make_dataset

CONFIG = ScheduleConfig(max_seq_len=256, bucket_bounds=(0, 40, 80, 257), token_budget=1024, max_batch_size=16)


@pytest.fixture(scope="module")
def registry(tmp_path_factory: pytest.TempPathFactory) -> JobRegistry:
    root = tmp_path_factory.mktemp("http-schema")
    make_dataset(root / "ds", 600, seed=1, scale=1 / 32)
    dataset = open_dataset(root / "ds")
    store = EmbeddedStore(root / "state.db")
    registry = JobRegistry(dataset, CONFIG, store)
    registry.open("run-42", 2)
    for rank, step in ((0, 5), (1, 3)):
        joined = store.join("run-42", rank, 2)
        store.advance("run-42", rank, joined.generation, Position(0, step))
    registry.open("resized", 3)
    registry.open("resized", 2, elastic=True)
    store.open_job(JobSpec("elsewhere", "another-dataset", CONFIG.fingerprint(), 4))
    return registry


def schema(registry: JobRegistry, token: TokenCheck | None = None) -> Any:
    app = create_app(Inspector(registry), ServerMetrics(), token)
    # A rank past the job's world size is schema-valid (the range depends on the job) and gets a 400.
    config = schemathesis.config.SchemathesisConfig.from_dict(
        {"checks": {"positive_data_acceptance": {"expected-statuses": ["2xx", "400", "404", "409"]}}}
    )
    return schemathesis.openapi.from_asgi("/openapi.json", app, config=config)


@pytest.fixture(scope="module")
def api(registry: JobRegistry) -> Any:
    return schema(registry)


JOBS = ["run-42", "resized", "elsewhere"]
PATHS = [
    "/",
    "/healthz",
    "/readyz",
    "/metrics",
    "/v1/jobs",
    "/v1/jobs/{job}",
    "/v1/jobs/{job}/buckets",
    "/v1/jobs/{job}/schedule",
    "/v1/jobs/{job}/quality",
    "/v1/jobs/{job}/cursor",
]


def test_the_document_names_every_endpoint(api: Any) -> None:
    assert sorted(api.raw_schema["paths"]) == sorted(PATHS)


# One test per operation, driven by hypothesis directly (schemathesis' pytest
# plugin reads a pytest-internal attribute that pytest 9 no longer has).
@pytest.mark.parametrize("path", PATHS)
def test_answers_match_the_schema(api: Any, path: str) -> None:
    operation = api[path]["GET"]

    @given(case=operation.as_strategy(), job=st.sampled_from([None, *JOBS]))
    @settings(max_examples=30, deadline=None, suppress_health_check=list(HealthCheck))
    def check(case: Any, job: str | None) -> None:
        # the generated names are almost never a stored job's
        if job is not None and "job" in (case.path_parameters or {}):
            case.path_parameters["job"] = job
        if job is not None and "job" in (case.query or {}):
            case.query["job"] = job
        case.call_and_validate()

    check()


def test_the_page_documents_its_errors_as_html(api: Any) -> None:
    responses = api.raw_schema["paths"]["/"]["get"]["responses"]
    kinds = {status: sorted(r.get("content", {})) for status, r in responses.items()}
    assert kinds == {s: ["text/html"] for s in ("200", "400", "401", "404", "409", "422", "503")}, kinds


def test_the_pages_refusals_match_the_schema(api: Any, registry: JobRegistry) -> None:
    """The page's errors are HTML pages, as its document says: a 422, a 404, a 409, and a 401."""
    operation = api["/"]["GET"]
    for query in ({"world_size": 0}, {"start": -1}, {"job": "bad name"}, {"job": "no-such-job"}):
        operation.Case(query=query).call_and_validate()
    operation.Case(query={"job": "elsewhere"}).call_and_validate()
    behind_a_token = schema(registry, TokenCheck(["a-token-of-32-characters-or-more!"]))
    refused = behind_a_token["/"]["GET"].Case().call_and_validate()
    assert refused.status_code == 401
    assert refused.headers["content-type"][0].startswith("text/html"), "a browser gets the API's JSON"
    assert refused.headers["www-authenticate"][0].startswith("Basic"), "no password prompt"

    @given(case=operation.as_strategy(schemathesis.GenerationMode.NEGATIVE))
    @settings(max_examples=30, deadline=None, suppress_health_check=list(HealthCheck))
    def check(case: Any) -> None:
        case.call_and_validate()

    check()
