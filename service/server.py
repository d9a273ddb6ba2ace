"""The batch server process: dataset, store, jobs, the gRPC and HTTP faces, with a clean shutdown.

``BatchServer`` is a context manager: entering opens the dataset and the
store and starts serving (the HTTP face too when ``http_port`` is given, on
its own thread); leaving stops the HTTP face, stops accepting calls, asks open
streams to end (UNAVAILABLE, so clients reconnect and resume), waits up to
the grace period and closes the store. ``serve_forever`` adds SIGTERM/SIGINT/SIGHUP/SIGQUIT
handling for ``ladle serve``: the first signal shuts down gracefully, a second one
cuts the grace short.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import errno
import functools
import logging
import math
import os
import signal
import socket
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import FrameType, TracebackType
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

import ladle
from ladle.proto import rpc

from .assemble import Assembler
from .dataset import open_dataset
from .errors import ConfigError, StoreCredentialsError, StoreUnavailableError
from .first_request import FirstRequestInterceptor
from .grpc_server import ACK_FLUSH_SECONDS, BatchServicer
from .jobs import JobRegistry
from .limits import RANK_SERIES, Limits
from .metrics import ServerMetrics, TimedStore
from .readiness import STORE_ANSWER_S, Readiness
from .schedule import ScheduleConfig
from .security import CallGate, TlsFiles, TokenCheck, check_exposure
from .standing import read_standing
from .store import DEFAULT_JOB_TTL_S, CursorStore, open_store

__all__ = ["DEFAULT_STATE", "BatchServer", "serve_forever"]

log = logging.getLogger("ladle.server")

#: How long the main thread sleeps at most between looks at signals: one the kernel hands to
#: another thread (gRPC's, the loop's) only marks Python's handler as due for the main thread.
_SIGNAL_POLL_S = 0.2

DEFAULT_STATE = ".ladle/state.db"
# How often the gRPC health service's status for ladle.v1.BatchService follows the readiness check
# (a store ping and a stat of the data files): a readiness probe sees a change within this plus
# its own period.
READY_CHECK_S = 2.0


class BatchServer:
    """One batch server: ``with BatchServer(...) as server: server.wait()``."""

    def __init__(
        self,
        dataset: str | Path,
        config: ScheduleConfig,
        *,
        host: str = "127.0.0.1",
        grpc_port: int = 50051,
        state: str | Path = DEFAULT_STATE,
        redis_url: str | None = None,
        job_ttl_s: float = DEFAULT_JOB_TTL_S,
        store_wait_s: float = 0.0,
        limits: Limits | None = None,
        ack_flush_s: float = ACK_FLUSH_SECONDS,
        grace: float = 5.0,
        http_port: int | None = None,
        tokens: Sequence[str] = (),
        tls: TlsFiles | None = None,
        insecure: bool = False,
        columns: Mapping[str, str] | Sequence[str] | None = None,
        metrics_ranks: int = RANK_SERIES,
    ) -> None:
        if not 0 <= grpc_port <= 65535:
            raise ConfigError("grpc_port", f"must be in 0..65535, got {grpc_port}")
        if http_port is not None and not 0 <= http_port <= 65535:
            raise ConfigError("http_port", f"must be in 0..65535, got {http_port}")
        # inf would overflow the shutdown's timeout and nan never compares: refuse both up front
        if not (math.isfinite(grace) and grace >= 0):
            raise ConfigError("grace", f"must be a finite number of seconds >= 0, got {grace}")
        self.dataset_path = str(dataset)
        # the columns served (open_dataset's: roles to names; None: input_ids, and the mask it finds)
        self.columns = columns
        self.config = config
        # "[::1]" as URLs write it is the address ::1; "host:port" strings bracket it again (_join)
        self.host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
        self.requested_port = grpc_port
        self.state_path = Path(state)
        # The cursor store: Redis when a URL is given (shared by every replica), else the file.
        self.redis_url = redis_url
        self.job_ttl_s = job_ttl_s
        if not (math.isfinite(store_wait_s) and store_wait_s >= 0):
            raise ConfigError("store_wait", f"must be a finite number of seconds >= 0, got {store_wait_s}")
        # how long start() waits for a cursor store that cannot be reached (Redis starting beside it)
        self.store_wait_s = store_wait_s
        # sessions, prefetch, message sizes, connections, keepalive and idle reaping
        self.limits = limits if limits is not None else Limits()
        self.ack_flush_s = ack_flush_s
        self.grace = grace
        # who may connect: the accepted tokens (none: anyone who reaches the port) and TLS
        self.token = TokenCheck(tokens) if tokens else None
        self.tls = tls
        self.insecure = insecure
        self.port = 0
        self.requested_http_port = http_port
        self.http_port = 0
        if metrics_ranks < 0:
            raise ConfigError("metrics_ranks", f"must be >= 0 (0: per-job series only), got {metrics_ranks}")
        self.metrics_ranks = metrics_ranks
        self.metrics = ServerMetrics()
        self._http: Any = None
        self._server: Any = None
        self._store: CursorStore | None = None
        self._servicer: BatchServicer | None = None
        self._health: Any = None
        self._readiness: Readiness | None = None
        self._watcher: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_thread: threading.Thread | None = None
        self._stopped = threading.Event()
        self._hurry = False  # stop_now() was called: end open calls without waiting the grace
        self._grpc_stopping = False  # the gRPC server's stop has begun (on the loop)

    def _open_store(self) -> CursorStore:
        """The cursor store; one that cannot be reached is waited for up to ``store_wait_s``.

        Refused credentials, a replica, a bad URL or a folder that cannot be
        made are not waited for: they will not change by themselves.
        """
        deadline = time.monotonic() + self.store_wait_s
        delay = 0.5
        while True:
            try:
                return open_store(
                    redis_url=self.redis_url, state_path=self.state_path, job_ttl_s=self.job_ttl_s
                )
            except StoreCredentialsError:
                raise
            except StoreUnavailableError as exc:
                left = deadline - time.monotonic()
                if left < delay:
                    raise
                log.warning("%s; waiting for it (up to %.0f s more, --store-wait)", exc, left)
                time.sleep(delay)
                delay = min(delay * 2, 5.0)

    @property
    def address(self) -> str:
        return _join(self.host, self.port)

    @property
    def http_url(self) -> str | None:
        """``http://host:port`` of the HTTP face, None when it is off."""
        return self._http.url if self._http is not None else None

    def start(self) -> BatchServer:
        check_exposure(
            self.host, token=self.token is not None, tls=self.tls is not None, insecure=self.insecure
        )
        dataset = open_dataset(self.dataset_path, self.columns)
        try:
            store = self._open_store()
        except OSError as exc:  # the state file's folder cannot be made: /proc/nope, read-only, a file
            raise StoreUnavailableError(
                f"cursor store {self.state_path}: cannot create its folder {self.state_path.parent}: "
                f"{exc.strerror or exc}"
            ) from None
        self._store = TimedStore(store, self.metrics)
        self._readiness = Readiness(dataset, self._store)
        registry = JobRegistry(dataset, self.config, self._store, spare=self.limits.spare_schedules)
        self.metrics.watch_ranks(functools.partial(read_standing, registry), self.metrics_ranks)
        # Check the config against the dataset now (a bad config fails at start-up, not on the first
        # trainer), resolving the bucket edges every schedule uses: no schedule is built before a
        # trainer asks for one, which at 10^8 rows takes seconds for each world size.
        from .schedule import cut_samples

        registry.edges()
        cut = cut_samples(dataset.lengths, self.config)
        if cut:
            log.warning("dataset %s: %s", self.dataset_path, cut.sentence())
        self._servicer = BatchServicer(
            registry,
            Assembler(dataset),
            limits=self.limits,
            ack_flush_s=self.ack_flush_s,
            metrics=self.metrics,
        )
        # The asyncio server runs on its own event loop thread.
        self._loop = asyncio.new_event_loop()
        self._loop_thread = threading.Thread(
            target=self._loop.run_forever, name="ladle-grpc-loop", daemon=True
        )
        self._loop_thread.start()
        try:
            asyncio.run_coroutine_threadsafe(self._start(), self._loop).result()
        except BaseException:
            self.stop(grace=0)  # the loop thread and the store must not outlive a failed start
            raise
        if self.requested_http_port is not None:
            from .http import HttpServer, Inspector, create_app
            from .security import is_loopback

            local = is_loopback(self.host) and self.token is None
            inspector = Inspector(registry, self._readiness)
            app = create_app(inspector, self.metrics, token=self.token, local_hosts_only=local)
            try:
                self._http = HttpServer(
                    app,
                    self.host,
                    self.requested_http_port,
                    tls=self.tls,
                    on_refused=lambda: self.metrics.error("http", "503"),  # uvicorn's, over the cap
                ).start()
            except BaseException:
                self.stop(grace=0)
                raise
            self.http_port = self._http.port
            log.info("HTTP on %s", self._http.url)
        self._watcher = threading.Thread(target=self._watch_readiness, name="ladle-readiness", daemon=True)
        self._watcher.start()
        # The store's repr names its file or its Redis URL with the password redacted.
        log.info(
            "serving %s on %s (ladle %s, dataset %s: %s; config %s, store %r)",
            self.dataset_path,
            self.address,
            ladle.__version__,
            dataset.fingerprint,
            dataset.columns.describe(),
            self.config.fingerprint(),
            self._store,
        )
        return self

    async def _start(self) -> None:
        assert self._servicer is not None
        # grpcio sets SO_REUSEPORT on its sockets by default, so a second server on a
        # taken port would bind it silently and the kernel would spread trainers over
        # both; without it the second server fails to start instead.
        options = [*self.limits.grpc_options(self._servicer.max_frame_bytes), ("grpc.so_reuseport", 0)]
        # The gate first: the token, then a budget of calls in progress for each kind of call (health
        # Watch, other health calls, the rest: --max-sessions + 64), counted from the moment a call
        # opens. No maximum_concurrent_rpcs: gRPC's own limit counts every call alike, and health
        # Watch calls, which need no token and stay open, filled it and shut every trainer and probe out.
        gate = CallGate(
            self.token, max_calls=self.limits.max_concurrent_rpcs, on_refused=self.metrics.call_refused
        )
        # unary-request calls read their request within the handshake timeout, and parse it here
        interceptors: list[Any] = [gate, FirstRequestInterceptor(self.limits.handshake_timeout_s)]
        self._server = grpc.aio.server(
            options=options, maximum_concurrent_rpcs=None, interceptors=interceptors
        )
        self._server.add_generic_rpc_handlers((self._servicer.handler(),))
        self._health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self._health, self._server)
        where = _join(self.host, self.requested_port)
        _check_port_free(self.host, self.requested_port)
        try:
            if self.tls is not None:
                self.port = self._server.add_secure_port(where, self.tls.grpc_credentials())
            else:
                self.port = self._server.add_insecure_port(where)
        except RuntimeError:  # grpcio >= 1.5x: "Failed to bind to address ..."
            self.port = 0
        if self.port == 0:
            raise ConfigError("grpc_port", f"cannot listen on {where}")
        await self._server.start()
        await self._health.set("", health_pb2.HealthCheckResponse.SERVING)
        await self._health.set(rpc.SERVICE, health_pb2.HealthCheckResponse.SERVING)

    def _watch_readiness(self) -> None:
        """Keep the health status of ``ladle.v1.BatchService`` on the readiness check, as ``/readyz`` answers.

        ``NOT_SERVING`` while the dataset changed on disk or the cursor store
        does not answer (or refuses writes), ``SERVING`` again once both are
        back. The overall status (service ``""``) stays ``SERVING`` until the
        shutdown: the process answers, so a liveness probe must not restart it
        and cut the streams of its trainers. Kubernetes probes readiness here
        (``grpc: {port: 50051, service: ladle.v1.BatchService}``) rather than
        over HTTP, whose 128 connections anyone who reaches the port can hold.
        Its own thread: the event loop's executor can be full of store calls
        waiting on a store that hangs, the very moment this must answer.
        """
        readiness, loop, answer = self._readiness, self._loop, health_pb2.HealthCheckResponse
        assert readiness is not None
        assert loop is not None
        serving = True
        while not self._stopped.wait(READY_CHECK_S):
            why = readiness.problem()  # waits at most STORE_ANSWER_S for the store
            if (why is None) == serving:
                continue
            serving = why is None
            self.metrics.ready.set(serving)
            if serving:
                log.warning("ready again: the dataset is as it was and the cursor store answers")
            else:
                log.warning("not ready (gRPC health %s NOT_SERVING, /readyz 503): %s", rpc.SERVICE, why)
            with contextlib.suppress(RuntimeError):  # the loop closed meanwhile: the server stopped
                asyncio.run_coroutine_threadsafe(
                    self._health.set(rpc.SERVICE, answer.SERVING if serving else answer.NOT_SERVING), loop
                )

    async def _stop(self, grace: float) -> None:
        until = asyncio.get_running_loop().time() + grace  # the late cursor writes' last tries end then too
        if self._health is not None:
            await self._health.enter_graceful_shutdown()
        if self._servicer is not None:
            self._servicer.stop_streams()
        if self._server is not None:
            self._grpc_stopping = True
            await self._server.stop(0 if self._hurry else grace)
        if self._servicer is not None:
            await self._servicer.end_late_writes(until, lambda: self._hurry)

    async def _stop_now(self) -> None:
        # grpc.aio honours a second stop(): stop(0) cancels the calls a running stop(grace) waits for
        if self._server is not None and self._grpc_stopping:
            await self._server.stop(0)

    def stop_now(self) -> None:
        """Cut the grace period short: end every open call now (from any thread, a signal handler too).

        Before ``stop`` it makes that stop use a grace of 0; during it, it cancels
        the calls the stop is waiting for, so ``stop`` returns at once.
        """
        self._hurry = True
        loop = self._loop
        if loop is None or loop.is_closed() or not loop.is_running():
            return
        with contextlib.suppress(RuntimeError):  # the loop closed meanwhile: nothing left to cut short
            asyncio.run_coroutine_threadsafe(self._stop_now(), loop)

    def stop(self, grace: float | None = None) -> None:
        """Stop accepting calls, end open streams with UNAVAILABLE within ``grace`` seconds."""
        if self._stopped.is_set():
            return
        self._stopped.set()
        if self._watcher is not None:  # it may be waiting on the store: at most STORE_ANSWER_S
            self._watcher.join(timeout=STORE_ANSWER_S + 1)
        if self._http is not None:
            self._http.stop()
        if self._loop is not None:
            grace = self.grace if grace is None else grace
            stopping = asyncio.run_coroutine_threadsafe(self._stop(grace), self._loop)
            _wait_in_slices(stopping, grace + 10)  # a second signal cuts the grace short meanwhile
            self._loop.call_soon_threadsafe(self._loop.stop)
            if self._loop_thread is not None:
                self._loop_thread.join(timeout=10)
            self._loop.close()
        if self._servicer is not None:
            self._servicer.close()
        if self._store is not None:
            self._store.close()

    def wait(self) -> None:
        self._stopped.wait()

    def __enter__(self) -> BatchServer:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()


def _wait_in_slices(future: concurrent.futures.Future[Any], timeout: float) -> None:
    """``future.result(timeout)``, waking every ``_SIGNAL_POLL_S`` for a signal another thread took."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            future.result(max(0.0, min(_SIGNAL_POLL_S, deadline - time.monotonic())))
            return
        except concurrent.futures.TimeoutError:
            if time.monotonic() >= deadline:
                raise


def _join(host: str, port: int) -> str:
    """``host:port``, an IPv6 address in brackets (``[::1]:50051``), as gRPC targets and URLs write it."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _check_port_free(host: str, port: int) -> None:
    """Raise the ``ConfigError`` a taken or forbidden gRPC port gets, before grpcio tries it.

    grpcio only says "Failed to bind" (and logs the reason to stderr), so the
    reason is found the way the HTTP face finds it: by binding the address
    (port 0 too: a host name that does not resolve, or an address this
    machine lacks, is the host's fault, not the port's). Other failures are
    left to grpcio.
    """
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise ConfigError("host", f"cannot resolve {host!r}: {exc}") from None
    family, kind, proto, _, address = infos[0]
    with socket.socket(family, kind, proto) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as grpcio does
        try:
            sock.bind(address)
            sock.listen(1)
        except OSError as exc:
            reason = (exc.strerror or str(exc)).lower()  # "address already in use"
            if exc.errno == errno.EADDRNOTAVAIL:
                why = f"{host} is not an address of this machine ({reason}); give one it has, or 0.0.0.0"
                raise ConfigError("host", why) from None
            if exc.errno in (errno.EADDRINUSE, errno.EACCES):
                hint = (
                    "; give another with --grpc-port (0: any free port)"
                    if exc.errno == errno.EADDRINUSE
                    else ""
                )
                raise ConfigError(
                    "grpc_port", f"cannot listen on {_join(host, port)}: {reason}{hint}"
                ) from None


#: The signals that stop ``ladle serve``: the first gracefully, a second at once (no SIGHUP or
#: SIGQUIT on Windows). SIGQUIT (Ctrl-\) killed the server with no log and left its ready files.
STOP_SIGNALS = tuple(
    getattr(signal, name) for name in ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT") if hasattr(signal, name)
)


def serve_forever(
    server: BatchServer, *, ready_file: str | None = None, http_ready_file: str | None = None
) -> int:
    """Run until SIGTERM, SIGINT, SIGHUP or SIGQUIT, then shut down gracefully; returns the exit code (0).

    The first signal stops accepting calls and gives open streams the grace
    period; a second one during it ends them at once. SIGHUP and SIGQUIT are
    left ignored when they already were (``nohup ladle serve``, a job started
    with ``&`` by a script); a stop signal the parent blocked (a supervisor's or
    CI runner's mask, inherited through exec) is unblocked while it serves.

    Once both faces serve, ``http_ready_file`` gets the HTTP face's ``host:port``
    and then ``ready_file`` the gRPC face's, so a script that waits for
    ``ready_file`` finds both. Both are removed when the server shuts down
    (each only if it still holds what this server wrote), so a restart script
    never reads a port from a server that is gone.
    """
    done = threading.Event()

    def _on_signal(signum: int, frame: FrameType | None) -> None:
        if not done.is_set():
            log.info("signal %d: shutting down (grace %.1fs)", signum, server.grace)
            done.set()
        else:
            log.warning("signal %d: second signal: stopping now", signum)
            server.stop_now()

    previous: dict[int, Any] = {}
    for s in STOP_SIGNALS:
        if s not in (signal.SIGTERM, signal.SIGINT) and signal.getsignal(s) == signal.SIG_IGN:
            continue  # SIGHUP under nohup: the user asked for the server to outlive its terminal
        previous[s] = signal.signal(s, _on_signal)
    # A parent that blocked them (a CI runner, a supervisor) passed the mask on through exec:
    # a blocked signal would wait forever instead of stopping this server.
    unblocked = set(previous) & _blocked_signals()
    if unblocked:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, unblocked)
    written: list[tuple[str, str]] = []
    try:
        with server:
            if done.is_set():  # a stop signal came while it started: no announcement, no ready file
                log.info("stopping: the stop signal came during start-up")
            else:
                _announce(server, written, ready_file, http_ready_file)
                # In slices: a signal the kernel hands to another thread (gRPC's, the loop's) only
                # marks Python's handler as due, and a main thread asleep in one long wait would
                # never run it (SIGQUIT was lost so, a test's server never stopped).
                while not done.wait(_SIGNAL_POLL_S):
                    pass
            # Shutting down: the ports go now. Removed while this server still holds them,
            # a file cannot yet be a successor's on the same port.
            _remove_ready_files(written)
    finally:
        _remove_ready_files(written)
        if unblocked:
            signal.pthread_sigmask(signal.SIG_BLOCK, unblocked)
        for s, handler in previous.items():
            signal.signal(s, handler)
    log.info("stopped")  # a clean end, told apart from a kill in the log
    return 0


def _announce(
    server: BatchServer, written: list[tuple[str, str]], ready_file: str | None, http_ready_file: str | None
) -> None:
    """Print where the server serves and write the ready files (recorded in ``written``), HTTP's first."""
    print(f"ladle: serving on {server.address}", flush=True)
    if server.http_url is not None:
        print(f"ladle: inspect at {server.http_url}/", flush=True)
        if http_ready_file:
            written.append((http_ready_file, _join(server.host, server.http_port)))
            _write_atomically(*written[-1])
    if ready_file:
        written.append((ready_file, server.address))
        _write_atomically(*written[-1])


def _blocked_signals() -> set[int]:
    """The signals this thread blocks (none where the platform has no signal masks)."""
    if not hasattr(signal, "pthread_sigmask"):
        return set()
    return {int(s) for s in signal.pthread_sigmask(signal.SIG_BLOCK, [])}


def _write_atomically(path: str, text: str) -> None:
    """Write ``text`` so that a reader that sees the file sees all of it."""
    tmp = Path(f"{path}.tmp-{os.getpid()}")
    tmp.write_text(text)
    tmp.replace(path)


def _remove_ready_files(written: list[tuple[str, str]]) -> None:
    """Remove each ready file that still holds what this server wrote (another may have replaced it)."""
    while written:
        path, text = written.pop()
        try:
            if Path(path).read_text() == text:
                os.unlink(path)
        except OSError:  # gone already, or unreadable: not ours to remove
            pass
