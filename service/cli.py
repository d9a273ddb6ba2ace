"""The ladle CLI: plan, serve, demo, jobs, inspect, health and make-dataset.

Every command takes the same schedule options, from flags or a TOML file
(``--config``; flags win). Errors a user can cause print one line and exit 2;
output cut short by a closed pipe (``ladle plan DS | head``) ends quietly.
Each command is a module of ``ladle.service.commands``; this one joins them
into one parser and runs the one asked for.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from typing import Protocol

from .commands import demo, health, inspect, jobs, make_dataset, plan, serve
from .commands._options import DEFAULT_STATE, REDIS_URL_ENV, Subparsers, config_from_args
from .commands._tables import format_bucket_rows, format_bucket_table, format_loss, format_quality
from .commands.health import SERVICE_HEALTH
from .commands.inspect import format_cursor, format_job_names
from .commands.jobs import format_jobs, job_summary
from .commands.serve import limits_from_args
from .errors import LadleError

__all__ = [
    "DEFAULT_STATE",
    "REDIS_URL_ENV",
    "SERVICE_HEALTH",
    "build_parser",
    "config_from_args",
    "format_bucket_rows",
    "format_bucket_table",
    "format_cursor",
    "format_job_names",
    "format_jobs",
    "format_loss",
    "format_quality",
    "job_summary",
    "limits_from_args",
    "main",
]


class Command(Protocol):
    """What each module of ``ladle.service.commands`` is."""

    def add_parser(self, sub: Subparsers) -> argparse.ArgumentParser: ...

    def run(self, args: argparse.Namespace) -> int: ...


# In the order `ladle --help` lists them.
COMMANDS: dict[str, Command] = {
    "plan": plan,
    "serve": serve,
    "demo": demo,
    "jobs": jobs,
    "inspect": inspect,
    "health": health,
    "make-dataset": make_dataset,
}


def _version() -> str:
    import ladle

    return ladle.__version__


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ladle", description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--version", action="version", version=f"ladle {_version()}")
    sub = parser.add_subparsers(dest="command", required=True)
    for command in COMMANDS.values():
        command.add_parser(sub)
    return parser


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
        return COMMANDS[args.command].run(args)
    except LadleError as exc:
        print(f"ladle: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
