"""The ladle CLI: plan, serve, demo, jobs, inspect, health and make-dataset.

Every command takes the same schedule options, from flags or a TOML file
(``--config``; flags win). Errors a user can cause print one line and exit 2;
output cut short by a closed pipe (``ladle plan DS | head``) ends quietly.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import textwrap
import time
from collections.abc import Sequence
from typing import Any, Final, get_args

from .errors import ConfigError, JobNotFoundError, LadleError
from .ingest.command import add_arguments as ingest_arguments
from .limits import Limits
from .report import BUCKET_HEADER, bucket_cells, ratio_cell
from .schedule import PRODUCTION_BOUNDS, ScheduleConfig, build_schedule, cut_samples
from .schedule.stats import (
    BucketRow,
    LossFigures,
    Quality,
    batch_mates_note,
    bucket_table,
    quality,
    simulate_loss,
    summary,
)

# The gRPC health service's name for "ready to serve trainers" (ladle.proto.rpc.SERVICE).
SERVICE_HEALTH: Final = "ladle.v1.BatchService"

__all__ = ["build_parser", "main"]

# The Redis URL may carry a password: it is read from the environment rather
# than typed on a command line that `ps` shows, and never printed unredacted.
REDIS_URL_ENV = "LADLE_REDIS_URL"
DEFAULT_STATE = ".ladle/state.db"
# The client certificate's files, as BatchClient reads them (mutual TLS).
TLS_CERT_ENV: Final = "LADLE_TLS_CERT"
TLS_KEY_ENV: Final = "LADLE_TLS_KEY"
# The shortest --job-ttl: a job must outlive a trainer's pause (an evaluation, a slow checkpoint).
MIN_JOB_TTL_S: Final = 60.0
# `ladle inspect` names this many of a store's jobs, the most recently updated first.
SHOWN_JOBS: Final = 5
# `ladle jobs --delete` refuses a job with a rank seen this recently: its trainers are
# probably still streaming, and the server they stream from would re-create the job.
LIVE_WINDOW_S = 300.0


def _add_config_options(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("schedule options (also settable in --config FILE)")
    group.add_argument("--config", metavar="FILE", help="TOML file with a [schedule] table")
    for name, info in ScheduleConfig.model_fields.items():
        flag = "--" + name.replace("_", "-")
        choices = [c for c in get_args(info.annotation) if isinstance(c, str)]
        if name == "bucket_bounds":
            group.add_argument(
                flag,
                metavar="auto|production|EDGES",
                help="'auto' (default): edges fitted to the dataset; 'production': the production "
                "run's (0,770,1216,1728,2432,3296,8193); or comma-separated edges",
            )
        elif choices and all(isinstance(c, str) for c in get_args(info.annotation)):
            group.add_argument(flag, choices=choices, help=f"default: {info.default}")
        else:
            group.add_argument(
                flag, type=int, metavar="N", help=info.description or f"default: {info.default}"
            )


def config_from_args(args: argparse.Namespace) -> ScheduleConfig:
    """The validated config from ``--config`` and the flags given (flags win)."""
    overrides: dict[str, Any] = {
        name: getattr(args, name)
        for name in ScheduleConfig.model_fields
        if getattr(args, name, None) is not None
    }
    if getattr(args, "config", None):
        return ScheduleConfig.from_toml(args.config, overrides)
    return ScheduleConfig.from_mapping(overrides)


def _version() -> str:
    import ladle

    return ladle.__version__


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ladle", description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--version", action="version", version=f"ladle {_version()}")
    sub = parser.add_subparsers(dest="command", required=True)

    plan = sub.add_parser("plan", help="print the per-bucket table and the schedule's quality figures")
    plan.add_argument("dataset", help="a dataset folder written by save_to_disk")
    plan.add_argument("--world-size", type=int, default=1, metavar="W")
    plan.add_argument("--epoch", type=int, default=0)
    plan.add_argument("--json", action="store_true", help="machine-readable output")
    plan.add_argument("--compare", choices=["random"], help="show the naive random shuffle beside ladle")
    plan.add_argument("--simulate-loss", action="store_true", help="simulate the logged loss (the ladder)")
    plan.add_argument(
        "--check-values",
        action="store_true",
        help="read every token: refuse ids beyond int32 and mask values beyond int8 now, not at their batch, "
        "and name negative ids and masks other than 0/1 (reads the whole dataset once)",
    )
    plan.add_argument(
        "--vocab-size",
        type=int,
        metavar="N",
        help="with --check-values: refuse token ids outside [0, N), the model's vocabulary",
    )
    _add_column_option(plan)
    _add_config_options(plan)

    serve = sub.add_parser("serve", help="serve a dataset's batches over gRPC to BatchClient trainers")
    serve.add_argument("dataset", help="a dataset folder written by save_to_disk")
    _add_column_option(serve)
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
    store = serve.add_mutually_exclusive_group()
    store.add_argument(
        "--state",
        help=f"the embedded cursor store file, unless ${REDIS_URL_ENV} is set (default: {DEFAULT_STATE})",
    )
    _add_store_options(store)
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
    _add_security_options(serve)
    _add_limit_options(serve)
    _add_config_options(serve)

    demo = sub.add_parser("demo", help="run the whole system on this machine: server, trainers, checks")
    from .demo import add_arguments as _demo_arguments

    _demo_arguments(demo)
    _add_config_options(demo)

    jobs = sub.add_parser("jobs", help="list the jobs in a cursor store, or delete some")
    where = jobs.add_mutually_exclusive_group()
    where.add_argument("--state", help=f"the embedded cursor store file (default: {DEFAULT_STATE})")
    _add_store_options(where)
    jobs.add_argument("--json", action="store_true", help="machine-readable output, every rank included")
    jobs.add_argument(
        "--delete",
        nargs="+",
        metavar="NAME",
        help="delete these jobs (exit 1 if one is unknown); a name that starts with '-': --delete=-NAME",
    )
    jobs.add_argument(
        "--force",
        action="store_true",
        help=f"with --delete: delete jobs with ranks seen in the last {LIVE_WINDOW_S:.0f} s too "
        "(their trainers keep running, and a server they stream from re-creates the job)",
    )

    inspect = sub.add_parser("inspect", help="print a running server's tables for one job (its HTTP API)")
    inspect.add_argument("--server", default=None, help="the server's HTTP address (default: 127.0.0.1:8080)")
    inspect.add_argument("--job", help="the job to show (default: the one updated last)")
    inspect.add_argument(
        "--epoch", type=_non_negative, metavar="E", help="default: the epoch of the job's slowest rank"
    )
    inspect.add_argument("--json", action="store_true", help="machine-readable output")
    inspect.add_argument(
        "--token-file", metavar="FILE", help="the server's token (default: $LADLE_TOKEN_FILE, $LADLE_TOKEN)"
    )
    inspect.add_argument("--tls-ca", metavar="PEM", help="verify an https:// server against this CA")
    inspect.add_argument(
        "--tls-cert",
        metavar="PEM",
        help="mutual TLS: the client certificate a server with --tls-client-ca asks for "
        f"(default: ${TLS_CERT_ENV})",
    )
    inspect.add_argument("--tls-key", metavar="PEM", help=f"its private key (default: ${TLS_KEY_ENV})")

    health = sub.add_parser(
        "health",
        help="ask a server's gRPC health service, as an exec probe does (exit 0 when SERVING)",
        description="Exit 0 when the server answers SERVING for the service, 1 when it answers "
        "anything else, 2 when it cannot be asked (not there, TLS refused, no answer in time).",
    )
    health.add_argument(
        "--server", default="127.0.0.1:50051", help="its gRPC address (default: 127.0.0.1:50051)"
    )
    health.add_argument(
        "--service",
        default=SERVICE_HEALTH,
        help=f"default: {SERVICE_HEALTH}, ready to serve trainers (the dataset and the cursor store "
        'answer); "" for the process alone, as a liveness probe asks',
    )
    health.add_argument("--timeout", type=float, default=3.0, help="seconds to wait (default: 3)")
    health.add_argument(
        "--tls", action="store_true", help="speak TLS, trusting the system's CAs (implied by --tls-ca)"
    )
    health.add_argument(
        "--tls-ca", metavar="PEM", help="speak TLS, trusting this CA (default: $LADLE_TLS_CA)"
    )
    health.add_argument(
        "--tls-cert", metavar="PEM", help=f"mutual TLS: the client certificate (default: ${TLS_CERT_ENV})"
    )
    health.add_argument("--tls-key", metavar="PEM", help=f"its private key (default: ${TLS_KEY_ENV})")
    health.add_argument(
        "--tls-server-name",
        metavar="NAME",
        help="the name to check the server's certificate against, when --server does not carry it "
        "(a probe inside the pod asks 127.0.0.1)",
    )

    make = sub.add_parser(
        "make-dataset",
        help="write a tokenized dataset: synthetic (production length mix), or from text, JSONL, Parquet "
        "or a save_to_disk folder",
    )
    make.add_argument("out", help="folder to create")
    source = make.add_mutually_exclusive_group(required=True)
    source.add_argument("--rows", type=int, help="synthetic: this many rows of the production length mix")
    make.add_argument("--seed", type=int, default=0, help="synthetic rows")
    make.add_argument(
        "--scale",
        type=float,
        default=1.0,
        help="synthetic: multiply every length, e.g. 0.03125 for rows 1/32 as long (default: 1.0)",
    )
    ingest_arguments(make, source)
    return parser


def _add_column_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--column",
        action="append",
        default=[],
        metavar="ROLE=NAME",
        help="serve another column in a role: input_ids=NAME (the token ids), loss_mask=NAME (weights) or "
        "labels=NAME (loss where not -100). Default: input_ids, and the mask from loss_mask, else labels, "
        "else loss on every token",
    )


def _non_negative(text: str) -> int:
    """An argparse type: an integer >= 0 (a bad one is argparse's usage error, exit 2)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        code = _run(args)
        sys.stdout.flush()  # here, not at exit: a closed pipe must end in the handler below
    except BrokenPipeError:
        # The reader went away (`ladle plan DS | head`): stop quietly, as standard tools do.
        # Python's recipe: point stdout at devnull so the flush at exit does not fail again.
        try:
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
        except (OSError, ValueError):
            pass  # stdout is not a file (captured in tests)
        return 1
    return code


def _run(args: argparse.Namespace) -> int:
    try:
        if args.command == "plan":
            return _plan(args)
        if args.command == "make-dataset":
            return _make_dataset(args)
        if args.command == "serve":
            return _serve(args)
        if args.command == "jobs":
            return _jobs(args)
        if args.command == "inspect":
            return _inspect(args)
        if args.command == "health":
            return _health(args)
        if args.command == "demo":
            from .demo import run_demo

            if args.dataset_path is not None and (args.dataset is not None or args.text):
                raise ConfigError("dataset", "give one of DATASET, --dataset and --text")
            config = config_from_args(args)
            dataset = args.dataset if args.dataset is not None else args.dataset_path
            return run_demo(dataset, args.world_size, config, args.rows, args.keep, args.text, args.split)
    except LadleError as exc:
        print(f"ladle: error: {exc}", file=sys.stderr)
        return 2
    raise AssertionError(f"unhandled command {args.command}")


def _add_security_options(parser: argparse.ArgumentParser) -> None:
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


def _add_limit_options(parser: argparse.ArgumentParser) -> None:
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
        f"inspected epoch's; each holds about 10 bytes a row, so lower it for huge datasets "
        f"(default: {d.spare_schedules})",
    )
    group.add_argument(
        "--max-schedules",
        type=int,
        default=d.max_schedules,
        metavar="N",
        help=f"schedules no stream uses that Opens and Describes had built in the last minute (new world "
        f"sizes or start epochs), builds in progress included; an Open that needs one more is refused "
        f"with RESOURCE_EXHAUSTED. Each holds about 10 bytes a row (default: {d.max_schedules})",
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


def _serve(args: argparse.Namespace) -> int:
    import logging

    from .dataset import parse_columns
    from .security import TlsFiles, load_tokens
    from .server import BatchServer, serve_forever

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
        redis_url=_redis_url(args),
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
    )
    return serve_forever(server, ready_file=args.ready_file, http_ready_file=args.http_ready_file)


def _inspect(args: argparse.Namespace) -> int:
    from .inspect_client import DEFAULT_SERVER, fetch_report
    from .security import load_tokens

    tokens = load_tokens(args.token_file)
    doc = fetch_report(
        args.server or DEFAULT_SERVER,
        args.job,
        args.epoch,
        token=tokens[0] if tokens else None,
        cafile=args.tls_ca,
        certfile=args.tls_cert or os.environ.get(TLS_CERT_ENV) or None,
        keyfile=args.tls_key or os.environ.get(TLS_KEY_ENV) or None,
    )
    if args.json:
        print(json.dumps(doc, indent=2))
        return 0
    ds = doc["dataset"]
    print(f"server {doc['server']}: dataset {ds['path']}, {ds['rows']} rows, fingerprint {ds['fingerprint']}")
    print(format_job_names(doc["jobs"]))
    job = doc["job"]
    if job is None:
        return 0
    config = job["config"] or {}
    print(
        f"job {job['job']}: world size {job['world_size']}, {config.get('rank_mode', '?')} ranks, "
        f"epoch {doc['buckets']['epoch']}, {doc['buckets']['num_steps']} steps, "
        f"schedule {job['schedule_fingerprint']}"
    )
    print()
    print(format_bucket_rows([BucketRow(**row) for row in doc["buckets"]["buckets"]]))
    print()
    print(format_quality(Quality(**doc["quality"]["quality"]), Quality(**doc["random"]["quality"])))
    print()
    ours, random = doc["quality"]["simulated_loss"], doc["random"]["simulated_loss"]
    print(format_loss(LossFigures(**ours), LossFigures(**random)))
    print()
    print(format_cursor(doc["cursor"]))
    return 0


# BatchClient's TLS arguments, as `ladle health` names them (a flag, or the variable it defaults to)
_TLS_FLAGS: Final = {
    "root_certificates": "--tls-ca ($LADLE_TLS_CA)",
    "client_certificate": f"--tls-cert (${TLS_CERT_ENV})",
    "client_key": f"--tls-key (${TLS_KEY_ENV})",
}


def _health(args: argparse.Namespace) -> int:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from ladle.client.client import channel_credentials, grpc_target

    if not math.isfinite(args.timeout) or args.timeout <= 0:
        raise ConfigError("timeout", f"--timeout must be a positive number of seconds, not {args.timeout}")
    try:
        target = grpc_target(args.server)
    except ValueError as exc:
        raise ConfigError("server", str(exc)) from None
    try:
        tls = True if args.tls else None
        credentials = channel_credentials(tls, args.tls_ca, args.tls_cert, args.tls_key)
    except ValueError as exc:  # worded for BatchClient's arguments: name the flags (or their variables)
        message = str(exc)
        for argument, flag in _TLS_FLAGS.items():
            message = message.replace(argument, flag)
        raise ConfigError("tls", message) from None
    if args.tls_server_name and credentials is None:
        raise ConfigError("tls_server_name", "--tls-server-name goes with TLS (--tls or --tls-ca)")
    options = [("grpc.ssl_target_name_override", args.tls_server_name)] if args.tls_server_name else []
    channel = (
        grpc.insecure_channel(target, options=options)
        if credentials is None
        else grpc.secure_channel(target, credentials, options=options)
    )
    service = args.service or "overall"
    with channel:
        try:
            answer = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=args.service), timeout=args.timeout
            )
        except grpc.RpcError as exc:
            code = exc.code()
            if code == grpc.StatusCode.NOT_FOUND:
                print(f"{target}: no service {args.service!r} (the server does not know it)")
                return 1
            detail = exc.details() or ""
            hint = ""
            if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                hint = (
                    " (TLS: check --tls-ca, the server's name or --tls-server-name, and that it serves TLS)"
                    if credentials is not None
                    else " (is it running, is that its gRPC port, and if it serves TLS, --tls-ca or --tls?)"
                )
            print(f"ladle: error: {target}: {code.name}: {detail}{hint}", file=sys.stderr)
            return 2
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(answer.status)
    print(f"{target} {service}: {status}")
    return 0 if answer.status == health_pb2.HealthCheckResponse.SERVING else 1


def format_job_names(jobs: Sequence[dict[str, Any]]) -> str:
    """The ``jobs:`` line of ``ladle inspect``: how many, and a few names of each kind, newest first.

    A store of thousands of jobs gives at most two short lines, not every
    name; when none runs on this server's dataset and config, it says so.
    """
    if not jobs:
        return "jobs: none yet"
    newest = sorted(jobs, key=lambda j: (j.get("updated") or 0.0, j["job"]), reverse=True)
    served = [j["job"] for j in newest if j["served"]]
    other = [j["job"] for j in newest if not j["served"]]
    ours = f"{len(served)} on this server's dataset and config" + (f": {_some(served)}" if served else "")
    if not other:
        return f"jobs: {ours}"
    theirs = f"{len(other)} of another dataset or config: {_some(other)}"
    if not served:
        return f"jobs: none on this server's dataset and config; {theirs}"
    return f"jobs: {ours}\n      {theirs}"


def _some(names: Sequence[str]) -> str:
    """At most ``SHOWN_JOBS`` names (the most recently updated), then how many more."""
    shown = ", ".join(names[:SHOWN_JOBS])
    return shown + (f" and {len(names) - SHOWN_JOBS} more" if len(names) > SHOWN_JOBS else "")


def format_cursor(cursor: dict[str, Any]) -> str:
    """Each rank's position, progress through its epoch, lag behind the leader, last seen, generation.

    A rank that never connected (``last_seen``/``seen_ago_s`` null) shows "never".
    """
    rows = [
        [
            str(r["rank"]),
            f"{r['epoch']}:{r['step']}",
            f"{100 * r['progress']:.1f}% of {r['steps_in_epoch']}",
            str(r["lag_steps"]),
            _seen(r),
            str(r["generation"]),
        ]
        for r in cursor["ranks"]
    ]
    lead = cursor["leader"]
    return f"ranks (leader at {lead['epoch']}:{lead['step']})\n" + _table(
        ["rank", "epoch:step", "progress", "lag (steps)", "last seen", "generation"], rows
    )


def _seen(rank: dict[str, Any]) -> str:
    ago = rank.get("seen_ago_s")
    return "never" if ago is None or rank.get("last_seen", ago) is None else f"{ago:.0f}s ago"


def _add_store_options(parser: argparse.ArgumentParser | argparse._MutuallyExclusiveGroup) -> None:
    parser.add_argument(
        "--redis-url",
        metavar="URL",
        help=f"keep cursors in Redis: redis://[:password@]host:port/db, rediss:// (TLS) or unix:// "
        f"(default: ${REDIS_URL_ENV}, else the embedded --state file)",
    )


def _redis_url(args: argparse.Namespace) -> str | None:
    """``--redis-url``, else ``$LADLE_REDIS_URL`` unless ``--state`` was given; None: the embedded store.

    A flag wins over the environment, for ``serve`` as for ``jobs``.
    """
    if args.redis_url is not None:
        return _check_redis_url(str(args.redis_url), "--redis-url")
    if getattr(args, "state", None):
        return None
    url = os.environ.get(REDIS_URL_ENV)
    return None if url is None else _check_redis_url(url, f"${REDIS_URL_ENV}")


REDIS_SCHEMES: Final = ("redis", "rediss", "unix")


def _check_redis_url(url: str, where: str) -> str:
    """``url`` if it names one of ``REDIS_SCHEMES``, else a ``ConfigError`` that says how to write it.

    Without a scheme, ``host:port`` would parse as the scheme ``host``. The
    value is echoed back only if it holds no ``@`` (so no password).
    """
    if not url.strip():
        # an empty Secret or an unset shell variable in a template: not a request for the embedded
        # store, which would leave each replica with cursors of its own
        raise ConfigError(
            "redis_url",
            f"{where} is set but empty: give the Redis URL (redis://host:6379/0), or leave it unset "
            "for the embedded store",
        )
    scheme, sep, _ = url.partition("://")
    if sep and scheme.lower() in REDIS_SCHEMES:
        return url
    hint = f": did you mean redis://{url}?" if not sep and "@" not in url else ""
    raise ConfigError(
        "redis_url",
        f"{where} needs a URL that starts with redis://, rediss:// (TLS) or unix://, "
        f"e.g. redis://localhost:6379/0{hint}",
    )


def _jobs(args: argparse.Namespace) -> int:
    from .errors import StoreUnavailableError
    from .store import DEFAULT_JOB_TTL_S, open_store
    from .store.base import CursorStore

    url = _redis_url(args)
    state = args.state or DEFAULT_STATE
    if url is None and not os.path.exists(state):
        raise StoreUnavailableError(f"no cursor store at {state} (give --state FILE or --redis-url URL)")
    if not args.delete:
        # a listing is a read: a read-only copy of the file, a file beside a busy writer, an older
        # ladle's file as it is; a Redis replica, without the server's start-up checks and warnings
        # (they would repeat on every listing)
        if url is None:
            from .store.embedded import EmbeddedStore

            opened: CursorStore = EmbeddedStore(state, read_only=True)
        else:
            from .store.redis import RedisCursorStore  # redis is imported only for a Redis URL

            opened = RedisCursorStore(url, job_ttl_s=DEFAULT_JOB_TTL_S, read_only=True)
    else:
        opened = open_store(redis_url=url, state_path=state, job_ttl_s=DEFAULT_JOB_TTL_S)
    with opened as store:
        if args.delete:
            if not args.force:
                live = _live_jobs(store, args.delete, time.time())
                for name, ago in live.items():
                    if isinstance(ago, LadleError):  # when its ranks were seen cannot be read
                        print(f"ladle: error: {ago}", file=sys.stderr)
                        continue
                    # The store cannot tell trainers that stopped cleanly from running ones: say both.
                    print(
                        f"ladle: error: job {name!r} has ranks seen {ago:.0f} s ago: if its trainers are "
                        f"still running, stop them first (a server they stream from re-creates the job); "
                        f"a job can be deleted {LIVE_WINDOW_S / 60:.0f} minutes after its last rank was "
                        "seen, or now with --force",
                        file=sys.stderr,
                    )
                if live:
                    return 2
            deleted = [name for name in args.delete if store.delete_job(name)]
            missing = [name for name in args.delete if name not in deleted]
            if args.json:
                print(json.dumps({"deleted": deleted, "not_found": missing}))
            for name in [] if args.json else deleted:
                print(f"deleted job {name!r}")
            for name in missing:
                print(f"ladle: error: job {name!r} not found in {store!r}", file=sys.stderr)
            return 1 if missing else 0
        jobs = store.list_jobs()
        if args.json:
            print(json.dumps([job_summary(job) for job in jobs], indent=2))
        elif not jobs:
            print(f"no jobs to show in {store!r} (a job whose record cannot be read is left out, warned of)")
        else:
            print(format_jobs(jobs))
    return 0


def _live_jobs(store: Any, names: Sequence[str], now: float) -> dict[str, float | LadleError]:
    """The named jobs with a rank seen within ``LIVE_WINDOW_S`` of ``now``: how many seconds ago.

    A job whose stored record cannot be read is among them, with the error: whether its trainers
    run cannot be told, so only ``--force`` deletes it (its error says so).
    """
    from .errors import StoreCorruptError

    live: dict[str, float | LadleError] = {}
    for name in names:
        try:
            job = store.get(name)
        except JobNotFoundError:
            continue
        except StoreCorruptError as exc:
            live[name] = exc
            continue
        ago = max(0.0, now - max([job.updated, *(r.last_seen for r in job.ranks)]))
        if ago < LIVE_WINDOW_S:
            live[name] = ago
    return live


def job_summary(job: Any) -> dict[str, Any]:
    """One job of ``ladle jobs --json``: its identity, the spread of its ranks, and every rank."""
    positions = [r.position for r in job.ranks]
    generations = [r.generation for r in job.ranks]
    return {
        "job": job.job,
        "world_size": job.spec.world_size,
        "dataset_fingerprint": job.spec.dataset_fingerprint,
        "config_fingerprint": job.spec.config_fingerprint,
        "min_position": [min(positions).epoch, min(positions).step],
        "max_position": [max(positions).epoch, max(positions).step],
        "generations": [min(generations), max(generations)],
        "created": job.created,
        "updated": job.updated,
        "incarnation": job.incarnation,
        "resizes": len(job.plan),
        "ranks": [
            {
                "rank": r.rank,
                "epoch": r.position.epoch,
                "step": r.position.step,
                "generation": r.generation,
                "last_seen": r.last_seen,
            }
            for r in job.ranks
        ],
    }


def format_jobs(jobs: Sequence[Any]) -> str:
    """The table ``ladle jobs`` prints: one row per job, positions as ``epoch:step``, times in UTC."""
    rows = []
    for job in jobs:
        doc = job_summary(job)
        low, high = doc["generations"]
        rows.append(
            [
                job.job,
                str(job.spec.world_size),
                "{}:{}".format(*doc["min_position"]),
                "{}:{}".format(*doc["max_position"]),
                str(low) if low == high else f"{low}..{high}",
                time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(job.updated)),
                job.incarnation,
                str(len(job.plan)),
            ]
        )
    header = ["job", "world", "min pos", "max pos", "generations", "updated (UTC)", "incarnation", "resizes"]
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(header, widths, strict=True)).rstrip()]
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows]
    return "\n".join(lines)


def _make_dataset(args: argparse.Namespace) -> int:
    try:
        return _write_dataset(args)
    except OSError as exc:  # the sources' read errors are LadleErrors already: this one is the writing
        where = f" ({exc.filename})" if exc.filename and os.fspath(exc.filename) != args.out else ""
        raise ConfigError("out", f"cannot write {args.out}: {exc.strerror or exc}{where}") from None


def _write_dataset(args: argparse.Namespace) -> int:
    if args.rows is None:
        from .ingest.command import run

        return run(args)
    from .synth import make_dataset

    began = time.perf_counter()
    vocab_size = 32000 if args.vocab_size is None else args.vocab_size
    ds = make_dataset(args.out, args.rows, args.seed, scale=args.scale, vocab_size=vocab_size)
    took = time.perf_counter() - began
    print(f"wrote {ds.num_rows} rows to {args.out} in {took:.1f}s (fingerprint {ds.fingerprint})")
    return 0


def _plan(args: argparse.Namespace) -> int:
    from .assemble import check_values
    from .dataset import open_dataset, parse_columns

    config = config_from_args(args)
    if args.vocab_size is not None and args.vocab_size < 1:
        raise ConfigError("vocab_size", f"--vocab-size must be >= 1, got {args.vocab_size}")
    if args.vocab_size is not None and not args.check_values:
        raise ConfigError("vocab_size", "--vocab-size is checked by --check-values: give both")
    ds = open_dataset(args.dataset, parse_columns(args.column))
    sched = build_schedule(ds.lengths, config, epoch=args.epoch, world_size=args.world_size)
    # the epoch after, for the batch-mates that meet again
    after = build_schedule(ds.lengths, config, epoch=args.epoch + 1, world_size=args.world_size)
    baseline = None
    if args.compare == "random" or args.simulate_loss:
        baseline = build_schedule(
            ds.lengths,
            config.replace(interleave="random"),
            epoch=args.epoch,
            world_size=args.world_size,
        )
    cut = cut_samples(ds.lengths, config)
    ranges = check_values(ds, args.vocab_size) if args.check_values else None
    if args.json:
        doc = summary(sched, after)
        doc["dataset"] = {
            "path": ds.path,
            "rows": ds.num_rows,
            "fingerprint": ds.fingerprint,
            "columns": ds.columns.as_dict(),
        }
        doc["cut"] = {"samples": cut.samples, "tokens_cut": cut.tokens_cut, "tokens": cut.tokens}
        if ranges is not None:
            doc["values"] = {column: {"min": lo, "max": hi} for column, (lo, hi) in ranges.items()}
        if baseline is not None and args.compare == "random":
            doc["compare"] = {"random": summary(baseline)}
        if args.simulate_loss and baseline is not None:
            doc["simulated_loss"] = {
                "ladle": vars(simulate_loss(sched)),
                "random": vars(simulate_loss(baseline)),
            }
        print(json.dumps(doc, indent=2))
        return 0
    print(f"dataset {ds.path}: {ds.num_rows} rows, fingerprint {ds.fingerprint}")
    print(f"columns: {ds.columns.describe()}")
    print(
        f"config {config.fingerprint()}: budget {config.token_budget} tokens, "
        f"<= {config.max_batch_size} rows, max_seq_len {config.max_seq_len}, "
        f"{config.rank_mode} ranks, seed {config.seed}, epoch {args.epoch}"
    )
    print(f"bucket bounds {_bounds_source(config)}: {', '.join(str(b) for b in sched.bounds)}")
    print()
    print(format_bucket_table(sched))
    print()
    q = quality(sched, after)
    qb = quality(baseline) if baseline is not None and args.compare == "random" else None
    print(format_quality(q, qb))
    if cut:
        print(f"\nnote: {cut.sentence()}")
    crowded = _crowded_bucket(sched, config)
    if crowded:
        print(f"\nnote: {crowded}")
    if ranges is not None:
        print(f"\n{_values_line(ranges)}")
    if args.simulate_loss and baseline is not None:
        print()
        print(format_loss(simulate_loss(sched), simulate_loss(baseline)))
    return 0


def _bounds_source(config: ScheduleConfig) -> str:
    """How the edges were chosen: 'auto' (fitted), the production preset, or given."""
    if config.bucket_bounds == "auto":
        return f"(auto, {config.num_buckets} buckets at most, fitted to this dataset)"
    if config.bucket_bounds == PRODUCTION_BOUNDS:
        return "(the production preset)"
    return "(given)"


def _values_line(ranges: dict[str, tuple[int, int]]) -> str:
    """What ``--check-values`` found: the ranges, and what in them is odd (every value fits the wire)."""
    ids_low, ids_high = ranges["input_ids"]
    mask_low, mask_high = ranges.get("loss_mask", (0, 1))
    mask = f", loss_mask {mask_low}..{mask_high}" if "loss_mask" in ranges else ", loss mask derived (0 or 1)"
    line = f"values: input_ids {ids_low}..{ids_high}{mask}: all fit the wire"
    if ids_low < 0:
        line += "\nnote: input_ids holds negative values (a -100 copied from labels?): they are served as is"
    if mask_low < 0 or mask_high > 1:
        line += "\nnote: loss_mask holds values other than 0 and 1: they reach the trainer as weights"
    return line


def _crowded_bucket(sched: Any, config: ScheduleConfig) -> str:
    """A hint when fixed edges put most samples in one bucket (nothing left to interleave), else ''."""
    rows = bucket_table(sched)
    total = sum(r.samples for r in rows)
    if config.bucket_bounds == "auto" or len(rows) < 2 or not total:
        return ""
    top = max(rows, key=lambda r: r.samples)
    if top.samples < 0.9 * total:
        return ""
    return (
        f"{top.samples / total:.0%} of the samples fall in one bucket ([{top.lo}, {top.hi})) with these "
        "edges, so batches barely mix lengths; --bucket-bounds auto fits edges to this dataset"
    )


def _table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(header)]
    lines = ["  ".join(h.rjust(w) for h, w in zip(header, widths, strict=True))]
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) for r in rows]
    return "\n".join(lines)


def format_bucket_table(sched: Any) -> str:
    return format_bucket_rows(bucket_table(sched))


def format_bucket_rows(rows: Sequence[BucketRow]) -> str:
    """The per-bucket table as text (the page and ``ladle inspect`` show the same cells)."""
    return _table(list(BUCKET_HEADER), [bucket_cells(r) for r in rows])


def _fmt_list(values: list[int] | None) -> str:
    return " ".join(str(v) for v in values) if values is not None else "-"


def format_quality(q: Quality, baseline: Quality | None = None) -> str:
    def row(name: str, ours: str, theirs: str | None = None) -> list[str]:
        return [name, ours] + ([theirs or "-"] if baseline is not None else [])

    b = baseline
    rows = [
        row("steps per epoch", str(q.num_steps), str(b.num_steps) if b else None),
        row("optimizer steps", str(q.optimizer_steps), str(b.optimizer_steps) if b else None),
        row("world size", str(q.world_size), str(b.world_size) if b else None),
        row(
            "padding efficiency",
            f"{q.padding_efficiency:.4f}",
            f"{b.padding_efficiency:.4f}" if b else None,
        ),
        row("longest run per bucket", _fmt_list(q.max_run), _fmt_list(b.max_run) if b else None),
        row(
            "  its lower bound",
            _fmt_list(q.max_run_lower_bound),
            _fmt_list(b.max_run_lower_bound) if b else None,
        ),
        row("  worst excess over bound", str(q.max_run_excess), str(b.max_run_excess) if b else None),
        row(
            "share deviation, ranks",
            f"{q.share_deviation_ranks:.2f}",
            f"{b.share_deviation_ranks:.2f}" if b else None,
        ),
        row(
            "share deviation, steps",
            f"{q.share_deviation_steps:.2f}",
            f"{b.share_deviation_steps:.2f}" if b else None,
        ),
        row(
            "distinct buckets/step min, mean",
            f"{q.distinct_per_step_min}, {q.distinct_per_step_mean:.2f}",
            f"{b.distinct_per_step_min}, {b.distinct_per_step_mean:.2f}" if b else None,
        ),
        row(
            f"distinct buckets/window min, mean (of {q.distinct_per_window_possible})",
            f"{q.distinct_per_window_min}, {q.distinct_per_window_mean:.2f}",
            f"{b.distinct_per_window_min}, {b.distinct_per_window_mean:.2f}" if b else None,
        ),
        row(
            "buckets run out within (steps)",
            str(q.finish_spread_steps),
            str(b.finish_spread_steps) if b else None,
        ),
        row(
            "batch-mates: row-id span / random's",
            ratio_cell(q.batch_span_ratio),
            ratio_cell(b.batch_span_ratio) if b else None,
        ),
        row(
            "batch-mates: meeting again / chance",
            ratio_cell(q.batch_mates_again),
            ratio_cell(b.batch_mates_again) if b else None,
        ),
        row("dropped samples", _fmt_dropped(q.dropped), _fmt_dropped(b.dropped) if b else None),
    ]
    header = ["figure", "ladle"] + (["random"] if baseline is not None else [])
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]
    lines = [
        "  ".join(
            h.ljust(w) if i == 0 else h.rjust(w) for i, (h, w) in enumerate(zip(header, widths, strict=True))
        )
    ]
    lines.append("  ".join("-" * w for w in widths))
    for r in rows:
        lines.append(
            "  ".join(
                c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths, strict=True))
            )
        )
    lines.append(textwrap.fill(batch_mates_note(q), width=100))
    return "\n".join(lines)


def _fmt_dropped(dropped: dict[str, int]) -> str:
    return ", ".join(f"{k} {v}" for k, v in dropped.items()) if dropped else "none"


def format_loss(ours: LossFigures, random: LossFigures) -> str:
    rows = [
        ["std of windowed loss", f"{ours.windowed_std:.4f}", f"{random.windowed_std:.4f}"],
        [
            "longest streak above mean",
            str(ours.longest_above_mean_streak),
            str(random.longest_above_mean_streak),
        ],
        ["windows (2 steps each)", str(ours.windows), str(random.windows)],
    ]
    return "simulated loss (bucket levels + noise, mean over ranks, windows of 2 steps)\n" + _table(
        ["figure", "ladle", "random"], rows
    )


if __name__ == "__main__":
    sys.exit(main())
