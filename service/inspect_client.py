"""``ladle inspect``'s side of the wire: one job's report, fetched from a running server's HTTP API.

Standard library only (urllib), so inspecting a server needs nothing the CLI
does not already have. A server that cannot be reached, or that refuses a
request, raises ``InspectError`` with the server's own message; so does a
port that does not speak HTTP/1.1 (the gRPC port, most often).
"""

from __future__ import annotations

import http.client
import json
import ssl
import urllib.error
import urllib.parse
import urllib.request
from typing import Any, Final

from .errors import ConfigError, LadleError

__all__ = ["DEFAULT_SERVER", "InspectError", "fetch", "fetch_report", "server_url"]

DEFAULT_SERVER: Final = "127.0.0.1:8080"
_NOT_HTTP: Final = "is that the gRPC port? inspect speaks HTTP (--http-port, default 8080)"


class InspectError(LadleError):
    """The server could not be reached, or refused the request."""

    kind = "unavailable"


def server_url(server: str, *, tls: bool = False) -> str:
    """``server`` as a base URL (no trailing slash): ``host:port`` gets ``http://`` (``https://`` if ``tls``).

    ``tls`` (a CA to verify the server against was given) with an ``http://``
    URL is a ``ConfigError``: the CA would silently go unused.
    """
    server = server.strip()
    if "://" not in server:
        server = ("https://" if tls else "http://") + server
    elif tls and not server.lower().startswith("https://"):
        raise ConfigError("tls_ca", f"verifies an https:// server, but --server is {server}: use https://")
    return server.rstrip("/")


def fetch(
    base: str,
    path: str,
    timeout: float = 30.0,
    *,
    token: str | None = None,
    cafile: str | None = None,
    **params: Any,
) -> Any:
    """GET ``base + path`` with the given query parameters (None ones left out); the decoded JSON.

    ``token`` goes in an ``Authorization: Bearer`` header; ``cafile`` verifies an https server.
    """
    query = urllib.parse.urlencode({k: v for k, v in params.items() if v is not None})
    url = f"{base}{path}" + (f"?{query}" if query else "")
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"} if token else {})
    context = None
    if cafile and url.startswith("https:"):
        try:
            context = ssl.create_default_context(cafile=cafile)
        except (OSError, ssl.SSLError) as exc:
            raise ConfigError("tls_ca", f"cannot read {cafile}: {exc.strerror or exc}") from None
    try:
        with urllib.request.urlopen(request, timeout=timeout, context=context) as response:
            body = response.read()
    except urllib.error.HTTPError as exc:
        try:
            detail = json.loads(exc.read()).get("detail", exc.reason)
        except (ValueError, AttributeError):
            detail = exc.reason
        raise InspectError(f"{url}: HTTP {exc.code}: {detail}") from None
    except http.client.HTTPException as exc:  # BadStatusLine: an HTTP/2-only (gRPC) port answered
        raise InspectError(f"{base} did not answer HTTP ({type(exc).__name__}): {_NOT_HTTP}") from None
    except (urllib.error.URLError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        if isinstance(reason, http.client.HTTPException):
            raise InspectError(f"{base} did not answer HTTP ({type(reason).__name__}): {_NOT_HTTP}") from None
        raise InspectError(f"cannot reach {base} ({reason}); is `ladle serve` running there?") from None
    try:
        return json.loads(body)
    except ValueError:
        raise InspectError(f"{url}: the answer is not JSON: is {base} a ladle server's HTTP port?") from None


def fetch_report(
    server: str,
    job: str | None = None,
    epoch: int | None = None,
    *,
    token: str | None = None,
    cafile: str | None = None,
) -> dict[str, Any]:
    """Everything ``ladle inspect`` prints about one job (the served job updated last if none is named).

    ``job`` is None in the result when the server has no job yet.
    """
    base = server_url(server, tls=cafile is not None)

    def get(path: str, **params: Any) -> Any:
        return fetch(base, path, token=token, cafile=cafile, **params)

    listing = get("/v1/jobs")
    while listing.get("next_after"):  # a store of many jobs comes a page at a time
        page = get("/v1/jobs", after=listing["next_after"])
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
