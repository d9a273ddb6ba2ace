"""Prometheus metrics of one batch server: what it served, how fast, and what failed.

Each ``ServerMetrics`` owns its own ``CollectorRegistry``, so several servers
in one process (tests) never collide. The per-batch figures are plain Python
numbers that the stream adds to on the server's one event loop thread (a
``StreamMeter`` per job and rank, and two lock-free histograms), read when
/metrics is scraped: about a microsecond a batch, where prometheus-client's
locked counters and histograms cost about seven (1.3% of a batch's server
CPU). The gauges of live streams are read from the servicer when scraped.
Store latency and errors, which are not per batch, use prometheus-client's
own thread-safe metrics. Where each rank of a job stands is read from the
cursor store when scraped, one read per job this server streams to: every
rank counts in the job's summary series, and only the ``rank_series`` ranks
that need attention first get series of their own, so a thousand-rank job
adds a bounded number of series. The served counters and the prefetch depth
have series of their own for ranks below ``rank_series`` (a fixed set, so a
counter never moves between series); a job's other ranks add up in one
series labelled ``rank="rest"``.
"""

from __future__ import annotations

import time
from bisect import bisect_left
from collections.abc import Callable, Iterable, Iterator
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

from .errors import LadleError, StoreUnavailableError
from .limits import RANK_SERIES
from .standing import JobStanding, attention
from .store.base import CursorStore, JobSpec, JobState, Position, RankState, Resize

__all__ = [
    "CONTENT_TYPE",
    "METER_LINGER_S",
    "METRIC_NAMES",
    "REST",
    "UNSEEN_OVER_S",
    "LoopHistogram",
    "ServerMetrics",
    "StreamMeter",
    "TimedStore",
]

CONTENT_TYPE: Final = "text/plain; version=0.0.4; charset=utf-8"
# How long a job's rank keeps its per-rank series after its last stream on this server ended.
METER_LINGER_S: Final = 3600.0
# ladle_job_ranks_unseen counts the ranks not seen for more than each of these (seconds).
UNSEEN_OVER_S: Final = (60, 300, 3600)

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
    "ladle_ready",
    "ladle_rank_epoch",
    "ladle_rank_step",
    "ladle_rank_lag_steps",
    "ladle_rank_seen_ago_seconds",
    "ladle_job_ranks",
    "ladle_job_leader_epoch",
    "ladle_job_leader_step",
    "ladle_job_lag_steps_max",
    "ladle_job_seen_ago_seconds_max",
    "ladle_job_seen_ago_seconds_min",
    "ladle_job_ranks_unseen",
)

_FAST = (5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 0.1, 0.5)
_SLOW = (1e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 0.5, 1.0, 5.0)

# (job, rank, batches sent whose credit has not come back yet), for every open stream.
StreamDepths = Callable[[], Iterable[tuple[str, int, int]]]
# Where the ranks of a job stand, read from the cursor store (LadleError if it cannot be read).
ReadStanding = Callable[[str], JobStanding]


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


class _Retired:
    """The counts of a job's dropped meters that its ``rank="rest"`` series still carries."""

    __slots__ = ("batches", "bytes", "padded_tokens", "tokens")

    def __init__(self) -> None:
        self.batches = self.tokens = self.padded_tokens = self.bytes = 0

    def add(self, meter: StreamMeter) -> None:
        self.batches += meter.batches
        self.tokens += meter.tokens
        self.padded_tokens += meter.padded_tokens
        self.bytes += meter.bytes


# the rank label of the one series that adds up a job's ranks past ``rank_series`` (served counters, depth)
REST: Final = "rest"

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
        own = m.rank_series
        meters = list(m.meters.items())
        retired = dict(m.retired)
        for name, documentation, attribute in _COUNTERS:
            family = CounterMetricFamily(name, documentation, labels=["job", "rank"])
            rest = {job: getattr(sums, attribute) for job, sums in retired.items()}
            for (job, rank), meter in meters:
                if rank < own:
                    family.add_metric([job, str(rank)], getattr(meter, attribute))
                else:
                    rest[job] = rest.get(job, 0) + getattr(meter, attribute)
            for job, total in sorted(rest.items()):
                family.add_metric([job, REST], total)
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
        rest_depth: dict[str, int] = {}
        for job, rank, in_flight in m.depths():
            if rank < own:
                depth.add_metric([job, str(rank)], in_flight)
            else:
                rest_depth[job] = rest_depth.get(job, 0) + in_flight
            count += 1
        for job, in_flight in sorted(rest_depth.items()):
            depth.add_metric([job, REST], in_flight)
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
            "Epoch schedules this server holds in memory (each about 6 bytes per dataset row)",
            value=m.schedules_cached(),
        )


_RANK_GAUGES: Final = (
    ("ladle_rank_epoch", "The epoch a rank is in"),
    ("ladle_rank_step", "Steps a rank has consumed in its epoch (its position)"),
    ("ladle_rank_lag_steps", "Steps a rank is behind the job's leading rank"),
    (
        "ladle_rank_seen_ago_seconds",
        "Seconds since a rank was last seen: its last acknowledged batch or stream open "
        "(since the job was created for a rank no trainer joined)",
    ),
)


class _Standings(Collector):
    """Where the ranks of each job this server streams to stand, read from the store when scraped."""

    def __init__(self, metrics: ServerMetrics) -> None:
        self._metrics = metrics
        self._shown: dict[str, frozenset[int]] = {}  # per job: the ranks with series at the last scrape

    def _read(self) -> Iterator[tuple[str, JobStanding]]:
        read = self._metrics.read_standing
        if read is None:
            return
        for name in self._metrics.streamed_jobs():
            try:
                now = read(name)
            except LadleError:  # the store does not answer (ladle_ready says so), or the job is gone
                continue
            if now.ranks:
                yield name, now

    def collect(self) -> Iterable[Metric]:
        m = self._metrics
        per_rank = [GaugeMetricFamily(name, doc, labels=["job", "rank"]) for name, doc in _RANK_GAUGES]
        ranks = GaugeMetricFamily("ladle_job_ranks", "Ranks in a job (its world size)", labels=["job"])
        leader_epoch = GaugeMetricFamily(
            "ladle_job_leader_epoch", "The epoch of a job's leading rank", labels=["job"]
        )
        leader_step = GaugeMetricFamily(
            "ladle_job_leader_step", "The step in its epoch of a job's leading rank", labels=["job"]
        )
        lag_max = GaugeMetricFamily(
            "ladle_job_lag_steps_max", "Steps the rank furthest behind is behind the leader", labels=["job"]
        )
        seen_max = GaugeMetricFamily(
            "ladle_job_seen_ago_seconds_max", "Seconds since the rank seen least recently", labels=["job"]
        )
        seen_min = GaugeMetricFamily(
            "ladle_job_seen_ago_seconds_min", "Seconds since the rank seen most recently", labels=["job"]
        )
        unseen = GaugeMetricFamily(
            "ladle_job_ranks_unseen", "Ranks not seen for more than `over` seconds", labels=["job", "over"]
        )
        shown: dict[str, frozenset[int]] = {}
        for name, now in self._read():
            picked = attention(now.ranks, m.rank_series, shown=self._shown.get(name, ()))
            shown[name] = frozenset(r.rank for r in picked)
            for r in sorted(picked, key=lambda r: r.rank):
                labels = [name, str(r.rank)]
                values = (r.position.epoch, r.position.step, r.lag_steps, r.seen_ago_s)
                for family, value in zip(per_rank, values, strict=True):
                    family.add_metric(labels, value)
            seen = [r.seen_ago_s for r in now.ranks]
            ranks.add_metric([name], len(now.ranks))
            leader_epoch.add_metric([name], now.leader.epoch)
            leader_step.add_metric([name], now.leader.step)
            lag_max.add_metric([name], max(r.lag_steps for r in now.ranks))
            seen_max.add_metric([name], max(seen))
            seen_min.add_metric([name], min(seen))
            for over in UNSEEN_OVER_S:
                unseen.add_metric([name, str(over)], sum(1 for s in seen if s > over))
        self._shown = shown
        yield from per_rank
        yield from (ranks, leader_epoch, leader_step, lag_max, seen_max, seen_min, unseen)


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
        # per job, what the dropped meters of ranks without series of their own had counted
        self.retired: dict[str, _Retired] = {}
        self.meter_linger_s = meter_linger_s
        self._clock = clock
        self.assembly_seconds = LoopHistogram(_FAST)
        self.send_seconds = LoopHistogram(_FAST)
        self.depths: StreamDepths = lambda: ()
        self.stream_limits = (0, 0)  # (per server, per job); 0: not reported yet
        self.schedules_cached: Callable[[], int] = lambda: 0
        self.read_standing: ReadStanding | None = None  # until watch_ranks
        self.rank_series = RANK_SERIES
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
        self.registry.register(_Standings(self))
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

    def streamed_jobs(self) -> list[str]:
        """The jobs with a stream open on this server, or one that ended within ``meter_linger_s``."""
        cutoff = self._clock() - self.meter_linger_s
        live = {job for (job, _), m in list(self.meters.items()) if m.streams > 0 or m.idle_since >= cutoff}
        return sorted(live)

    def _drop_idle(self) -> None:
        cutoff = self._clock() - self.meter_linger_s
        for key, meter in list(self.meters.items()):
            if meter.streams <= 0 and meter.idle_since < cutoff:
                del self.meters[key]
                job, rank = key
                if rank >= self.rank_series:  # kept in the job's "rest" series: counters never fall
                    self.retired.setdefault(job, _Retired()).add(meter)
        metered = {job for job, _ in self.meters}
        for job in [job for job in self.retired if job not in metered]:
            del self.retired[job]  # the job's last meter is gone: so are its series

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

    def watch_ranks(self, read: ReadStanding, rank_series: int = RANK_SERIES) -> None:
        """Report where the ranks of each job in ``streamed_jobs`` stand, from ``read(job)`` when scraped.

        Every rank counts in the job's summary series; at most ``rank_series``
        ranks a job get series of their own (``attention``'s first: not seen
        for longest, then furthest behind, the ones shown last time before
        others alike), so a stalled rank always shows and healthy ones do not churn.
        The served counters and the prefetch depth of the ranks from ``rank_series``
        up add up in one series a job, ``rank="rest"``.
        """
        if rank_series < 0:
            raise ValueError(f"rank_series must be >= 0, got {rank_series}")
        self.read_standing = read
        self.rank_series = rank_series

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
