"""Concurrent reads of one job share a store read that began after each caller asked (``SharedReads``)."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest

from ladle.service.errors import JobNotFoundError
from ladle.service.store.base import JobSpec, Position, SharedReads
from ladle.service.store.embedded import EmbeddedStore


class _Slow:
    """A read that blocks until released and returns how many reads had begun when it began."""

    def __init__(self) -> None:
        self.begun = 0
        self.release = threading.Event()
        self.lock = threading.Lock()

    def __call__(self) -> Any:
        with self.lock:
            self.begun += 1
            mine = self.begun
        assert self.release.wait(10)
        return mine


def _ask(reads: SharedReads[Any], read: Any, out: list[Any]) -> threading.Thread:
    thread = threading.Thread(target=lambda: out.append(reads.get("job", read)))
    thread.start()
    return thread


def _wait_for(condition: Any) -> None:
    deadline = time.monotonic() + 10
    while not condition():
        assert time.monotonic() < deadline
        time.sleep(0.005)


def test_callers_during_a_read_share_the_next_read_not_the_running_one() -> None:
    reads: SharedReads[int] = SharedReads()
    read, out = _Slow(), list[Any]()
    first = _ask(reads, read, out)
    _wait_for(lambda: read.begun == 1)  # read 1 runs: callers from now on may not take its answer
    later = [_ask(reads, read, out) for _ in range(20)]
    time.sleep(0.05)
    assert read.begun == 1, "a caller began a read beside the running one"
    read.release.set()
    for t in [first, *later]:
        t.join(10)
    assert read.begun == 2, "twenty callers that came during a read should share one more read"
    assert sorted(out) == [1] + [2] * 20


def test_an_error_reaches_every_caller_of_that_read_and_the_next_read_is_fresh() -> None:
    reads: SharedReads[str] = SharedReads()
    gate = threading.Event()
    errors: list[BaseException] = []

    def failing() -> Any:
        assert gate.wait(10)
        raise JobNotFoundError("job")

    def ask() -> None:
        try:
            reads.get("job", failing)
        except JobNotFoundError as exc:
            errors.append(exc)

    threads = [threading.Thread(target=ask) for _ in range(5)]
    for t in threads:
        t.start()
    time.sleep(0.05)
    gate.set()
    for t in threads:
        t.join(10)
    assert len(errors) == 5
    assert reads.get("job", lambda: "fresh") == "fresh"


def test_the_store_reads_a_write_that_ended_before_the_call(tmp_path: Path) -> None:
    """Through a real store, many threads reading while another writes each see at least the
    position written before they asked."""
    store = EmbeddedStore(tmp_path / "state.db")
    try:
        store.open_job(JobSpec("j", "d" * 16, "c" * 16, 4))
        gen = store.join("j", 0, 4).generation
        stop = threading.Event()
        wrong: list[str] = []

        def reader() -> None:
            while not stop.is_set():
                before = written[0]
                seen = store.get("j").ranks[0].position.step
                if seen < before:
                    wrong.append(f"saw {seen} after {before} was written")

        written = [0]
        readers = [threading.Thread(target=reader) for _ in range(8)]
        for t in readers:
            t.start()
        for step in range(1, 60):
            store.advance("j", 0, gen, Position(0, step))
            written[0] = step
        stop.set()
        for t in readers:
            t.join(10)
        assert not wrong, wrong[:3]
    finally:
        store.close()


@pytest.mark.parametrize("jobs", [1, 3])
def test_reads_of_other_jobs_do_not_wait_for_each_other(jobs: int) -> None:
    reads: SharedReads[str] = SharedReads()
    release = threading.Event()
    out: list[Any] = []

    def blocked() -> Any:
        assert release.wait(10)
        return "blocked"

    t = threading.Thread(target=lambda: out.append(reads.get("slow", blocked)))
    t.start()
    time.sleep(0.02)
    for i in range(jobs):
        assert reads.get(f"other-{i}", lambda: "quick") == "quick"
    release.set()
    t.join(10)
    assert out == ["blocked"]
