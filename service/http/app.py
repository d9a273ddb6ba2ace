"""The HTTP face: a FastAPI app that shows the jobs, schedules and cursors of one batch server.

Read-only. Every handler that touches a schedule or the store is a plain
function, which FastAPI runs in its thread pool, so a schedule that takes a
second to build never stalls the event loop. Errors map once from
``LadleError.kind`` to an HTTP status (``HTTP_STATUS``) with an ``ErrorBody``;
a malformed parameter gets FastAPI's 422. Nothing a client sends gives a 5xx.
"""

from __future__ import annotations

import logging
from dataclasses import asdict
from typing import Annotated, Any, Final, Literal

from fastapi import Depends, FastAPI, Header, Path, Query, Request, Security
from fastapi.exception_handlers import request_validation_exception_handler
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, Response
from fastapi.security import HTTPBearer
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

import ladle
from ladle.proto.codec import JOB_NAME_PATTERN

from ..errors import ConfigError, LadleError
from ..jobs import Job
from ..metrics import CONTENT_TYPE, ServerMetrics
from ..security import TokenCheck
from ..store.base import MAX_INDEX, JobState
from . import page
from .inspector import DEFAULT_PAGE_STEPS, MAX_PAGE_STEPS, Inspector, Interleave
from .models import (
    BucketReport,
    CursorReport,
    ErrorBody,
    Health,
    JobDetail,
    JobList,
    QualityReport,
    Readiness,
    SchedulePage,
)

__all__ = ["HTTP_STATUS", "create_app"]

log = logging.getLogger("ladle.http")

HTTP_STATUS: Final = {
    "invalid_argument": 400,
    "not_found": 404,
    "failed_precondition": 409,
    "unauthenticated": 401,
    "resource_exhausted": 429,
    "unavailable": 503,
    "internal": 500,
}

JOB_PATTERN: Final = rf"^{JOB_NAME_PATTERN}$"
DEFAULT_JOBS_PAGE: Final = 1000
MAX_JOBS_PAGE: Final = 10000

JobName = Annotated[
    str, Path(pattern=JOB_PATTERN, description="the job's name, as its trainers gave it", examples=["run-42"])
]
Epoch = Annotated[
    int | None, Query(ge=0, le=MAX_INDEX, description="default: the epoch of the job's slowest rank")
]
InterleaveQuery = Annotated[
    Interleave | None,
    Query(description="another interleaving of the same config: `random` is the naive shuffle baseline"),
]


def _errors(*statuses: int) -> dict[int | str, dict[str, Any]]:
    return {status: {"model": ErrorBody} for status in statuses}


def _page_errors(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """The page's refusals: short HTML pages for a person (a 422 too), not the API's JSON."""
    html = {"text/html": {"schema": {"type": "string"}}}
    return {status: {"description": "an error page", "content": html} for status in statuses}


_JOB_ERRORS = _errors(400, 401, 404, 409, 503)


def _retry_after(exc: LadleError) -> dict[str, str] | None:
    """A ``Retry-After`` header for an error that says when to ask again (``ScheduleBusyError``)."""
    seconds = getattr(exc, "retry_after", None)
    return {"Retry-After": str(seconds)} if isinstance(seconds, int) else None


def _error_response(exc: LadleError, *, for_page: bool = False) -> Response:
    """The refusal of ``exc``: an ``ErrorBody``, or for the page (``for_page``) a short HTML page."""
    status = HTTP_STATUS.get(exc.kind, 500)
    headers = None
    if status == 401:
        # a browser asks for the token as a password on the page; scripts send it as a bearer token
        headers = {"WWW-Authenticate": 'Basic realm="ladle"' if for_page else 'Bearer realm="ladle"'}
    if status == 503:
        headers = _retry_after(exc)
    if for_page:
        return HTMLResponse(page.render_error(exc), status_code=status, headers=headers)
    body = ErrorBody(detail=str(exc), kind=exc.kind, field=getattr(exc, "field", None) or None)
    return JSONResponse(body.model_dump(), status_code=status, headers=headers)


class _CountErrors:
    """ASGI middleware: every response of status >= 400 counts in ``ladle_errors_total{face="http"}``.

    It also answers an unexpected exception: logged once and a JSON 500,
    counted like any other error. Left to Starlette's outermost handler, a 500
    was neither counted (that handler runs outside this middleware) nor logged
    once (it re-raises to uvicorn, which logs the traceback again).
    """

    def __init__(self, app: ASGIApp, metrics: ServerMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def watch(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                if message["status"] >= 400:
                    self.metrics.error("http", str(message["status"]))
            await send(message)

        try:
            await self.app(scope, receive, watch)
        except Exception as exc:
            log.exception("HTTP %s %s failed", scope.get("method"), scope.get("path"))
            if started:  # half an answer is out: the connection is closed, as uvicorn does
                self.metrics.error("http", "500")
                return
            body = ErrorBody(detail=f"internal error: {type(exc).__name__}", kind="internal")
            await JSONResponse(body.model_dump(), status_code=500)(scope, receive, watch)


def _summary(inspector: Inspector, state: JobState) -> dict[str, Any]:
    """A job as stored: identity and the spread of its ranks' stored positions (no schedule built)."""
    positions = [r.position for r in state.ranks]
    low, high = min(positions), max(positions)
    return {
        "job": state.job,
        "world_size": state.spec.world_size,
        "served": inspector.served(state),
        "dataset_fingerprint": state.spec.dataset_fingerprint,
        "config_fingerprint": state.spec.config_fingerprint,
        "epoch": low.epoch,
        "min_position": {"epoch": low.epoch, "step": low.step},
        "max_position": {"epoch": high.epoch, "step": high.step},
        "created": state.created,
        "updated": state.updated,
        "incarnation": state.incarnation,
        "resizes": len(state.plan),
    }


def _dataset(inspector: Inspector) -> dict[str, Any]:
    ds = inspector.dataset
    return {
        "path": ds.path,
        "rows": ds.num_rows,
        "fingerprint": ds.fingerprint,
        "columns": ds.columns.describe(),
    }


# the Host names that mean this machine (any port): what a loopback server without a token answers
LOCAL_HOSTS: Final = frozenset({"127.0.0.1", "localhost", "[::1]"})


def _host_name(host: str) -> str:
    """``host`` of a Host header without its port (``[::1]:8080`` -> ``[::1]``), lower case.

    A name's trailing dot (``localhost.``, the fully qualified form) is dropped.
    """
    host = host.strip().lower()
    if host.startswith("["):
        return host[: host.find("]") + 1] if "]" in host else host
    name = host.split(":", 1)[0]
    return name[:-1] if name.endswith(".") else name


class _LocalHostsOnly:
    """ASGI middleware: refuse (400) a request whose Host header does not name this machine."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            host = next((v.decode("latin-1") for k, v in scope["headers"] if k == b"host"), "")
            if _host_name(host) not in LOCAL_HOSTS:
                body = ErrorBody(
                    detail=f"Host {host!r} is not this machine: a loopback server without a token answers "
                    "only 127.0.0.1, localhost and [::1] (a page elsewhere could reach it through a name "
                    "that points here)",
                    kind="invalid_argument",
                    field="host",
                )
                await JSONResponse(body.model_dump(), status_code=400)(scope, receive, send)
                return
        await self.app(scope, receive, send)


def create_app(
    inspector: Inspector,
    metrics: ServerMetrics | None = None,
    token: TokenCheck | None = None,
    *,
    local_hosts_only: bool = False,
) -> FastAPI:
    """The app for one server: ``inspector`` reads its jobs, ``metrics`` is what /metrics exposes.

    With ``token``, every endpoint but ``/healthz``, ``/readyz`` and the
    OpenAPI document answers 401 unless the request carries an accepted token
    (``Authorization: Bearer <token>``, or Basic with the token as password).
    With ``local_hosts_only`` (a loopback server with no token) a request
    whose ``Host`` is not this machine's (``127.0.0.1``, ``localhost``,
    ``[::1]``) is refused with 400: a web page the user opens elsewhere could
    otherwise read the API through a DNS name that points at 127.0.0.1.
    """
    metrics = metrics if metrics is not None else ServerMetrics()

    def authorized(authorization: Annotated[str | None, Header(include_in_schema=False)] = None) -> None:
        if token is not None:
            token.check(authorization)

    protected = [Depends(authorized)]
    if token is not None:  # named in the OpenAPI document, so /docs and generated clients send it
        protected.append(Security(HTTPBearer(auto_error=False, description="the server's token")))
    app = FastAPI(
        title="ladle",
        version=ladle.__version__,
        description="Inspect a ladle batch server: its jobs, each epoch's schedule, the ranks' cursors "
        "and Prometheus metrics. Read-only. Large answers are paged.",
    )
    if local_hosts_only:
        app.add_middleware(_LocalHostsOnly)
    app.add_middleware(_CountErrors, metrics=metrics)

    @app.exception_handler(LadleError)
    async def _ladle_error(request: Request, exc: LadleError) -> Response:
        # the page's own refusals (its token check among them) answer a person, in HTML
        return _error_response(exc, for_page=request.url.path == "/")

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> Response:
        # an unknown path or method: the same body as every other refusal, with a kind
        kind = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "http_error")
        body = ErrorBody(detail=str(exc.detail), kind=kind, field=None)
        return JSONResponse(body.model_dump(), status_code=exc.status_code, headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> Response:
        if request.url.path != "/":
            return await request_validation_exception_handler(request, exc)
        # the page answers a person: its own error page, not FastAPI's JSON
        first = exc.errors()[0] if exc.errors() else {}
        loc = [str(part) for part in first.get("loc", ()) if part not in ("query", "path")]
        error = ConfigError(".".join(loc) or "query", str(first.get("msg", "invalid request")))
        return HTMLResponse(page.render_error(error), status_code=422)

    def served_job(name: str) -> tuple[Job, JobState]:
        state = inspector.state(name)
        return inspector.job(state), state

    def shown(name: str, epoch: int | None, interleave: Interleave | None) -> tuple[Job, int]:
        """The job (or its other interleaving) and the epoch asked for (default: the slowest rank's)."""
        served, state = served_job(name)
        e = inspector.epoch_of(served, state) if epoch is None else epoch
        return inspector.variant(served, interleave), e

    @app.get("/healthz", tags=["health"])
    async def healthz() -> Health:
        """The process is alive and answering."""
        return Health()

    # HEAD too: some load balancers and uptime checkers probe with it (the status, no body)
    @app.head("/healthz", tags=["health"], response_class=Response, operation_id="healthz_head")
    async def healthz_head() -> Response:
        """The process is alive and answering (200, no body)."""
        return Response()

    def readiness() -> Readiness:
        dataset_ok = inspector.dataset_ok()
        error = inspector.store_error()
        return Readiness.model_validate(
            {
                "ready": dataset_ok and error is None,
                "dataset": _dataset(inspector),
                "dataset_ok": dataset_ok,
                "store": {"ok": error is None, "store": repr(inspector.store), "error": error},
            }
        )

    @app.get(
        "/readyz",
        tags=["health"],
        responses={503: {"model": Readiness, "description": "the store cannot be reached"}},
    )
    def readyz() -> JSONResponse:
        """Ready to serve: the dataset is open and the cursor store answers (else 503)."""
        body = readiness()
        return JSONResponse(body.model_dump(), status_code=200 if body.ready else 503)

    @app.head(
        "/readyz",
        tags=["health"],
        response_class=Response,
        operation_id="readyz_head",
        responses={503: {"description": "not ready: GET says why"}},
    )
    def readyz_head() -> Response:
        """Ready to serve (200) or not (503), as GET answers, without a body."""
        return Response(status_code=200 if readiness().ready else 503)

    @app.get("/v1/jobs", tags=["jobs"], dependencies=protected, responses=_errors(401, 503))
    def list_jobs(
        limit: Annotated[
            int, Query(ge=1, le=MAX_JOBS_PAGE, description="jobs on this page")
        ] = DEFAULT_JOBS_PAGE,
        after: Annotated[
            str | None, Query(pattern=JOB_PATTERN, description="the page after this job name (`next_after`)")
        ] = None,
    ) -> JobList:
        """The jobs in the cursor store by name, a page at a time, with their stored positions.

        `served`: the job runs on this server's dataset and config (its schedule is shown here).
        """
        states = inspector.job_states()
        rest = [s for s in states if after is None or s.job > after]
        page = rest[:limit]
        return JobList.model_validate(
            {
                "dataset": _dataset(inspector),
                "config_fingerprint": inspector.config.fingerprint(),
                "jobs": [_summary(inspector, s) for s in page],
                "total": len(states),
                "next_after": page[-1].job if len(rest) > limit else None,
            }
        )

    @app.get("/v1/jobs/{job}", tags=["jobs"], dependencies=protected, responses=_JOB_ERRORS)
    def get_job(job: JobName) -> JobDetail:
        """A job's config, fingerprints, world size, epoch and progress."""
        state = inspector.state(job)
        doc = _summary(inspector, state)
        doc["resize_history"] = [
            {"world_size": r.world_size, "cut": [{"epoch": p.epoch, "step": p.step} for p in r.cut]}
            for r in state.plan
        ]
        doc.update(schedule_fingerprint=None, config=None, steps_per_epoch=None, progress=None)
        if doc["served"]:
            served = inspector.job(state)
            slowest = min(r.position for r in state.ranks)
            steps = served.steps(slowest.epoch)
            doc.update(
                schedule_fingerprint=served.fingerprint,
                config=inspector.config,
                steps_per_epoch=steps,
                progress=round(min(1.0, slowest.step / steps), 4) if steps else 1.0,
            )
        return JobDetail.model_validate(doc)

    @app.get("/v1/jobs/{job}/buckets", tags=["schedule"], dependencies=protected, responses=_JOB_ERRORS)
    def get_buckets(job: JobName, epoch: Epoch = None, interleave: InterleaveQuery = None) -> BucketReport:
        """The per-bucket table of an epoch: the same rows as `ladle plan --json` for the job's world size."""
        variant, e = shown(job, epoch, interleave)
        sched = inspector.schedule(variant, e)
        return BucketReport.model_validate(
            {
                "job": job,
                "epoch": e,
                "world_size": variant.world_size,
                "interleave": variant.config.interleave,
                "num_steps": sched.num_steps,
                "bucket_bounds": list(sched.bounds),
                "padding_efficiency": inspector.table(variant, e).padding_efficiency,
                "dropped": sched.dropped.counts,
                "buckets": inspector.buckets(variant, e),
            }
        )

    @app.get("/v1/jobs/{job}/schedule", tags=["schedule"], dependencies=protected, responses=_JOB_ERRORS)
    def get_schedule(
        job: JobName,
        epoch: Epoch = None,
        start: Annotated[int, Query(ge=0, le=MAX_INDEX, description="first step of the page")] = 0,
        limit: Annotated[
            int, Query(ge=1, le=MAX_PAGE_STEPS, description="steps per page (fewer if the batch cap is hit)")
        ] = DEFAULT_PAGE_STEPS,
        rank: Annotated[int | None, Query(ge=0, le=MAX_INDEX, description="one rank only")] = None,
        include: Annotated[
            Literal["samples"] | None, Query(description="`samples`: each batch's row indices too")
        ] = None,
        interleave: InterleaveQuery = None,
    ) -> SchedulePage:
        """A page of an epoch's batches, step-major: bucket, rows, padded length, real and padded tokens."""
        variant, e = shown(job, epoch, interleave)
        doc = inspector.page(variant, e, start=start, limit=limit, rank=rank, samples=include == "samples")
        return SchedulePage.model_validate({"job": job, **doc})

    @app.get("/v1/jobs/{job}/quality", tags=["schedule"], dependencies=protected, responses=_JOB_ERRORS)
    def get_quality(job: JobName, epoch: Epoch = None, interleave: InterleaveQuery = None) -> QualityReport:
        """An epoch's quality figures (runs and their bounds, share deviation, distinct buckets, padding,
        batch-mates: how random the rows of a batch are, and how often they meet again the next epoch)
        and the simulated loss (bucket loss levels plus noise)."""
        variant, e = shown(job, epoch, interleave)
        return QualityReport.model_validate(
            {
                "job": job,
                "epoch": e,
                "world_size": variant.world_size,
                "interleave": variant.config.interleave,
                "quality": asdict(inspector.quality(variant, e)),
                "simulated_loss": asdict(inspector.loss(variant, e)),
            }
        )

    @app.get("/v1/jobs/{job}/cursor", tags=["jobs"], dependencies=protected, responses=_JOB_ERRORS)
    def get_cursor(job: JobName) -> CursorReport:
        """Each rank's epoch and step, progress, lag behind the leading rank, last seen and generation."""
        served, state = served_job(job)
        return CursorReport.model_validate(inspector.cursor(served, state))

    @app.get(
        "/metrics",
        tags=["health"],
        dependencies=protected,
        response_class=Response,
        responses={200: {"content": {"text/plain": {"schema": {"type": "string"}}}}, **_errors(401)},
    )
    def get_metrics() -> Response:
        """Prometheus metrics (text format)."""
        return Response(metrics.exposition(), media_type=CONTENT_TYPE)

    @app.get(
        "/",
        response_class=HTMLResponse,
        tags=["page"],
        responses=_page_errors(400, 401, 404, 409, 422, 503),
        dependencies=protected,
    )
    def index(
        job: Annotated[str | None, Query(pattern=JOB_PATTERN)] = None,
        epoch: Epoch = None,
        start: Annotated[
            int | None, Query(ge=0, le=MAX_INDEX, description="default: the page holding the slowest rank")
        ] = None,
        world_size: Annotated[
            int, Query(ge=1, le=1024, description="the preview's world size when there is no job")
        ] = page.PREVIEW_WORLD_SIZE,
    ) -> Response:
        """The page for people: the epoch's ribbon of buckets beside a random shuffle's, the bucket
        table, each rank's progress and lag (refreshed while the job runs)."""
        try:
            html = page.render(inspector, job=job, epoch=epoch, start=start, world_size=world_size)
        except LadleError as exc:
            return _error_response(exc, for_page=True)
        return HTMLResponse(html)

    return app
