"""A throwaway ``redis-server`` on a free loopback port, for tests and benchmarks.

Each ``RedisServer`` runs in its own temporary folder (its AOF, RDB and log
live there), never touches another Redis (such as a shared one on 6379), and
is killed when the object is closed or the test process dies (Linux: the
parent-death signal). ``restart`` reuses the port and the folder, so a server
with ``appendonly=True`` comes back with the data it had fsynced.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import TracebackType
from typing import Literal, Self

import redis

__all__ = ["RedisServer", "redis_server_available"]

_START_TIMEOUT_S = 20.0


def redis_server_available() -> bool:
    """Whether a ``redis-server`` binary is on the PATH."""
    return shutil.which("redis-server") is not None


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


# No redis-server outlives the test process: util-linux's setpriv sets PR_SET_PDEATHSIG and execs it.
# (A preexec_fn doing the same ran Python between fork and exec in a process with grpcio's threads:
# not safe there, and it once crashed a test worker with a segmentation fault.)
_DIE_WITH_PARENT = (
    ["setpriv", "--pdeathsig", "KILL", "--"] if sys.platform == "linux" and shutil.which("setpriv") else []
)


class RedisServer:
    """One ``redis-server`` process: ``with RedisServer() as server: use(server.url)``.

    ``appendonly`` turns on the AOF with ``appendfsync``; ``password`` sets
    ``requirepass``; ``save=False`` (the default) disables RDB snapshots;
    ``unixsocket=True`` also listens on ``unix_socket`` (a short path in the
    temporary folder). ``config_file`` starts from that file instead (only the
    port, address, folder and log are overridden; the persistence options are
    the file's). The server is started by the constructor and answers PING
    when it returns.
    """

    def __init__(
        self,
        *,
        appendonly: bool = False,
        appendfsync: Literal["always", "everysec", "no"] = "everysec",
        password: str | None = None,
        save: bool = False,
        unixsocket: bool = False,
        config_file: str | os.PathLike[str] | None = None,
        extra_args: tuple[str, ...] = (),
    ) -> None:
        self.appendonly = appendonly
        self.appendfsync = appendfsync
        self.password = password
        self.save = save
        self.config_file = os.fspath(config_file) if config_file is not None else None
        self.extra_args = extra_args
        self.dir = Path(tempfile.mkdtemp(prefix="ladle-redis-"))
        self.unix_socket: str | None = str(self.dir / "redis.sock") if unixsocket else None
        self.port = 0
        self._process: subprocess.Popen[bytes] | None = None
        try:
            self._start_on_a_free_port()
        except BaseException:
            self.close()
            raise

    # --- addresses ----------------------------------------------------------

    @property
    def host(self) -> str:
        return "127.0.0.1"

    def url_for(self, db: int = 0, *, password: str | None = None) -> str:
        """A ``redis://`` URL of this server's database ``db`` (with its password unless one is given)."""
        secret = self.password if password is None else password
        auth = f":{secret}@" if secret else ""
        return f"redis://{auth}{self.host}:{self.port}/{db}"

    @property
    def url(self) -> str:
        return self.url_for(0)

    def client(self, db: int = 0) -> redis.Redis:
        """A plain redis-py client on database ``db`` (strings decoded); the caller closes it."""
        return redis.Redis(
            host=self.host,
            port=self.port,
            db=db,
            password=self.password,
            decode_responses=True,
            socket_timeout=5,
            socket_connect_timeout=5,
        )

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process is not None else None

    @property
    def running(self) -> bool:
        return self._process is not None and self._process.poll() is None

    # --- lifetime -----------------------------------------------------------

    def _args(self) -> list[str]:
        args = ["redis-server"] + ([self.config_file] if self.config_file else [])
        args += [
            "--port",
            str(self.port),
            "--bind",
            self.host,
            "--dir",
            str(self.dir),
            "--logfile",
            str(self.dir / "redis.log"),
            "--daemonize",
            "no",
        ]
        if not self.config_file:
            args += [
                "--save",
                "3600 1" if self.save else "",
                "--appendonly",
                "yes" if self.appendonly else "no",
                "--appendfsync",
                self.appendfsync,
            ]
        if self.password:
            args += ["--requirepass", self.password]
        if self.unix_socket:
            args += ["--unixsocket", self.unix_socket, "--unixsocketperm", "700"]
        return [*args, *self.extra_args]

    def _start_on_a_free_port(self) -> None:
        # Another process may take the port between choosing and binding it: try a few.
        for attempt in range(5):
            self.port = _free_port()
            try:
                self._start()
                return
            except RuntimeError:
                if attempt == 4:
                    raise

    def _start(self) -> None:
        self._process = subprocess.Popen(
            [*_DIE_WITH_PARENT, *self._args()],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + _START_TIMEOUT_S
        with self.client() as probe:
            while True:
                if self._process.poll() is not None:
                    self._process = None
                    raise RuntimeError(f"redis-server exited at start-up on port {self.port}: {self.log()}")
                try:
                    if probe.ping():
                        return
                except (redis.ConnectionError, redis.TimeoutError, redis.ResponseError):
                    pass  # not listening yet, or still loading its AOF
                if time.monotonic() > deadline:
                    self.kill()
                    raise RuntimeError(f"redis-server on port {self.port} did not answer PING: {self.log()}")
                time.sleep(0.01)

    def log(self, lines: int = 20) -> str:
        """The last ``lines`` lines of the server's log file."""
        try:
            return "\n".join((self.dir / "redis.log").read_text().splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def kill(self) -> None:
        """SIGKILL the server (a crash: nothing is flushed beyond what was already fsynced)."""
        if self._process is not None:
            with contextlib.suppress(ProcessLookupError):
                self._process.kill()
            self._process.wait(timeout=30)
            self._process = None

    def stop(self) -> None:
        """SIGTERM the server and wait for it (a clean shutdown: the AOF is flushed)."""
        if self._process is not None:
            with contextlib.suppress(ProcessLookupError):
                self._process.terminate()
            try:
                self._process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait(timeout=30)
            self._process = None

    def restart(self, *, kill: bool = False) -> None:
        """Stop (or, with ``kill``, SIGKILL) the server and start it again on the same port and folder."""
        if kill:
            self.kill()
        else:
            self.stop()
        deadline = time.monotonic() + 10
        while True:  # the old socket may linger for a moment
            try:
                self._start()
                return
            except RuntimeError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)

    def start(self) -> None:
        """Start a stopped or killed server again (same port and folder)."""
        if not self.running:
            self._start()

    def close(self) -> None:
        """Kill the server and remove its folder; idempotent."""
        self.kill()
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "running" if self.running else "stopped"
        return f"RedisServer(port={self.port}, {state}, dir={str(self.dir)!r})"


if __name__ == "__main__":  # a quick manual check: python -m tests.support.redis_server
    with RedisServer(appendonly=True) as server:
        print(server, server.url, os.getpid())
