"""``ladle.client._direct.DirectCall`` against a real in-process gRPC server on 127.0.0.1."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from typing import Any

import grpc
import pytest

from ladle.client import _direct

SERVICE = "ladle.test.Direct"


def _echo(requests: Iterator[bytes], context: Any) -> Iterator[bytes]:
    """Echoes each request; b"abort" ends the call with a status and a trailer; b"hold" sends nothing."""
    for request in requests:
        if request == b"abort":
            context.set_trailing_metadata((("ladle-test-bin", b"\x01\x02"),))
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, "told to abort")
        if request == b"hold":
            while context.is_active():
                time.sleep(0.01)
            return
        yield request


@pytest.fixture
def channel() -> Iterator[grpc.Channel]:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    echo = grpc.stream_stream_rpc_method_handler(_echo)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, {"Echo": echo}),))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    ch = grpc.insecure_channel(f"127.0.0.1:{port}")
    try:
        grpc.channel_ready_future(ch).result(timeout=10)
        yield ch
    finally:
        ch.close()
        server.stop(grace=None).wait(5)


def _once_sent(call: _direct.DirectCall, start: Callable[[], bool], what: str) -> None:
    """``start()`` (a send or the half-close) once the message before has gone, polling for its
    completion as the reader thread would.

    The echo of the last message can be polled before the completion of its
    send: ``receive`` then returns with the send still open, and nothing else
    polls the call here (in ``BatchClient`` the reader thread always does).
    """
    deadline = time.monotonic() + 10
    while not start():
        assert time.monotonic() < deadline, f"{what} never became possible"
        if call.sending():
            call._poll()  # the only operation that can complete now: the last send's
        else:
            time.sleep(0.001)


def _send(call: _direct.DirectCall, message: bytes) -> None:
    _once_sent(call, lambda: call.send(message), "a send")


def test_available_on_a_grpcio_channel(channel: grpc.Channel) -> None:
    assert _direct.available(channel)
    assert not _direct.available(object())


def test_messages_both_ways_and_a_clean_end(channel: grpc.Channel) -> None:
    call = _direct.DirectCall(channel, f"/{SERVICE}/Echo", b"first")
    assert call.receive() == b"first"
    for i in range(20):
        _send(call, b"m%d" % i)
        assert call.receive() == b"m%d" % i, "messages out of order"
    # one message in flight at a time: its completion must be polled before the next starts
    _send(call, b"last")
    assert not call.send(b"too soon"), "a second message started while one was in flight"
    assert call.receive() == b"last"
    # (the send of "last" may still await its completion: under load its echo came first, and a
    # loop that only slept here waited for good)
    _once_sent(call, call.close_send, "the half-close")
    assert call.receive() is None
    assert call.status is not None
    assert call.status.code() is grpc.StatusCode.OK
    assert call.receive() is None, "the end did not stay the end"
    assert not call.send(b"after the end")


def test_an_aborted_call_reports_its_status_and_trailers(channel: grpc.Channel) -> None:
    call = _direct.DirectCall(channel, f"/{SERVICE}/Echo", b"abort")
    assert call.receive() is None
    status = call.status
    assert isinstance(status, grpc.RpcError)
    assert status.code() is grpc.StatusCode.FAILED_PRECONDITION
    assert status.details() == "told to abort"
    assert ("ladle-test-bin", b"\x01\x02") in [tuple(m) for m in status.trailing_metadata()]


def test_cancel_from_another_thread_ends_a_blocked_receive(channel: grpc.Channel) -> None:
    call = _direct.DirectCall(channel, f"/{SERVICE}/Echo", b"hold")
    timer = threading.Timer(0.2, call.cancel)
    timer.start()
    began = time.monotonic()
    try:
        assert call.receive() is None
    finally:
        timer.cancel()
    assert time.monotonic() - began < 5, "the receive was not ended by the cancel"
    assert call.status is not None
    assert call.status.code() is grpc.StatusCode.CANCELLED
    call.close()  # idempotent once the call has ended


def test_on_sent_runs_when_a_message_has_gone(channel: grpc.Channel) -> None:
    call = _direct.DirectCall(channel, f"/{SERVICE}/Echo", b"first")
    sent: list[bool] = []
    call.on_sent = lambda: sent.append(call.sending())
    assert call.receive() == b"first"
    _send(call, b"second")
    assert call.receive() == b"second"
    assert sent, "on_sent never ran"
    assert not any(sent), "on_sent ran while the message was still marked in flight"
    call.close()


@pytest.fixture
def server_port() -> Iterator[int]:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield port
    finally:
        server.stop(grace=None).wait(5)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_wait_ready_connects_and_leaves_no_watch_for_close(server_port: int) -> None:
    """grpcio's ready future leaves a polling thread whose watch close() waits out (up to 0.2 s)."""
    ch = grpc.insecure_channel(f"127.0.0.1:{server_port}")
    try:
        assert _direct.can_watch(ch)
        assert _direct.wait_ready(ch, time.monotonic() + 10, lambda: False)
        state = ch._connectivity_state  # grpcio's own bookkeeping
        assert not state.polling, "a connectivity thread of grpcio's is watching the channel"
        assert not state.callbacks_and_connectivities
    finally:
        ch.close()


def test_wait_ready_gives_up_at_the_deadline_and_when_told_to_stop() -> None:
    ch = grpc.insecure_channel(f"127.0.0.1:{_free_port()}")  # nothing listens there
    try:
        start = time.monotonic()
        assert not _direct.wait_ready(ch, start + 0.6, lambda: False, slice_s=0.1)
        assert 0.6 <= time.monotonic() - start < 5
        stop = threading.Event()
        threading.Timer(0.3, stop.set).start()
        start = time.monotonic()
        assert not _direct.wait_ready(ch, start + 30, stop.is_set, slice_s=0.1)
        assert time.monotonic() - start < 5, "stop() was not seen"
    finally:
        ch.close()


def test_wait_ready_connects_to_a_server_that_comes_late() -> None:
    port = _free_port()
    ch = grpc.insecure_channel(f"127.0.0.1:{port}")
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    try:
        threading.Timer(0.5, lambda: (server.add_insecure_port(f"127.0.0.1:{port}"), server.start())).start()
        assert _direct.wait_ready(ch, time.monotonic() + 30, lambda: False)
    finally:
        ch.close()
        server.stop(grace=None).wait(5)
