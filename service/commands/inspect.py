"""``ladle inspect``: a running server's tables for one job, read from its HTTP API."""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Sequence
from typing import Any, Final

from ..schedule.stats import BucketRow, LossFigures, Quality
from ._options import TLS_CERT_ENV, TLS_KEY_ENV, Subparsers
from ._tables import format_bucket_rows, format_loss, format_quality, table

# `ladle inspect` names this many of a store's jobs, the most recently updated first.
SHOWN_JOBS: Final = 5


def add_parser(sub: Subparsers) -> argparse.ArgumentParser:
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
    return inspect


def _non_negative(text: str) -> int:
    """An argparse type: an integer >= 0 (a bad one is argparse's usage error, exit 2)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def run(args: argparse.Namespace) -> int:
    from ..inspect_client import DEFAULT_SERVER, fetch_report
    from ..security import load_tokens

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
    return f"ranks (leader at {lead['epoch']}:{lead['step']})\n" + table(
        ["rank", "epoch:step", "progress", "lag (steps)", "last seen", "generation"], rows
    )


def _seen(rank: dict[str, Any]) -> str:
    ago = rank.get("seen_ago_s")
    return "never" if ago is None or rank.get("last_seen", ago) is None else f"{ago:.0f}s ago"
