"""Elastic restarts against a real server (docs/product.md guarantee 7).

A DDP job checkpoints, stops and comes back with another world size: every
new rank loads the checkpoint (``elastic=True``), the first one's Open resizes
the job at the checkpoint's position, and the rest of the epoch is re-planned.
Over the epoch every row is delivered once or dropped and reported.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from ladle.client import BatchClient, FencedError, StateDictError
from ladle.service.dataset import open_dataset
from ladle.service.jobs import plan_schedule
from ladle.service.store import EmbeddedStore

from .test_serving import CONFIG, Factory, consume, drain

JOB = "elastic"


def run_world(
    address: str, world: int, state: dict[str, Any] | None, steps: int | None
) -> tuple[list[np.ndarray], dict[str, Any]]:
    """Every rank of a world loads ``state``, takes ``steps`` batches (None: the rest of the epoch)."""
    rows: list[np.ndarray] = []
    clients = [BatchClient(r, world, address, JOB, elastic=True, timeout=30) for r in range(world)]
    try:
        for client in clients:
            if state is not None:
                client.load_state_dict(state)
            rows.extend(b["sample_ids"] for b in consume(client, steps))
        checkpoint = clients[0].state_dict()
        for client in clients[1:]:
            assert client.state_dict()["step"] == checkpoint["step"], "ranks of one world moved apart"
    finally:
        for client in clients:
            client.close()
    return rows, checkpoint


def test_4_then_3_then_6_ranks_deliver_every_row_once(
    server_factory: Factory, small_dataset: Path, tmp_path: Path
) -> None:
    state_db = tmp_path / "elastic.db"
    server = server_factory(state=state_db)
    got, state4 = run_world(server.address, 4, None, 5)
    assert (state4["world_size"], state4["epoch"], state4["step"]) == (4, 0, 5)

    # a trainer of the old world still connected is ended by the resize
    stale = BatchClient(3, 4, server.address, JOB, timeout=30)
    stale.load_state_dict({**state4, "rank": 3})
    it = iter(stale)
    next(it)

    more, state3 = run_world(server.address, 3, state4, 4)
    got += more
    assert state3["world_size"] == 3
    assert state3["schedule_fingerprint"] != state4["schedule_fingerprint"]
    assert (state3["epoch"], state3["step"]) == (0, 4), "the new world starts at step 0 of the re-plan"
    with pytest.raises(FencedError, match="resized"):
        drain(it, 10)  # its window may still hold a few batches sent before the resize
    with pytest.raises(FencedError, match="resized"):  # a fenced process reports no clean end
        stale.close()

    rest, state6 = run_world(server.address, 6, state3, None)
    got += rest
    assert (state6["epoch"], state6["step"]) == (1, 0)

    with EmbeddedStore(state_db) as store:
        plan = store.get(JOB).plan
    assert [r.world_size for r in plan] == [4, 3]
    lengths = open_dataset(small_dataset).lengths
    final = plan_schedule(lengths, CONFIG, 0, 6, plan)
    rows = np.concatenate(got)
    assert len(np.unique(rows)) == len(rows), "a row was delivered twice in the epoch"
    union = np.sort(np.concatenate([rows, final.dropped.rows]))
    assert np.array_equal(union, np.arange(len(lengths))), "a row was lost"

    # the next epoch is an ordinary epoch of the new world
    again, _ = run_world(server.address, 6, None, 2)  # continue at the stored cursors
    assert len(again) == 12


def test_a_world_size_change_without_elastic_is_refused(server_factory: Factory) -> None:
    server = server_factory()
    _, state = run_world(server.address, 2, None, 2)
    client = BatchClient(0, 3, server.address, JOB, timeout=10)
    with pytest.raises(StateDictError, match="elastic=True"):
        client.load_state_dict(state)
    client.close()


def test_a_checkpoint_ahead_of_a_ranks_cursor_is_refused_naming_it(
    server_factory: Factory, small_dataset: Path, tmp_path: Path
) -> None:
    """Trainers stopped at different steps, resumed from rank 0's checkpoint: rank 1's rows were lost.

    Four trainers that do not train in step stop at steps 11, 5, 12 and 9; rank 0 checkpointed
    at step 8. Three ranks resuming from that checkpoint were cut at 8 for every old rank, and
    old rank 1's batches 5-7 (never acknowledged) were served to no one. The resize is refused,
    naming rank 1; started without the checkpoint's position, it is cut at each rank's cursor.
    """
    state_db = tmp_path / "elastic.db"
    server = server_factory(state=state_db)
    got: list[np.ndarray] = []
    checkpoint: dict[str, Any] = {}
    for rank, stop in enumerate((11, 5, 12, 9)):
        with BatchClient(rank, 4, server.address, JOB, timeout=30) as client:
            got += [b["sample_ids"] for b in consume(client, min(stop, 8))]
            if rank == 0:
                checkpoint = client.state_dict()
            got += [b["sample_ids"] for b in consume(client, stop - 8)] if stop > 8 else []
    assert (checkpoint["epoch"], checkpoint["step"]) == (0, 8)

    with BatchClient(0, 3, server.address, JOB, elastic=True, timeout=30) as first:
        first.load_state_dict(checkpoint)
        with pytest.raises(StateDictError) as info:
            consume(first, 1)
    message = str(info.value)
    assert "rank 1 (batches 0:5 up to 0:8)" in message, message
    assert "the job is unchanged" in message, message
    with EmbeddedStore(state_db) as store:
        kept = store.get(JOB)
    assert (kept.spec.world_size, kept.plan) == (4, ()), "the refused resize changed the job"
    assert [r.position.step for r in kept.ranks] == [11, 5, 12, 9]

    # without the checkpoint's position: cut at each rank's stored cursor, every row once
    rest, _ = run_world(server.address, 3, None, None)
    got += rest
    with EmbeddedStore(state_db) as store:
        plan = store.get(JOB).plan
    assert [[p.step for p in r.cut] for r in plan] == [[11, 5, 12, 9]]
    final = plan_schedule(open_dataset(small_dataset).lengths, CONFIG, 0, 3, plan)
    rows = np.concatenate(got)
    assert len(np.unique(rows)) == len(rows), "a row was delivered twice in the epoch"
    union = np.sort(np.concatenate([rows, final.dropped.rows]))
    assert np.array_equal(union, np.arange(len(open_dataset(small_dataset).lengths))), "a row was lost"
