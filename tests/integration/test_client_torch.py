"""BatchClient's torch path and the DataLoader adapter against a real server."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from ladle.client import BatchClient  # noqa: E402
from ladle.client.errors import BatchClientError  # noqa: E402
from ladle.client.torch_data import BatchDataset  # noqa: E402


def test_tensors_match_numpy(server_factory: Callable[..., Any]) -> None:
    server = server_factory()
    with BatchClient(0, 1, server.address, "np", timeout=30) as plain:
        first = [b for _, b in zip(range(5), plain, strict=False)]
        expected = [(np.array(b.input_ids), np.array(b.attention_mask)) for b in first]
    with BatchClient(0, 1, server.address, "pt", timeout=30, device="cpu") as client:
        got = [b for _, b in zip(range(5), client, strict=False)]
    for (ids, mask), batch in zip(expected, got, strict=True):
        assert isinstance(batch.input_ids, torch.Tensor)
        assert batch.input_ids.dtype == torch.int32
        assert np.array_equal(batch.input_ids.numpy(), ids)
        assert np.array_equal(batch.attention_mask.numpy(), mask)


def test_writing_into_cpu_tensors_changes_only_that_batch(server_factory: Callable[..., Any]) -> None:
    """Labels made in place (``ids[ids == pad] = -100``), as training code does: no other batch sees it."""
    server = server_factory()
    with BatchClient(0, 1, server.address, "np-ref", timeout=30) as plain:
        expected = [np.array(b.input_ids) for _, b in zip(range(12), plain, strict=False)]
    with BatchClient(0, 1, server.address, "pt-write", timeout=30, device="cpu", prefetch=8) as client:
        for step, batch in zip(range(12), client, strict=False):
            ids = batch.input_ids
            assert np.array_equal(ids.numpy(), expected[step]), (
                f"batch {step} was changed by an earlier write"
            )
            ids[ids == 0] = -100
            ids += 1
            assert np.array_equal(
                batch.input_ids.numpy(), np.where(expected[step] == 0, -100, expected[step]) + 1
            )
            assert batch.attention_mask.dtype == torch.int8  # made from the lengths, not the ids


def test_dataloader_adapter(server_factory: Callable[..., Any]) -> None:
    server = server_factory()
    data = BatchDataset(0, 1, server.address, "dl", timeout=30)
    loader = torch.utils.data.DataLoader(data, batch_size=None, num_workers=0)
    steps = [batch.step for batch in loader]
    assert steps == list(range(len(steps)))
    assert data.state_dict()["epoch"] == 1
    data.close()


@pytest.mark.parametrize("workers", [1, 2])
def test_dataloader_workers_are_refused(server_factory: Callable[..., Any], workers: int) -> None:
    """In a worker, the client's position would be out of the trainer's state_dict(): refused, not silent."""
    server = server_factory()
    data = BatchDataset(0, 1, server.address, "dl-workers", timeout=30)
    loader = torch.utils.data.DataLoader(data, batch_size=None, num_workers=workers)
    with pytest.raises(BatchClientError, match="num_workers=0"):
        next(iter(loader))
    data.close()


@pytest.mark.parametrize("context", ["spawn", "forkserver"])
def test_dataloader_workers_over_a_client_are_refused_under_spawn(
    server_factory: Callable[..., Any], context: str
) -> None:
    """Pickled for a spawned worker, a wrapped client failed with "Can't pickle local object"."""
    server = server_factory()
    with BatchClient(0, 1, server.address, f"dl-{context}", timeout=30, device="cpu") as client:
        loader = torch.utils.data.DataLoader(
            BatchDataset(client), batch_size=None, num_workers=1, multiprocessing_context=context
        )
        with pytest.raises(BatchClientError, match="num_workers=0"):
            next(iter(loader))


def test_dataloader_adapter_over_a_client(server_factory: Callable[..., Any]) -> None:
    server = server_factory()
    with BatchClient(0, 1, server.address, "dl-client", timeout=30, device="cpu") as client:
        data = BatchDataset(client)
        assert data.client is client
        steps = [batch.step for batch in torch.utils.data.DataLoader(data, batch_size=None)]
        assert steps == list(range(len(steps)))
        assert data.state_dict() == client.state_dict()
    with pytest.raises(TypeError, match="BatchClient alone"):
        BatchDataset(client, job="other")
    with pytest.raises(TypeError, match="give device= to the BatchClient"):
        BatchDataset(client, device="cuda")  # was silently ignored: the client converts its batches
    assert BatchDataset(0, 1, server.address, "dl-default")._kwargs["device"] == "cpu"


def test_a_dataloader_that_batches_again_says_what_to_do(server_factory: Callable[..., Any]) -> None:
    """DataLoader's default batch_size=1 failed deep in torch's collate, naming nothing of ladle."""
    server = server_factory()
    data = BatchDataset(0, 1, server.address, "batched-again", device="cpu", timeout=30)
    try:
        with pytest.raises(TypeError, match=r"batch_size=None"):
            next(iter(torch.utils.data.DataLoader(data)))
    finally:
        data.close()


def test_the_dataset_is_a_context_manager_like_its_client(server_factory: Callable[..., Any]) -> None:
    """Left by an exception the batch the trainer failed on is not consumed; a clean exit consumes it."""
    server = server_factory()

    def train(fail_at: int | None, stop_at: int, seen: list[int]) -> None:
        with BatchDataset(0, 1, server.address, "dl-with", timeout=30) as data:
            for batch in torch.utils.data.DataLoader(data, batch_size=None, num_workers=0):
                seen.append(batch.step)
                if batch.step == fail_at:
                    raise RuntimeError("OOM")
                if batch.step == stop_at:
                    break

    first: list[int] = []
    with pytest.raises(RuntimeError, match="OOM"):
        train(3, 99, first)
    second: list[int] = []
    train(None, 5, second)
    assert (first, second) == ([0, 1, 2, 3], [3, 4, 5]), "the failed batch was consumed, or one was lost"
    with BatchDataset(0, 1, server.address, "dl-with", timeout=30) as data:
        assert next(iter(data)).step == 6, "a clean exit did not consume the last batch"
