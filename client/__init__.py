"""The trainer side of ladle: ``BatchClient(rank)`` and iterate.

Imports only grpcio, numpy and the generated protocol (``ladle.proto``); torch
only when asked for tensors. Never imports ``ladle.service``.
"""

from .batch import Batch
from .client import STATE_VERSION, BatchClient
from .errors import (
    AuthenticationError,
    BatchClientError,
    FencedError,
    ServerFullError,
    ServerUnavailableError,
    StateDictError,
)

__all__ = [
    "STATE_VERSION",
    "AuthenticationError",
    "Batch",
    "BatchClient",
    "BatchClientError",
    "FencedError",
    "ServerFullError",
    "ServerUnavailableError",
    "StateDictError",
]
