"""Run a command that starts processes of its own (servers, trainers) and leave none behind.

The command runs in a new session; if it outlives ``timeout`` or the test is
interrupted, the whole process group is killed, so its children die with it.
"""

from __future__ import annotations

import os
import signal
import subprocess
from collections.abc import Sequence

__all__ = ["run_in_session"]


def run_in_session(cmd: Sequence[str], timeout: float) -> tuple[int, str]:
    """``(exit code, stdout and stderr together)``; the group is killed if anything goes wrong."""
    proc = subprocess.Popen(
        list(cmd), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    try:
        output, _ = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
    return int(proc.returncode), output
