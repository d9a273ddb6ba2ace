"""The gRPC face: ``ladle.v1.BatchService`` (Stream and Describe).

The server runs on grpc's asyncio API: every stream is a coroutine on one
event loop, so a batch crosses no thread on its way out (the synchronous
server's thread hand-offs cost more CPU per batch than the batch itself).

One ``Stream`` call serves one rank of one job: its first request (``Open``)
is checked and counted (``admission``), turned into a ``RankLease`` by the
registry (the rank joined and positioned), and then the rank's batches go out
in schedule order as raw frames, at most ``prefetch`` ahead of the trainer's
credits, its acknowledgements written behind (``flow``). This module converts
messages and statuses only: it never calls the cursor store.

Errors map once, from ``LadleError.kind`` to a gRPC status, with a
``ladle.v1.Error`` in the trailing metadata.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc

from ladle.proto import codec, rpc
from ladle.proto import ladle_pb2 as pb

from . import flow
from .admission import RESUME_GENERATION_LIMIT, Admission, client_key, printable
from .assemble import Assembler
from .errors import ConfigError, LadleError, ScheduleLimitError, reason_of
from .first_request import NoRequestError, first_request
from .flow import ACK_FLUSH_SECONDS, StreamSession
from .jobs import JobRegistry
from .late_writes import LateWrites
from .lease import StreamAbortedError
from .limits import Limits
from .metrics import ServerMetrics, StreamMeter
from .start import RESUME_CLAIM_LIMIT

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
# Threads that write streams' cursors to the store (each stream has at most one write in flight).
STORE_WRITERS = 16
# Threads that answer Describe (store reads, schedule builds): apart from the Opens' threads, so a
# crowd of Describes never queues ahead of a trainer's Open
DESCRIBERS = 2
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
        self.metrics = metrics if metrics is not None else ServerMetrics()
        self.admission = Admission(self.limits, self.metrics)
        # the open streams, by (job, rank): the one session table
        self._active: dict[tuple[str, int], StreamSession] = {}
        # the streams' cursor writes: off the event loop, so a store that hangs stops no batch
        self.store_executor = ThreadPoolExecutor(STORE_WRITERS, thread_name_prefix="ladle-store")
        self.describe_executor = ThreadPoolExecutor(DESCRIBERS, thread_name_prefix="ladle-describe")
        self.late_writes = LateWrites(self.store_executor)
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

        See ``LateWrites.finish``.
        """
        await self.late_writes.finish(until, hurried)

    def stop_streams(self) -> None:
        """Ask every open stream to end with UNAVAILABLE (call on the server's event loop)."""
        self.admission.stopping = True
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
            preview = functools.partial(
                self.registry.preview, request.job, request.world_size, epoch, rank, request.own_cursor
            )
            job, epoch, sched = await asyncio.get_running_loop().run_in_executor(
                self.describe_executor, self._as_client, client_key(context, None), preview
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
        except LadleError as exc:
            await self._abort(context, exc)
        except Exception as exc:  # a bug or an unexpected store answer: INTERNAL, counted, logged once
            log.exception("Describe of job %s failed", printable(request.job))
            await self._abort(context, exc)
        raise AssertionError("unreachable")

    def _as_client(self, client: str, call: Callable[[], Any]) -> Any:
        """``call()`` here, its schedule builds counted for ``client`` (``ScheduleCache.admitting``)."""
        with self.registry.schedules.admitting(client):
            return call()

    # --- Stream ---

    async def stream(self, requests: AsyncIterator[pb.StreamRequest], context: Any) -> None:
        """One trainer's stream: a coroutine that writes each frame itself (``context.write``).

        Not an async generator: grpc.aio drives a generator from its own
        loop, and when the trainer goes away during a write, the failed write
        or the cancellation lands in grpc's loop, not here, and leaves the
        generator suspended at its ``yield``; its clean-up then waits for the
        garbage collector. Written here, both reach this coroutine's ``finally``.
        """
        try:
            # a call that sends nothing holds one of grpc's concurrent-call slots while it waits
            first = await first_request(requests, self.limits.handshake_timeout_s, "Open", missing="no_open")
        except NoRequestError as exc:
            await exc.abort(context)
            return
        client = client_key(context, first.open.client_id)
        session = await self._open(first, client, context)
        if session is None:
            return
        key = self._take_over(session, client)  # no await from here to the finally: the schedule is freed
        reader = asyncio.create_task(flow.read(requests, session))
        meter = self.metrics.stream(session.job.name, session.rank)
        gone: BaseException | None = None  # the call ended under a write: no status can follow
        try:
            await context.write(self._start_frame(session))
            async with contextlib.aclosing(flow.send(session, self.assembler, meter)) as frames:
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
            await self._finish(session, key, meter, gone)
        if gone is not None:
            # grpc would try to send a status on the dead call and log that as an ERROR; a
            # cancelled handler is grpc's own quiet ending
            raise asyncio.CancelledError(f"the call ended during a send: {_gone(gone)}")
        if session.failure is not None:
            await self._abort(context, session.failure)

    async def _open(self, first: pb.StreamRequest, client: str, context: Any) -> StreamSession | None:
        """The session of an Open checked, admitted and attached; None when refused (the call aborted)."""
        o = first.open
        try:
            claim = self.admission.check(first)
            # counted before the store hears of it: a refused Open must not fence anyone
            admitted = self.admission.admit(claim.job, claim.rank, self._active.keys())
            try:
                # store calls may wait on a lock held by another process: keep them off the event loop;
                # the schedules the Open has built count against its client's limits (ScheduleCache)
                with self.registry.schedules.admitting(client):
                    lease = await asyncio.to_thread(self.registry.attach, claim)
            except LadleError as exc:
                if isinstance(exc, ScheduleLimitError):
                    self.metrics.refused(exc.limit)
                if exc.kind == "failed_precondition":  # a job this server cannot serve as asked: say so here
                    log.warning(
                        "stream refused: job=%s rank=%d/%d client=%s: %s",
                        o.job,
                        o.rank,
                        o.world_size,
                        printable(o.client_id) or "-",
                        exc,
                    )
                raise
            finally:
                self.admission.release(admitted)
        except LadleError as exc:
            await self._abort(context, exc)
            return None
        except Exception as exc:  # a bug or an unexpected store answer: INTERNAL, counted, logged once
            log.exception("stream open failed: job=%s rank=%d", printable(o.job), o.rank)
            await self._abort(context, exc)
            return None
        for note in lease.notes:
            log.log(note.level, "%s", note.message)
        log.info(
            "stream open: job=%s rank=%d/%d generation=%d start=%s client=%s",
            lease.job.name,
            lease.rank,
            o.world_size,
            lease.generation,
            lease.start,
            printable(o.client_id) or "-",
        )
        return StreamSession(lease, o.prefetch, self.ack_flush_s, self.store_executor)

    def _take_over(self, session: StreamSession, client: str) -> tuple[str, int]:
        """Enter ``session`` in the session table, holding its schedule in use (``ScheduleCache``).

        It ends the stream it replaces and every stream of the world an
        elastic resize ended, and takes over its rank's position from a late
        write of an earlier stream.
        """
        job = session.job
        session.schedule = self.registry.schedules.lease(job.fingerprint, session.sent.epoch, client)
        key = (job.name, session.rank)
        for other_key, other in list(self._active.items()):
            if other_key == key or (other_key[0] == key[0] and other.job.fingerprint != job.fingerprint):
                other.replaced = True
                other.fail(other.lease.fenced(job))
                del self._active[other_key]
        self._active[key] = session
        self.late_writes.taken(key)
        return key

    @staticmethod
    def _start_frame(session: StreamSession) -> bytes:
        job = session.job
        return codec.encode_stream_start(
            generation=session.generation,
            incarnation=job.incarnation,
            epoch=session.sent.epoch,
            step=session.sent.step,
            schedule_fingerprint=job.fingerprint,
            world_size=job.world_size,
        )

    async def _finish(
        self, session: StreamSession, key: tuple[str, int], meter: StreamMeter, gone: BaseException | None
    ) -> None:
        """The stream is over: its schedule and slot freed, its last position written, its end logged."""
        if session.schedule is not None:
            session.schedule.release()
        self.metrics.ended(meter)
        await session.drain()
        session.on_end = self.late_writes.ended
        session.end()
        if self._active.get(key) is session:
            del self._active[key]
        session.lease.end()
        log.info(
            "stream end: job=%s rank=%d generation=%d sent=%s stored=%s: %s",
            session.job.name,
            session.rank,
            session.generation,
            session.sent,
            session.stored,
            _why(session.failure) if gone is None else f"the call ended during a send ({_gone(gone)})",
        )
