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
