"""gRPC's client transport for ladle's processes, chosen before grpcio is first imported.

grpcio reads its *experiments* (``GRPC_EXPERIMENTS``) once, when it is
imported. Its default client transport on Linux (the EventEngine) reads a
channel's socket on threads of its own and hands every message to the thread
that polls the call: for a stream of batches, one more thread wake-up per
message in the trainer. The transport before it (iomgr's epoll1 poller,
experiment ``-event_engine_client``) reads the socket on the thread that polls
the call's completion queue, which in ``BatchClient`` is its reader thread:
the message is read where it is decoded. ``python -m benchmarks.bench_serving``
(figure 1, 2 trainers, 3 alternated runs on 2 cores) measured the trainers'
CPU a batch at 235-255 us against 276-314 us, and ladle's rate at 0.73-0.81
against 0.61-0.68 GB/s; a bare grpcio stream read by the same processes gained
about 13% too (see docs/serving.md, "The trainer's transport").

:func:`choose` sets that experiment for grpcio's import and takes the
variable out of the environment again right after, so only this process reads
it (child processes see the environment the user gave). It leaves grpcio's
own choice when:

* the user set ``GRPC_EXPERIMENTS`` (to anything, even empty): theirs wins;
* grpcio was imported before ladle: it has read its experiments already;
* the installed grpcio is not one this was tested with (:data:`TESTED_GRPC`),
  since experiments come and go between grpcio releases.

``ladle.client`` and ``ladle.proto.rpc`` (which the server and every
other gRPC user in ladle import) call :func:`choose` before they import
grpcio, so ``import ladle.client`` before anything that imports grpcio is all
a trainer needs. Nothing here imports grpcio until :func:`choose` does, and
the rest of ``ladle`` (the schedule, the dataset layer) does not call it.
"""

from __future__ import annotations

import os
import sys
from importlib import metadata
from typing import Final

__all__ = ["CLIENT_EXPERIMENTS", "TESTED_GRPC", "choose", "chosen", "grpc_is_tested"]

# The grpcio minor versions ladle's uses of grpcio's internals were tested with: the transport
# experiment here, and the client's polled reader (``ladle.client._direct``, which reads grpcio's
# Cython layer, not a public API). A later grpcio may change either without notice.
TESTED_GRPC: tuple[tuple[int, int], ...] = ((1, 85),)

CLIENT_EXPERIMENTS: Final = "-event_engine_client"
"""The experiments ladle asks for: grpcio's iomgr transport for client channels."""

_chosen: str | None = None  # what choose() did, once it has


def grpc_is_tested(version: str) -> bool:
    """True if grpcio ``version`` ("1.85.3") is one of :data:`TESTED_GRPC`."""
    parts = version.split(".")
    try:
        return (int(parts[0]), int(parts[1])) in TESTED_GRPC
    except (IndexError, ValueError):
        return False


def choose() -> str:
    """Import grpcio with :data:`CLIENT_EXPERIMENTS` unless the module docstring's exceptions apply.

    Returns (and :func:`chosen` repeats) what was done, in words. Calling it
    again changes nothing.
    """
    global _chosen
    if _chosen is None:
        _chosen = _choose()
    return _chosen


def _choose() -> str:
    if "GRPC_EXPERIMENTS" in os.environ:
        return f"grpcio's, as GRPC_EXPERIMENTS={os.environ['GRPC_EXPERIMENTS']!r} asks"
    if "grpc" in sys.modules:
        return "grpcio's own: grpcio was imported before ladle"
    try:
        version = metadata.version("grpcio")
    except metadata.PackageNotFoundError:
        version = "unknown"
    if not grpc_is_tested(version):
        return f"grpcio's own: grpcio {version} is not one ladle's transport was tested with"
    os.environ["GRPC_EXPERIMENTS"] = CLIENT_EXPERIMENTS
    try:
        import grpc  # noqa: F401  (reads GRPC_EXPERIMENTS now, and only now)
    finally:
        del os.environ["GRPC_EXPERIMENTS"]
    return f"iomgr (GRPC_EXPERIMENTS={CLIENT_EXPERIMENTS} for grpcio's import)"


def chosen() -> str:
    """What :func:`choose` did in this process, in words (for logs and benchmarks)."""
    return _chosen or "not chosen: ladle.proto.transport.choose() was not called"
