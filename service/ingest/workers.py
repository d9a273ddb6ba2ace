"""Worker processes that tokenize raw batches, their results returned in input order.

Guarantee: ``ordered_map`` yields one result per item, in the items' order,
whatever the number of workers, so the dataset written is the same for any
``--workers``; at most ``2 * workers + 2`` items are read ahead of the one
being written, so memory does not grow with the input. Workers are started
with ``forkserver`` (``spawn`` where it is missing), never ``fork``: Arrow
and ``tokenizers`` hold threads that a forked child would inherit broken.
Each worker tokenizes on one thread (``RAYON_NUM_THREADS=1`` and
``TOKENIZERS_PARALLELISM=false`` are set before it loads the tokenizer), so
``--workers N`` uses N cores. The trade-off: every batch is pickled to its
worker and back (a few percent of the tokenizing time); ``workers=0`` runs
everything in the calling process, for tests and debugging.
"""

from __future__ import annotations

import multiprocessing
import os
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ProcessPoolExecutor
from typing import Any

__all__ = ["default_workers", "ordered_map", "single_threaded"]

# The function a worker process calls on each item (set by _start).
_work: Callable[[Any], Any] | None = None


def default_workers() -> int:
    """All cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def single_threaded() -> None:
    """Keep ``tokenizers`` (Rayon) on the calling thread; call before it first encodes."""
    os.environ["RAYON_NUM_THREADS"] = "1"
    os.environ["TOKENIZERS_PARALLELISM"] = "false"


def _start(factory: Callable[..., Callable[[Any], Any]], args: tuple[Any, ...]) -> None:
    global _work
    single_threaded()
    _work = factory(*args)


def _call(item: Any) -> Any:
    assert _work is not None, "the worker was not started"
    return _work(item)


def ordered_map(
    factory: Callable[..., Callable[[Any], Any]],
    args: tuple[Any, ...],
    items: Iterable[Any],
    workers: int,
) -> Iterator[Any]:
    """``factory(*args)(item)`` for each item, in order, on ``workers`` processes (0: in this one).

    ``factory`` and ``args`` must pickle (a module-level class or function);
    each worker calls ``factory(*args)`` once and the result on each item. An
    exception raised for an item (a worker's ``LadleError`` included) is
    raised here when its turn comes; the pool is shut down when the iterator
    ends, fails or is closed, the items not yet started cancelled.
    """
    if workers <= 0:
        work = factory(*args)
        for item in items:
            yield work(item)
        return
    methods = multiprocessing.get_all_start_methods()
    context = multiprocessing.get_context("forkserver" if "forkserver" in methods else "spawn")
    pending: deque[Future[Any]] = deque()
    limit = 2 * workers + 2
    pool = ProcessPoolExecutor(workers, mp_context=context, initializer=_start, initargs=(factory, args))
    try:
        for item in items:
            pending.append(pool.submit(_call, item))
            while len(pending) >= limit or (pending and pending[0].done()):
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()
    finally:
        for future in pending:
            future.cancel()
        pool.shutdown(wait=True, cancel_futures=True)
