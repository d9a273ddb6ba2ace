"""ScheduleSampler, pad_collate and lengths_of: ladle's schedule in a plain DataLoader, no server."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import datasets
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import DataLoader

import ladle
from ladle.client.errors import StateDictError
from ladle.client.sampler import ScheduleSampler, lengths_of, pad_collate
from ladle.service.errors import ConfigError, ScheduleError
from ladle.service.schedule import ScheduleConfig, build_schedule

CONFIG = ScheduleConfig(max_seq_len=256, token_budget=1024, max_batch_size=16, bucket_bounds=(0, 32, 96, 257))
RNG = np.random.default_rng(7)
LENGTHS = RNG.integers(1, 300, size=600)


class Rows(torch.utils.data.Dataset[dict[str, Any]]):
    """Row i: ``input_ids`` of ``lengths[i]`` tokens (i's own value), ``labels`` -100 on the first half."""

    def __init__(self, lengths: np.ndarray) -> None:
        self.lengths = lengths

    def __len__(self) -> int:
        return len(self.lengths)

    def __getitem__(self, i: int) -> dict[str, Any]:
        n = int(self.lengths[i])
        ids = [i + 1] * n
        return {"input_ids": ids, "labels": [-100] * (n // 2) + ids[n // 2 :]}


def test_ladle_exports_the_in_process_names() -> None:
    assert ladle.ScheduleSampler is ScheduleSampler
    assert ladle.pad_collate is pad_collate
    assert ladle.lengths_of is lengths_of


@pytest.mark.parametrize("world", [1, 2, 3])
def test_each_rank_gets_the_schedule_and_the_ranks_every_row_once(world: int) -> None:
    sched = build_schedule(LENGTHS, CONFIG, epoch=0, world_size=world)
    seen: list[int] = []
    for rank in range(world):
        sampler = ScheduleSampler(LENGTHS, CONFIG, rank=rank, world_size=world)
        batches = list(sampler)
        assert len(batches) == len(sampler) == sched.num_steps  # equal steps on every rank
        for step, rows in enumerate(batches):
            assert rows == sched.samples(step, rank).tolist()
        seen += [r for rows in batches for r in rows]
    assert sorted(seen) == sorted(sched.scheduled_rows().tolist())
    assert len(seen) == len(set(seen))


def test_epochs_follow_one_another_and_set_epoch_keeps_the_one_in_progress() -> None:
    sampler = ScheduleSampler(LENGTHS, CONFIG, rank=0, world_size=2)
    first = list(sampler)
    second = list(sampler)  # the epoch ran to its end: the next one
    assert sampler.epoch == 1
    assert second == [build_schedule(LENGTHS, CONFIG, epoch=1, world_size=2).samples(s, 0).tolist()
                      for s in range(len(second))]  # fmt: skip
    assert first != second
    sampler.set_epoch(3)
    head = [next(iter(sampler))]
    sampler.set_epoch(3)  # the epoch in progress: a no-op (a resumed loop calls it at its top)
    rest = list(sampler)
    assert head + rest == [build_schedule(LENGTHS, CONFIG, epoch=3, world_size=2).samples(s, 0).tolist()
                           for s in range(len(sampler))]  # fmt: skip


@given(taken=st.integers(0, 40), epoch=st.integers(0, 3), world=st.integers(1, 3), data=st.data())
@settings(max_examples=30, deadline=None)
def test_property_a_resumed_sampler_continues_exactly(taken: int, epoch: int, world: int, data: Any) -> None:
    rank = data.draw(st.integers(0, world - 1))
    sampler = ScheduleSampler(LENGTHS, CONFIG, rank=rank, world_size=world, epoch=epoch)
    whole = list(ScheduleSampler(LENGTHS, CONFIG, rank=rank, world_size=world, epoch=epoch))
    taken = min(taken, len(whole))
    it = iter(sampler)
    head = [next(it) for _ in range(taken)]
    state = json.loads(json.dumps(sampler.state_dict()))  # a checkpoint is plain data
    again = ScheduleSampler(LENGTHS, CONFIG, rank=rank, world_size=world)
    again.load_state_dict(state)
    rest = list(again)
    if taken < len(whole):
        assert head + rest == whole
    else:  # saved at the epoch's end: the resumed sampler goes on with the next epoch
        assert again.epoch == epoch + 1
        assert rest == list(ScheduleSampler(LENGTHS, CONFIG, rank=rank, world_size=world, epoch=epoch + 1))


def test_states_of_another_sampler_are_refused() -> None:
    sampler = ScheduleSampler(LENGTHS, CONFIG, rank=1, world_size=2)
    state = sampler.state_dict()
    others = {
        "schedule config": ScheduleSampler(LENGTHS, CONFIG.replace(seed=1), rank=1, world_size=2),
        "dataset": ScheduleSampler(LENGTHS + 1, CONFIG, rank=1, world_size=2),
        "world size": ScheduleSampler(LENGTHS, CONFIG, rank=1, world_size=3),
        "rank": ScheduleSampler(LENGTHS, CONFIG, rank=0, world_size=2),
    }
    for what, other in others.items():
        with pytest.raises(StateDictError, match=f"another {what}"):
            other.load_state_dict(state)
    with pytest.raises(StateDictError, match="lacks"):
        sampler.load_state_dict({"epoch": 0})
    with pytest.raises(StateDictError, match="must be a mapping"):
        sampler.load_state_dict([1, 2])  # type: ignore[arg-type]
    with pytest.raises(StateDictError, match="past epoch"):
        sampler.load_state_dict({**state, "step": 10**6})
    with pytest.raises(StateDictError, match="integers >= 0"):
        sampler.load_state_dict({**state, "step": -1})


@pytest.mark.parametrize(
    ("lengths", "kwargs", "error", "match"),
    [
        (np.ones((3, 2), dtype=np.int64), {}, ScheduleError, "1-D"),
        (np.array([3, -1, 2]), {}, ScheduleError, "non-positive"),
        (np.array([1.5, 2.0]), {}, ScheduleError, "integers"),
        (LENGTHS, {"rank": 2, "world_size": 2}, ConfigError, "rank"),
        (LENGTHS, {"rank": 0, "world_size": 0}, ConfigError, "world_size"),
        (LENGTHS, {"rank": 0, "world_size": 1, "config": {"seed": 1}}, ConfigError, "ScheduleConfig"),
    ],
)
def test_bad_input_gets_typed_errors(lengths: Any, kwargs: dict[str, Any], error: type, match: str) -> None:
    config = kwargs.pop("config", CONFIG)
    with pytest.raises(error, match=match):
        ScheduleSampler(lengths, config, **{"rank": 0, "world_size": 1, **kwargs})


def test_rank_and_world_size_come_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RANK", "2")
    monkeypatch.setenv("WORLD_SIZE", "3")
    sampler = ScheduleSampler(LENGTHS, CONFIG)
    assert (sampler.rank, sampler.world_size) == (2, 3)


@pytest.mark.parametrize("workers", [0, 2])
def test_a_dataloader_makes_the_served_widths_and_masks(workers: int) -> None:
    sampler = ScheduleSampler(LENGTHS, CONFIG, rank=0, world_size=2)
    loader = DataLoader(
        Rows(LENGTHS), batch_sampler=sampler, collate_fn=sampler.collate(pad_id=0), num_workers=workers
    )
    for step, batch in enumerate(loader):
        rows = sampler.schedule.samples(step, 0)
        assert batch["input_ids"].shape == (len(rows), sampler.padded_len(step))
        for i, row in enumerate(rows.tolist()):
            n = min(int(LENGTHS[row]), CONFIG.max_seq_len)
            assert batch["input_ids"][i, :n].tolist() == [row + 1] * n
            assert batch["attention_mask"][i].sum() == n
            assert batch["loss_mask"][i].tolist() == [0] * (int(LENGTHS[row]) // 2) + [1] * (
                n - int(LENGTHS[row]) // 2
            ) + [0] * (batch["input_ids"].shape[1] - n)
            assert (batch["labels"][i][batch["loss_mask"][i] == 0] == -100).all()
    assert step == len(sampler) - 1


def test_pad_collate_without_a_mask_column_trains_every_token() -> None:
    batch = pad_collate(pad_id=9, pad_to_multiple_of=4, with_loss_mask=False)(
        [{"input_ids": [1, 2, 3]}, {"input_ids": [4]}]
    )
    assert batch["input_ids"].tolist() == [[1, 2, 3, 9], [4, 9, 9, 9]]
    assert batch["labels"].tolist() == [[1, 2, 3, -100], [4, -100, -100, -100]]
    assert set(batch) == {"input_ids", "attention_mask", "labels"}


def test_lengths_of_reads_the_arrow_offsets(tmp_path: Path) -> None:
    rows = [[1, 2, 3], [4], [5, 6]]
    ds = datasets.Dataset.from_dict({"input_ids": rows, "text": ["a", "b", "c"]})
    assert lengths_of(ds).tolist() == [3, 1, 2]
    assert lengths_of(ds.select([2, 0])).tolist() == [2, 3]  # an indices mapping: row by row
    assert lengths_of({"input_ids": rows}).tolist() == [3, 1, 2]


RESUMABLE = textwrap.dedent(
    """
    import json, os, sys, time
    import numpy as np
    from torchdata.stateful_dataloader import StatefulDataLoader
    from ladle.client.sampler import ScheduleSampler
    from ladle.service.schedule import ScheduleConfig
    sys.path.insert(0, os.environ["TESTS_ROOT"])
    from tests.unit.test_sampler import CONFIG, LENGTHS, Rows

    log, state_file, stop_after = sys.argv[1], sys.argv[2], int(sys.argv[3])
    sampler = ScheduleSampler(LENGTHS, CONFIG, rank=1, world_size=2)
    loader = StatefulDataLoader(
        Rows(LENGTHS), batch_sampler=sampler, collate_fn=sampler.collate(), num_workers=2
    )
    if os.path.exists(state_file):
        with open(state_file) as f:
            loader.load_state_dict(json.load(f))
    with open(log, "a") as out:
        for n, batch in enumerate(loader, 1):
            rows = (batch["input_ids"][:, 0] - 1).tolist()  # row i holds the token i + 1
            out.write(json.dumps(rows) + "\\n")
            out.flush()
            with open(state_file + ".tmp", "w") as f:
                json.dump(loader.state_dict(), f)
            os.replace(state_file + ".tmp", state_file)  # a checkpoint after each step
            if n == stop_after:
                print("ready", flush=True)
                time.sleep(600)  # killed here, mid-epoch, workers still prefetching
    """
)


def test_a_stateful_dataloader_killed_mid_epoch_resumes_exactly(tmp_path: Path) -> None:
    pytest.importorskip("torchdata.stateful_dataloader")
    script = tmp_path / "train.py"
    script.write_text(RESUMABLE)
    log, state = tmp_path / "rows.jsonl", tmp_path / "state.json"
    env = {**os.environ, "TESTS_ROOT": str(Path(__file__).resolve().parents[2])}
    first = subprocess.Popen(
        [sys.executable, str(script), str(log), str(state), "7"], stdout=subprocess.PIPE, env=env, text=True
    )
    try:
        assert first.stdout is not None
        assert first.stdout.readline().strip() == "ready"
        first.send_signal(signal.SIGKILL)  # kill -9 mid-epoch: no shutdown, workers orphaned
        first.wait(timeout=30)
    finally:
        if first.poll() is None:
            first.kill()
    time.sleep(0.2)
    done = subprocess.run(
        [sys.executable, str(script), str(log), str(state), "0"],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    served = [json.loads(line) for line in log.read_text().splitlines()]
    expected = list(ScheduleSampler(LENGTHS, CONFIG, rank=1, world_size=2))
    assert served == expected  # no batch lost, none repeated, in order


DISTRIBUTED = textwrap.dedent(
    """
    import json, sys
    import torch.distributed as dist
    from ladle.client.sampler import ScheduleSampler
    import numpy as np
    rank, world, init, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    lengths = (np.arange(500) * 37) % 300 + 1
    sampler = ScheduleSampler(lengths)  # rank and world size from torch.distributed
    with open(out, "w") as f:
        json.dump({"rank": sampler.rank, "world": sampler.world_size, "batches": list(sampler)}, f)
    dist.destroy_process_group()
    """
)


def test_two_ranks_under_torch_distributed_split_the_epoch(tmp_path: Path) -> None:
    script = tmp_path / "rank.py"
    script.write_text(DISTRIBUTED)
    init = f"file://{tmp_path / 'rendezvous'}"
    procs = [
        subprocess.Popen([sys.executable, str(script), str(r), "2", init, str(tmp_path / f"{r}.json")])
        for r in range(2)
    ]
    for proc in procs:
        assert proc.wait(timeout=120) == 0
    results = [json.loads((tmp_path / f"{r}.json").read_text()) for r in range(2)]
    assert [(r["rank"], r["world"]) for r in results] == [(0, 2), (1, 2)]
    lengths = (np.arange(500) * 37) % 300 + 1
    sched = build_schedule(lengths, ScheduleConfig(), world_size=2)
    for r in results:
        assert r["batches"] == [sched.samples(s, r["rank"]).tolist() for s in range(sched.num_steps)]
