"""Lightning's DDP (2 CPU processes, gloo) on ``BatchDataset(lockstep=True)``, for test_lightning.

``python lightning_proc.py SERVER JOB OUT MAX_STEPS [CHECKPOINT]``: Lightning's
launcher starts the second rank by running this script again. Each rank
writes ``OUT/rank-R.json``: the (epoch, step) of every batch it trained on.
Without ``CHECKPOINT`` it checkpoints every 5 steps into ``OUT/checkpoints``
(Lightning saves rank 0's loader state only); with one it resumes from it.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import lightning

from ladle.client.torch_data import BatchDataset
from tests.integration.test_lightning import TinyLM


class Ranked(lightning.LightningDataModule):
    """One ``BatchDataset`` a rank, made once Lightning knows the rank."""

    def __init__(self, server: str, job: str) -> None:
        super().__init__()
        self.server, self.job = server, job

    def train_dataloader(self) -> BatchDataset:
        trainer = self.trainer
        assert trainer is not None
        return BatchDataset(
            trainer.global_rank, trainer.world_size, self.server, self.job, timeout=30, lockstep=True
        )


def main() -> None:
    server, job, out, max_steps = sys.argv[1], sys.argv[2], Path(sys.argv[3]), int(sys.argv[4])
    resume = sys.argv[5] if len(sys.argv) > 5 else None
    out.mkdir(parents=True, exist_ok=True)
    checkpoints: list[Any] = []
    if resume is None:
        every5 = lightning.pytorch.callbacks.ModelCheckpoint(
            out / "checkpoints", every_n_train_steps=5, save_top_k=-1
        )
        checkpoints.append(every5)
    trainer = lightning.Trainer(
        accelerator="cpu", devices=2, strategy="ddp", max_steps=max_steps, logger=False,
        enable_progress_bar=False, enable_model_summary=False, callbacks=checkpoints,
        enable_checkpointing=bool(checkpoints), reload_dataloaders_every_n_epochs=1,
    )  # fmt: skip
    model = TinyLM()
    trainer.fit(model, datamodule=Ranked(server, job), ckpt_path=resume)
    (out / f"rank-{trainer.global_rank}.json").write_text(json.dumps(model.seen))


if __name__ == "__main__":
    main()
