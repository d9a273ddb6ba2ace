"""The HTTP face's process side: uvicorn on its own thread and event loop.

The gRPC streams keep their event loop to themselves: a page render or a
schedule built for an inspection runs on this thread's loop or in FastAPI's
thread pool, never between two batches of a stream. The socket is bound
before uvicorn starts, so port 0 gives a known free port and a taken port
fails ``start`` with a ``ConfigError`` rather than a log line.

Limits: the app is read-only (GET only, no request body is ever read), the
request line and headers may take 16 KiB (h11's default, made explicit), at
most ``max_connections`` connections and requests are served at once (more
get 503), and a connection that sends nothing for ``idle_timeout_s`` is
closed, whether it just opened or its last response went out.
"""

from __future__ import annotations

import errno
import logging
import socket
import threading
import time
from collections.abc import Callable
from typing import Any, Final, cast

import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from ..errors import ConfigError
from ..security import TlsFiles

__all__ = ["HTTP_IDLE_TIMEOUT_S", "HTTP_MAX_CONNECTIONS", "HttpServer"]

log = logging.getLogger("ladle.http")

HTTP_MAX_CONNECTIONS: Final = 128  # people, a Prometheus scraper and `ladle inspect`: far fewer
HTTP_IDLE_TIMEOUT_S: Final = 5
HTTP_REQUEST_TIMEOUT_S: Final = 10
_MAX_HEADER_BYTES: Final = 16 << 10


# what uvicorn logs (a warning) for each request it answers 503 itself, over ``limit_concurrency``
_OVER_LIMIT: Final = "Exceeded concurrency limit."


class _CountRefusals:
    """uvicorn's logger for one connection, which also counts the requests uvicorn refuses over the cap.

    uvicorn answers those 503 without calling the app, so the app's own
    error count never sees them; the warning it logs for each is the one
    place to count them (tested against the installed uvicorn).
    """

    def __init__(self, logger: logging.Logger, on_refused: Callable[[], None]) -> None:
        self._logger = logger
        self._on_refused = on_refused

    def __getattr__(self, name: str) -> Any:
        return getattr(self._logger, name)

    def warning(self, msg: object, *args: Any, **kwargs: Any) -> None:
        if msg == _OVER_LIMIT:
            self._on_refused()
        self._logger.warning(msg, *args, **kwargs)


class _H11(H11Protocol):
    """uvicorn's h11 protocol, which also times out a connection that opens and says nothing or too little.

    uvicorn starts its keep-alive timer only after a response, so a client
    that connects and never sends a request would hold its connection (and
    one of the ``max_connections``) for ever; and any byte received stops
    that timer, so one that sends a header line every few seconds would too.
    So every request's line and headers must arrive within
    ``HTTP_REQUEST_TIMEOUT_S`` of the connection (or of the last response).
    """

    request_timeout_s: float = HTTP_REQUEST_TIMEOUT_S
    on_refused: Callable[[], None] | None = None  # a request refused over the connection cap (a 503)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if self.on_refused is not None:
            # every call uvicorn makes on its logger goes through (a duck, not a Logger subclass)
            self.logger = cast(logging.Logger, _CountRefusals(self.logger, self.on_refused))

    def connection_made(self, transport: Any) -> None:
        super().connection_made(transport)
        self.timeout_keep_alive_task = self.loop.call_later(
            self.timeout_keep_alive, self.timeout_keep_alive_handler
        )
        self._request_deadline = self.loop.call_later(self.request_timeout_s, self._request_late)

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._request_deadline.cancel()
        self._request_deadline = self.loop.call_later(self.request_timeout_s, self._request_late)

    def connection_lost(self, exc: Exception | None) -> None:
        self._request_deadline.cancel()
        super().connection_lost(exc)

    def _request_late(self) -> None:
        """Close the connection unless a request is being answered (its headers all came)."""
        answering = self.cycle is not None and not self.cycle.response_complete
        if not answering and not self.transport.is_closing():
            self.transport.close()


def _counting(on_refused: Callable[[], None]) -> type[_H11]:
    """The protocol class of one server: its connections call ``on_refused`` for each request over the cap."""
    return type("_H11", (_H11,), {"on_refused": staticmethod(on_refused)})


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
        hint = (
            "; give another with --http-port (0: any free port) or serve gRPC only with --no-http "
            "(each replica on one host needs its own HTTP port)"
            if exc.errno == errno.EADDRINUSE
            else ""
        )
        raise ConfigError(
            "http_port", f"cannot listen on {host}:{port}: {exc.strerror or exc}{hint}"
        ) from None
    sock.set_inheritable(True)
    return sock


class HttpServer:
    """``HttpServer(app, host, port).start()`` serves ``app`` until ``stop()``; ``port`` is the bound one."""

    def __init__(
        self,
        app: Any,
        host: str = "127.0.0.1",
        port: int = 8080,
        *,
        tls: TlsFiles | None = None,
        max_connections: int = HTTP_MAX_CONNECTIONS,
        idle_timeout_s: int = HTTP_IDLE_TIMEOUT_S,
        on_refused: Callable[[], None] | None = None,
    ) -> None:
        if not 0 <= port <= 65535:
            raise ConfigError("http_port", f"must be in 0..65535, got {port}")
        self.app = app
        self.max_connections = max_connections
        self.idle_timeout_s = idle_timeout_s
        self.on_refused = on_refused
        self.tls = tls
        self.host = host
        self.requested_port = port
        self.port = 0
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{'https' if self.tls is not None else 'http'}://{host}:{self.port}"

    def start(self, timeout: float = 30.0) -> HttpServer:
        sock = _bind(self.host, self.requested_port)
        self.port = int(sock.getsockname()[1])
        config = uvicorn.Config(
            self.app,
            log_level="warning",
            log_config=None,  # no handlers of uvicorn's own: its lines reach ladle's log in its format
            access_log=False,
            lifespan="off",
            loop="asyncio",
            http=_H11 if self.on_refused is None else _counting(self.on_refused),
            ws="none",
            timeout_graceful_shutdown=2,
            limit_concurrency=self.max_connections,
            timeout_keep_alive=self.idle_timeout_s,
            h11_max_incomplete_event_size=_MAX_HEADER_BYTES,
            **(self.tls.uvicorn_options() if self.tls is not None else {}),
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
