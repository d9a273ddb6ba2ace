"""``BatchClient``: a trainer's view of ladle, one rank's batches, one epoch per iteration.

The client opens one gRPC stream to the batch server, keeps ``prefetch``
batches in flight (credits), and hands out batches whose arrays are read-only
views of the received frames (no copy). A batch counts as consumed when the
trainer asks for the next one, calls ``state_dict()`` or closes the client;
the client then acknowledges it, and the server moves the rank's stored
cursor. If the server goes away (UNAVAILABLE) or is at its limit on calls in
progress (RESOURCE_EXHAUSTED, reason ``too_many_calls``), the client reconnects
with exponential backoff and continues at its next step: no gap, no duplicate.

Imports only grpcio, numpy and ``ladle.proto`` (torch when ``device`` is given).
"""

from __future__ import annotations

import atexit
import contextlib
import ipaddress
import logging
import os
import queue
import re
import socket
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Mapping
from types import TracebackType
from typing import Any, cast

import grpc
import numpy as np

from ladle.proto import codec, rpc
from ladle.proto import ladle_pb2 as pb

from . import _device, _direct
from .batch import Batch
from .errors import (
    AuthenticationError,
    BatchClientError,
    FencedError,
    ServerUnavailableError,
    StateDictError,
)

__all__ = ["STATE_VERSION", "BatchClient"]

log = logging.getLogger("ladle.client")

STATE_VERSION = 1
_STATE_KEYS = ("version", "job", "rank", "world_size", "epoch", "step", "schedule_fingerprint")
# The largest epoch or step a position may hold (the cursor store's limit, exact in a double).
_MAX_INDEX = 2**53 - 1
_RECEIVE_LIMIT = 256 << 20  # far above any batch (a 49152-token batch frame is ~250 KiB)
_BACKOFF_FIRST, _BACKOFF_MAX = 0.05, 2.0
# with replicas, the longest one gets to connect before the next is tried (a frozen host accepts
# TCP but never answers HTTP/2: it cost timeout / replicas, 30 s of the default 60)
_CONNECT_TRY_S = 10.0
# grpcio's connectivity thread watches a channel 0.2 s at a time after its last subscriber left
_WATCH_ENDS_S = 0.25
_MAX_TIMEOUT = 30 * 86400.0  # "wait for ever" enough for a trainer; gRPC's deadlines overflow far above it
# An acknowledgement reaches the server at most this long after the trainer
# asked for the next batch (sooner when three quarters of the prefetch window wait).
ACK_DELAY = 0.005
_END = object()
# How a stream is read: "auto" (the default: "polled" on the grpcio versions _direct was tested
# with, else "thread"), "polled" (a reader thread polls the call's own completion queue, on any
# grpcio that has the calls) or "thread" (grpcio's iterator, read by a reader thread). Both give
# the same batches.
_READER = os.environ.get("LADLE_CLIENT_READER", "auto")


def _is_int(value: Any) -> bool:
    """An integer (Python or numpy), not a bool."""
    return not isinstance(value, bool) and isinstance(value, int | np.integer)


def _is_fingerprint(value: Any) -> bool:
    """A string a frame and an Open can carry (encodable, at most MAX_FINGERPRINT_BYTES)."""
    if not isinstance(value, str):
        return False
    try:
        return len(value.encode()) <= codec.MAX_FINGERPRINT_BYTES
    except UnicodeEncodeError:  # a lone surrogate
        return False


def _from_env(value: Any, name: str, default: Any, kind: type) -> Any:
    if value is not None:
        return value
    raw = os.environ.get(name)
    if raw is None or not raw.strip():
        return default
    if kind is int:
        if not re.fullmatch(r"[0-9]+", raw.strip()):  # ASCII digits: no "1_0", no other scripts' digits
            raise ValueError(f"environment variable {name}={raw!r} is not a valid int")
        return int(raw)
    return kind(raw)


def _integer(value: Any, name: str, least: int, most: int = _MAX_INDEX) -> int:
    """``value`` as an int if it is an integer (numpy's too, not a bool) in least..most, else ValueError."""
    if not _is_int(value) or not least <= value <= most:
        too_large = _is_int(value) and value > most
        limits = f">= {least}" if most == _MAX_INDEX and not too_large else f"in {least}..{most}"
        raise ValueError(f"{name} must be an integer {limits}, got {value!r}")
    return int(value)


# a bad job name fails in the constructor, not at the first batch
_JOB_NAME = re.compile(codec.JOB_NAME_PATTERN)
_DEFAULT_PORT = 50051
_URL_SCHEMES = frozenset({"grpc", "grpcs", "http", "https"})
# gRPC metadata values are printable ASCII; a client_id is logged by the server
_PRINTABLE_ASCII = re.compile(r"[\x20-\x7e]*")
_MAX_CLIENT_ID = 256
_MAX_UINT32 = 2**32 - 1  # world_size and prefetch travel as uint32


def grpc_target(address: str) -> str:
    """A gRPC target for ``address``: a host alone gets ladle's port 50051 (gRPC would take 443).

    ``host:port`` and ``[v6]:port`` are kept, as are targets with a scheme
    (``dns:///``, ``unix:``, ``ipv4:``); a malformed one, a port outside
    1..65535, or a URL (``grpc://``, ``http://``: gRPC would resolve the
    whole URL as a host name) is a ValueError at once instead of a timeout
    later.
    """
    scheme, _, rest = address.partition("://")
    if scheme.lower() in _URL_SCHEMES:
        raise ValueError(
            f"server address {address!r} is a URL, not a gRPC target: give host:port "
            f"({rest.rstrip('/') or 'host:port'}), or tls=True for TLS"
        )
    if ":/" in address or address.startswith(("unix:", "unix-abstract:", "ipv4:", "ipv6:", "vsock:")):
        return address
    bad = ValueError(f"server address {address!r} is not host:port (port 1..65535)")
    if address.startswith("["):  # [v6] or [v6]:port
        host, close, rest = address[1:].partition("]")
        if not close or not host or (rest and not rest.startswith(":")):
            raise bad
        port = rest[1:] if rest else None
    elif address.count(":") > 1:  # a bare IPv6 address
        host, port = address, None
    else:
        host, colon, port_ = address.partition(":")
        port = port_ if colon else None
    if ":" in host:
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            raise bad from None
        if port is None:
            return f"[{host}]:{_DEFAULT_PORT}"
    if not host or (port is not None and not (re.fullmatch(r"[0-9]{1,5}", port) and 1 <= int(port) <= 65535)):
        raise bad
    return address if port is not None else f"{host}:{_DEFAULT_PORT}"


class _Stream:
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
        # three quarters of the window: fewer upstream messages than half (-15 us of CPU a
        # batch on each side, measured), and the server keeps a quarter of its credits
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
        if _is_fence(status):
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


class _ThreadedStream(_Stream):
    """One gRPC stream read through grpcio's iterator by a reader thread (the fallback of ``_PolledStream``).

    A reader thread takes each frame from gRPC as it arrives, decodes it and
    queues the batch, so a trainer whose window is full finds its next batch
    ready (``next()`` only dequeues). Reading on the trainer's own thread
    instead saved a thread hand-off per batch when the trainer waits for
    every batch (about 20 us of CPU), but put gRPC's receive round trip
    inside ``next()`` (median 13 -> 127 us with a full window): measured in
    docs/serving.md.

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
            self.frames.put(_END)
        except grpc.RpcError as exc:
            self._end(exc)
        except Exception as exc:  # pragma: no cover - defensive: surface anything to the trainer
            self.frames.put(exc)

    def close(self, join: float = 0.0) -> None:
        self.requests.put(None)
        if join:
            self.thread.join(timeout=join)
        self.call.cancel()


class _PolledStream(_Stream):
    """One gRPC stream whose completion queue its reader thread polls itself (``_direct.DirectCall``).

    The reader thread takes each frame off the call's own completion queue
    as it arrives, decodes it and queues the batch, so ``next()`` only
    dequeues. Unlike ``_ThreadedStream`` no channel-spin thread stands
    between gRPC and the reader: a batch wakes one Python thread in the
    trainer instead of two (about -70 us of trainer CPU a batch, measured in
    docs/serving.md). Reading on the trainer's own thread instead saved a
    little more CPU, but gRPC does a message's receive work on the thread
    that polls for it, so ``next()`` paid for it (median 20 -> 198 us with
    a full window).

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
                self.frames.put(_END)
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
            # the watchdog sends it, not this thread. Signals are handled on the trainer's
            # thread, and a KeyboardInterrupt inside grpcio's send left grpcio's lock held: the
            # emergency checkpoint after a Ctrl-C then hung (2 of 14 tries in an audit)
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


class BatchClient:
    """Batches of one rank of one job, from a ladle batch server.

    ``BatchClient(rank, world_size, server, job)`` takes its defaults from
    ``RANK``, ``WORLD_SIZE``, ``LADLE_SERVER`` and ``LADLE_JOB`` (then 0, 1,
    ``127.0.0.1:50051`` and ``"default"``). Iterating yields one epoch of
    ``Batch`` objects; iterating again continues with the next epoch (after
    a ``break``, with the rest of the same one: nothing is skipped).
    ``device=None`` gives numpy arrays (read-only, zero-copy); a torch device
    gives tensors on it. For CUDA the reader thread copies each batch through
    pinned memory on a CUDA stream of its own, and ``next()`` makes the
    trainer's current stream wait for those copies (no host wait), so any
    stream may use the batch; ``"cuda"`` without an index is the device
    current when the client is made (``torch.cuda.set_device(local_rank)``
    first). ``timeout`` bounds how long the client waits for a server (to
    connect, or for the next batch) before it raises ``ServerUnavailableError``.

    Without ``load_state_dict``, a rank of a job that has already run
    starts at the job's cursor: the earliest position any of its ranks has
    reached. The ranks of a DDP job restarted without a checkpoint are then
    at the same step and get equal steps to the epoch's end (each at its own
    cursor, a step or two apart, the ranks with more would hang in their
    last collective); a rank that was ahead gets again the batches it
    consumed beyond it. ``own_cursor=True`` starts at this rank's own
    cursor instead, for ranks that do not train in step.

    ``token`` (default ``LADLE_TOKEN``, else the first line of the file
    ``LADLE_TOKEN_FILE`` names) is sent with every call to a server
    that wants one; a refused token raises ``AuthenticationError`` at once.
    TLS is on when ``root_certificates`` (PEM bytes, or a file; default
    ``LADLE_TLS_CA``) or a client certificate is given, or ``tls=True``
    (the system's roots); ``client_certificate`` and ``client_key`` (PEM
    bytes or files; default ``LADLE_TLS_CERT``, ``LADLE_TLS_KEY``) answer a
    server that asks for mutual TLS.
    """

    def __init__(
        self,
        rank: int | None = None,
        world_size: int | None = None,
        server: str | None = None,
        job: str | None = None,
        *,
        prefetch: int = 4,
        device: Any = None,
        timeout: float = 60.0,
        pin_memory: bool | None = None,
        client_id: str | None = None,
        elastic: bool = False,
        own_cursor: bool = False,
        token: str | None = None,
        tls: bool | None = None,
        root_certificates: bytes | str | os.PathLike[str] | None = None,
        client_certificate: bytes | str | os.PathLike[str] | None = None,
        client_key: bytes | str | os.PathLike[str] | None = None,
    ) -> None:
        self.world_size = _integer(_from_env(world_size, "WORLD_SIZE", 1, int), "world_size", 1, _MAX_UINT32)
        self.rank = _integer(_from_env(rank, "RANK", 0, int), "rank", 0)
        if server is not None and not isinstance(server, str):
            raise ValueError(f"server must be a string of host:port, got {server!r}")
        self.server = str(_from_env(server, "LADLE_SERVER", f"127.0.0.1:{_DEFAULT_PORT}", str))
        self.job = _from_env(job, "LADLE_JOB", "default", str)
        if job is None and not os.environ.get("LADLE_JOB", "").strip():
            _warn_default_job()
        if self.rank >= self.world_size:
            raise ValueError(
                f"rank {self.rank} is outside 0..{self.world_size - 1} (world_size={self.world_size})"
            )
        if not isinstance(self.job, str) or _JOB_NAME.fullmatch(self.job) is None:
            raise ValueError(f"job must be {codec.JOB_NAME_RULE}, got {self.job!r}")
        self.prefetch = _integer(prefetch, "prefetch", 1, _MAX_UINT32)
        if (
            isinstance(timeout, bool)
            or not isinstance(timeout, int | float)
            or not 0 < timeout <= _MAX_TIMEOUT
        ):
            raise ValueError(f"timeout must be seconds in (0, {_MAX_TIMEOUT:.0f}], got {timeout!r}")
        self.timeout = float(timeout)
        if client_id is not None and (
            not isinstance(client_id, str)
            or len(client_id) > _MAX_CLIENT_ID
            or _PRINTABLE_ASCII.fullmatch(client_id) is None
        ):
            raise ValueError(
                f"client_id must be printable ASCII of at most {_MAX_CLIENT_ID} characters, "
                f"got {client_id!r:.100}"
            )
        self.client_id = client_id or f"{socket.gethostname()}:{os.getpid()}"
        self.elastic = bool(elastic)
        self.own_cursor = bool(own_cursor)
        # "a:50051,b:50051": replicas; rank r starts on the r-th (mod n) and fails over in turn
        self.servers = [grpc_target(a.strip()) for a in self.server.split(",") if a.strip()]
        if not self.servers:
            raise ValueError(f"server must name at least one host:port, got {self.server!r}")
        self._server_index = self.rank % len(self.servers)
        token = str(_from_env(token, "LADLE_TOKEN", "", str)).strip() or _token_file()
        if _PRINTABLE_ASCII.fullmatch(token) is None:  # never echoed: it is a secret
            raise ValueError("the token must be printable ASCII (it travels as gRPC metadata)")
        # the token travels only in the call metadata; never in a message, a log line or repr()
        self._metadata = (("authorization", f"Bearer {token}"),) if token else ()
        self._credentials = channel_credentials(tls, root_certificates, client_certificate, client_key)
        self._convert = _device.converter(_device.check_device(device, pin_memory), pin_memory)
        self._channel: Any = None
        self._stub: rpc.BatchServiceClient | None = None
        self._stream: _ThreadedStream | _PolledStream | None = None
        # The next batch to receive (None: the server's stored cursor), the
        # batch handed out but not yet consumed, and what was last acknowledged.
        self._next: tuple[int, int] | None = None
        self._held: tuple[int, int] | None = None
        self._fingerprint: str | None = None
        # what the last stream's StreamStart said; sent back on a reconnect (Open.resume)
        self._generation: int | None = None
        self._incarnation = ""
        self._closed = False
        self._replanned = False  # a loaded state awaits the server's re-planned position
        self._loaded_epoch: int | None = None  # the epoch of a state just loaded (until the next batch)
        self._cut_short = False  # a take was interrupted where a frame may be lost (see _receive)
        self._epochs_ended = 0  # epoch ends taken: an iteration ends where another ended its epoch
        self._takes = 0  # batches taken: an interrupted iteration knows whether it took one
        # once fenced, for good: a fenced process must stop, not take its rank back
        self._fence: FencedError | None = None
        # one thread iterates at a time (two would race each other into streams that fence one
        # another): _iterating refuses a second; _busy makes state_dict() from another thread wait
        self._iterating = threading.Lock()
        self._busy = threading.Lock()
        # gRPC's channels do not survive a fork: a child must make its own client
        self._pid = os.getpid()
        # read through _direct (else grpcio's iterator)
        self._polled = _READER == "polled" or (_READER != "thread" and _direct.grpc_is_tested())
        self.reconnects = 0
        _LIVE.add(self)

    # --- state ---

    def state_dict(self) -> dict[str, Any]:
        """The rank's position (a few integers) and the schedule fingerprint; consumes the held batch.

        Before the first batch (and with no ``load_state_dict``), the position
        is where the server will start this rank: the stored cursor of a job
        that has already run. The client opens its stream to learn it, so a
        checkpoint taken before any batch never rewinds the rank. After
        ``close()`` (or a ``with`` block) it is where the client ended: after
        the batches it consumed, at the held one if the block ended in an
        exception.

        Raises ``FencedError`` once the client knows that a newer process took
        its rank (the server ended its stream so, whether or not ``next()`` has
        raised it yet): a replaced process must not checkpoint a position, which
        could overwrite the newer process's checkpoint.
        """
        with self._busy:
            self._raise_if_fenced()
            if self._ended_at_known_position():
                assert self._next is not None
                return self._state(*self._next)
            if self._closed and self._pid == os.getpid() and self._fence is None:
                raise BatchClientError(
                    "the client was closed before it learned its position (it read no batch and loaded "
                    "no state), so there is none to save: a new client for this rank goes on from the "
                    "job's stored cursor"
                )
            self._check_usable()
            self._consume_held()
            if self._next is None or self._replanned:
                self._receive(until_start=True)
            if self._stream is not None:
                self._stream.flush()
            self._raise_if_fenced()  # the fence may have come while it waited
            assert self._next is not None
            return self._state(*self._next)

    def _ended_at_known_position(self) -> bool:
        """Closed in this process, not fenced, with its position known: ``state_dict()`` needs no server.

        The position is known once a stream started or a state was loaded
        (whose fingerprint may be None, as it was saved).
        """
        return (
            self._closed
            and self._pid == os.getpid()
            and self._fence is None
            and self._next is not None
            and not self._replanned
        )

    def _state(self, epoch: int, step: int) -> dict[str, Any]:
        return {
            "version": STATE_VERSION,
            "job": self.job,
            "rank": self.rank,
            "world_size": self.world_size,
            "epoch": int(epoch),
            "step": int(step),
            "schedule_fingerprint": self._fingerprint,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Resume exactly where ``state`` (from ``state_dict()``) left off; the dict is not changed."""
        with self._busy:
            self._check_usable()
            self._load(state)

    def _load(self, state: Mapping[str, Any]) -> None:
        if not isinstance(state, Mapping):
            raise StateDictError(f"state must be a mapping, got {type(state).__name__}")
        missing = [k for k in _STATE_KEYS if k not in state]
        if missing:
            raise StateDictError(f"state lacks {missing}; it was not made by BatchClient.state_dict()")
        version = state["version"]
        if not _is_int(version) or version != STATE_VERSION:
            raise StateDictError(f"state version {version!r}; this client reads {STATE_VERSION}")
        for key in ("rank", "world_size", "epoch", "step"):
            value = state[key]
            if not _is_int(value) or not 0 <= value <= _MAX_INDEX:
                raise StateDictError(
                    f"state[{key!r}] must be a non-negative integer <= {_MAX_INDEX}, got {value!r}"
                )
        if not isinstance(state["job"], str):
            raise StateDictError(f"state['job'] must be a string, got {state['job']!r}")
        resized = self.elastic and state["world_size"] != self.world_size
        for key, mine in (("job", self.job), ("rank", self.rank), ("world_size", self.world_size)):
            if key != "job" and resized:
                continue  # an elastic restart: any rank's checkpoint of the old world will do
            if state[key] != mine:
                hint = " (pass elastic=True to resume with another world size)" if key == "world_size" else ""
                raise StateDictError(
                    f"state is for {key}={state[key]!r}, this client has {key}={mine!r}{hint}"
                )
        fingerprint = state["schedule_fingerprint"]
        if fingerprint is not None and not _is_fingerprint(fingerprint):
            raise StateDictError(
                f"state['schedule_fingerprint'] must be a string of at most {codec.MAX_FINGERPRINT_BYTES} "
                f"UTF-8 bytes, got {fingerprint!r:.100}"
            )
        self._drop_stream()
        self._next = (int(state["epoch"]), int(state["step"]))
        self._held = None
        self._fingerprint = fingerprint
        self._generation = None  # a restart from a checkpoint, not a reconnect
        # a checkpoint of another world size: the server re-plans, so state_dict() asks it first
        self._replanned = resized
        self._loaded_epoch = None if resized else int(state["epoch"])

    @property
    def position(self) -> tuple[int, int] | None:
        """(epoch, step) of the next batch this client will receive (None before the first).

        After an elastic ``load_state_dict`` (another world size) it is the
        loaded position of the old world until the first batch or
        ``state_dict()`` learns the re-planned one from the server.
        """
        return self._next

    # --- the epoch's length ---

    def __len__(self) -> int:
        """This rank's batches in the epoch ``for batch in client`` continues or starts, from its start.

        Every rank gets the same number. The server answers it (its
        ``Describe`` call reads only: any process may ask, without joining the
        job or fencing the rank's trainer). After ``load_state_dict`` in the
        middle of an epoch it is still the whole epoch's count, as a resumed
        ``DataLoader``'s ``len`` is, and after a state taken on an epoch's
        last batch it is that epoch's (the next iteration is its empty rest).
        Each epoch is packed anew, so epochs can differ by a few batches: for
        a learning-rate schedule over several epochs, add
        ``steps_in_epoch(e)`` for each. Raises as iterating would:
        ``ServerUnavailableError`` after ``timeout``, ``BatchClientError`` for a
        job of another world size (unless ``elastic``: the job is then resized
        first, as the first batch would).
        """
        return self.steps_in_epoch()

    def __bool__(self) -> bool:
        """Always true: ``if client:`` must not ask the server for ``len(client)``."""
        return True

    def steps_in_epoch(self, epoch: int | None = None) -> int:
        """This rank's batches in ``epoch`` (default: the epoch ``len(client)`` counts)."""
        if epoch is not None:
            epoch = _integer(epoch, "epoch", 0)
        with self._busy:
            self._check_usable()
            if epoch is None and self._loaded_epoch is not None:
                # the next iteration continues the loaded epoch: its empty rest, if the state
                # was taken on its last batch (the server already starts the rank after it)
                epoch = self._loaded_epoch
            info = self._describe(epoch)
            if info.world_size != self.world_size:
                if not self.elastic or self._stream is not None:
                    raise BatchClientError(
                        f"job {self.job!r} has {info.world_size} ranks and this client {self.world_size} "
                        "(pass elastic=True to resize it to this client's world size)",
                        "FAILED_PRECONDITION",
                    )
                self._receive(until_start=True)  # the stream's Open resizes the job: then it is known
                info = self._describe(epoch)
            if epoch is None and self._next is not None and self._next[1] >= info.steps_per_epoch > 0:
                # stopped at the epoch's end: the next iteration starts the next epoch
                info = self._describe(info.epoch + 1)
            return int(info.steps_per_epoch)

    def _describe(self, epoch: int | None) -> pb.JobInfo:
        """The server's ``JobInfo`` of this job for ``epoch`` (None: this client's, else the job's).

        Retried with backoff while the server is unavailable or at its limit on
        calls in progress (RESOURCE_EXHAUSTED, ``_is_busy``), up to ``timeout``.
        """
        if epoch is None and self._next is not None:
            epoch = self._next[0]
        # not read a batch yet: where this rank's stream would start (its own cursor, or the job's)
        rank = self.rank if epoch is None else None
        deadline = time.monotonic() + self.timeout
        backoff = _BACKOFF_FIRST
        while True:
            stub = self._connect(deadline)
            try:
                return stub.describe(
                    self.job,
                    max(0.01, deadline - time.monotonic()),
                    world_size=self.world_size,
                    epoch=epoch,
                    rank=rank,
                    own_cursor=self.own_cursor,
                )
            except grpc.RpcError as exc:
                if exc.code() is grpc.StatusCode.DEADLINE_EXCEEDED:
                    raise ServerUnavailableError(
                        f"{self._address} did not describe job {self.job!r} within {self.timeout:.0f}s",
                        "DEADLINE_EXCEEDED",
                    ) from None
                error = self._map_error(exc)
            if not isinstance(error, ServerUnavailableError) or time.monotonic() + backoff > deadline:
                raise error
            if self._stream is None and len(self.servers) > 1:  # no stream to keep: try another replica
                self._drop_stream()
                self._server_index = (self._server_index + 1) % len(self.servers)
            time.sleep(backoff)
            self._check_open()
            backoff = min(backoff * 2, _BACKOFF_MAX)

    # --- iteration ---

    def __iter__(self) -> Iterator[Batch]:
        return self._epoch()

    def _epoch(self) -> Iterator[Batch]:
        first = True
        ends = -1  # epochs this client had ended when this iteration took its first batch
        while True:
            if not first and self._epochs_ended != ends:
                return  # another iteration of this client ended this one's epoch: so does this one
            takes = self._takes
            try:
                batch = self._take(first)
            except BaseException:
                if self._takes != takes:
                    self._undeliver()  # taken, then interrupted (Ctrl-C) before it reached the trainer
                raise
            if batch is None:
                return
            if first:
                ends = self._epochs_ended
            first = False
            yield batch

    def _take(self, first: bool) -> Batch | None:
        """Consume the held batch and take the next one; None at the end of the epoch."""
        if not self._iterating.acquire(blocking=False):
            raise BatchClientError(
                "two threads asked one BatchClient for a batch at once: it is one rank's stream, "
                "so iterate it from one thread (a checkpoint thread may call state_dict())"
            )
        try:
            with self._busy:
                self._check_usable()
                if self._cut_short:
                    # the last take was interrupted (Ctrl-C, or an exception a signal handler
                    # raised) between a frame leaving the stream's queue and the position moving
                    # past it: the frame may be lost, so the stream starts again at the position
                    self._drop_stream()
                self._consume_held()
                loaded, self._loaded_epoch = self._loaded_epoch, None
                if first and loaded is not None and self._rest_is_empty(loaded):
                    return None
                batch = self._take_next(first)
                self._cut_short = False  # the frame taken (if any) is accounted for
                return batch
        finally:
            self._iterating.release()

    def _undeliver(self) -> None:
        """The batch just taken never reached the trainer: it is the next one again, not a held one.

        Python raises a Ctrl-C at the first check after ``_take`` returns, so
        the position can have moved past a batch the loop never got; without
        this, the next take would consume it (acknowledged, never trained on).
        """
        with self._busy:
            if self._held is not None:
                self._next, self._held = self._held, None
                self._cut_short = True  # the stream has sent past it: start again at the position

    def _take_next(self, first: bool) -> Batch | None:
        """Receive the next batch and move the position past it; None at the end of the epoch."""
        item = self._receive()
        if isinstance(item, codec.DecodedEpochEnd):
            self._epochs_ended += 1
            # the last iteration stopped (break) right after the epoch's last batch, and this
            # one starts at that epoch's end: no epoch of its own, go on into the next
            after_last = first and self._next == (item.epoch, item.steps)
            self._next = (int(item.epoch) + 1, 0)
            if not after_last:
                return None
            item = self._receive()
            if isinstance(item, codec.DecodedEpochEnd):  # an empty epoch (a resize can leave one)
                self._epochs_ended += 1
                self._next = (int(item.epoch) + 1, 0)
                return None
        batch = cast(Batch, item)
        self._held = (batch.epoch, batch.step)
        self._next = (batch.epoch, batch.step + 1)
        self._takes += 1
        return batch

    def _rest_is_empty(self, loaded: int) -> bool:
        """A state of epoch ``loaded`` was taken on its last batch: this iteration is its empty rest.

        The server starts such a state at the next epoch. A loop that resumes
        ``for epoch in range(saved_epoch, N): for batch in client:`` then
        finishes the saved epoch first (nothing is left of it) and trains N
        epochs in all, as it does from any other checkpoint.
        """
        if self._stream is None:
            self._receive(until_start=True)  # where the server starts this rank
        return self._next is not None and self._next[0] > loaded

    def _check_usable(self) -> None:
        """Raise if this client cannot serve the caller: made in another process, fenced, or closed."""
        if self._pid != os.getpid():
            raise BatchClientError(
                f"this BatchClient was made in process {self._pid}, not this one ({os.getpid()}): gRPC "
                "does not survive a fork; make the client in the process that uses it, and start that "
                "process with 'spawn' (multiprocessing, torch.multiprocessing) or before the parent uses gRPC"
            )
        self._raise_if_fenced()
        if self._closed:
            raise BatchClientError("the client is closed")

    def _note_fence(self, stream: _ThreadedStream | _PolledStream | None) -> FencedError | None:
        """The fence this client knows of: raised before, or the end of ``stream`` its reader has seen.

        The reader thread notes a fence as soon as the stream's status comes,
        before the trainer has taken the batches still queued ahead of it
        (they are the newer process's now): from then on the client is fenced.
        """
        if self._fence is None and stream is not None and stream.fenced is not None:
            error = self._map_error(stream.fenced)
            if isinstance(error, FencedError):
                self._fence = error
        return self._fence

    def _raise_if_fenced(self) -> None:
        """Raise ``FencedError`` once this client (in its own process) knows a newer process took its rank."""
        if self._pid == os.getpid():
            fence = self._note_fence(self._stream)
            if fence is not None:
                raise FencedError(str(fence), fence.code)

    def _receive(self, *, until_start: bool = False) -> Any:
        """The next batch or epoch end; with ``until_start``, return None once the stream has started.

        From here until the caller has moved the position past what this
        returns, an exception raised into the trainer's thread (Ctrl-C) can
        lose a frame taken from the queue: ``_cut_short`` says so, and the
        next take starts the stream again at the position.
        """
        self._cut_short = True
        deadline = time.monotonic() + self.timeout
        failures = 0  # streams that ended unavailable since this call began
        silent = 0  # replicas that sent nothing within the timeout
        while True:
            stream = self._ensure_stream(deadline)
            try:
                # a fenced stream's queued batches are the newer process's now: its status first
                item = stream.fenced or stream.next(max(0.0, deadline - time.monotonic()))
                if isinstance(item, tuple) and stream.fenced is not None:
                    item = stream.fenced  # the status came as the batch left the queue: not this process's
            except queue.Empty:
                self._drop_stream()
                silent += 1
                quiet = ServerUnavailableError(
                    f"no batch from {self._address} within {self.timeout:.0f}s "
                    f"(job {self.job!r}, rank {self.rank})",
                    "UNAVAILABLE",
                )
                if silent >= len(self.servers):  # every replica had its turn
                    raise quiet from None
                # a replica that hangs (a frozen host: no reset comes back) is left like a dead one
                self._server_index = (self._server_index + 1) % len(self.servers)
                log.warning("rank %d: %s; trying the next replica, %s", self.rank, quiet, self._address)
                deadline = time.monotonic() + self.timeout
                self.reconnects += 1
                continue
            if isinstance(item, tuple):
                decoded, batch = item
                self._check_batch(decoded)
                if batch._ready is not None:  # its device copies: the trainer's stream waits for them
                    batch._ready()
                    batch.__dict__["_ready"] = None
                return cast(Batch, batch)
            if isinstance(item, codec.DecodedEpochEnd):
                return item
            if isinstance(item, codec.DecodedStreamStart):
                self._started(item)
                if until_start:
                    self._cut_short = False
                    return None
                continue
            self._drop_stream()
            self._check_open()
            if item is _END:
                error: BaseException = ServerUnavailableError(
                    f"{self._address} ended the stream", "UNAVAILABLE"
                )
            elif isinstance(item, grpc.RpcError):
                error = self._map_error(item)
            else:
                raise item
            if isinstance(error, FencedError):
                self._fence = error
            # the wait doubles with each round over the replicas (each round over one server), so
            # a trainer tries the next replica at once but does not spin while all of them fail
            # (a cursor store that is down fails every replica alike)
            backoff = min(_BACKOFF_FIRST * 2 ** min(failures // len(self.servers), 16), _BACKOFF_MAX)
            failures += 1
            if not isinstance(error, ServerUnavailableError) or time.monotonic() + backoff > deadline:
                raise error
            if len(self.servers) > 1:
                self._server_index = (self._server_index + 1) % len(self.servers)
            log.warning("rank %d: %s; reconnecting to %s in %.2fs", self.rank, error, self._address, backoff)
            time.sleep(backoff)
            self._check_open()
            self.reconnects += 1

    def _started(self, start: codec.DecodedStreamStart) -> None:
        """The server's first frame: adopt its schedule, generation and (after a resize) position."""
        self._generation = start.generation
        self._incarnation = start.incarnation
        if self._fingerprint is not None and start.schedule_fingerprint != self._fingerprint:
            log.warning(
                "rank %d: job %r was resized to %d ranks; continuing at epoch %d step %d of the re-planned "
                "schedule %s",
                self.rank,
                self.job,
                start.world_size,
                start.epoch,
                start.step,
                start.schedule_fingerprint,
            )
        if self._next is None and (start.epoch, start.step) != (0, 0):  # not a reconnect, not a load
            # a warning: a new run under an old name, or a restart whose model did not restart with it
            log.warning(
                "rank %d: job %r continues at epoch %d step %d, where the store left it (a restart "
                "without load_state_dict; use another job name for a new run)",
                self.rank,
                self.job,
                start.epoch,
                start.step,
            )
        self._fingerprint = start.schedule_fingerprint
        self._next = (start.epoch, start.step)
        self._replanned = False

    @property
    def _address(self) -> str:
        return self.servers[self._server_index]

    def _check_batch(self, batch: codec.DecodedBatch) -> None:
        if batch.rank != self.rank:
            raise BatchClientError(f"server sent a batch for rank {batch.rank} to rank {self.rank}")
        # (the server normalises a step past an epoch's end to the next epoch's step 0)
        expected = self._next
        if (
            expected is not None
            and (batch.epoch, batch.step) != expected
            and not (batch.step == 0 and batch.epoch == expected[0] + 1)
        ):
            raise BatchClientError(f"server sent epoch {batch.epoch} step {batch.step}, expected {expected}")
        if self._fingerprint is None:
            self._fingerprint = batch.schedule_fingerprint
        elif batch.schedule_fingerprint != self._fingerprint:
            raise StateDictError(
                f"server follows schedule {batch.schedule_fingerprint}, this client {self._fingerprint}"
            )

    def _map_error(self, exc: Any) -> BaseException:
        code = exc.code()
        details = rpc.error_details(exc.trailing_metadata()) if hasattr(exc, "trailing_metadata") else None
        message = exc.details() or str(code)
        name = code.name if code is not None else "UNKNOWN"
        if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED) and not self._closed:
            return ServerUnavailableError(f"{self._address}: {message}", name)
        if _is_busy(code, message, details) and not self._closed:  # retried with backoff, as unavailable
            return ServerUnavailableError(
                f"{self._address}: {message} (the server's limit on calls in progress)", name
            )
        if code in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED):
            return AuthenticationError(f"{self._address}: {message}", name)
        if _is_fence(exc):
            return FencedError(message, name)
        if details is not None and details.reason == "schedule_mismatch":  # a loaded state of another job
            return StateDictError(f"{self._address}: {message}", name)
        return BatchClientError(f"{self._address}: {message}", name)

    # --- connection ---

    def _connect(self, deadline: float) -> rpc.BatchServiceClient:
        if self._stub is not None:
            return self._stub
        options = [
            ("grpc.max_receive_message_length", _RECEIVE_LIMIT),
            ("grpc.max_send_message_length", 4 << 20),
            # a server that stops answering (a frozen host, a partition: no reset comes back)
            # is noticed within 20 s, even while the window is full and nothing flows: a ping
            # every 15 s (ladle's server allows one every 10 s) and 5 s for its answer. gRPC
            # 1.5x+ times the answer with http2.ping_timeout_ms (one minute by default)
            ("grpc.keepalive_time_ms", 15_000),
            ("grpc.keepalive_timeout_ms", 5_000),
            ("grpc.http2.ping_timeout_ms", 5_000),
            ("grpc.http2.max_pings_without_data", 0),
        ]
        # with replicas, each gets a share of the time left before the next is tried
        tries = len(self.servers)
        while True:
            left = deadline - time.monotonic()
            wait = left if tries <= 1 else min(left, max(1.0, min(left / tries, _CONNECT_TRY_S)))
            if self._credentials is not None:
                channel = grpc.secure_channel(self._address, self._credentials, options=options)
            else:
                channel = grpc.insecure_channel(self._address, options=options)
            # not self._channel until it is ready: a close() from another thread meanwhile
            # leaves it to _ready, which stops watching it before it is closed (grpcio's
            # connectivity thread raises on a channel closed under its watch)
            if self._ready(channel, time.monotonic() + max(0.01, wait)):
                break
            if not self._watch_here(channel):  # grpcio's thread stops watching it (else it raises at close)
                time.sleep(_WATCH_ENDS_S)
            channel.close()
            self._check_open()
            if time.monotonic() >= deadline or tries <= 1:
                hint = (
                    " (TLS: check the CA, the server's name and TLS on both sides)"
                    if self._credentials
                    else " (is it running, is that its gRPC port, and if it serves TLS, pass tls=True "
                    "or root_certificates=...?)"
                )
                raise ServerUnavailableError(
                    f"no batch server answered at {self.server} within {self.timeout:.0f}s{hint}",
                    "UNAVAILABLE",
                ) from None
            log.warning("rank %d: no answer from %s; trying the next replica", self.rank, self._address)
            self._server_index = (self._server_index + 1) % len(self.servers)
            tries = max(1, tries - 1)
        self._channel = channel
        if self._closed:  # closed as it became ready (close() reads _channel after setting _closed)
            self._drop_stream()
            self._check_open()
        self._stub = rpc.BatchServiceClient(channel, self._metadata)
        return self._stub

    def _watch_here(self, channel: Any) -> bool:
        """Watch ``channel`` connect through grpcio's Cython layer, like the polled reader (``wait_ready``).

        ``grpc.channel_ready_future`` leaves a watch for ``close()`` to wait
        out (0-470 ms a close, measured); ``_direct.wait_ready`` leaves none.
        """
        return (self._polled or _direct.grpc_is_tested()) and _direct.can_watch(channel)

    def _ready(self, channel: Any, until: float) -> bool:
        """Wait for ``channel`` to connect until ``until``; False at the deadline or once closed.

        Waited for in slices, so a ``close()`` from another thread ends the
        wait at once (a closed channel's ready future never completes).
        """
        if self._watch_here(channel):
            return _direct.wait_ready(channel, until, lambda: self._closed)
        ready = grpc.channel_ready_future(channel)
        try:
            while not self._closed:
                try:
                    ready.result(timeout=max(0.0, min(0.25, until - time.monotonic())))
                    return True
                except grpc.FutureTimeoutError:
                    if time.monotonic() >= until:
                        return False
            return False
        finally:
            ready.cancel()

    def _check_open(self) -> None:
        """Raise if ``close()`` (from another thread) closed the client while this one waited."""
        if self._closed:
            raise BatchClientError("the client was closed while waiting for a batch")

    def _ensure_stream(self, deadline: float) -> _ThreadedStream | _PolledStream:
        if self._stream is not None:
            return self._stream
        self._check_open()
        if self._fence is not None:  # a fenced process must stop: a new stream would take its rank back
            raise FencedError(str(self._fence), self._fence.code)
        stub = self._connect(deadline)
        request = pb.Open(
            job=self.job,
            rank=self.rank,
            world_size=self.world_size,
            prefetch=self.prefetch,
            client_id=self.client_id,
        )
        if self._next is not None:
            request.start.CopyFrom(pb.Position(epoch=self._next[0], step=self._next[1]))
        if self._fingerprint is not None:
            request.schedule_fingerprint = self._fingerprint
        if self.elastic:
            request.elastic = True
        if self.own_cursor:
            request.own_cursor = True
        if self._generation is not None:
            request.resume.CopyFrom(pb.Resume(generation=self._generation, incarnation=self._incarnation))
        first = pb.StreamRequest(open=request)
        if self._polled and _direct.available(self._channel):
            try:
                self._stream = _PolledStream(
                    self._channel, self._metadata, first, self.prefetch, self._convert
                )
                return self._stream
            except (TypeError, AttributeError) as exc:  # a grpcio whose Cython layer differs
                log.warning("rank %d: reading through grpcio's iterator (%s)", self.rank, exc)
                self._polled = False
        self._stream = _ThreadedStream(stub, first, self.prefetch, self._convert)
        return self._stream

    def _drop_stream(self) -> None:
        if self._stream is not None:
            self._note_fence(self._stream)  # a fence its reader saw outlives the stream
            self._stream.close()
            self._stream = None
        if self._channel is not None:
            self._channel.close()
            self._channel = None
            self._stub = None

    def _consume_held(self) -> None:
        """The held batch is consumed: acknowledge it and give its credit back."""
        if self._held is None:
            return
        held, self._held = self._held, None
        if self._stream is not None:
            self._stream.ack((held[0], held[1] + 1))

    # --- lifetime ---

    def close(self) -> None:
        """Acknowledge the held batch and close the stream; idempotent.

        In a forked child it only marks this client closed: the parent's
        gRPC channel is not the child's to touch. Once the client knows that a
        newer process took its rank (before or while it closes: the stream's
        graceful end reads the server's status), it acknowledges nothing, closes,
        and raises ``FencedError``, each time it is called: the process was
        replaced and must not report a clean end.
        """
        if self._closed:
            self._raise_if_fenced()
            return
        if self._pid != os.getpid():
            self._closed = True
            return
        fenced = self._note_fence(self._stream) is not None
        if not fenced:
            self._consume_held()
            if self._stream is not None:
                self._stream.flush()
        self._closed = True
        stream, self._stream = self._stream, None
        if stream is not None:
            stream.close(join=0.0 if fenced else 1.0)
            self._note_fence(stream)
        if self._channel is not None:
            self._channel.close()
            self._channel = None
        self._raise_if_fenced()

    def __enter__(self) -> BatchClient:
        return self

    def __reduce__(self) -> Any:
        """Refused: a client is one process's live stream (a ``spawn`` worker makes its own)."""
        raise BatchClientError(
            "a BatchClient cannot be pickled: it holds one process's live gRPC stream of its rank; "
            "make the client in the process that trains (from its arguments), and keep "
            "DataLoader(num_workers=0) for BatchDataset"
        )

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if exc_type is not None and self._held is not None:
            # the trainer failed on it: not consumed, the next process (or a state_dict() taken
            # now) gets it again
            self._next, self._held = self._held, None
        if exc_type is None:
            self.close()
            return
        with contextlib.suppress(FencedError):  # the exception on its way out goes on (a fence's too)
            self.close()

    def __del__(self) -> None:  # pragma: no cover - best effort
        """Dropped without ``close()``: acknowledge what was consumed (not the held batch), then end.

        The graceful end waits for the server, so it runs on a thread of its
        own (it holds the stream, not this client) instead of in the garbage
        collector's caller.
        """
        try:
            stream = self._stream
            if self._closed or stream is None or self._pid != os.getpid():
                return
            self._closed = True
            stream.flush()
            # the thread holds the channel too: freed with this client, grpcio's channel would
            # cancel the call at once, before the acknowledgement just flushed has gone
            threading.Thread(
                target=_end_dropped, args=(stream, self._channel), name="ladle-client-end", daemon=True
            ).start()
        except Exception:
            pass


# grpcio's own answer over a server's maximum_concurrent_rpcs (no ladle.v1.Error with it)
_GRPC_BUSY = "Concurrent RPC limit exceeded"


def _is_busy(code: Any, message: str, details: pb.Error | None) -> bool:
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


def _is_fence(status: Any) -> bool:
    """Whether a call's status says a newer process took this rank (FAILED_PRECONDITION, reason fenced)."""
    try:
        if status.code() is not grpc.StatusCode.FAILED_PRECONDITION:
            return False
        details = rpc.error_details(status.trailing_metadata())
    except Exception:  # not a status with trailers: not a fence
        return False
    return details is not None and details.reason == "fenced"


def _end_dropped(stream: _ThreadedStream | _PolledStream, channel: Any) -> None:
    """End a dropped client's stream gracefully, then its channel (on a thread of its own)."""
    try:
        stream.close(join=1.0)
    finally:
        if channel is not None:
            channel.close()


# Clients not closed when the interpreter exits are closed then, all at once, so what their trainers
# consumed is acknowledged. The batch each holds is not: an exit without close() may come from a
# failure on that batch (an uncaught exception, or sys.exit after a caught one), and the next
# process must get it again.
_LIVE: weakref.WeakSet[BatchClient] = weakref.WeakSet()


_warned_default_job = False


def _warn_default_job() -> None:
    """Once a process: two runs that name no job share one, and the second resumes the first."""
    global _warned_default_job
    if not _warned_default_job:
        _warned_default_job = True
        log.warning(
            "BatchClient: no job given (job=... or LADLE_JOB), so the job is 'default'; every run that "
            "names none shares it, and a new run continues where the last one stopped"
        )


def _end(client: BatchClient) -> None:
    try:
        client._held = None
        client.close()
    except Exception:  # pragma: no cover - best effort at exit
        pass


@atexit.register
def _close_at_exit() -> None:
    ending = [
        threading.Thread(target=_end, args=(c,), daemon=True)
        for c in list(_LIVE)
        if not c._closed and c._pid == os.getpid()
    ]
    for thread in ending:
        thread.start()
    until = time.monotonic() + 2.0  # a server that hangs costs the exit at most this
    for thread in ending:
        thread.join(timeout=max(0.0, until - time.monotonic()))


def _token_file() -> str:
    """The first token in the file ``LADLE_TOKEN_FILE`` names (a mounted secret), or ""."""
    path = os.environ.get("LADLE_TOKEN_FILE")
    if not path:
        return ""
    try:
        with open(path, encoding="utf-8") as f:
            return next((line.strip() for line in f if line.strip()), "")
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"LADLE_TOKEN_FILE={path!r} cannot be read: {exc}") from None


def _pem(value: bytes | str | os.PathLike[str] | None, env: str, what: str) -> bytes | None:
    """PEM bytes from ``value`` (bytes, PEM text, or a file name) or from the file named by ``env``."""
    if value is None:
        value = os.environ.get(env) or None
        if value is None:
            return None
    if isinstance(value, bytes):
        return value
    if isinstance(value, str) and value.lstrip().startswith("-----BEGIN"):
        return value.encode()
    try:
        with open(value, "rb") as f:
            return f.read()
    except OSError as exc:
        raise ValueError(f"{what}: cannot read {os.fspath(value)!r}: {exc.strerror or exc}") from None


def channel_credentials(
    tls: bool | None,
    root_certificates: bytes | str | os.PathLike[str] | None,
    client_certificate: bytes | str | os.PathLike[str] | None,
    client_key: bytes | str | os.PathLike[str] | None,
) -> Any:
    """``grpc.ssl_channel_credentials`` when TLS is asked for (explicitly or by certificates), else None."""
    roots = _pem(root_certificates, "LADLE_TLS_CA", "root_certificates")
    cert = _pem(client_certificate, "LADLE_TLS_CERT", "client_certificate")
    key = _pem(client_key, "LADLE_TLS_KEY", "client_key")
    if (cert is None) != (key is None):
        raise ValueError("client_certificate and client_key go together (mutual TLS)")
    if tls is False:
        if roots is not None or cert is not None:
            raise ValueError("tls=False, but TLS certificates were given")
        return None
    if tls is None and roots is None and cert is None:
        return None
    return grpc.ssl_channel_credentials(root_certificates=roots, private_key=key, certificate_chain=cert)
