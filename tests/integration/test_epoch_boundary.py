"""At an epoch's end no trainer waits for the next schedule: the server has built it before.

A real ``ladle serve`` and ``BatchClient``; the server's gauge of the
schedules it holds (``ladle_schedules_cached``) says when the next epoch's is
built. A trainer that reads an epoch from its start, and one that resumes past
its middle on a restarted server (its first batch there is near the end), must
both find it built while the server's stream is still in the epoch (a window
of one batch: the stream never sends ahead into the next epoch, whose first
batch would build it): were it built only when asked, the boundary ``next()``
would wait a whole build (tens of seconds at 10^8 rows).
"""

from __future__ import annotations

import time
import urllib.request
from pathlib import Path

from ladle.client import BatchClient

from .conftest import ServerProcess
from .test_serving import Factory, reference

BUILT_WITHIN_S = 30.0


def schedules_held(server: ServerProcess) -> float:
    with urllib.request.urlopen(server.http_url + "/metrics", timeout=30) as response:
        for line in response.read().decode().splitlines():
            if line.startswith("ladle_schedules_cached "):
                return float(line.split()[-1])
    raise AssertionError("no ladle_schedules_cached gauge in /metrics")


def wait_for_schedules(server: ServerProcess, count: int) -> float:
    """The gauge once it reaches ``count`` (or its value after ``BUILT_WITHIN_S``)."""
    deadline = time.monotonic() + BUILT_WITHIN_S
    held = schedules_held(server)
    while held < count and time.monotonic() < deadline:
        time.sleep(0.05)
        held = schedules_held(server)
    return held


def test_the_next_epoch_is_built_before_a_trainer_reaches_its_boundary(
    server_factory: Factory, small_dataset: Path
) -> None:
    server = server_factory()
    steps = reference(small_dataset, 1).num_steps
    with BatchClient(0, 1, server.address, "boundary", timeout=30, prefetch=1) as client:
        it = iter(client)
        for _ in range(steps - 2):
            next(it)  # the stream has sent at most the epoch's last batch
        # epoch 0 (the stream's) and epoch 1, prepared while it was read; no start-up schedule besides
        assert wait_for_schedules(server, 2) == 2, "epoch 1 was not built before the end of epoch 0"
        assert next(it).step == steps - 2
        last = next(it)
        assert (last.epoch, last.step) == (0, steps - 1)
        assert next(it, None) is None
        first = next(iter(client))
        assert (first.epoch, first.step) == (1, 0)


def test_a_trainer_resumed_past_the_middle_on_a_new_server_finds_the_next_epoch_built(
    server_factory: Factory, small_dataset: Path, tmp_path: Path
) -> None:
    steps = reference(small_dataset, 1).num_steps
    first = server_factory()
    with BatchClient(0, 1, first.address, "resumed", timeout=30) as client:
        it = iter(client)
        for _ in range(steps - 3):
            next(it)
        state = client.state_dict()
    first.kill()
    second = server_factory(state=tmp_path / "second.db")  # a new server and store: nothing cached
    with BatchClient(0, 1, second.address, "resumed", timeout=30, prefetch=1) as client:
        client.load_state_dict(state)
        it = iter(client)
        batch = next(it)
        assert (batch.epoch, batch.step) == (0, steps - 3), "not resumed where the checkpoint was"
        assert wait_for_schedules(second, 2) == 2, "a stream resumed past the middle left epoch 1 unbuilt"
        assert [b.step for b in it] == [steps - 2, steps - 1]
