"""Hugging Face ``Trainer`` on ladle's batches: ``LadleTrainer``.

``Trainer`` makes its own ``DataLoader`` and hands it to accelerate, which
re-batches, shards or dispatches an ``IterableDataset`` from rank 0 and, on a
resume, skips batches by reading them: each of those would break ladle's
schedule. ``LadleTrainer`` gives ``Trainer`` a loader over one rank's
``BatchClient`` instead, untouched by accelerate, saves each rank's
``state_dict()`` in every checkpoint and loads it on
``train(resume_from_checkpoint=...)``, so a resumed run trains on exactly the
batches an uninterrupted one would have.

``Trainer`` counts epochs of one fixed length while ladle packs each epoch
anew (epochs can differ by a few batches), so the loader is ladle's stream
itself, cut by ``Trainer`` into epochs of ``steps_in_epoch(0)`` batches: no
batch is skipped or repeated at the seams, and a ``Trainer`` epoch may begin
or end a few batches away from a ladle epoch's (``batch.epoch`` in the
stream is exact). Needs transformers 5 and torch.

Without a server: ``LadleTrainer(..., train_dataset=ds)`` (a tokenized
``datasets.Dataset``, no ``client``) batches ``ds`` in this process with
``ladle.ScheduleSampler`` over its lengths (``schedule_config``: a
``ScheduleConfig``, its defaults when None), pads with the tokenizer's pad
id (``processing_class.pad_token_id``, else 0), and saves and resumes the
sampler's position in every checkpoint the same way.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, IterableDataset
from transformers import Trainer, TrainerCallback
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, get_last_checkpoint

from .batch import Batch
from .client import BatchClient
from .errors import BatchClientError
from .sampler import ScheduleSampler, lengths_of
from .torch_data import _IN_PROCESS, check_in_process

__all__ = ["LadleTrainer", "TrainerStream", "model_inputs", "state_file"]

log = logging.getLogger("ladle.client.hf")

IGNORE_INDEX = -100  # what transformers' losses skip in ``labels``

_NO_TRIALS = (
    "LadleTrainer does not run hyperparameter trials: they would share one ladle stream, each trial "
    "reading on from where the last one stopped (other batches for each trial), and their positions "
    "would be saved outside the trials' folders; run each trial as a LadleTrainer of its own with a "
    "client of its own job (BatchClient(..., job=f'{job}-trial-{n}'))"
)


def model_inputs(batch: Batch) -> dict[str, torch.Tensor]:
    """A ``Batch`` as a causal LM's keyword arguments: ``input_ids``, ``attention_mask``, ``labels``.

    ``labels`` are ``input_ids`` with ``-100`` wherever ``loss_mask`` is 0
    (padding among them): the model shifts them itself, so ``loss_mask[i]``
    says whether token ``i`` is predicted, as in ladle's own loss. All three
    are new int64 tensors (what every transformers model takes) on the
    batch's device, so the batch's own buffers stay as received.
    """
    ids = _int64(batch.input_ids)
    return {
        "input_ids": ids,
        "attention_mask": _int64(batch.attention_mask),
        "labels": ids.masked_fill(_int64(batch.loss_mask) == 0, IGNORE_INDEX),
    }


def _int64(values: Any) -> torch.Tensor:
    """A new int64 tensor of a batch's array (a numpy one is read-only: copied, not wrapped)."""
    if isinstance(values, torch.Tensor):
        return values.to(torch.int64, copy=True)
    return torch.from_numpy(np.array(values, dtype=np.int64))


class TrainerStream(IterableDataset[dict[str, torch.Tensor]]):
    """One rank's ladle stream as ``model_inputs`` dicts, across epochs, with a fixed ``len``.

    Each iteration goes on where the last one stopped (into the next epoch
    at an epoch's end), so ``Trainer``, which reads ``len`` batches an epoch
    and then starts a new iteration, neither skips nor repeats a batch.
    ``len`` is epoch 0's length for this world size, the same on every rank
    and in every restart, so ``Trainer``'s epoch arithmetic on a resume
    agrees with the run it resumes.
    """

    def __init__(self, client: BatchClient) -> None:
        super().__init__()
        self.client = client
        self._length: tuple[int, int] | None = None  # (world size, epoch 0's batches for it)

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        check_in_process()
        client = self.client
        empty = 0
        while empty < 2:  # a resize can leave one empty epoch; two in a row: nothing left to read
            got = False
            for batch in client:
                got = True
                yield model_inputs(batch)
            empty = 0 if got else empty + 1

    def __len__(self) -> int:
        client = self.client
        if self._length is None or self._length[0] != client.world_size:  # asked once per world size
            self._length = (client.world_size, client.steps_in_epoch(0))
        return self._length[1]

    def __getstate__(self) -> dict[str, Any]:
        """Pickled for a worker process (spawn, forkserver): refused, as a worker is."""
        raise BatchClientError(_IN_PROCESS)


class SamplerStream(IterableDataset[dict[str, torch.Tensor]]):
    """In-process: ``dataset``'s rows in ``sampler``'s batches, collated, across epochs, with a fixed ``len``.

    As ``TrainerStream``: each iteration goes on where the last one stopped
    (into the next epoch at an epoch's end), and ``len`` is epoch 0's length.
    Rows are read one batch at a time, only when ``Trainer`` asks for it, so
    the sampler's position is always that of the batches handed out.
    """

    def __init__(self, dataset: Any, sampler: ScheduleSampler, collate: Any) -> None:
        super().__init__()
        self.dataset, self.sampler, self.collate = dataset, sampler, collate
        self._length = len(ScheduleSampler(sampler.lengths, sampler.config, rank=sampler.rank,
                                           world_size=sampler.world_size))  # fmt: skip

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        check_in_process()
        while True:
            got = False
            for rows in self.sampler:
                got = True
                yield self.collate([self.dataset[int(i)] for i in rows])
            if not got:
                return

    def __len__(self) -> int:
        return self._length

    def __getstate__(self) -> dict[str, Any]:
        raise BatchClientError(_IN_PROCESS)


def state_file(checkpoint: str | os.PathLike[str], process_index: int) -> Path:
    """Where one rank's ``state_dict()`` lives in a checkpoint (beside Trainer's ``rng_state_N.pth``)."""
    return Path(checkpoint) / f"ladle_state_{process_index}.json"


class _SaveState(TrainerCallback):
    """Writes the rank's ``state_dict()`` into each checkpoint ``Trainer`` saves."""

    def __init__(self, client: BatchClient | ScheduleSampler) -> None:
        self.client = client

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        folder = Path(args.output_dir) / f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}"
        folder.mkdir(parents=True, exist_ok=True)  # a rank on a node that saves no model
        path = state_file(folder, args.process_index)
        partial = path.with_name(path.name + ".partial")
        partial.write_text(json.dumps(self.client.state_dict()), encoding="utf-8")
        os.replace(partial, path)  # a crash mid-write leaves the last whole state, never half of one


class LadleTrainer(Trainer):
    """``transformers.Trainer`` that trains on one rank's ladle batches.

    ``LadleTrainer(model=..., args=..., client=BatchClient(...))``; without
    ``client`` it makes ``BatchClient(args.process_index, args.world_size,
    device=args.device)`` with the server and job from ``LADLE_SERVER`` and
    ``LADLE_JOB``. Every other argument is ``Trainer``'s; ``train_dataset``
    and ``data_collator`` are ladle's to give, so they are refused, and so
    is ``auto_find_batch_size`` (the server sizes the batches).
    """

    def __init__(
        self,
        *args: Any,
        client: BatchClient | None = None,
        schedule_config: Any = None,
        **kwargs: Any,
    ) -> None:
        dataset = kwargs.pop("train_dataset", None)
        if kwargs.get("data_collator") is not None:
            raise TypeError("LadleTrainer takes its batches from ladle: leave out data_collator=")
        if dataset is not None and client is not None:
            raise TypeError(
                "give train_dataset= (batched in this process) or client= (a server's batches), not both"
            )
        if dataset is None and schedule_config is not None:
            raise TypeError("schedule_config= goes with train_dataset= (a server has its own config)")
        super().__init__(*args, **kwargs)
        if self.args.auto_find_batch_size:
            # it retries a failed run from where the stream then is: the batches before the
            # failure would be skipped, and the retry's smaller batch size would not apply anyway
            raise ValueError(
                "auto_find_batch_size cannot shrink ladle's batches (the server's token_budget and "
                "max_batch_size size them): leave it off and serve a smaller --token-budget instead"
            )
        rank, world = self.args.process_index, self.args.world_size
        if not hasattr(Trainer, "get_resumed_dataloader"):
            # transformers < 5.25 skips a resumed epoch's first batches by reading them, with no
            # hook to stop it: the loaded position must not be skipped past a second time
            self.args.ignore_data_skip = True
        self.stream: TrainerStream | SamplerStream
        if dataset is not None:
            sampler = ScheduleSampler(lengths_of(dataset), schedule_config, rank=rank, world_size=world)
            pad_id = getattr(self.processing_class, "pad_token_id", None)
            self.ladle: BatchClient | ScheduleSampler = sampler
            self.stream = SamplerStream(dataset, sampler, sampler.collate(pad_id or 0, with_loss_mask=False))
            self.add_callback(_SaveState(sampler))
            return
        if client is None:
            client = BatchClient(rank, world, device=self.args.device)
        elif (client.rank, client.world_size) != (rank, world):
            raise BatchClientError(
                f"the client is rank {client.rank} of {client.world_size}, but this process is rank "
                f"{rank} of {world} in Trainer's arguments: make it BatchClient(args.process_index, "
                "args.world_size, ...)"
            )
        self.ladle = client
        self.stream = TrainerStream(client)
        self.add_callback(_SaveState(client))

    def get_train_dataloader(self) -> DataLoader[Any]:
        """The rank's stream, one batch per item (ladle made the batches), in this process."""
        return DataLoader(self.stream, batch_size=None, num_workers=0)

    def get_resumed_dataloader(self, dataloader: DataLoader[Any], num_batches: int) -> DataLoader[Any]:
        """The stream as it is: ``train()`` loaded the checkpoint's position, so skipping would skip twice."""
        return dataloader

    def train(  # type: ignore[override]
        self, resume_from_checkpoint: str | bool | None = None, **kwargs: Any
    ) -> Any:
        """``Trainer.train``; a resume first loads this rank's position from the checkpoint."""
        if kwargs.get("trial") is not None:
            raise NotImplementedError(_NO_TRIALS)
        if resume_from_checkpoint is True:
            resume_from_checkpoint = get_last_checkpoint(self.args.output_dir)  # type: ignore[no-untyped-call]
            if resume_from_checkpoint is None:
                raise ValueError(f"No valid checkpoint found in output directory ({self.args.output_dir})")
        if isinstance(resume_from_checkpoint, str | os.PathLike):
            self._load_position(resume_from_checkpoint)
        return super().train(resume_from_checkpoint=resume_from_checkpoint or None, **kwargs)

    def hyperparameter_search(self, *args: Any, **kwargs: Any) -> Any:
        """Refused, before any trial starts: see ``_NO_TRIALS``."""
        raise NotImplementedError(_NO_TRIALS)

    def _load_position(self, checkpoint: str | os.PathLike[str]) -> None:
        path = state_file(checkpoint, self.args.process_index)
        if getattr(self.ladle, "elastic", False) and not path.exists():
            # a world larger than the checkpoint's: every new rank loads one position of the
            # same step, and rank 0's will do (the resize re-plans the rest of the epoch)
            path = state_file(checkpoint, 0)
        try:
            state: Mapping[str, Any] = json.loads(path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            log.warning(
                "%s has no ladle position for rank %d (%s): the rank goes on from the job's stored "
                "cursor, which may be past the checkpoint",
                checkpoint,
                self.args.process_index,
                path.name,
            )
            return
        except ValueError as exc:
            raise BatchClientError(f"{path} is not a ladle position: {exc}") from exc
        self.ladle.load_state_dict(state)
