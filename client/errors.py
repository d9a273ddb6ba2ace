"""Errors a trainer can see from ``BatchClient``, each with the gRPC status it came from."""

from __future__ import annotations

__all__ = [
    "AuthenticationError",
    "BatchClientError",
    "FencedError",
    "ServerFullError",
    "ServerUnavailableError",
    "StateDictError",
]


class BatchClientError(Exception):
    """Base of the client's errors; ``code`` is the gRPC status name when the server said it."""

    def __init__(self, message: str, code: str | None = None) -> None:
        self.code = code
        super().__init__(message)


class StateDictError(BatchClientError, ValueError):
    """A ``state_dict`` that does not belong to this client's job, rank or schedule."""


class FencedError(BatchClientError):
    """A newer process took over this rank of this job; this one must stop."""


class ServerUnavailableError(BatchClientError, ConnectionError):
    """No server answered within the client's timeout (after retries with backoff)."""


class AuthenticationError(BatchClientError, PermissionError):
    """The server refused the client's token (none sent, or not one it accepts); retrying cannot help."""


class ServerFullError(BatchClientError):
    """Every replica refused the stream: its sessions are all taken (RESOURCE_EXHAUSTED).

    The message names the server's flag to raise (``--max-sessions`` or
    ``--max-sessions-per-job``); adding a replica helps too. Not retried: a
    full server stays full until trainers leave.
    """
