"""The schedules of every job of one server, each built once and kept while it is used.

A schedule is derived, never stored, and large (about 6 bytes a dataset
row): the cache keeps what open streams are on and what trainers come back to,
bounds what requests may have built (refusing beyond, ``ScheduleLimitError``),
and gives dropped schedules' memory back to the operating system.
"""

from __future__ import annotations

import contextlib
import contextvars
import ctypes
import functools
import math
import platform
import sys
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from typing import Final

from .errors import ConfigError, ScheduleBusyError, ScheduleLimitError
from .limits import MAX_SCHEDULES, SPARE_SCHEDULES
from .schedule import Schedule

__all__ = [
    "BUILD_WAIT_S",
    "COLD_WAIT_S",
    "HOT_SECONDS",
    "MAX_COLD_WAITING",
    "ScheduleCache",
    "ScheduleLease",
]

# What a server keeps of its jobs' schedules (ScheduleCache): every one an open stream is on,
# those used in the last HOT_SECONDS (at most MAX_SCHEDULES, a limit in .limits, beyond which Opens
# that need a build are refused), and SPARE_SCHEDULES (also in .limits) more; an Open that needs a
# build waits up to BUILD_WAIT_S while other builds fill the limit. Inspection builds one at a
# time, with MAX_COLD_WAITING requests waiting up to COLD_WAIT_S for their turn.
SWEEP_SECONDS: Final = 1.0  # a stream's use drops idle schedules at most this often
HOT_SECONDS: Final = 60.0
MAX_COLD_WAITING: Final = 2
COLD_WAIT_S: Final = 20.0
BUILD_WAIT_S: Final = 20.0
# Bucket edges kept (ScheduleCache.edges): one per (dataset, config) that builds use, a few in practice.
KEPT_EDGES: Final = 8

# The client whose request builds schedules now (ScheduleCache.admitting): set around an Open or a
# Describe, unset (None) for a stream's own builds, which are never refused.
_CLIENT: contextvars.ContextVar[str | None] = contextvars.ContextVar("ladle_schedule_client", default=None)


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    """glibc's ``malloc_trim``, or None (another C library, or not Linux)."""
    if sys.platform != "linux" or platform.libc_ver()[0] != "glibc":
        return None
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return None
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    return trim


class _Entry:
    """A kept schedule: when a use last made it hot, and the client whose Open or Describe built it."""

    __slots__ = ("owner", "schedule", "used")

    def __init__(self, schedule: Schedule, used: float, owner: str | None) -> None:
        self.schedule = schedule
        self.used = used
        self.owner = owner


class ScheduleLease:
    """An open stream's hold on the schedule it is on (``ScheduleCache.lease``).

    The epoch it holds and the next are in use: never dropped, counted
    against no limit. ``move`` follows the stream into another epoch;
    ``release`` (at its end; again is a no-op) leaves both kept for
    ``HOT_SECONDS``, for the trainer to come back to.
    """

    __slots__ = ("_cache", "_held", "client", "epoch", "fingerprint")

    def __init__(self, cache: ScheduleCache, fingerprint: str, epoch: int, client: str | None) -> None:
        self._cache = cache
        self.fingerprint = fingerprint
        self.epoch = epoch
        self.client = client
        self._held = True

    def move(self, epoch: int) -> None:
        if epoch != self.epoch:
            self._cache._move(self, epoch)

    def release(self) -> None:
        self._cache._release(self)


class ScheduleCache:
    """The schedules of every job of one server, each built once per (schedule fingerprint, epoch).

    Jobs of one world size and resize history follow the same schedule, so
    they share it. What is kept is bounded by use, not by how many jobs the
    server has seen or clients ask for. A schedule of a 10M-row dataset holds
    about 100 MB and takes about a second to build
    (``benchmarks/bench_schedule.py``); one of 200,000 rows, 2 MB.

    * In use: the epoch each open stream is on (its ``lease``) and the one
      after it (prepared ahead for the boundary). Never dropped, never
      counted: a server holds what its streams need.
    * Recent: the others a hot use (an Open, a Describe of a job's epoch, a
      stream that ended on it) touched in the last ``hot_s`` seconds, and the
      epoch after each, what a trainer that restarts comes back to. At most
      ``most``; beyond, the least recently used go, the unclaimed ones (see
      below) first, then those of the client that has the most.
    * Idle: the ``spare`` most recently used of the rest (an idle job's, an
      epoch only inspected, epochs streams have moved past).

    A build for a request (an Open or a Describe: inside ``admitting``) is
    counted with the recent schedules built for requests, the claimed ones,
    while it runs, and refused (``ScheduleLimitError``, RESOURCE_EXHAUSTED)
    when the claimed schedules of its client and its builds reach
    ``per_client``, or those of all clients reach ``most``. When builds in
    progress fill the server's limit, it waits up to ``BUILD_WAIT_S`` for one
    to end (a crowd of trainers reconnecting together). So a client opening
    stream after stream of new world sizes or start epochs holds ``per_client``
    schedules for a minute, everyone such clients ``most``, and then is
    refused until they age. A stream's own builds (the next epoch, an epoch
    it reaches) are never refused. The memory of dropped schedules goes back
    to the operating system (glibc's ``malloc_trim``, on a thread): glibc
    otherwise keeps it in its arenas.

    Builds for inspection (the HTTP face: ``hot=False``) run one at a time,
    with at most ``MAX_COLD_WAITING`` requests waiting up to ``COLD_WAIT_S``
    for their turn; any more raise ``ScheduleBusyError`` (HTTP 503), so
    requests for many epochs cannot fill the server's memory or its threads.
    """

    def __init__(
        self,
        spare: int = SPARE_SCHEDULES,
        hot_s: float = HOT_SECONDS,
        *,
        most: int = MAX_SCHEDULES,
        per_client: int | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if spare < 0:
            raise ConfigError("spare", f"must be >= 0, got {spare}")
        self.spare = spare
        self.hot_s = hot_s
        self.set_limits(most, per_client)
        self._clock = clock
        # (fingerprint, epoch) -> what is kept of it, least recently used first
        self._items: OrderedDict[tuple[str, int], _Entry] = OrderedDict()
        self._building: set[tuple[str, int]] = set()
        self._claiming: dict[tuple[str, int], str] = {}  # builds for requests -> their client
        self._leases: dict[tuple[str, int], int] = {}  # (fingerprint, epoch) -> streams on it
        self._cold_building = False
        self._cold_waiting = 0
        self._changed = threading.Condition(threading.Lock())
        self._swept = -math.inf  # when _evict last ran
        self._trimming = self._untrimmed = False
        # (dataset fingerprint, config fingerprint) -> the bucket edges of every epoch's schedule
        self._edges: OrderedDict[tuple[str, str], tuple[int, ...]] = OrderedDict()

    def set_limits(self, most: int, per_client: int | None = None) -> None:
        """The limits on claimed schedules: ``most`` for the server, ``per_client`` (default half)."""
        per_client = per_client or max(1, most // 2)
        if most < 1 or not 1 <= per_client <= most:
            raise ConfigError(
                "max_schedules", f"must be >= 1 and >= the per-client limit, got {most}, {per_client}"
            )
        self.most, self.per_client = most, per_client

    def __len__(self) -> int:
        """Schedules kept (dropping those gone idle first: a scrape of the gauge sweeps too)."""
        with self._changed:
            dropped = self._evict()
        self._trim(dropped)
        return len(self._items)

    def edges(self, key: tuple[str, str], resolve: Callable[[], tuple[int, ...]]) -> tuple[int, ...]:
        """The bucket edges under ``key`` (dataset and config fingerprints), ``resolve()``d once.

        Every epoch and world size of one dataset and config shares them
        (``schedule.bucket_edges``), so a build does not resolve ``auto``
        edges again: seconds of a 10^8-row build. Two builds that ask at once
        may both resolve them (the same edges); the last ``KEPT_EDGES`` keys are kept.
        """
        with self._changed:
            kept = self._edges.get(key)
            if kept is not None:
                self._edges.move_to_end(key)
                return kept
        resolved = resolve()
        with self._changed:
            self._edges[key] = resolved
            while len(self._edges) > KEPT_EDGES:
                self._edges.popitem(last=False)
        return resolved

    def has(self, key: tuple[str, int]) -> bool:
        with self._changed:
            return key in self._items

    @contextlib.contextmanager
    def admitting(self, client: str) -> Iterator[None]:
        """Builds in this context (its thread, or ``asyncio.to_thread``s begun in it) are for ``client``.

        Each is counted against the limits on claimed schedules, and refused
        beyond them (see the class). Builds outside any such context (a
        stream's own, ``warm``'s, a program that uses a registry directly) are
        not.
        """
        token = _CLIENT.set(client)
        try:
            yield
        finally:
            _CLIENT.reset(token)

    def lease(self, fingerprint: str, epoch: int, client: str | None = None) -> ScheduleLease:
        """Hold ``(fingerprint, epoch)`` and the epoch after it in use for a stream, until ``release``."""
        lease = ScheduleLease(self, fingerprint, epoch, client)
        with self._changed:
            self._pin((fingerprint, epoch), 1)
        return lease

    def _pin(self, key: tuple[str, int], n: int) -> None:
        left = self._leases.get(key, 0) + n
        if left > 0:
            self._leases[key] = left
        else:
            self._leases.pop(key, None)

    def _in_use(self, key: tuple[str, int]) -> bool:
        fingerprint, epoch = key
        return key in self._leases or (fingerprint, epoch - 1) in self._leases

    def _move(self, lease: ScheduleLease, epoch: int) -> None:
        with self._changed:
            if not lease._held:
                return
            left = (lease.fingerprint, lease.epoch)
            self._pin(left, -1)
            lease.epoch = epoch
            self._pin((lease.fingerprint, epoch), 1)
            entry = self._items.get(left)
            if entry is not None and epoch > left[1] and not self._in_use(left):
                entry.used = -math.inf  # an epoch streams moved past: idle, not what a trainer comes back to

    def _release(self, lease: ScheduleLease) -> None:
        with self._changed:
            if not lease._held:
                return
            lease._held = False
            key = (lease.fingerprint, lease.epoch)
            self._pin(key, -1)
            now = self._clock()
            for at in (key, (key[0], key[1] + 1)):
                entry = self._items.get(at)
                if entry is not None:
                    entry.used = max(entry.used, now)  # kept for the trainer to come back to
            dropped = self._evict()
        self._trim(dropped)

    def cached(self, key: tuple[str, int], *, hot: bool) -> Schedule | None:
        """The schedule under ``key`` if it is kept (a use, as ``get``), else None; never builds."""
        with self._changed:
            sched, dropped = self._hit(key, hot)
        self._trim(dropped)
        return sched

    def _hit(self, key: tuple[str, int], hot: bool) -> tuple[Schedule | None, int]:
        """``cached`` with the lock held, and how many schedules a sweep dropped."""
        entry = self._items.get(key)
        if entry is None:
            return None, 0
        self._items.move_to_end(key)
        dropped = 0
        if hot:
            now = entry.used = self._clock()
            if now - self._swept >= SWEEP_SECONDS:  # schedules gone idle go without waiting for a build
                dropped = self._evict()
        return entry.schedule, dropped

    def get(self, key: tuple[str, int], build: Callable[[], Schedule], *, hot: bool) -> Schedule:
        """The schedule under ``key``, built with ``build()`` if it is not kept (once for every caller).

        Raises ``ScheduleLimitError`` for a build for a request beyond the
        limits, ``ScheduleBusyError`` for an inspection beyond its queue.
        """
        client = _CLIENT.get() if hot else None
        deadline: float | None = None
        dropped = 0
        try:
            with self._changed:
                while True:
                    kept, swept = self._hit(key, hot)
                    dropped += swept
                    if kept is not None:
                        return kept
                    if key in self._building:
                        self._changed.wait()  # built by another caller: take theirs
                        continue
                    if hot:
                        if client is None:
                            break  # a stream's own build
                        refused, can_wait = self._refusal(client)
                        if refused is None:
                            break
                        if not can_wait:
                            raise refused
                        if deadline is None:
                            deadline = self._clock() + BUILD_WAIT_S
                        left = deadline - self._clock()
                        if left <= 0:
                            raise refused
                        self._changed.wait(left)  # other requests' builds fill the limit: one may end
                        continue
                    if not self._cold_building:
                        break
                    if deadline is None:
                        if self._cold_waiting >= MAX_COLD_WAITING:
                            raise self._busy()
                        deadline = self._clock() + COLD_WAIT_S
                    left = deadline - self._clock()
                    if left <= 0:
                        raise self._busy()
                    self._cold_waiting += 1
                    try:
                        self._changed.wait(left)
                    finally:
                        self._cold_waiting -= 1
                self._building.add(key)
                if client is not None:
                    self._claiming[key] = client
                if not hot:
                    self._cold_building = True
        finally:
            self._trim(dropped)
        built: Schedule | None = None
        try:
            built = build()
            return built
        finally:
            with self._changed:
                self._building.discard(key)
                self._claiming.pop(key, None)
                if not hot:
                    self._cold_building = False
                if built is not None:
                    self._items[key] = _Entry(built, self._clock() if hot else -math.inf, client)
                    dropped = self._evict()
                self._changed.notify_all()
            self._trim(dropped)

    def warm(self, key: tuple[str, int], build: Callable[[], Schedule]) -> None:
        """Build ``key``'s schedule on a thread of its own unless it is kept or being built.

        A stream's own build (its next epoch): never refused, whatever context it is called in.
        """
        with self._changed:
            if key in self._items or key in self._building:
                return
        threading.Thread(
            target=contextvars.Context().run,
            args=(self.get, key, build),
            kwargs={"hot": True},
            name=f"ladle-plan-{key[1]}",
            daemon=True,
        ).start()

    def _kept(self, now: float) -> tuple[list[tuple[str, int]], list[tuple[str, int]]]:
        """(recent, idle): the schedules no stream is on, least recently used first (see the class)."""
        hot = {key for key, entry in self._items.items() if now - entry.used <= self.hot_s}
        hot.update([(fingerprint, epoch + 1) for fingerprint, epoch in hot])
        recent: list[tuple[str, int]] = []
        idle: list[tuple[str, int]] = []
        for key in self._items:
            if not self._in_use(key):
                (recent if key in hot else idle).append(key)
        return recent, idle

    def _refusal(self, client: str) -> tuple[ScheduleLimitError | None, bool]:
        """Why ``client`` may not have a schedule built now (None: it may), and whether waiting may help."""
        now = self._clock()
        recent, _ = self._kept(now)
        claimed = [(self._items[key].owner, self._items[key].used) for key in recent]
        claimed = [(owner, used) for owner, used in claimed if owner is not None]
        building = list(self._claiming.values())
        mine = sum(1 for owner, _ in claimed if owner == client) + building.count(client)
        # the seconds until the first claimed schedule (of the client's, when its limit is the one) ages
        ages = [used for owner, used in claimed if math.isfinite(used)]
        if mine >= self.per_client:
            ages = [used for owner, used in claimed if owner == client and math.isfinite(used)] or ages
            return self._exhausted(client, mine, len(building), ages, now, per_client=True), False
        if len(claimed) >= self.most:
            return self._exhausted(client, len(claimed), len(building), ages, now), False
        if len(claimed) + len(building) >= self.most:
            return self._exhausted(client, len(claimed) + len(building), len(building), ages, now), True
        return None, False

    def _exhausted(
        self,
        client: str,
        held: int,
        building: int,
        ages: list[float],
        now: float,
        *,
        per_client: bool = False,
    ) -> ScheduleLimitError:
        retry = max(1, math.ceil(min(ages, default=now) + self.hot_s - now))
        what = (
            f"schedules that no stream uses and that requests had this batch server build in the last "
            f"{self.hot_s:.0f} s (new world sizes or start epochs; {building} building now)"
        )
        if per_client:
            message = (
                f"client {client} already holds {held} {what}; its limit (ladle serve "
                f"--max-schedules-per-client) is {self.per_client}"
            )
        else:
            message = (
                f"this batch server already holds {held} {what}; its limit (ladle serve --max-schedules) "
                f"is {self.most}"
            )
        return ScheduleLimitError(
            f"{message}. Each holds about 6 bytes a dataset row. Ask again in {retry} s, when the "
            "oldest is no longer kept for its trainer to come back to, or raise the limit",
            "too_many_schedules_per_client" if per_client else "too_many_schedules",
            retry,
        )

    def _evict(self) -> int:
        """Drop what is over the limits (see the class); returns how many schedules went.

        The epoch after one in use counts as in use: it was prepared ahead
        (``Job.warm``) for the streams that reach its boundary, maybe hours
        later, and dropping it would pause them while it is built again.
        """
        now = self._swept = self._clock()
        recent, idle = self._kept(now)
        drop = idle[: max(0, len(idle) - self.spare)]
        over = len(recent) - self.most
        if over > 0:  # streams that ended on epochs no request built: theirs go first
            unclaimed = [key for key in recent if self._items[key].owner is None][:over]
            drop += unclaimed
            over -= len(unclaimed)
            owners: dict[str, list[tuple[str, int]]] = {}
            for key in recent:
                owner = self._items[key].owner
                if owner is not None:
                    owners.setdefault(owner, []).append(key)
            for _ in range(over):
                largest = max(owners.values(), key=len)
                drop.append(largest.pop(0))
        for key in drop:
            del self._items[key]
        if drop:
            self._untrimmed = True
        return len(drop)

    def _trim(self, dropped: int) -> None:
        """After schedules were dropped: give their memory back to the operating system, on a thread."""
        if not dropped or _malloc_trim() is None:
            return
        with self._changed:
            if self._trimming or not self._untrimmed:
                return
            self._trimming = True
        threading.Thread(target=self._trim_freed, name="ladle-trim", daemon=True).start()

    def _trim_freed(self) -> None:
        trim = _malloc_trim()
        while True:
            with self._changed:
                if not self._untrimmed or trim is None:
                    self._trimming = False
                    return
                self._untrimmed = False
            trim(0)  # a few ms: returns the free pages of every arena (numpy's large arrays among them)

    @staticmethod
    def _busy() -> ScheduleBusyError:
        return ScheduleBusyError(
            "the server is already building the schedules of other epochs for inspection "
            f"(one at a time, {MAX_COLD_WAITING} waiting at most); ask again in a few seconds"
        )
