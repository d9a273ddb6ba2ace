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
from tests.contract.store_contract import SPEC, MakeStore, StoreContract, StoreFactory  # noqa: E402

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
