"""The gRPC face: ``ladle.v1.BatchService`` (Stream and Describe).

The server runs on grpc's asyncio API: every stream is a coroutine on one
event loop, so a batch crosses no thread on its way out (the synchronous
server's thread hand-offs cost more CPU per batch than the batch itself).

One ``Stream`` call serves one rank of one job: it validates the first
request (``Open``), joins the job in the cursor store (a new fencing
generation), positions the rank (the trainer's checkpoint, or the stored
cursor), and then sends that rank's batches in schedule order as raw frames,
at most ``prefetch`` ahead of the trainer's credits. Acknowledgements move the
stored cursor, written behind in small groups (one store write per
``ACK_FLUSH_SECONDS`` at most, and always at the end of the stream), because
one round trip per batch halves throughput (MEASURED.md).

Errors map once, from ``LadleError.kind`` to a gRPC status, with a
``ladle.v1.Error`` in the trailing metadata.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import threading
import time
import urllib.parse
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Sequence
from concurrent.futures import Executor, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import grpc
from google.protobuf.message import DecodeError  # type: ignore[import-untyped]

from ladle.proto import codec, rpc
from ladle.proto import ladle_pb2 as pb

from .assemble import Assembler
from .errors import (
    CheckpointPositionError,
    ConfigError,
    FencedError,
    JobNotFoundError,
    LadleError,
    ScheduleLimitError,
    StoreUnavailableError,
    reason_of,
)
from .first_request import NoRequestError, first_request
from .jobs import Job, JobRegistry, ScheduleLease
from .limits import Limits
from .metrics import ServerMetrics, StreamMeter
from .schedule import Schedule
from .start import (
    ALIGNED_START_S,
    RESUME_CLAIM_LIMIT,
    AlignedStart,
    HotPositions,
    Opening,
    Resume,
    StartDecision,
    decide_start,
)
from .store.base import MAX_INDEX, Position, RankState

__all__ = [
    "ACK_FLUSH_SECONDS",
    "RESUME_CLAIM_LIMIT",
    "RESUME_GENERATION_LIMIT",
    "STORE_WRITERS",
    "BatchServicer",
    "StreamAbortedError",
    "status_of",
]

log = logging.getLogger("ladle.server")
ACK_FLUSH_SECONDS = 0.05
# Threads that write streams' cursors to the store (each stream has at most one write in flight).
STORE_WRITERS = 16
# Threads that answer Describe (store reads, schedule builds): apart from the Opens' threads, so a
# crowd of Describes never queues ahead of a trainer's Open
DESCRIBERS = 2
# A stream that ended with its last acknowledged position unwritten (the store did not answer) has
# it written when the store answers again: tried this long, at most LATE_WRITE_MAX_DELAY_S apart,
# and once more at once when the server shuts down (within its grace period).
LATE_WRITE_S = 600.0
LATE_WRITE_MAX_DELAY_S = 5.0
# A reconnecting client's Resume.generation at most (checked before the join): the generation of its
# last StreamStart, and one is issued per stream opened
RESUME_GENERATION_LIMIT = 2**32
# (RESUME_CLAIM_LIMIT, in .start: the largest Resume.generation a store that lost it is given back)
# Longest error message sent back: the status details and the trailer both carry it, and
# a client refuses response headers and trailers over 16 KiB or so.
_MAX_MESSAGE_CHARS = 2000

_STATUS = {
    "invalid_argument": grpc.StatusCode.INVALID_ARGUMENT,
    "failed_precondition": grpc.StatusCode.FAILED_PRECONDITION,
    "not_found": grpc.StatusCode.NOT_FOUND,
    "unavailable": grpc.StatusCode.UNAVAILABLE,
    "unauthenticated": grpc.StatusCode.UNAUTHENTICATED,
    "resource_exhausted": grpc.StatusCode.RESOURCE_EXHAUSTED,
    "internal": grpc.StatusCode.INTERNAL,
}


def status_of(exc: BaseException) -> Any:
    """The gRPC status code for an exception (INTERNAL for anything that is not a LadleError)."""
    if isinstance(exc, LadleError):
        return _STATUS.get(exc.kind, grpc.StatusCode.INTERNAL)
    return grpc.StatusCode.INTERNAL


class StreamAbortedError(LadleError):
    """A stream ends on purpose with a status (bad request, replaced, out of credit misuse)."""

    def __init__(self, kind: str, reason: str, message: str, field: str = "") -> None:
        self.kind = kind  # type: ignore[misc]
        self.reason = reason
        self.field = field
        super().__init__(message)


async def _abort(context: Any, exc: BaseException) -> None:
    """End the call with the status of ``exc`` and a ``ladle.v1.Error`` trailer (never returns)."""
    code = status_of(exc)
    reason = reason_of(exc)
    field = getattr(exc, "field", "") or ""
    message = str(exc) if isinstance(exc, LadleError) else f"internal error: {type(exc).__name__}"
    if len(message) > _MAX_MESSAGE_CHARS:  # it may quote what the client sent (a 60 KB job name)
        message = message[:_MAX_MESSAGE_CHARS] + "... (cut)"
    await rpc.abort(context, code, str(reason)[:200], message, str(field)[:200])


def _why(failure: BaseException | None) -> str:
    """Why a stream ended, for its log line."""
    if failure is None:
        return "ended by the trainer (closed, cancelled or gone)"
    reason = getattr(failure, "reason", "")
    kind = failure.kind if isinstance(failure, LadleError) else type(failure).__name__
    return f"{kind}{'/' + reason if reason else ''}: {failure}"


def _gone(exc: BaseException) -> str:
    """What a failed write raised, in a few words (grpc's ExecuteBatchError names only its operation)."""
    name = type(exc).__name__
    return "the trainer went away" if name == "ExecuteBatchError" else f"{name}: {exc}"


def _printable(text: str, most: int = 200) -> str:
    """Free text a client sent (``Open.client_id``) as it goes in one log line: escaped, cut at ``most``."""
    cut = text[:most]
    if not cut.isprintable():  # a newline would start a forged log line
        cut = cut.encode("unicode_escape").decode("ascii")
    return cut + (f"... ({len(text)} characters)" if len(text) > most else "")


def _peer_host(peer: str) -> str:
    """The host of a gRPC peer: 'ipv4:10.0.0.5:4242' -> '10.0.0.5', 'ipv6:[::1]:4242' -> '::1'."""
    kind, _, rest = urllib.parse.unquote(peer).partition(":")
    if kind in ("ipv4", "ipv6"):
        return rest.rsplit(":", 1)[0].strip("[]")
    return peer


def _client_key(context: Any, client_id: str | None) -> str:
    """Who asks, for the limits per client on schedules: ``Open.client_id`` at the peer's host.

    None (a Describe, which names no client): the peer's address and port, its connection, so the
    processes of one host (a trainer's ``len(client)`` each) are not one client.
    """
    peer = getattr(context, "peer", None)
    address = str(peer()) if callable(peer) else ""
    if client_id is None:
        return urllib.parse.unquote(address) or "an unknown address"
    return f"{_printable(client_id, 100) or '-'} at {_peer_host(address) or 'an unknown address'}"


def _malformed(exc: DecodeError) -> StreamAbortedError:
    """A request whose bytes are not a ``ladle.v1.StreamRequest`` (grpc parses it before the servicer)."""
    return StreamAbortedError(
        "invalid_argument", "bad_request", f"a request is not a valid ladle.v1.StreamRequest: {exc}"
    )


class _Session:
    """The state one Stream shares between its sender and its request reader (one event loop)."""

    def __init__(
        self,
        job: Job,
        rank: int,
        generation: int,
        start: Position,
        credits: int,
        flush_every: float = ACK_FLUSH_SECONDS,
        store_executor: Executor | None = None,
    ) -> None:
        self.job = job
        self.flush_every = flush_every
        self.rank = rank
        self.generation = generation
        self.wake = asyncio.Event()
        self.credits = credits
        self.window = credits
        self.sent = start  # the position after the last batch sent
        self.acked = start
        self.stored = start
        self.last_flush = 0.0
        self.deferred: asyncio.TimerHandle | None = None
        self.writing: asyncio.Future[Position] | None = None  # the store write in flight
        # what a cursor write failed with: the stream ends, with no last write
        self.write_error: BaseException | None = None
        # called (on the event loop) when the stream has ended, and again when a write in flight then ends
        self.on_end: Callable[[_Session], None] | None = None
        self.ended = False
        self.store_executor = store_executor
        self.failure: BaseException | None = None
        self.requests_done = False
        self.replaced = False
        self.lease: ScheduleLease | None = None  # the schedule its stream is on is in use (ScheduleCache)

    def grant(self, n: int, field: str) -> None:
        """The client returned ``n`` credits; more than the batches in flight is INVALID_ARGUMENT."""
        if self.credits + n > self.window:
            raise StreamAbortedError(
                "invalid_argument",
                "bad_credit",
                f"{field} {n} returns more credits than batches in flight ({self.window - self.credits}; "
                f"the window is Open.prefetch = {self.window}): return one per batch consumed",
                field,
            )
        self.credits += n
        self.wake.set()

    def fail(self, exc: BaseException) -> None:
        if self.failure is None:
            self.failure = exc
        self.wake.set()

    def flush(self, *, force: bool = False) -> None:
        """Write the acknowledged position to the store if it moved (at most every ``flush_every`` s).

        Call on the event loop. The write runs on ``store_executor``, one at a
        time per stream, so a store that is slow or gone (a Redis that stopped
        answering waits out its socket timeout) holds up this stream's cursor
        and no other stream's batches. A write held back is done
        ``flush_every`` after the previous one, so the stored cursor is never
        more than that behind a trainer that pauses; one that comes while a
        write is in flight follows it. After a failed write there is no
        other: the stream ends with its error.
        """
        target = self.acked
        if target <= self.stored or self.replaced or self.writing is not None or self.write_error is not None:
            return  # after a failed write the stream ends: an Ack still on its way starts no other
        now = time.monotonic()
        if not force and now - self.last_flush < self.flush_every:
            if self.deferred is None:
                wait = self.flush_every - (now - self.last_flush)
                self.deferred = asyncio.get_running_loop().call_later(wait, self._flush_deferred)
            return
        self.last_flush = now
        self.writing = asyncio.get_running_loop().run_in_executor(self.store_executor, self._write, target)
        self.writing.add_done_callback(self._written)

    async def drain(self) -> None:
        """Write the last acknowledged position and wait for it (the end of the stream).

        The stream's status goes to the trainer after this, so a trainer that
        restarts from the stored cursor finds everything it acknowledged.
        """
        while True:
            if self.writing is None:
                if self.write_error is not None:  # it would fail again (and wait out a hung store again)
                    return
                self.flush(force=True)
                if self.writing is None:
                    return
            writing = self.writing
            try:
                await asyncio.shield(writing)
            except asyncio.CancelledError:
                return  # cancelled again while ending: the write still completes on its thread
            except Exception:  # _written records it: no retry at the end
                return
            # A future can be done before its callbacks ran, and awaiting a done future does not
            # yield: let _written run before looking again (else this loop spins for ever).
            while self.writing is writing:
                await asyncio.sleep(0)

    def _write(self, target: Position) -> Position:
        """Move the stored cursor to ``target`` (on a store thread); raises what the stream ends with."""
        store, name = self.job.store, self.job.name
        try:
            store.advance(name, self.rank, self.generation, target)
        except FencedError as exc:
            if exc.current >= self.generation:
                raise self._fenced() from None
            self._reconcile(target, f"it holds generation {exc.current} for a process of {exc.generation}")
        except JobNotFoundError:
            store.open_job(self.job.spec, incarnation=self.job.incarnation or None, plan=self.job.plan)
            self._reconcile(target, "the job was gone: expired by --job-ttl, deleted, or lost by the store")
        return target

    def write_late(self, target: Position) -> bool:
        """One try at storing ``target`` after the stream ended (on a store thread).

        False, with nothing written, when the job is no longer the one this
        stream served: deleted, expired, reset (a new run under the name, with
        a new incarnation), resized, or the rank held by a newer process. Unlike
        ``_write`` it never re-creates a job or reconciles: no trainer is there
        to vouch for the position. Raises ``StoreUnavailableError``.
        """
        store, name = self.job.store, self.job.name
        try:
            if not self.job.is_stored_as(store.get(name)):
                return False
            store.advance(name, self.rank, self.generation, target)
        except StoreUnavailableError:
            raise
        except LadleError:  # gone, fenced, a rank an elastic resize removed
            return False
        return True

    def _written(self, done: asyncio.Future[Position]) -> None:
        """A write finished (on the event loop): note it, or end the stream with its error."""
        self.writing = None
        if done.cancelled():
            return
        exc = done.exception()
        if exc is not None:
            self.write_error = exc
            if not isinstance(exc, LadleError):
                log.error("job %s rank %d: the cursor write failed", self.job.name, self.rank, exc_info=exc)
            elif not isinstance(exc, StreamAbortedError):  # the store is away: the trainer reconnects
                log.warning(
                    "job %s rank %d: the cursor write failed (%s); the stream ends (a trainer still "
                    "reading reconnects from its own position) and the position is written when the "
                    "store answers again",
                    self.job.name,
                    self.rank,
                    exc,
                )
            self.fail(exc)
            if self.ended:  # the write outlived its stream (the trainer closed meanwhile)
                self.end()
            return
        self.stored = max(self.stored, done.result())
        if self.acked > self.stored and self.failure is None:
            self.flush()  # acknowledged while it was written: the next one, at its time
        if self.ended and self.writing is None:
            self.end()

    def _flush_deferred(self) -> None:
        self.deferred = None
        self.flush()

    def end(self) -> None:
        """The stream is over (after ``drain``): tell ``on_end``; a write still in flight tells it again."""
        self.ended = True
        if self.on_end is not None:
            self.on_end(self)

    @property
    def unwritten(self) -> bool:
        """Acknowledged batches the store did not take because it did not answer, and no write in flight."""
        return (
            self.acked > self.stored
            and isinstance(self.write_error, StoreUnavailableError)
            and self.writing is None
            and not self.replaced
        )

    @property
    def in_doubt(self) -> bool:
        """Acknowledged batches whose write is still in flight."""
        return self.acked > self.stored and self.writing is not None and not self.replaced

    def _reconcile(self, target: Position, why: str) -> None:
        """The store lost writes it had acknowledged: put back what this live trainer holds."""
        try:
            self.job.store.reconcile(self.job.name, self.rank, self.generation, target)
        except FencedError:
            raise self._fenced() from None
        log.warning(
            "job %s rank %d: the cursor store lost recent writes (%s); reconciled from the trainer's "
            "position %s, generation %d",
            self.job.name,
            self.rank,
            why,
            target,
            self.generation,
        )

    def _fenced(self, now: Job | None = None) -> StreamAbortedError:
        """Why this stream may no longer move the cursor: a newer process, or a resize of the job.

        ``now``: the job as the stream that replaces this one follows it; None
        asks the store (on a store thread only).
        """
        if now is not None:
            resized, world_size = now.fingerprint != self.job.fingerprint, now.world_size
        else:
            try:
                state = self.job.store.get(self.job.name)
                resized = state.spec.world_size != self.job.world_size or state.plan != self.job.plan
                world_size = state.spec.world_size
            except LadleError:
                resized, world_size = False, self.job.world_size
        if resized:
            why = (
                f"job {self.job.name!r} was resized to {world_size} ranks by an elastic restart; "
                f"this stream of rank {self.rank} of the old world of {self.job.world_size} ends"
            )
        else:
            why = (
                f"this stream for rank {self.rank} of job {self.job.name!r} was replaced by a newer "
                "trainer process (a new Open for the same job and rank)"
            )
        return StreamAbortedError("failed_precondition", "fenced", why)


@dataclass
class _LateWrite:
    """The retry of the last position of a stream that ended unwritten (kept on the event loop)."""

    session: _Session
    target: Position
    task: asyncio.Task[None] | None = None
    trying: bool = False  # a try is with the store now
    error: BaseException | None = None  # what the last try failed with


class BatchServicer:
    """Serves every job of one dataset and config; register with ``handler()`` on a grpc.aio server."""

    def __init__(
        self,
        registry: JobRegistry,
        assembler: Assembler,
        *,
        limits: Limits | None = None,
        ack_flush_s: float = ACK_FLUSH_SECONDS,
        metrics: ServerMetrics | None = None,
    ) -> None:
        if ack_flush_s < 0:
            raise ConfigError("ack_flush_s", f"must be >= 0, got {ack_flush_s}")
        self.ack_flush_s = ack_flush_s
        self.registry = registry
        self.assembler = assembler
        self.limits = limits if limits is not None else Limits()
        self.max_prefetch = self.limits.max_prefetch
        self.max_frame_bytes = codec.max_frame_bytes(
            registry.config.token_budget, registry.config.max_batch_size
        )
        self._active: dict[tuple[str, int], _Session] = {}
        # sessions admitted whose Open is still with the store (off the loop), by (job, rank)
        self._opening: dict[tuple[str, int], int] = {}
        self._stopping = False
        # (job, rank) -> (generation, start, monotonic time, store time of the join) of streams begun
        # at the job's cursor
        self._aligned_starts: dict[tuple[str, int], tuple[int, Position, float, float]] = {}
        self._aligned_lock = threading.Lock()  # Opens run on threads of their own
        # the streams' cursor writes: off the event loop, so a store that hangs stops no batch
        self.store_executor = ThreadPoolExecutor(STORE_WRITERS, thread_name_prefix="ladle-store")
        self.describe_executor = ThreadPoolExecutor(DESCRIBERS, thread_name_prefix="ladle-describe")
        # (job, rank) -> the retry of a position an ended stream could not write (on the event loop)
        self._late_writes: dict[tuple[str, int], _LateWrite] = {}
        # set at shutdown: every retry makes its last try at once (end_late_writes)
        self._last_tries = asyncio.Event()
        # (job, rank) -> an ended stream whose last write is still in flight
        self._in_doubt: dict[tuple[str, int], _Session] = {}
        self.metrics = metrics if metrics is not None else ServerMetrics()
        self.metrics.watch_streams(self.stream_depths, self.limits.max_sessions, self.limits.per_job)
        self.metrics.schedules_cached = registry.schedules.__len__
        registry.schedules.set_limits(self.limits.max_schedules, self.limits.schedules_per_client)

    def handler(self) -> Any:
        return rpc.batch_service_handler(self.stream, self.describe)  # type: ignore[arg-type]

    def stream_depths(self) -> list[tuple[str, int, int]]:
        """(job, rank, batches sent and not yet acknowledged) of every open stream; any thread may ask."""
        return [(job, rank, max(0, s.window - s.credits)) for (job, rank), s in list(self._active.items())]

    async def _abort(self, context: Any, exc: BaseException) -> None:
        self.metrics.error("grpc", status_of(exc).name)
        await _abort(context, exc)

    def close(self) -> None:
        """Let the cursor writes still queued run, without waiting for them (after the server stopped)."""
        self.store_executor.shutdown(wait=False)
        self.describe_executor.shutdown(wait=False)

    async def end_late_writes(self, until: float, hurried: Callable[[], bool] = lambda: False) -> None:
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
                late.task for late in self._late_writes.values() if late.task is not None
            ]
            waiting += [s.writing for s in self._in_doubt.values() if s.writing is not None]
            left = until - loop.time()
            if not waiting or left <= 0:
                break
            await asyncio.wait(waiting, timeout=min(left, 0.1))
            await asyncio.sleep(0)  # an ended write's callbacks run: a failed one starts its last try
        for (job, rank), late in list(self._late_writes.items()):
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
        self._late_writes.clear()
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

    def _ended(self, session: _Session) -> None:
        """A stream ended, or the write it left in flight did: retry a position the store did not take."""
        key = (session.job.name, session.rank)
        if session.in_doubt:
            self._in_doubt[key] = session
            return
        if self._in_doubt.get(key) is session:
            del self._in_doubt[key]
        if session.unwritten:
            self._write_late(session)

    def _write_late(self, session: _Session) -> None:
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
        earlier = self._late_writes.pop(key, None)
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
                        stored = await loop.run_in_executor(self.store_executor, session.write_late, target)
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
                if self._late_writes.get(key) is late:
                    del self._late_writes[key]

        late.task = asyncio.get_running_loop().create_task(retry())
        self._late_writes[key] = late

    def stop_streams(self) -> None:
        """Ask every open stream to end with UNAVAILABLE (call on the server's event loop)."""
        self._stopping = True
        for session in list(self._active.values()):
            session.fail(
                StreamAbortedError("unavailable", "shutting_down", "the batch server is shutting down")
            )

    # --- Describe ---

    async def describe(self, request: pb.DescribeRequest, context: Any) -> pb.JobInfo:
        try:
            # the store and a schedule build may take a while: off the event loop
            epoch = request.epoch if request.HasField("epoch") else None
            rank = request.rank if request.HasField("rank") else None
            describe = functools.partial(
                self._describe, request.job, request.world_size, epoch, rank, request.own_cursor
            )
            job, epoch, sched = await asyncio.get_running_loop().run_in_executor(
                self.describe_executor, self._as_client, _client_key(context, None), describe
            )
            return pb.JobInfo(
                job=job.name,
                world_size=job.world_size,
                epoch=epoch,
                steps_per_epoch=sched.num_steps,
                schedule_fingerprint=job.fingerprint,
                config_fingerprint=job.spec.config_fingerprint,
                dataset_fingerprint=job.spec.dataset_fingerprint,
                bucket_bounds=list(sched.bounds),
                token_budget=self.registry.config.token_budget,
                max_batch_size=self.registry.config.max_batch_size,
                max_frame_bytes=self.max_frame_bytes,
            )
        except (JobNotFoundError, LadleError) as exc:
            await self._abort(context, exc)
        except Exception as exc:  # a bug or an unexpected store answer: INTERNAL, counted, logged once
            log.exception("Describe of job %s failed", _printable(request.job))
            await self._abort(context, exc)
        raise AssertionError("unreachable")

    def _as_client(self, client: str, call: Callable[[], Any]) -> Any:
        """``call()`` here, its schedule builds counted for ``client`` (``ScheduleCache.admitting``)."""
        with self.registry.schedules.admitting(client):
            return call()

    def _describe(
        self, name: str, world_size: int, epoch: int | None, rank: int | None = None, own_cursor: bool = False
    ) -> tuple[Job, int, Schedule]:
        """The job ``name``, the epoch described and its schedule (on a worker thread).

        ``epoch`` None: the epoch of the job's slowest rank, or with ``rank``
        the epoch its stream would start in if it opened now with no
        checkpoint (as ``_open`` starts it, with nothing joined). A job the store
        does not hold is ``JobNotFoundError`` unless ``world_size`` is given:
        then it is the job a trainer of that world size would create, built
        here and stored nowhere, as an inspection builds (``ScheduleBusyError``
        when too many builds run: nothing a stream uses, so anyone asking for
        many world sizes holds no more schedules than the spare ones). An epoch
        other than the job's own is built the same way. ``ConfigError`` for
        an epoch or rank no Open would take (a rank is checked against the
        ``world_size`` asked for: an elastic restart's new rank may be beyond
        the stored job's).
        """
        if epoch is not None and epoch > MAX_INDEX:
            raise ConfigError("epoch", f"must be in 0..{MAX_INDEX}, got {epoch}")
        if rank is not None and world_size and rank >= world_size:
            raise ConfigError("rank", f"{rank} is outside 0..{world_size - 1} (world_size={world_size})")
        try:
            job = self.registry.get(name)
            if job is None:
                job = self.registry.open(name, self.registry.store.get(name).spec.world_size)
            state = job.state()  # (a job this server knew may be gone from the store since)
        except JobNotFoundError:
            if not world_size:
                raise
            job = self.registry.unstored(name, world_size)
            at = 0 if epoch is None else epoch
            return job, at, job.schedule(at)
        current = min(r.position.epoch for r in state.ranks) if state.ranks else 0
        at = current if epoch is None else epoch
        mine = next((r for r in state.ranks if r.rank == rank), None) if epoch is None else None
        if mine is not None:  # where Open would start it (the job's cursor unless own_cursor), nothing joined
            opening = Opening(job.name, mine.rank, own_cursor=own_cursor)
            at = self._decide(job, opening, mine, state.ranks, describe=True).start.epoch
        return job, at, job.schedule(at, hot=at == current)

    # --- Stream ---

    async def stream(self, requests: AsyncIterator[pb.StreamRequest], context: Any) -> None:
        """One trainer's stream: a coroutine that writes each frame itself (``context.write``).

        Not an async generator: grpc.aio drives a generator from its own
        loop, and when the trainer goes away during a write, the failed write
        or the cancellation lands in grpc's loop, not here, and leaves the
        generator suspended at its ``yield``. Its clean-up (the session slot,
        the last cursor write, the log line) then waited for the garbage
        collector, which a reference cycle could put off for minutes, and
        grpc logged the failed write as an ERROR with a traceback. Written
        here, both reach this coroutine's ``finally``.
        """
        try:
            # a call that sends nothing holds one of grpc's concurrent-call slots while it waits
            first = await first_request(requests, self.limits.handshake_timeout_s, "Open", missing="no_open")
        except NoRequestError as exc:
            await exc.abort(context)
            return
        try:
            self._check_open(first)
            # counted before the store hears of it: a refused Open must not fence anyone
            admitted = self._admit(first.open.job, first.open.rank)
            client = _client_key(context, first.open.client_id)
            try:
                # store calls may wait on a lock held by another process: keep them off the event loop;
                # the schedules the Open has built count against its client's limits (ScheduleCache)
                with self.registry.schedules.admitting(client):
                    session = await asyncio.to_thread(self._open, first)
            except LadleError as exc:
                if isinstance(exc, ScheduleLimitError):
                    self.metrics.refused(exc.limit)
                if exc.kind == "failed_precondition":  # a job this server cannot serve as asked: say so here
                    o = first.open
                    log.warning(
                        "stream refused: job=%s rank=%d/%d client=%s: %s",
                        o.job,
                        o.rank,
                        o.world_size,
                        _printable(o.client_id) or "-",
                        exc,
                    )
                raise
            finally:
                self._release(admitted)
        except LadleError as exc:
            await self._abort(context, exc)
            return
        except Exception as exc:  # a bug or an unexpected store answer: INTERNAL, counted, logged once
            log.exception("stream open failed: job=%s rank=%d", _printable(first.open.job), first.open.rank)
            await self._abort(context, exc)
            return
        # released in the finally below (no await before it): what the stream is on is never dropped
        lease = session.lease = self.registry.schedules.lease(
            session.job.fingerprint, session.sent.epoch, client
        )
        key = (session.job.name, session.rank)
        for other_key, other in list(self._active.items()):
            # the stream this one replaces, and every stream of the world an elastic resize ended
            if other_key == key or (
                other_key[0] == key[0] and other.job.fingerprint != session.job.fingerprint
            ):
                other.replaced = True
                other.fail(other._fenced(session.job))
                del self._active[other_key]
        self._active[key] = session
        late = self._late_writes.pop(key, None)
        if late is not None and late.task is not None:  # this stream's Open took the rank's position
            late.task.cancel()
        self._in_doubt.pop(key, None)
        reader = asyncio.create_task(self._read(requests, session))
        meter = self.metrics.stream(session.job.name, session.rank)
        gone: BaseException | None = None  # the call ended under a write: no status can follow
        try:
            start = codec.encode_stream_start(
                generation=session.generation,
                incarnation=session.job.incarnation,
                epoch=session.sent.epoch,
                step=session.sent.step,
                schedule_fingerprint=session.job.fingerprint,
                world_size=session.job.world_size,
            )
            await context.write(start)
            async with contextlib.aclosing(self._send(session, meter)) as frames:
                async for frame in frames:
                    await context.write(frame)
        except LadleError as exc:
            session.fail(exc)
        except asyncio.CancelledError:
            raise  # grpc cancels the handler when the trainer cancels or goes away
        except Exception as exc:  # the write failed: the call is over (the trainer went away)
            gone = exc
        finally:
            reader.cancel()
            lease.release()
            self.metrics.ended(meter)
            await session.drain()
            session.on_end = self._ended
            session.end()
            if self._active.get(key) is session:
                del self._active[key]
            with self._aligned_lock:  # its start no longer holds back the ranks that join later
                began = self._aligned_starts.get(key)
                if began is not None and began[0] == session.generation:
                    del self._aligned_starts[key]
            log.info(
                "stream end: job=%s rank=%d generation=%d sent=%s stored=%s: %s",
                session.job.name,
                session.rank,
                session.generation,
                session.sent,
                session.stored,
                _why(session.failure) if gone is None else f"the call ended during a send ({_gone(gone)})",
            )
        if gone is not None:
            # grpc would try to send a status on the dead call and log that as an ERROR; a
            # cancelled handler is grpc's own quiet ending
            raise asyncio.CancelledError(f"the call ended during a send: {_gone(gone)}")
        if session.failure is not None:
            await self._abort(context, session.failure)

    def _admit(self, job: str, rank: int) -> tuple[str, int]:
        """Hold a session slot for ``rank`` of ``job`` (on the event loop), or refuse with RESOURCE_EXHAUSTED.

        A stream that replaces one of the same job and rank takes its slot, so a
        reconnecting trainer is never refused for the session it is replacing.
        """
        key = (job, rank)
        held = (set(self._active) | set(self._opening)) - {key}
        limits = self.limits
        if len(held) >= limits.max_sessions:
            self.metrics.refused("max_sessions")
            raise StreamAbortedError(
                "resource_exhausted",
                "too_many_sessions",
                f"this batch server already serves {len(held)} trainer sessions, its limit "
                f"(ladle serve --max-sessions) is {limits.max_sessions}: add a replica or raise the limit",
            )
        in_job = sum(1 for held_job, _ in held if held_job == job)
        if in_job >= limits.per_job:
            self.metrics.refused("max_sessions_per_job")
            raise StreamAbortedError(
                "resource_exhausted",
                "too_many_sessions_per_job",
                f"job {job!r} already holds {in_job} sessions on this batch server, the limit per job "
                f"(ladle serve --max-sessions-per-job) is {limits.per_job}",
                "open.rank",
            )
        self._opening[key] = self._opening.get(key, 0) + 1
        return key

    def _release(self, key: tuple[str, int]) -> None:
        left = self._opening.pop(key) - 1
        if left:
            self._opening[key] = left

    def _check_open(self, first: pb.StreamRequest) -> None:
        """Refuse a malformed Open before it costs a session slot or a store call."""
        if first.WhichOneof("kind") != "open":
            raise StreamAbortedError("invalid_argument", "no_open", "the first request must be Open", "open")
        o = first.open
        if not o.job:
            raise StreamAbortedError("invalid_argument", "bad_job", "Open.job is empty", "open.job")
        if o.world_size < 1:
            raise StreamAbortedError(
                "invalid_argument", "bad_world_size", "Open.world_size must be >= 1", "open.world_size"
            )
        if o.rank >= o.world_size:
            raise StreamAbortedError(
                "invalid_argument",
                "bad_rank",
                f"rank: {o.rank} is outside 0..{o.world_size - 1} (world_size={o.world_size})",
                "open.rank",
            )
        if not 1 <= o.prefetch <= self.max_prefetch:
            self.metrics.refused("max_prefetch")
            raise StreamAbortedError(
                "invalid_argument",
                "bad_prefetch",
                f"Open.prefetch must be in 1..{self.max_prefetch} on this server "
                f"(ladle serve --max-prefetch), got {o.prefetch}",
                "open.prefetch",
            )
        if o.HasField("resume") and o.resume.generation >= RESUME_GENERATION_LIMIT:
            raise StreamAbortedError(
                "invalid_argument",
                "bad_resume",
                f"Open.resume.generation must be below {RESUME_GENERATION_LIMIT} (the generation of the "
                f"client's last StreamStart), got {o.resume.generation}",
                "open.resume.generation",
            )
        if self._stopping:
            raise StreamAbortedError("unavailable", "shutting_down", "the batch server is shutting down")

    def _open(self, first: pb.StreamRequest) -> _Session:
        """Join the job in the store and position the rank (``first`` passed ``_check_open``).

        The store calls and refusals are here; where the rank starts is ``decide_start``'s.
        """
        o = first.open
        job, given = self._claim(o)
        resume = Resume(o.resume.generation, o.resume.incarnation) if o.HasField("resume") else None
        opening = Opening(job.name, o.rank, given, o.own_cursor, resume)
        # a start at the job's cursor reads the job's ranks before the join: the rank's own entry then
        # still says when it last moved (its last_seen), which tells its earlier stream from a stale cursor
        ranks = job.state().ranks if opening.aligned else ()
        joined = job.join(o.rank)
        decision = self._decide(job, opening, joined, ranks)
        start = decision.start
        if decision.aligned:
            self._remember_aligned(job.name, o.rank, joined, start)
        for note in decision.notes:
            log.log(note.level, "%s", note.message)
        if decision.refusal:
            raise StreamAbortedError(
                "invalid_argument", "bad_resume", decision.refusal, "open.resume.generation"
            )
        if decision.reconcile is not None:
            joined = job.store.reconcile(job.name, o.rank, decision.reconcile.generation, start)
            log.log(decision.reconcile.note.level, "%s", decision.reconcile.note.message)
        elif decision.rewind:
            joined = job.store.rewind(job.name, o.rank, joined.generation, start)
        log.info(
            "stream open: job=%s rank=%d/%d generation=%d start=%s client=%s",
            job.name,
            o.rank,
            o.world_size,
            joined.generation,
            start,
            _printable(o.client_id) or "-",
        )
        session = _Session(
            job, o.rank, joined.generation, start, o.prefetch, self.ack_flush_s, self.store_executor
        )
        session.stored = joined.position
        return session

    def _claim(self, o: pb.Open) -> tuple[Job, Position | None]:
        """The job (opened, resized if elastic) and the position the Open's checkpoint claims in it
        (across a resize, normalised; None without one), or the refusal: all before the join, which
        would fence the rank's running process."""
        given = Position(o.start.epoch, o.start.step) if o.HasField("start") else None
        checkpoint = None
        if given is not None and o.HasField("schedule_fingerprint"):
            checkpoint = (given, o.schedule_fingerprint)
        if o.HasField("schedule_fingerprint"):
            self.registry.check_restorable(o.job, o.world_size, o.schedule_fingerprint)
        job = self.registry.open(o.job, o.world_size, elastic=o.elastic, checkpoint=checkpoint)
        job.check_rank(o.rank, o.world_size)
        if o.HasField("schedule_fingerprint") and o.schedule_fingerprint != job.fingerprint:
            moved = job.translate(o.schedule_fingerprint, given) if given is not None else None
            if moved is None and given is not None and o.schedule_fingerprint == job.previous_fingerprint:
                cut = job.plan[-1]
                at = ", ".join(f"{p.epoch}:{p.step}" for p in sorted(set(cut.cut)))
                raise StreamAbortedError(
                    "failed_precondition",
                    "schedule_mismatch",
                    f"job {job.name!r} was resized from {cut.world_size} to {job.world_size} ranks at "
                    f"{at} (epoch:step; the checkpoint the first new rank loaded, or the stored cursors "
                    f"if it loaded none), and this checkpoint of the old world is at {given.epoch}:"
                    f"{given.step}: every rank of an elastic restart must load a checkpoint of the same "
                    "step (rank 0's will do), or none",
                    "open.start",
                )
            if moved is None:
                raise StreamAbortedError(
                    "failed_precondition",
                    "schedule_mismatch",
                    f"the client expects schedule {o.schedule_fingerprint} but job {job.name!r} follows "
                    f"{job.fingerprint} (another dataset, config, world size, resize or ladle version)",
                    "open.schedule_fingerprint",
                )
            given = moved  # a checkpoint of the world before an elastic resize, taken at its cut
        if given is not None:
            try:
                given = job.normalise(given, hot=True)
            except ConfigError as exc:
                message = f"the loaded state is not a position of this job: {exc}"
                raise CheckpointPositionError(message) from None
        return job, given

    def _decide(
        self,
        job: Job,
        opening: Opening,
        joined: RankState,
        ranks: Sequence[RankState],
        *,
        describe: bool = False,
    ) -> StartDecision:
        """``decide_start`` with the other ranks' recent starts at the job's cursor this server began."""
        now = time.monotonic()
        aligned_starts = {}
        with self._aligned_lock:
            for r in ranks:
                began = self._aligned_starts.get((job.name, r.rank))
                if r.rank != opening.rank and began is not None:
                    generation, start, at, store_time = began
                    aligned_starts[r.rank] = AlignedStart(generation, start, now - at, store_time)
        return decide_start(
            opening,
            joined=joined,
            ranks=ranks,
            aligned_starts=aligned_starts,
            incarnation=job.incarnation,
            positions=HotPositions(job),
            describe=describe,
        )

    def _remember_aligned(self, name: str, rank: int, joined: RankState, start: Position) -> None:
        """Remember a stream begun at the job's cursor, for the ranks that join after it (``_decide``)."""
        now = time.monotonic()
        with self._aligned_lock:
            if len(self._aligned_starts) > 10_000:  # bounded by use: entries are read for minutes
                stale = [k for k, v in self._aligned_starts.items() if now - v[2] >= ALIGNED_START_S]
                for key in stale:
                    del self._aligned_starts[key]
            self._aligned_starts[(name, rank)] = (joined.generation, start, now, joined.last_seen)

    async def _read(self, requests: AsyncIterator[pb.StreamRequest], session: _Session) -> None:
        """Apply the client's Acks and Credits until its half of the stream ends."""
        try:
            async for request in requests:
                kind = request.WhichOneof("kind")
                if kind == "credit":
                    session.grant(request.credit.n, "credit.n")
                elif kind == "ack":
                    given = Position(request.ack.through.epoch, request.ack.through.step)
                    # checked before normalising: this runs on the event loop, and an epoch the
                    # stream has not reached would need its schedule built here
                    through = given
                    if session.acked < given <= session.sent:
                        through = session.job.normalise(given, hot=True)
                    if through > session.sent:
                        raise StreamAbortedError(
                            "invalid_argument",
                            "bad_ack",
                            f"Ack through epoch {given.epoch} step {given.step} is beyond the last batch "
                            f"sent (next: epoch {session.sent.epoch} step {session.sent.step})",
                            "ack",
                        )
                    session.acked = max(session.acked, through)  # an earlier or repeated Ack changes nothing
                    if request.ack.credit:
                        session.grant(request.ack.credit, "ack.credit")
                    session.flush()
                else:
                    raise StreamAbortedError(
                        "invalid_argument",
                        "bad_request",
                        f"unexpected {kind or 'request with neither ack nor credit'} after Open",
                        kind or "",
                    )
        except LadleError as exc:  # a bad Ack or Credit (a position out of range, too far ahead)
            session.fail(exc)
        except DecodeError as exc:
            session.fail(_malformed(exc))
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # the call ended (cancelled, deadline) while reading
            if not isinstance(exc, grpc.RpcError | grpc.aio.AioRpcError):
                log.exception("request reader failed")
        finally:
            session.requests_done = True
            session.wake.set()

    async def _send(self, session: _Session, meter: StreamMeter) -> AsyncGenerator[bytes, None]:
        job = session.job
        position = session.sent
        while True:
            while session.credits <= 0 and session.failure is None:
                if session.requests_done:
                    return
                session.wake.clear()
                await session.wake.wait()
            if session.failure is not None:
                return
            session.credits -= 1
            if session.lease is not None and session.lease.epoch != position.epoch:
                session.lease.move(position.epoch)  # the epoch it left is no longer in use
            if not job.has_schedule(position.epoch):  # building one takes a while: off the loop
                await asyncio.to_thread(functools.partial(job.schedule, position.epoch, hot=True))
            began = time.perf_counter()
            ref = job.batch(position, session.rank)
            # the rows' bytes go from the mapped dataset straight into the frame: one copy
            batch = self.assembler.frame(
                ref.rows,
                ref.padded_len,
                epoch=position.epoch,
                step=position.step,
                rank=session.rank,
                bucket=ref.bucket,
                schedule_fingerprint=job.fingerprint,
                max_len=job.config.max_seq_len,  # the width can be more (pad_to_multiple_of)
            )
            frame = batch.data
            meter.batch(
                batch.real_tokens, batch.rows * ref.padded_len, len(frame), time.perf_counter() - began
            )
            nxt = ref.next
            session.sent = nxt
            handed = time.perf_counter()
            yield frame  # stream() writes it
            meter.send.observe(time.perf_counter() - handed)
            if nxt.epoch != position.epoch:
                yield codec.encode_epoch_end(position.epoch, ref.steps_in_epoch)
            position = nxt
