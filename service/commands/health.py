"""``ladle health``: ask a server's gRPC health service, as an exec probe does."""

from __future__ import annotations

import argparse
import math
import sys
from typing import Final

from ..errors import ConfigError
from ._options import TLS_CERT_ENV, TLS_KEY_ENV, Subparsers

# The gRPC health service's name for "ready to serve trainers" (ladle.proto.rpc.SERVICE).
SERVICE_HEALTH: Final = "ladle.v1.BatchService"

# BatchClient's TLS arguments, as `ladle health` names them (a flag, or the variable it defaults to)
_TLS_FLAGS: Final = {
    "root_certificates": "--tls-ca ($LADLE_TLS_CA)",
    "client_certificate": f"--tls-cert (${TLS_CERT_ENV})",
    "client_key": f"--tls-key (${TLS_KEY_ENV})",
}


def add_parser(sub: Subparsers) -> argparse.ArgumentParser:
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
    return health


def run(args: argparse.Namespace) -> int:
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
