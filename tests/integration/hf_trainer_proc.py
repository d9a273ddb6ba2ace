"""A Hugging Face ``Trainer`` run on ladle's batches, for the LadleTrainer tests.

``python hf_trainer_proc.py SERVER|env JOB OUT [--max-steps N | --epochs E] [--accumulate A]
[--save-steps S] [--resume PATH|last] [--elastic] [--dataset PATH]``, alone or under ``torchrun``
(one process a rank).

A tiny Llama made from a config (nothing downloaded) trains on CPU; each
rank writes ``OUT/rank-R.jsonl``, one line per batch it trained on (a digest
of its ``input_ids``, its shape, ``Trainer``'s global step), and
``OUT/rank-R.result.json``: the losses ``Trainer`` logged and the client's
final ``state_dict()``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
from pathlib import Path
from typing import Any

import torch
from transformers import LlamaConfig, LlamaForCausalLM, TrainingArguments

from ladle.client import BatchClient
from ladle.client.hf import LadleTrainer

VOCAB = 256  # the test dataset's tokens are in [1, VOCAB)


def digest(input_ids: torch.Tensor) -> str:
    return hashlib.sha1(input_ids.contiguous().numpy().tobytes()).hexdigest()[:16]


class RecordingTrainer(LadleTrainer):
    """Notes every batch a training step takes, before training on it."""

    def __init__(self, *args: Any, record: Path, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.record = record.open("a", encoding="utf-8")

    def training_step(self, model: Any, inputs: dict[str, Any], num_items_in_batch: Any = None) -> Any:
        ids = inputs["input_ids"]
        line = {"digest": digest(ids.cpu()), "shape": list(ids.shape), "global_step": self.state.global_step}
        self.record.write(json.dumps(line) + "\n")
        self.record.flush()
        return super().training_step(model, inputs, num_items_in_batch)


def run(
    server: str,
    job: str,
    out: Path,
    *,
    max_steps: int = -1,
    epochs: float = 1.0,
    accumulate: int = 1,
    save_steps: int = 0,
    resume: str | None = None,
    ignore_data_skip: bool = False,
    elastic: bool = False,
    cuda: bool = False,
    train_dataset: Any = None,
) -> dict[str, Any]:
    """One rank's run; ``cuda``: on the GPU in bf16 (the client's batches on ``args.device``).

    ``train_dataset``: no server (``server`` is ignored): the dataset batched in this process.
    """
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=512,
    )  # fmt: skip
    args = TrainingArguments(
        output_dir=str(out / "checkpoints"), max_steps=max_steps, num_train_epochs=epochs,
        gradient_accumulation_steps=accumulate, learning_rate=1e-3, logging_steps=1,
        save_strategy="steps" if save_steps else "no", save_steps=save_steps or 500,
        use_cpu=not cuda, bf16=cuda, ddp_backend="gloo" if "LOCAL_RANK" in os.environ else None,
        ignore_data_skip=ignore_data_skip, report_to=[], disable_tqdm=True, seed=0,
    )  # fmt: skip
    # "env": the client LadleTrainer makes itself, from LADLE_SERVER and LADLE_JOB
    given = None
    if server != "env" and train_dataset is None:
        given = BatchClient(
            args.process_index, args.world_size, server, job, timeout=60, device=args.device, elastic=elastic
        )
    rank = args.process_index
    trainer = RecordingTrainer(
        model=LlamaForCausalLM(config),
        args=args,
        client=given,
        record=out / f"rank-{rank}.jsonl",
        **({} if train_dataset is None else {"train_dataset": train_dataset}),
    )
    client = trainer.ladle
    output = trainer.train(resume_from_checkpoint=True if resume == "last" else resume)
    result = {
        "losses": {str(e["step"]): e["loss"] for e in trainer.state.log_history if "loss" in e},
        "global_step": output.global_step,
        "state": client.state_dict(),
        "length": len(trainer.get_train_dataloader()),
    }
    (out / f"rank-{rank}.result.json").write_text(json.dumps(result))
    if isinstance(client, BatchClient):
        client.close()
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("server")
    parser.add_argument("job")
    parser.add_argument("out", type=Path)
    parser.add_argument("--max-steps", type=int, default=-1)
    parser.add_argument("--epochs", type=float, default=1.0)
    parser.add_argument("--accumulate", type=int, default=1)
    parser.add_argument("--save-steps", type=int, default=0)
    parser.add_argument("--resume")
    parser.add_argument("--elastic", action="store_true")
    parser.add_argument("--dataset", type=Path, help="no server: this saved dataset, batched in-process")
    a = parser.parse_args()
    train_dataset = None
    if a.dataset is not None:
        import datasets

        train_dataset = datasets.load_from_disk(str(a.dataset))
    run(
        a.server, a.job, a.out, max_steps=a.max_steps, epochs=a.epochs, accumulate=a.accumulate,
        save_steps=a.save_steps, resume=a.resume, elastic=a.elastic, train_dataset=train_dataset,
    )  # fmt: skip


if __name__ == "__main__":
    main()
