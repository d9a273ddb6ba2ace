"""The stream reader: a rank's gRPC stream, its frames decoded on a reader thread, and its acknowledgements.

A reader thread takes each frame off the stream as it arrives, decodes it and
queues the batch, so a trainer whose window is full finds its next batch ready
(``next()`` only dequeues); acknowledgements are grouped and never sent from
the trainer's thread. ``PolledStream`` polls the call's own completion queue
(``_direct``); ``ThreadedStream`` reads grpcio's public iterator, its fallback.
Both give the same batches.
"""

from __future__ import annotations

import contextlib
import queue
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import grpc

from ladle.proto import codec, rpc
from ladle.proto import ladle_pb2 as pb

from . import _direct
from .batch import Batch

__all__ = ["ACK_DELAY", "END", "PolledStream", "Stream", "ThreadedStream", "is_fence"]

# An acknowledgement reaches the server at most this long after the trainer
# asked for the next batch (sooner when three quarters of the prefetch window wait).
ACK_DELAY = 0.005
END = object()  # queued when the server ended the stream with OK


def is_fence(status: Any) -> bool:
    """Whether a call's status says a newer process took this rank (FAILED_PRECONDITION, reason fenced)."""
    try:
        if status.code() is not grpc.StatusCode.FAILED_PRECONDITION:
            return False
        details = rpc.error_details(status.trailing_metadata())
    except Exception:  # not a status with trailers: not a fence
        return False
    return details is not None and details.reason == "fenced"


class Stream:
    """What both ways of reading a stream share: the decoded-batch queue and the pending acknowledgement.

    Acknowledgements (each carrying the consumed batches' credit) are grouped
    when the trainer consumes faster than one batch per ``ACK_DELAY``: each
    upstream message wakes a thread on both sides, which costs more CPU than a
    batch itself when nothing else runs. A group goes when it holds three
    quarters of the window, when ``ACK_DELAY`` has passed since the last
    message, and at once on ``flush`` (``state_dict``, ``close``).
    """

    def __init__(self, depth: int, convert: Callable[[codec.DecodedBatch], Batch]) -> None:
        self.convert = convert
        # three quarters of the window: fewer upstream messages than half, and the server keeps
        # a quarter of its credits
        self.group = max(1, depth * 3 // 4)
        self._through: tuple[int, int] | None = None
        self._credit = 0
        self._last_sent = time.monotonic()
        # decoded batches (or an end marker / an error), decoded on the stream's reader
        # thread so next() only dequeues
        # (unbounded: the server sends at most `depth` batches beyond what was acknowledged)
        self.frames: queue.SimpleQueue[Any] = queue.SimpleQueue()
        # the status that ended a stream whose rank a newer process took: seen before the batches
        # still queued, which the newer process is given too (set on the reader thread)
        self.fenced: Any = None

    def _end(self, status: Any) -> None:
        """Queue the status that ended the call (on the reader thread), noting a fence at once."""
        if is_fence(status):
            self.fenced = status
        self.frames.put(status)

    def _hold(self, through: tuple[int, int]) -> bool:
        """Count one consumed batch; True if its acknowledgement may wait (hold the stream's lock)."""
        self._through = through
        self._credit += 1
        return not self._due()

    def _due(self) -> bool:
        """A pending acknowledgement should go: a full group, or ``ACK_DELAY`` since the last one."""
        return self._through is not None and (
            self._credit >= self.group or time.monotonic() - self._last_sent >= ACK_DELAY
        )

    def _ack_request(self) -> pb.StreamRequest | None:
        """The pending acknowledgement as a request, or None (hold the stream's lock)."""
        if self._through is None:
            return None
        epoch, step = self._through
        return pb.StreamRequest(ack=pb.Ack(through=pb.Position(epoch=epoch, step=step), credit=self._credit))

    def _acked(self) -> None:
        """The pending acknowledgement went (hold the stream's lock)."""
        self._through = None
        self._credit = 0
        self._last_sent = time.monotonic()

    def _put(self, frame: bytes) -> None:
        """Decode a received frame and queue it for the trainer (on the reader thread)."""
        decoded = codec.decode_frame(frame)
        if isinstance(decoded, codec.DecodedBatch):
            self.frames.put((decoded, self.convert(decoded)))
        else:
            self.frames.put(decoded)

    def next(self, timeout: float) -> Any:
        """The next decoded item (or an end marker, or an error); ``queue.Empty`` after ``timeout``."""
        return self.frames.get(timeout=timeout)

    def buffered(self) -> int:
        """Frames received and decoded, not yet taken."""
        return self.frames.qsize()


class ThreadedStream(Stream):
    """One gRPC stream read through grpcio's iterator by a reader thread (the fallback of ``PolledStream``).

    A reader thread takes each frame from gRPC as it arrives, decodes it and
    queues the batch, so a trainer whose window is full finds its next batch
    ready (``next()`` only dequeues). Reading on the trainer's own thread
    instead saves a thread hand-off per batch, but puts gRPC's receive round
    trip inside ``next()`` (docs/serving.md has the figures).

    Acknowledgements go through grpcio's request iterator, on its request
    thread; one held back is sent when it is due because that thread waits
    for that moment after each message it sends (so the trainer's thread
    wakes no one for an acknowledgement it holds back).
    """

    def __init__(
        self,
        stub: rpc.BatchServiceClient,
        open_request: pb.StreamRequest,
        depth: int,
        convert: Callable[[codec.DecodedBatch], Batch],
    ) -> None:
        super().__init__(depth, convert)
        self.requests: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self.requests.put(open_request)
        self._lock = threading.Lock()
        self.call = stub.stream(self._request_iter())
        self.thread = threading.Thread(target=self._read, name="ladle-client-reader", daemon=True)
        self.thread.start()

    def _take_ack(self) -> pb.StreamRequest | None:
        """The pending acknowledgement as a request (and clear it), or None; hold the lock."""
        request = self._ack_request()
        if request is not None:
            self._acked()
        return request

    def _request_iter(self) -> Iterator[pb.StreamRequest]:
        while True:
            with self._lock:
                # ack() holds an acknowledgement back only within ACK_DELAY of the last one
                # sent (later, it sends at once), so wait for a held one until it is due,
                # and past that sleep until the next request: no wakeup per held ack
                left = self._last_sent + ACK_DELAY - time.monotonic()
                pending = self._through is not None
            try:
                item = self.requests.get(timeout=max(0.0, left) if pending or left > 0 else None)
            except queue.Empty:
                with self._lock:
                    due = time.monotonic() - self._last_sent >= ACK_DELAY
                    late = self._take_ack() if due else None
                if late is not None:
                    yield late
                continue
            if item is None:
                with self._lock:
                    last = self._take_ack()
                if last is not None:
                    yield last
                return
            yield item

    def ack(self, through: tuple[int, int]) -> None:
        """The trainer consumed everything before ``through``: one batch's credit back."""
        with self._lock:
            if self._hold(through):
                return  # the request thread sends it when it is due
            request = self._take_ack()
        if request is not None:
            self.requests.put(request)

    def flush(self) -> None:
        """Send the pending acknowledgement now."""
        with self._lock:
            request = self._take_ack()
        if request is not None:
            self.requests.put(request)

    def _read(self) -> None:
        try:
            for frame in self.call:
                self._put(frame)
            self.frames.put(END)
        except grpc.RpcError as exc:
            self._end(exc)
        except Exception as exc:  # pragma: no cover - defensive: surface anything to the trainer
            self.frames.put(exc)

    def close(self, join: float = 0.0) -> None:
        self.requests.put(None)
        if join:
            self.thread.join(timeout=join)
        self.call.cancel()


class PolledStream(Stream):
    """One gRPC stream whose completion queue its reader thread polls itself (``_direct.DirectCall``).

    The reader thread takes each frame off the call's own completion queue
    as it arrives, decodes it and queues the batch, so ``next()`` only
    dequeues. Unlike ``ThreadedStream`` no channel-spin thread stands
    between gRPC and the reader: a batch wakes one Python thread in the
    trainer instead of two. Reading on the trainer's own thread instead
    saves a little more CPU, but gRPC does a message's receive work on the
    thread that polls for it, so ``next()`` would pay for it.

    Acknowledgements are sent by a watchdog thread (asleep unless one is
    pending), never by the trainer's thread: Python handles signals on the
    main thread, and a Ctrl-C that struck inside grpcio's send left a lock of
    grpcio's held, so the emergency checkpoint in the handler hung. The
    watchdog sends a group when it is full or flushed, and one held back once
    ``ACK_DELAY`` has passed; gRPC takes the next message up only after the
    last one's completion has been polled, so one that finds a message in
    flight is sent by the reader thread when it sees that one go (``_sent``).
    """

    def __init__(
        self,
        channel: Any,
        metadata: Any,
        open_request: pb.StreamRequest,
        depth: int,
        convert: Callable[[codec.DecodedBatch], Batch],
    ) -> None:
        super().__init__(depth, convert)
        # The trainer's thread touches only C-level primitives here (a Lock, a SimpleQueue): a
        # KeyboardInterrupt lands between bytecodes, and inside threading.Condition's Python
        # methods it could leave the lock held or the watchdog unwoken
        self._lock = threading.Lock()
        self._wake: queue.SimpleQueue[None] = queue.SimpleQueue()  # wakes the watchdog
        self._closed = False
        self._watch_held = False  # the watchdog knows of the held acknowledgement
        self.call = _direct.DirectCall(channel, rpc.STREAM_METHOD, open_request.SerializeToString(), metadata)
        self.call.on_sent = self._sent
        self.thread = threading.Thread(target=self._read, name="ladle-client-reader", daemon=True)
        self.thread.start()
        self.watchdog = threading.Thread(target=self._watch, name="ladle-client-acks", daemon=True)
        self.watchdog.start()

    # --- the reader thread ---

    def _read(self) -> None:
        call = self.call
        try:
            while (frame := call.receive()) is not None:
                self._put(frame)
            status = call.status
            if status is None or status.code() is grpc.StatusCode.OK:
                self.frames.put(END)
            else:
                self._end(status)
        except Exception as exc:  # pragma: no cover - defensive: surface anything to the trainer
            self.frames.put(exc)
            call.cancel()

    def _sent(self) -> None:
        """The message in flight has gone (on the reader thread): send a held acknowledgement that is due."""
        with self._lock:
            if self._due():
                self._send_locked()

    # --- the trainer's thread ---

    def _send_locked(self) -> bool:
        """Send the pending acknowledgement unless a message is in flight; hold ``_lock``."""
        request = self._ack_request()
        if request is None or self.call.sending():
            return False
        if not self.call.send(request.SerializeToString()):
            return False  # in flight after all, or the call ended: kept for later
        self._acked()
        return True

    def ack(self, through: tuple[int, int]) -> None:
        """The trainer consumed everything before ``through``: one batch's credit back."""
        with self._lock:
            wake = not self._hold(through) or not self._watch_held  # due, or the group's first held
            self._watch_held = True
        if wake:
            # the watchdog sends it: a KeyboardInterrupt inside grpcio's send on this thread
            # would leave grpcio's lock held, and the emergency checkpoint would hang
            self._wake.put(None)

    def flush(self) -> None:
        """Have the pending acknowledgement sent now (by the watchdog), or once the message in flight went."""
        with self._lock:
            pending = self._through is not None
            if pending:
                self._last_sent = 0.0  # due: the watchdog sends it, or _sent when it cannot go now
        if pending:
            self._wake.put(None)

    def close(self, join: float = 0.0) -> None:
        """End the stream; with ``join``, first let the server take the last acknowledgement.

        The graceful end waits (at most ``join`` seconds) for the
        acknowledgement to go, half-closes the call and lets the reader read
        what the server still sends until it ends the stream: a cancel could
        overtake an acknowledgement the server has not read yet.
        """
        call = self.call
        if join:
            end = time.monotonic() + join
            while (
                (call.sending() or self._through is not None)
                and call.status is None
                and not call.broken
                and time.monotonic() < end
            ):
                time.sleep(0.001)  # the reader thread sees the last message go
            if call.close_send():
                self.thread.join(timeout=max(0.0, end - time.monotonic()))
        with self._lock:
            self._closed = True
        self._wake.put(None)
        call.cancel()  # the reader's receive ends; it releases the call
        if join:
            self.thread.join(timeout=join)

    # --- the watchdog ---

    def _watch(self) -> None:
        """Send every due acknowledgement (a full group, a flush, or one held ``ACK_DELAY``)."""
        wait: float | None = None
        while True:
            with contextlib.suppress(queue.Empty):  # Empty: a held acknowledgement's ACK_DELAY is up
                self._wake.get(timeout=wait)
            with self._lock:
                if self._closed:
                    return
                wait = None
                if self._through is not None:
                    if self._due():  # it goes now, or _sent sends it when the message in flight has gone
                        self._send_locked()
                        self._watch_held = False
                    else:
                        wait = max(0.0, self._last_sent + ACK_DELAY - time.monotonic())
                else:
                    self._watch_held = False
