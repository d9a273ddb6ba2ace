"""Padded numpy batches from the server's gather, and an ordered read-ahead pool of them.

The server sends frames (``Assembler.frame``); a loader inside the trainer
would hand out arrays instead. ``padded`` makes that loader's batch from the
same gather (``Assembler.pieces``, joined once), and ``Prefetcher`` runs it on
a small thread pool ahead of its consumer: the baselines ``bench_assemble``
and ``bench_serving`` measure the server against.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Iterable, Iterator
from concurrent.futures import CancelledError, Future, ThreadPoolExecutor
from types import TracebackType
from typing import Generic, NamedTuple, TypeVar

import numpy as np
import numpy.typing as npt

from ladle.service.assemble import Assembler

__all__ = ["Padded", "Prefetcher", "padded"]

K = TypeVar("K")


class Padded(NamedTuple):
    """One padded batch: int32 ``input_ids`` and int8 ``loss_mask`` ``[rows, padded_len]`` (writable).

    ``lengths`` (int32) holds each row's tokens in the batch, ``sample_ids``
    (int64) the dataset rows in the order asked for.
    """

    input_ids: npt.NDArray[np.int32]
    loss_mask: npt.NDArray[np.int8]
    lengths: npt.NDArray[np.int32]
    sample_ids: npt.NDArray[np.int64]


def padded(
    asm: Assembler, rows: npt.ArrayLike, padded_len: int, pad_id: int = 0, *, max_len: int | None = None
) -> Padded:
    """The batch ``asm.pieces`` gives, joined into new arrays (one copy of each byte)."""
    pieces = asm.pieces(rows, padded_len, pad_id, max_len=max_len)
    shape = (len(pieces.lengths), padded_len)
    ids = np.frombuffer(bytearray().join(pieces.input_ids), dtype="<i4").reshape(shape)
    mask = np.frombuffer(bytearray().join(pieces.loss_mask), dtype=np.int8).reshape(shape)
    return Padded(ids.astype(np.int32, copy=False), mask, pieces.lengths, pieces.sample_ids)


class Prefetcher(Generic[K]):
    """Makes ``padded`` batches of ``jobs`` ahead on a thread pool and yields ``(key, Padded)`` in job order.

    At most ``depth`` batches beyond the one the consumer waits for are queued
    or ready; jobs are pulled lazily, on the consumer's thread. An exception
    (from the jobs or from making a batch) is raised where that job's batch
    would have been yielded, and ends the iteration. ``close()`` cancels the
    queued work; ``with Prefetcher(...)`` closes on exit.
    """

    def __init__(
        self,
        assembler: Assembler,
        jobs: Iterable[tuple[K, npt.ArrayLike, int]],
        depth: int = 4,
        workers: int = 2,
        *,
        pad_id: int = 0,
    ) -> None:
        if depth < 1 or workers < 1:
            raise ValueError(f"depth and workers must be >= 1, got {depth} and {workers}")
        self._assembler = assembler
        self._jobs: Iterator[tuple[K, npt.ArrayLike, int]] | None = iter(jobs)
        self._depth = depth
        self._pad_id = pad_id
        self._lock = threading.Lock()
        self._pending: deque[tuple[K, Future[Padded]]] = deque()
        self._job_error: Exception | None = None
        self._closed = False
        self._executor = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="ladle-padded")

    def _top_up(self, size: int) -> None:
        """Pull and submit jobs until ``size`` are pending or the jobs run out (lock held)."""
        while self._jobs is not None and len(self._pending) < size:
            try:
                key, rows, padded_len = next(self._jobs)
            except StopIteration:
                self._jobs = None
                break
            except Exception as exc:  # raised in order, once the batches already queued are out
                self._jobs = None
                self._job_error = exc
                break
            future = self._executor.submit(padded, self._assembler, rows, padded_len, self._pad_id)
            self._pending.append((key, future))

    def __iter__(self) -> Prefetcher[K]:
        return self

    def __next__(self) -> tuple[K, Padded]:
        with self._lock:
            if self._closed:
                raise StopIteration
            self._top_up(self._depth + 1)
            if not self._pending:
                error, self._job_error = self._job_error, None
                self._close()
                if error is not None:
                    raise error
                raise StopIteration
            key, future = self._pending.popleft()
            self._top_up(self._depth)
        try:
            return key, future.result()
        except CancelledError:
            raise StopIteration from None  # closed by another thread meanwhile
        except BaseException:
            self.close()
            raise

    def _close(self) -> None:
        """Cancel the queued work (lock held)."""
        if not self._closed:
            self._closed = True
            self._jobs = None
            self._pending.clear()
            self._executor.shutdown(wait=False, cancel_futures=True)

    def close(self) -> None:
        """Cancel the queued work; idempotent, any thread."""
        with self._lock:
            self._close()

    def __enter__(self) -> Prefetcher[K]:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()
