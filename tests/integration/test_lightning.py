"""Lightning's ``Trainer`` on ``BatchDataset`` passed as the train loader, against a real server.

Lightning moves each ``Batch`` with ``batch.to(device)``, saves the loader's
``state_dict()`` in its checkpoints (``BatchDataset`` has one) and loads it
on ``fit(ckpt_path=...)``; with the loader's ``len`` known it reads no batch
ahead, so the position saved is the last batch trained.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch")
pytest.importorskip("lightning")

import lightning
import torch

from ladle.client import Batch, BatchClient
from ladle.client.torch_data import BatchDataset
from ladle.service.synth import make_dataset
from tests.support.session import run_in_session

pytestmark = [
    # lightning 2.6 on torch 2.13, and the resumed runs' choice to write no checkpoints of their own
    pytest.mark.filterwarnings(r"ignore:`isinstance\(treespec, LeafSpec\)` is deprecated:FutureWarning"),
    pytest.mark.filterwarnings("ignore:Be aware that when using `ckpt_path`:UserWarning"),
]


class TinyLM(lightning.LightningModule):
    """Notes the (epoch, step) of every batch it trains on, and Lightning's epoch for each."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(256, 8)
        self.head = torch.nn.Linear(8, 256)
        self.seen: list[tuple[int, int]] = []
        self.lightning_epochs: list[int] = []

    def training_step(self, batch: Batch, index: int) -> Any:
        assert isinstance(batch.input_ids, torch.Tensor)
        self.seen.append((batch.epoch, batch.step))
        self.lightning_epochs.append(self.current_epoch)
        ids = batch.input_ids.long()
        logits = self.head(self.embed(ids))
        labels = ids.masked_fill(batch.attention_mask == 0, -100)
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1)


@pytest.fixture(scope="module")
def dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("lightning-ds") / "ds"
    make_dataset(out, 300, seed=5, scale=1 / 16, vocab_size=256)
    return out


@pytest.fixture
def server(server_factory: Callable[..., Any], dataset: Path) -> Any:
    return server_factory(dataset=dataset)


def fit(
    server: Any, job: str, checkpoints: Path | None = None, resume: Path | None = None, **kwargs: Any
) -> TinyLM:
    # len(data) asked at each epoch's start (reload_dataloaders_every_n_epochs=1), as docs/serving.md
    # says to, unless a test asks otherwise
    callbacks: list[Any] = []
    if checkpoints is not None:
        callbacks.append(
            lightning.pytorch.callbacks.ModelCheckpoint(
                dirpath=checkpoints, every_n_train_steps=5, save_top_k=-1
            )
        )
    trainer = lightning.Trainer(
        accelerator="cpu", devices=1, logger=False, enable_progress_bar=False, enable_model_summary=False,
        callbacks=callbacks, enable_checkpointing=checkpoints is not None,
        **{"reload_dataloaders_every_n_epochs": 1, **kwargs},
    )  # fmt: skip
    model = TinyLM()
    data = BatchDataset(0, 1, server.address, job, timeout=30, device="cpu")
    trainer.fit(model, train_dataloaders=data, ckpt_path=resume)
    data.close()
    return model


def epochs(server: Any, count: int) -> list[tuple[int, int]]:
    with BatchClient(0, 1, server.address, "reference", timeout=30) as client:
        return [(e, s) for e in range(count) for s in range(client.steps_in_epoch(e))]


def test_two_epochs_are_ladle_epochs(server: Any) -> None:
    model = fit(server, "epochs", max_epochs=2)
    assert model.seen == epochs(server, 2), "Lightning trained on other batches than two ladle epochs"


def uneven(server_factory: Callable[..., Any], dataset: Path) -> tuple[Any, list[int]]:
    """A server whose first 3 epochs differ in length (rows sorted in small chunks pack differently)."""
    server = server_factory(dataset=dataset, extra=["--sort-chunk", "32"])
    with BatchClient(0, 1, server.address, "lengths", timeout=30) as client:
        return server, [client.steps_in_epoch(e) for e in range(3)]


def test_epochs_of_other_lengths_are_each_one_lightning_epoch(
    server_factory: Callable[..., Any], dataset: Path
) -> None:
    """With ``len`` asked at each epoch's start, an epoch longer than the first is one Lightning epoch."""
    server, lengths = uneven(server_factory, dataset)
    assert lengths[2] > lengths[0], lengths  # the case under test: a later epoch longer than the first
    model = fit(server, "uneven", max_epochs=3)
    assert model.seen == epochs(server, 3), "Lightning trained on other batches than three ladle epochs"
    assert model.lightning_epochs == [e for e, _ in model.seen], "a Lightning epoch was not one ladle epoch"


def test_without_reloading_a_longer_later_epoch_spills_into_the_next(
    server_factory: Callable[..., Any], dataset: Path
) -> None:
    """``reload_dataloaders_every_n_epochs=0`` keeps the first epoch's ``len``: what docs/serving.md says."""
    server, lengths = uneven(server_factory, dataset)
    assert lengths[2] > lengths[0], lengths  # the case under test: a later epoch longer than the first
    model = fit(server, "spill", max_epochs=4, reload_dataloaders_every_n_epochs=0)
    assert model.seen == epochs(server, 4)[: len(model.seen)], "a batch was skipped or repeated"
    assert model.seen[-1] == (2, lengths[2] - 1), "the run did not end with the long epoch's last batch"
    pairs = zip(model.lightning_epochs, (ladle for ladle, _ in model.seen), strict=True)
    spilled = [(lightning, ladle) for lightning, ladle in pairs if lightning != ladle]
    assert spilled == [(3, 2)] * (lengths[2] - lengths[0]), "the long epoch's rest did not open the next"


def test_a_resume_from_a_checkpoint_in_an_epoch_goes_on_exactly(server: Any, tmp_path: Path) -> None:
    whole = fit(server, "resume", tmp_path / "checkpoints", max_steps=30)
    assert whole.seen == epochs(server, 2)[:30]
    resumed = fit(server, "resume", resume=tmp_path / "checkpoints" / "epoch=0-step=10.ckpt", max_steps=30)
    assert resumed.seen == whole.seen[10:], "the resumed run did not go on where the checkpoint was"


def ddp(server: Any, out: Path, *args: str) -> list[list[tuple[int, int]]]:
    """Lightning's DDP on 2 CPU processes (``lightning_proc.py``); each rank's (epoch, step) trained."""
    script = Path(__file__).with_name("lightning_proc.py")
    root = Path(__file__).resolve().parents[2]
    cmd = ["env", f"PYTHONPATH={root}", sys.executable, str(script), server.address, "ddp", str(out), *args]
    code, output = run_in_session(cmd, timeout=240)
    assert code == 0, f"Lightning's DDP failed:\n{output[-4000:]}"
    return [[tuple(s) for s in json.loads((out / f"rank-{r}.json").read_text())] for r in range(2)]


def test_ddp_ranks_resume_from_the_one_loader_state_lightning_saves(server: Any, tmp_path: Path) -> None:
    """Lightning keeps rank 0's loader state only: with lockstep=True every rank resumes from it."""
    whole = ddp(server, tmp_path / "whole", "12")
    assert whole[0] == whole[1] == [(0, s) for s in range(12)]
    resumed = ddp(
        server, tmp_path / "resumed", "12", str(tmp_path / "whole" / "checkpoints" / "epoch=0-step=5.ckpt")
    )
    assert resumed == [steps[5:] for steps in whole], "the ranks did not go on where the checkpoint was"
