"""The wheel holds one top-level package, ``ladle``, with the three mapped folders."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path
from typing import Any

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
    assert "ladle = ladle.service.entry:main" in zipfile.ZipFile(wheel).read(entry[0]).decode()


READ_EPOCH = """
import sys
from ladle.client import BatchClient

seen = []
with BatchClient(0, 1, sys.argv[1], sys.argv[2], timeout=60) as client:
    for batch in client:
        seen += batch.sample_ids.tolist()
print(" ".join(map(str, sorted(seen))))
"""
SERVER_ONLY = (
    "datasets",
    "pyarrow",
    "fastapi",
    "uvicorn",
    "redis",
    "tokenizers",
    "prometheus_client",
)


def test_the_client_installs_alone_and_reads_an_epoch(tmp_path: Path, server_factory: Any) -> None:
    """`pip install ladle` is the trainer's side (numpy, grpcio, protobuf, pydantic), not the server."""
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--quiet", "-w", str(tmp_path), str(ROOT)],
        check=True,
        timeout=600,
        capture_output=True,
    )
    (wheel,) = tmp_path.glob("ladle-*.whl")
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    python = str(venv / "bin" / "python")
    installed = subprocess.run(
        [python, "-m", "pip", "install", "--quiet", str(wheel)], capture_output=True, text=True, timeout=600
    )
    assert installed.returncode == 0, installed.stderr[-3000:]
    listed = subprocess.run([python, "-m", "pip", "list"], capture_output=True, text=True, check=True).stdout
    names = {line.split()[0].lower().replace("-", "_") for line in listed.splitlines()[2:]}
    assert not names & set(SERVER_ONLY), f"the client pulled in {sorted(names & set(SERVER_ONLY))}"
    server = server_factory()
    fresh = subprocess.run(
        [python, "-c", READ_EPOCH, server.address, "fresh"], capture_output=True, text=True, timeout=300
    )
    assert fresh.returncode == 0, fresh.stderr[-3000:]
    full = subprocess.run(
        [sys.executable, "-c", READ_EPOCH, server.address, "full"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert full.returncode == 0, full.stderr[-3000:]
    assert fresh.stdout.split() == full.stdout.split() != []
    sampled = subprocess.run(  # the schedule in-process, with no server and no torch
        [python, "-c", "import ladle; print(len(list(ladle.ScheduleSampler([3, 50, 7] * 400))))"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert sampled.returncode == 0, sampled.stderr[-3000:]
    assert int(sampled.stdout) > 0
    cli = subprocess.run(
        [str(venv / "bin" / "ladle"), "serve", "x"], capture_output=True, text=True, timeout=60
    )
    assert cli.returncode == 2, cli.stderr[-3000:]
    assert "pip install 'ladle[server]'" in cli.stderr, cli.stderr[-3000:]
