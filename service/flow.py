"""A stream's flow: credits out, batches out, acknowledgements in, the cursor written behind.

One ``StreamSession`` is shared by a stream's sender (``send``) and its
request reader (``read``) on one event loop. The sender sends at most the
trainer's credits ahead (``Open.prefetch``); acknowledgements move the stored
cursor through the stream's ``RankLease``, written behind in small groups (one
write per ``ACK_FLUSH_SECONDS`` at most, and always at the end of the stream),
as a round trip to the store per batch would halve throughput.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from concurrent.futures import Executor

import grpc
from google.protobuf.message import DecodeError  # type: ignore[import-untyped]

from ladle.proto import codec
from ladle.proto import ladle_pb2 as pb

from .assemble import Assembler
from .errors import LadleError, StoreUnavailableError
from .jobs import Job, ScheduleLease
from .lease import Position, RankLease, StreamAbortedError
from .metrics import StreamMeter

__all__ = ["ACK_FLUSH_SECONDS", "StreamSession", "malformed", "read", "send"]

log = logging.getLogger("ladle.server")
ACK_FLUSH_SECONDS = 0.05


def malformed(exc: DecodeError) -> StreamAbortedError:
    """A request whose bytes are not a ``ladle.v1.StreamRequest`` (grpc parses it before the servicer)."""
    return StreamAbortedError(
        "invalid_argument", "bad_request", f"a request is not a valid ladle.v1.StreamRequest: {exc}"
    )


class StreamSession:
    """The state one Stream shares between its sender and its request reader (one event loop)."""

    def __init__(
        self,
        lease: RankLease,
        credits: int,
        flush_every: float = ACK_FLUSH_SECONDS,
        store_executor: Executor | None = None,
    ) -> None:
        self.lease = lease
        self.flush_every = flush_every
        self.wake = asyncio.Event()
        self.credits = credits
        self.window = credits
        self.sent = lease.start  # the position after the last batch sent
        self.acked = lease.start
        self.stored = lease.stored
        self.last_flush = 0.0
        self.deferred: asyncio.TimerHandle | None = None
        self.writing: asyncio.Future[Position] | None = None  # the store write in flight
        # what a cursor write failed with: the stream ends, with no last write
        self.write_error: BaseException | None = None
        # called (on the event loop) when the stream has ended, and again when a write in flight then ends
        self.on_end: Callable[[StreamSession], None] | None = None
        self.ended = False
        self.store_executor = store_executor
        self.failure: BaseException | None = None
        self.requests_done = False
        self.replaced = False
        self.schedule: ScheduleLease | None = None  # the schedule its stream is on is in use (ScheduleCache)

    @property
    def job(self) -> Job:
        return self.lease.job

    @property
    def rank(self) -> int:
        return self.lease.rank

    @property
    def generation(self) -> int:
        return self.lease.generation

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
        loop = asyncio.get_running_loop()
        self.writing = loop.run_in_executor(self.store_executor, self.lease.advance, target)
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


async def read(requests: AsyncIterator[pb.StreamRequest], session: StreamSession) -> None:
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
        session.fail(malformed(exc))
    except asyncio.CancelledError:
        raise
    except Exception as exc:  # the call ended (cancelled, deadline) while reading
        if not isinstance(exc, grpc.RpcError | grpc.aio.AioRpcError):
            log.exception("request reader failed")
    finally:
        session.requests_done = True
        session.wake.set()


async def send(
    session: StreamSession, assembler: Assembler, meter: StreamMeter
) -> AsyncGenerator[bytes, None]:
    """The stream's frames in schedule order, one per credit; an EpochEnd after an epoch's last."""
    job, rank = session.job, session.rank
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
        if session.schedule is not None and session.schedule.epoch != position.epoch:
            session.schedule.move(position.epoch)  # the epoch it left is no longer in use
        if not job.has_schedule(position.epoch):  # building one takes a while: off the loop
            await asyncio.to_thread(functools.partial(job.schedule, position.epoch, hot=True))
        began = time.perf_counter()
        ref = job.batch(position, rank)
        # the rows' bytes go from the mapped dataset straight into the frame: one copy
        batch = assembler.frame(
            ref.rows,
            ref.padded_len,
            epoch=position.epoch,
            step=position.step,
            rank=rank,
            bucket=ref.bucket,
            schedule_fingerprint=job.fingerprint,
            max_len=job.config.max_seq_len,  # the width can be more (pad_to_multiple_of)
        )
        frame = batch.data
        meter.batch(batch.real_tokens, batch.rows * ref.padded_len, len(frame), time.perf_counter() - began)
        nxt = ref.next
        session.sent = nxt
        handed = time.perf_counter()
        yield frame  # the servicer writes it
        meter.send.observe(time.perf_counter() - handed)
        if nxt.epoch != position.epoch:
            yield codec.encode_epoch_end(position.epoch, ref.steps_in_epoch)
        position = nxt
