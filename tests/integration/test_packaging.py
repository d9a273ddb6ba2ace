"""The wheel holds one top-level package, ``ladle``, with the three mapped folders."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_wheel_layout(tmp_path: Path) -> None:
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--quiet", "-w", str(tmp_path), str(ROOT)],
        check=True,
        timeout=600,
        capture_output=True,
    )
    (wheel,) = tmp_path.glob("ladle-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names if not n.split("/")[0].endswith((".dist-info", ".data"))}
    assert tops == {"ladle"}, f"the wheel installs top-level {sorted(tops)}"
    for module in (
        "ladle/service/schedule/schedule.py",
        "ladle/client/__init__.py",
        "ladle/proto/__init__.py",
    ):
        assert module in names, f"{module} missing from the wheel"
    entry = [n for n in names if n.endswith("entry_points.txt")]
    assert entry, "no console script"
    assert "ladle = ladle.service.cli:main" in zipfile.ZipFile(wheel).read(entry[0]).decode()
