"""The stream reader: a rank's gRPC stream, its frames decoded on a reader thread, and its acknowledgements.

A reader thread takes each frame off the stream as it arrives, decodes it and
queues the batch, so a trainer whose window is full finds its next batch ready
(``next()`` only dequeues); acknowledgements are grouped and never sent from
the trainer's thread. Only grpcio's public API is used: the stream is read
through its iterator and written through its request iterator, at the cost of
one more thread hand-off a batch than a reader polling grpcio's private layer
(about a tenth of the trainer's CPU, docs/serving.md).
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import grpc

from ladle.proto import codec, rpc
from ladle.proto import ladle_pb2 as pb

from .batch import Batch

__all__ = ["ACK_DELAY", "END", "Stream", "is_fence"]

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
    """One gRPC stream read through grpcio's iterator by a reader thread, and its acknowledgements.

    The reader thread takes each frame from gRPC as it arrives, decodes it and
    queues the batch, so a trainer whose window is full finds its next batch
    ready (``next()`` only dequeues). Reading on the trainer's own thread
    instead saves a thread hand-off per batch, but puts gRPC's receive round
    trip inside ``next()`` (docs/serving.md has the figures).

    Acknowledgements (each carrying the consumed batches' credit) are grouped
    when the trainer consumes faster than one batch per ``ACK_DELAY``: each
    upstream message wakes a thread on both sides, which costs more CPU than a
    batch itself when nothing else runs. A group goes when it holds three
    quarters of the window, when ``ACK_DELAY`` has passed since the last
    message, and at once on ``flush`` (``state_dict``, ``close``). They go
    through grpcio's request iterator, on its request thread, never the
    trainer's: Python handles signals on the trainer's thread, and a Ctrl-C
    inside grpcio's send could leave a lock of grpcio's held, so an emergency
    checkpoint in the handler would hang. The trainer's thread touches only
    C-level primitives (a Lock, a SimpleQueue). One held back is sent when it
    is due because the request thread waits for that moment after each
    message it sends (so the trainer's thread wakes no one for it).
    """

    def __init__(
        self,
        stub: rpc.BatchServiceClient,
        open_request: pb.StreamRequest,
        depth: int,
        convert: Callable[[codec.DecodedBatch], Batch],
    ) -> None:
        self.convert = convert
        # three quarters of the window: fewer upstream messages than half, and the server keeps
        # a quarter of its credits
        self.group = max(1, depth * 3 // 4)
        self._through: tuple[int, int] | None = None
        self._credit = 0
        self._last_sent = time.monotonic()
        # decoded batches (or an end marker / an error), decoded on the reader thread so next()
        # only dequeues (unbounded: the server sends at most `depth` batches beyond what was
        # acknowledged)
        self.frames: queue.SimpleQueue[Any] = queue.SimpleQueue()
        # the status that ended a stream whose rank a newer process took: seen before the batches
        # still queued, which the newer process is given too (set on the reader thread)
        self.fenced: Any = None
        self.requests: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self.requests.put(open_request)
        self._lock = threading.Lock()
        self.call = stub.stream(self._request_iter())
        self.thread = threading.Thread(target=self._read, name="ladle-client-reader", daemon=True)
        self.thread.start()

    # --- acknowledgements (hold _lock for the underscored ones) ---

    def _hold(self, through: tuple[int, int]) -> bool:
        """Count one consumed batch; True if its acknowledgement may wait."""
        self._through = through
        self._credit += 1
        return not self._due()

    def _due(self) -> bool:
        """A pending acknowledgement should go: a full group, or ``ACK_DELAY`` since the last one."""
        return self._through is not None and (
            self._credit >= self.group or time.monotonic() - self._last_sent >= ACK_DELAY
        )

    def _take_ack(self) -> pb.StreamRequest | None:
        """The pending acknowledgement as a request (and clear it), or None."""
        if self._through is None:
            return None
        epoch, step = self._through
        request = pb.StreamRequest(
            ack=pb.Ack(through=pb.Position(epoch=epoch, step=step), credit=self._credit)
        )
        self._through = None
        self._credit = 0
        self._last_sent = time.monotonic()
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

    # --- the reader thread ---

    def _read(self) -> None:
        try:
            for frame in self.call:
                self._put(frame)
            self.frames.put(END)
        except grpc.RpcError as exc:
            if is_fence(exc):  # noted at once, before the batches still queued are taken
                self.fenced = exc
            self.frames.put(exc)
        except Exception as exc:  # pragma: no cover - defensive: surface anything to the trainer
            self.frames.put(exc)

    def _put(self, frame: bytes) -> None:
        """Decode a received frame and queue it for the trainer."""
        decoded = codec.decode_frame(frame)
        if isinstance(decoded, codec.DecodedBatch):
            self.frames.put((decoded, self.convert(decoded)))
        else:
            self.frames.put(decoded)

    # --- the trainer's thread ---

    def next(self, timeout: float) -> Any:
        """The next decoded item (or an end marker, or an error); ``queue.Empty`` after ``timeout``."""
        return self.frames.get(timeout=timeout)

    def buffered(self) -> int:
        """Frames received and decoded, not yet taken."""
        return self.frames.qsize()

    def close(self, join: float = 0.0) -> None:
        """End the stream; with ``join``, first let the server take the last acknowledgement.

        The graceful end half-closes the call after the pending acknowledgement
        and lets the reader read what the server still sends until it ends the
        stream (at most ``join`` seconds): a cancel could overtake an
        acknowledgement the server has not read yet.
        """
        self.requests.put(None)
        if join:
            self.thread.join(timeout=join)
        self.call.cancel()
