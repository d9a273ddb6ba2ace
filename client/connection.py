"""``Connection``: a client's channel to one server replica, its stream, and the one failover policy.

A call that fails for a reason that passes (the server unavailable or
restarting, or at its limit on calls in progress) is tried again within the
client's timeout, on the next replica when there are several, after a back-off
that doubles with each round over the replicas (``Retry``); anything else is
raised at once as one of the client's errors. The trade-off: a trainer moves
to the next replica at once, but never spins while every replica fails alike
(a cursor store that is down).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

import grpc

from ladle.proto import codec, rpc
from ladle.proto import ladle_pb2 as pb

from .batch import Batch
from .config import ClientConfig
from .errors import (
    AuthenticationError,
    BatchClientError,
    FencedError,
    ServerFullError,
    ServerUnavailableError,
    StateDictError,
)
from .reader import END, Stream, is_fence

__all__ = ["Connection", "Retry", "is_busy"]

log = logging.getLogger("ladle.client")

_RECEIVE_LIMIT = 256 << 20  # far above any batch frame
_BACKOFF_FIRST, _BACKOFF_MAX = 0.05, 2.0
# with replicas, the longest one gets to connect before the next is tried (a frozen host accepts
# TCP but never answers HTTP/2: it would take the whole timeout)
_CONNECT_TRY_S = 10.0
# grpcio's connectivity thread (behind grpc.channel_ready_future) watches a channel 0.2 s at a time
# until it sees that its last subscriber left, and channel.close() waits for that watch to end
_WATCH_ENDS_S = 0.25
# grpcio's own answer over a server's maximum_concurrent_rpcs (no ladle.v1.Error with it)
_GRPC_BUSY = "Concurrent RPC limit exceeded"
_CHANNEL_OPTIONS = [
    ("grpc.max_receive_message_length", _RECEIVE_LIMIT),
    ("grpc.max_send_message_length", 4 << 20),
    # a server that stops answering (a frozen host, a partition: no reset comes back) is noticed
    # even while the window is full and nothing flows: a ping every 15 s (ladle's server allows
    # one every 10 s) and 5 s for its answer, which gRPC times with http2.ping_timeout_ms
    ("grpc.keepalive_time_ms", 15_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    ("grpc.http2.ping_timeout_ms", 5_000),
    ("grpc.http2.max_pings_without_data", 0),
]

Item = tuple[codec.DecodedBatch, Batch] | codec.DecodedEpochEnd


def is_busy(code: Any, message: str, details: pb.Error | None) -> bool:
    """A call refused because the server is at its limit on calls in progress: it passes, so retry.

    RESOURCE_EXHAUSTED with ladle's reason ``too_many_calls``, or gRPC's own
    "Concurrent RPC limit exceeded!" (a server with ``maximum_concurrent_rpcs``). Not
    the other RESOURCE_EXHAUSTED answers: a message over the size limit or a
    server's sessions all taken (``too_many_sessions``) stay so, and fail at once.
    """
    if code is not grpc.StatusCode.RESOURCE_EXHAUSTED:
        return False
    if details is not None:
        return details.reason == "too_many_calls"
    return message.startswith(_GRPC_BUSY)


def is_late(code: Any, details: pb.Error | None) -> bool:
    """The server saw no first request within its ``--handshake-timeout`` (reason ``no_open``/``no_request``).

    The client sends its first request with the call, so the server (or the
    network to it) was too busy to read it in time: it passes, so retry.
    """
    late = details is not None and details.reason in ("no_open", "no_request")
    return code is grpc.StatusCode.DEADLINE_EXCEEDED and late


class Retry:
    """One call's retries: the back-off doubles with each round over ``replicas``, within a deadline."""

    def __init__(self, replicas: int) -> None:
        self.replicas = replicas
        self.failures = 0

    def wait(self, deadline: float) -> float | None:
        """Seconds to wait before the next try, or None when that would pass ``deadline``."""
        rounds = min(self.failures // self.replicas, 16)
        self.failures += 1
        backoff = min(_BACKOFF_FIRST * 2**rounds, _BACKOFF_MAX)
        return None if time.monotonic() + backoff > deadline else backoff


class Connection:
    """The channel to the current replica, the rank's stream on it, and what ended a stream.

    ``replica`` starts at the rank's own (rank mod replicas) and moves only
    through ``next_replica``. Once a stream ends because a newer process took
    the rank, ``fence`` holds that error for good and no new stream opens.
    Holds no reference to the client, so a client dropped without ``close()``
    is collected.
    """

    def __init__(self, config: ClientConfig, convert: Callable[[codec.DecodedBatch], Batch]) -> None:
        self.config = config
        self.convert = convert
        self.replica = config.rank % len(config.servers)
        self.channel: Any = None
        self.stub: rpc.BatchServiceClient | None = None
        self.stream: Stream | None = None
        self.closed = False
        self.fence: FencedError | None = None
        self.reconnects = 0
        # until when grpcio's connectivity thread may still watch the channel (see _close_channel)
        self._watched_until = 0.0

    @property
    def address(self) -> str:
        return self.config.servers[self.replica]

    def next_replica(self) -> None:
        """Leave the current replica (its stream and channel) for the next one in turn."""
        self.drop_stream()
        self.replica = (self.replica + 1) % len(self.config.servers)

    def check_open(self) -> None:
        """Raise if ``close()`` (from another thread) closed the client while this one waited."""
        if self.closed:
            raise BatchClientError("the client was closed while waiting for a batch")

    # --- the channel ---

    def connect(self, deadline: float) -> rpc.BatchServiceClient:
        """The stub of a ready channel; with replicas, each gets a share of the time left in turn."""
        if self.stub is not None:
            return self.stub
        config = self.config
        tries = len(config.servers)
        while True:
            left = deadline - time.monotonic()
            wait = left if tries <= 1 else min(left, max(1.0, min(left / tries, _CONNECT_TRY_S)))
            if config.credentials is not None:
                channel = grpc.secure_channel(self.address, config.credentials, options=_CHANNEL_OPTIONS)
            else:
                channel = grpc.insecure_channel(self.address, options=_CHANNEL_OPTIONS)
            # not self.channel until it is ready: a close() from another thread meanwhile
            # leaves it to _ready, which stops watching it before it is closed (grpcio's
            # connectivity thread raises on a channel closed under its watch)
            ready = self._ready(channel, time.monotonic() + max(0.01, wait))
            self._watched_until = time.monotonic() + _WATCH_ENDS_S
            if ready:
                break
            time.sleep(_WATCH_ENDS_S)  # grpcio's thread stops watching it (else it raises at close)
            channel.close()
            self.check_open()
            if time.monotonic() >= deadline or tries <= 1:
                hint = (
                    " (TLS: check the CA, the server's name and TLS on both sides)"
                    if config.credentials
                    else " (is it running, is that its gRPC port, and if it serves TLS, pass tls=True "
                    "or root_certificates=...?)"
                )
                raise ServerUnavailableError(
                    f"no batch server answered at {config.server} within {config.timeout:.0f}s{hint}",
                    "UNAVAILABLE",
                ) from None
            log.warning("rank %d: no answer from %s; trying the next replica", config.rank, self.address)
            self.next_replica()
            tries = max(1, tries - 1)
        self.channel = channel
        if self.closed:  # closed as it became ready (close() reads channel after setting closed)
            self.drop_stream()
            self.check_open()
        self.stub = rpc.BatchServiceClient(channel, config.metadata)
        return self.stub

    def _ready(self, channel: Any, until: float) -> bool:
        """Wait for ``channel`` to connect until ``until``; False at the deadline or once closed.

        Waited for in slices, so a ``close()`` from another thread ends the
        wait at once (a closed channel's ready future never completes). The
        future's watch runs on grpcio's thread, so a signal's exception
        (Ctrl-C) raised here leaves no watch behind.
        """
        ready = grpc.channel_ready_future(channel)
        try:
            while not self.closed:
                try:
                    ready.result(timeout=max(0.0, min(0.25, until - time.monotonic())))
                    return True
                except grpc.FutureTimeoutError:
                    if time.monotonic() >= until:
                        return False
            return False
        finally:
            ready.cancel()

    # --- the stream ---

    def _ensure_stream(self, opening: Callable[[], pb.Open], deadline: float) -> Stream:
        if self.stream is not None:
            return self.stream
        self.check_open()
        if self.fence is not None:  # a fenced process must stop: a new stream would take its rank back
            raise FencedError(str(self.fence), self.fence.code)
        stub = self.connect(deadline)
        first = pb.StreamRequest(open=opening())
        self.stream = Stream(stub, first, self.config.prefetch, self.convert)
        return self.stream

    def drop_stream(self) -> None:
        """Close the stream and the channel (the next call connects again)."""
        if self.stream is not None:
            self.note_fence(self.stream)  # a fence its reader saw outlives the stream
            self.stream.close()
            self.stream = None
        if self.channel is not None:
            self._close_channel(self.channel)
            self.channel = None
            self.stub = None

    def _close_channel(self, channel: Any) -> None:
        """Close ``channel`` now, or on a thread of its own while grpcio may still watch it.

        ``channel.close()`` waits for the connectivity watch behind the ready
        future to end (up to 0.2 s after the channel became ready): a client
        closed soon after it connected (tests, evaluations, short jobs) would
        wait for it, and nothing of the client's needs the channel by then
        (its stream has ended).
        """
        if time.monotonic() >= self._watched_until:
            channel.close()
        else:
            threading.Thread(target=channel.close, name="ladle-channel-close", daemon=True).start()

    def note_fence(self, stream: Stream | None) -> FencedError | None:
        """The fence this client knows of: noted before, or the end of ``stream`` its reader has seen.

        The reader thread notes a fence as soon as the stream's status comes,
        before the trainer has taken the batches still queued ahead of it
        (they are the newer process's now): from then on the client is fenced.
        """
        if self.fence is None and stream is not None and stream.fenced is not None:
            error = self.map_error(stream.fenced)
            if isinstance(error, FencedError):
                self.fence = error
        return self.fence

    def receive(
        self, opening: Callable[[], pb.Open], on_start: Callable[[codec.DecodedStreamStart], bool]
    ) -> Item | None:
        """The next batch (decoded, and as the trainer gets it) or epoch end; opens a stream if none is.

        Each stream's start goes to ``on_start``; None when it returns True.
        A stream that ends for a reason that passes is opened again (``Retry``);
        a replica silent for the whole timeout is left for the next, until
        every one had its turn.
        """
        config = self.config
        replicas = len(config.servers)
        deadline = time.monotonic() + config.timeout
        retry = Retry(replicas)
        silent = 0  # replicas that sent nothing within the timeout
        full = 0  # replicas that refused the stream for their sessions all taken
        while True:
            stream = self._ensure_stream(opening, deadline)
            try:
                # a fenced stream's queued batches are the newer process's now: its status first
                item = stream.fenced or stream.next(max(0.0, deadline - time.monotonic()))
                if isinstance(item, tuple) and stream.fenced is not None:
                    item = stream.fenced  # the status came as the batch left the queue: not this process's
            except queue.Empty:
                self.drop_stream()
                silent += 1
                quiet = ServerUnavailableError(
                    f"no batch from {self.address} within {config.timeout:.0f}s "
                    f"(job {config.job!r}, rank {config.rank})",
                    "UNAVAILABLE",
                )
                if silent >= replicas:  # every replica had its turn
                    raise quiet from None
                # a replica that hangs (a frozen host: no reset comes back) is left like a dead one
                self.next_replica()
                log.warning("rank %d: %s; trying the next replica, %s", config.rank, quiet, self.address)
                deadline = time.monotonic() + config.timeout
                self.reconnects += 1
                continue
            if isinstance(item, tuple | codec.DecodedEpochEnd):
                return item
            if isinstance(item, codec.DecodedStreamStart):
                if on_start(item):
                    return None
                continue
            self.drop_stream()
            self.check_open()
            if item is END:
                error: BaseException = ServerUnavailableError(
                    f"{self.address} ended the stream", "UNAVAILABLE"
                )
            elif isinstance(item, grpc.RpcError):
                error = self.map_error(item)
            else:
                raise item
            if isinstance(error, FencedError):
                self.fence = error
            if isinstance(error, ServerFullError) and full < replicas - 1:
                full += 1  # another replica may have room: each is tried once before giving up
                self.next_replica()
                log.warning("rank %d: %s; trying the next replica, %s", config.rank, error, self.address)
                continue
            backoff = retry.wait(deadline)
            if not isinstance(error, ServerUnavailableError) or backoff is None:
                raise error
            if replicas > 1:
                self.next_replica()
            log.warning("rank %d: %s; reconnecting to %s in %.2fs", config.rank, error, self.address, backoff)
            time.sleep(backoff)
            self.check_open()
            self.reconnects += 1

    def ack(self, through: tuple[int, int]) -> None:
        """Acknowledge everything before ``through`` on the open stream (none open: nothing to do)."""
        if self.stream is not None:
            self.stream.ack(through)

    def flush(self) -> None:
        """Send the open stream's pending acknowledgement now."""
        if self.stream is not None:
            self.stream.flush()

    def close(self) -> None:
        """Mark closed, end the stream (gracefully unless fenced) and close the channel."""
        join = 0.0 if self.fence is not None else 1.0
        self.closed = True
        stream, self.stream = self.stream, None
        if stream is not None:
            stream.close(join=join)
            self.note_fence(stream)
        if self.channel is not None:
            self._close_channel(self.channel)
            self.channel = None

    # --- Describe ---

    def describe(self, epoch: int | None, rank: int | None) -> pb.JobInfo:
        """The server's ``JobInfo`` of the job for ``epoch`` (None: where ``rank``'s stream would start).

        Retried as a stream is (``Retry``), up to the timeout; with no stream
        to keep, on the next replica.
        """
        config = self.config
        deadline = time.monotonic() + config.timeout
        retry = Retry(len(config.servers) if self.stream is None else 1)
        while True:
            stub = self.connect(deadline)
            try:
                return stub.describe(
                    config.job,
                    max(0.01, deadline - time.monotonic()),
                    world_size=config.world_size,
                    epoch=epoch,
                    rank=rank,
                    own_cursor=config.own_cursor,
                )
            except grpc.RpcError as exc:
                error = self.map_error(exc)
                if exc.code() is grpc.StatusCode.DEADLINE_EXCEEDED and not isinstance(
                    error, ServerUnavailableError
                ):  # this call's own deadline (a late handshake passes, as below)
                    raise ServerUnavailableError(
                        f"{self.address} did not describe job {config.job!r} within {config.timeout:.0f}s",
                        "DEADLINE_EXCEEDED",
                    ) from None
            backoff = retry.wait(deadline)
            if not isinstance(error, ServerUnavailableError) or backoff is None:
                raise error
            if self.stream is None and len(config.servers) > 1:
                self.next_replica()
            time.sleep(backoff)
            self.check_open()

    # --- errors ---

    def map_error(self, exc: Any) -> BaseException:
        """A call's status as the client's error: the ones that pass are ``ServerUnavailableError``."""
        code = exc.code()
        details = rpc.error_details(exc.trailing_metadata()) if hasattr(exc, "trailing_metadata") else None
        message = exc.details() or str(code)
        name = code.name if code is not None else "UNKNOWN"
        if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED) and not self.closed:
            return ServerUnavailableError(f"{self.address}: {message}", name)
        if is_busy(code, message, details) and not self.closed:  # retried with backoff, as unavailable
            return ServerUnavailableError(
                f"{self.address}: {message} (the server's limit on calls in progress)", name
            )
        if is_late(code, details) and not self.closed:  # this client sent it at once: an overloaded server
            return ServerUnavailableError(f"{self.address}: {message} (the server is overloaded)", name)
        if code in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED):
            return AuthenticationError(f"{self.address}: {message}", name)
        if is_fence(exc):
            return FencedError(message, name)
        if details is not None and details.reason in ("too_many_sessions", "too_many_sessions_per_job"):
            return ServerFullError(f"{self.address}: {message}", name)
        if details is not None and details.reason == "schedule_mismatch":  # a loaded state of another job
            return StateDictError(f"{self.address}: {message}", name)
        return BatchClientError(f"{self.address}: {message}", name)
