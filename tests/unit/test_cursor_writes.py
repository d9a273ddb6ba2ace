"""A stream's cursor writes run off the event loop, one at a time, the last one awaited at its end."""

from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace
from typing import Any

from ladle.service.flow import StreamSession
from ladle.service.lease import RankLease
from ladle.service.store.base import Position


class Store:
    """Records advances; ``gate`` (when set) holds each one until it is set."""

    def __init__(self) -> None:
        self.advanced: list[tuple[Position, str]] = []
        self.gate: threading.Event | None = None

    def advance(self, job: str, rank: int, generation: int, to: Position) -> None:
        if self.gate is not None:
            assert self.gate.wait(10)
        self.advanced.append((to, threading.current_thread().name))


class Failing(Store):
    """Every advance fails (a store that is gone)."""

    def advance(self, job: str, rank: int, generation: int, to: Position) -> None:
        self.advanced.append((to, "x"))
        raise RuntimeError("the store is gone")


def session(store: Store, executor: Any = None) -> StreamSession:
    job: Any = SimpleNamespace(name="j", store=store)
    return StreamSession(RankLease(job, 0, 1, Position(0, 0)), 4, flush_every=0.05, store_executor=executor)


def in_flight(s: StreamSession) -> Any:
    return s.writing


def in_thread(coro: Any, timeout: float = 10.0) -> None:
    """Run ``coro`` on a loop of its own; fail if it has not ended in ``timeout`` (a spinning loop)."""
    errors: list[BaseException] = []

    def run() -> None:
        try:
            asyncio.run(coro)
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(timeout)
    assert not thread.is_alive(), "the event loop never came back"
    assert not errors, errors


def test_the_end_of_a_stream_waits_for_a_write_that_is_done_but_not_yet_noted() -> None:
    """A future can be done with its callbacks still queued; awaiting it does not yield."""
    store = Store()

    async def scenario() -> None:
        s = session(store)
        s.acked = Position(0, 3)
        done = asyncio.get_running_loop().create_future()
        s.writing = done
        done.add_done_callback(s._written)
        done.set_result(Position(0, 3))  # done; _written queued, not run
        await s.drain()
        assert in_flight(s) is None
        assert s.stored == Position(0, 3)

    in_thread(scenario())
    assert store.advanced == [], "nothing was left to write"


def test_writes_run_on_the_store_threads_one_at_a_time_and_the_last_one_is_awaited() -> None:
    store = Store()
    gate = store.gate = threading.Event()
    executor = ThreadPoolExecutor(4, thread_name_prefix="ladle-store")

    async def scenario() -> None:
        s = session(store, executor)
        s.acked = s.sent = Position(0, 1)
        s.flush(force=True)  # the first write, held by the gate
        for step in range(2, 6):  # acknowledgements while it is held: no second write yet
            s.acked = s.sent = Position(0, step)
            s.flush()
        await asyncio.sleep(0.1)
        assert in_flight(s) is not None
        loop_free = time.monotonic()
        await asyncio.sleep(0.01)  # the loop is not held by the write
        assert time.monotonic() - loop_free < 1.0
        threading.Timer(0.2, gate.set).start()
        await s.drain()
        assert s.stored == Position(0, 5)

    try:
        in_thread(scenario())
    finally:
        executor.shutdown()
    positions = [p for p, _ in store.advanced]
    assert positions[0] == Position(0, 1)
    assert positions[-1] == Position(0, 5), "the last acknowledged position was not written at the end"
    assert positions == sorted(positions)
    assert len(positions) <= 3, f"a write per acknowledgement: {positions}"
    assert all(name.startswith("ladle-store") for _, name in store.advanced)


def test_a_failed_write_ends_the_stream_with_its_error_and_is_not_retried() -> None:
    store = Failing()

    async def scenario() -> None:
        s = session(store)
        s.acked = s.sent = Position(0, 2)
        await s.drain()
        assert isinstance(s.failure, RuntimeError)

    in_thread(scenario())
    assert len(store.advanced) == 1


def test_an_ack_after_a_failed_write_starts_no_other_write() -> None:
    """The trainer keeps acknowledging its prefetched batches until the stream's end reaches it.

    An Ack that came between the failed write and the stream's end started a
    second write; on a hung Redis the end then waited out a second timeout
    (10 s, not 5) and logged the failure twice.
    """

    store = Failing()

    async def scenario() -> None:
        s = session(store)
        s.acked = s.sent = Position(0, 2)
        s.flush(force=True)
        writing = in_flight(s)
        assert writing is not None
        await asyncio.wait([writing])
        while in_flight(s) is writing:  # let _written note the failure
            await asyncio.sleep(0)
        assert isinstance(s.failure, RuntimeError)
        s.sent = s.acked = Position(0, 3)  # an Ack in the reader's queue
        s.flush()
        s.flush(force=True)
        assert in_flight(s) is None, "a write after the failure"
        assert s.deferred is None, "a write held back after the failure"
        await s.drain()

    in_thread(scenario())
    assert len(store.advanced) == 1, store.advanced


def test_a_late_write_never_brings_back_a_deleted_job_nor_moves_a_new_run(tmp_path: Any) -> None:
    """A stream that ended unwritten retries its trainer's last position; it used the stream's own
    write, which re-created a job deleted meanwhile (`ladle jobs --delete --force`) and, the name
    taken by a new run (generation 1 again), moved that run's cursor forward past unread batches."""
    from ladle.service.store import EmbeddedStore, JobSpec

    with EmbeddedStore(tmp_path / "s.db") as store:
        spec = JobSpec("j", "d", "c", 1)
        first = store.open_job(spec)
        generation = store.join("j", 0, 1).generation
        job: Any = SimpleNamespace(
            name="j", store=store, is_stored_as=lambda state: state.incarnation == first.incarnation
        )
        s = RankLease(job, 0, generation, Position(0, 0))
        assert s.store_late(Position(0, 5))
        assert store.get("j").ranks[0].position == Position(0, 5)
        store.delete_job("j")
        assert not s.store_late(Position(0, 9)), "a deleted job came back"
        assert store.list_jobs() == []
        store.open_job(spec)  # a new run under the name: another incarnation, generation 1 again
        assert store.join("j", 0, 1).generation == generation
        store.advance("j", 0, generation, Position(0, 2))
        assert not s.store_late(Position(0, 9)), "an old run's position moved the new run's cursor"
        assert store.get("j").ranks[0].position == Position(0, 2)
