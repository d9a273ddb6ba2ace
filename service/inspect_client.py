"""``ladle inspect``'s side of the wire: one job's report, fetched from a running server's HTTP API.

Standard library only (urllib), so inspecting a server needs nothing the CLI
does not already have. A server that cannot be reached, or that refuses a
request, raises ``InspectError`` with the server's own message and a hint at
the likely mistake: a port that does not speak HTTP/1.1 (the gRPC port, most
often), a TLS port spoken to in plain text or the reverse, a server that wants
a client certificate (mutual TLS).
"""

from __future__ import annotations

import http.client
import json
import re
import ssl
import urllib.error
import urllib.parse
import urllib.request
from typing import Any, Final

from ladle.proto.codec import JOB_NAME_PATTERN, JOB_NAME_RULE

from .errors import ConfigError, LadleError

__all__ = ["DEFAULT_SERVER", "InspectError", "fetch", "fetch_report", "server_url", "tls_context"]

DEFAULT_SERVER: Final = "127.0.0.1:8080"
_NOT_HTTP: Final = "is that the gRPC port? inspect speaks HTTP (--http-port, default 8080)"
# A connection closed before any answer is not a wrong protocol: it is what a server
# restarting does, and what a TLS port does with plain text (or without a client certificate).
_CLOSED: Final = {
    "http": "a server restarting, or a TLS port: try https:// or --tls-ca",
    "https": "a server restarting, or one with --tls-client-ca that wants a client certificate "
    "signed by its CA: --tls-cert and --tls-key",
}
_NO_TLS: Final = "the port does not speak TLS: leave out --tls-ca (and https://) for a plain-HTTP server"
_UNTRUSTED: Final = "give --tls-ca with the CA that signed it (and --server with a name it holds)"
_CLIENT_CERT: Final = (
    "the server wants a client certificate it accepts (mutual TLS): --tls-cert and --tls-key"
)
# The TLS alerts a server sends when the client certificate is missing or not one it accepts.
_CERT_ALERTS: Final = ("CERTIFICATE_REQUIRED", "BAD_CERTIFICATE", "UNKNOWN_CA", "HANDSHAKE_FAILURE")
# FastAPI's 422 ``loc`` starts with where the value came from; the parameter's name follows.
_SOURCES: Final = frozenset({"path", "query", "header", "cookie", "body"})
_JOB_NAME: Final = re.compile(JOB_NAME_PATTERN)
_LISTING_PAGE: Final = 10_000  # the most /v1/jobs gives at once: a big store in few requests
# A peer that hung up mid-exchange (RemoteDisconnected is also a ConnectionResetError).
_CLOSED_ERRORS: Final = (
    http.client.RemoteDisconnected,
    http.client.IncompleteRead,
    ConnectionResetError,
    ConnectionAbortedError,
    BrokenPipeError,
    ssl.SSLEOFError,
    ssl.SSLZeroReturnError,
)


class InspectError(LadleError):
    """The server could not be reached, or refused the request."""

    kind = "unavailable"


def server_url(server: str, *, tls: bool = False, option: str = "tls_ca") -> str:
    """``server`` as a base URL (no trailing slash): ``host:port`` gets ``http://`` (``https://`` if ``tls``).

    ``tls`` (a CA to verify the server against, or a client certificate, was
    given) with an ``http://`` URL is a ``ConfigError`` naming ``option``: the
    files would silently go unused.
    """
    server = server.strip()
    if "://" not in server:
        server = ("https://" if tls else "http://") + server
    elif tls and not server.lower().startswith("https://"):
        what = "verifies" if option == "tls_ca" else "is for"
        raise ConfigError(option, f"{what} an https:// server, but --server is {server}: use https://")
    return server.rstrip("/")


def tls_context(
    cafile: str | None = None, certfile: str | None = None, keyfile: str | None = None
) -> ssl.SSLContext | None:
    """The context an https server is spoken to with; None (the system's CAs) when no file is given.

    ``cafile`` verifies the server; ``certfile`` and ``keyfile`` (together or
    not at all) are the client certificate a mutual-TLS server asks for. A
    file that cannot be read or used is a ``ConfigError`` naming it.
    """
    if (certfile is None) != (keyfile is None):
        raise ConfigError(
            "tls_cert", "--tls-cert and --tls-key go together (the client certificate and its key)"
        )
    if cafile is None and certfile is None:
        return None
    try:
        context = ssl.create_default_context(cafile=cafile)
    except (OSError, ssl.SSLError) as exc:
        raise ConfigError("tls_ca", f"cannot read {cafile}: {exc.strerror or exc}") from None
    if certfile is not None:
        try:
            context.load_cert_chain(certfile, keyfile)
        except (OSError, ssl.SSLError) as exc:
            raise ConfigError(
                "tls_cert", f"cannot use {certfile} with the key {keyfile}: {exc.strerror or exc}"
            ) from None
    return context


def fetch(
    base: str,
    path: str,
    timeout: float = 30.0,
    *,
    token: str | None = None,
    context: ssl.SSLContext | None = None,
    **params: Any,
) -> Any:
    """GET ``base + path`` with the given query parameters (None ones left out); the decoded JSON.

    ``token`` goes in an ``Authorization: Bearer`` header; ``context`` (from
    ``tls_context``) is used for an https server.
    """
    query = urllib.parse.urlencode({k: v for k, v in params.items() if v is not None})
    url = f"{base}{path}" + (f"?{query}" if query else "")
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"} if token else {})
    try:
        with urllib.request.urlopen(
            request, timeout=timeout, context=context if url.startswith("https:") else None
        ) as response:
            body = response.read()
    except urllib.error.HTTPError as exc:
        raise InspectError(f"{url}: HTTP {exc.code}: {_refusal(exc)}") from None
    except (urllib.error.URLError, http.client.HTTPException, OSError) as exc:
        raise InspectError(_unreachable(base, exc)) from None
    try:
        return json.loads(body)
    except ValueError:
        raise InspectError(f"{url}: the answer is not JSON: is {base} a ladle server's HTTP port?") from None


def _refusal(exc: urllib.error.HTTPError) -> str:
    """The server's reason for an HTTP error on one line: its ``detail``, a 422's as ``field: message``."""
    try:
        detail = json.loads(exc.read()).get("detail", exc.reason)
    except (ValueError, AttributeError):
        detail = exc.reason
    if isinstance(detail, list):  # FastAPI's validation errors: [{"loc": [...], "msg": ...}, ...]
        detail = "; ".join(_validation_error(item) for item in detail)
    if exc.code == 401:
        detail = f"{detail} (ladle inspect: --token-file FILE, or LADLE_TOKEN_FILE or LADLE_TOKEN)"
    return str(detail)


def _validation_error(item: Any) -> str:
    if not isinstance(item, dict):
        return str(item)
    loc = [str(part) for part in item.get("loc", [])]
    if loc and loc[0] in _SOURCES:
        loc = loc[1:]
    msg = str(item.get("msg", item))
    return f"{'.'.join(loc)}: {msg}" if loc else msg


def _unreachable(base: str, exc: Exception) -> str:
    """What to say when ``base`` gave no HTTP answer: what happened, and the likely mistake."""
    reason = getattr(exc, "reason", exc) if isinstance(exc, urllib.error.URLError) else exc
    name = type(reason).__name__
    scheme = "https" if base.lower().startswith("https:") else "http"
    # RemoteDisconnected and IncompleteRead are HTTPExceptions too: test them before BadStatusLine.
    if isinstance(reason, _CLOSED_ERRORS):
        when = (
            "before its answer was whole"
            if isinstance(reason, http.client.IncompleteRead)
            else "without answering"
        )
        return f"{base} closed the connection {when} ({name}): {_CLOSED[scheme]}"
    if isinstance(reason, http.client.HTTPException):  # BadStatusLine: an HTTP/2-only (gRPC) port answered
        return f"{base} did not answer HTTP ({name}): {_NOT_HTTP}"
    if isinstance(reason, ssl.SSLCertVerificationError):
        return f"{base}'s certificate is not trusted ({reason.verify_message}): {_UNTRUSTED}"
    if isinstance(reason, ssl.SSLError):
        if reason.reason == "WRONG_VERSION_NUMBER":
            return f"{base} did not answer TLS ({reason.reason}): {_NO_TLS}"
        if any(alert in str(reason.reason) for alert in _CERT_ALERTS):
            return f"{base} refused the TLS connection ({reason.reason}): {_CLIENT_CERT}"
    return f"cannot reach {base} ({reason}); is `ladle serve` running there?"


def fetch_report(
    server: str,
    job: str | None = None,
    epoch: int | None = None,
    *,
    token: str | None = None,
    cafile: str | None = None,
    certfile: str | None = None,
    keyfile: str | None = None,
) -> dict[str, Any]:
    """Everything ``ladle inspect`` prints about one job (the served job updated last if none is named).

    ``job`` is None in the result when the server has no job on its dataset
    and config. A ``job`` that is not a valid name is a ``ConfigError``
    before any request; ``certfile``/``keyfile`` are a client certificate
    (mutual TLS).
    """
    if job is not None and _JOB_NAME.fullmatch(job) is None:
        raise ConfigError("job", f"must be {JOB_NAME_RULE}, got {job!r}")
    tls = cafile is not None or certfile is not None
    base = server_url(server, tls=tls, option="tls_ca" if cafile is not None else "tls_cert")
    context = tls_context(cafile, certfile, keyfile)

    def get(path: str, **params: Any) -> Any:
        return fetch(base, path, token=token, context=context, **params)

    listing = get("/v1/jobs", limit=_LISTING_PAGE)
    while listing.get("next_after"):  # a store of many jobs comes a page at a time
        page = get("/v1/jobs", limit=_LISTING_PAGE, after=listing["next_after"])
        listing["jobs"] += page["jobs"]
        listing["next_after"] = page["next_after"]
    doc: dict[str, Any] = {
        "server": base,
        "dataset": listing["dataset"],
        "jobs": listing["jobs"],
        "job": None,
    }
    if job is None:
        served = [j for j in listing["jobs"] if j["served"]]
        if not served:
            return doc
        job = max(served, key=lambda j: (j["updated"], j["job"]))["job"]
    path = "/v1/jobs/" + urllib.parse.quote(job, safe="")
    doc["job"] = get(path)
    doc["buckets"] = get(path + "/buckets", epoch=epoch)
    doc["quality"] = get(path + "/quality", epoch=epoch)
    doc["random"] = get(path + "/quality", epoch=epoch, interleave="random")
    doc["cursor"] = get(path + "/cursor")
    return doc
