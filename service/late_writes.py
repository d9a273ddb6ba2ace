"""What streams leave unwritten: the last acknowledged position of a stream that ended without it stored.

A stream whose last cursor write is still in flight when it ends is in doubt
until the write ends; one whose store did not answer has its position retried
(``LATE_WRITE_S``, at most ``LATE_WRITE_MAX_DELAY_S`` apart) until the store
takes it, a newer stream of the rank takes over, or the server shuts down
(``finish``: one last try each, then every position not stored is named).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Any

from .errors import StoreUnavailableError
from .flow import StreamSession
from .lease import Position

__all__ = ["LATE_WRITE_MAX_DELAY_S", "LATE_WRITE_S", "LateWrites"]

log = logging.getLogger("ladle.server")
# how long a position is retried, and the longest wait between tries
LATE_WRITE_S = 600.0
LATE_WRITE_MAX_DELAY_S = 5.0


@dataclass
class _LateWrite:
    """The retry of the last position of a stream that ended unwritten (kept on the event loop)."""

    session: StreamSession
    target: Position
    task: asyncio.Task[None] | None = None
    trying: bool = False  # a try is with the store now
    error: BaseException | None = None  # what the last try failed with


class LateWrites:
    """The positions ended streams left unwritten, by (job, rank); used on the event loop only."""

    def __init__(self, store_executor: Executor) -> None:
        self.store_executor = store_executor
        # (job, rank) -> the retry of a position an ended stream could not write
        self._retries: dict[tuple[str, int], _LateWrite] = {}
        # (job, rank) -> an ended stream whose last write is still in flight
        self._in_doubt: dict[tuple[str, int], StreamSession] = {}
        # set at shutdown: every retry makes its last try at once (finish)
        self._last_tries = asyncio.Event()

    def taken(self, key: tuple[str, int]) -> None:
        """A new stream of the rank took its position: no retry of an older one."""
        late = self._retries.pop(key, None)
        if late is not None and late.task is not None:
            late.task.cancel()
        self._in_doubt.pop(key, None)

    async def finish(self, until: float, hurried: Callable[[], bool] = lambda: False) -> None:
        """Store what ended streams left unwritten before ``until``, then name what is not (at shutdown).

        Called on the event loop once the streams have ended; ``until`` is the
        end of the grace period on the loop's clock, ``hurried()`` says it was
        cut short (a second signal). Every retry makes one last try at once,
        rather than at its next time (the store may have answered again since
        its last failure), and writes still in flight are waited for (one that
        fails gets its last try too). Each position is logged by what became of
        it: written at shutdown, failed at shutdown (with the store's error),
        or still waiting for the store when the grace period ended.
        """
        loop = asyncio.get_running_loop()
        self._last_tries.set()
        while not hurried():
            waiting: list[asyncio.Future[Any]] = [
                late.task for late in self._retries.values() if late.task is not None
            ]
            waiting += [s.writing for s in self._in_doubt.values() if s.writing is not None]
            left = until - loop.time()
            if not waiting or left <= 0:
                break
            await asyncio.wait(waiting, timeout=min(left, 0.1))
            await asyncio.sleep(0)  # an ended write's callbacks run: a failed one starts its last try
        for (job, rank), late in list(self._retries.items()):
            if late.task is not None:
                late.task.cancel()
            if late.trying:
                log.warning(
                    "the last write of job %s rank %d (position %s) was still waiting for the store when "
                    "the grace period ended%s; a trainer that restarts without its checkpoint may repeat "
                    "batches",
                    job,
                    rank,
                    late.target,
                    f" (its try before failed: {late.error})" if late.error is not None else "",
                )
            else:
                log.warning(
                    "job %s rank %d: its trainer's position %s was never stored: the grace period ended "
                    "before a last try%s; a trainer that restarts without its checkpoint repeats batches",
                    job,
                    rank,
                    late.target,
                    f" (the try before failed: {late.error})" if late.error is not None else "",
                )
        self._retries.clear()
        for (job, rank), session in list(self._in_doubt.items()):
            if session.in_doubt:
                log.warning(
                    "job %s rank %d: its trainer's position %s may not be stored (its write was still "
                    "waiting for the store when the grace period ended); a trainer that restarts without "
                    "its checkpoint may repeat batches",
                    job,
                    rank,
                    session.acked,
                )
        self._in_doubt.clear()

    def ended(self, session: StreamSession) -> None:
        """A stream ended, or the write it left in flight did: retry a position the store did not take."""
        key = (session.job.name, session.rank)
        if session.in_doubt:
            self._in_doubt[key] = session
            return
        if self._in_doubt.get(key) is session:
            del self._in_doubt[key]
        if session.unwritten:
            self._retry(session)

    def _retry(self, session: StreamSession) -> None:
        """Keep trying the last position of a stream that ended unwritten, until the store takes it.

        The trainer may have read its last batch and closed (the end of its
        run): nobody reconnects to put the position back, and without this a
        restart without a checkpoint would repeat everything since the last
        write the store took (an epoch, with a store that hung for seconds).
        A write for the same rank by a newer process is fenced, so a trainer
        that reconnected wins. At shutdown (``end_late_writes``) the retry
        stops waiting and makes its last try at once.
        """
        key = (session.job.name, session.rank)
        late = _LateWrite(session, session.acked)
        target = late.target
        earlier = self._retries.pop(key, None)
        if earlier is not None and earlier.task is not None:
            earlier.task.cancel()

        async def retry() -> None:
            loop = asyncio.get_running_loop()
            give_up, delay = loop.time() + LATE_WRITE_S, 0.5
            try:
                while True:
                    if not self._last_tries.is_set():
                        with contextlib.suppress(TimeoutError):  # the shutdown ends the wait early
                            await asyncio.wait_for(self._last_tries.wait(), delay)
                    last = self._last_tries.is_set()  # the shutdown had begun when this try began
                    late.trying = True
                    try:
                        store = session.lease.store_late
                        stored = await loop.run_in_executor(self.store_executor, store, target)
                    except StoreUnavailableError as exc:
                        late.error = exc
                        if last:
                            log.warning(
                                "the last write of job %s rank %d (position %s) failed at shutdown: %s; a "
                                "trainer that restarts without its checkpoint repeats batches",
                                *key,
                                target,
                                exc,
                            )
                            return
                        if self._last_tries.is_set():
                            continue  # failed as the shutdown began: its last try, at once
                        if loop.time() + delay > give_up:
                            log.warning(
                                "job %s rank %d: gave up storing position %s after %.0f s (%s); a trainer "
                                "that restarts without its checkpoint repeats batches",
                                *key,
                                target,
                                LATE_WRITE_S,
                                exc,
                            )
                            return
                        delay = min(delay * 2, LATE_WRITE_MAX_DELAY_S)
                        continue
                    except Exception:
                        log.exception("job %s rank %d: storing position %s failed", *key, target)
                        return
                    finally:
                        late.trying = False
                    if stored and last:
                        log.info(
                            "the last write of job %s rank %d (position %s) was written at shutdown",
                            *key,
                            target,
                        )
                    elif stored:
                        log.info("job %s rank %d: position %s stored after the store came back", *key, target)
                    else:
                        log.info(
                            "job %s rank %d: position %s not stored: the job is not the one its stream "
                            "served any more (deleted, expired, reset or resized, or the rank taken by a "
                            "newer process)",
                            *key,
                            target,
                        )
                    return
            finally:
                if self._retries.get(key) is late:
                    del self._retries[key]

        late.task = asyncio.get_running_loop().create_task(retry())
        self._retries[key] = late
