"""The HTTP face: a read-only FastAPI app (JSON API, Prometheus metrics, a page) and its thread.

``create_app`` builds the app over an ``Inspector`` of the server's jobs;
``HttpServer`` runs it with uvicorn beside the gRPC face (``ladle serve
--http-port``). docs/inspect.md lists the endpoints and metrics.
"""

from .app import HTTP_STATUS, create_app
from .inspector import Inspector
from .server import HttpServer

__all__ = ["HTTP_STATUS", "HttpServer", "Inspector", "create_app"]
