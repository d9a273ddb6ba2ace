"""``ladle demo``: the whole system on this machine (the demo itself is ``ladle.service.demo``)."""

from __future__ import annotations

import argparse

from ..errors import ConfigError
from ._options import Subparsers, add_config_options, config_from_args


def add_parser(sub: Subparsers) -> argparse.ArgumentParser:
    demo = sub.add_parser("demo", help="run the whole system on this machine: server, trainers, checks")
    from ..demo import add_arguments

    add_arguments(demo)
    add_config_options(demo)
    return demo


def run(args: argparse.Namespace) -> int:
    from ..demo import run_demo

    if args.dataset_path is not None and args.text:
        raise ConfigError("dataset", "give DATASET or --text, not both")
    config = config_from_args(args)
    return run_demo(args.dataset_path, args.world_size, config, args.rows, args.keep, args.text, args.split)
