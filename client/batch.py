"""The ``Batch`` a trainer receives: padded arrays plus where the batch sits in the schedule."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import numpy as np
import numpy.typing as npt

__all__ = ["Batch"]


@dataclass(frozen=True, eq=False)
class Batch:
    """One rank's batch of one step.

    ``input_ids`` (int32) and ``loss_mask`` (int8) are ``[rows, padded_len]``;
    ``attention_mask`` (int8) is 1 on the real tokens of each row (its first
    ``lengths[i]`` positions) and 0 on padding. With numpy (the default) the
    arrays are read-only views of the received message, without a copy; with
    ``device=...`` they are torch tensors on that device. ``device="cpu"``
    tensors share the received message too (torch has no read-only tensor):
    writing to them in place (``labels[labels == pad] = -100`` on
    ``input_ids`` itself) changes this batch and nothing else, as on a copy.

    ``sample_ids`` (int64, one per row) are the rows' indices in the dataset
    folder as saved (``datasets.load_from_disk(DIR)[int(i)]``), after any
    shuffle, select or filter that ran before ``save_to_disk``.

    ``attention_mask`` is the one array not on the wire: it is made from
    ``lengths`` the first time it is read and kept, so a trainer that never reads it (one that passes
    ``lengths`` to a variable-length attention kernel) never pays for it.

    Batches compare and hash by identity (their arrays have no one truth
    value). A batch pickles (``multiprocessing``, ``torch.save``) with its
    arrays copied and ``attention_mask`` made; an unpickled batch's arrays
    are its own (writable, except with pickle protocol 5, which keeps
    numpy's read-only flag). ``torch.load`` of a saved batch needs
    ``weights_only=False`` (a ``Batch`` is not one of the types torch loads
    by default); a checkpoint should hold ``client.state_dict()``, not batches.
    """

    input_ids: Any
    loss_mask: Any
    lengths: Any
    sample_ids: Any
    epoch: int
    step: int
    rank: int
    bucket: int
    real_tokens: int
    padded_tokens: int
    extra: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)
    # makes attention_mask on first use (BatchClient passes one that gives a tensor on its device)
    _mask: Callable[[], Any] | None = field(default=None, repr=False, compare=False)
    # BatchClient(device="cuda"): makes the trainer's stream wait for the batch's copies (at next())
    _ready: Callable[[], None] | None = field(default=None, repr=False, compare=False)

    @classmethod
    def _make(cls, fields: dict[str, Any]) -> Batch:
        """A Batch of ``fields`` (every field, ``extra`` and ``_mask`` too) without ``__init__``.

        BatchClient makes one a batch: a frozen dataclass's ``__init__`` sets
        each field through ``object.__setattr__``, and one ``__dict__``
        update costs far less. It is still frozen after.
        """
        batch = object.__new__(cls)
        batch.__dict__.update(fields)
        return batch

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["attention_mask"] = self.attention_mask  # made now: the function that makes it stays here
        state["_mask"] = state["_ready"] = None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)

    @cached_property
    def attention_mask(self) -> Any:
        """int8 ``[rows, padded_len]``: 1 on each row's first ``lengths[i]`` positions, 0 after."""
        if self._mask is not None:
            return self._mask()
        return attention_mask(np.asarray(self.lengths), self.padded_len)

    @property
    def rows(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def padded_len(self) -> int:
        return int(self.input_ids.shape[1])

    def pin_memory(self) -> Batch:
        """This batch with its arrays in pinned (page-locked) host memory, for fast copies to a GPU.

        What ``DataLoader(..., pin_memory=True)`` calls on each batch (it
        leaves an object without this method as it is, unpinned). Tensors
        already on a GPU stay where they are. Needs torch and CUDA.
        """
        import torch

        def pin(array: Any) -> Any:
            if not isinstance(array, torch.Tensor):
                with warnings.catch_warnings():  # read-only views: pinning copies them, nothing writes
                    warnings.simplefilter("ignore", UserWarning)
                    array = torch.from_numpy(np.asarray(array))
            if array.device.type != "cpu":
                return array
            return array.pin_memory()

        return self._map(pin)

    def to(self, device: Any, *, non_blocking: bool = False) -> Batch:
        """This batch with its arrays as torch tensors on ``device``; this one is left as it is.

        What frameworks that move a batch with ``.to(device)`` call (Lightning's
        ``transfer_batch_to_device`` does, and refuses a frozen dataclass
        without it). Arrays already on ``device`` are shared, not copied;
        numpy arrays are copied into new tensors. ``attention_mask`` stays
        lazy: made (or moved) when first read. Needs torch. A dtype is
        refused: the arrays are token ids, lengths and row indices, which a
        float type would round.
        """
        import torch

        if isinstance(device, torch.dtype):
            raise TypeError(
                f"Batch.to takes a device, not a dtype ({device}): a float type would round the token "
                "ids and row indices; convert the one tensor you need (batch.loss_mask.to(torch.float32))"
            )

        def move(array: Any) -> Any:
            if not isinstance(array, torch.Tensor):
                array = torch.from_numpy(np.array(array))  # a copy: the received views are read-only
            return array.to(device, non_blocking=non_blocking)

        return self._map(move)

    def _map(self, change: Callable[[Any], Any]) -> Batch:
        """A batch of ``change(array)`` for each array; ``attention_mask`` changed when first read."""
        fields = {k: v for k, v in self.__dict__.items() if k != "attention_mask"}  # its cache
        for name in ("input_ids", "loss_mask", "lengths", "sample_ids"):
            fields[name] = change(fields[name])
        fields["extra"] = dict(self.extra)
        fields["_mask"] = lambda: change(self.attention_mask)
        fields["_ready"] = None
        return Batch._make(fields)


def attention_mask(lengths: npt.NDArray[np.integer], padded_len: int) -> npt.NDArray[np.int8]:
    """1 on the first ``lengths[i]`` positions of row i, 0 after."""
    mask: npt.NDArray[np.int8] = (np.arange(padded_len, dtype=np.int32)[None, :] < lengths[:, None]).view(
        np.int8
    )
    return mask
