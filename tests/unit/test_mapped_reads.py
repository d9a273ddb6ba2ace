"""A data file cut shorter while a batch is copied out of its mapping: an error, not a dead server.

The server stats every data file before each batch (``DatasetChangedError``),
but a cut that lands between that check and the copy makes the copy read
past the file's new end: a SIGBUS, which kills a process by default. The
compiled frame guards its reads of the mapping and turns that fault into an
error. Each case runs in a child process, so the old behaviour (the child
dies of SIGBUS) fails the test instead of killing pytest; ``-X faulthandler``
is on in the children, as under pytest, so the guard must coexist with it.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from ladle.service import assemble
from ladle.service.synth import make_dataset

pytestmark = pytest.mark.skipif(assemble._frame_c is None, reason="the compiled frame is not built")

# The race, made certain: the check before a batch passes (as it would just before the cut),
# then the largest data file loses two thirds of its bytes, then the rows at its end are copied.
RACE = """
import os, sys, threading
from pathlib import Path
import numpy as np
from ladle.service import assemble
from ladle.service.assemble import Assembler
from ladle.service.dataset import open_dataset
from ladle.service.errors import DatasetChangedError

folder, path, on_thread, checks_after = sys.argv[1], sys.argv[2], sys.argv[3] == "thread", int(sys.argv[4])
if path == "plan+frame":
    assemble._build = None  # the two-call path: _frame.plan, then _frame.frame
ds = open_dataset(folder)
asm = Assembler(ds)
rows = np.arange(ds.num_rows - 30, ds.num_rows, dtype=np.int64)  # the last rows: in the part cut off
fields = dict(epoch=0, rank=0, bucket=0, schedule_fingerprint="f")
asm.frame(rows, 8192, step=0, **fields)  # reads the pages once, while they are there

real_check, calls = type(ds).check_files, [0]
def late_check(*rows):  # the check that comes before the cut passes; the later ones are real
    calls[0] += 1
    if calls[0] > checks_after:
        real_check(ds, *rows)
object.__setattr__(ds, "check_files", late_check)
victim = max(Path(folder).glob("*.arrow"), key=lambda p: p.stat().st_size)
os.truncate(victim, victim.stat().st_size // 3)

outcomes = []
def serve_two():
    for step in (1, 2):  # twice: the guard is still there after the first fault
        try:
            asm.frame(rows, 8192, step=step, **fields)
            outcomes.append("served")
        except DatasetChangedError as exc:
            outcomes.append(exc.detail)
if on_thread:  # as the server does: frames are made on its event loop's thread
    worker = threading.Thread(target=serve_two)
    worker.start()
    worker.join()
else:
    serve_two()
print("|".join(outcomes))
"""


def _run(code: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-X", "faulthandler", "-c", code, *args],
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("mapped") / "ds"
    make_dataset(out, 3000, seed=5, scale=0.3)
    return out


def _copy(folder: Path, tmp_path: Path) -> Path:
    import shutil

    return Path(shutil.copytree(folder, tmp_path / "served"))


def _died(result: subprocess.CompletedProcess[str]) -> str:
    if result.returncode < 0:
        return f"the child died of {signal.Signals(-result.returncode).name}: {result.stderr[-1500:]}"
    return f"the child exited {result.returncode}: {result.stderr[-1500:]}"


@pytest.mark.parametrize("where", ["main", "thread"])
@pytest.mark.parametrize("path", ["build", "plan+frame"])
def test_a_file_cut_between_the_check_and_the_copy_is_a_dataset_changed_error(
    folder: Path, tmp_path: Path, path: str, where: str
) -> None:
    served = _copy(folder, tmp_path)
    result = _run(RACE, str(served), path, where, "1")
    assert result.returncode == 0, _died(result)
    first, second = result.stdout.strip().split("|")
    # the check after the fault sees the cut and names it; the next batch's check refuses it up front
    assert first.startswith("it was truncated from"), result.stdout
    assert second.startswith("it was truncated from"), result.stdout
    assert "Fatal Python error" not in result.stderr, result.stderr  # faulthandler never saw it


def test_a_fault_the_check_cannot_explain_is_still_an_error(folder: Path, tmp_path: Path) -> None:
    """Every check passes (a cut the stat misses): each faulting batch is refused, and the guard stays."""
    served = _copy(folder, tmp_path)
    result = _run(RACE, str(served), "build", "thread", "1000")
    assert result.returncode == 0, _died(result)
    assert result.stdout.strip().split("|") == ["a page of its memory mapping could not be read (SIGBUS)"] * 2


# Outside a guarded read a SIGBUS does what it did before the guard was installed.
OUTSIDE = """
import mmap, os, signal, sys
import numpy as np
from ladle.service.assemble import Assembler
from ladle.service.dataset import open_dataset

folder, how = sys.argv[1], sys.argv[2]
ds = open_dataset(folder)
Assembler(ds).frame(np.arange(4, dtype=np.int64), 8192, epoch=0, step=0, rank=0, bucket=0,
                    schedule_fingerprint="f")  # the guard is installed by now
print("guarded", flush=True)
if how == "kill":
    os.kill(os.getpid(), signal.SIGBUS)
else:  # a fault in code of its own (numpy) over a mapping whose file was cut
    path = os.path.join(folder, "own.bin")
    with open(path, "wb") as f:
        f.write(b"x" * (1 << 20))
    with open(path, "r+b") as f:
        view = np.frombuffer(mmap.mmap(f.fileno(), 0), dtype=np.uint8)
        os.truncate(path, 4096)
        print(int(view[-1]), flush=True)
print("survived", flush=True)
"""


@pytest.mark.parametrize("how", ["kill", "fault"])
def test_a_sigbus_anywhere_else_still_ends_the_process(folder: Path, tmp_path: Path, how: str) -> None:
    served = _copy(folder, tmp_path)
    result = _run(OUTSIDE, str(served), how)
    assert result.stdout.splitlines()[:1] == ["guarded"], result.stderr[-1500:]
    assert "survived" not in result.stdout
    assert result.returncode == -signal.SIGBUS, _died(result)
    assert "Fatal Python error: Bus error" in result.stderr  # the handler from before (faulthandler) ran


def test_the_guard_leaves_sigbus_alone_until_a_frame_is_made() -> None:
    """Importing the assembler changes no signal's disposition: only serving a frame installs the guard."""
    code = textwrap.dedent(
        """
        import signal
        before = signal.getsignal(signal.SIGBUS)
        import ladle.service.assemble
        print(before == signal.getsignal(signal.SIGBUS) == signal.SIG_DFL)
        """
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.stdout.strip() == "True", result.stderr
