"""The embedded cursor store: one SQLite file in WAL mode, the default on one machine.

Every operation is one SQLite transaction (``BEGIN IMMEDIATE`` for writes), so
check-and-set is atomic across the threads and processes that open the same
file; the trade-off is that writers are serialised by the file lock (tens of
thousands of operations a second on one disk, far above what trainers
acknowledge) and the file must be on a local filesystem (WAL needs shared
memory, so NFS and similar mounts are not supported).

Each transaction has a connection of its own (from a pool that keeps at most
``POOL_IDLE`` idle ones, two file descriptors each), so reads see
a WAL snapshot and never wait for a writer, even one stuck behind another
process's write lock, and each write waits about the busy timeout at most,
however many others wait with it. A store opened ``read_only`` never writes the file
(no journal-mode change, no migration, no creation), so ``ladle jobs`` lists a
read-only copy, a file beside a busy writer, or an older ladle's file as it is.

A job nobody writes to for ``job_ttl_s`` seconds is gone: every write stores
the job's expiry time with it (as Redis's key TTL is set by the writer, so
every reader agrees on it), reads no longer see an expired job, and the next
write to it, or the next ``open_job`` of any job, deletes its rows.

Durability: with ``synchronous=NORMAL`` in WAL mode a committed operation
survives the crash or kill of any process, but a power loss or OS crash may
lose the last transactions committed before it (never corrupting the file): the
store then holds slightly older cursors and generations than the trainers
acknowledged. Detecting and reconciling such a store from the trainers'
positions ("store lost recent writes", docs/product.md guarantee 6) is the job of
the layer above and is shared with the Redis store; ``FencedError`` with
``generation > current`` is its signal.
"""

from __future__ import annotations

import logging
import os
import sqlite3
import stat
import threading
import time
import urllib.parse
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from typing import Final

from ..errors import (
    ConfigError,
    JobNotFoundError,
    StoreCorruptError,
    StoreError,
    StoreUnavailableError,
    WorldSizeMismatchError,
)
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
    shown_value,
)

__all__ = ["POOL_IDLE", "SCHEMA_VERSION", "EmbeddedStore"]

log = logging.getLogger("ladle.server")

# Stored in PRAGMA user_version; bump with a migration in ``_migrate``.
SCHEMA_VERSION: Final = 3
# Idle connections kept for the next transactions; more open while more threads
# read at once, and close when they come back (the database file and its -wal each).
POOL_IDLE: Final = 4

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
# A job's row, then its expiry, as each schema holds them: a read-only store reads older files as
# they are, with what their migration would add (version 1's fresh incarnations are left empty).
_JOB_SELECT: Final = {
    1: "job, dataset_fingerprint, config_fingerprint, world_size, created, updated, '', '[]', 0",
    2: f"{_JOB_COLUMNS}, 0",
    3: f"{_JOB_COLUMNS}, expires",
}

_JobRow = tuple[str, str, str, int, float, float, str, str]
_RankRow = tuple[int, int, int, int, float]


# A writing store checks at most this often that its file is still at its path.
_FILE_CHECK_S: Final = 1.0

# Guards a store's first call in a forked child, where the parent's locks may have been held.
_fork_lock = threading.Lock()


def _new_fork_lock() -> None:
    global _fork_lock
    _fork_lock = threading.Lock()


os.register_at_fork(after_in_child=_new_fork_lock)


def _file_kind(mode: int) -> str:
    """What a path that is not a regular file is, for an error message."""
    kinds = (
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISFIFO, "a FIFO (named pipe)"),
        (stat.S_ISSOCK, "a socket"),
    )
    return next((kind for test, kind in kinds if test(mode)), "not a regular file")


def _rank_state(row: _RankRow) -> RankState:
    rank, epoch, step, generation, last_seen = row
    return RankState(rank, Position(epoch, step), generation, last_seen)


def _job_state(row: _JobRow, ranks: list[_RankRow]) -> JobState:
    """A job as stored; ``StoreCorruptError`` if its row is not what this ladle writes (a hand edit)."""
    job, dataset_fp, config_fp, world_size, created, updated, incarnation, plan = row
    where = f"the jobs row of {job!r}"
    try:
        spec = JobSpec(job, dataset_fp, config_fp, world_size)
    except ConfigError as exc:
        raise StoreCorruptError(job, where, exc.field, f"holds an invalid {exc}") from None
    try:
        resizes = plan_from_json(plan)
    except (ValueError, TypeError):
        detail = f"holds plan={shown_value(plan)}, not a resize history"
        raise StoreCorruptError(job, where, "plan", detail) from None
    return JobState(spec, tuple(_rank_state(r) for r in ranks), created, updated, incarnation, resizes)


class EmbeddedStore(CursorStore):
    """A ``CursorStore`` in one SQLite file, shared safely by threads and processes.

    Each transaction takes a connection of its own from the store's pool (as
    many as run at once), so reads see a WAL snapshot and never wait for a
    write. Writes of one store object take turns in the process (threads queue
    here, not on SQLite's sleeping busy handler); processes and other store
    objects on the same file wait for its write lock. Each write waits at most
    ``busy_timeout_s`` in all (10 % more at worst), for its turn and the lock,
    then gets ``StoreUnavailableError``, however many writes wait with it.

    The file is created (not its directory) and its schema checked and
    migrated on construction, so a bad path fails at once (the write lock is
    taken only if there is a schema to create or migrate); a path that exists
    and is not a regular file (a directory, a device, a FIFO) is refused
    before SQLite touches it. Only that first connection may create the file:
    one made later to a path whose file was removed or replaced is refused
    (``StoreUnavailableError``, as ``ping`` does), and the first time the store
    finds this it logs a warning. A store object used in a forked child opens
    connections of its own there, never using the parent's. ``job_ttl_s`` (0:
    forever, the default here; ``open_store`` passes the server's
    ``--job-ttl``) is how long a job nobody writes to is kept.

    ``read_only=True`` opens the file with SQLite's ``mode=ro``: it must exist
    (``StoreError`` if not), its journal mode and schema are left as they are
    (schema versions 1 to ``SCHEMA_VERSION`` are read), it needs no write lock,
    and every write method raises ``StoreError``. On a folder it cannot write,
    a file with no WAL to read (no ``-wal``, or an empty one) and no ``-shm`` is
    read as immutable, on a fresh connection per transaction; one whose
    ``-wal`` holds changes but has no ``-shm`` is refused with ``StoreError``.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        clock: Clock = time.time,
        busy_timeout_s: float = 10.0,
        job_ttl_s: float = 0.0,
        read_only: bool = False,
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
        self.read_only = read_only
        # Later connections open the same file even if the process changes its directory.
        self._abspath = os.path.abspath(self.path)
        self._uri = "file:" + urllib.parse.quote(self._abspath)
        self._lock = threading.Lock()  # guards the pool; never held while SQLite waits
        self._returned = threading.Condition(self._lock)
        self._writing = threading.Lock()  # this object's writes take turns
        self._idle: list[sqlite3.Connection] = []
        self._in_use = 0
        self._pid = os.getpid()
        self._file_id = (0, 0)
        self._file_lost = False
        self._file_checked = 0.0  # time.monotonic() of the last check after a write
        self._closed = False
        self._check_path()
        db, reusable = self._connect(first=True)
        if reusable:
            self._idle.append(db)
        else:
            db.close()

    def __repr__(self) -> str:
        return f"EmbeddedStore({self.path!r}{', read_only=True' if self.read_only else ''})"

    # --- connections and transactions --------------------------------------

    def _unavailable(self, exc: sqlite3.Error) -> StoreUnavailableError:
        return StoreUnavailableError(f"cursor store {self.path}: {exc}{self._permission_hint(exc)}")

    def _permission_hint(self, exc: sqlite3.Error) -> str:
        """Which of the file and its folder this process cannot write, when SQLite's words do not say.

        SQLite says "attempt to write a readonly database" for a writable file
        in a folder it cannot write (WAL mode keeps ``-wal`` and ``-shm``
        beside the file), which sends an operator to chmod the wrong thing.
        """
        text = str(exc)
        if "readonly database" not in text and "unable to open database file" not in text:
            return ""
        who = f"uid {os.geteuid()}" if hasattr(os, "geteuid") else "this process"
        folder = os.path.dirname(self._abspath)
        if not os.access(folder, os.W_OK | os.X_OK):
            return (
                f" (its folder {folder} is not writable by {who}: SQLite's WAL mode writes "
                f"{os.path.basename(self._abspath)}-wal and -shm beside the file)"
            )
        if os.path.exists(self._abspath) and not os.access(self._abspath, os.W_OK):
            return f" (the file is not writable by {who})"
        return ""

    def _check_path(self) -> None:
        """Refuse, before SQLite opens it, a path that is no regular file (or, read-only, none at all)."""
        try:
            mode = os.stat(self.path).st_mode
        except (FileNotFoundError, NotADirectoryError):
            if self.read_only:
                raise StoreError(
                    f"no cursor store at {self.path} (a read-only store does not create one)"
                ) from None
            return
        except OSError:
            return  # SQLite reports it as it opens the path (no permission, a loop)
        if stat.S_ISDIR(mode):
            raise StoreError(
                f"cursor store {self.path}: is a directory, not a file "
                f"(give a file path, e.g. {os.path.join(self.path, 'state.db')})"
            )
        if not stat.S_ISREG(mode):
            raise StoreError(f"cursor store {self.path}: is {_file_kind(mode)}, not a regular file")

    def _connect(self, *, first: bool) -> tuple[sqlite3.Connection, bool]:
        """A new connection, and whether it may go back to the pool after its transaction.

        The ``first`` one (on construction) creates the file and migrates it
        (read-only: checks its schema); later ones must find the same file.
        """
        db: sqlite3.Connection | None = None
        try:
            if not first:
                self._refuse_lost_file()  # else SQLite would open (or create) whatever is there now
            if self.read_only:
                db, reusable = self._open_read_only()
                self._schema_version(db)
            else:
                db, reusable = self._open("mode=rwc" if first else "mode=rw"), True
                db.execute("PRAGMA synchronous = NORMAL")
                db.execute("PRAGMA foreign_keys = ON")
                if first:
                    (mode,) = db.execute("PRAGMA journal_mode = WAL").fetchone()
                    if str(mode).lower() != "wal":
                        raise StoreUnavailableError(
                            f"cursor store {self.path}: cannot switch to WAL mode (got {mode!r}); "
                            "is it on a network filesystem?"
                        )
                    self._migrate(db)
            if first:
                found = os.stat(self._abspath)
                self._file_id = (found.st_dev, found.st_ino)
            else:
                self._refuse_lost_file()  # replaced while this connection opened
        except BaseException as exc:
            if db is not None:
                db.close()
            if isinstance(exc, sqlite3.Error):
                raise self._unavailable(exc) from exc
            if isinstance(exc, OSError):
                raise StoreUnavailableError(f"cursor store {self.path}: {exc}") from exc
            raise
        return db, reusable

    def _open(self, query: str) -> sqlite3.Connection:
        return sqlite3.connect(
            f"{self._uri}?{query}",
            uri=True,
            timeout=self.busy_timeout_s,
            isolation_level=None,
            check_same_thread=False,
        )

    def _open_read_only(self) -> tuple[sqlite3.Connection, bool]:
        """A ``mode=ro`` connection that has read the file, else an immutable one where that is safe.

        Reading a WAL file needs its ``-shm``, which SQLite creates if the
        folder allows; without one, and with no WAL content to miss, the file
        is read as it is (``immutable``), never to be reused: a writer may
        start on it later.
        """
        db = self._open("mode=ro")
        try:
            db.execute("PRAGMA user_version").fetchone()  # opens the WAL and its -shm, if any
            return db, True
        except sqlite3.OperationalError as exc:
            db.close()
            shm, wal = f"{self._abspath}-shm", f"{self._abspath}-wal"
            folder = os.path.dirname(self._abspath)
            if (
                exc.sqlite_errorcode != sqlite3.SQLITE_CANTOPEN
                or os.path.exists(shm)
                or os.access(folder, os.W_OK)
            ):
                raise
            if os.path.exists(wal) and os.path.getsize(wal) > 0:
                raise StoreError(
                    f"cursor store {self.path}: cannot be read read-only: {wal} holds recent writes, "
                    f"but there is no {shm} and its folder is not writable to create one (copy the "
                    "file with its -wal to a writable folder, or open it once with write access)"
                ) from exc
        return self._open("mode=ro&immutable=1"), False

    def _schema_version(self, db: sqlite3.Connection) -> int:
        """The file's schema version; refuse files of a newer ladle or of another program."""
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
            if self.read_only:
                raise StoreError(
                    f"cursor store {self.path} is empty: `ladle serve` creates its schema "
                    "(a read-only store does not)"
                )
        return int(version)

    def _migrate(self, db: sqlite3.Connection) -> None:
        """Create the schema in a new file or bring an older one up to date (in one transaction).

        A file of the current schema needs no write lock, so a server starts beside a busy writer;
        one it cannot write (a read-only mount or file) is refused here all the same, not at the
        first trainer's write.
        """
        db.execute("BEGIN")
        try:
            current = self._schema_version(db) == SCHEMA_VERSION
        finally:
            db.rollback()
        if current:
            self._check_writable(db)
            return
        db.execute("BEGIN IMMEDIATE")
        try:
            version = self._schema_version(db)
            if version == 0:
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

    def _check_writable(self, db: sqlite3.Connection) -> None:
        """Raise what a write would (read-only file or mount), without waiting for another writer's lock."""
        # SQLite opens a file it cannot write read-only without a word; a write rolled back tells
        db.execute("PRAGMA busy_timeout = 0")
        try:
            db.execute("BEGIN IMMEDIATE")
            try:
                db.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
            finally:
                db.rollback()
        except sqlite3.OperationalError as exc:
            if exc.sqlite_errorcode != sqlite3.SQLITE_BUSY:  # busy: writable, another writer has the lock
                raise
        finally:
            db.execute(f"PRAGMA busy_timeout = {int(self.busy_timeout_s * 1000)}")

    def _after_fork(self) -> None:
        """In a forked child: forget the parent's connections and locks (never use or close them here)."""
        with _fork_lock:
            if self._pid == os.getpid():
                return  # another thread of this child did it
            self._lock = threading.Lock()
            self._returned = threading.Condition(self._lock)
            self._writing = threading.Lock()
            self._idle, self._in_use = [], 0
            self._pid = os.getpid()  # last: a thread that sees it sees the rest

    def _checkout(self) -> tuple[sqlite3.Connection, bool]:
        """A connection for one transaction (a pooled one if any is idle), and whether it goes back."""
        with self._lock:
            if self._closed:
                raise StoreUnavailableError(f"cursor store {self.path} is closed")
            self._in_use += 1
            if self._idle:
                return self._idle.pop(), True
        try:
            return self._connect(first=False)
        except BaseException:
            self._checkin(None, reusable=False)
            raise

    def _checkin(self, db: sqlite3.Connection | None, *, reusable: bool) -> None:
        with self._lock:
            self._in_use -= 1
            if db is not None and reusable and not self._closed and len(self._idle) < POOL_IDLE:
                self._idle.append(db)
            elif db is not None:
                db.close()
            if self._closed:
                self._returned.notify_all()

    def _take_turn(self) -> threading.Lock:
        """The lock of this store object's turn to write, held; the caller releases it.

        ``StoreUnavailableError`` after ``busy_timeout_s`` in line behind other writes.
        """
        turn = self._writing
        if turn.acquire(blocking=False):
            return turn
        if not turn.acquire(timeout=max(0.0, self.busy_timeout_s)):
            raise StoreUnavailableError(
                f"cursor store {self.path}: database is locked (waited {self.busy_timeout_s:g} s, "
                "in line behind another write of this process)"
            )
        return turn

    @contextmanager
    def _transaction(self, *, write: bool) -> Iterator[sqlite3.Connection]:
        """One transaction: committed if the body returns, rolled back (changing nothing) if it raises.

        Writes take the file's write lock up front (``BEGIN IMMEDIATE``), so a
        check-and-set never reads a state another writer is about to change;
        waiting for their turn and for the lock together takes about the busy
        timeout at most. Reads see one consistent snapshot (WAL) and never
        block writers or wait for them.
        """
        if write and self.read_only:
            raise StoreError(f"cursor store {self.path} is open read-only: writes are refused")
        if self._pid != os.getpid():
            self._after_fork()
        start = time.monotonic()
        turn = self._take_turn() if write else None
        try:
            db, reusable = self._checkout()
            # A write that waited long for its turn waits for the file lock only what is left.
            left = self.busy_timeout_s - (time.monotonic() - start)
            shortened = turn is not None and left < 0.9 * self.busy_timeout_s
            try:
                try:
                    if shortened:
                        db.execute(f"PRAGMA busy_timeout = {max(0, int(left * 1000))}")
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
                    with suppress(sqlite3.Error):
                        db.rollback()
                    raise self._unavailable(exc) from exc
            finally:
                if shortened:
                    with suppress(sqlite3.Error):
                        db.execute(f"PRAGMA busy_timeout = {int(self.busy_timeout_s * 1000)}")
                self._checkin(db, reusable=reusable)
        finally:
            if turn is not None:
                turn.release()
        if write and not self._file_lost and start - self._file_checked >= _FILE_CHECK_S:
            self._file_checked = start
            self._notice_lost_file()

    def _refuse_lost_file(self) -> None:
        """``StoreUnavailableError`` if the file at ``path`` is not the one this store opened."""
        problem = self._notice_lost_file()
        if problem is not None:
            raise StoreUnavailableError(f"cursor store {self.path} {problem}")

    def _notice_lost_file(self) -> str | None:
        """What became of the file at ``path`` since this store opened it (None: nothing); warns once.

        SQLite keeps reading and writing a file removed or replaced under it:
        the state it writes then is lost at the next restart.
        """
        try:
            found = os.stat(self._abspath)
        except OSError as exc:
            problem = f"was removed ({exc.strerror})"
        else:
            if (found.st_dev, found.st_ino) == self._file_id:
                return None
            problem = "was replaced by another file"
        with self._lock:
            first, self._file_lost = not self._file_lost, True
        if first:
            log.warning(
                "cursor store %s %s while this process had it open: %s",
                self.path,
                problem,
                "its reads see the old file"
                if self.read_only
                else "its writes go to a deleted file, and a restart loses them",
            )
        return problem

    # --- the hooks, one transaction each -----------------------------------

    def _expires(self, now: float) -> float:
        """The expiry a write at ``now`` gives its job: ``job_ttl_s`` later, or 0 (never)."""
        return now + self.job_ttl_s if self.job_ttl_s > 0 else 0.0

    @staticmethod
    def _expired(expires: float, now: float) -> bool:
        return 0 < expires <= now

    def _job_select(self, db: sqlite3.Connection) -> str:
        """The columns of a job's row and its expiry in this file (a read-only store reads any schema)."""
        return _JOB_SELECT[self._schema_version(db) if self.read_only else SCHEMA_VERSION]

    def _job_row(self, db: sqlite3.Connection, job: str, now: float, *, write: bool) -> _JobRow | None:
        """The job's row; None if there is none or it expired (its rows then deleted, in a write)."""
        found = db.execute(f"SELECT {self._job_select(db)} FROM jobs WHERE job = ?", (job,)).fetchone()
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
                for row in db.execute(f"SELECT {self._job_select(db)} FROM jobs ORDER BY job").fetchall()
                if not self._expired(row[-1], now)
            ]
            rows: list[tuple[str, int, int, int, int, float]] = db.execute(
                f"SELECT job, {_RANK_COLUMNS} FROM ranks ORDER BY job, rank"
            ).fetchall()
            ranks: dict[str, list[_RankRow]] = {row[0]: [] for row in jobs}
            for row in rows:
                if row[0] in ranks:
                    ranks[row[0]].append(row[1:])
        listed = []
        for job_row in jobs:
            try:
                listed.append(_job_state(job_row, ranks[job_row[0]]))
            except StoreCorruptError as exc:  # one bad row fails only its own job
                self._left_out(exc)
        return listed

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
        self._refuse_lost_file()

    def close(self) -> None:
        """Close every connection once the transactions in flight are done; idempotent."""
        if self._pid != os.getpid():
            self._after_fork()
        with self._lock:
            self._closed = True
            for db in self._idle:
                db.close()
            self._idle = []
            self._returned.wait_for(lambda: self._in_use <= 0)
