"""The ``ladle`` command's entry point: the CLI, or which extra to install when the server's part is missing.

``pip install ladle`` installs the trainer's side only (``ladle.client``);
every ``ladle`` command needs the server's dependencies, ``ladle[server]``.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

# The top-level modules of the `server` extra (pyproject.toml), as Python imports them.
SERVER_MODULES = frozenset(
    {
        "pyarrow",
        "datasets",
        "pydantic",
        "grpc_health",
        "redis",
        "fastapi",
        "uvicorn",
        "prometheus_client",
        "tokenizers",
        "jinja2",
    }
)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI (``ladle.service.cli.main``); exit 2 with one line if ``ladle[server]`` is missing."""
    try:
        from .cli import main as run

        return run(argv)
    except ModuleNotFoundError as exc:
        if (exc.name or "").split(".")[0] not in SERVER_MODULES:
            raise
        print(
            f"ladle: error: the ladle command needs the server's dependencies ({exc.name} is not installed): "
            "pip install 'ladle[server]' (`pip install ladle` alone installs BatchClient for trainers)",
            file=sys.stderr,
        )
        return 2
