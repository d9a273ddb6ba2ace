"""Prometheus metrics of one batch server: what it served, how fast, and what failed.

Each ``ServerMetrics`` owns its own ``CollectorRegistry``, so several servers
in one process (tests) never collide. The per-batch figures are plain Python
numbers that the stream adds to on the server's one event loop thread (a
``StreamMeter`` per job and rank, and two lock-free histograms), read when
/metrics is scraped: about a microsecond a batch, where prometheus-client's
locked counters and histograms cost about seven (1.3% of a batch's server
CPU). The gauges of live streams are read from the servicer when scraped.
Store latency and errors, which are not per batch, use prometheus-client's
own thread-safe metrics.
"""

from __future__ import annotations

import time
from bisect import bisect_left
from collections.abc import Callable, Iterable
from typing import Any, Final

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    Info,
    ProcessCollector,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from .errors import StoreUnavailableError
from .store.base import CursorStore, JobSpec, JobState, Position, RankState, Resize

__all__ = [
    "CONTENT_TYPE",
    "METER_LINGER_S",
    "METRIC_NAMES",
    "LoopHistogram",
    "ServerMetrics",
    "StreamMeter",
    "TimedStore",
]

CONTENT_TYPE: Final = "text/plain; version=0.0.4; charset=utf-8"
# How long a job's rank keeps its per-rank series after its last stream on this server ended.
METER_LINGER_S: Final = 3600.0

# Exposed names (counters get the _total suffix); docs/inspect.md describes each one.
METRIC_NAMES: Final = (
    "ladle_batches_served_total",
    "ladle_tokens_served_total",
    "ladle_padded_tokens_served_total",
    "ladle_bytes_served_total",
    "ladle_batch_assembly_seconds",
    "ladle_stream_send_seconds",
    "ladle_stream_prefetch_depth",
    "ladle_streams_open",
    "ladle_streams_limit",
    "ladle_streams_refused_total",
    "ladle_calls_refused_total",
    "ladle_schedules_cached",
    "ladle_store_seconds",
    "ladle_errors_total",
)

_FAST = (5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 0.1, 0.5)
_SLOW = (1e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 0.5, 1.0, 5.0)

# (job, rank, batches sent whose credit has not come back yet), for every open stream.
StreamDepths = Callable[[], Iterable[tuple[str, int, int]]]


class LoopHistogram:
    """A histogram written by one thread (the event loop) without a lock; any thread may read it."""

    __slots__ = ("bounds", "counts", "total")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # the last one: above every bound
        self.total = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1
        self.total += value

    def family(self, name: str, documentation: str) -> HistogramMetricFamily:
        cumulative, buckets = 0, []
        for bound, count in zip((*self.bounds, float("inf")), list(self.counts), strict=True):
            cumulative += count
            buckets.append(("+Inf" if bound == float("inf") else repr(bound), cumulative))
        return HistogramMetricFamily(name, documentation, buckets=buckets, sum_value=self.total)


class StreamMeter:
    """What a job's rank was served, over all its streams on this server (written on the event loop)."""

    __slots__ = ("_assembly", "batches", "bytes", "idle_since", "padded_tokens", "send", "streams", "tokens")

    def __init__(self, assembly: LoopHistogram, send: LoopHistogram) -> None:
        self.batches = self.tokens = self.padded_tokens = self.bytes = 0
        self.streams = 0  # open now
        self.idle_since = 0.0  # when the last one ended (time.monotonic)
        self._assembly = assembly
        self.send = send

    def batch(self, real_tokens: int, padded_tokens: int, nbytes: int, assembly_s: float) -> None:
        self.batches += 1
        self.tokens += real_tokens
        self.padded_tokens += padded_tokens
        self.bytes += nbytes
        self._assembly.observe(assembly_s)


_COUNTERS: Final = (
    ("ladle_batches_served", "Batches sent to trainers", "batches"),
    ("ladle_tokens_served", "Real (unpadded) tokens in the batches sent", "tokens"),
    ("ladle_padded_tokens_served", "Padded tokens (rows x padded length) sent", "padded_tokens"),
    ("ladle_bytes_served", "Frame bytes sent to trainers", "bytes"),
)


class _Served(Collector):
    """The stream figures, read when scraped."""

    def __init__(self, metrics: ServerMetrics) -> None:
        self._metrics = metrics

    def collect(self) -> Iterable[Metric]:
        m = self._metrics
        meters = list(m.meters.items())
        for name, documentation, attribute in _COUNTERS:
            family = CounterMetricFamily(name, documentation, labels=["job", "rank"])
            for (job, rank), meter in meters:
                family.add_metric([job, str(rank)], getattr(meter, attribute))
            yield family
        yield m.assembly_seconds.family(
            "ladle_batch_assembly_seconds", "Time to gather, pad and encode one batch frame"
        )
        yield m.send_seconds.family(
            "ladle_stream_send_seconds",
            "Time gRPC takes to take one frame (from handing it over until it asks for the next)",
        )
        depth = GaugeMetricFamily(
            "ladle_stream_prefetch_depth",
            "Batches sent to a rank and not yet acknowledged (its prefetch window in use)",
            labels=["job", "rank"],
        )
        count = 0
        for job, rank, in_flight in m.depths():
            depth.add_metric([job, str(rank)], in_flight)
            count += 1
        yield depth
        yield GaugeMetricFamily("ladle_streams_open", "Trainer streams open on this server", value=count)
        limit = GaugeMetricFamily(
            "ladle_streams_limit", "Trainer streams this server admits (scope: server, job)", labels=["scope"]
        )
        limit.add_metric(["server"], m.stream_limits[0])
        limit.add_metric(["job"], m.stream_limits[1])
        yield limit
        yield GaugeMetricFamily(
            "ladle_schedules_cached",
            "Epoch schedules this server holds in memory (each about 10 bytes per dataset row)",
            value=m.schedules_cached(),
        )


def _build() -> dict[str, str]:
    import platform

    import grpc

    import ladle

    return {"version": ladle.__version__, "python": platform.python_version(), "grpcio": grpc.__version__}


class ServerMetrics:
    """Every metric of one server, in its own registry (``exposition`` renders them)."""

    def __init__(
        self, *, meter_linger_s: float = METER_LINGER_S, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.registry = CollectorRegistry()
        self.meters: dict[tuple[str, int], StreamMeter] = {}
        self.meter_linger_s = meter_linger_s
        self._clock = clock
        self.assembly_seconds = LoopHistogram(_FAST)
        self.send_seconds = LoopHistogram(_FAST)
        self.depths: StreamDepths = lambda: ()
        self.stream_limits = (0, 0)  # (per server, per job); 0: not reported yet
        self.schedules_cached: Callable[[], int] = lambda: 0
        self.store_seconds = Histogram(
            "ladle_store_seconds",
            "Cursor store operation latency",
            ["op"],
            buckets=_SLOW,
            registry=self.registry,
        )
        self.errors = Counter(
            "ladle_errors",
            "Calls that ended in an error, by face (grpc, http) and status code",
            ["face", "code"],
            registry=self.registry,
        )
        self.refusals = Counter(
            "ladle_streams_refused",
            "Stream opens refused by a limit (max_sessions, max_sessions_per_job, max_prefetch)",
            ["limit"],
            registry=self.registry,
        )
        self.calls_refused = Counter(
            "ladle_calls_refused",
            "gRPC calls refused as they opened, by reason: unauthenticated (no token or a wrong one), "
            "too_many_watches, too_many_health_calls (the budgets of calls that need no token), "
            "too_many_calls (every other call: --max-sessions + 64)",
            ["reason"],
            registry=self.registry,
        )
        self.ready = Gauge(
            "ladle_ready",
            "1 while the server is ready to serve trainers (its dataset as opened, its cursor store "
            "answering), else 0: the readiness check behind /readyz and the gRPC health service",
            registry=self.registry,
        )
        self.ready.set(1)
        self.registry.register(_Served(self))
        ProcessCollector(registry=self.registry)  # process_*: RSS, CPU, open descriptors
        Info("ladle_build", "The ladle release this server runs", registry=self.registry).info(_build())

    def stream(self, job: str, rank: int) -> StreamMeter:
        """The meter of a stream of ``rank`` of ``job`` that opens now (call on the event loop).

        A rank's meter counts over all its streams on this server; once none
        has been open for ``meter_linger_s`` it is dropped, with its series,
        so a server that sees job after job does not report every one of them
        for ever. Call ``ended`` when the stream ends.
        """
        self._drop_idle()
        meter = self.meters.get((job, rank))
        if meter is None:
            meter = self.meters[job, rank] = StreamMeter(self.assembly_seconds, self.send_seconds)
        meter.streams += 1
        return meter

    def ended(self, meter: StreamMeter) -> None:
        """A stream ``stream`` metered has ended (call on the event loop)."""
        meter.streams -= 1
        meter.idle_since = self._clock()

    def _drop_idle(self) -> None:
        cutoff = self._clock() - self.meter_linger_s
        for key, meter in list(self.meters.items()):
            if meter.streams <= 0 and meter.idle_since < cutoff:
                del self.meters[key]

    def error(self, face: str, code: str) -> None:
        self.errors.labels(face, code).inc()

    def refused(self, limit: str) -> None:
        self.refusals.labels(limit).inc()

    def call_refused(self, code: str, reason: str) -> None:
        """A gRPC call the server refused as it opened (``CallGate``): counted by reason and by status."""
        self.calls_refused.labels(reason).inc()
        self.error("grpc", code)

    def watch_streams(self, depths: StreamDepths, limit: int = 0, limit_per_job: int = 0) -> None:
        """Report the open streams ``depths()`` lists when scraped, and the limits on them."""
        self.depths = depths
        self.stream_limits = (limit, limit_per_job)

    def exposition(self) -> bytes:
        """Every metric in the Prometheus text format."""
        return generate_latest(self.registry)


# the operations that write; one refused as unavailable keeps ping() failing this long, or until one succeeds
_WRITES: Final = frozenset({"open_job", "resize", "reconcile", "join", "advance", "rewind", "delete_job"})
WRITE_FAILURE_S: Final = 10.0


class TimedStore(CursorStore):
    """A cursor store that times each operation into ``ladle_store_seconds{op}``.

    Arguments are validated once, by this store's public methods; each hook
    calls the inner store's hook, so the inner store's atomicity, clock and
    errors are unchanged.
    """

    def __init__(self, inner: CursorStore, metrics: ServerMetrics) -> None:
        super().__init__()
        self.inner = inner
        self._seconds = metrics.store_seconds
        # the last write the store refused as unavailable (monotonic time, why), until one succeeds
        self._write_failed: tuple[float, str] | None = None

    def _timed(self, op: str, call: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        began = time.perf_counter()
        try:
            out = call(*args, **kwargs)
        except StoreUnavailableError as exc:
            if op in _WRITES:
                self._write_failed = (time.monotonic(), str(exc))
            raise
        finally:
            self._seconds.labels(op).observe(time.perf_counter() - began)
        if op in _WRITES:
            self._write_failed = None
        return out

    def _open_job(
        self, spec: JobSpec, *, reset: bool, incarnation: str, plan: tuple[Resize, ...]
    ) -> JobState:
        state: JobState = self._timed(
            "open_job", self.inner._open_job, spec, reset=reset, incarnation=incarnation, plan=plan
        )
        return state

    def _resize(
        self, job: str, from_world_size: int, to_world_size: int, cut: tuple[Position, ...] | None
    ) -> JobState:
        state: JobState = self._timed("resize", self.inner._resize, job, from_world_size, to_world_size, cut)
        return state

    def _reconcile(self, job: str, rank: int, generation: int, to: Position) -> RankState:
        out: RankState = self._timed("reconcile", self.inner._reconcile, job, rank, generation, to)
        return out

    def _join(self, job: str, rank: int, world_size: int) -> RankState:
        out: RankState = self._timed("join", self.inner._join, job, rank, world_size)
        return out

    def _advance(self, job: str, rank: int, generation: int, to: Position) -> RankState:
        out: RankState = self._timed("advance", self.inner._advance, job, rank, generation, to)
        return out

    def _rewind(self, job: str, rank: int, generation: int, to: Position) -> RankState:
        out: RankState = self._timed("rewind", self.inner._rewind, job, rank, generation, to)
        return out

    def _get(self, job: str) -> JobState:
        state: JobState = self._timed("get", self.inner._get, job)
        return state

    def _list_jobs(self) -> list[JobState]:
        jobs: list[JobState] = self._timed("list_jobs", self.inner._list_jobs)
        return jobs

    def _delete_job(self, job: str) -> bool:
        return bool(self._timed("delete_job", self.inner._delete_job, job))

    def _ping(self) -> None:
        """The store answers, and takes writes: one that answers PING but refuses every write (a
        Redis at maxmemory with noeviction) stops every stream, so it is not ready either."""
        self._timed("ping", self.inner._ping)
        if self.inner.ping_writes:
            self._write_failed = None  # the ping was a write, and it was taken: writes are taken again
        failed = self._write_failed
        if failed is not None and time.monotonic() - failed[0] < WRITE_FAILURE_S:
            raise StoreUnavailableError(f"its writes fail ({failed[1]})")

    def close(self) -> None:
        self.inner.close()

    def __repr__(self) -> str:
        return repr(self.inner)
