"""``ladle jobs``: list the jobs in a cursor store, or delete some."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Sequence
from typing import Any

from ..errors import JobNotFoundError, LadleError, StoreCorruptError, StoreUnavailableError
from ._options import DEFAULT_STATE, Subparsers, add_store_options, redis_url

# `ladle jobs --delete` refuses a job with a rank seen this recently: its trainers are
# probably still streaming, and the server they stream from would re-create the job.
LIVE_WINDOW_S = 300.0


def add_parser(sub: Subparsers) -> argparse.ArgumentParser:
    jobs = sub.add_parser("jobs", help="list the jobs in a cursor store, or delete some")
    where = jobs.add_mutually_exclusive_group()
    where.add_argument("--state", help=f"the embedded cursor store file (default: {DEFAULT_STATE})")
    add_store_options(where)
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
    return jobs


def run(args: argparse.Namespace) -> int:
    from ..store import DEFAULT_JOB_TTL_S, open_store
    from ..store.base import CursorStore

    url = redis_url(args)
    state = args.state or DEFAULT_STATE
    if url is None and not os.path.exists(state):
        raise StoreUnavailableError(f"no cursor store at {state} (give --state FILE or --redis-url URL)")
    if not args.delete:
        # a listing is a read: a read-only copy of the file, a file beside a busy writer, an older
        # ladle's file as it is; a Redis replica, without the server's start-up checks and warnings
        # (they would repeat on every listing)
        if url is None:
            from ..store.embedded import EmbeddedStore

            opened: CursorStore = EmbeddedStore(state, read_only=True)
        else:
            from ..store.redis import RedisCursorStore  # redis is imported only for a Redis URL

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
