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

__all__ = ["RPC_HEADROOM", "Limits", "connection_cap"]

log = logging.getLogger("ladle.server")

RPC_HEADROOM: Final = 64
"""Calls beyond ``max_sessions`` that gRPC itself admits (Describe, health checks): its backstop."""

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
    bytes a row of the dataset). Durations are seconds; ``idle_timeout_s=0`` never
    closes an idle connection.
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
    per_job: int = field(init=False)
    connections: int = field(init=False)

    def __post_init__(self) -> None:
        for name in ("max_sessions", "max_prefetch", "max_sessions_per_job", "max_connections"):
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
        if self.max_sessions_per_job is not None and self.max_sessions_per_job > self.max_sessions:
            raise ConfigError(
                "max_sessions_per_job",
                f"must be at most max_sessions ({self.max_sessions}), got {self.max_sessions_per_job}: "
                "raise --max-sessions too",
            )
        per_job = self.max_sessions_per_job or max(1, self.max_sessions // 2)
        object.__setattr__(self, "per_job", per_job)
        object.__setattr__(self, "connections", self.max_connections or connection_cap())

    @property
    def max_concurrent_rpcs(self) -> int:
        """gRPC's own cap on calls in progress: above the sessions, so ladle's clearer refusal comes first."""
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
