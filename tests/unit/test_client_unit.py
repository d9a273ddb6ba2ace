"""BatchClient without a server: the Batch it makes, the grpcio API it uses, the errors it retries."""

from __future__ import annotations

import dataclasses
import re
import time
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest

import ladle.client
from ladle.client import Batch, BatchClient, BatchClientError, ServerUnavailableError
from ladle.client._device import converter
from ladle.proto import codec, rpc
from ladle.proto import ladle_pb2 as pb

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


def test_the_client_uses_only_grpcios_public_api() -> None:
    """No private grpcio module or name, and no grpcio experiments: they change without notice.

    STYLE.md: a private layer is opt-in and must earn its place by a measured
    gain; the polled reader over grpcio's Cython layer saved a tenth of the
    trainer's CPU and was removed (docs/serving.md).
    """
    root = Path(ladle.client.__file__).parent
    sources = [
        *sorted(root.glob("*.py")),
        root.parent / "proto" / "rpc.py",
        root.parent / "proto" / "codec.py",
    ]
    private = re.compile(r"grpc\._|_cython|cygrpc|GRPC_EXPERIMENTS")
    found = [
        f"{path.name}:{n}: {line.strip()}"
        for path in sources
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if private.search(line)
    ]
    assert not found, f"the client reaches into grpcio's private API: {found}"


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


class _Refused(grpc.RpcError):  # type: ignore[misc]
    """A call's status as grpcio raises it: a code, details and trailing metadata."""

    def __init__(self, code: grpc.StatusCode, message: str, reason: str | None = None) -> None:
        super().__init__(message)
        self._code, self._message = code, message
        error = pb.Error(code=code.name, reason=reason, message=message) if reason is not None else None
        self._trailers = rpc.error_trailer(error) if error is not None else ()

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._message

    def trailing_metadata(self) -> Any:
        return self._trailers


class _BusyStub:
    """A server that refuses the first ``refusals`` Describes with ``error``, then answers."""

    def __init__(self, error: _Refused, refusals: int) -> None:
        self.error, self.left, self.calls = error, refusals, 0

    def describe(self, job: str, timeout: float | None = None, **_: Any) -> pb.JobInfo:
        self.calls += 1
        if self.left > 0:
            self.left -= 1
            raise self.error
        return pb.JobInfo(job=job, world_size=1, steps_per_epoch=7)


_BUSY = [
    (
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        "this batch server has 65 calls in progress, its limit (ladle serve --max-sessions + 64)",
        "too_many_calls",
    ),
    (grpc.StatusCode.RESOURCE_EXHAUSTED, "Concurrent RPC limit exceeded!", None),  # grpcio's own limit
    # a server too loaded to read the request the client sent with the call (1,000 ranks at once)
    (grpc.StatusCode.DEADLINE_EXCEEDED, "the call sent no Open within 10 s of opening", "no_open"),
    (grpc.StatusCode.DEADLINE_EXCEEDED, "the call sent no request within 10 s of opening", "no_request"),
]


@pytest.mark.parametrize(("code", "message", "reason"), _BUSY)
def test_a_server_at_its_call_limit_is_retried_with_backoff(
    monkeypatch: pytest.MonkeyPatch, code: grpc.StatusCode, message: str, reason: str | None
) -> None:
    """RESOURCE_EXHAUSTED for the calls in progress, or a server that saw no first request within its
    handshake timeout, passes: the client backs off and tries again within its timeout, as for
    UNAVAILABLE, instead of failing at once."""
    stub = _BusyStub(_Refused(code, message, reason), refusals=3)
    slept: list[float] = []
    client = BatchClient(0, 1, "127.0.0.1:1", "busy", timeout=30)
    monkeypatch.setattr(client._connection, "connect", lambda deadline: stub)
    monkeypatch.setattr(time, "sleep", slept.append)
    try:
        assert client._describe(0).steps_per_epoch == 7
        assert stub.calls == 4
        assert slept == [0.05, 0.1, 0.2], "not the client's backoff"
        error = client._connection.map_error(_Refused(code, message, reason))
        assert isinstance(error, ServerUnavailableError)
        assert error.code == code.name
    finally:
        monkeypatch.undo()
        client.close()


def test_a_server_busy_past_the_timeout_fails_with_its_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    now = [1000.0]
    stub = _BusyStub(_Refused(*_BUSY[0]), refusals=10**6)
    client = BatchClient(0, 1, "127.0.0.1:1", "busy", timeout=5)
    monkeypatch.setattr(client._connection, "connect", lambda deadline: stub)
    monkeypatch.setattr(time, "monotonic", lambda: now[0])
    monkeypatch.setattr(time, "sleep", lambda s: now.__setitem__(0, now[0] + s))
    try:
        with pytest.raises(ServerUnavailableError, match="calls in progress") as info:
            client._describe(0)
    finally:
        monkeypatch.undo()
        client.close()
    assert info.value.code == "RESOURCE_EXHAUSTED"
    # 0.05 + 0.1 + ... + 1.6 s of backoff; the next wait (2 s) would pass the 5 s timeout
    assert now[0] - 1000.0 == pytest.approx(3.15), "the retries did not stay within the timeout"
    assert stub.calls == 7


@pytest.mark.parametrize(
    ("message", "reason"),
    [
        ("this batch server already serves 8 trainer sessions", "too_many_sessions"),
        ("Received message larger than max (5123 vs. 4096)", None),
    ],
)
def test_other_resource_exhausted_answers_fail_at_once(
    monkeypatch: pytest.MonkeyPatch, message: str, reason: str | None
) -> None:
    """Sessions all taken, a request over the size limit: retrying does not help, so no retry."""
    stub = _BusyStub(_Refused(grpc.StatusCode.RESOURCE_EXHAUSTED, message, reason), refusals=1)
    client = BatchClient(0, 1, "127.0.0.1:1", "busy", timeout=30)
    monkeypatch.setattr(client._connection, "connect", lambda deadline: stub)
    monkeypatch.setattr(time, "sleep", lambda s: pytest.fail("retried"))
    try:
        with pytest.raises(BatchClientError) as info:
            client._describe(0)
    finally:
        monkeypatch.undo()
        client.close()
    assert not isinstance(info.value, ServerUnavailableError)
    assert info.value.code == "RESOURCE_EXHAUSTED"
    assert stub.calls == 1
