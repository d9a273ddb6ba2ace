"""``len(client)`` and ``steps_in_epoch``: an epoch's length, from the server, without joining the job.

A trainer sizes its learning-rate schedule with ``len(loader) * epochs``;
with ladle the count is the server's (the schedule is built there). These
run a real server: the length must equal both the reference schedule and
the batches a rank then actually gets, on every rank, before and during
iteration, after a checkpoint is loaded, for a resized job, and asking must
store nothing and fence no one.
"""

from __future__ import annotations

import time
from pathlib import Path

import grpc
import pytest

from ladle.client import BatchClient, BatchClientError, FencedError, ServerUnavailableError
from ladle.proto import rpc

from .test_serving import CONFIG, Factory, consume, reference


@pytest.mark.parametrize("world", [1, 2, 3])
def test_len_is_each_ranks_batches_in_the_epoch(
    server_factory: Factory, small_dataset: Path, world: int
) -> None:
    server = server_factory()
    job = f"len-{world}"
    clients = [BatchClient(r, world, server.address, job, timeout=30) for r in range(world)]
    try:
        epoch0, epoch1 = (reference(small_dataset, world, e).num_steps for e in (0, 1))
        assert [len(c) for c in clients] == [epoch0] * world  # before the job exists
        for client in clients:
            got = 0
            for got, _batch in enumerate(client, 1):
                if got == 3:
                    assert len(client) == epoch0  # the whole epoch's count, while it is read
            assert got == epoch0
        # each rank finished epoch 0: its next iteration is epoch 1
        assert [len(c) for c in clients] == [epoch1] * world
        assert [c.steps_in_epoch(e) for e in (0, 1, 2) for c in clients[:1]] == [
            reference(small_dataset, world, e).num_steps for e in (0, 1, 2)
        ]
        assert len(consume(clients[0])) == epoch1
    finally:
        for client in clients:
            client.close()


def test_asking_stores_nothing_and_fences_no_one(server_factory: Factory, small_dataset: Path) -> None:
    server = server_factory()
    steps = reference(small_dataset, 2).num_steps
    with BatchClient(0, 2, server.address, "ask-first", timeout=30) as asker:
        assert len(asker) == steps
    with grpc.insecure_channel(server.address) as channel:  # the job was not created by asking
        with pytest.raises(grpc.RpcError) as info:
            rpc.BatchServiceClient(channel).describe("ask-first", timeout=10)
        assert info.value.code() == grpc.StatusCode.NOT_FOUND

    trainer = BatchClient(0, 2, server.address, "busy", timeout=30)
    other = BatchClient(0, 2, server.address, "busy", timeout=30)  # a launcher asking for rank 0's length
    try:
        it = iter(trainer)
        first = [next(it) for _ in range(3)]
        assert len(other) == steps
        rest = list(it)  # not fenced: the trainer reads its epoch to the end
        assert len(first) + len(rest) == steps
    except FencedError as exc:  # pragma: no cover - the failure this test exists for
        pytest.fail(f"asking for the length fenced the trainer: {exc}")
    finally:
        trainer.close()
        other.close()


def test_a_loaded_checkpoint_counts_the_whole_epoch(server_factory: Factory, small_dataset: Path) -> None:
    server = server_factory()
    steps0, steps1 = (reference(small_dataset, 1, e).num_steps for e in (0, 1))
    with BatchClient(0, 1, server.address, "ckpt", timeout=30) as first:
        it = iter(first)
        for _ in range(5):
            next(it)
        mid = first.state_dict()
        for _ in range(steps0 - 5):
            next(it)
        end = first.state_dict()  # taken on the epoch's last batch
    with BatchClient(0, 1, server.address, "ckpt", timeout=30) as resumed:
        resumed.load_state_dict(mid)
        assert len(resumed) == steps0  # the epoch's count, not the rest of it
        assert len(consume(resumed)) == steps0 - 5
    with BatchClient(0, 1, server.address, "ckpt", timeout=30) as resumed:
        resumed.load_state_dict(end)
        assert len(resumed) == steps1  # nothing left of epoch 0: the next iteration is epoch 1
        assert consume(resumed) == []  # (the rest of epoch 0, empty)
        assert len(consume(resumed)) == steps1


def test_a_job_of_another_world_size(server_factory: Factory, small_dataset: Path) -> None:
    server = server_factory()
    with BatchClient(0, 2, server.address, "resized", timeout=30) as two:
        it = iter(two)
        for _ in range(4):
            next(it)
        state = two.state_dict()
    with BatchClient(1, 2, server.address, "resized", timeout=30) as other:
        consume(other, 4)  # a resize at rank 0's checkpoint is refused while a rank's cursor is behind it
    with BatchClient(0, 3, server.address, "resized", timeout=30) as plain:
        with pytest.raises(BatchClientError, match="has 2 ranks and this client 3") as info:
            len(plain)
        assert info.value.code == "FAILED_PRECONDITION"
    with BatchClient(0, 3, server.address, "resized", elastic=True, timeout=30) as three:
        three.load_state_dict(state)
        length = len(three)  # resizes the job, as the first batch would, then counts
        assert len(consume(three)) == length
        assert len(three) == reference(small_dataset, 3, 1).num_steps  # later epochs: the plain schedule


def test_a_job_deleted_from_the_store_is_counted_as_new(
    server_factory: Factory, small_dataset: Path, tmp_path: Path
) -> None:
    """``ladle jobs --delete`` under a server that served the job: the length is the new job's."""
    from ladle.service.store import EmbeddedStore

    state_db = tmp_path / "deleted.db"
    server = server_factory(state=state_db)
    with BatchClient(0, 2, server.address, "gone", timeout=30) as client:
        it = iter(client)
        for _ in range(3):
            next(it)
    store = EmbeddedStore(state_db)
    try:
        assert store.delete_job("gone")
    finally:
        store.close()
    with BatchClient(0, 2, server.address, "gone", timeout=30) as again:
        assert len(again) == reference(small_dataset, 2).num_steps


def test_no_server_is_a_clear_error_after_the_timeout() -> None:
    import socket

    with socket.socket() as sock:  # a port nothing listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with BatchClient(0, 1, f"127.0.0.1:{port}", "nobody", timeout=1.5) as client:
        began = time.monotonic()
        with pytest.raises(ServerUnavailableError):
            len(client)
        assert time.monotonic() - began < 10


def test_truth_asks_nothing() -> None:
    """``if client:`` is true at once: with ``__len__`` defined it would otherwise be a call to the server."""
    with BatchClient(0, 1, "127.0.0.1:9", "x", timeout=30) as client:
        began = time.monotonic()
        assert client
        assert time.monotonic() - began < 1


@pytest.mark.parametrize("epoch", [-1, 1.5, True, "2"])
def test_a_bad_epoch_is_refused_before_any_call(epoch: object) -> None:
    with BatchClient(0, 1, "127.0.0.1:9", "x", timeout=1) as client, pytest.raises(ValueError, match="epoch"):
        client.steps_in_epoch(epoch)  # type: ignore[arg-type]


def test_describe_names_a_world_size_for_a_job_not_created_yet(
    server_factory: Factory, small_dataset: Path
) -> None:
    server = server_factory()
    with grpc.insecure_channel(server.address) as channel:
        stub = rpc.BatchServiceClient(channel)
        info = stub.describe("not-yet", timeout=30, world_size=4, epoch=2)
        assert (info.job, info.world_size, info.epoch) == ("not-yet", 4, 2)
        assert info.steps_per_epoch == reference(small_dataset, 4, 2).num_steps
        for bad, code in (("", 4), ("../x", 4), ("big", 2**32 - 1)):
            with pytest.raises(grpc.RpcError) as raised:
                stub.describe(bad, timeout=30, world_size=code)
            assert raised.value.code() in (
                grpc.StatusCode.INVALID_ARGUMENT,
                grpc.StatusCode.FAILED_PRECONDITION,
            ), (bad, raised.value)
        with pytest.raises(grpc.RpcError) as missing:  # still not created
            stub.describe("not-yet", timeout=30)
        assert missing.value.code() == grpc.StatusCode.NOT_FOUND


def test_len_of_a_dataloader(server_factory: Factory, small_dataset: Path) -> None:
    torch_data = pytest.importorskip("torch.utils.data")
    from ladle.client.torch_data import BatchDataset

    server = server_factory()
    dataset = BatchDataset(0, 1, server.address, "loader", timeout=30)
    try:
        loader = torch_data.DataLoader(dataset, batch_size=None)
        assert len(loader) == reference(small_dataset, 1).num_steps
        assert sum(1 for _ in loader) == len(loader)
    finally:
        dataset.close()


def test_a_fresh_client_counts_the_epoch_its_stream_starts_in(
    server_factory: Factory, small_dataset: Path
) -> None:
    """With no checkpoint, a rank starts at its own cursor (or, unless ``own_cursor``, at a rank just
    behind it): ``len`` counts that epoch, not the epoch of the job's slowest rank."""
    server = server_factory(["--sort-chunk", "64"])  # epochs packed to different lengths
    config = CONFIG.model_copy(update={"sort_chunk": 64})
    steps0, steps1 = (reference(small_dataset, 2, e, config).num_steps for e in (0, 1))
    assert steps0 != steps1, "the test needs epochs of different lengths"
    with BatchClient(0, 2, server.address, "apart", timeout=30, own_cursor=True) as ahead:
        assert len(consume(ahead)) == steps0  # rank 0 read all of epoch 0; rank 1 has not started
    with BatchClient(0, 2, server.address, "apart", timeout=30, own_cursor=True) as fresh:
        assert len(fresh) == steps1, "counted the slowest rank's epoch, not this rank's"
    with BatchClient(0, 2, server.address, "apart", timeout=30) as fresh:
        assert len(fresh) == steps1  # no rank just behind it: its own cursor too
    with BatchClient(1, 2, server.address, "apart", timeout=30) as behind:
        assert len(behind) == steps0
        assert len(consume(behind, limit=steps0 - 2)) == steps0 - 2  # 2 steps behind rank 0
    with BatchClient(0, 2, server.address, "apart", timeout=30) as aligned:
        assert len(aligned) == steps0, "rank 0 starts at the job's cursor (rank 1's), in epoch 0"
        got = consume(aligned)
        assert [b["step"] for b in got] == [steps0 - 2, steps0 - 1], "not the job's cursor"
    with BatchClient(0, 2, server.address, "apart", timeout=30, own_cursor=True) as own:
        assert len(own) == steps1
        got = consume(own)
        assert len(got) == steps1
        assert {b["epoch"] for b in got} == {1}
