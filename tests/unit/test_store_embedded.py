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
import multiprocessing
import os
import pickle
import sqlite3
import subprocess
import sys
from collections.abc import Iterator
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
from ladle.service.store.embedded import SCHEMA_VERSION  # noqa: E402
from tests.contract.store_contract import SPEC, MakeStore, ManualClock, StoreContract, StoreFactory  # noqa: E402

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
        with pytest.raises(StoreUnavailableError, match="removed"):
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


def test_a_version_2_file_is_migrated_and_its_jobs_kept(tmp_path: Path) -> None:
    """A state file of the previous schema (no expiry) keeps its jobs; their next write sets one."""
    db = sqlite3.connect(tmp_path / DB, isolation_level=None)
    db.execute(
        "CREATE TABLE jobs (job TEXT PRIMARY KEY, dataset_fingerprint TEXT NOT NULL, "
        "config_fingerprint TEXT NOT NULL, world_size INTEGER NOT NULL CHECK (world_size >= 1), "
        "created REAL NOT NULL, updated REAL NOT NULL, incarnation TEXT NOT NULL, plan TEXT NOT NULL) "
        "WITHOUT ROWID"
    )
    db.execute(
        "CREATE TABLE ranks (job TEXT NOT NULL REFERENCES jobs (job) ON DELETE CASCADE, "
        "rank INTEGER NOT NULL CHECK (rank >= 0), epoch INTEGER NOT NULL CHECK (epoch >= 0), "
        "step INTEGER NOT NULL CHECK (step >= 0), generation INTEGER NOT NULL CHECK (generation >= 0), "
        "last_seen REAL NOT NULL, PRIMARY KEY (job, rank)) WITHOUT ROWID"
    )
    db.execute(
        "INSERT INTO jobs VALUES (?, ?, ?, 1, 5.0, 5.0, 'feedbeef', '[]')",
        (SPEC.job, SPEC.dataset_fingerprint, SPEC.config_fingerprint),
    )
    db.execute("INSERT INTO ranks VALUES (?, 0, 2, 7, 3, 5.0)", (SPEC.job,))
    db.execute("PRAGMA user_version = 2")
    db.close()
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
