"""The HTTP face's process side: uvicorn on its own thread and event loop.

The gRPC streams keep their event loop to themselves: a page render or a
schedule built for an inspection runs on this thread's loop or in FastAPI's
thread pool, never between two batches of a stream. The socket is bound
before uvicorn starts, so port 0 gives a known free port and a taken port
fails ``start`` with a ``ConfigError`` rather than a log line.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from typing import Any

import uvicorn

from ..errors import ConfigError

__all__ = ["HttpServer"]

log = logging.getLogger("ladle.http")


def _bind(host: str, port: int) -> socket.socket:
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise ConfigError("host", f"cannot resolve {host!r}: {exc}") from None
    family, kind, proto, _, address = infos[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(128)
    except OSError as exc:
        sock.close()
        raise ConfigError("http_port", f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    sock.set_inheritable(True)
    return sock


class HttpServer:
    """``HttpServer(app, host, port).start()`` serves ``app`` until ``stop()``; ``port`` is the bound one."""

    def __init__(self, app: Any, host: str = "127.0.0.1", port: int = 8080) -> None:
        if not 0 <= port <= 65535:
            raise ConfigError("http_port", f"must be in 0..65535, got {port}")
        self.app = app
        self.host = host
        self.requested_port = port
        self.port = 0
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def start(self, timeout: float = 30.0) -> HttpServer:
        sock = _bind(self.host, self.requested_port)
        self.port = int(sock.getsockname()[1])
        config = uvicorn.Config(
            self.app,
            log_level="warning",
            access_log=False,
            lifespan="off",
            loop="asyncio",
            http="h11",
            ws="none",
            timeout_graceful_shutdown=2,
        )
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(
            target=self._server.run, kwargs={"sockets": [sock]}, name="ladle-http", daemon=True
        )
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                self.stop()
                raise ConfigError("http_port", f"the HTTP server did not start on {self.url}")
            time.sleep(0.01)
        return self  # uvicorn closes the socket when it stops

    def stop(self, timeout: float = 10.0) -> None:
        """Stop accepting requests, let running ones finish (2 s at most), join the thread."""
        if self._server is not None:
            self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                log.warning("the HTTP server thread did not stop within %.0fs", timeout)
        self._thread = None
