"""``BatchClient(dataset=PATH)``: the dataset served in the trainer's process, the same batches as served.

Every batch of an epoch, for world sizes 1 to 3, is compared byte for byte
with what a real ``ladle serve`` of the same dataset and config sends; the
position is kept in a state file across a client that stops mid-epoch; bad
combinations of arguments are refused in the constructor.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from ladle.client import BatchClient
from ladle.service.schedule import ScheduleConfig
from tests.integration.conftest import ServerProcess

Factory = Callable[..., ServerProcess]
# the served config of tests/integration/conftest.py's SMALL_CONFIG
CONFIG = ScheduleConfig(
    max_seq_len=512, bucket_bounds=(0, 48, 76, 108, 152, 206, 513), token_budget=3072, max_batch_size=16
)
FIELDS = ("input_ids", "loss_mask", "lengths", "sample_ids")


def read_epoch(make: Callable[[int], BatchClient], world: int) -> dict[int, list[dict[str, Any]]]:
    """Every rank's batches of one epoch, the ranks reading at once (threads)."""
    got: dict[int, list[dict[str, Any]]] = {}
    errors: list[BaseException] = []

    def run(rank: int) -> None:
        try:
            with make(rank) as client:
                got[rank] = [
                    {**{f: np.array(getattr(b, f)) for f in FIELDS}, "step": b.step, "bucket": b.bucket}
                    for b in client
                ]
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=180)
    assert not errors, errors
    return got


@pytest.mark.parametrize("world", [1, 2, 3])
def test_in_process_batches_are_the_served_ones_byte_for_byte(
    server_factory: Factory, small_dataset: Path, world: int
) -> None:
    server = server_factory()
    served = read_epoch(lambda r: BatchClient(r, world, server.address, f"served-{world}", timeout=60), world)
    local = read_epoch(
        lambda r: BatchClient(
            r, world, job=f"local-{world}", dataset=small_dataset, config=CONFIG, timeout=60
        ),
        world,
    )
    for rank in range(world):
        assert len(local[rank]) == len(served[rank]) > 0
        for mine, theirs in zip(local[rank], served[rank], strict=True):
            assert (mine["step"], mine["bucket"]) == (theirs["step"], theirs["bucket"])
            for field in FIELDS:
                assert mine[field].dtype == theirs[field].dtype
                assert mine[field].tobytes() == theirs[field].tobytes(), f"rank {rank} {field} differs"


def test_a_state_file_resumes_a_stopped_rank_without_a_checkpoint(
    small_dataset: Path, tmp_path: Path
) -> None:
    state = tmp_path / "rank0.db"
    with BatchClient(0, 1, job="resume", dataset=small_dataset, config=CONFIG, state=state) as client:
        head = [next(iter(client)).sample_ids.tolist() for _ in range(5)]
    with BatchClient(0, 1, job="resume", dataset=small_dataset, config=CONFIG, state=state) as client:
        rest = [b.sample_ids.tolist() for b in client]
    with BatchClient(0, 1, job="whole", dataset=small_dataset, config=CONFIG) as client:
        whole = [b.sample_ids.tolist() for b in client]
    assert head + rest == whole


def test_the_environment_names_the_dataset(small_dataset: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("LADLE_SERVER", raising=False)
    monkeypatch.setenv("LADLE_DATASET", str(small_dataset))
    with BatchClient(0, 1, job="env", config=CONFIG) as client:
        assert client.server.startswith("127.0.0.1:")
        assert len(next(iter(client)).sample_ids) > 0


def test_bad_combinations_are_refused(small_dataset: Path, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="not both"):
        BatchClient(0, 1, "127.0.0.1:1", dataset=small_dataset)
    with pytest.raises(ValueError, match="go with dataset="):
        BatchClient(0, 1, "127.0.0.1:1", config=CONFIG)
    with pytest.raises(ValueError, match="ScheduleConfig"):
        BatchClient(0, 1, dataset=small_dataset, config={"seed": 1})
    with pytest.raises(ValueError, match="rank"):
        BatchClient(2, 2, dataset=small_dataset, config=CONFIG)
    from ladle.service.errors import DatasetNotFoundError

    with pytest.raises(DatasetNotFoundError):
        BatchClient(0, 1, dataset=tmp_path / "nothing", config=CONFIG)
