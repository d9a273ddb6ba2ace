"""The embedded (SQLite) cursor store: the whole store contract, plus what only a file can show.

The contract suite lives in ``tests/contract/store_contract.py`` so that every
store (this one, Redis) runs the same tests. ``tests/`` is not a package and
pytest imports test files by path (``--import-mode=importlib``), so the
repository root is put on ``sys.path`` here and the suite imported by its
full name, ``tests.contract.store_contract`` (a namespace package): the name
mypy (with ``explicit_package_bases``) also gives it, and one that processes
spawned by the suite can import again.
"""

from __future__ import annotations

import functools
import json
import logging
import multiprocessing
import os
import pickle
import sqlite3
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from ladle.service.errors import (  # noqa: E402
    CursorRegressionError,
    FencedError,
    JobMismatchError,
    JobNotFoundError,
    StoreError,
    StoreUnavailableError,
    WorldSizeMismatchError,
)
from ladle.service.store import Clock, CursorStore, EmbeddedStore, JobSpec, Position  # noqa: E402
from ladle.service.store.embedded import POOL_IDLE, SCHEMA_VERSION  # noqa: E402
from tests.contract.store_contract import SPEC, MakeStore, ManualClock, StoreContract, StoreFactory  # noqa: E402
from tests.support.timing import timed  # noqa: E402

DB = "cursors.db"


class TestEmbeddedStore(StoreContract):
    @pytest.fixture
    def make_store(self, tmp_path: Path) -> Iterator[MakeStore]:
        made: list[EmbeddedStore] = []

        def make(clock: Clock) -> CursorStore:
            made.append(EmbeddedStore(tmp_path / DB, clock=clock))
            return made[-1]

        yield make
        for store in made:
            store.close()

    @pytest.fixture
    def process_factory(self, tmp_path: Path) -> StoreFactory:
        return functools.partial(EmbeddedStore, tmp_path / DB)


# --- what only the file store shows ------------------------------------------

READ_BACK = """
import json, sys
from ladle.service.store import EmbeddedStore, Position
with EmbeddedStore(sys.argv[1]) as store:
    state = store.get("run-42")
    json.dump([[r.position.epoch, r.position.step, r.generation] for r in state.ranks], sys.stdout)
"""

WRITE_AND_DIE = """
import os, sys
from ladle.service.store import EmbeddedStore, Position
store = EmbeddedStore(sys.argv[1])
generation = store.join("run-42", 3, 4).generation
store.advance("run-42", 3, generation, Position(5, 6))
os._exit(0)  # no close, no cleanup: a crashed trainer host process
"""


def run_python(code: str, path: Path) -> str:
    out = subprocess.run(
        [sys.executable, "-c", code, str(path)], capture_output=True, text=True, timeout=60, check=True
    )
    return out.stdout


def test_a_new_process_sees_the_state(tmp_path: Path) -> None:
    with EmbeddedStore(tmp_path / DB) as store:
        store.open_job(SPEC)
        generation = store.join(SPEC.job, 1, 4).generation
        store.advance(SPEC.job, 1, generation, Position(2, 9))
    assert json.loads(run_python(READ_BACK, tmp_path / DB)) == [[0, 0, 0], [2, 9, 1], [0, 0, 0], [0, 0, 0]]


def test_a_killed_writer_loses_nothing_it_committed(tmp_path: Path) -> None:
    with EmbeddedStore(tmp_path / DB) as store:
        store.open_job(SPEC)
        run_python(WRITE_AND_DIE, tmp_path / DB)
        assert store.get(SPEC.job).ranks[3].position == Position(5, 6)


def test_the_file_is_in_wal_mode_with_the_schema_version(tmp_path: Path) -> None:
    with EmbeddedStore(tmp_path / DB):
        db = sqlite3.connect(tmp_path / DB)
        try:
            assert db.execute("PRAGMA journal_mode").fetchone() == ("wal",)
            assert db.execute("PRAGMA user_version").fetchone() == (SCHEMA_VERSION,)
            tables = {r[0] for r in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
            assert tables == {"jobs", "ranks"}
        finally:
            db.close()


def test_a_newer_schema_is_refused(tmp_path: Path) -> None:
    EmbeddedStore(tmp_path / DB).close()
    db = sqlite3.connect(tmp_path / DB)
    db.execute(f"PRAGMA user_version = {SCHEMA_VERSION + 1}")
    db.close()
    with pytest.raises(StoreError, match="newer"):
        EmbeddedStore(tmp_path / DB)


def test_another_programs_database_is_refused(tmp_path: Path) -> None:
    db = sqlite3.connect(tmp_path / DB)
    db.execute("CREATE TABLE notes (text TEXT)")
    db.close()
    with pytest.raises(StoreError, match="not a ladle cursor store"):
        EmbeddedStore(tmp_path / DB)


def test_unusable_paths_are_refused(tmp_path: Path) -> None:
    (tmp_path / "junk.db").write_bytes(b"this is not a database at all" * 100)
    with pytest.raises(StoreUnavailableError):
        EmbeddedStore(tmp_path / "junk.db")
    with pytest.raises(StoreUnavailableError):
        EmbeddedStore(tmp_path / "no-such-dir" / DB)
    with pytest.raises(StoreError, match="needs a file"):
        EmbeddedStore(":memory:")


def test_ping_notices_a_removed_file(tmp_path: Path) -> None:
    with EmbeddedStore(tmp_path / DB) as store:
        store.ping()
        os.remove(tmp_path / DB)
        with pytest.raises(StoreUnavailableError, match="was removed"):
            store.ping()


def test_a_lock_held_too_long_is_unavailable_and_changes_nothing(tmp_path: Path) -> None:
    with EmbeddedStore(tmp_path / DB, busy_timeout_s=0.05) as store:
        store.open_job(SPEC)
        generation = store.join(SPEC.job, 0, 4).generation
        blocker = sqlite3.connect(tmp_path / DB, isolation_level=None)
        blocker.execute("BEGIN IMMEDIATE")
        try:
            with pytest.raises(StoreUnavailableError, match="locked") as info:
                store.advance(SPEC.job, 0, generation, Position(0, 1))
            assert info.value.kind == "unavailable"
            assert store.get(SPEC.job).ranks[0].position == Position(0, 0), "reads must not wait on writers"
        finally:
            blocker.execute("ROLLBACK")
            blocker.close()
        assert store.advance(SPEC.job, 0, generation, Position(0, 1)).position == Position(0, 1)


def _advance_in_child(store: EmbeddedStore, generation: int) -> None:
    store.advance(SPEC.job, 2, generation, Position(0, 4))


@pytest.mark.skipif(sys.platform != "linux", reason="fork start method")
def test_a_forked_child_reconnects(tmp_path: Path) -> None:
    with EmbeddedStore(tmp_path / DB) as store:
        store.open_job(SPEC)
        generation = store.join(SPEC.job, 2, 4).generation
        child = multiprocessing.get_context("fork").Process(
            target=_advance_in_child, args=(store, generation)
        )
        child.start()
        child.join(timeout=60)
        assert child.exitcode == 0
        assert store.get(SPEC.job).ranks[2].position == Position(0, 4)


def test_store_errors_survive_pickling() -> None:
    errors = [
        JobNotFoundError("j"),
        JobMismatchError("j", (("dataset_fingerprint", "a", "b"),)),
        WorldSizeMismatchError("j", 8, 4),
        FencedError("j", 1, 2, 3),
        CursorRegressionError("j", 1, (2, 3), (1, 0)),
        StoreUnavailableError("down"),
    ]
    for error in errors:
        back = pickle.loads(pickle.dumps(error))
        assert type(back) is type(error)
        assert str(back) == str(error)
        assert vars(back) == vars(error)


def test_job_spec_round_trip_of_the_pickle() -> None:
    spec = JobSpec("run-42", "d", "c", 8)
    assert pickle.loads(pickle.dumps(spec)) == spec
    assert pickle.loads(pickle.dumps(Position(1, 2))) == Position(1, 2)


# --- the job time-to-live (--job-ttl, as the Redis store's key TTL) -----------


def _ttl_store(tmp_path: Path, clock: ManualClock, ttl: float) -> EmbeddedStore:
    return EmbeddedStore(tmp_path / DB, clock=clock, job_ttl_s=ttl)


def test_a_job_nobody_writes_to_expires_and_every_write_refreshes_it(tmp_path: Path) -> None:
    clock = ManualClock()
    with _ttl_store(tmp_path, clock, 100) as store:
        store.open_job(SPEC)
        clock.tick(99)
        generation = store.join(SPEC.job, 0, 4).generation  # refreshed: 100 s from now
        clock.tick(99)
        store.advance(SPEC.job, 0, generation, Position(0, 3))  # refreshed again
        clock.tick(99)
        assert store.get(SPEC.job).ranks[0].position == Position(0, 3), "a touched job expired"
        assert [j.job for j in store.list_jobs()] == [SPEC.job]
        clock.tick(1)  # 100 s after the last write
        with pytest.raises(JobNotFoundError):
            store.get(SPEC.job)
        assert store.list_jobs() == [], "an expired job is still listed"
        with pytest.raises(JobNotFoundError):
            store.advance(SPEC.job, 0, generation, Position(0, 4))
        with pytest.raises(JobNotFoundError):
            store.join(SPEC.job, 0, 4)
        fresh = store.open_job(SPEC)  # a new job of the same name: every rank at the start
        assert {r.position for r in fresh.ranks} == {Position(0, 0)}
        assert {r.generation for r in fresh.ranks} == {0}


def test_a_refused_write_does_not_refresh_the_ttl(tmp_path: Path) -> None:
    clock = ManualClock()
    with _ttl_store(tmp_path, clock, 100) as store:
        store.open_job(SPEC)
        generation = store.join(SPEC.job, 1, 4).generation
        store.join(SPEC.job, 1, 4)  # a newer process holds rank 1
        clock.tick(60)
        with pytest.raises(FencedError):
            store.advance(SPEC.job, 1, generation, Position(0, 9))
        clock.tick(40)
        with pytest.raises(JobNotFoundError):
            store.get(SPEC.job)


def test_the_expiry_is_stored_so_every_reader_agrees(tmp_path: Path) -> None:
    """``ladle jobs`` (another TTL, or none) sees the expiry the server's writes set, as with Redis."""
    clock = ManualClock()
    with _ttl_store(tmp_path, clock, 100) as server, _ttl_store(tmp_path, clock, 0) as reader:
        server.open_job(SPEC)
        keep = JobSpec("forever", SPEC.dataset_fingerprint, SPEC.config_fingerprint, 2)
        reader.open_job(keep)  # written with no TTL: kept whatever the server's is
        clock.tick(100)
        assert [j.job for j in reader.list_jobs()] == ["forever"]
        assert [j.job for j in server.list_jobs()] == ["forever"]
        clock.tick(10**9)
        assert reader.get("forever").spec == keep


def test_expired_rows_are_deleted_not_only_hidden(tmp_path: Path) -> None:
    clock = ManualClock()
    with _ttl_store(tmp_path, clock, 10) as store:
        for name in ("old-a", "old-b"):
            store.open_job(JobSpec(name, SPEC.dataset_fingerprint, SPEC.config_fingerprint, 3))
        clock.tick(10)
        store.open_job(SPEC)  # any open_job sweeps
        assert store.delete_job("old-a") is False, "an expired job could still be deleted"
        db = sqlite3.connect(tmp_path / DB)
        try:
            assert db.execute("SELECT job FROM jobs").fetchall() == [(SPEC.job,)]
            assert db.execute("SELECT DISTINCT job FROM ranks").fetchall() == [(SPEC.job,)]
        finally:
            db.close()


def test_a_bad_ttl_is_a_config_error(tmp_path: Path) -> None:
    from ladle.service.errors import ConfigError

    for bad in (-1, float("nan"), float("inf"), True, "7d"):
        with pytest.raises(ConfigError, match="job_ttl_s"):
            EmbeddedStore(tmp_path / DB, job_ttl_s=bad)  # type: ignore[arg-type]


# --- files of older schemas ---------------------------------------------------

_OLD_JOBS = (
    "CREATE TABLE jobs (job TEXT PRIMARY KEY, dataset_fingerprint TEXT NOT NULL, "
    "config_fingerprint TEXT NOT NULL, world_size INTEGER NOT NULL CHECK (world_size >= 1), "
    "created REAL NOT NULL, updated REAL NOT NULL{extra}) WITHOUT ROWID"
)
_OLD_RANKS = (
    "CREATE TABLE ranks (job TEXT NOT NULL REFERENCES jobs (job) ON DELETE CASCADE, "
    "rank INTEGER NOT NULL CHECK (rank >= 0), epoch INTEGER NOT NULL CHECK (epoch >= 0), "
    "step INTEGER NOT NULL CHECK (step >= 0), generation INTEGER NOT NULL CHECK (generation >= 0), "
    "last_seen REAL NOT NULL, PRIMARY KEY (job, rank)) WITHOUT ROWID"
)

_FINGERPRINTS = (SPEC.dataset_fingerprint, SPEC.config_fingerprint)


def _old_schema_file(path: Path, version: int) -> None:
    """A state file as ladle wrote it at schema ``version`` (1: no incarnation or plan; 2: no expiry).

    It holds ``SPEC.job`` of world size 1, created at 5.0, its rank 0 at (2, 7), generation 3.
    """
    db = sqlite3.connect(path, isolation_level=None)
    if version == 1:
        db.execute(_OLD_JOBS.format(extra=""))
        db.execute("INSERT INTO jobs VALUES (?, ?, ?, 1, 5.0, 5.0)", (SPEC.job, *_FINGERPRINTS))
    else:
        db.execute(_OLD_JOBS.format(extra=", incarnation TEXT NOT NULL, plan TEXT NOT NULL"))
        db.execute(
            "INSERT INTO jobs VALUES (?, ?, ?, 1, 5.0, 5.0, 'feedbeef', '[]')", (SPEC.job, *_FINGERPRINTS)
        )
    db.execute(_OLD_RANKS)
    db.execute("INSERT INTO ranks VALUES (?, 0, 2, 7, 3, 5.0)", (SPEC.job,))
    db.execute(f"PRAGMA user_version = {version}")
    db.close()


def test_a_version_2_file_is_migrated_and_its_jobs_kept(tmp_path: Path) -> None:
    """A state file of the previous schema (no expiry) keeps its jobs; their next write sets one."""
    _old_schema_file(tmp_path / DB, 2)
    clock = ManualClock()
    with _ttl_store(tmp_path, clock, 100) as store:
        state = store.get(SPEC.job)  # written long before T0, under no TTL: kept
        assert (state.incarnation, state.ranks[0].position, state.ranks[0].generation) == (
            "feedbeef",
            Position(2, 7),
            3,
        )
        store.advance(SPEC.job, 0, 3, Position(2, 8))
        clock.tick(100)
        with pytest.raises(JobNotFoundError):
            store.get(SPEC.job)
    db = sqlite3.connect(tmp_path / DB)
    try:
        assert db.execute("PRAGMA user_version").fetchone() == (SCHEMA_VERSION,)
    finally:
        db.close()


# --- a write lock held by another process: reads go on, writes time out together --


def _populated(path: Path) -> None:
    """A store file as a server left it: ``SPEC`` with rank 1 at (2, 9)."""
    with EmbeddedStore(path) as store:
        store.open_job(SPEC)
        generation = store.join(SPEC.job, 1, 4).generation
        store.advance(SPEC.job, 1, generation, Position(2, 9))


@contextmanager
def _write_lock_held(path: Path) -> Iterator[None]:
    """Another connection holds the file's write lock (an operator's ``sqlite3`` shell in BEGIN IMMEDIATE)."""
    blocker = sqlite3.connect(path, isolation_level=None)
    blocker.execute("BEGIN IMMEDIATE")
    try:
        yield
    finally:
        blocker.execute("ROLLBACK")
        blocker.close()


def test_reads_do_not_wait_for_a_write_stuck_behind_the_file_lock(tmp_path: Path) -> None:
    busy = 2.0
    with EmbeddedStore(tmp_path / DB, busy_timeout_s=busy) as store:
        store.open_job(SPEC)
        generation = store.join(SPEC.job, 0, 4).generation
        with _write_lock_held(tmp_path / DB):
            stuck: list[tuple[float, BaseException | None]] = []
            writer = threading.Thread(
                target=lambda: stuck.append(
                    timed(lambda: store.advance(SPEC.job, 0, generation, Position(0, 1)))
                )
            )
            writer.start()
            time.sleep(0.2)  # the write now waits for the lock
            read_s, read_error = timed(lambda: store.get(SPEC.job))
            list_s, list_error = timed(store.list_jobs)
            ping_s, ping_error = timed(store.ping)
            waiting = writer.is_alive()
            writer.join(timeout=30)
        assert (read_error, list_error, ping_error) == (None, None, None)
        assert max(read_s, list_s, ping_s) < busy / 4, (
            f"reads waited for a stuck write: get {read_s:.2f} s, list_jobs {list_s:.2f} s, "
            f"ping {ping_s:.2f} s (busy timeout {busy} s)"
        )
        assert waiting, "the write did not wait for the lock: the test proves nothing"
        assert isinstance(stuck[0][1], StoreUnavailableError), "the stuck write did not time out"
        assert store.get(SPEC.job).ranks[0].position == Position(0, 0), "a timed-out write changed the state"


def test_writes_stuck_behind_the_file_lock_each_wait_one_busy_timeout_at_the_same_time(
    tmp_path: Path,
) -> None:
    """Four ranks' writes all fail after one busy timeout, not after 1, 2, 3 and 4 of them."""
    busy, writers = 0.5, 4
    with EmbeddedStore(tmp_path / DB, busy_timeout_s=busy) as store:
        store.open_job(SPEC)
        generations = [store.join(SPEC.job, rank, 4).generation for rank in range(writers)]
        results: list[tuple[float, BaseException | None]] = [(0.0, None)] * writers
        barrier = threading.Barrier(writers)

        def write(rank: int) -> None:
            barrier.wait(timeout=30)
            results[rank] = timed(lambda: store.advance(SPEC.job, rank, generations[rank], Position(0, 1)))

        with _write_lock_held(tmp_path / DB):
            pool = [threading.Thread(target=write, args=(rank,)) for rank in range(writers)]
            for thread in pool:
                thread.start()
            for thread in pool:
                thread.join(timeout=60)
        errors = [error for _, error in results]
        assert all(isinstance(e, StoreUnavailableError) and "locked" in str(e) for e in errors), errors
        waits = sorted(seconds for seconds, _ in results)
        assert waits[0] > 0.8 * busy, f"a write gave up before its busy timeout: {waits}"
        assert waits[-1] < 2.5 * busy, f"writes timed out one after another, not together: {waits}"
        assert [r.position for r in store.get(SPEC.job).ranks] == [Position(0, 0)] * 4
        # and once the lock is free every rank writes again
        for rank in range(writers):
            store.advance(SPEC.job, rank, generations[rank], Position(0, 1))


def test_a_server_starts_beside_a_held_write_lock(tmp_path: Path) -> None:
    """Opening a file of the current schema needs no write lock (``ladle serve`` took 13 s to fail)."""
    _populated(tmp_path / DB)
    with _write_lock_held(tmp_path / DB):
        seconds, error = timed(lambda: EmbeddedStore(tmp_path / DB, busy_timeout_s=2).close())
    assert error is None, f"opening beside a writer failed: {error!r}"
    assert seconds < 1.0, f"opening waited {seconds:.1f} s for the write lock"


def test_short_lived_threads_leave_no_connections_open(tmp_path: Path) -> None:
    """Each HTTP request or readiness ping may run on a new thread: connections are pooled, not per thread."""
    fds = Path("/proc/self/fd")
    if not fds.is_dir():
        pytest.skip("needs /proc/self/fd")
    with EmbeddedStore(tmp_path / DB) as store:
        store.open_job(SPEC)
        before = len(list(fds.iterdir()))
        for _ in range(50):
            thread = threading.Thread(target=store.list_jobs)
            thread.start()
            thread.join(timeout=30)
        assert len(list(fds.iterdir())) <= before + 3, "a connection was left open per thread"


def test_bursts_of_reads_leave_pool_idle_connections_and_no_growing_descriptors(tmp_path: Path) -> None:
    """Reads at once each get a connection; ``POOL_IDLE`` stay open after, and bursts do not add up.

    SQLite keeps a closed connection's database-file descriptor while other
    connections of the process hold the file's locks, and reuses it for the
    next connection: so the file's descriptors stay at the largest burst, and
    the ``-wal`` ones (one per open connection) count the connections.
    """
    proc_fds = Path("/proc/self/fd")
    if not proc_fds.is_dir():
        pytest.skip("needs /proc/self/fd")
    db_file = str((tmp_path / DB).resolve())
    readers = POOL_IDLE + 4

    def descriptors() -> tuple[int, int]:  # of the database file, of its -wal
        targets = []
        for fd in proc_fds.iterdir():
            with suppress(OSError):  # closed while we looked
                targets.append(os.readlink(fd))
        return targets.count(db_file), targets.count(db_file + "-wal")

    peaks: list[tuple[int, int]] = []
    together = threading.Barrier(readers, action=lambda: peaks.append(descriptors()), timeout=30)
    burst, waited = threading.Event(), threading.local()

    def clock() -> float:  # read inside each read's transaction: holds the readers there together
        if burst.is_set() and not getattr(waited, "done", False):
            waited.done = True
            together.wait()
        return time.time()

    with EmbeddedStore(tmp_path / DB, clock=clock) as store:
        store.open_job(SPEC)
        burst.set()
        seen: list[int] = []
        for _ in range(3):
            seen.clear()
            threads = [
                threading.Thread(target=lambda: seen.append(len(store.list_jobs()))) for _ in range(readers)
            ]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join(timeout=60)
            assert seen == [1] * readers, "a reader failed"
            assert peaks[-1] == (readers, readers), f"the readers did not each hold a connection: {peaks}"
            assert descriptors() == (readers, POOL_IDLE), "idle connections beyond POOL_IDLE were kept"
    assert descriptors() == (0, 0), "close() left descriptors open"


# --- paths that are not a regular file ----------------------------------------


@pytest.mark.parametrize("read_only", [False, True])
def test_a_path_that_is_not_a_regular_file_is_refused_before_sqlite_opens_it(
    tmp_path: Path, read_only: bool
) -> None:
    fifo = tmp_path / "pipe.db"
    os.mkfifo(fifo)
    # the FIFO last: SQLite would block reading it
    cases = [(tmp_path, "is a directory"), (Path(os.devnull), "is a character device"), (fifo, "is a FIFO")]
    journal_before = os.path.exists(os.devnull + "-journal")
    for path, kind in cases:
        with pytest.raises(StoreError) as info:
            EmbeddedStore(path, read_only=True) if read_only else EmbeddedStore(path)
        message = str(info.value)
        assert message.startswith(f"cursor store {path}: {kind}"), message
        assert "\n" not in message, message
        assert type(info.value) is StoreError, "a path that is no file is a mistake to fix, not an outage"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["pipe.db"], "SQLite left files beside the FIFO"
    if not journal_before:
        assert not os.path.exists(os.devnull + "-journal"), "SQLite left /dev/null-journal behind"


# --- the file removed or replaced under a running store -------------------------


def _warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        r.getMessage() for r in caplog.records if r.name == "ladle.server" and r.levelno == logging.WARNING
    ]


def test_a_removed_file_is_warned_about_once(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="ladle.server")
    with EmbeddedStore(tmp_path / DB) as store:
        store.open_job(SPEC)
        generation = store.join(SPEC.job, 0, 4).generation
        assert _warnings(caplog) == []
        for path in tmp_path.iterdir():
            path.unlink()
        store.advance(SPEC.job, 0, generation, Position(0, 1))  # SQLite writes on to the deleted file
        for _ in range(3):
            with pytest.raises(StoreUnavailableError, match="was removed"):
                store.ping()
        store.advance(SPEC.job, 0, generation, Position(0, 2))
    (warning,) = _warnings(caplog)
    assert f"cursor store {tmp_path / DB} was removed" in warning, warning
    assert "writes go to a deleted file, and a restart loses them" in warning, warning


# A writing store looks at its file's identity at most once a second (a stat per write would cost).
FILE_CHECK_S = 1.0


def test_a_writing_store_notices_a_removed_file_without_a_ping(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A server nobody polls on /readyz still says it, at its next write."""
    caplog.set_level(logging.WARNING, logger="ladle.server")
    with EmbeddedStore(tmp_path / DB) as store:
        store.open_job(SPEC)
        generation = store.join(SPEC.job, 0, 4).generation
        for path in tmp_path.iterdir():
            path.unlink()
        time.sleep(FILE_CHECK_S)
        for step in (1, 2, 3):
            store.advance(SPEC.job, 0, generation, Position(0, step))
        assert len(_warnings(caplog)) == 1, _warnings(caplog)
        time.sleep(FILE_CHECK_S)
        store.advance(SPEC.job, 0, generation, Position(0, 4))
    assert len(_warnings(caplog)) == 1, "the warning was repeated"


def test_a_replaced_file_is_warned_about_by_ping(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="ladle.server")
    with EmbeddedStore(tmp_path / DB) as store:
        store.open_job(SPEC)
        (tmp_path / "backup").mkdir()
        EmbeddedStore(tmp_path / "backup" / DB).close()
        os.replace(tmp_path / "backup" / DB, tmp_path / DB)  # a backup restored over it
        for _ in range(2):
            with pytest.raises(StoreUnavailableError, match="was replaced by another file"):
                store.ping()
    (warning,) = _warnings(caplog)
    assert f"cursor store {tmp_path / DB} was replaced by another file" in warning, warning


def _read_in_child(store: EmbeddedStore) -> None:
    try:
        store.get(SPEC.job)
    except StoreUnavailableError as exc:
        os._exit(3 if " was removed " in str(exc) else 4)
    os._exit(0)


@pytest.mark.skipif(sys.platform != "linux", reason="fork start method")
def test_a_new_connection_never_recreates_a_removed_file(tmp_path: Path) -> None:
    """A forked child (any new connection) finds the file gone: refused, not a second, empty store."""
    with EmbeddedStore(tmp_path / DB) as store:
        store.open_job(SPEC)
        for path in tmp_path.iterdir():
            path.unlink()
        child = multiprocessing.get_context("fork").Process(target=_read_in_child, args=(store,))
        child.start()
        child.join(timeout=60)
        assert child.exitcode == 3, f"the child's read was not refused as removed (exit {child.exitcode})"
        assert not (tmp_path / DB).exists(), "a new connection created another state file"


# --- read_only: listing without the write lock, a migration or a created file ----


def _fingerprint(path: Path) -> list[tuple[str, bytes, int]]:
    """Every file of the store (with -wal and -shm, if any): its name, bytes and mtime."""
    return sorted(
        (p.name, p.read_bytes(), p.stat().st_mtime_ns)
        for p in path.parent.iterdir()
        if p.name.startswith(path.name)
    )


def test_a_read_only_store_reads_what_the_server_wrote_and_changes_no_byte(tmp_path: Path) -> None:
    _populated(tmp_path / DB)
    before = _fingerprint(tmp_path / DB)
    with EmbeddedStore(tmp_path / DB, read_only=True) as store:
        assert [j.job for j in store.list_jobs()] == [SPEC.job]
        assert store.get(SPEC.job).ranks[1].position == Position(2, 9)
        store.ping()
        assert "read_only=True" in repr(store)
    after = [f for f in _fingerprint(tmp_path / DB) if f[0] == DB]
    assert after == [f for f in before if f[0] == DB], "a read-only store changed the state file"


def test_a_read_only_store_refuses_every_write(tmp_path: Path) -> None:
    _populated(tmp_path / DB)
    with EmbeddedStore(tmp_path / DB, read_only=True) as store:
        before = _fingerprint(tmp_path / DB)
        state = store.get(SPEC.job)
        writes: list[Callable[[], object]] = [
            lambda: store.open_job(JobSpec("other", "d", "c", 2)),
            lambda: store.open_job(SPEC, reset=True),
            lambda: store.join(SPEC.job, 0, 4),
            lambda: store.advance(SPEC.job, 1, 1, Position(3, 0)),
            lambda: store.rewind(SPEC.job, 1, 1, Position(0, 0)),
            lambda: store.reconcile(SPEC.job, 1, 1, Position(0, 0)),
            lambda: store.resize(SPEC.job, 4, 2),
            lambda: store.delete_job(SPEC.job),
        ]
        for write in writes:
            with pytest.raises(StoreError, match="read-only") as info:
                write()
            assert type(info.value) is StoreError
        assert store.get(SPEC.job) == state
        assert _fingerprint(tmp_path / DB) == before, "a refused write changed the files"


def test_a_read_only_store_reads_beside_a_held_write_lock(tmp_path: Path) -> None:
    """``ladle jobs`` beside a writer: it needs no lock, so it neither waits nor fails."""
    _populated(tmp_path / DB)
    with _write_lock_held(tmp_path / DB):
        seconds, error = timed(lambda: EmbeddedStore(tmp_path / DB, busy_timeout_s=2, read_only=True).close())
        assert error is None, f"opening read-only beside a writer failed: {error!r}"
        assert seconds < 1.0, f"opening read-only waited {seconds:.1f} s for the lock"
        with EmbeddedStore(tmp_path / DB, busy_timeout_s=2, read_only=True) as store:
            seconds, error = timed(store.list_jobs)
        assert error is None, f"listing beside a writer failed: {error!r}"
        assert seconds < 1.0, f"listing waited {seconds:.1f} s for the lock"


def test_a_read_only_store_never_creates_a_file(tmp_path: Path) -> None:
    with pytest.raises(StoreError, match="no cursor store at") as info:
        EmbeddedStore(tmp_path / DB, read_only=True)
    assert "does not create" in str(info.value)
    with pytest.raises(StoreError, match="no cursor store at"):
        EmbeddedStore(tmp_path / "no-such-dir" / DB, read_only=True)
    assert list(tmp_path.iterdir()) == [], "a read-only store created a file"
    (tmp_path / DB).touch()  # an empty file: no schema yet
    with pytest.raises(StoreError, match=r"is empty: `ladle serve` creates"):
        EmbeddedStore(tmp_path / DB, read_only=True)
    assert (tmp_path / DB).stat().st_size == 0


@pytest.mark.parametrize("version", [1, 2])
def test_a_read_only_store_reads_an_older_schema_without_migrating_it(tmp_path: Path, version: int) -> None:
    _old_schema_file(tmp_path / DB, version)
    before = _fingerprint(tmp_path / DB)
    with EmbeddedStore(tmp_path / DB, read_only=True, job_ttl_s=1) as store:
        (job,) = store.list_jobs()
        assert job == store.get(SPEC.job)
        assert job.spec == JobSpec(SPEC.job, *_FINGERPRINTS, 1)
        assert (job.created, job.updated, job.plan) == (5.0, 5.0, ())
        assert (job.ranks[0].position, job.ranks[0].generation) == (Position(2, 7), 3)
        assert job.incarnation == ("" if version == 1 else "feedbeef")
    assert _fingerprint(tmp_path / DB) == before, "a read-only store migrated the file"
    db = sqlite3.connect(tmp_path / DB)
    try:
        assert db.execute("PRAGMA user_version").fetchone() == (version,)
        assert db.execute("PRAGMA journal_mode").fetchone() == ("delete",), "the journal mode was changed"
    finally:
        db.close()


def test_a_read_only_store_refuses_what_a_writer_refuses(tmp_path: Path) -> None:
    db = sqlite3.connect(tmp_path / "other.db")
    db.execute("CREATE TABLE notes (text TEXT)")
    db.close()
    with pytest.raises(StoreError, match="not a ladle cursor store"):
        EmbeddedStore(tmp_path / "other.db", read_only=True)
    _populated(tmp_path / DB)
    db = sqlite3.connect(tmp_path / DB)
    db.execute(f"PRAGMA user_version = {SCHEMA_VERSION + 1}")
    db.close()
    with pytest.raises(StoreError, match="newer"):
        EmbeddedStore(tmp_path / DB, read_only=True)


def test_a_read_only_store_sees_later_writes_and_expiry(tmp_path: Path) -> None:
    clock = ManualClock()
    with (
        EmbeddedStore(tmp_path / DB, clock=clock, job_ttl_s=100) as server,
        EmbeddedStore(tmp_path / DB, clock=clock, read_only=True) as reader,
    ):
        server.open_job(SPEC)
        generation = server.join(SPEC.job, 2, 4).generation
        server.advance(SPEC.job, 2, generation, Position(0, 5))
        assert reader.get(SPEC.job).ranks[2].position == Position(0, 5)
        clock.tick(100)
        assert reader.list_jobs() == [], "a read-only store lists an expired job"


@pytest.mark.skipif(
    os.geteuid() == 0, reason="root ignores file permissions (tests/integration covers a read-only mount)"
)
def test_a_read_only_store_reads_a_file_in_a_folder_it_cannot_write(tmp_path: Path) -> None:
    folder = tmp_path / "ro"
    folder.mkdir()
    _populated(folder / DB)  # closed cleanly: no -wal, no -shm
    folder.chmod(0o555)
    (folder / DB).chmod(0o444)
    try:
        with pytest.raises(StoreUnavailableError):
            EmbeddedStore(folder / DB)
        with EmbeddedStore(folder / DB, read_only=True) as store:
            assert store.get(SPEC.job).ranks[1].position == Position(2, 9)
        assert sorted(p.name for p in folder.iterdir()) == [DB]
    finally:
        folder.chmod(0o755)


def test_a_permission_error_names_what_is_not_writable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SQLite says "readonly database" for a writable file in a read-only folder: the message says which."""
    path = tmp_path / "state.db"
    store = EmbeddedStore(path)
    store.close()
    readonly = sqlite3.OperationalError("attempt to write a readonly database")
    writable = {str(path)}  # the file is writable, its folder is not
    monkeypatch.setattr(os, "access", lambda p, mode: str(p) in writable)
    message = str(store._unavailable(readonly))
    assert f"its folder {tmp_path} is not writable by uid {os.geteuid()}" in message, message
    assert "state.db-wal and -shm" in message
    writable = {str(tmp_path)}  # now the folder is, the file is not
    assert "(the file is not writable by uid" in str(store._unavailable(readonly))
    writable |= {str(path)}
    assert "writable" not in str(store._unavailable(readonly)), "a hint where nothing is wrong"
    assert "writable" not in str(store._unavailable(sqlite3.OperationalError("disk I/O error")))


def test_a_malformed_job_row_is_a_typed_error_for_that_job_only(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A hand-edited row: a JSONDecodeError from every get and listing; now that job alone is refused."""
    from ladle.service.errors import StoreCorruptError

    path = tmp_path / "state.db"
    with EmbeddedStore(path) as store:
        store.open_job(SPEC)
        store.open_job(JobSpec("bad", "dataset-aaaa", "config-bbbb", 2))
    with sqlite3.connect(path) as db:
        db.execute("UPDATE jobs SET plan = 'not json' WHERE job = 'bad'")
    with EmbeddedStore(path) as store:
        with pytest.raises(StoreCorruptError, match="ladle jobs --delete bad --force") as caught:
            store.get("bad")
        assert caught.value.field == "plan"
        with caplog.at_level(logging.WARNING, logger="ladle.store"):
            assert [j.job for j in store.list_jobs()] == [SPEC.job]
            assert [j.job for j in store.list_jobs()] == [SPEC.job]  # the page lists every few seconds
        warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        assert len(warned) == 1, warned
        assert "job 'bad' cannot be read" in warned[0]
        assert store.delete_job("bad")
        assert [j.job for j in store.list_jobs()] == [SPEC.job]
