"""A torch ``IterableDataset`` over ``BatchClient``, for code that wants a ``DataLoader``.

Use it with ``DataLoader(BatchDataset(...), batch_size=None)``: the batches
are already made by the server, so the loader must not batch again, and it
must run in the training process (``num_workers=0``): two worker processes
would both open the same rank and the second would fence the first.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

from torch.utils.data import IterableDataset, get_worker_info

from .batch import Batch
from .client import BatchClient

__all__ = ["BatchDataset"]


class BatchDataset(IterableDataset[Batch]):
    """One epoch per iteration of a ``BatchClient`` made lazily with these arguments."""

    def __init__(self, *args: Any, device: Any = "cpu", **kwargs: Any) -> None:
        super().__init__()
        self._args = args
        self._kwargs = dict(kwargs, device=device)
        self._client: BatchClient | None = None

    @property
    def client(self) -> BatchClient:
        if self._client is None:
            self._client = BatchClient(*self._args, **self._kwargs)
        return self._client

    def __iter__(self) -> Iterator[Batch]:
        info = get_worker_info()
        if info is not None and info.num_workers > 1:
            raise RuntimeError(
                "BatchDataset must run with DataLoader(num_workers=0 or 1): each worker would open the same "
                "rank and fence the others"
            )
        return iter(self.client)

    def state_dict(self) -> dict[str, Any]:
        return self.client.state_dict()

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.client.load_state_dict(state)

    def close(self) -> None:
        if self._client is not None:
            self._client.close()
