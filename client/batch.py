"""The ``Batch`` a trainer receives: padded arrays plus where the batch sits in the schedule."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

__all__ = ["Batch"]


@dataclass(frozen=True)
class Batch:
    """One rank's batch of one step.

    ``input_ids`` (int32) and ``loss_mask`` (int8) are ``[rows, padded_len]``;
    ``attention_mask`` (int8) is 1 on the real tokens of each row (its first
    ``lengths[i]`` positions) and 0 on padding. With numpy (the default) the
    arrays are read-only views of the received message, without a copy; with
    ``device=...`` they are torch tensors on that device.
    """

    input_ids: Any
    loss_mask: Any
    attention_mask: Any
    lengths: Any
    sample_ids: Any
    epoch: int
    step: int
    rank: int
    bucket: int
    real_tokens: int
    padded_tokens: int
    extra: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    @property
    def rows(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def padded_len(self) -> int:
        return int(self.input_ids.shape[1])


def attention_mask(lengths: npt.NDArray[np.integer], padded_len: int) -> npt.NDArray[np.int8]:
    """1 on the first ``lengths[i]`` positions of row i, 0 after."""
    mask: npt.NDArray[np.int8] = (np.arange(padded_len, dtype=np.int32)[None, :] < lengths[:, None]).view(
        np.int8
    )
    return mask
