"""Regenerate the protocol modules from ``ladle.proto``, or check they are current.

``python -m ladle.proto.generate`` writes ``ladle_pb2.py``, ``ladle_pb2.pyi``
and ``ladle_pb2_grpc.py`` next to ``ladle.proto``; ``--check`` writes nothing,
compares a fresh generation byte for byte with the committed files and exits
1 with a summary of the differences. protoc runs from the repository root on
the path ``ladle/proto/ladle.proto`` (through the ``ladle/proto`` link), so
the generated imports are package-absolute (``from ladle.proto import
ladle_pb2``). The output depends on the grpcio-tools version, which the dev
extra pins.
"""

from __future__ import annotations

import argparse
import difflib
import subprocess
import sys
import tempfile
from importlib import metadata
from pathlib import Path

__all__ = ["GENERATED", "PROTO", "generate", "main", "repo_root"]

PROTO = "ladle/proto/ladle.proto"
GENERATED = ("ladle_pb2.py", "ladle_pb2.pyi", "ladle_pb2_grpc.py")


def repo_root() -> Path:
    """The folder holding the ``ladle`` package root (``ladle/__init__.py``), not the link's target."""
    import ladle

    return Path(ladle.__file__).resolve().parent.parent


def generate(out: Path, root: Path | None = None) -> dict[str, bytes]:
    """Run protoc into ``out`` and return the generated files' bytes by name."""
    root = repo_root() if root is None else root
    command = [
        sys.executable,
        "-m",
        "grpc_tools.protoc",
        "-I.",
        f"--python_out={out}",
        f"--pyi_out={out}",
        f"--grpc_python_out={out}",
        PROTO,
    ]
    done = subprocess.run(command, cwd=root, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"protoc failed ({done.returncode}):\n{done.stderr.strip()}")
    where = out / Path(PROTO).parent
    return {name: (where / name).read_bytes() for name in GENERATED}


def _tools_version() -> str:
    try:
        return metadata.version("grpcio-tools")
    except metadata.PackageNotFoundError:
        return "not installed"


def _summary(name: str, old: bytes, new: bytes) -> str:
    diff = list(
        difflib.unified_diff(
            old.decode(errors="replace").splitlines(),
            new.decode(errors="replace").splitlines(),
            f"committed/{name}",
            f"generated/{name}",
            lineterm="",
            n=1,
        )
    )
    shown = "\n".join(line[:160] for line in diff[:24])
    more = f"\n... {len(diff) - 24} more diff lines" if len(diff) > 24 else ""
    return f"{name}: differs ({len(old)} bytes committed, {len(new)} generated)\n{shown}{more}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ladle.proto.generate", description=__doc__)
    parser.add_argument("--check", action="store_true", help="compare, write nothing; exit 1 on difference")
    args = parser.parse_args(argv)
    root = repo_root()
    target = root / Path(PROTO).parent
    if _tools_version() == "not installed":
        print("grpcio-tools is not installed: pip install -e '.[dev]'", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="ladle-protoc-") as tmp:
        try:
            fresh = generate(Path(tmp), root)
        except RuntimeError as exc:
            print(exc, file=sys.stderr)
            return 2
    if not args.check:
        for name, data in fresh.items():
            (target / name).write_bytes(data)
        print(f"wrote {', '.join(GENERATED)} in {target} (grpcio-tools {_tools_version()})")
        return 0
    problems = []
    for name, data in fresh.items():
        path = target / name
        if not path.exists():
            problems.append(f"{name}: missing (run python -m ladle.proto.generate)")
        elif (old := path.read_bytes()) != data:
            problems.append(_summary(name, old, data))
    if problems:
        print(
            f"generated protocol modules are stale or edited (grpcio-tools {_tools_version()}); "
            "run python -m ladle.proto.generate\n" + "\n".join(problems),
            file=sys.stderr,
        )
        return 1
    print(f"{', '.join(GENERATED)} match {PROTO}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
