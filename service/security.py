"""Who may talk to a batch server: the shared token, TLS, and the exposure check.

* **Tokens.** ``load_tokens`` reads ``--token-file`` (one token a line, so a
  new token can be added before the old one is removed) or ``LADLE_TOKEN``.
  ``TokenCheck`` compares a presented ``authorization`` header in constant
  time against every accepted token. ``CallGate`` applies it to every gRPC
  call except the standard health service, answering UNAUTHENTICATED; the
  HTTP app applies it through a FastAPI dependency. A token is never logged,
  put in an error, a metric or the page: only "missing" or "wrong".
* **Call budgets.** ``CallGate`` also counts the gRPC calls in progress in
  three budgets: health ``Watch`` calls (``MAX_WATCHES``), other health calls
  (``MAX_HEALTH_CALLS``), and every other call (the trainers' streams and
  Describes: ``--max-sessions`` + 64). A call over its budget ends at once
  with RESOURCE_EXHAUSTED (counted, logged at most once a minute), so callers
  without a token, who may only use the health service, cannot take the
  trainers' slots.
* **TLS.** ``TlsFiles`` names the certificate, key and optional client CA
  (mutual TLS); ``grpc_credentials`` and ``uvicorn_options`` turn them into
  what each face needs.
* **Exposure.** ``check_exposure`` refuses to listen on a non-loopback
  address without a token unless ``--insecure`` is given, and warns when it is.
"""

from __future__ import annotations

import base64
import hmac
import inspect
import ipaddress
import logging
import os
import ssl
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import grpc

from ladle.proto import rpc

from .errors import ConfigError, LadleError

__all__ = [
    "MAX_HEALTH_CALLS",
    "MAX_WATCHES",
    "MIN_TOKEN_LENGTH",
    "REFUSAL_LOG_S",
    "TOKEN_ENV",
    "TOKEN_FILE_ENV",
    "AuthenticationError",
    "CallBudget",
    "CallGate",
    "RefusalLog",
    "TlsFiles",
    "TokenCheck",
    "check_exposure",
    "is_loopback",
    "load_tokens",
]

log = logging.getLogger("ladle.security")

TOKEN_ENV: Final = "LADLE_TOKEN"
TOKEN_FILE_ENV: Final = "LADLE_TOKEN_FILE"
MIN_TOKEN_LENGTH: Final = 16
_HEALTH_PREFIX: Final = "/grpc.health.v1.Health/"
_WATCH: Final = _HEALTH_PREFIX + "Watch"
MAX_WATCHES: Final = 16
"""Health ``Watch`` calls open at once. A Watch needs no token and lasts as long as its caller keeps it;
Kubernetes probes and ``ladle health`` use ``Check``, so only a gRPC client's own health checking
(one Watch a channel) needs one."""
MAX_HEALTH_CALLS: Final = 64
"""Other health calls (``Check``) in progress at once: each answers as soon as its request comes,
and one that sends none ends after ``--handshake-timeout``."""
REFUSAL_LOG_S: Final = 60.0
"""One log line per kind of refusal at most this often; the metrics count every one."""
_MAKE_ONE = "make one with: python -c 'import secrets; print(secrets.token_urlsafe(32))'"


class AuthenticationError(LadleError):
    """A request without the server's token, or with another one (the token itself is never named)."""

    kind = "unauthenticated"


def _valid(token: str, where: str) -> str:
    if len(token) < MIN_TOKEN_LENGTH:
        raise ConfigError(
            "token",
            f"{where}: a token has at least {MIN_TOKEN_LENGTH} characters, got {len(token)}; {_MAKE_ONE}",
        )
    if not all(33 <= ord(c) <= 126 for c in token):
        # visible ASCII only: it travels in an HTTP/2 header
        raise ConfigError("token", f"{where}: a token is visible ASCII without spaces; {_MAKE_ONE}")
    if token.lower().startswith("change-me"):
        # deploy/k8s/secret.example.yaml's placeholder: published, so anyone could read the batches
        raise ConfigError("token", f"{where}: the token is the example Secret's placeholder; {_MAKE_ONE}")
    return token


def load_tokens(token_file: str | os.PathLike[str] | None = None, env: str | None = None) -> tuple[str, ...]:
    """The accepted tokens: every non-empty line of ``token_file`` (default
    ``$LADLE_TOKEN_FILE``, as a container secret is mounted), else ``env``
    (default ``$LADLE_TOKEN``).

    Returns ``()`` when none is given (no authentication). A file that
    cannot be read, holds no token, or a token too short or with spaces is a
    ``ConfigError`` that names the file, never the token.
    """
    if token_file is None:
        token_file = os.environ.get(TOKEN_FILE_ENV) or None
    if token_file is not None:
        path = Path(token_file)
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError(
                "token_file", f"cannot read {path}: {getattr(exc, 'strerror', None) or exc}"
            ) from None
        tokens = tuple(_valid(line.strip(), str(path)) for line in text.splitlines() if line.strip())
        if not tokens:
            raise ConfigError("token_file", f"{path} holds no token; {_MAKE_ONE}")
        return tokens
    value = os.environ.get(TOKEN_ENV, "") if env is None else env
    return (_valid(value.strip(), TOKEN_ENV),) if value.strip() else ()


class TokenCheck:
    """Is an ``authorization`` header one of the accepted tokens? Constant time in the header's content.

    ``Bearer <token>`` is what trainers and scripts send; ``Basic`` with the
    token as the password (any user name) lets a browser open the page.
    """

    def __init__(self, tokens: Sequence[str]) -> None:
        if not tokens:
            raise ValueError("TokenCheck needs at least one token")
        self._tokens = [t.encode() for t in tokens]

    def __repr__(self) -> str:
        return f"TokenCheck({len(self._tokens)} token(s))"

    def _matches(self, presented: bytes) -> bool:
        ok = False
        for token in self._tokens:  # every token compared: the time does not tell which one matched
            ok |= hmac.compare_digest(token, presented)
        return ok

    def allows(self, header: str | bytes | None) -> bool:
        if not header:
            return False
        value = header.decode("latin-1") if isinstance(header, bytes) else header
        scheme, _, credentials = value.strip().partition(" ")
        credentials = credentials.strip()
        if scheme.lower() == "bearer":
            return self._matches(credentials.encode("latin-1", "replace"))
        if scheme.lower() == "basic":
            try:
                decoded = base64.b64decode(credentials, validate=True).decode("latin-1")
            except ValueError:
                return False
            return self._matches(decoded.partition(":")[2].encode("latin-1"))
        return False

    def check(self, header: str | bytes | None) -> None:
        """Raise ``AuthenticationError`` unless ``header`` carries an accepted token."""
        if not self.allows(header):
            raise AuthenticationError(
                "missing token: send 'authorization: Bearer <token>' (BatchClient(token=...), ladle inspect "
                "--token-file, or LADLE_TOKEN)"
                if not header
                else "wrong token: the server does not accept the token sent"
            )


def _header(metadata: Iterable[tuple[str, str | bytes]] | None) -> str | bytes | None:
    for key, value in metadata or ():
        if key == "authorization":
            return value
    return None


class RefusalLog:
    """Logs the first refusal of each kind, then at most one line per ``every`` seconds for that kind,
    saying how many were refused since the last line: a flood of refused calls is not a flood of lines."""

    def __init__(self, every: float = REFUSAL_LOG_S, clock: Callable[[], float] = time.monotonic) -> None:
        self.every = every
        self._clock = clock
        self._kinds: dict[str, tuple[float, int]] = {}  # kind -> (when its last line was logged, held since)

    def __call__(self, kind: str, level: int, message: str) -> bool:
        """Log ``message`` unless a line of ``kind`` went out less than ``every`` s ago; True if logged."""
        now = self._clock()
        last = self._kinds.get(kind)
        if last is not None and now - last[0] < self.every:
            self._kinds[kind] = (last[0], last[1] + 1)
            return False
        more = ""
        if last is not None and last[1]:
            more = f" ({last[1]} more like it since the last such line, {now - last[0]:.0f} s ago)"
        log.log(level, "%s%s", message, more)
        self._kinds[kind] = (now, 0)
        return True


class CallBudget:
    """At most ``limit`` calls of one kind in progress (counted on the server's event loop)."""

    __slots__ = ("held", "limit", "reason", "what")

    def __init__(self, what: str, limit: int, reason: str) -> None:
        if limit < 1:
            raise ValueError(f"a call budget is at least 1, got {limit}")
        self.what = what  # "health Watch calls", as the refusal names them
        self.limit = limit
        self.reason = reason  # the ladle.v1.Error reason and the metric's label
        self.held = 0

    def __repr__(self) -> str:
        return f"CallBudget({self.what}: {self.held}/{self.limit})"

    def take(self) -> bool:
        if self.held >= self.limit:
            return False
        self.held += 1
        return True

    def give(self) -> None:
        self.held -= 1


class CallGate(grpc.aio.ServerInterceptor):  # type: ignore[misc]
    """Who may make a gRPC call, and how many calls of each kind may be in progress at once.

    With a ``check``, every call but the health service's needs an accepted
    token, else it ends at once with UNAUTHENTICATED (before its request is
    read, holding nothing). Every call that passes is counted in one of three
    budgets until it ends: health ``Watch`` calls (``max_watches``), other
    health calls (``max_health_calls``), and every other call (``max_calls``:
    trainers' streams and Describes). A call over its budget ends at once with
    RESOURCE_EXHAUSTED and a ``ladle.v1.Error`` whose reason is the budget's
    (``too_many_watches``, ``too_many_health_calls``, ``too_many_calls``).
    ``on_refused(code, reason)`` counts each refusal (reason ``unauthenticated``
    for a token refused); ``RefusalLog`` logs them.

    Install it first (outermost), with ``grpc.aio.server(maximum_concurrent_rpcs=None)``:
    gRPC's own limit counts every call alike, so callers without a token
    could fill it with health calls and shut the trainers out. The interceptor
    after it (``FirstRequestInterceptor``) makes every handler read its own
    request, so a call is counted from the moment it opens, its wait for the
    request included.
    """

    def __init__(
        self,
        check: TokenCheck | None,
        *,
        max_calls: int,
        max_watches: int = MAX_WATCHES,
        max_health_calls: int = MAX_HEALTH_CALLS,
        on_refused: Callable[[str, str], None] | None = None,
        refusal_log: RefusalLog | None = None,
    ) -> None:
        self._check = check
        self.calls = CallBudget("calls", max_calls, "too_many_calls")
        self.watches = CallBudget("health Watch calls", max_watches, "too_many_watches")
        self.health = CallBudget("health calls", max_health_calls, "too_many_health_calls")
        self._on_refused = on_refused
        self._log = refusal_log if refusal_log is not None else RefusalLog()

    async def intercept_service(
        self,
        continuation: Callable[[Any], Awaitable[Any]],
        details: Any,
    ) -> Any:
        handler = await continuation(details)
        if handler is None:  # no such method: gRPC answers UNIMPLEMENTED at once
            return None
        method = details.method
        if method.startswith(_HEALTH_PREFIX):
            budget = self.watches if method == _WATCH else self.health
        else:
            if self._check is not None:
                try:
                    self._check.check(_header(details.invocation_metadata))
                except AuthenticationError as exc:
                    self._refused("UNAUTHENTICATED", "unauthenticated")
                    why = "missing" if str(exc).startswith("missing") else "wrong"
                    self._log(f"token:{method}:{why}", logging.INFO, f"refused {method}: {exc}")
                    return _refusal(handler, exc)
            budget = self.calls
        return _counted(handler, budget, method, self._over)

    def _refused(self, code: str, reason: str) -> None:
        if self._on_refused is not None:
            self._on_refused(code, reason)

    async def _over(self, budget: CallBudget, method: str, context: Any) -> None:
        """End a call over ``budget`` with RESOURCE_EXHAUSTED (never returns)."""
        self._refused("RESOURCE_EXHAUSTED", budget.reason)
        held = f"{budget.held} {budget.what} in progress"
        if budget is self.calls:
            limit = "(ladle serve --max-sessions + 64)"
            message = f"this batch server has {held}, its limit {limit}: retry with backoff"
            why = "BatchClient retries with backoff"
        else:
            limit = "for calls without a token"
            message = f"this batch server has {held}, its limit {limit}: retry later"
            if budget is self.watches:
                message += " (or use Check, as probes do)"
            why = "the trainers' calls have a budget of their own"
        self._log(
            budget.reason,
            logging.WARNING,
            f"refused {method} from {_peer(context)}: {held}, the limit {limit}; {why} "
            f"(RESOURCE_EXHAUSTED, reason {budget.reason}; one such line a minute at most)",
        )
        await rpc.abort(context, grpc.StatusCode.RESOURCE_EXHAUSTED, budget.reason, message)


def _peer(context: Any) -> str:
    try:
        return str(context.peer())
    except Exception:  # a test's context, a call already gone
        return "?"


def _counted(
    handler: Any,
    budget: CallBudget,
    method: str,
    over: Callable[[CallBudget, str, Any], Awaitable[None]],
) -> Any:
    """``handler`` as one that takes a slot of ``budget`` as it starts (else ``over`` ends the call)
    and gives it back when it ends, however it ends.

    The slot is taken and the ``try`` entered in one step of the coroutine:
    grpc.aio starts a handler's coroutine as it creates it, so a call
    cancelled at any point after that gives its slot back.
    """

    async def unary(request: Any, context: Any) -> Any:
        behavior = handler.stream_unary if handler.request_streaming else handler.unary_unary
        if not budget.take():
            await over(budget, method, context)
        try:
            answer = behavior(request, context)
            return await answer if inspect.isawaitable(answer) else answer
        finally:
            budget.give()

    async def streaming(request: Any, context: Any) -> None:
        behavior = handler.stream_stream if handler.request_streaming else handler.unary_stream
        if not budget.take():
            await over(budget, method, context)
        try:
            # written with context.write whatever the handler's shape: grpc.aio takes a coroutine or
            # a generator, not both in one handler
            answer = behavior(request, context)
            if inspect.isasyncgen(answer):
                async for item in answer:
                    await context.write(item)
            elif inspect.isawaitable(answer):
                await answer
            elif answer is not None:  # a synchronous generator
                for item in answer:
                    await context.write(item)
        finally:
            budget.give()

    make = {
        (False, False): grpc.unary_unary_rpc_method_handler,
        (False, True): grpc.unary_stream_rpc_method_handler,
        (True, False): grpc.stream_unary_rpc_method_handler,
        (True, True): grpc.stream_stream_rpc_method_handler,
    }[(bool(handler.request_streaming), bool(handler.response_streaming))]
    return make(
        streaming if handler.response_streaming else unary,
        request_deserializer=handler.request_deserializer,
        response_serializer=handler.response_serializer,
    )


def _refusal(handler: Any, exc: AuthenticationError) -> Any:
    """A handler shaped like ``handler`` that ends the call with UNAUTHENTICATED and a ladle error trailer."""

    async def refuse(requests: Any, context: Any) -> None:
        await rpc.abort(context, grpc.StatusCode.UNAUTHENTICATED, "unauthenticated", str(exc))

    # request-streaming whatever the method: grpc.aio runs it at once, where a unary-request
    # handler would first wait for the request (a slot held by a caller with no token)
    if handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(refuse)
    return grpc.stream_unary_rpc_method_handler(refuse)


@dataclass(frozen=True)
class TlsFiles:
    """The server's certificate chain and key (PEM files), and a CA that client certificates must chain to."""

    cert: Path
    key: Path
    client_ca: Path | None = None

    @classmethod
    def from_options(
        cls,
        cert: str | os.PathLike[str] | None,
        key: str | os.PathLike[str] | None,
        client_ca: str | os.PathLike[str] | None = None,
    ) -> TlsFiles | None:
        """None without ``cert`` and ``key``; ``ConfigError`` for one without the other or a missing file."""
        if cert is None and key is None:
            if client_ca is not None:
                raise ConfigError("tls_client_ca", "mutual TLS needs --tls-cert and --tls-key too")
            return None
        if cert is None or key is None:
            raise ConfigError(
                "tls_cert" if cert is None else "tls_key", "--tls-cert and --tls-key go together"
            )
        files = cls(Path(cert), Path(key), Path(client_ca) if client_ca is not None else None)
        for field, path in (
            ("tls_cert", files.cert),
            ("tls_key", files.key),
            ("tls_client_ca", files.client_ca),
        ):
            if path is not None and not path.is_file():
                raise ConfigError(field, f"no such file: {path}")
        # a certificate that does not match its key fails here, at start-up, with the file named
        try:
            ssl.create_default_context(ssl.Purpose.CLIENT_AUTH).load_cert_chain(files.cert, files.key)
            if files.client_ca is not None:
                ssl.create_default_context(cafile=str(files.client_ca))
        except (ssl.SSLError, OSError) as exc:
            raise ConfigError("tls_cert", f"cannot use {files.cert} with {files.key}: {exc}") from None
        return files

    def grpc_credentials(self) -> Any:
        """``grpc.ssl_server_credentials`` for these files (client certificates required with a CA)."""
        return grpc.ssl_server_credentials(
            [(self.key.read_bytes(), self.cert.read_bytes())],
            root_certificates=self.client_ca.read_bytes() if self.client_ca is not None else None,
            require_client_auth=self.client_ca is not None,
        )

    def uvicorn_options(self) -> dict[str, Any]:
        """The ``uvicorn.Config`` keywords that serve HTTPS with these files."""
        options: dict[str, Any] = {"ssl_certfile": str(self.cert), "ssl_keyfile": str(self.key)}
        if self.client_ca is not None:
            options.update(ssl_ca_certs=str(self.client_ca), ssl_cert_reqs=ssl.CERT_REQUIRED)
        return options


def is_loopback(host: str) -> bool:
    """Only this machine can reach ``host``: ``localhost`` or a loopback address (not ``0.0.0.0``)."""
    if host.strip("[]").lower() in ("localhost", "localhost."):  # the fully qualified form too
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a host name: assume others can reach it


def check_exposure(host: str, *, token: bool, tls: bool, insecure: bool) -> None:
    """Refuse a non-loopback address without a token unless ``insecure``; warn about what is exposed."""
    if is_loopback(host):
        return
    if not token:
        if not insecure:
            raise ConfigError(
                "host",
                f"{host} can be reached from other machines and no token is set: give --token-file "
                f"(or {TOKEN_ENV}), or --insecure to serve every batch to anyone who connects",
            )
        log.warning(
            "INSECURE: serving on %s without a token: anyone who can reach this port can read "
            "every batch and move every job's cursor",
            host,
        )
    elif not tls:
        log.warning(
            "serving on %s with a token but without TLS: the token and the batches cross the network "
            "in clear text (give --tls-cert and --tls-key, or keep the network private)",
            host,
        )
