"""``ladle serve``: serve a dataset's batches over gRPC (and HTTP) until stopped."""

from __future__ import annotations

import argparse
import math
from typing import Final

from ..errors import ConfigError
from ..limits import RANK_SERIES, Limits
from ._options import (
    DEFAULT_STATE,
    REDIS_URL_ENV,
    Subparsers,
    add_column_option,
    add_config_options,
    add_store_options,
    config_from_args,
    redis_url,
)

# The shortest --job-ttl: a job must outlive a trainer's pause (an evaluation, a slow checkpoint).
MIN_JOB_TTL_S: Final = 60.0


def add_parser(sub: Subparsers) -> argparse.ArgumentParser:
    serve = sub.add_parser("serve", help="serve a dataset's batches over gRPC to BatchClient trainers")
    serve.add_argument("dataset", help="a dataset folder written by save_to_disk")
    add_column_option(serve)
    serve.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    serve.add_argument(
        "--grpc-port",
        type=int,
        default=50051,
        help="trainers connect here; 0 picks a free port (default: 50051)",
    )
    serve.add_argument(
        "--http-port",
        type=int,
        default=8080,
        help="the HTTP API, metrics and page; 0 picks a free port (default: 8080)",
    )
    serve.add_argument("--no-http", action="store_true", help="serve gRPC only (no HTTP port at all)")
    serve.add_argument(
        "--metrics-ranks",
        type=int,
        default=RANK_SERIES,
        metavar="N",
        help="/metrics gives at most N ranks of a job series of their own (those not seen for longest, "
        "then furthest behind; ranks 0..N-1 for the served counters, the others adding up in "
        f'rank="rest"); every rank counts in the job\'s own series (0: only those; default: {RANK_SERIES})',
    )
    store = serve.add_mutually_exclusive_group()
    store.add_argument(
        "--state",
        help=f"the embedded cursor store file, unless ${REDIS_URL_ENV} is set (default: {DEFAULT_STATE})",
    )
    add_store_options(store)
    serve.add_argument(
        "--job-ttl",
        type=float,
        default=7 * 86400.0,
        metavar="SECONDS",
        help="the cursor store forgets a job nobody touched for this long; 0 keeps jobs forever "
        "(default: 7 days)",
    )
    serve.add_argument(
        "--store-wait",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="at start-up, wait this long for a cursor store that cannot be reached yet (Redis starting "
        "beside the server), retrying, before giving up; refused credentials fail at once (default: 0)",
    )
    serve.add_argument(
        "--ack-flush-ms",
        type=float,
        default=50.0,
        help="write acknowledged positions to the store at most this often per stream "
        "(0: every ack; default: 50)",
    )
    serve.add_argument(
        "--grace", type=float, default=5.0, help="seconds open streams get at shutdown (default: 5)"
    )
    serve.add_argument("--ready-file", help="write host:port here once serving (for scripts and tests)")
    serve.add_argument("--http-ready-file", help="write the HTTP host:port here (before --ready-file)")
    serve.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    add_security_options(serve)
    add_limit_options(serve)
    add_config_options(serve)
    return serve


def add_security_options(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("security (docs/security.md)")
    group.add_argument(
        "--token-file",
        metavar="FILE",
        help="accept only calls with a token from this file, one a line "
        "(default: $LADLE_TOKEN_FILE, else the token in $LADLE_TOKEN)",
    )
    group.add_argument("--tls-cert", metavar="PEM", help="serve gRPC and HTTP over TLS with this certificate")
    group.add_argument("--tls-key", metavar="PEM", help="the certificate's private key")
    group.add_argument(
        "--tls-client-ca", metavar="PEM", help="mutual TLS: clients need a certificate from this CA"
    )
    group.add_argument(
        "--insecure",
        action="store_true",
        help="allow a non-loopback --host without a token (anyone who reaches the port reads every batch)",
    )


def add_limit_options(parser: argparse.ArgumentParser) -> None:
    d = Limits()
    group = parser.add_argument_group("limits (docs/serving.md#limits)")
    group.add_argument(
        "--max-sessions",
        "--max-streams",
        type=int,
        default=d.max_sessions,
        metavar="N",
        help=f"trainer streams open at once; one more is refused with RESOURCE_EXHAUSTED "
        f"(default: {d.max_sessions})",
    )
    group.add_argument(
        "--max-sessions-per-job",
        type=int,
        metavar="N",
        help="streams of one job at once, so one job cannot take the whole server "
        "(default: half of --max-sessions)",
    )
    group.add_argument(
        "--max-prefetch",
        type=int,
        default=d.max_prefetch,
        metavar="N",
        help=f"largest prefetch window a client may ask for; more is INVALID_ARGUMENT "
        f"(default: {d.max_prefetch})",
    )
    group.add_argument(
        "--max-request-bytes",
        type=int,
        default=d.max_request_bytes,
        metavar="BYTES",
        help=f"largest message a client may send; requests are tiny (default: {d.max_request_bytes})",
    )
    group.add_argument(
        "--max-connections",
        type=int,
        metavar="N",
        help="gRPC connections at once; more are closed as they arrive "
        "(default: 4096, less when the file-descriptor limit is lower)",
    )
    group.add_argument(
        "--keepalive",
        type=float,
        default=d.keepalive_s,
        metavar="SECONDS",
        help=f"ping every connection this often and close it when the answer is "
        f"{d.keepalive_timeout_s:.0f}s late: half-open connections go (default: {d.keepalive_s:.0f})",
    )
    group.add_argument(
        "--idle-timeout",
        type=float,
        default=d.idle_timeout_s,
        metavar="SECONDS",
        help=f"close a connection with no call for this long; clients reconnect on their next call "
        f"(0: never; default: {d.idle_timeout_s:.0f})",
    )
    group.add_argument(
        "--handshake-timeout",
        type=float,
        default=d.handshake_timeout_s,
        metavar="SECONDS",
        help=f"close a connection that has not finished its HTTP/2 (or TLS) handshake by then, and end a "
        f"call that has not sent its first request (default: {d.handshake_timeout_s:.0f})",
    )
    group.add_argument(
        "--spare-schedules",
        type=int,
        default=d.spare_schedules,
        metavar="N",
        help=f"schedules kept beyond those streams use (and their next epochs): an idle job's, an "
        f"inspected epoch's; each holds about 6 bytes a row, so lower it for huge datasets "
        f"(default: {d.spare_schedules})",
    )
    group.add_argument(
        "--max-schedules",
        type=int,
        default=d.max_schedules,
        metavar="N",
        help=f"schedules no stream uses that Opens and Describes had built in the last minute (new world "
        f"sizes or start epochs), builds in progress included; an Open that needs one more is refused "
        f"with RESOURCE_EXHAUSTED. Each holds about 6 bytes a row (default: {d.max_schedules})",
    )
    group.add_argument(
        "--max-schedules-per-client",
        type=int,
        metavar="N",
        help="the same for one client (its address and client_id), so one cannot take them all "
        "(default: half of --max-schedules)",
    )


def limits_from_args(args: argparse.Namespace) -> Limits:
    """The server's ``Limits`` from the ``serve`` options (a ``ConfigError`` names a bad one)."""
    return Limits(
        max_sessions=args.max_sessions,
        max_sessions_per_job=args.max_sessions_per_job,
        max_prefetch=args.max_prefetch,
        max_request_bytes=args.max_request_bytes,
        max_connections=args.max_connections,
        keepalive_s=args.keepalive,
        idle_timeout_s=args.idle_timeout,
        handshake_timeout_s=args.handshake_timeout,
        spare_schedules=args.spare_schedules,
        max_schedules=args.max_schedules,
        max_schedules_per_client=args.max_schedules_per_client,
    )


def run(args: argparse.Namespace) -> int:
    import logging

    from ..dataset import parse_columns
    from ..security import TlsFiles, load_tokens
    from ..server import BatchServer, serve_forever

    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # named as the flags are: the server's own checks name its fields (ack_flush_s, in seconds)
    if not math.isfinite(args.ack_flush_ms) or args.ack_flush_ms < 0:
        raise ConfigError(
            "ack_flush_ms", f"--ack-flush-ms must be a number of milliseconds >= 0, got {args.ack_flush_ms:g}"
        )
    if not math.isfinite(args.job_ttl) or args.job_ttl < 0:
        raise ConfigError(
            "job_ttl", f"--job-ttl must be a number of seconds >= 0 (0: never), got {args.job_ttl:g}"
        )
    if 0 < args.job_ttl < MIN_JOB_TTL_S:
        # a job expires between two writes of a trainer that pauses (an evaluation, a slow checkpoint)
        raise ConfigError(
            "job_ttl",
            f"--job-ttl {args.job_ttl:g} s is shorter than {MIN_JOB_TTL_S:.0f} s: a job would be forgotten "
            "while its trainers pause; give at least that, or 0 to keep jobs forever",
        )
    server = BatchServer(
        args.dataset,
        config_from_args(args),
        host=args.host,
        grpc_port=args.grpc_port,
        state=args.state or DEFAULT_STATE,
        redis_url=redis_url(args),
        job_ttl_s=args.job_ttl,
        store_wait_s=args.store_wait,
        limits=limits_from_args(args),
        ack_flush_s=args.ack_flush_ms / 1000,
        grace=args.grace,
        http_port=None if args.no_http else args.http_port,
        tokens=load_tokens(args.token_file),
        tls=TlsFiles.from_options(args.tls_cert, args.tls_key, args.tls_client_ca),
        insecure=args.insecure,
        columns=parse_columns(args.column),
        metrics_ranks=args.metrics_ranks,
    )
    return serve_forever(server, ready_file=args.ready_file, http_ready_file=args.http_ready_file)
