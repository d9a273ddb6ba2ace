"""``ladle serve`` as a child process on free loopback ports, for ``ladle demo`` and the examples.

``ServeProcess`` starts the server with a fresh embedded store in a work
folder (or on a Redis, ``redis_url=``), waits until it serves (its ready files name the gRPC and HTTP
addresses) and, as a context manager, always stops it: SIGTERM (a graceful
shutdown), then SIGKILL after ``grace`` seconds. It binds 127.0.0.1 only.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType

__all__ = ["ServeProcess", "ServerStartError"]


class ServerStartError(RuntimeError):
    """The server exited or did not get ready in time; the message ends with its log's tail."""


class ServeProcess:
    """One ``ladle serve DATASET`` child; ``address`` (gRPC) and ``http_address`` once it serves."""

    def __init__(
        self,
        dataset: str | os.PathLike[str],
        workdir: str | os.PathLike[str],
        *,
        config: str | os.PathLike[str] | None = None,
        extra: Sequence[str] = (),
        redis_url: str | None = None,
        log_level: str = "WARNING",
        timeout: float = 120.0,
        grace: float = 30.0,
    ) -> None:
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.log = self.workdir / "server.log"
        self.grace = grace
        ready, http_ready, state = (self.workdir / name for name in ("ready", "http", "state.db"))
        self.state = state  # the embedded cursor store's file (unused with ``redis_url``)
        store = ["--state", str(state)] if redis_url is None else ["--redis-url", redis_url]
        for stale in (ready, http_ready, state):
            stale.unlink(missing_ok=True)
        cmd = [
            sys.executable, "-m", "ladle.service.cli", "serve", os.fspath(dataset), "--host", "127.0.0.1",
            "--grpc-port", "0", "--http-port", "0", "--http-ready-file", str(http_ready),
            *store, "--ready-file", str(ready), "--log-level", log_level,
            *(["--config", os.fspath(config)] if config is not None else []), *extra,
        ]  # fmt: skip
        with self.log.open("wb") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + timeout
            while not ready.exists():
                if self.proc.poll() is not None:
                    raise ServerStartError(
                        f"ladle serve exited with {self.proc.returncode}:\n{self.log_tail()}"
                    )
                if time.monotonic() > deadline:
                    raise ServerStartError(
                        f"ladle serve did not get ready in {timeout:.0f}s:\n{self.log_tail()}"
                    )
                time.sleep(0.05)
        except BaseException:
            self.stop()
            raise
        self.address = ready.read_text()
        self.http_address = http_ready.read_text() if http_ready.exists() else ""

    def log_tail(self, chars: int = 2000) -> str:
        return self.log.read_text(errors="replace")[-chars:] if self.log.exists() else ""

    def stop(self) -> int:
        """Stop the server (SIGTERM, then SIGKILL after ``grace`` seconds); returns its exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=self.grace)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=30)
        return int(self.proc.returncode)

    def __enter__(self) -> ServeProcess:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, value: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()
