"""The cursor-store contract: where each job's per-rank cursors and fencing tokens live.

A store keeps, per job, its identity (``JobSpec``) and, per rank, a position,
a generation (the fencing token of the trainer process that holds the rank)
and when it was last seen; every mutating operation is one atomic
check-and-set, so any number of server threads, processes or replicas may
share a store. The trade-off: the store knows nothing of the schedule, so it
never checks a position against an epoch's length; the jobs layer does.
"""

from __future__ import annotations

import abc
import json
import logging
import math
import re
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from types import TracebackType
from typing import Generic, Self, TypeVar

from ladle.proto.codec import JOB_NAME_PATTERN, JOB_NAME_RULE, MAX_JOB_NAME_LEN

from ..errors import (
    ConfigError,
    CursorRegressionError,
    FencedError,
    JobMismatchError,
    StoreCorruptError,
    WorldSizeMismatchError,
)

__all__ = [
    "MAX_FINGERPRINT_LEN",
    "MAX_INDEX",
    "MAX_JOB_NAME_LEN",
    "MAX_WORLD_SIZE",
    "Clock",
    "CursorStore",
    "JobSpec",
    "JobState",
    "Position",
    "RankState",
    "Resize",
    "check_forward",
    "check_generation",
    "check_identity",
    "new_incarnation",
    "plan_from_json",
    "plan_to_json",
    "rank_outside",
    "resize_start",
    "shown_value",
    "validate_job_name",
]

log = logging.getLogger("ladle.store")

Clock = Callable[[], float]


def shown_value(value: object) -> str:
    """A stored value for an error message: quoted, and cut if long."""
    text = str(value)
    return repr(text if len(text) <= 60 else text[:57] + "...")


MAX_FINGERPRINT_LEN = 256
# The Redis store keeps integers in Lua numbers (doubles), exact up to 2**53.
MAX_INDEX = 2**53 - 1
# Every rank is a row (a hash field in Redis), written when a job is created.
MAX_WORLD_SIZE = 65536

_JOB_NAME = re.compile(JOB_NAME_PATTERN)


def _check_int(field: str, value: object, lo: int, hi: int = MAX_INDEX) -> int:
    # bool is an int subclass; True is never a meaningful rank or step.
    if not isinstance(value, int) or isinstance(value, bool):
        raise ConfigError(field, f"must be an integer, got {value!r}")
    if not lo <= value <= hi:
        raise ConfigError(field, f"must be in {lo}..{hi}, got {value}")
    return value


def validate_job_name(job: object) -> str:
    """``job`` if it is 1..200 characters of ``[A-Za-z0-9._:-]``, else ``ConfigError("job")``."""
    if not isinstance(job, str) or _JOB_NAME.fullmatch(job) is None:
        raise ConfigError("job", f"must be {JOB_NAME_RULE}, got {job!r}")
    return job


def check_job_ttl(value: object) -> float:
    """``value`` as a job time-to-live in seconds (0: jobs are kept forever), else ``ConfigError``."""
    if not isinstance(value, int | float) or isinstance(value, bool) or not math.isfinite(value) or value < 0:
        raise ConfigError("job_ttl_s", f"must be a number of seconds >= 0 (0: never), got {value!r}")
    return float(value)


def _check_fingerprint(field: str, value: object) -> None:
    if not isinstance(value, str) or not 1 <= len(value) <= MAX_FINGERPRINT_LEN:
        raise ConfigError(field, f"must be a string of 1..{MAX_FINGERPRINT_LEN} characters, got {value!r}")


@dataclass(frozen=True, slots=True)
class JobSpec:
    """A job's identity: a stored job resumes only under the same fingerprints and world size.

    Validated on construction (``ConfigError`` naming the field).
    """

    job: str
    dataset_fingerprint: str
    config_fingerprint: str
    world_size: int

    def __post_init__(self) -> None:
        validate_job_name(self.job)
        _check_fingerprint("dataset_fingerprint", self.dataset_fingerprint)
        _check_fingerprint("config_fingerprint", self.config_fingerprint)
        _check_int("world_size", self.world_size, 1, MAX_WORLD_SIZE)


@dataclass(frozen=True, order=True, slots=True)
class Position:
    """A rank's cursor: it has consumed every batch before ``(epoch, step)``.

    Ordered as the pair ``(epoch, step)``; both are in ``0..MAX_INDEX``
    (``ConfigError`` otherwise). A step may lie past an epoch's last step: the
    store does not know epoch lengths, the jobs layer normalises.
    """

    epoch: int
    step: int

    def __post_init__(self) -> None:
        _check_int("epoch", self.epoch, 0)
        _check_int("step", self.step, 0)


@dataclass(frozen=True, slots=True)
class RankState:
    """One rank of a job: its cursor, its current generation and when it was last seen.

    ``generation`` is 0 until a trainer process first joins the rank; each
    join increments it. ``last_seen`` is the store clock's time of the rank's
    last join, advance or rewind (the job's creation time if none yet).
    """

    rank: int
    position: Position
    generation: int
    last_seen: float


@dataclass(frozen=True, slots=True)
class Resize:
    """One change of a job's world size: where every rank of the old world stood when it happened.

    ``world_size`` is the size before the change (``len(cut) == world_size``);
    the size after it is the next ``Resize``'s ``world_size``, or the job's
    current one. The jobs layer re-plans the rest of each epoch the cut runs
    through (docs/product.md guarantee 7); the store only records it.
    """

    world_size: int
    cut: tuple[Position, ...]

    def __post_init__(self) -> None:
        _check_int("world_size", self.world_size, 1, MAX_WORLD_SIZE)
        if len(self.cut) != self.world_size or not all(isinstance(p, Position) for p in self.cut):
            raise ConfigError("cut", f"must be {self.world_size} Positions, one per rank of the old world")


def plan_to_json(plan: tuple[Resize, ...]) -> str:
    """The compact text a store keeps a job's resize history in (``[]`` for a job never resized)."""
    return json.dumps(
        [[r.world_size, [[p.epoch, p.step] for p in r.cut]] for r in plan], separators=(",", ":")
    )


def plan_from_json(text: str) -> tuple[Resize, ...]:
    """The inverse of ``plan_to_json``."""
    return tuple(
        Resize(int(size), tuple(Position(int(e), int(s)) for e, s in cut)) for size, cut in json.loads(text)
    )


def resize_start(cut: tuple[Position, ...]) -> Position:
    """Where every rank of the new world starts: step 0 of the re-planned rest of the earliest epoch."""
    return Position(min(p.epoch for p in cut), 0)


def new_incarnation() -> str:
    """A fresh random token naming one life of a job in a store (see ``JobState.incarnation``)."""
    return secrets.token_hex(8)


@dataclass(frozen=True, slots=True)
class JobState:
    """A job's identity and every rank's state (``ranks[r].rank == r``).

    ``created`` is when the job was (re)created; ``updated`` is the time of its
    last successful join, advance, rewind, resize or reconcile (``created`` if
    none). ``incarnation`` is a random token chosen when the job was created:
    a trainer that knew another incarnation is talking to a store that lost the
    job (a Redis restarted without persistence) or to a job that was reset.
    ``plan`` is the job's resize history, oldest first (``spec.world_size`` is
    the current size).
    """

    spec: JobSpec
    ranks: tuple[RankState, ...]
    created: float
    updated: float
    incarnation: str = ""
    plan: tuple[Resize, ...] = ()

    @property
    def job(self) -> str:
        return self.spec.job


# --- decisions every implementation makes the same way -----------------------
# A store calls these inside its atomic operation with the values it read, so
# every store refuses the same requests with the same typed errors. A store
# whose check runs elsewhere (a Redis Lua script) returns what it read and
# raises through these helpers.


def check_identity(stored: JobSpec, given: JobSpec) -> None:
    """Refuse to open ``stored`` as ``given`` unless fingerprints and world size agree.

    Fingerprint differences are reported first (``JobMismatchError`` naming
    each differing field, stored vs given value): a job on other data is the
    more fundamental mismatch. Then ``WorldSizeMismatchError``.
    """
    differences = tuple(
        (field, old, new)
        for field, old, new in (
            ("dataset_fingerprint", stored.dataset_fingerprint, given.dataset_fingerprint),
            ("config_fingerprint", stored.config_fingerprint, given.config_fingerprint),
        )
        if old != new
    )
    if differences:
        raise JobMismatchError(stored.job, differences)
    if stored.world_size != given.world_size:
        raise WorldSizeMismatchError(stored.job, stored.world_size, given.world_size)


def rank_outside(rank: int, world_size: int) -> ConfigError:
    """The error for a rank outside ``[0, world_size)``."""
    return ConfigError("rank", f"{rank} is outside 0..{world_size - 1} (world_size={world_size})")


def check_generation(job: str, rank: int, generation: int, current: int) -> None:
    """``FencedError`` unless ``generation`` is the rank's ``current`` generation."""
    if generation != current:
        raise FencedError(job, rank, generation, current)


def check_forward(job: str, rank: int, stored: Position, to: Position) -> None:
    """``CursorRegressionError`` if ``to`` lies before ``stored`` (equal is allowed)."""
    if to < stored:
        raise CursorRegressionError(job, rank, (stored.epoch, stored.step), (to.epoch, to.step))


T = TypeVar("T")


class SharedReads(Generic[T]):
    """Concurrent reads of one job's state share one store read that began after each of them was asked.

    A thousand ranks opening at once each read the whole job (every rank's
    cursor: milliseconds at that size). Asked while a read of the same job
    runs, a caller waits for it to end and then joins the next read with
    every other caller that arrived meanwhile: one read, begun after each of
    them asked, so each sees every write that ended before it asked, as its
    own read would have. Errors reach every caller of that read.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._waiting: dict[str, _Read[T]] = {}  # the next read of a job, not begun: callers join it
        self._running: dict[str, threading.Lock] = {}  # one read of a job at a time

    def get(self, job: str, read: Callable[[], T]) -> T:
        with self._lock:
            mine = self._waiting.get(job)
            lead = mine is None
            if mine is None:
                mine = self._waiting[job] = _Read[T]()
            running = self._running.setdefault(job, threading.Lock())
        if not lead:
            mine.done.wait()
            return mine.result()
        with running:
            with self._lock:
                del self._waiting[job]  # callers from now on wait for the next read
            try:
                mine.value = read()
            except BaseException as exc:
                mine.error = exc
                raise
            finally:
                mine.done.set()
                with self._lock:
                    if job not in self._waiting:
                        self._running.pop(job, None)
        return mine.result()


class _Read(Generic[T]):
    def __init__(self) -> None:
        self.done = threading.Event()
        self.value: T | None = None
        self.error: BaseException | None = None

    def result(self) -> T:
        if self.error is not None:
            raise self.error
        return self.value  # type: ignore[return-value]  # set before done (or error)


class CursorStore(abc.ABC):
    """Per-job, per-rank cursors with fencing; one contract for every backing store.

    Guarantees to callers (``tests/contract/store_contract.py`` checks each
    one against every implementation):

    * Every public method validates its arguments first (``ConfigError``
      naming the field), then runs as ONE atomic operation against the backing
      store: concurrent calls from any number of threads, processes and hosts
      behave as if run one at a time in some order, and a refused call changes
      nothing.
    * Unknown jobs raise ``JobNotFoundError`` (except ``delete_job``, which
      returns ``False``); a store that cannot be reached raises
      ``StoreUnavailableError``.
    * A stale trainer process (its generation is not the rank's current one)
      can neither advance nor rewind its rank (``FencedError``).
    * All times come from the injected ``clock``, read inside the operation.

    Contract for implementers: subclass, call ``super().__init__(clock=...)``
    and implement the ``_``-prefixed hooks and ``close``. The hooks receive
    arguments already validated by the public methods (job names well formed,
    ``0 <= rank``, ``rank < world_size`` for ``join``, ``generation >= 1``,
    valid ``Position``/``JobSpec``); each hook must be one atomic operation
    (one SQLite transaction, one Redis Lua script) that reads the time from
    ``self._now()`` and raises through ``check_identity``,
    ``rank_outside``, ``check_generation`` and ``check_forward``, in the
    order each public method's docstring gives. Keep each operation small and
    self-contained: no operation spans several round trips with the store.
    """

    def __init__(self, *, clock: Clock = time.time) -> None:
        self._clock = clock
        self._reads: SharedReads[JobState] = SharedReads()
        self._left_out_jobs: set[tuple[str, str, str]] = set()

    def _now(self) -> float:
        return float(self._clock())

    def _left_out(self, exc: StoreCorruptError) -> None:
        """Log a job a listing leaves out: at WARNING the first time this store meets it, then at DEBUG
        (the page lists the jobs every few seconds)."""
        seen = (exc.job, exc.key, exc.field)
        first = seen not in self._left_out_jobs
        if first and len(self._left_out_jobs) < 1000:
            self._left_out_jobs.add(seen)
        level = logging.WARNING if first else logging.DEBUG
        log.log(level, "cursor store %r: left out of the listing: %s", self, exc)

    # --- the public contract -----------------------------------------------

    def open_job(
        self,
        spec: JobSpec,
        *,
        reset: bool = False,
        incarnation: str | None = None,
        plan: tuple[Resize, ...] = (),
    ) -> JobState:
        """The job ``spec.job``, created if absent with every rank at ``Position(0, 0)``, generation 0.

        An existing job with the same spec is returned unchanged. One with
        another dataset or config fingerprint raises ``JobMismatchError``
        naming each differing field (stored vs given value); one with another
        world size raises ``WorldSizeMismatchError`` (fingerprints are checked
        first). ``reset=True`` deletes any existing job of that name and
        creates it afresh, whatever its spec.

        A job created here gets ``incarnation`` (a new random one if None) and
        the resize history ``plan``; both are ignored for an existing job. A
        server that finds its job gone from a store that lost it passes the
        values it knew, so the job comes back as it was (then ranks are
        restored with ``reconcile``).
        """
        if not isinstance(spec, JobSpec):
            raise ConfigError("spec", f"must be a JobSpec, got {type(spec).__name__}")
        if incarnation is None:
            incarnation = new_incarnation()
        if not isinstance(incarnation, str) or not 1 <= len(incarnation) <= MAX_FINGERPRINT_LEN:
            raise ConfigError("incarnation", f"must be a string of 1..{MAX_FINGERPRINT_LEN} characters")
        if not isinstance(plan, tuple) or not all(isinstance(r, Resize) for r in plan):
            raise ConfigError("plan", "must be a tuple of Resize")
        return self._open_job(spec, reset=bool(reset), incarnation=incarnation, plan=plan)

    def join(self, job: str, rank: int, world_size: int) -> RankState:
        """Register a (new) trainer process for ``rank``: its generation is incremented and returned.

        The returned generation is the fencing token the process passes to
        ``advance``/``rewind``; every earlier process of the rank is fenced
        off. The position is kept, ``last_seen`` refreshed. Checked in order:
        arguments (``ConfigError`` for a rank outside ``[0, world_size)``),
        ``JobNotFoundError``, ``WorldSizeMismatchError`` if ``world_size`` is
        not the job's.
        """
        validate_job_name(job)
        _check_int("world_size", world_size, 1, MAX_WORLD_SIZE)
        _check_int("rank", rank, 0, MAX_INDEX)
        if rank >= world_size:
            raise rank_outside(rank, world_size)
        return self._join(job, rank, world_size)

    def advance(self, job: str, rank: int, generation: int, to: Position) -> RankState:
        """Record that ``rank`` has consumed every batch before ``to``; a forward-only check-and-set.

        ``to`` may lie any number of steps or epochs ahead (callers batch
        acknowledgements); equal to the stored position it only refreshes
        ``last_seen``. Checked in order: arguments, ``JobNotFoundError``,
        ``ConfigError("rank")`` if ``rank >= world_size``, ``FencedError`` if
        ``generation`` is not the current one, ``CursorRegressionError`` if
        ``to`` lies before the stored position (which is kept).
        """
        self._check_move(job, rank, generation, to)
        return self._advance(job, rank, generation, to)

    def rewind(self, job: str, rank: int, generation: int, to: Position) -> RankState:
        """Move ``rank``'s cursor to ``to``, backwards or forwards (a trainer loading its checkpoint).

        Only this rank changes. Same checks as ``advance`` except the
        direction check.
        """
        self._check_move(job, rank, generation, to)
        return self._rewind(job, rank, generation, to)

    def resize(
        self, job: str, from_world_size: int, to_world_size: int, cut: tuple[Position, ...] | None = None
    ) -> JobState:
        """Change the job's world size (an elastic restart); returns the new state.

        ``cut`` is where each rank of the old world stands (a checkpoint's
        position for every rank); None takes the stored cursors. The cut is
        appended to ``plan``, every rank of the new world starts at
        ``resize_start(cut)`` with one generation above every generation the
        job has issued (so every process of the old world is fenced), and the
        ranks beyond the new size are removed. Checked in order: arguments
        (``ConfigError``: sizes outside 1..MAX_WORLD_SIZE or equal, a cut not
        of ``from_world_size`` positions), ``JobNotFoundError``; then, if the
        job already has ``to_world_size`` ranks, it is returned unchanged
        (another process of the new world resized it first);
        ``WorldSizeMismatchError`` if the stored size is not ``from_world_size``.
        """
        validate_job_name(job)
        _check_int("from_world_size", from_world_size, 1, MAX_WORLD_SIZE)
        _check_int("to_world_size", to_world_size, 1, MAX_WORLD_SIZE)
        if from_world_size == to_world_size:
            raise ConfigError("to_world_size", f"equals from_world_size ({to_world_size}): nothing to resize")
        if cut is not None:
            Resize(from_world_size, tuple(cut))  # validates
            cut = tuple(cut)
        return self._resize(job, from_world_size, to_world_size, cut)

    def reconcile(self, job: str, rank: int, generation: int, to: Position) -> RankState:
        """Restore a rank the store forgot: its cursor to ``to`` and its generation to ``generation``.

        For a store that lost recent writes (a Redis restarted without
        persistence or from an AOF a second old): the live trainer process
        still holds generation ``generation`` and has consumed every batch
        before ``to``; both are written back. Refused with ``FencedError`` if
        the stored generation is newer (that process really was replaced).
        Same argument checks as ``rewind``.
        """
        self._check_move(job, rank, generation, to)
        return self._reconcile(job, rank, generation, to)

    def get(self, job: str) -> JobState:
        """The job's state, read atomically (``JobNotFoundError`` if absent).

        Calls from several threads at once share one read (``SharedReads``).
        """
        name = validate_job_name(job)
        return self._reads.get(name, lambda: self._get(name))

    def list_jobs(self) -> list[JobState]:
        """Every job's state, sorted by job name (one consistent snapshot)."""
        return self._list_jobs()

    def delete_job(self, job: str) -> bool:
        """Delete the job and its ranks; ``True`` if it existed."""
        return self._delete_job(validate_job_name(job))

    def ping(self) -> None:
        """Return if the backing store can be reached and used, else raise ``StoreUnavailableError``."""
        self._ping()

    @abc.abstractmethod
    def close(self) -> None:
        """Release connections; idempotent. Later calls raise ``StoreUnavailableError``."""

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    @staticmethod
    def _check_move(job: str, rank: int, generation: int, to: Position) -> None:
        validate_job_name(job)
        _check_int("rank", rank, 0, MAX_INDEX)
        if (
            not isinstance(generation, int)
            or isinstance(generation, bool)
            or not 1 <= generation <= MAX_INDEX
        ):
            raise ConfigError("generation", f"must be the integer join returned (>= 1), got {generation!r}")
        if not isinstance(to, Position):
            raise ConfigError("to", f"must be a Position, got {type(to).__name__}")

    # --- the hooks each store implements, each one atomic operation ---------

    @abc.abstractmethod
    def _open_job(
        self, spec: JobSpec, *, reset: bool, incarnation: str, plan: tuple[Resize, ...]
    ) -> JobState: ...

    @abc.abstractmethod
    def _resize(
        self, job: str, from_world_size: int, to_world_size: int, cut: tuple[Position, ...] | None
    ) -> JobState: ...

    @abc.abstractmethod
    def _reconcile(self, job: str, rank: int, generation: int, to: Position) -> RankState: ...

    @abc.abstractmethod
    def _join(self, job: str, rank: int, world_size: int) -> RankState: ...

    @abc.abstractmethod
    def _advance(self, job: str, rank: int, generation: int, to: Position) -> RankState: ...

    @abc.abstractmethod
    def _rewind(self, job: str, rank: int, generation: int, to: Position) -> RankState: ...

    @abc.abstractmethod
    def _get(self, job: str) -> JobState: ...

    @abc.abstractmethod
    def _list_jobs(self) -> list[JobState]: ...

    @abc.abstractmethod
    def _delete_job(self, job: str) -> bool: ...

    # Whether ``_ping`` writes (Redis sets a readiness key): then a ping that succeeds also says the
    # store takes writes again, and a write refused before no longer makes the server unready.
    ping_writes = False

    @abc.abstractmethod
    def _ping(self) -> None: ...
