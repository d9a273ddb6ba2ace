"""Running a command whose standard output is a pipe nobody reads (``ladle ... | head`` after head left)."""

from __future__ import annotations

import os
import subprocess


def into_closed_pipe(cmd: list[str]) -> subprocess.CompletedProcess[str]:
    """Run ``cmd`` with its stdout a pipe whose reader has already gone; stderr is captured."""
    read, write = os.pipe()
    os.close(read)
    try:
        return subprocess.run(cmd, stdout=write, stderr=subprocess.PIPE, text=True, timeout=120)
    finally:
        os.close(write)
