"""Whether a server can serve trainers now: its dataset is as it was opened, and its cursor store answers.

One check behind both faces: HTTP ``/readyz`` and the gRPC health service's
status for ``ladle.v1.BatchService`` (the status Kubernetes' ``grpc``
readiness probe asks for). The store is asked by one ping at a time; checks
that come while it is out wait for that one, and none waits longer than
``STORE_ANSWER_S``, so a store that hangs (a Redis stopped mid-connection)
makes the server not ready within that bound instead of hanging its probe.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from pathlib import Path
from typing import Final

from .dataset import TokenDataset
from .errors import LadleError
from .store.base import CursorStore

# How long a readiness check waits for the store's answer: a Redis that hangs answers nothing for
# its 5 s socket timeout, and a probe's own timeout (Kubernetes: 1 s by default) would expire first.
STORE_ANSWER_S: Final = 1.0


class Readiness:
    """The readiness check of one server (thread-safe)."""

    def __init__(self, dataset: TokenDataset, store: CursorStore) -> None:
        self.dataset = dataset
        self.store = store
        # one store ping at a time; checks that come meanwhile wait for that one
        self._ping_lock = threading.Lock()
        self._ping: Future[str | None] | None = None

    def dataset_ok(self) -> bool:
        """The dataset was opened and validated at start-up; its folder and files must be as they were."""
        if not Path(self.dataset.path).exists():
            return False
        return all(data_file.change() is None for data_file in self.dataset.files)

    def store_error(self) -> str | None:
        """Why the cursor store cannot be used now, or None when it answers (within ``STORE_ANSWER_S``)."""
        with self._ping_lock:
            if self._ping is None or self._ping.done():
                self._ping = Future()
                threading.Thread(
                    target=self._ping_store, args=(self._ping,), name="ladle-ping", daemon=True
                ).start()
            ping = self._ping
        try:
            return ping.result(timeout=STORE_ANSWER_S)
        except FutureTimeout:
            return f"cursor store {self.store!r} did not answer within {STORE_ANSWER_S:.0f} s"

    def problem(self) -> str | None:
        """Why the server is not ready now (the dataset first, then the store), or None when it is."""
        if not self.dataset_ok():
            return f"dataset {self.dataset.path} changed on disk since the server opened it"
        error = self.store_error()
        return None if error is None else f"cursor store: {error}"

    def _ping_store(self, done: Future[str | None]) -> None:
        try:
            self.store.ping()
        except LadleError as exc:
            done.set_result(str(exc))
        except Exception as exc:  # a store must raise StoreUnavailableError; readiness never crashes
            done.set_result(f"{type(exc).__name__}: {exc}")
        else:
            done.set_result(None)
