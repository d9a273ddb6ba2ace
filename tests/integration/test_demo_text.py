"""``ladle demo --text``: real files tokenized, served and read by trainer processes, exactly once."""

from __future__ import annotations

import sys
import sysconfig
from pathlib import Path

from tests.support.session import run_in_session

STDLIB = Path(sysconfig.get_paths()["stdlib"])


def test_demo_on_real_text() -> None:
    cmd = [
        str(Path(sys.executable).with_name("ladle")), "demo", "--text", str(STDLIB / "json"),
        "--world-size", "2", "--token-budget", "4096", "--max-seq-len", "1024",
    ]  # fmt: skip
    code, output = run_in_session(cmd, timeout=180)
    assert code == 0, output[-3000:]
    assert "split into functions, BPE trained here" in output
    assert "exactly once          OK" in output
