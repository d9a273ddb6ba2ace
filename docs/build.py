"""The references, made from the code: ``python docs/build.py [--check] [--out DIR]`` (``make docs``).

- ``docs/cli.md``: every ``ladle`` command's usage and options, from the
  argument parser itself. ``--check`` fails when the file on disk differs
  (regenerate it with ``python docs/build.py``), so a changed flag cannot
  leave the reference behind.
- The flags the README and docs cite: every ``--flag`` in a ``ladle COMMAND``
  line of a code block or code span must be one of that command's options,
  and the command must exist. A renamed or removed flag that a page still
  cites in a command fails the build.
- The API reference (HTML, with ``pdoc``) of the public modules, into
  ``DIR/api``, with Python warnings as errors: a docstring pdoc cannot
  render fails the build.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CLI_PAGE = ROOT / "docs" / "cli.md"
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# What the API reference covers: the trainer's classes, the schedule, the errors.
API_MODULES = [
    "ladle.client",
    "ladle.client.torch_data",
    "ladle.client.hf",
    "ladle.client.errors",
    "ladle.service.schedule",
    "ladle.service.errors",
]
_FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]*")


def commands() -> dict[str, argparse.ArgumentParser]:
    """``{"": the top parser, "serve": its parser, ...}``."""
    from ladle.service.cli import build_parser

    top = build_parser()
    found = {"": top}
    for action in top._actions:
        if isinstance(action, argparse._SubParsersAction):
            found.update(action.choices)
    return found


def options(parser: argparse.ArgumentParser) -> set[str]:
    return {flag for action in parser._actions for flag in action.option_strings}


def cli_page() -> str:
    """The markdown of ``docs/cli.md``."""
    parsers = commands()
    out = [
        "# The `ladle` command",
        "",
        "Generated from the argument parser by `python docs/build.py` (`make docs` checks it is current).",
        "",
    ]
    for name, parser in parsers.items():
        if not name:
            continue
        out += [f"## `ladle {name}`", "", "```", parser.format_help().rstrip(), "```", ""]
    return "\n".join(out)


def cited_flags(pages: list[Path] = PAGES) -> list[str]:
    """Every cited command or flag that the parser does not have, as ``page:line: what``."""
    parsers = commands()
    problems = []
    for page in pages:
        text = page.read_text(encoding="utf-8")
        for number, line in _command_lines(text):
            try:
                words = shlex.split(line, comments=True)
            except ValueError:
                words = line.split()
            if len(words) < 2 or words[0] != "ladle":
                continue
            parser = parsers.get(words[1])
            if parser is None:
                if not words[1].startswith("-"):
                    problems.append(f"{page.name}:{number}: no command `ladle {words[1]}`")
                continue
            known = options(parser)
            for word in words[2:]:
                flag = word.split("=", 1)[0]
                if _FLAG.fullmatch(flag) and flag not in known:
                    problems.append(f"{page.name}:{number}: `ladle {words[1]}` has no {flag}")
    return problems


def _command_lines(text: str) -> list[tuple[int, str]]:
    """``(line number, command)`` for each ``ladle ...`` in a code block (continuations joined) or span."""
    found = []
    block = False
    pending = ""
    for number, line in enumerate(text.splitlines(), 1):
        if line.lstrip().startswith("```"):
            block = not block
            pending = ""
            continue
        if block:
            joined = pending + line
            if joined.rstrip().endswith("\\"):
                pending = joined.rstrip()[:-1] + " "
                continue
            pending = ""
            for part in re.split(r"&&|\|\||;|\|", joined):
                part = part.strip().removeprefix("$ ").strip()
                part = re.sub(r"^(\S*/)?(\.venv/bin/)", "", part)
                if part.startswith("ladle "):
                    found.append((number, part))
        else:
            found += [(number, s) for n, s in _spans(line) if s.startswith("ladle ")]
    return found


def _spans(text: str) -> list[tuple[int, str]]:
    """``(line number, code)`` for each inline code span outside code blocks."""
    spans = []
    block = False
    for number, line in enumerate(text.splitlines(), 1):
        if line.lstrip().startswith("```"):
            block = not block
            continue
        if not block:
            spans += [(number, s) for s in re.findall(r"`([^`\n]+)`", line)]
    return spans


def api(out: Path) -> None:
    """The API reference of ``API_MODULES`` into ``out`` (pdoc; warnings are errors)."""
    subprocess.run(
        [sys.executable, "-W", "error", "-m", "pdoc", "--no-show-source", "-o", str(out), *API_MODULES],
        check=True,
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--check", action="store_true", help="fail if docs/cli.md is not current")
    parser.add_argument("--out", type=Path, help="also build the API reference into OUT/api")
    args = parser.parse_args(argv)
    os.environ["COLUMNS"] = "100"  # argparse wraps help at the terminal's width: the page must not vary
    page = cli_page()
    failed = False
    if args.check:
        if not CLI_PAGE.exists() or CLI_PAGE.read_text(encoding="utf-8") != page:
            print(f"{CLI_PAGE.relative_to(ROOT)} is not current: run python docs/build.py", file=sys.stderr)
            failed = True
    else:
        CLI_PAGE.write_text(page, encoding="utf-8")
    for problem in cited_flags():
        print(problem, file=sys.stderr)
        failed = True
    if args.out is not None:
        api(args.out / "api")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
