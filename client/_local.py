"""``BatchClient(dataset=PATH)``: the dataset served in the trainer's own process, no ``ladle serve``.

A ``BatchServer`` (``ladle.service.server``) runs on a thread of this
process, on a free loopback port with no HTTP face, and the client reads
from it as from any server: the batches are the same objects, byte for byte,
that ``ladle serve PATH`` sends for the same config and job, and the rank's
position lives in ``state_dict()`` and in the embedded store (``state``: a
file, so a crash resumes without a checkpoint; else a temporary one, removed
at ``close()``). The trade-off: each batch still crosses a loopback gRPC
stream inside the process (the same code path as served, not the cheapest
one); ``ladle.ScheduleSampler`` in a ``DataLoader`` is the path with no gRPC.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from typing import Any

from .errors import BatchClientError

__all__ = ["LocalServer"]


class LocalServer:
    """A ``BatchServer`` of ``dataset`` on 127.0.0.1, started now; ``stop()`` ends it (idempotent)."""

    def __init__(self, dataset: str | os.PathLike[str], config: Any = None, state: Any = None) -> None:
        try:
            from ladle.service.schedule import ScheduleConfig
            from ladle.service.server import BatchServer
        except ModuleNotFoundError as exc:
            raise BatchClientError(
                f"BatchClient(dataset=...) serves the dataset in this process and needs ladle's server part "
                f"({exc.name} is not installed): pip install 'ladle[server]'"
            ) from None
        if config is None:
            config = ScheduleConfig()
        elif not isinstance(config, ScheduleConfig):
            raise ValueError(f"config must be a ScheduleConfig, got {type(config).__name__}")
        self._scratch = None if state is not None else tempfile.mkdtemp(prefix="ladle-local-")
        where = state if state is not None else os.path.join(str(self._scratch), "state.db")
        self.server = BatchServer(
            os.fspath(dataset), config, host="127.0.0.1", grpc_port=0, state=where, http_port=None
        )
        try:
            self.server.start()
        except BaseException:
            self._remove_scratch()
            raise
        self.address: str = self.server.address

    def stop(self) -> None:
        try:
            self.server.stop(grace=0)
        finally:
            self._remove_scratch()

    def _remove_scratch(self) -> None:
        if self._scratch is not None:
            shutil.rmtree(self._scratch, ignore_errors=True)
            self._scratch = None
