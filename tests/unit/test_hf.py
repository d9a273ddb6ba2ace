"""A Batch for training frameworks: ``ladle.client.hf.model_inputs`` and ``Batch.to``."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from ladle.client import Batch  # noqa: E402
from ladle.client.hf import IGNORE_INDEX, model_inputs  # noqa: E402


def batch(as_tensors: bool) -> Batch:
    ids = np.array([[5, 6, 7, 8], [9, 10, 0, 0]], dtype=np.int32)
    mask = np.array([[0, 0, 1, 1], [1, 1, 0, 0]], dtype=np.int8)  # a prompt, then an answer; padding
    ids.flags.writeable = mask.flags.writeable = False  # as BatchClient's numpy views are
    lengths = np.array([4, 2], dtype=np.int32)
    convert = torch.from_numpy if as_tensors else (lambda a: a)
    return Batch(
        input_ids=convert(ids.copy()) if as_tensors else ids,
        loss_mask=convert(mask.copy()) if as_tensors else mask,
        lengths=lengths,
        sample_ids=np.array([3, 1]),
        epoch=0,
        step=0,
        rank=0,
        bucket=0,
        real_tokens=6,
        padded_tokens=8,
    )


@pytest.mark.parametrize("as_tensors", [False, True], ids=["numpy", "torch"])
def test_labels_are_the_ids_where_the_loss_mask_is_set(as_tensors: bool) -> None:
    b = batch(as_tensors)
    inputs = model_inputs(b)
    assert set(inputs) == {"input_ids", "attention_mask", "labels"}
    assert all(t.dtype == torch.int64 for t in inputs.values())
    assert inputs["input_ids"].tolist() == [[5, 6, 7, 8], [9, 10, 0, 0]]
    assert inputs["attention_mask"].tolist() == [[1, 1, 1, 1], [1, 1, 0, 0]]
    skip = IGNORE_INDEX
    assert inputs["labels"].tolist() == [[skip, skip, 7, 8], [9, 10, skip, skip]]


def test_the_inputs_are_copies_the_batch_is_left_as_received() -> None:
    b = batch(as_tensors=True)
    inputs = model_inputs(b)
    inputs["input_ids"].fill_(1)
    inputs["labels"].fill_(1)
    assert b.input_ids.tolist() == [[5, 6, 7, 8], [9, 10, 0, 0]]


@pytest.mark.parametrize("as_tensors", [False, True], ids=["numpy", "torch"])
def test_to_gives_a_batch_of_tensors_on_the_device_and_leaves_this_one(as_tensors: bool) -> None:
    """What Lightning calls to move a batch (it refuses a frozen dataclass otherwise)."""
    b = batch(as_tensors)
    moved = b.to("cpu")
    assert moved is not b
    assert all(isinstance(getattr(moved, f), torch.Tensor) for f in ("input_ids", "loss_mask", "lengths"))
    assert moved.input_ids.tolist() == [[5, 6, 7, 8], [9, 10, 0, 0]]
    assert moved.attention_mask.tolist() == [[1, 1, 1, 1], [1, 1, 0, 0]]
    assert (moved.epoch, moved.step, moved.rows) == (b.epoch, b.step, b.rows)
    if as_tensors:
        assert moved.input_ids.data_ptr() == b.input_ids.data_ptr(), "a tensor already there is shared"
    else:
        assert isinstance(b.input_ids, np.ndarray), "the numpy batch itself changed"
        moved.input_ids.fill_(1)  # its own copy: the received arrays are read-only
        assert b.input_ids.tolist() == [[5, 6, 7, 8], [9, 10, 0, 0]]


def test_lockstep_takes_another_rank_s_state_of_the_same_world_and_leaves_the_caller_s() -> None:
    """Lightning's DDP checkpoint holds rank 0's loader state, loaded on every rank."""
    from ladle.client.errors import StateDictError
    from ladle.client.torch_data import BatchDataset

    saved = {"version": 1, "job": "j", "rank": 0, "world_size": 2, "epoch": 1, "step": 7,
             "schedule_fingerprint": "0123456789abcdef"}  # fmt: skip
    original = dict(saved)
    data = BatchDataset(1, 2, "127.0.0.1:1", "j", lockstep=True)
    data.load_state_dict(saved)
    assert data.client.position == (1, 7)
    assert saved == original, "the caller's state was changed"
    with pytest.raises(StateDictError, match="rank"):
        BatchDataset(1, 2, "127.0.0.1:1", "j").load_state_dict(saved)  # without lockstep: refused
    with pytest.raises(StateDictError):
        BatchDataset(1, 4, "127.0.0.1:1", "j", lockstep=True).load_state_dict(saved)  # another world: refused
