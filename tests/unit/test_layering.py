"""The gRPC face converts messages and statuses: it and its parts import nothing from the cursor store."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import ladle.service

SERVICE = Path(ladle.service.__file__).parent
FACE = ("grpc_server.py", "admission.py", "flow.py", "late_writes.py")


def imported(path: Path) -> set[str]:
    """Every module ``path`` imports, as absolute names (relative imports resolved)."""
    package = "ladle.service"
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{parent}.{base}" if base else parent
            names.add(base)
            names.update(f"{base}.{alias.name}" for alias in node.names)
    return names


@pytest.mark.parametrize("name", FACE)
def test_the_grpc_face_imports_nothing_from_the_store(name: str) -> None:
    leaked = sorted(n for n in imported(SERVICE / name) if n.startswith("ladle.service.store"))
    assert not leaked, f"service/{name} imports the cursor store: {leaked}"


def test_the_check_sees_a_store_import() -> None:
    assert "ladle.service.store.base" in imported(SERVICE / "jobs.py")
