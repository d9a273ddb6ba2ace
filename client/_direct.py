"""A bidirectional gRPC call polled by one thread of its caller's (no channel-spin thread).

grpcio's synchronous streams hand every received message from its
channel-spin thread to the thread that reads the call, and ``BatchClient``'s
reader thread hands it on to the trainer: two Python thread wake-ups a
batch, which cost more CPU than decoding it. This module drives one call on
a completion queue of its own, as grpcio's single-threaded unary-stream
rendezvous does, but for a bidirectional call: the thread that receives
polls the queue itself, so a message that has arrived wakes no other
thread. One receive is kept outstanding, so the next message is on its way
while the last one is used.

It uses grpcio's Cython layer (``grpc._cython.cygrpc``), which grpcio's own
channel is built on and which is not a public API: :func:`available` says
whether this grpcio has what is needed, and ``BatchClient`` falls back to
grpcio's iterator when it has not.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import grpc

from ladle.proto import transport

try:  # grpcio's own layer: present in every grpcio this package supports, checked anyway
    from grpc import _common as _grpc_common
    from grpc._cython import cygrpc as _cygrpc
except ImportError:  # pragma: no cover - an unusual grpcio build
    _cygrpc = None
    _grpc_common = None

__all__ = [
    "TESTED_GRPC",
    "DirectCall",
    "StatusError",
    "available",
    "can_watch",
    "grpc_is_tested",
    "wait_ready",
]

_FLAGS = 0
_NEEDED = (
    "SendInitialMetadataOperation",
    "SendMessageOperation",
    "SendCloseFromClientOperation",
    "ReceiveInitialMetadataOperation",
    "ReceiveMessageOperation",
    "ReceiveStatusOnClientOperation",
    "PropagationConstants",
    "StatusCode",
)
# the tags of this call's operations
_START, _METADATA, _STATUS = "start", "metadata", "status"
_RECEIVE, _SEND, _CLOSE = "receive", "send", "close"


# The grpcio minor versions this module was tested with (its Cython layer is not a public API,
# so a later grpcio may change it without notice): BatchClient uses a DirectCall on these only,
# unless LADLE_CLIENT_READER=polled asks for it on any grpcio that has the calls.
TESTED_GRPC = transport.TESTED_GRPC


def grpc_is_tested(version: str | None = None) -> bool:
    """True if grpcio ``version`` (default: the one imported) is one this module was tested with."""
    return transport.grpc_is_tested(str(version or getattr(grpc, "__version__", "")))


def available(channel: Any) -> bool:
    """True if ``channel`` (a ``grpc.Channel``) can carry a :class:`DirectCall`."""
    if _cygrpc is None or _grpc_common is None or not all(hasattr(_cygrpc, n) for n in _NEEDED):
        return False
    return hasattr(getattr(channel, "_channel", None), "segregated_call")


def can_watch(channel: Any) -> bool:
    """True if :func:`wait_ready` can watch ``channel``'s connectivity on the caller's thread."""
    inner = getattr(channel, "_channel", None)
    return (
        _cygrpc is not None
        and hasattr(_cygrpc, "ConnectivityState")
        and hasattr(inner, "check_connectivity_state")
        and hasattr(inner, "watch_connectivity_state")
    )


def wait_ready(channel: Any, until: float, stop: Callable[[], bool], slice_s: float = 0.25) -> bool:
    """Connect ``channel``, wait until it is READY; False at ``until`` (monotonic) or once ``stop()``.

    ``grpc.channel_ready_future`` watches the channel on a thread of
    grpcio's that renews a 0.2 s watch until it sees the unsubscription, and
    ``channel.close()`` waits for that watch to end. Here the watch runs in
    slices of at most ``slice_s`` (so ``stop`` is seen) on a thread of this
    call's, which the caller waits for: none is left once this returns, so a
    close right after costs nothing.

    The watch is not on the caller's thread because a signal handler's
    exception (Ctrl-C's ``KeyboardInterrupt``, a preemption handler's
    ``sys.exit``) raised inside it leaves grpcio's watch registered with
    nobody to complete it, and closing or collecting the channel then waits
    for it for ever. Interrupted, the caller raises at once; the watch ends
    at its slice's deadline. The channel must not be closed while this runs.
    """
    result: list[bool] = []
    failed: list[BaseException] = []
    interrupted = threading.Event()

    def watch() -> None:
        try:
            result.append(_watch_ready(channel, until, lambda: interrupted.is_set() or stop(), slice_s))
        except BaseException as exc:  # handed to the caller
            failed.append(exc)

    watcher = threading.Thread(target=watch, name="ladle-connect", daemon=True)
    watcher.start()
    try:
        watcher.join()  # a signal's exception is raised here, in the caller
    except BaseException:
        interrupted.set()
        raise
    if failed:
        raise failed[0]
    return result[0]


def _watch_ready(channel: Any, until: float, stop: Callable[[], bool], slice_s: float) -> bool:
    assert _cygrpc is not None
    inner = channel._channel
    ready = _cygrpc.ConnectivityState.ready
    state = inner.check_connectivity_state(True)
    while state != ready:
        left = until - time.monotonic()
        if left <= 0 or stop():
            return False
        # the GIL is released while it waits; it returns on a change or at its deadline
        inner.watch_connectivity_state(state, time.time() + min(slice_s, left))
        state = inner.check_connectivity_state(True)  # and asks again out of IDLE or a failure
    return True


class StatusError(grpc.RpcError):  # type: ignore[misc]  # grpc's stubs type it as Any
    """How a direct call ended, in the shape of grpcio's own call errors (code, details, trailers)."""

    def __init__(
        self, code: grpc.StatusCode, details: str, trailing_metadata: tuple[tuple[str, Any], ...] = ()
    ) -> None:
        super().__init__(f"{code.name}: {details}")
        self._code = code
        self._details = details
        self._trailing = trailing_metadata

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details

    def trailing_metadata(self) -> tuple[tuple[str, Any], ...]:
        return self._trailing


class DirectCall:
    """One bidirectional call whose completion queue is polled by the thread that receives.

    ``receive()`` returns the next message, or None once the call has ended
    (``status`` then says how). ``send()`` may be called from any thread; at
    most one message is in flight upstream, and gRPC starts the next only
    after the last one's completion has been polled, so it returns False
    until then and the caller keeps its message for later (``on_sent`` says
    when). ``cancel()`` may be called from any thread and makes a blocked
    ``receive()`` return. Only one thread may call ``receive()`` or ``close()``.
    """

    def __init__(self, channel: Any, method: str, first: bytes, metadata: Any = ()) -> None:
        cy = _cygrpc
        assert cy is not None
        self._cy = cy
        self._lock = threading.Lock()
        self._messages: deque[bytes | None] = deque()
        self._open: set[str] = set()  # tags started and not yet completed (never poll without one)
        self._receiving = False
        self._sending = False
        self.status: StatusError | None = None
        self.broken = False  # polling was interrupted (a signal): the call is gone
        self.on_sent: Callable[[], None] | None = None  # called on the polling thread when a send completes
        operations = (
            (
                (
                    cy.SendInitialMetadataOperation(tuple(metadata) or None, _FLAGS),
                    cy.SendMessageOperation(first, _FLAGS),
                ),
                _START,
            ),
            ((cy.ReceiveInitialMetadataOperation(_FLAGS),), _METADATA),
            ((cy.ReceiveStatusOnClientOperation(_FLAGS),), _STATUS),
        )
        self._call = channel._channel.segregated_call(
            cy.PropagationConstants.GRPC_PROPAGATE_DEFAULTS,
            method.encode(),
            None,
            None,  # no deadline: a trainer's stream lives as long as its run
            tuple(metadata) or None,
            None,
            operations,
            None,
        )
        self._open.update((_START, _METADATA, _STATUS))
        self._sending = True  # the Open is the first message up
        self._start_receive()

    # --- receiving (one thread) ---

    def receive(self) -> bytes | None:
        """The next message (blocking until it comes), or None when the call has ended."""
        while not self._messages:
            if self.status is not None or not self._open:
                self._drain()
                return None
            self._poll()
        message = self._messages.popleft()
        if message is None:
            self._messages.appendleft(None)  # the end stays the end
            self._drain()  # the status follows the last message: wait for it
        return message

    def _start_receive(self) -> None:
        if self._receiving or self.status is not None:
            return
        if self._call.operate((self._cy.ReceiveMessageOperation(_FLAGS),), _RECEIVE):
            self._receiving = True
            self._open.add(_RECEIVE)

    def _poll(self) -> None:
        """Take one completed operation off the call's queue (blocks, without the GIL)."""
        try:
            event = self._call.next_event()
        except BaseException:  # a signal handler raised: grpcio has destroyed the call
            self.broken = True
            self._open.clear()
            if self.status is None:
                self.status = StatusError(grpc.StatusCode.CANCELLED, "interrupted")
            self._messages.append(None)
            raise
        tag = event.tag
        self._open.discard(tag)
        if tag == _RECEIVE:
            self._receiving = False
            message = event.batch_operations[0].message() if event.success else None
            if message is None:
                self._messages.append(None)
            else:
                self._messages.append(message)
                self._start_receive()  # the next one is on its way while this one is used
        elif tag in (_SEND, _START):
            with self._lock:
                self._sending = False
            if self.on_sent is not None:
                self.on_sent()
        elif tag == _STATUS:
            op = event.batch_operations[0]
            assert _grpc_common is not None
            code = _grpc_common.CYGRPC_STATUS_CODE_TO_STATUS_CODE.get(op.code(), grpc.StatusCode.UNKNOWN)
            self.status = StatusError(code, op.details() or "", tuple(op.trailing_metadata() or ()))
            self._messages.append(None)

    def _drain(self) -> None:
        """Wait out the operations still open, so the call and its queue are released."""
        while self._open and not self.broken:
            try:
                self._poll()
            except Exception:  # grpcio refused the bookkeeping of a completion: give the call up
                self.broken = True
                self._open.clear()

    # --- sending (any thread) ---

    def send(self, message: bytes) -> bool:
        """Start sending ``message``; False if one is still in flight or the call has ended."""
        with self._lock:
            if self._sending or self.status is not None or self.broken:
                return False
            # marked open before it starts: its completion may be polled before operate returns
            self._sending = True
            self._open.add(_SEND)
            started = False
            try:
                started = bool(self._call.operate((self._cy.SendMessageOperation(message, _FLAGS),), _SEND))
            finally:
                if not started:
                    self._sending = False
                    self._open.discard(_SEND)
            return started

    def sending(self) -> bool:
        """True while a message sent upstream has not been seen complete."""
        return self._sending

    def close_send(self) -> bool:
        """Half-close: no more messages up (after the one in flight); False if that cannot start now."""
        with self._lock:
            if self._sending or self.status is not None or self.broken or _CLOSE in self._open:
                return False
            self._open.add(_CLOSE)
            started = False
            try:
                started = bool(self._call.operate((self._cy.SendCloseFromClientOperation(_FLAGS),), _CLOSE))
            finally:
                if not started:
                    self._open.discard(_CLOSE)
            return started

    # --- ending ---

    def cancel(self) -> None:
        """Cancel the call (any thread); a blocked ``receive()`` then returns None."""
        if self.broken:
            return
        self._call.cancel(self._cy.StatusCode.cancelled, "cancelled by the client")

    def close(self) -> None:
        """Cancel the call and release it (the receiving thread)."""
        self.cancel()
        self._drain()
