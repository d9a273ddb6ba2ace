"""docs/build.py: the CLI reference is current, and no page cites a flag a command does not have."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def build() -> ModuleType:
    spec = importlib.util.spec_from_file_location("docs_build", ROOT / "docs" / "build.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_cli_reference_is_current(build: ModuleType, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "100")
    assert (ROOT / "docs" / "cli.md").read_text(encoding="utf-8") == build.cli_page(), (
        "docs/cli.md is stale: run python docs/build.py"
    )


def test_the_pages_cite_only_flags_that_exist(build: ModuleType) -> None:
    assert build.cited_flags() == []


def test_a_renamed_flag_or_command_is_caught(build: ModuleType, tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text(
        "Serve it:\n\n```bash\nladle serve data/x --grpc-prot 1 \\\n    --column input_ids=tokens\n"
        ".venv/bin/ladle plan data/x --world-size 8 && ladle plan data/x --no-such\n```\n\n"
        "Or `ladle sreve data/x`, or `ladle make-dataset OUT --from-jsonl a.jsonl --text-column text`.\n",
        encoding="utf-8",
    )
    assert build.cited_flags([page]) == [
        "page.md:5: `ladle serve` has no --grpc-prot",  # where its continued line ends
        "page.md:6: `ladle plan` has no --no-such",
        "page.md:9: no command `ladle sreve`",
    ]
