"""Fixtures that run real ``ladle serve`` processes on loopback and always stop them."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from ladle.service.synth import make_dataset

SMALL_CONFIG = [
    "--max-seq-len", "512",
    "--bucket-bounds", "0,48,76,108,152,206,513",
    "--token-budget", "3072",
    "--max-batch-size", "16",
]  # fmt: skip


@dataclass
class ServerProcess:
    """One ``ladle serve`` child process; ``address`` (gRPC) and ``http_url`` once it is serving."""

    dataset: Path
    state: Path
    workdir: Path
    extra: list[str] = field(default_factory=list)
    proc: subprocess.Popen[bytes] | None = None
    address: str = ""
    port: int = 0
    http_port: int = 0

    @property
    def http_url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    def start(self, timeout: float = 60.0) -> ServerProcess:
        ready = self.workdir / f"ready-{time.monotonic_ns()}"
        http_ready = ready.with_name(ready.name + ".http")
        log = (self.workdir / "server.log").open("ab")
        # one store: the state file unless the test gives a Redis (serve refuses both)
        store = [] if "--redis-url" in self.extra else ["--state", str(self.state)]
        cmd = [
            str(Path(sys.executable).with_name("ladle")), "serve", str(self.dataset),
            "--host", "127.0.0.1", "--grpc-port", str(self.port), *store,
            "--ready-file", str(ready), "--http-port", "0", "--http-ready-file", str(http_ready),
            "--grace", "1", *SMALL_CONFIG, *self.extra,
        ]  # fmt: skip
        with log:  # the child has its own descriptor of it
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        while not ready.exists():
            if self.proc.poll() is not None:
                raise RuntimeError(f"ladle serve exited with {self.proc.returncode}: {self.log_tail()}")
            if time.monotonic() > deadline:
                self.kill()
                raise RuntimeError(f"ladle serve did not get ready: {self.log_tail()}")
            time.sleep(0.05)
        self.address = ready.read_text()
        self.port = int(self.address.rsplit(":", 1)[1])
        self.http_port = int(http_ready.read_text().rsplit(":", 1)[1])  # written before the gRPC file
        return self

    def log_tail(self) -> str:
        path = self.workdir / "server.log"
        return path.read_text(errors="replace")[-3000:] if path.exists() else ""

    def kill(self) -> None:
        """kill -9: no shutdown at all."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=30)

    def stop(self) -> int:
        """SIGTERM, then wait; returns the exit code."""
        if self.proc is None:
            return 0
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=30)
        return int(self.proc.returncode)

    def rss_kib(self) -> int:
        assert self.proc is not None
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS"):
                return int(line.split()[1])
        return 0


@pytest.fixture(scope="session")
def small_dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("serve-ds") / "ds"
    make_dataset(out, 2000, seed=3, scale=1 / 16)
    return out


@pytest.fixture(scope="module")
def module_server(small_dataset: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """One ``ladle serve`` shared by a module's tests (each test uses its own job names)."""
    workdir = tmp_path_factory.mktemp("module-server")
    server = ServerProcess(small_dataset, workdir / "state.db", workdir)
    try:
        yield server.start()
    finally:
        server.kill()


@pytest.fixture
def server_factory(small_dataset: Path, tmp_path: Path) -> Iterator[Callable[..., ServerProcess]]:
    started: list[ServerProcess] = []

    def make(
        extra: list[str] | None = None, state: Path | None = None, dataset: Path | None = None, port: int = 0
    ) -> ServerProcess:
        server = ServerProcess(
            dataset or small_dataset, state or tmp_path / "state.db", tmp_path, extra or [], port=port
        )
        started.append(server)
        return server.start()

    yield make
    for server in started:
        server.kill()
    os.environ.pop("LADLE_SERVER", None)
