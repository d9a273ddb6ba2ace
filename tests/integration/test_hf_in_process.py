"""``LadleTrainer(train_dataset=ds)``: Hugging Face's Trainer on ladle's schedule with no server.

Every batch a training step took is compared, by a digest of its
``input_ids``, with ``ScheduleSampler``'s batches of the same dataset padded
by ``pad_collate``: across two epochs (Trainer's epochs are epoch 0's
length; the seams lose none) and across a resume from a checkpoint (the same
batches and losses as an uninterrupted run).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

import datasets

from ladle.client.hf import state_file
from ladle.client.sampler import ScheduleSampler, lengths_of, pad_collate
from ladle.service.synth import make_dataset
from tests.integration import hf_trainer_proc
from tests.integration.hf_trainer_proc import VOCAB, digest, run
from tests.support.session import run_in_session

PROC = Path(hf_trainer_proc.__file__)


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("hf-local") / "ds"
    make_dataset(out, 300, seed=5, scale=1 / 16, vocab_size=VOCAB)
    return out


@pytest.fixture(scope="module")
def dataset(saved: Path) -> Any:
    return datasets.load_from_disk(str(saved))


def reference(ds: Any, batches: int, rank: int = 0, world: int = 1) -> list[str]:
    """The first ``batches`` of the rank's in-process stream across epochs, as digests."""
    sampler = ScheduleSampler(lengths_of(ds), rank=rank, world_size=world)
    collate = sampler.collate(0, with_loss_mask=False)
    got: list[str] = []
    while len(got) < batches:
        for rows in sampler:
            got.append(digest(collate([ds[int(i)] for i in rows])["input_ids"]))
            if len(got) == batches:
                break
    return got


def trained(out: Path, rank: int = 0) -> list[str]:
    return [json.loads(line)["digest"] for line in (out / f"rank-{rank}.jsonl").read_text().splitlines()]


def test_two_epochs_in_process_train_on_the_samplers_batches(dataset: Any, tmp_path: Path) -> None:
    result = run("", "local", tmp_path, epochs=2, train_dataset=dataset)
    length = result["length"]
    assert length > 3
    assert trained(tmp_path) == reference(dataset, 2 * length)
    assert result["state"]["epoch"] >= 1, "the second epoch was not reached"


def test_an_in_process_resume_trains_as_an_uninterrupted_run(dataset: Any, tmp_path: Path) -> None:
    whole = run("", "local", tmp_path / "whole", max_steps=8, save_steps=3, train_dataset=dataset)
    checkpoint = tmp_path / "whole" / "checkpoints" / "checkpoint-3"
    assert json.loads(state_file(checkpoint, 0).read_text())["step"] == 3
    resumed = run(
        "", "local", tmp_path / "resumed", max_steps=8, resume=str(checkpoint), train_dataset=dataset
    )
    assert trained(tmp_path / "resumed") == trained(tmp_path / "whole")[3:]
    for step in range(4, 9):
        assert resumed["losses"][str(step)] == pytest.approx(whole["losses"][str(step)], rel=1e-4), step
    assert resumed["state"] == whole["state"]


def test_pad_collate_pads_with_the_tokenizers_pad_id() -> None:
    batch = pad_collate(7, with_loss_mask=False)([{"input_ids": [1, 2]}, {"input_ids": [3]}])
    assert batch["input_ids"].tolist() == [[1, 2], [3, 7]]


def test_two_ddp_ranks_under_torchrun_in_process_train_on_their_batches_and_resume(
    saved: Path, dataset: Any, tmp_path: Path
) -> None:
    def torchrun(out: Path, *args: str) -> None:
        cmd = [
            sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
            str(PROC), "-", "-", str(out), "--dataset", str(saved), *args,
        ]  # fmt: skip
        code, output = run_in_session(cmd, timeout=240)
        assert code == 0, output[-4000:]

    torchrun(tmp_path / "whole", "--max-steps", "5", "--save-steps", "2")
    checkpoint = tmp_path / "whole" / "checkpoints" / "checkpoint-2"
    torchrun(tmp_path / "resumed", "--max-steps", "5", "--resume", str(checkpoint))
    for rank in range(2):
        expected = reference(dataset, 5, rank, 2)
        assert trained(tmp_path / "whole", rank) == expected, f"rank {rank}: other batches than its own"
        assert trained(tmp_path / "resumed", rank) == expected[2:], f"rank {rank}: the resume is not exact"
        position = json.loads(state_file(checkpoint, rank).read_text())
        assert (position["rank"], position["world_size"], position["step"]) == (rank, 2, 2)
