"""The layers point one way: the schedule imports no network, store or web code."""

from __future__ import annotations

import json
import subprocess
import sys

FORBIDDEN = ("grpc", "redis", "fastapi", "uvicorn", "starlette", "torch", "datasets", "pyarrow")


def imported_after(statement: str) -> set[str]:
    code = f"import sys, json; {statement}; print(json.dumps(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    return {name.split(".")[0] for name in json.loads(out.stdout)}


def test_schedule_is_pure() -> None:
    loaded = imported_after("import ladle.service.schedule, ladle.service.schedule.stats")
    leaked = sorted(loaded & set(FORBIDDEN))
    assert not leaked, f"the schedule imports {leaked}"


def test_client_does_not_import_the_service() -> None:
    code = "import sys, json, ladle.client; print(json.dumps(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    assert not [m for m in json.loads(out.stdout) if m.startswith("ladle.service")], (
        "client imports the service"
    )


def test_the_command_line_starts_without_the_dataset_layer() -> None:
    """`datasets` (with pandas) costs a second of start-up: an exec probe (`ladle health`) runs often."""
    loaded = imported_after("from ladle.service.cli import build_parser; build_parser()")
    assert not loaded & {"datasets", "pandas", "pyarrow", "torch"}, sorted(loaded)
