"""``serve_forever`` in process, with a stand-in server: its signals and its ready files.

A thread sends the signals to this process once the ready file is there; the
handlers run on the main thread, where ``serve_forever`` waits. A fallback
handler turns a signal that ``serve_forever`` leaves alone into a test failure
instead of the end of the test run.
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import FrameType, TracebackType

import pytest

from ladle.service import server as server_module
from ladle.service.errors import ConfigError
from ladle.service.schedule import ScheduleConfig


class UnhandledSignalError(Exception):
    """A signal reached the test's fallback handler: ``serve_forever`` left it alone."""


class FakeServer:
    """What ``serve_forever`` uses of a ``BatchServer``; its stop waits the grace unless cut short."""

    host = "127.0.0.1"
    port = 4242
    http_port = 8484
    address = "127.0.0.1:4242"

    def __init__(self, grace: float = 0.0, http: bool = True) -> None:
        self.grace = grace
        self.http_url = f"http://127.0.0.1:{self.http_port}" if http else None
        self.cut_short = threading.Event()
        self.stopped_after: float | None = None

    def stop_now(self) -> None:
        self.cut_short.set()

    def __enter__(self) -> FakeServer:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, value: BaseException | None, tb: TracebackType | None
    ) -> None:
        began = time.monotonic()
        self.cut_short.wait(self.grace)  # as BatchServer.stop waits for held streams
        self.stopped_after = time.monotonic() - began


@pytest.fixture
def fallback() -> Iterator[None]:
    """A signal ``serve_forever`` does not take over raises ``UnhandledSignalError``, not kill pytest."""

    def _unhandled(signum: int, frame: FrameType | None) -> None:
        raise UnhandledSignalError(f"signal {signum} was not handled by serve_forever")

    signals = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)
    previous = {s: signal.signal(s, _unhandled) for s in signals}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def signal_when_ready(
    ready: Path, *signals: int, gap: float = 0.3, before: str | None = None
) -> threading.Thread:
    """Once ``ready`` exists (and, given ``before``, is overwritten with it), send ``signals`` here."""

    def run() -> None:
        deadline = time.monotonic() + 30
        while not ready.exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        if before is not None:
            ready.write_text(before)
        for signum in signals:
            os.kill(os.getpid(), signum)
            time.sleep(gap)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


@pytest.mark.usefixtures("fallback")
def test_sighup_stops_like_sigterm(tmp_path: Path) -> None:
    ready = tmp_path / "ready"
    thread = signal_when_ready(ready, signal.SIGHUP)
    assert server_module.serve_forever(FakeServer(), ready_file=str(ready)) == 0  # type: ignore[arg-type]
    thread.join(10)


@pytest.mark.usefixtures("fallback")
def test_a_second_signal_cuts_the_grace_short(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    ready = tmp_path / "ready"
    server = FakeServer(grace=30.0)
    thread = signal_when_ready(ready, signal.SIGTERM, signal.SIGINT)
    began = time.monotonic()
    with caplog.at_level(logging.INFO, logger="ladle.server"):
        assert server_module.serve_forever(server, ready_file=str(ready)) == 0  # type: ignore[arg-type]
    thread.join(10)
    assert server.cut_short.is_set(), "the second signal did not cut the grace short"
    assert time.monotonic() - began < 10, "the shutdown waited the grace after a second signal"
    messages = [r.getMessage() for r in caplog.records if r.name == "ladle.server"]
    assert messages == [
        f"signal {int(signal.SIGTERM)}: shutting down (grace 30.0s)",
        f"signal {int(signal.SIGINT)}: second signal: stopping now",
        "stopped",  # a clean end: a kill leaves no such line
    ], messages


class SlowStartServer(FakeServer):
    """A server whose start (opening the dataset, binding) takes a while: a SIGTERM comes meanwhile."""

    def __enter__(self) -> FakeServer:
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.2)  # the handler runs on the main thread during the start
        return self


@pytest.mark.usefixtures("fallback")
def test_a_stop_signal_during_start_up_announces_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    """It used to print "serving", write the ready files and only then stop."""
    ready, http_ready = tmp_path / "ready", tmp_path / "http"
    with caplog.at_level(logging.INFO, logger="ladle.server"):
        code = server_module.serve_forever(
            SlowStartServer(),  # type: ignore[arg-type]
            ready_file=str(ready),
            http_ready_file=str(http_ready),
        )
    assert code == 0
    assert "serving on" not in capsys.readouterr().out
    assert not ready.exists()
    assert not http_ready.exists()
    messages = [r.getMessage() for r in caplog.records if r.name == "ladle.server"]
    assert messages[-2:] == ["stopping: the stop signal came during start-up", "stopped"], messages


@pytest.mark.usefixtures("fallback")
def test_the_ready_files_go_when_the_server_stops(tmp_path: Path) -> None:
    ready, http_ready = tmp_path / "ready", tmp_path / "http"
    thread = signal_when_ready(ready, signal.SIGTERM)
    code = server_module.serve_forever(FakeServer(), ready_file=str(ready), http_ready_file=str(http_ready))  # type: ignore[arg-type]
    assert code == 0
    thread.join(10)
    assert not ready.exists(), "the gRPC ready file outlived the server"
    assert not http_ready.exists(), "the HTTP ready file outlived the server"


@pytest.mark.usefixtures("fallback")
def test_a_ready_file_another_server_rewrote_is_left(tmp_path: Path) -> None:
    ready = tmp_path / "ready"
    thread = signal_when_ready(ready, signal.SIGTERM, before="127.0.0.1:5555")  # a successor's
    assert server_module.serve_forever(FakeServer(http=False), ready_file=str(ready)) == 0  # type: ignore[arg-type]
    thread.join(10)
    assert ready.read_text() == "127.0.0.1:5555", "removed a ready file this server did not write"


@pytest.mark.parametrize("grace", [float("inf"), float("nan"), -1.0])
def test_a_grace_that_is_not_a_finite_number_of_seconds(tmp_path: Path, grace: float) -> None:
    with pytest.raises(ConfigError, match="grace: must be a finite number of seconds >= 0"):
        server_module.BatchServer(tmp_path, ScheduleConfig(), grace=grace)


@pytest.mark.parametrize("port", [0, 50999])
def test_a_host_this_machine_lacks_is_named_not_the_port(port: int) -> None:
    """--host 10.255.255.1 was "grpc_port: cannot listen", and with port 0 a name that did not resolve too."""
    with pytest.raises(ConfigError, match="is not an address of this machine") as lacks:
        server_module._check_port_free("10.255.255.1", port)
    assert lacks.value.field == "host"
    with pytest.raises(ConfigError, match="cannot resolve") as unknown:
        server_module._check_port_free("no-such-host.invalid", port)
    assert unknown.value.field == "host"
    server_module._check_port_free("127.0.0.1", 0)  # a free port: nothing to say


@pytest.mark.usefixtures("fallback")
def test_a_signal_that_lands_on_another_thread_still_stops_it(tmp_path: Path) -> None:
    """The kernel may hand a process's signal to any thread that does not block it; Python then only
    marks its handler as due, for the main thread to run. A main thread asleep in one endless wait
    never ran it: the server went on serving (seen with SIGQUIT in a full test run)."""
    ready = tmp_path / "ready"
    stopped = threading.Event()

    def run() -> None:
        deadline = time.monotonic() + 30
        while not ready.exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        signal.pthread_kill(threading.get_ident(), signal.SIGTERM)  # to this thread, not the main one
        if not stopped.wait(10):  # the fix is missing: wake the main thread so the test ends
            os.kill(os.getpid(), signal.SIGINT)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    began = time.monotonic()
    try:
        assert server_module.serve_forever(FakeServer(), ready_file=str(ready)) == 0  # type: ignore[arg-type]
    finally:
        stopped.set()
    took = time.monotonic() - began
    thread.join(10)
    assert took < 5, f"a signal delivered to another thread stopped the server after {took:.1f}s"


def test_the_graceful_stop_wait_runs_a_signal_another_thread_took() -> None:
    """``BatchServer.stop`` waits up to the grace (+10 s) for the loop's stop; a second signal the kernel
    gave another thread meanwhile must still run its handler (which cuts the grace short) at once."""
    stopping: concurrent.futures.Future[None] = concurrent.futures.Future()

    def cut_short(signum: int, frame: FrameType | None) -> None:
        stopping.set_result(None)

    previous = signal.signal(signal.SIGUSR1, cut_short)
    try:

        def send() -> None:
            time.sleep(0.2)
            signal.pthread_kill(threading.get_ident(), signal.SIGUSR1)  # to this thread, not the main one

        thread = threading.Thread(target=send, daemon=True)
        thread.start()
        began = time.monotonic()
        server_module._wait_in_slices(stopping, 8.0)
        took = time.monotonic() - began
        thread.join(10)
    finally:
        signal.signal(signal.SIGUSR1, previous)
    assert took < 4, f"the handler ran {took:.1f}s after the signal"
