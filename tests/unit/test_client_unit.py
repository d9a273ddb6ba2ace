"""BatchClient without a server: the Batch it makes per batch, and which reader it picks."""

from __future__ import annotations

import dataclasses

import grpc
import numpy as np
import pytest

from ladle.client import Batch, BatchClient, _direct
from ladle.client import client as client_module
from ladle.client._device import converter
from ladle.proto import codec

from .test_proto import make_frame


def decoded() -> codec.DecodedBatch:
    frame, _ = make_frame(rows=3, padded_len=6, seed=5)
    return codec.decode_batch(frame)


def test_the_client_makes_the_batch_batch_init_makes() -> None:
    """``Batch._make`` (one ``__dict__`` update) sets every field ``Batch()`` sets, and stays frozen."""
    d = decoded()
    got = converter(None, None)(d)
    made = Batch(
        input_ids=d.input_ids,
        loss_mask=d.loss_mask,
        lengths=d.lengths,
        sample_ids=d.sample_ids,
        epoch=d.epoch,
        step=d.step,
        rank=d.rank,
        bucket=d.bucket,
        real_tokens=d.real_tokens,
        padded_tokens=d.padded_tokens,
    )
    for f in dataclasses.fields(Batch):
        mine, theirs = getattr(got, f.name), getattr(made, f.name)
        if f.name == "_mask":
            continue  # the client's makes the mask lazily; Batch() makes it from lengths
        if isinstance(theirs, np.ndarray):
            assert mine is getattr(d, f.name), f"{f.name} is not the received view"
        else:
            assert mine == theirs, f.name
    assert set(vars(got)) >= {f.name for f in dataclasses.fields(Batch)}, "a field was left unset"
    np.testing.assert_array_equal(got.attention_mask, made.attention_mask)
    assert got.attention_mask.dtype == np.int8
    assert (got.rows, got.padded_len) == (3, 6)
    with pytest.raises(dataclasses.FrozenInstanceError):
        got.step = 10  # type: ignore[misc]
    assert repr(got) == repr(made)


@pytest.mark.parametrize(
    ("reader", "version", "polled"),
    [
        ("auto", "1.85.3", True),  # a tested grpcio: the polled reader
        ("auto", "1.86.0", False),  # a later one: grpcio's public iterator
        ("auto", "2.0.0rc1", False),
        ("auto", "", False),
        ("polled", "1.99.0", True),  # asked for on any grpcio that has the calls
        ("thread", "1.85.3", False),
    ],
)
def test_the_reader_follows_the_setting_and_the_grpcio_version(
    monkeypatch: pytest.MonkeyPatch, reader: str, version: str, polled: bool
) -> None:
    monkeypatch.setattr(client_module, "_READER", reader)
    monkeypatch.setattr(grpc, "__version__", version)
    client = BatchClient(0, 1, "127.0.0.1:1", "reader", timeout=1)  # connects on first use only
    try:
        assert client._polled is polled
    finally:
        client.close()


def test_the_installed_grpcio_is_one_the_polled_reader_was_tested_with() -> None:
    """A grpcio upgrade past ``_direct.TESTED_GRPC`` fails here: test the polled reader on it, then add it."""
    assert _direct.grpc_is_tested(), f"grpcio {grpc.__version__} is not in {_direct.TESTED_GRPC}"


def test_cuda_without_an_index_is_the_constructing_threads_device(monkeypatch: pytest.MonkeyPatch) -> None:
    """``device="cuda"`` after ``torch.cuda.set_device(3)`` is cuda:3, not the reader thread's device 0."""
    torch = pytest.importorskip("torch")
    from ladle.client._device import check_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    assert check_device("cuda", None) == torch.device("cuda", 3)
    assert check_device(torch.device("cuda"), None) == torch.device("cuda", 3)
    assert check_device("cuda:1", None) == torch.device("cuda", 1)
    with pytest.raises(ValueError, match="sees 4 CUDA device"):
        check_device("cuda:4", None)
    assert check_device("cpu", None) == torch.device("cpu")
    assert check_device(None, None) is None


def test_a_batch_moved_or_pickled_carries_no_device_hook() -> None:
    """``_ready`` (the CUDA event of a batch's copies) is the client's: ``to()`` and pickling drop it."""
    import pickle

    pytest.importorskip("torch")
    d = decoded()
    batch = converter(None, None)(d)
    batch.__dict__["_ready"] = lambda: None
    assert batch.to("cpu")._ready is None
    assert pickle.loads(pickle.dumps(batch))._ready is None
    assert np.array_equal(batch.to("cpu").attention_mask.numpy(), np.asarray(batch.attention_mask))
