"""A torch ``IterableDataset`` over ``BatchClient``, for code that wants a ``DataLoader``.

Use it with ``DataLoader(BatchDataset(...), batch_size=None)``: the batches
are already made by the server, so the loader must not batch again, and it
must run in the training process (``num_workers=0``). ``BatchClient``
already reads ahead on a thread of its own, so a worker process would add a
copy of every batch and nothing else; its position (``state_dict``) would be
out of the training process's reach, so a checkpoint would silently hold the
start; and two workers would both open the same rank, the second fencing
the first.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from types import TracebackType
from typing import Any

from torch.utils.data import IterableDataset, get_worker_info

from .batch import Batch
from .client import BatchClient
from .errors import BatchClientError

__all__ = ["BatchDataset"]

_BATCHED = (
    "DataLoader tried to batch ladle Batch objects again: each is a whole batch the server made, "
    "so give DataLoader(BatchDataset(...), batch_size=None)"
)


def _batched_already(batch: Any, *, collate_fn_map: Any = None) -> Any:
    """torch's default collate met a ``Batch`` (a DataLoader without ``batch_size=None``)."""
    raise TypeError(_BATCHED)


try:  # its own words in place of "default_collate: batch must contain tensors, ... found Batch"
    from torch.utils.data._utils.collate import default_collate_fn_map

    default_collate_fn_map.setdefault(Batch, _batched_already)
except (ImportError, AttributeError):  # a torch without the registry: its own message stands
    pass

_IN_PROCESS = (
    "BatchDataset must run with DataLoader(num_workers=0): BatchClient already reads ahead on "
    "a thread of its own, and in a worker process its position would be out of state_dict()'s "
    "reach (and a second worker would open the same rank and fence the first)"
)


_UNSET: Any = object()  # BatchDataset's device= when not given


def check_in_process() -> None:
    """Refuses a ``DataLoader`` worker process (``BatchDataset``'s and ``ladle.client.hf``'s)."""
    if get_worker_info() is not None:
        raise BatchClientError(_IN_PROCESS)


class BatchDataset(IterableDataset[Batch]):
    """One epoch per iteration of a ``BatchClient``: the one given, or one made lazily with these arguments.

    ``BatchDataset(client)`` wraps a client, whose batches are as it makes
    them (numpy arrays unless it was given a ``device``); ``BatchDataset(rank,
    world_size, server, job, ..., device="cpu")`` makes one with
    ``BatchClient``'s arguments when first iterated (tensors on the CPU by
    default).

    ``lockstep=True`` is for a DDP job whose checkpoint holds one rank's
    position for all (Lightning saves rank 0's loader state and loads it on
    every rank): ranks in step are all at the same step of the same epoch,
    so ``load_state_dict`` takes a state of another rank of the same world
    as this rank's position. Without it such a state is a
    ``StateDictError``, as it is for ``BatchClient``.
    """

    def __init__(self, *args: Any, device: Any = _UNSET, lockstep: bool = False, **kwargs: Any) -> None:
        super().__init__()
        self.lockstep = bool(lockstep)
        given = args[0] if len(args) == 1 and not kwargs and isinstance(args[0], BatchClient) else None
        if given is None and any(isinstance(a, BatchClient) for a in (*args, *kwargs.values())):
            raise TypeError("BatchDataset takes a BatchClient alone, or BatchClient's arguments")
        if given is not None and device is not _UNSET:
            # the client converts its batches on its own reader thread, as it was made to
            raise TypeError(
                "BatchDataset(client) keeps the client's device: give device= to the BatchClient "
                "(BatchClient(..., device='cuda')), not to BatchDataset"
            )
        self._args = args
        self._kwargs = dict(kwargs, device="cpu" if device is _UNSET else device)
        self._client: BatchClient | None = given

    @property
    def client(self) -> BatchClient:
        if self._client is None:
            self._client = BatchClient(*self._args, **self._kwargs)
        return self._client

    def __iter__(self) -> Iterator[Batch]:
        check_in_process()
        return iter(self.client)

    def __getstate__(self) -> dict[str, Any]:
        """Pickled for a worker process (spawn, forkserver): refused as ``__iter__`` refuses a worker."""
        if self._client is not None:
            raise BatchClientError(_IN_PROCESS)
        return self.__dict__.copy()

    def __len__(self) -> int:
        """``len(client)``: this rank's batches in the current epoch, so ``len(DataLoader(...))`` works.

        Epochs can differ by a few batches and ``DataLoader`` keeps the length
        it was last told: ask again at each epoch's start (else torch warns in a
        longer epoch), or use ``client.steps_in_epoch(e)``.
        """
        return len(self.client)

    def state_dict(self) -> dict[str, Any]:
        return self.client.state_dict()

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        client = self.client
        if (
            self.lockstep
            and isinstance(state, Mapping)
            and state.get("world_size") == client.world_size
            and state.get("rank") != client.rank
        ):
            state = {**state, "rank": client.rank}  # a copy: the caller's state stays as it was
        client.load_state_dict(state)

    def close(self) -> None:
        if self._client is not None:
            self._client.close()

    def __enter__(self) -> BatchDataset:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        """As ``BatchClient``'s: left by an exception, the batch the trainer failed on is not consumed."""
        if self._client is not None:
            self._client.__exit__(exc_type, exc, tb)
