"""A rank lease (``JobRegistry.attach``): what an Open costs the store, and what the lease does with it."""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from ladle.service.errors import FencedError, WorldSizeMismatchError
from ladle.service.jobs import JobRegistry
from ladle.service.lease import Claim, RankLease, StreamAbortedError
from ladle.service.schedule import ScheduleConfig
from ladle.service.start import Resume
from ladle.service.store import EmbeddedStore
from ladle.service.store.base import CursorStore, Position

CONFIG = ScheduleConfig(max_seq_len=128, bucket_bounds=(0, 32, 129), token_budget=512)
# the store contract's public operations (tests/contract/store_contract.py)
OPERATIONS = (
    "open_job",
    "join",
    "advance",
    "rewind",
    "resize",
    "reconcile",
    "get",
    "list_jobs",
    "delete_job",
)


class CountingStore:
    """An embedded store that records every operation of the store contract called on it."""

    def __init__(self, store: CursorStore) -> None:
        self.store = store
        self.calls: list[str] = []

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self.store, name)
        if name not in OPERATIONS:
            return attr

        def counted(*args: Any, **kwargs: Any) -> Any:
            self.calls.append(name)
            return attr(*args, **kwargs)

        return counted


@pytest.fixture
def store(tmp_path: Path) -> EmbeddedStore:
    return EmbeddedStore(tmp_path / "state.db")


@pytest.fixture
def server(tmp_path: Path, store: EmbeddedStore) -> Callable[[], tuple[JobRegistry, CountingStore]]:
    """A fresh server (a registry that knows no job) on the one store, counting its store operations."""
    lengths = (np.arange(4000, dtype=np.int64) * 37) % 128 + 1
    dataset = SimpleNamespace(lengths=lengths, fingerprint="ds", path=str(tmp_path), num_rows=len(lengths))

    def fresh() -> tuple[JobRegistry, CountingStore]:
        counting = CountingStore(store)
        return JobRegistry(dataset, CONFIG, counting), counting  # type: ignore[arg-type]

    return fresh


def attach(registry: JobRegistry, counting: CountingStore, claim: Claim) -> tuple[RankLease, list[str]]:
    counting.calls.clear()
    lease = registry.attach(claim)
    return lease, list(counting.calls)


def test_an_open_costs_at_most_three_store_operations(
    server: Callable[[], tuple[JobRegistry, CountingStore]], store: EmbeddedStore
) -> None:
    """Main made 4 for a fresh job, 3 and 4 for a rank rejoining, 5 for a fresh server resuming from a
    checkpoint, 6 and 7 for an elastic resize."""
    registry, counting = server()
    lease, calls = attach(registry, counting, Claim("j", 0, 2))
    assert calls == ["get", "open_job", "join"], "a fresh job"
    assert (lease.generation, lease.start, lease.stored) == (1, Position(0, 0), Position(0, 0))
    store.advance("j", 0, lease.generation, Position(0, 3))
    fingerprint = lease.job.fingerprint

    lease, calls = attach(registry, counting, Claim("j", 0, 2))
    assert calls == ["get", "join"], "a rank rejoining with its stored cursor"
    assert (lease.generation, lease.start) == (2, Position(0, 3))

    registry, counting = server()
    lease, calls = attach(registry, counting, Claim("j", 0, 2))
    assert calls == ["get", "join"], "a rank rejoining a fresh server"

    registry, counting = server()
    claim = Claim("j", 1, 2, start=Position(0, 2), fingerprint=fingerprint)
    lease, calls = attach(registry, counting, claim)
    assert calls == ["get", "join", "rewind"], "a fresh server resuming from a checkpoint"
    assert lease.start == lease.stored == Position(0, 2)

    registry, counting = server()
    lease, calls = attach(registry, counting, Claim("j", 0, 3, elastic=True))
    assert calls == ["get", "resize", "join"], "an elastic resize"
    assert lease.job.world_size == 3
    store.advance("j", 0, lease.generation, Position(0, 1))

    registry, counting = server()
    claim = Claim("j", 0, 2, start=lease.start, fingerprint=lease.job.fingerprint, elastic=True)
    lease, calls = attach(registry, counting, claim)
    assert calls == ["get", "resize", "join"], "an elastic resize from a checkpoint at the cut"
    assert lease.job.world_size == 2


def test_refusals_come_before_the_join(
    server: Callable[[], tuple[JobRegistry, CountingStore]], store: EmbeddedStore
) -> None:
    registry, counting = server()
    running = registry.attach(Claim("j", 0, 2))
    with pytest.raises(WorldSizeMismatchError):
        attach(registry, counting, Claim("j", 0, 3))
    with pytest.raises(StreamAbortedError, match="expects schedule") as refused:
        attach(registry, counting, Claim("j", 0, 2, start=Position(0, 1), fingerprint="0123456789abcdef"))
    assert (refused.value.kind, refused.value.reason) == ("failed_precondition", "schedule_mismatch")
    assert "join" not in counting.calls
    assert store.get("j").ranks[0].generation == running.generation, "a refused Open fenced the rank"


def test_a_resume_claim_that_cannot_be_stored_is_refused(
    server: Callable[[], tuple[JobRegistry, CountingStore]],
) -> None:
    registry, _ = server()
    registry.attach(Claim("j", 0, 1))
    with pytest.raises(StreamAbortedError, match="must be below") as refused:
        registry.attach(Claim("j", 0, 1, resume=Resume(2**31 + 5)))
    assert (refused.value.reason, refused.value.field) == ("bad_resume", "open.resume.generation")


def test_the_lease_moves_the_cursor_and_gives_back_what_a_store_lost(
    server: Callable[[], tuple[JobRegistry, CountingStore]],
    store: EmbeddedStore,
    caplog: pytest.LogCaptureFixture,
) -> None:
    registry, _ = server()
    lease = registry.attach(Claim("j", 0, 1))
    lease.advance(Position(0, 4))
    assert store.get("j").ranks[0].position == Position(0, 4)
    store.delete_job("j")  # lost by the store: the live trainer's position comes back
    with caplog.at_level(logging.WARNING, "ladle.server"):
        lease.advance(Position(0, 6))
    assert "lost recent writes" in caplog.text
    rank = store.get("j").ranks[0]
    assert (rank.position, rank.generation) == (Position(0, 6), lease.generation)


def test_a_replaced_lease_is_fenced_and_says_why(
    server: Callable[[], tuple[JobRegistry, CountingStore]], store: EmbeddedStore
) -> None:
    registry, _ = server()
    old = registry.attach(Claim("j", 0, 2))
    new = registry.attach(Claim("j", 0, 2))
    with pytest.raises(StreamAbortedError, match="replaced by a newer trainer process") as fenced:
        old.advance(Position(0, 1))
    assert (fenced.value.kind, fenced.value.reason) == ("failed_precondition", "fenced")
    assert not old.store_late(Position(0, 1))
    new.advance(Position(0, 2))
    resized = registry.attach(Claim("j", 0, 3, elastic=True))
    assert "resized to 3 ranks" in str(new.fenced(resized.job))
    assert "resized to 3 ranks" in str(new.fenced())
    with pytest.raises(FencedError):
        store.advance("j", 0, new.generation, Position(0, 3))
