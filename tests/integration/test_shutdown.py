"""How a real ``ladle serve`` process ends: SIGHUP, a second signal, its ready files.

The first SIGTERM, SIGINT or SIGHUP drains (streams end with UNAVAILABLE
within ``--grace``) and exits 0; a second one during the grace ends them at
once; either way the ready files go with the server.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from ladle.client import BatchClient

from .conftest import ServerProcess

Factory = Callable[..., ServerProcess]

# A trainer that takes one batch and then sits on its stream (the test freezes it with SIGSTOP).
_HOLDING_TRAINER = """
import sys, time
from ladle.client import BatchClient
client = BatchClient(0, 1, sys.argv[1], sys.argv[2], timeout=30, prefetch=2)
it = iter(client)
next(it)
print("holding", flush=True)
time.sleep(600)
"""


@pytest.fixture(params=["unblocked", "blocked"])
def hup_default(request: pytest.FixtureRequest) -> Iterator[None]:
    """Servers started meanwhile get SIGHUP's and SIGQUIT's default actions, even if this run was
    started by nohup or in the background by a script (which ignore them); under "blocked" they
    also inherit a mask that blocks both, as a CI runner's or supervisor's can (exec keeps it)."""
    hup_quit = (signal.SIGHUP, signal.SIGQUIT)
    previous = {s: signal.signal(s, signal.SIG_DFL) for s in hup_quit}
    how = signal.SIG_BLOCK if request.param == "blocked" else signal.SIG_UNBLOCK
    mask = signal.pthread_sigmask(how, hup_quit)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        for s, action in previous.items():
            signal.signal(s, action)


def ready_files(server: ServerProcess) -> list[Path]:
    return sorted(server.workdir.glob("ready-*"))


def signal_masks(pid: int) -> str:
    """The process's blocked, ignored and caught signal masks, as Linux's /proc shows them."""
    try:
        lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    except OSError:
        return "no /proc"
    wanted = ("SigBlk", "SigIgn", "SigCgt")
    return " ".join(line.replace("\t", "") for line in lines if line.startswith(wanted))


def wait_exit(server: ServerProcess, timeout: float) -> int | None:
    assert server.proc is not None
    try:
        return server.proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        return None


@pytest.mark.usefixtures("hup_default")
@pytest.mark.parametrize("signum", [signal.SIGHUP, signal.SIGQUIT])
def test_sighup_and_sigquit_drain_and_exit_zero(server_factory: Factory, signum: int) -> None:
    server = server_factory()
    assert server.proc is not None
    client = BatchClient(0, 1, server.address, "hup", timeout=30, prefetch=2)
    try:
        it = iter(client)
        for _ in range(4):
            next(it)
        assert len(ready_files(server)) == 2, "the ready files are not there while it serves"
        masks = signal_masks(server.proc.pid)
        server.proc.send_signal(signum)
        code = wait_exit(server, 30)
    finally:
        client.close()
    why = f"exit {code} (a negative one is the signal's; masks before it: {masks})"
    assert code == 0, f"signal {signum}: {why}: {server.log_tail()}"
    assert f"signal {int(signum)}: shutting down" in server.log_tail()
    assert ready_files(server) == [], "the ready files outlived the server"


def test_a_second_signal_stops_at_once(server_factory: Factory) -> None:
    server = server_factory(["--grace", "30"])
    assert server.proc is not None
    trainer = subprocess.Popen(
        [sys.executable, "-c", _HOLDING_TRAINER, server.address, "held"],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert trainer.stdout is not None
        assert trainer.stdout.readline().strip() == "holding"
        time.sleep(0.5)
        trainer.send_signal(signal.SIGSTOP)  # held: it reads nothing and answers nothing
        server.proc.send_signal(signal.SIGTERM)
        assert wait_exit(server, 2.0) is None, "the server did not wait for the held trainer at all"
        server.proc.send_signal(signal.SIGTERM)
        began = time.monotonic()
        code = wait_exit(server, 30)
        took = time.monotonic() - began
    finally:
        trainer.kill()  # SIGKILL ends a stopped process too
        trainer.wait(timeout=30)
    assert code == 0, f"exit {code}: {server.log_tail()}"
    assert took < 5, f"the second signal took {took:.1f}s to stop the server (grace 30 s)"
    log = server.log_tail()
    assert f"signal {int(signal.SIGTERM)}: second signal: stopping now" in log, log
    assert "Traceback" not in log, log
    assert ready_files(server) == [], "the ready files outlived the server"
