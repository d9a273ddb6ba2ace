"""ladle without a server: the schedule as a batch sampler for any map-style dataset.

``ScheduleSampler(lengths, config)`` yields, for one rank, one epoch's
batches as lists of row indices, in the order ``ladle serve`` would serve
them (the same ``build_schedule`` over the same lengths and config), so
``DataLoader(ds, batch_sampler=sampler, collate_fn=pad_collate(pad_id))``
trains on ladle's batches with no process besides the trainer's.

Guarantees: every iteration of an epoch yields this rank's batches of that
epoch's schedule, each once, in step order; ``len(sampler)`` is their number
(the same on every rank: guarantee 2). ``state_dict()`` is the position after
the batches yielded so far; ``load_state_dict`` refuses a state of another
config, dataset, world size or rank with ``StateDictError``, as
``BatchClient`` does. Under torchdata's ``StatefulDataLoader`` the loader
saves the sampler's state as of each batch it hands out (not as of the ones
its workers prefetched), so a resume with workers repeats and loses nothing.

An epoch that ran to its end is followed by the next one; ``set_epoch(e)``
chooses the epoch (a no-op for the epoch in progress, so calling it at the
top of every epoch after a resume keeps the resumed position).
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from .errors import StateDictError

__all__ = ["STATE_FORMAT", "ScheduleSampler", "lengths_of", "pad_collate"]

# What state_dict() writes and load_state_dict() reads.
STATE_FORMAT = "ladle-sampler-v1"
IGNORE_INDEX = -100


def _world() -> tuple[int, int]:
    """``(rank, world_size)``: torch.distributed's when it is initialised, else RANK/WORLD_SIZE, else 0/1."""
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return int(dist.get_rank()), int(dist.get_world_size())
    except ImportError:
        pass
    return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))


def _lengths_fingerprint(lengths: npt.NDArray[np.integer]) -> str:
    return hashlib.blake2b(np.ascontiguousarray(lengths, dtype="<i8").tobytes(), digest_size=8).hexdigest()


class ScheduleSampler:
    """This rank's batches of ladle's schedule over ``lengths``, an epoch an iteration (see the module).

    ``lengths`` is one positive integer per dataset row (a numpy array, a
    list, or ``lengths_of(dataset)``); ``config`` a ``ScheduleConfig`` (its
    defaults when None); ``rank`` and ``world_size`` default to
    torch.distributed's, else ``RANK``/``WORLD_SIZE``, else 0 and 1. Bad
    lengths raise ``ScheduleError``, a bad rank or world size ``ConfigError``
    (``ladle.service.errors``).
    """

    def __init__(
        self,
        lengths: npt.ArrayLike,
        config: Any = None,
        *,
        rank: int | None = None,
        world_size: int | None = None,
        epoch: int = 0,
    ) -> None:
        from ladle.service.errors import ConfigError
        from ladle.service.schedule import ScheduleConfig, build_schedule

        default_rank, default_world = _world()
        rank = default_rank if rank is None else rank
        world_size = default_world if world_size is None else world_size
        if isinstance(world_size, bool) or not isinstance(world_size, int | np.integer) or world_size < 1:
            raise ConfigError("world_size", f"must be a positive integer, got {world_size!r}")
        if isinstance(rank, bool) or not isinstance(rank, int | np.integer) or not 0 <= rank < world_size:
            raise ConfigError("rank", f"must be an integer in [0, {world_size}), got {rank!r}")
        self.config = ScheduleConfig() if config is None else config
        if not isinstance(self.config, ScheduleConfig):
            raise ConfigError("config", f"must be a ScheduleConfig, got {type(config).__name__}")
        self.rank, self.world_size = int(rank), int(world_size)
        self._build = build_schedule
        # build_schedule checks the lengths (1-D, integers, positive); epoch 0 now, so a bad one fails here
        self._schedule = build_schedule(lengths, self.config, epoch=epoch, world_size=self.world_size)
        self.lengths = np.asarray(lengths)
        self._fingerprint = _lengths_fingerprint(self.lengths)
        self.epoch = int(epoch)
        self._step = 0  # batches of this epoch yielded so far

    @property
    def schedule(self) -> Any:
        """The current epoch's ``Schedule`` (built once an epoch)."""
        if self._schedule.epoch != self.epoch:
            self._schedule = self._build(
                self.lengths, self.config, epoch=self.epoch, world_size=self.world_size
            )
        return self._schedule

    def __len__(self) -> int:
        """This rank's batches in the current epoch (every rank has as many)."""
        return int(self.schedule.num_steps)

    def set_epoch(self, epoch: int) -> None:
        """Iterate ``epoch`` next, from its start (the epoch in progress keeps its position)."""
        if isinstance(epoch, bool) or not isinstance(epoch, int | np.integer) or epoch < 0:
            from ladle.service.errors import ConfigError

            raise ConfigError("epoch", f"must be a non-negative integer, got {epoch!r}")
        if int(epoch) != self.epoch:
            self.epoch, self._step = int(epoch), 0

    def __iter__(self) -> Iterator[list[int]]:
        if self._step >= len(self):  # the last epoch ran to its end: the next one
            self.epoch, self._step = self.epoch + 1, 0
        sched = self.schedule
        while self._step < sched.num_steps:
            rows = sched.samples(self._step, self.rank).tolist()
            self._step += 1
            yield rows

    def collate(self, pad_id: int = 0, *, with_loss_mask: bool = True) -> Callable[..., dict[str, Any]]:
        """``pad_collate`` with the config's ``pad_to_multiple_of`` and ``max_seq_len``: the served widths."""
        return pad_collate(
            pad_id,
            pad_to_multiple_of=self.config.pad_to_multiple_of,
            max_seq_len=self.config.max_seq_len,
            with_loss_mask=with_loss_mask,
        )

    def padded_len(self, step: int) -> int:
        """The width ``ladle serve`` pads this rank's batch of ``step`` to (``pad_collate`` matches it)."""
        return int(self.schedule.padded_len(step, self.rank))

    def state_dict(self) -> dict[str, Any]:
        """The position after the batches yielded so far, and what it belongs to."""
        return {
            "format": STATE_FORMAT,
            "epoch": self.epoch,
            "step": self._step,
            "rank": self.rank,
            "world_size": self.world_size,
            "config": self.config.fingerprint(),
            "lengths": self._fingerprint,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Resume at ``state``'s position; ``StateDictError`` if it belongs to another sampler."""
        if not isinstance(state, Mapping):
            raise StateDictError(f"state must be a mapping, got {type(state).__name__}")
        missing = sorted({"format", "epoch", "step", "rank", "world_size", "config", "lengths"} - set(state))
        if missing:
            raise StateDictError(f"state lacks {missing}; it was not made by ScheduleSampler.state_dict()")
        if state["format"] != STATE_FORMAT:
            raise StateDictError(f"state format {state['format']!r}; this sampler reads {STATE_FORMAT!r}")
        for key, mine, what in (
            ("config", self.config.fingerprint(), "another schedule config"),
            ("lengths", self._fingerprint, "another dataset (its lengths differ)"),
            ("world_size", self.world_size, "another world size"),
            ("rank", self.rank, "another rank"),
        ):
            if state[key] != mine:
                raise StateDictError(f"state is of {what}: {key} {state[key]!r}, this sampler's {mine!r}")
        epoch, step = state["epoch"], state["step"]
        if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in (epoch, step)):
            raise StateDictError(f"state's epoch and step must be integers >= 0, got {epoch!r} and {step!r}")
        self.epoch, self._step = epoch, 0
        if step > len(self):
            raise StateDictError(f"state's step {step} is past epoch {epoch}'s {len(self)} batches")
        self._step = step


def lengths_of(dataset: Any, column: str = "input_ids") -> npt.NDArray[np.int64]:
    """Each row's token count of a ``datasets.Dataset`` list column, from the Arrow offsets (no token read).

    Anything else with ``__getitem__(column)`` giving sequences (a dict of
    lists, a pandas frame) is measured row by row.
    """
    table = getattr(getattr(dataset, "data", None), "table", None)
    if table is not None and getattr(dataset, "_indices", None) is None:
        parts = [
            np.diff(np.asarray(c.offsets.to_numpy(), dtype=np.int64)) for c in table.column(column).chunks
        ]
        return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
    return np.fromiter((len(row) for row in dataset[column]), dtype=np.int64)


def pad_collate(
    pad_id: int = 0,
    *,
    pad_to_multiple_of: int = 1,
    max_seq_len: int | None = None,
    with_loss_mask: bool = True,
) -> Callable[[Sequence[Mapping[str, Any]]], dict[str, Any]]:
    """A ``collate_fn``: rows (``input_ids``, and ``labels`` or ``loss_mask``) to one padded batch.

    The batch is torch tensors ``input_ids``, ``attention_mask`` and
    ``labels`` (``[rows, width]``, int64: what ``model(**batch)`` of a
    Hugging Face causal LM takes) and, unless ``with_loss_mask=False`` (for
    ``model(**batch)``), ``loss_mask`` (int8). The width is the
    longest row cut to ``max_seq_len``, rounded up to ``pad_to_multiple_of``,
    as ``ladle serve`` pads. A row's loss mask is its ``loss_mask``, else 1
    where its ``labels`` are not -100, else 1 on every token; ``labels`` is
    ``input_ids`` with -100 where the mask is 0 and on padding.
    """
    import torch

    if pad_to_multiple_of < 1:
        raise ValueError(f"pad_to_multiple_of must be >= 1, got {pad_to_multiple_of}")

    def collate(rows: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
        ids = [np.asarray(row["input_ids"], dtype=np.int64)[:max_seq_len] for row in rows]
        longest = max((len(r) for r in ids), default=0)
        width = -(-longest // pad_to_multiple_of) * pad_to_multiple_of
        out_ids = np.full((len(rows), width), pad_id, dtype=np.int64)
        mask = np.zeros((len(rows), width), dtype=np.int8)
        attention = np.zeros((len(rows), width), dtype=np.int64)
        for i, (row, tokens) in enumerate(zip(rows, ids, strict=True)):
            n = len(tokens)
            out_ids[i, :n] = tokens
            attention[i, :n] = 1
            if row.get("loss_mask") is not None:
                mask[i, :n] = np.asarray(row["loss_mask"])[:n]
            elif row.get("labels") is not None:
                mask[i, :n] = np.asarray(row["labels"])[:n] != IGNORE_INDEX
            else:
                mask[i, :n] = 1
        labels = np.where(mask != 0, out_ids, IGNORE_INDEX)
        batch = {
            "input_ids": torch.from_numpy(out_ids),
            "attention_mask": torch.from_numpy(attention),
            "labels": torch.from_numpy(labels),
        }
        if with_loss_mask:
            batch["loss_mask"] = torch.from_numpy(mask)
        return batch

    return collate
