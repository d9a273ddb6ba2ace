"""What one batch server lets its clients hold: sessions, windows, message sizes and connections.

``Limits`` is the one place these numbers live; ``ladle serve`` fills it from
its options and ``BatchServer`` hands it to the servicer (sessions, prefetch)
and to gRPC (``grpc_options``: message sizes, connections, keepalive and the
reaping of idle and half-open connections). Every limit refuses with a clear
status rather than queueing, and every connection that carries nothing is
eventually closed, so neither a crowd of idle clients nor a misbehaving one
can grow the server's threads, descriptors or memory without bound.
"""

from __future__ import annotations

import logging
import resource
from dataclasses import dataclass, field
from typing import Final

from .errors import ConfigError

# Schedules a server keeps beyond those its streams use (jobs.ScheduleCache). Defined here, not
# in .jobs, so the command line reads its limits without importing the dataset layer (datasets,
# pandas: a second of start-up that `ladle health` and `ladle jobs` have no use for).
SPARE_SCHEDULES: Final = 4
# Schedules no stream uses that Opens (and Describes) had built in the last minute, with the builds in
# progress, a server allows; one client half of them (jobs.ScheduleCache). Beyond: RESOURCE_EXHAUSTED.
MAX_SCHEDULES: Final = 16
# Ranks of a job /metrics gives series of their own (metrics.ServerMetrics.watch_ranks); here for the
# same reason.
RANK_SERIES: Final = 32

__all__ = ["MAX_SCHEDULES", "RANK_SERIES", "RPC_HEADROOM", "SPARE_SCHEDULES", "Limits", "connection_cap"]

log = logging.getLogger("ladle.server")

RPC_HEADROOM: Final = 64
"""Calls of the service beyond ``max_sessions`` that ladle's call budget admits (Describe, streams
being refused): health calls have budgets of their own (``security.CallGate``)."""

_FD_RESERVE: Final = 256  # descriptors kept for the dataset, the store, HTTP and the process itself
_MAX_CONNECTIONS_DEFAULT: Final = 4096


def connection_cap(soft_fd_limit: int | None = None) -> int:
    """The default connection cap: 4096, or fewer when the file-descriptor limit is lower.

    A server that runs out of descriptors fails to accept, and also to open a
    file; the cap keeps ``_FD_RESERVE`` of them free.
    """
    if soft_fd_limit is None:
        soft_fd_limit, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft_fd_limit == resource.RLIM_INFINITY:
        return _MAX_CONNECTIONS_DEFAULT
    return max(16, min(_MAX_CONNECTIONS_DEFAULT, soft_fd_limit - _FD_RESERVE))


@dataclass(frozen=True)
class Limits:
    """A batch server's limits; the defaults suit one server with a few jobs of up to 128 ranks.

    ``max_sessions_per_job`` defaults to half of ``max_sessions`` (so one job
    cannot take the whole server) and ``max_connections`` to
    ``connection_cap()``. ``spare_schedules`` is how many schedules no stream
    uses the server keeps for reuse (``ScheduleCache``; each holds about 10
    bytes a row of the dataset). ``max_schedules`` bounds the schedules that
    Opens and Describes had built (a new world size, a new start epoch) and no
    stream uses, for a minute after their last use, with the builds in
    progress; ``max_schedules_per_client`` (default: half of it) bounds one
    client's (its peer address and ``Open.client_id``). Beyond either, the
    request is refused with RESOURCE_EXHAUSTED. Durations are seconds;
    ``idle_timeout_s=0`` never closes an idle connection.
    """

    max_sessions: int = 256
    max_sessions_per_job: int | None = None
    max_prefetch: int = 64
    max_request_bytes: int = 64 << 10
    max_connections: int | None = None
    keepalive_s: float = 30.0
    keepalive_timeout_s: float = 10.0
    idle_timeout_s: float = 300.0
    handshake_timeout_s: float = 10.0
    spare_schedules: int = SPARE_SCHEDULES
    max_schedules: int = MAX_SCHEDULES
    max_schedules_per_client: int | None = None
    per_job: int = field(init=False)
    schedules_per_client: int = field(init=False)
    connections: int = field(init=False)

    def __post_init__(self) -> None:
        for name in (
            "max_sessions",
            "max_prefetch",
            "max_sessions_per_job",
            "max_connections",
            "max_schedules",
            "max_schedules_per_client",
        ):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ConfigError(name, f"must be an integer >= 1, got {value!r}")
        spare = self.spare_schedules
        if isinstance(spare, bool) or not isinstance(spare, int) or spare < 0:
            raise ConfigError("spare_schedules", f"must be an integer >= 0, got {spare!r}")
        if self.max_request_bytes < 1024:
            # an Open with a long job name and client id must still fit
            raise ConfigError("max_request_bytes", f"must be >= 1024, got {self.max_request_bytes}")
        for name in ("keepalive_s", "keepalive_timeout_s", "handshake_timeout_s"):
            if not getattr(self, name) > 0:
                raise ConfigError(name, f"must be > 0 seconds, got {getattr(self, name)}")
        if not self.idle_timeout_s >= 0:
            raise ConfigError("idle_timeout_s", f"must be >= 0 seconds (0: never), got {self.idle_timeout_s}")
        object.__setattr__(self, "per_job", self._share("max_sessions_per_job", "max_sessions"))
        object.__setattr__(
            self, "schedules_per_client", self._share("max_schedules_per_client", "max_schedules")
        )
        object.__setattr__(self, "connections", self.max_connections or connection_cap())

    def _share(self, part: str, whole: str) -> int:
        """The limit ``part`` of one job or client: as given (at most ``whole``), else half of ``whole``."""
        given, total = getattr(self, part), getattr(self, whole)
        if given is not None and given > total:
            raise ConfigError(
                part, f"must be at most {whole} ({total}), got {given}: raise --{whole.replace('_', '-')} too"
            )
        return int(given or max(1, total // 2))

    @property
    def max_concurrent_rpcs(self) -> int:
        """The budget of service calls in progress (``security.CallGate``): above the sessions, so the
        sessions' clearer refusal comes first."""
        return self.max_sessions + RPC_HEADROOM

    def grpc_options(self, max_frame_bytes: int) -> list[tuple[str, int]]:
        """The grpc.aio server options that enforce these limits for frames of ``max_frame_bytes``."""
        ms = _millis
        return [
            # Frames go out raw, so the send limit is the largest possible batch frame
            # (64 KiB at least, for Describe's JobInfo); requests (Open, Ack, Credit,
            # Describe) are a few hundred bytes, so a client cannot make the server
            # buffer a large message.
            ("grpc.max_send_message_length", max(int(max_frame_bytes), 64 << 10)),
            ("grpc.max_receive_message_length", self.max_request_bytes),
            # Connections over the cap are closed as they are accepted; the cap stays
            # below the descriptor limit (connection_cap).
            ("grpc.max_allowed_incoming_connections", self.connections),
            # Half-open connections: ping every keepalive_s, even without calls, and
            # close the connection when the ack is late. gRPC 1.5x+ times the ack with
            # http2.ping_timeout_ms (default one minute), keepalive_timeout_ms alone
            # no longer does, so both are set.
            ("grpc.keepalive_time_ms", ms(self.keepalive_s)),
            ("grpc.keepalive_timeout_ms", ms(self.keepalive_timeout_s)),
            ("grpc.http2.ping_timeout_ms", ms(self.keepalive_timeout_s)),
            ("grpc.keepalive_permit_without_calls", 1),
            ("grpc.http2.max_pings_without_data", 0),  # keep pinging a connection with no traffic
            # Clients may ping every 10 s (BatchClient pings every 15 s); more often is a
            # strike, and two strikes close the connection (GOAWAY ENHANCE_YOUR_CALM).
            ("grpc.http2.min_ping_interval_without_data_ms", 10_000),
            ("grpc.http2.max_ping_strikes", 2),
            # A TCP connection that never completes the HTTP/2 (or TLS) handshake is closed.
            ("grpc.server_handshake_timeout_ms", ms(self.handshake_timeout_s)),
            # A connection with no call for idle_timeout_s gets a GOAWAY; gRPC clients
            # reconnect on their next call without an error. There is deliberately no
            # max_connection_age: a trainer's stream lives as long as its run, and
            # cutting it would cost a reconnect and a pause for nothing.
            *([("grpc.max_connection_idle_ms", ms(self.idle_timeout_s))] if self.idle_timeout_s else []),
        ]


def _millis(seconds: float) -> int:
    return max(1, round(seconds * 1000))
