"""The embedded cursor store: one SQLite file in WAL mode, the default on one machine.

Every operation is one SQLite transaction (``BEGIN IMMEDIATE`` for writes), so
check-and-set is atomic across the threads and processes that open the same
file; the trade-off is that writers are serialised by the file lock (tens of
thousands of operations a second on one disk, far above what trainers
acknowledge) and the file must be on a local filesystem (WAL needs shared
memory, so NFS and similar mounts are not supported).

A job nobody writes to for ``job_ttl_s`` seconds is gone: every write stores
the job's expiry time with it (as Redis's key TTL is set by the writer, so
every reader agrees on it), reads no longer see an expired job, and the next
write to it, or the next ``open_job`` of any job, deletes its rows.

Durability: with ``synchronous=NORMAL`` in WAL mode a committed operation
survives the crash or kill of any process, but a power loss or OS crash may
lose the last transactions committed before it (never corrupting the file): the
store then holds slightly older cursors and generations than the trainers
acknowledged. Detecting and reconciling such a store from the trainers'
positions ("store lost recent writes", PRODUCT.md guarantee 6) is the job of
the layer above and is shared with the Redis store; ``FencedError`` with
``generation > current`` is its signal.
"""

from __future__ import annotations

import os
import sqlite3
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from typing import Final

from ..errors import JobNotFoundError, StoreError, StoreUnavailableError, WorldSizeMismatchError
from .base import (
    Clock,
    CursorStore,
    JobSpec,
    JobState,
    Position,
    RankState,
    Resize,
    check_forward,
    check_generation,
    check_identity,
    check_job_ttl,
    new_incarnation,
    plan_from_json,
    plan_to_json,
    rank_outside,
    resize_start,
)

__all__ = ["SCHEMA_VERSION", "EmbeddedStore"]

# Stored in PRAGMA user_version; bump with a migration in ``_migrate``.
SCHEMA_VERSION: Final = 3

_SCHEMA: Final = (
    """
    CREATE TABLE jobs (
        job TEXT PRIMARY KEY,
        dataset_fingerprint TEXT NOT NULL,
        config_fingerprint TEXT NOT NULL,
        world_size INTEGER NOT NULL CHECK (world_size >= 1),
        created REAL NOT NULL,
        updated REAL NOT NULL,
        incarnation TEXT NOT NULL,
        plan TEXT NOT NULL,
        expires REAL NOT NULL DEFAULT 0
    ) WITHOUT ROWID
    """,
    """
    CREATE TABLE ranks (
        job TEXT NOT NULL REFERENCES jobs (job) ON DELETE CASCADE,
        rank INTEGER NOT NULL CHECK (rank >= 0),
        epoch INTEGER NOT NULL CHECK (epoch >= 0),
        step INTEGER NOT NULL CHECK (step >= 0),
        generation INTEGER NOT NULL CHECK (generation >= 0),
        last_seen REAL NOT NULL,
        PRIMARY KEY (job, rank)
    ) WITHOUT ROWID
    """,
)

_JOB_COLUMNS: Final = (
    "job, dataset_fingerprint, config_fingerprint, world_size, created, updated, incarnation, plan"
)
# Version 1 had no incarnation or plan: jobs it holds get a fresh incarnation and an empty plan.
_MIGRATE_1_TO_2: Final = (
    "ALTER TABLE jobs ADD COLUMN incarnation TEXT NOT NULL DEFAULT ''",
    "ALTER TABLE jobs ADD COLUMN plan TEXT NOT NULL DEFAULT '[]'",
)
# Version 2 had no expiry: the jobs it holds never expire until written again.
_MIGRATE_2_TO_3: Final = ("ALTER TABLE jobs ADD COLUMN expires REAL NOT NULL DEFAULT 0",)
_RANK_COLUMNS: Final = "rank, epoch, step, generation, last_seen"

_JobRow = tuple[str, str, str, int, float, float, str, str]
_RankRow = tuple[int, int, int, int, float]


def _rank_state(row: _RankRow) -> RankState:
    rank, epoch, step, generation, last_seen = row
    return RankState(rank, Position(epoch, step), generation, last_seen)


def _job_state(row: _JobRow, ranks: list[_RankRow]) -> JobState:
    job, dataset_fp, config_fp, world_size, created, updated, incarnation, plan = row
    return JobState(
        JobSpec(job, dataset_fp, config_fp, world_size),
        tuple(_rank_state(r) for r in ranks),
        created,
        updated,
        incarnation,
        plan_from_json(plan),
    )


class EmbeddedStore(CursorStore):
    """A ``CursorStore`` in one SQLite file, shared safely by threads and processes.

    One connection per store object, guarded by a lock (threads of one process
    queue on the lock, not on SQLite's sleeping busy handler); processes and
    other store objects on the same file wait up to ``busy_timeout_s`` for the
    file's write lock, then get ``StoreUnavailableError``. The file is created
    (not its directory) and its schema checked on construction, so a bad path
    fails at once. A store object used in a forked child reconnects there
    instead of sharing the parent's connection. ``job_ttl_s`` (0: forever,
    the default here; ``open_store`` passes the server's ``--job-ttl``) is how
    long a job nobody writes to is kept.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        clock: Clock = time.time,
        busy_timeout_s: float = 10.0,
        job_ttl_s: float = 0.0,
    ) -> None:
        super().__init__(clock=clock)
        self.job_ttl_s = check_job_ttl(job_ttl_s)
        self.path = os.fspath(path)
        if self.path in ("", ":memory:") or self.path.startswith("file:"):
            raise StoreError(
                f"the embedded store needs a file path, got {self.path!r} "
                "(state must outlive the process and be shared with other processes)"
            )
        self.busy_timeout_s = busy_timeout_s
        self._lock = threading.Lock()
        self._db: sqlite3.Connection | None = None
        self._pid = 0
        self._file_id = (0, 0)
        self._closed = False
        with self._lock:
            self._connection()

    def __repr__(self) -> str:
        return f"EmbeddedStore({self.path!r})"

    # --- connection and transactions ---------------------------------------

    def _unavailable(self, exc: sqlite3.Error) -> StoreUnavailableError:
        return StoreUnavailableError(f"cursor store {self.path}: {exc}")

    def _connection(self) -> sqlite3.Connection:
        """The open connection (the caller holds ``self._lock``), connecting if needed."""
        if self._closed:
            raise StoreUnavailableError(f"cursor store {self.path} is closed")
        if self._db is not None and self._pid == os.getpid():
            return self._db
        # A connection inherited through fork must not be used (or closed) here.
        self._db = None
        try:
            db = sqlite3.connect(
                self.path, timeout=self.busy_timeout_s, isolation_level=None, check_same_thread=False
            )
        except sqlite3.Error as exc:
            raise self._unavailable(exc) from exc
        try:
            db.execute(f"PRAGMA busy_timeout = {int(self.busy_timeout_s * 1000)}")
            (mode,) = db.execute("PRAGMA journal_mode = WAL").fetchone()
            if str(mode).lower() != "wal":
                raise StoreUnavailableError(
                    f"cursor store {self.path}: cannot switch to WAL mode (got {mode!r}); "
                    "is it on a network filesystem?"
                )
            db.execute("PRAGMA synchronous = NORMAL")
            db.execute("PRAGMA foreign_keys = ON")
            self._migrate(db)
            stat = os.stat(self.path)
        except BaseException as exc:
            db.close()
            if isinstance(exc, sqlite3.Error):
                raise self._unavailable(exc) from exc
            if isinstance(exc, OSError):
                raise StoreUnavailableError(f"cursor store {self.path}: {exc}") from exc
            raise
        self._db, self._pid, self._file_id = db, os.getpid(), (stat.st_dev, stat.st_ino)
        return db

    def _migrate(self, db: sqlite3.Connection) -> None:
        """Create the schema in a new file; refuse files of a newer ladle or of another program."""
        db.execute("BEGIN IMMEDIATE")
        try:
            (version,) = db.execute("PRAGMA user_version").fetchone()
            if version > SCHEMA_VERSION:
                raise StoreError(
                    f"cursor store {self.path} has schema version {version}, newer than this "
                    f"ladle's {SCHEMA_VERSION}; upgrade ladle or use another file"
                )
            if version == 0:
                tables = [r[0] for r in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")]
                if tables:
                    raise StoreError(
                        f"{self.path} is an SQLite database but not a ladle cursor store "
                        f"(it has tables {sorted(tables)}); use another file"
                    )
                for statement in _SCHEMA:
                    db.execute(statement)
            if version == 1:
                for statement in _MIGRATE_1_TO_2:
                    db.execute(statement)
                for (job,) in db.execute("SELECT job FROM jobs").fetchall():
                    db.execute("UPDATE jobs SET incarnation = ? WHERE job = ?", (new_incarnation(), job))
            if version in (1, 2):
                for statement in _MIGRATE_2_TO_3:
                    db.execute(statement)
            db.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
            db.execute("COMMIT")
        except BaseException:
            db.rollback()
            raise

    @contextmanager
    def _transaction(self, *, write: bool) -> Iterator[sqlite3.Connection]:
        """One transaction: committed if the body returns, rolled back (changing nothing) if it raises.

        Writes take the file's write lock up front (``BEGIN IMMEDIATE``), so a
        check-and-set never reads a state another writer is about to change.
        Reads see one consistent snapshot (WAL) and never block writers.
        """
        with self._lock:
            db = self._connection()
            try:
                db.execute("BEGIN IMMEDIATE" if write else "BEGIN")
            except sqlite3.Error as exc:
                raise self._unavailable(exc) from exc
            try:
                yield db
            except BaseException as exc:
                with suppress(sqlite3.Error):  # the original error is the one to report
                    db.rollback()
                if isinstance(exc, sqlite3.Error):
                    raise self._unavailable(exc) from exc
                raise
            try:
                db.commit()
            except sqlite3.Error as exc:
                db.rollback()
                raise self._unavailable(exc) from exc

    # --- the hooks, one transaction each -----------------------------------

    def _expires(self, now: float) -> float:
        """The expiry a write at ``now`` gives its job: ``job_ttl_s`` later, or 0 (never)."""
        return now + self.job_ttl_s if self.job_ttl_s > 0 else 0.0

    @staticmethod
    def _expired(expires: float, now: float) -> bool:
        return 0 < expires <= now

    def _job_row(self, db: sqlite3.Connection, job: str, now: float, *, write: bool) -> _JobRow | None:
        """The job's row; None if there is none or it expired (its rows then deleted, in a write)."""
        found = db.execute(f"SELECT {_JOB_COLUMNS}, expires FROM jobs WHERE job = ?", (job,)).fetchone()
        if found is None or not self._expired(found[-1], now):
            return None if found is None else found[:-1]
        if write:
            self._delete(db, job)
        return None

    @staticmethod
    def _sweep(db: sqlite3.Connection, now: float) -> None:
        """Delete every expired job (inside a write)."""
        expired = "expires > 0 AND expires <= ?"
        db.execute(f"DELETE FROM ranks WHERE job IN (SELECT job FROM jobs WHERE {expired})", (now,))
        db.execute(f"DELETE FROM jobs WHERE {expired}", (now,))

    @staticmethod
    def _rank_rows(db: sqlite3.Connection, job: str) -> list[_RankRow]:
        rows: list[_RankRow] = db.execute(
            f"SELECT {_RANK_COLUMNS} FROM ranks WHERE job = ? ORDER BY rank", (job,)
        ).fetchall()
        return rows

    def _open_job(
        self, spec: JobSpec, *, reset: bool, incarnation: str, plan: tuple[Resize, ...]
    ) -> JobState:
        with self._transaction(write=True) as db:
            now = self._now()
            self._sweep(db, now)
            row = self._job_row(db, spec.job, now, write=True)
            if row is not None and reset:
                self._delete(db, spec.job)
                row = None
            if row is not None:
                check_identity(_job_state(row, []).spec, spec)
                return _job_state(row, self._rank_rows(db, spec.job))
            db.execute(
                f"INSERT INTO jobs ({_JOB_COLUMNS}, expires) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (
                    spec.job,
                    spec.dataset_fingerprint,
                    spec.config_fingerprint,
                    spec.world_size,
                    now,
                    now,
                    incarnation,
                    plan_to_json(plan),
                    self._expires(now),
                ),
            )
            self._insert_ranks(db, spec.job, spec.world_size, Position(0, 0), 0, now)
            ranks = tuple(RankState(rank, Position(0, 0), 0, now) for rank in range(spec.world_size))
            return JobState(spec, ranks, now, now, incarnation, plan)

    @staticmethod
    def _insert_ranks(
        db: sqlite3.Connection, job: str, world_size: int, at: Position, generation: int, now: float
    ) -> None:
        db.executemany(
            f"INSERT INTO ranks (job, {_RANK_COLUMNS}) VALUES (?, ?, ?, ?, ?, ?)",
            ((job, rank, at.epoch, at.step, generation, now) for rank in range(world_size)),
        )

    def _resize(
        self, job: str, from_world_size: int, to_world_size: int, cut: tuple[Position, ...] | None
    ) -> JobState:
        with self._transaction(write=True) as db:
            now = self._now()
            row = self._job_row(db, job, now, write=True)
            if row is None:
                raise JobNotFoundError(job)
            state = _job_state(row, self._rank_rows(db, job))
            if state.spec.world_size == to_world_size:
                return state
            if state.spec.world_size != from_world_size:
                raise WorldSizeMismatchError(job, state.spec.world_size, from_world_size)
            if cut is None:
                cut = tuple(r.position for r in state.ranks)
            plan = (*state.plan, Resize(from_world_size, cut))
            generation = max(r.generation for r in state.ranks) + 1
            start = resize_start(cut)
            db.execute("DELETE FROM ranks WHERE job = ?", (job,))
            self._insert_ranks(db, job, to_world_size, start, generation, now)
            db.execute(
                "UPDATE jobs SET world_size = ?, plan = ?, updated = ?, expires = ? WHERE job = ?",
                (to_world_size, plan_to_json(plan), now, self._expires(now), job),
            )
            return _job_state(self._job_row(db, job, now, write=True) or row, self._rank_rows(db, job))

    def _join(self, job: str, rank: int, world_size: int) -> RankState:
        with self._transaction(write=True) as db:
            now = self._now()
            row = db.execute("SELECT world_size, expires FROM jobs WHERE job = ?", (job,)).fetchone()
            if row is not None and self._expired(row[1], now):
                self._delete(db, job)
                row = None
            if row is None:
                raise JobNotFoundError(job)
            if row[0] != world_size:
                raise WorldSizeMismatchError(job, row[0], world_size)
            (updated,) = db.execute(
                f"UPDATE ranks SET generation = generation + 1, last_seen = ? "
                f"WHERE job = ? AND rank = ? RETURNING {_RANK_COLUMNS}",
                (now, job, rank),
            ).fetchall()
            db.execute(
                "UPDATE jobs SET updated = ?, expires = ? WHERE job = ?", (now, self._expires(now), job)
            )
            return _rank_state(updated)

    def _move(
        self, job: str, rank: int, generation: int, to: Position, *, forward_only: bool, restore: bool = False
    ) -> RankState:
        with self._transaction(write=True) as db:
            now = self._now()
            row = db.execute(
                "SELECT j.world_size, r.epoch, r.step, r.generation, j.expires FROM jobs AS j "
                "LEFT JOIN ranks AS r ON r.job = j.job AND r.rank = ? WHERE j.job = ?",
                (rank, job),
            ).fetchone()
            if row is not None and self._expired(row[4], now):
                self._delete(db, job)
                row = None
            if row is None:
                raise JobNotFoundError(job)
            world_size, epoch, step, current, _ = row
            if current is None:
                raise rank_outside(rank, world_size)
            if restore:
                if current > generation:
                    check_generation(job, rank, generation, current)
            else:
                check_generation(job, rank, generation, current)
            if forward_only:
                check_forward(job, rank, Position(epoch, step), to)
            db.execute(
                "UPDATE ranks SET epoch = ?, step = ?, generation = ?, last_seen = ? "
                "WHERE job = ? AND rank = ?",
                (to.epoch, to.step, generation, now, job, rank),
            )
            db.execute(
                "UPDATE jobs SET updated = ?, expires = ? WHERE job = ?", (now, self._expires(now), job)
            )
            return RankState(rank, to, generation, now)

    def _advance(self, job: str, rank: int, generation: int, to: Position) -> RankState:
        return self._move(job, rank, generation, to, forward_only=True)

    def _rewind(self, job: str, rank: int, generation: int, to: Position) -> RankState:
        return self._move(job, rank, generation, to, forward_only=False)

    def _reconcile(self, job: str, rank: int, generation: int, to: Position) -> RankState:
        return self._move(job, rank, generation, to, forward_only=False, restore=True)

    def _get(self, job: str) -> JobState:
        with self._transaction(write=False) as db:
            row = self._job_row(db, job, self._now(), write=False)
            if row is None:
                raise JobNotFoundError(job)
            return _job_state(row, self._rank_rows(db, job))

    def _list_jobs(self) -> list[JobState]:
        with self._transaction(write=False) as db:
            now = self._now()
            jobs: list[_JobRow] = [
                row[:-1]
                for row in db.execute(f"SELECT {_JOB_COLUMNS}, expires FROM jobs ORDER BY job").fetchall()
                if not self._expired(row[-1], now)
            ]
            rows: list[tuple[str, int, int, int, int, float]] = db.execute(
                f"SELECT job, {_RANK_COLUMNS} FROM ranks ORDER BY job, rank"
            ).fetchall()
            ranks: dict[str, list[_RankRow]] = {row[0]: [] for row in jobs}
            for row in rows:
                if row[0] in ranks:
                    ranks[row[0]].append(row[1:])
            return [_job_state(row, ranks[row[0]]) for row in jobs]

    @staticmethod
    def _delete(db: sqlite3.Connection, job: str) -> bool:
        db.execute("DELETE FROM ranks WHERE job = ?", (job,))
        return db.execute("DELETE FROM jobs WHERE job = ?", (job,)).rowcount > 0

    def _delete_job(self, job: str) -> bool:
        with self._transaction(write=True) as db:
            if self._job_row(db, job, self._now(), write=True) is None:
                return False  # unknown, or expired (and now deleted)
            return self._delete(db, job)

    def _ping(self) -> None:
        with self._transaction(write=False) as db:
            db.execute("SELECT count(*) FROM jobs").fetchone()
        # SQLite keeps writing to a file removed or replaced under it; that state would be lost.
        try:
            stat = os.stat(self.path)
        except OSError as exc:
            raise StoreUnavailableError(f"cursor store {self.path} was removed: {exc}") from exc
        if (stat.st_dev, stat.st_ino) != self._file_id:
            raise StoreUnavailableError(f"cursor store {self.path} was replaced by another file")

    def close(self) -> None:
        with self._lock:
            self._closed = True
            if self._db is not None and self._pid == os.getpid():
                self._db.close()
            self._db = None
