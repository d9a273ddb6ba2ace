"""Options more than one command takes: the schedule's, the dataset's columns and the cursor store's."""

from __future__ import annotations

import argparse
import os
from typing import Any, Final, TypeAlias, get_args

from ..errors import ConfigError
from ..schedule import ScheduleConfig

# What ``add_parser`` adds its command's parser to.
Subparsers: TypeAlias = "argparse._SubParsersAction[argparse.ArgumentParser]"

# The Redis URL may carry a password: it is read from the environment rather
# than typed on a command line that `ps` shows, and never printed unredacted.
REDIS_URL_ENV = "LADLE_REDIS_URL"
REDIS_SCHEMES: Final = ("redis", "rediss", "unix")
DEFAULT_STATE = ".ladle/state.db"
# The client certificate's files, as BatchClient reads them (mutual TLS).
TLS_CERT_ENV: Final = "LADLE_TLS_CERT"
TLS_KEY_ENV: Final = "LADLE_TLS_KEY"


def add_config_options(parser: argparse.ArgumentParser) -> None:
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


def add_column_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--column",
        action="append",
        default=[],
        metavar="ROLE=NAME",
        help="serve another column in a role: input_ids=NAME (the token ids), loss_mask=NAME (weights) or "
        "labels=NAME (loss where not -100). Default: input_ids, and the mask from loss_mask, else labels, "
        "else loss on every token",
    )


def add_store_options(parser: argparse.ArgumentParser | argparse._MutuallyExclusiveGroup) -> None:
    parser.add_argument(
        "--redis-url",
        metavar="URL",
        help=f"keep cursors in Redis: redis://[:password@]host:port/db, rediss:// (TLS) or unix:// "
        f"(default: ${REDIS_URL_ENV}, else the embedded --state file)",
    )


def redis_url(args: argparse.Namespace) -> str | None:
    """``--redis-url``, else ``$LADLE_REDIS_URL`` unless ``--state`` was given; None: the embedded store.

    A flag wins over the environment, for ``serve`` as for ``jobs``.
    """
    if args.redis_url is not None:
        return _check_redis_url(str(args.redis_url), "--redis-url")
    if getattr(args, "state", None):
        return None
    url = os.environ.get(REDIS_URL_ENV)
    return None if url is None else _check_redis_url(url, f"${REDIS_URL_ENV}")


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
