"""The embedded store beside other processes: a held write lock, a read-only mount.

Another process holding the file's write lock (an operator's ``sqlite3`` shell
in ``BEGIN IMMEDIATE``, a ``VACUUM``) must delay only writes, each by one busy
timeout at most, and a read-only store must read the file without the lock,
without writing a byte, on a read-only mount too.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from ladle.service.errors import StoreUnavailableError
from ladle.service.store import EmbeddedStore, JobSpec, Position
from tests.support.timing import timed

from .conftest import ServerProcess

SPEC = JobSpec("run-7", "dataset-aaaa", "config-bbbb", 4)

HOLD_LOCK = """
import sqlite3, sys
db = sqlite3.connect(sys.argv[1], isolation_level=None)
db.execute("BEGIN IMMEDIATE")
print("locked", flush=True)
sys.stdin.read()  # until the test closes our stdin
db.execute("ROLLBACK")
"""


@contextmanager
def write_lock_held_by_another_process(path: Path) -> Iterator[None]:
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD_LOCK, str(path)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout is not None
        assert holder.stdout.readline().strip() == "locked", "the lock holder did not start"
        yield
    finally:
        if holder.stdin is not None:
            holder.stdin.close()
        try:
            holder.wait(timeout=30)
        except subprocess.TimeoutExpired:
            holder.kill()
            holder.wait(timeout=30)


def list_read_only(path: Path) -> list[str]:
    """``ladle jobs``: a read-only store opened, listed and closed."""
    with EmbeddedStore(path, read_only=True) as store:
        return [job.job for job in store.list_jobs()]


def test_another_process_holding_the_write_lock_delays_only_writes(tmp_path: Path) -> None:
    busy, ranks = 1.0, 4
    path = tmp_path / "state.db"
    with EmbeddedStore(path, busy_timeout_s=busy) as store:
        store.open_job(SPEC)
        generations = [store.join(SPEC.job, rank, ranks).generation for rank in range(ranks)]
        results: list[tuple[float, BaseException | None]] = [(0.0, None)] * ranks

        def write(rank: int) -> None:
            results[rank] = timed(lambda: store.advance(SPEC.job, rank, generations[rank], Position(0, 1)))

        with write_lock_held_by_another_process(path):
            pool = [threading.Thread(target=write, args=(rank,)) for rank in range(ranks)]
            for thread in pool:
                thread.start()
            time.sleep(busy / 5)
            reads = [timed(lambda: store.get(SPEC.job)), timed(store.list_jobs)]
            reads.append(timed(lambda: list_read_only(path)))
            for thread in pool:
                thread.join(timeout=60)
        assert [error for _, error in reads] == [None] * 3, reads
        assert max(seconds for seconds, _ in reads) < busy / 2, f"reads waited for the stuck writes: {reads}"
        assert all(isinstance(error, StoreUnavailableError) for _, error in results), results
        waits = sorted(seconds for seconds, _ in results)
        assert waits[-1] < 2.5 * busy, f"the ranks' writes timed out one after another: {waits}"


def test_a_server_answers_reads_while_its_cursor_writes_wait_for_the_lock(
    server_factory: Callable[..., ServerProcess],
) -> None:
    """GET /v1/jobs/J/cursor took 38 s while the stream's writes queued behind another process's lock."""
    from ladle.client import BatchClient

    server = server_factory()
    with BatchClient(0, 1, server.address, "stuck", timeout=60) as client:
        batches = iter(client)
        for _ in range(5):
            next(batches)
        with write_lock_held_by_another_process(server.state):
            deadline = time.monotonic() + 1.0
            while time.monotonic() < deadline:  # acknowledged batches: a cursor write is now waiting
                next(batches)
                time.sleep(0.01)
            start = time.monotonic()
            with urllib.request.urlopen(f"{server.http_url}/v1/jobs/stuck/cursor", timeout=30) as response:
                assert response.status == 200
            seconds = time.monotonic() - start
        assert seconds < 3.0, f"a read waited {seconds:.1f} s behind a cursor write stuck on the lock"
    assert server.stop() == 0


# --- a read-only mount (as root: a tmpfs remounted read-only in a private mount namespace) ---

READ_ONLY_CASES = """
import json, os, sys
from ladle.service.store import EmbeddedStore
out = {}
for case in sorted(os.listdir(sys.argv[1])):
    folder = os.path.join(sys.argv[1], case)
    before = sorted(os.listdir(folder))
    try:
        with EmbeddedStore(os.path.join(folder, "state.db"), read_only=True) as store:
            store.ping()
            out[case] = sorted(j.job for j in store.list_jobs())
    except Exception as exc:
        out[case] = f"{type(exc).__name__}: {exc}"
    assert sorted(os.listdir(folder)) == before, f"{case}: files changed"
for case in ("clean", "live"):  # a writing store (ladle serve) refuses at once, WAL or none
    try:
        EmbeddedStore(os.path.join(sys.argv[1], case, "state.db"))
        out[f"write-{case}"] = "opened"
    except Exception as exc:
        out[f"write-{case}"] = type(exc).__name__
print(json.dumps(out))
"""


MAKE_CASES = """
import os, shutil, sys
from pathlib import Path
from ladle.service.store import EmbeddedStore, JobSpec
root = Path(sys.argv[1])
source = root / "source"
source.mkdir()
with EmbeddedStore(source / "state.db") as store:
    store.open_job(JobSpec(sys.argv[2], "dataset-aaaa", "config-bbbb", 4))
for case in ("clean", "empty-wal", "live", "no-shm"):  # a clean file, then beside a WAL
    (root / case).mkdir()
    shutil.copy(source / "state.db", root / case / "state.db")
(root / "empty-wal" / "state.db-wal").touch()
writer = EmbeddedStore(source / "state.db")
writer.open_job(JobSpec("in-the-wal", "d", "c", 1))  # in the WAL only while the writer is open
for case, suffixes in (("live", ("-wal", "-shm")), ("no-shm", ("-wal",))):
    for suffix in suffixes:
        shutil.copy(f"{source / 'state.db'}{suffix}", f"{root / case / 'state.db'}{suffix}")
writer.close()
shutil.rmtree(source)
"""


@pytest.mark.skipif(sys.platform != "linux" or os.geteuid() != 0, reason="mounts a tmpfs (root on Linux)")
def test_a_read_only_store_on_a_read_only_mount(tmp_path: Path) -> None:
    unshare = shutil.which("unshare")
    if unshare is None:
        pytest.skip("needs unshare(1)")
    mount = tmp_path / "ro"
    mount.mkdir()
    script = (
        'mount -t tmpfs tmpfs "$1" && "$2" -c "$3" "$1" "$5" && mount -o remount,ro "$1" && "$2" -c "$4" "$1"'
    )
    run = subprocess.run(
        [
            unshare,
            "-m",
            "sh",
            "-c",
            script,
            "sh",
            str(mount),
            sys.executable,
            MAKE_CASES,
            READ_ONLY_CASES,
            SPEC.job,
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    if run.returncode != 0 and "mount" in run.stderr and "Traceback" not in run.stderr:
        pytest.skip(f"cannot mount here: {run.stderr.strip()[-200:]}")
    assert run.returncode == 0, run.stderr
    got = json.loads(run.stdout.strip().splitlines()[-1])
    assert got["clean"] == [SPEC.job], "a clean file on a read-only mount could not be listed"
    assert got["empty-wal"] == [SPEC.job]
    assert got["live"] == ["in-the-wal", SPEC.job], "the WAL's writes were not read"
    assert got["no-shm"].startswith("StoreError: "), f"a WAL that cannot be read was not refused: {got}"
    assert "state.db-shm" in got["no-shm"], got["no-shm"]
    assert got["write-clean"] == "StoreUnavailableError"
    # with a crashed server's -wal and -shm, SQLite opened it read-only without a word: the server
    # said ready, then failed every trainer's first write
    assert got["write-live"] == "StoreUnavailableError", got
