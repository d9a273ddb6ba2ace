"""``BatchClient(device="cuda")`` against a real server, on a real GPU (skipped without CUDA).

Every tensor is compared with the numpy client's batch of the same step (the
schedule does not depend on the job's name). The race tests hold a batch's
tensors in kernels queued behind a long GPU sleep on the trainer's stream
while the client copies later batches: without the event and
``record_stream`` the client gives each batch (``_CudaCopies``), the
caching allocator would hand the first batch's memory to a later copy and
the queued kernels would read the later batch.

CI has no GPU: these run where one is lent (docs/serving.md, "On a GPU",
says when they last ran and what they measured).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("no CUDA device here", allow_module_level=True)

from ladle.client import Batch, BatchClient  # noqa: E402
from ladle.client.torch_data import BatchDataset  # noqa: E402

SLEEP_CYCLES = 200_000_000  # about 0.1 s of one GPU thread spinning (torch.cuda._sleep)
FIELDS = ("input_ids", "loss_mask", "lengths", "sample_ids", "attention_mask")


def reference(server: Any, batches: int) -> list[dict[str, np.ndarray]]:
    """Rank 0 of world 1, the first ``batches`` of its stream as numpy arrays (another job)."""
    got: list[dict[str, np.ndarray]] = []
    with BatchClient(0, 1, server.address, f"numpy-{time.monotonic_ns()}", timeout=30) as client:
        while len(got) < batches:
            before = len(got)
            for batch in client:
                got.append({f: np.array(getattr(batch, f)) for f in FIELDS})
                if len(got) == batches:
                    break
            assert len(got) > before, "an empty epoch"
    return got


def taken(client: BatchClient, batches: int) -> Iterator[Batch]:
    """The client's first ``batches`` batches across epochs."""
    n = 0
    while n < batches:
        for batch in client:
            yield batch
            n += 1
            if n == batches:
                return


def test_every_tensor_is_on_the_device_and_equals_the_numpy_batch(server_factory: Callable[..., Any]) -> None:
    server = server_factory()
    with BatchClient(0, 1, server.address, "job", timeout=30) as plain:
        count = len(plain)
    expected = reference(server, count + 5)  # into the second epoch
    dtypes = {"input_ids": torch.int32, "loss_mask": torch.int8, "lengths": torch.int32,
              "sample_ids": torch.int64, "attention_mask": torch.int8}  # fmt: skip
    with BatchClient(0, 1, server.address, "cuda", timeout=30, device="cuda", prefetch=8) as client:
        for i, batch in enumerate(taken(client, count + 5)):
            for f in FIELDS:
                tensor = getattr(batch, f)
                assert tensor.device == torch.device("cuda", torch.cuda.current_device()), f
                assert tensor.dtype == dtypes[f], f
                assert np.array_equal(tensor.cpu().numpy(), expected[i][f]), (i, f)


def test_cuda_without_an_index_is_the_callers_current_device(server_factory: Callable[..., Any]) -> None:
    server = server_factory()
    torch.cuda.set_device(torch.cuda.device_count() - 1)
    try:
        with BatchClient(0, 1, server.address, "current", timeout=30, device="cuda") as client:
            batch = next(iter(client))
            assert batch.input_ids.device.index == torch.cuda.device_count() - 1
    finally:
        torch.cuda.set_device(0)


@pytest.mark.parametrize("pin", [None, False])
def test_a_trainer_on_its_own_stream_reads_each_batch_as_it_was(
    server_factory: Callable[..., Any], pin: bool | None
) -> None:
    """Kernels queued behind a sleep on a side stream, the batch dropped: no later copy overwrites it."""
    server = server_factory()
    expected = reference(server, 40)
    side = torch.cuda.Stream()
    sums = []
    with (
        BatchClient(0, 1, server.address, f"side-{pin}", timeout=30, device="cuda", prefetch=8,
                    pin_memory=pin) as client,
        torch.cuda.stream(side),
    ):  # fmt: skip
        for batch in taken(client, 40):
            torch.cuda._sleep(SLEEP_CYCLES // 10)
            held = (batch.input_ids.long(), batch.attention_mask.long(), batch.sample_ids)
            sums.append(torch.stack([t.sum() for t in held]))
            del batch  # the trainer holds nothing: only the queued kernels read its memory
        side.synchronize()
    for i, got in enumerate(sums):
        want = [expected[i]["input_ids"].astype(np.int64).sum(), expected[i]["attention_mask"].sum(),
                expected[i]["sample_ids"].sum()]  # fmt: skip
        assert got.cpu().tolist() == [int(w) for w in want], f"batch {i} changed under queued kernels"


def test_next_does_not_wait_for_the_gpu(server_factory: Callable[..., Any]) -> None:
    """The copies are queued on the client's stream: ``next()`` returns while the trainer's stream is busy."""
    server = server_factory()
    with BatchClient(0, 1, server.address, "async", timeout=30, device="cuda", prefetch=8) as client:
        it = iter(client)
        next(it)
        torch.cuda.synchronize()
        time.sleep(0.5)  # the window fills: 8 batches copied or queued for copying
        torch.cuda._sleep(SLEEP_CYCLES * 10)  # about a second of work on the trainer's stream
        began = time.perf_counter()
        batches = [next(it) for _ in range(6)]
        took = time.perf_counter() - began
        assert torch.cuda.current_stream().query() is False, "the GPU finished early: the test proves nothing"
        assert took < 0.2, f"6 next() calls took {took:.3f}s behind a busy GPU"
        ids = batches[-1].input_ids.long().sum()  # queued behind the sleep, read after it
        torch.cuda.synchronize()
        assert int(ids) > 0


def test_dataloader_pin_memory_pins_the_batches(server_factory: Callable[..., Any]) -> None:
    """``DataLoader(..., pin_memory=True)`` calls ``Batch.pin_memory``: numpy batches come out pinned."""
    server = server_factory()
    expected = reference(server, 6)
    data = BatchDataset(0, 1, server.address, "pinned", timeout=30, device=None)
    loader = torch.utils.data.DataLoader(data, batch_size=None, pin_memory=True)
    try:
        for i, batch in zip(range(6), loader, strict=False):
            for f in FIELDS:
                tensor = getattr(batch, f)
                assert tensor.is_pinned(), f
                assert np.array_equal(tensor.numpy(), expected[i][f]), (i, f)
            moved = batch.to("cuda", non_blocking=True)
            assert torch.equal(moved.input_ids.cpu(), batch.input_ids)
    finally:
        data.close()


def test_hf_trainer_on_the_gpu_resumes_as_an_uninterrupted_run(
    server_factory: Callable[..., Any], tmp_path: Path
) -> None:
    """``LadleTrainer`` in bf16 on the GPU: the batches after a checkpoint are the uninterrupted run's."""
    pytest.importorskip("transformers")
    from ladle.client.hf import state_file
    from ladle.service.synth import make_dataset
    from tests.integration.hf_trainer_proc import VOCAB, run

    make_dataset(tmp_path / "ds", 300, seed=5, scale=1 / 16, vocab_size=VOCAB)  # the tiny model's tokens
    server = server_factory(dataset=tmp_path / "ds")
    whole = run(server.address, "gpu", tmp_path / "whole", max_steps=8, save_steps=3, cuda=True)
    checkpoint = tmp_path / "whole" / "checkpoints" / "checkpoint-3"
    assert state_file(checkpoint, 0).exists()
    resumed = run(server.address, "gpu", tmp_path / "resumed", max_steps=8, resume=str(checkpoint), cuda=True)

    def trained(out: Path) -> list[str]:
        return [json.loads(line)["digest"] for line in (out / "rank-0.jsonl").read_text().splitlines()]

    assert trained(tmp_path / "resumed") == trained(tmp_path / "whole")[3:]
    assert resumed["state"] == whole["state"]
    assert all(np.isfinite(v) for v in whole["losses"].values())
