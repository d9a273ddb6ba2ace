"""A real ``ladle serve`` process and real ``BatchClient`` trainers on loopback.

Every stream is compared with ``build_schedule`` rank by rank and byte for
byte with the rows read straight from the dataset.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest

from ladle.client import BatchClient, BatchClientError, FencedError, ServerUnavailableError, StateDictError
from ladle.proto import ladle_pb2 as pb
from ladle.proto import rpc
from ladle.service.dataset import open_dataset
from ladle.service.schedule import Schedule, ScheduleConfig, build_schedule

CONFIG = ScheduleConfig(
    max_seq_len=512, bucket_bounds=(0, 48, 76, 108, 152, 206, 513), token_budget=3072, max_batch_size=16
)

Factory = Callable[..., Any]


def reference(dataset: Path, world: int, epoch: int = 0, config: ScheduleConfig = CONFIG) -> Schedule:
    return build_schedule(open_dataset(dataset).lengths, config, epoch=epoch, world_size=world)


def consume(client: BatchClient, limit: int | None = None) -> list[dict[str, Any]]:
    """Batches of one epoch (or the first ``limit``), copied out of the received frames."""
    out = []
    for batch in client:
        out.append(
            {
                "epoch": batch.epoch,
                "step": batch.step,
                "bucket": batch.bucket,
                "sample_ids": np.array(batch.sample_ids),
                "input_ids": np.array(batch.input_ids),
                "loss_mask": np.array(batch.loss_mask),
                "attention_mask": np.array(batch.attention_mask),
                "lengths": np.array(batch.lengths),
            }
        )
        if limit is not None and len(out) >= limit:
            break
    return out


def drain(it: Any, most: int) -> None:
    """Take up to ``most`` batches (a test that expects the stream to fail on the way)."""
    for _ in range(most):
        next(it)


def check_rank_stream(
    dataset: Path, sched: Schedule, rank: int, got: list[dict[str, Any]], max_seq_len: int = 512
) -> None:
    table = open_dataset(dataset).table
    assert [b["step"] for b in got] == list(range(sched.num_steps)), (
        f"rank {rank}: steps missing or out of order"
    )
    for b in got:
        step = b["step"]
        rows = sched.samples(step, rank)
        assert np.array_equal(b["sample_ids"], rows), (
            f"rank {rank} step {step}: other samples than the schedule"
        )
        assert b["bucket"] == sched.bucket(step, rank)
        assert b["input_ids"].shape == (len(rows), sched.padded_len(step, rank))
        ids = table.column("input_ids").take(rows).to_pylist()
        mask = table.column("loss_mask").take(rows).to_pylist()
        for i, (row_ids, row_mask) in enumerate(zip(ids, mask, strict=True)):
            n = min(len(row_ids), max_seq_len)  # the width can be more (pad_to_multiple_of)
            assert n <= b["input_ids"].shape[1]
            assert b["lengths"][i] == n
            assert b["input_ids"][i, :n].tolist() == row_ids[:n], (
                f"rank {rank} step {step}: token bytes differ"
            )
            assert b["loss_mask"][i, :n].tolist() == row_mask[:n]
            assert not b["input_ids"][i, n:].any(), "padding is not zero"
            assert not b["loss_mask"][i, n:].any(), "loss on padding"
            assert b["attention_mask"][i, :n].all(), "attention mask misses real tokens"
            assert not b["attention_mask"][i, n:].any(), "attention mask covers padding"


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_ranks_consume_an_epoch_exactly_once(
    server_factory: Factory, small_dataset: Path, world: int
) -> None:
    server = server_factory()
    results: dict[int, list[dict[str, Any]]] = {}
    errors: list[BaseException] = []

    def run(rank: int) -> None:
        try:
            with BatchClient(rank, world, server.address, f"w{world}", timeout=30) as client:
                results[rank] = consume(client)
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors
    sched = reference(small_dataset, world)
    for rank in range(world):
        check_rank_stream(small_dataset, sched, rank, results[rank])
    served = np.concatenate([b["sample_ids"] for r in results.values() for b in r])
    assert len(np.unique(served)) == len(served), "duplicate samples"
    assert len(served) + len(sched.dropped) == open_dataset(small_dataset).num_rows, "missing samples"


def test_rows_are_cut_at_max_seq_len_when_batches_are_padded_wider(
    server_factory: Factory, small_dataset: Path
) -> None:
    """max_seq_len 100, pad_to_multiple_of 64: batches are 128 wide, and long rows arrived 128 long."""
    flags = ["--max-seq-len", "100", "--bucket-bounds", "0,48,101", "--pad-to-multiple-of", "64"]
    server = server_factory(extra=flags)
    with BatchClient(0, 1, server.address, "cut", timeout=30) as client:
        got = consume(client)
    config = ScheduleConfig(
        max_seq_len=100,
        bucket_bounds=(0, 48, 101),
        token_budget=3072,
        max_batch_size=16,
        pad_to_multiple_of=64,
    )
    sched = reference(small_dataset, 1, config=config)
    assert {b["input_ids"].shape[1] for b in got} == {64, 128}
    assert max(int(b["lengths"].max()) for b in got) == 100
    check_rank_stream(small_dataset, sched, 0, got, max_seq_len=100)


def test_the_stream_delivers_the_schedule_and_survives_a_kill_9(
    server_factory: Factory, small_dataset: Path
) -> None:
    server = server_factory()
    with BatchClient(0, 1, server.address, "kill-9", timeout=60) as client:
        part = consume(client, limit=9)
        server.kill()
        server_factory(state=server.state, port=server.port)
        got = part + consume(client)
        assert client.reconnects >= 1, "the client never had to reconnect"
    check_rank_stream(small_dataset, reference(small_dataset, 1), 0, got)


def test_a_held_back_ack_reaches_the_store_while_the_trainer_pauses(server_factory: Factory) -> None:
    """A fast consumer's acks are grouped, but one held back still goes within ACK_DELAY."""
    from .test_http import wait_for_cursor  # (test_http imports this module)

    server = server_factory()
    client = BatchClient(0, 1, server.address, "pause", timeout=30, prefetch=8)
    try:
        it = iter(client)
        for _ in range(4):  # consumed: 3 (the 4th is held); 3 < the group of 6, sent at once
            next(it)
        # no next(), no state_dict(): only the held-back ack's timer can move the cursor
        cursor = wait_for_cursor(server, "pause", [3])
        assert [r["step"] for r in cursor["ranks"]] == [3], f"stored cursor {cursor['ranks']}, consumed 3"
    finally:
        client.close()


def test_close_after_the_server_died_is_prompt(server_factory: Factory) -> None:
    server = server_factory()
    client = BatchClient(0, 1, server.address, "gone", timeout=30, prefetch=4)
    consume(client, limit=3)
    server.kill()
    time.sleep(0.5)  # the stream has seen the connection go
    began = time.monotonic()
    client.close()
    assert time.monotonic() - began < 0.5, "close() waited for a server that is gone"


def test_close_right_after_connecting_is_prompt(server_factory: Factory) -> None:
    """close() does not wait out grpcio's connectivity watch (0.2 s after the channel became ready)."""
    server = server_factory()
    took = []
    for i in range(3):  # the best of three: a loaded machine may slow one
        client = BatchClient(0, 1, server.address, f"short-{i}", timeout=30)
        consume(client, limit=3)
        began = time.monotonic()
        client.close()
        took.append(time.monotonic() - began)
    assert min(took) < 0.15, f"close() took {took} s right after connecting (grpcio's watch is 0.2 s)"


def test_next_epoch_continues(server_factory: Factory, small_dataset: Path) -> None:
    server = server_factory()
    with BatchClient(0, 1, server.address, "epochs", timeout=30) as client:
        first = consume(client)
        second = consume(client)
    assert {b["epoch"] for b in first} == {0}
    assert {b["epoch"] for b in second} == {1}
    check_rank_stream(small_dataset, reference(small_dataset, 1, epoch=1), 0, second)


def test_kill_9_and_restart_is_invisible(
    server_factory: Factory, small_dataset: Path, tmp_path: Path
) -> None:
    world = 2
    server = server_factory()
    clients = [BatchClient(r, world, server.address, "crash", timeout=60) for r in range(world)]
    got: dict[int, list[dict[str, Any]]] = {r: consume(clients[r], limit=7) for r in range(world)}
    server.kill()
    # the same state file and the same port: the trainers know only the address
    server_factory(state=server.state, port=server.port)
    for r in range(world):
        got[r] += consume(clients[r])
        clients[r].close()
    sched = reference(small_dataset, world)
    for r in range(world):
        check_rank_stream(small_dataset, sched, r, got[r])
    assert clients[0].reconnects >= 1, "the client never had to reconnect"


def test_resume_from_state_dict(server_factory: Factory, small_dataset: Path) -> None:
    server = server_factory()
    with BatchClient(1, 2, server.address, "resume", timeout=30) as first:
        part = consume(first, limit=5)
        state = first.state_dict()
    snapshot = dict(state)
    with BatchClient(1, 2, server.address, "resume", timeout=30) as second:
        second.load_state_dict(state)
        rest = consume(second)
    assert state == snapshot, "load_state_dict changed the caller's dict"
    check_rank_stream(small_dataset, reference(small_dataset, 2), 1, part + rest)


def test_state_dict_mismatch_is_refused(server_factory: Factory) -> None:
    server = server_factory()
    with BatchClient(0, 2, server.address, "sd", timeout=30) as client:
        consume(client, limit=1)
        state = client.state_dict()
    other = BatchClient(1, 2, server.address, "sd", timeout=30)
    with pytest.raises(StateDictError, match="rank"):
        other.load_state_dict(state)
    with pytest.raises(StateDictError, match="lacks"):
        other.load_state_dict({"epoch": 0})
    bad = dict(state, step=-1)
    with pytest.raises(StateDictError, match="non-negative"):
        BatchClient(0, 2, server.address, "sd").load_state_dict(bad)
    wrong = dict(state, schedule_fingerprint="0000000000000000")
    client = BatchClient(0, 2, server.address, "sd", timeout=30)
    client.load_state_dict(wrong)
    with pytest.raises(BatchClientError) as info:
        consume(client, limit=1)
    assert info.value.code == "FAILED_PRECONDITION"
    client.close()


def test_a_replaced_trainer_is_fenced(server_factory: Factory) -> None:
    server = server_factory()
    old = BatchClient(0, 1, server.address, "fence", timeout=30, prefetch=1)
    it = iter(old)
    next(it)
    new = BatchClient(0, 1, server.address, "fence", timeout=30)
    consume(new, limit=1)
    with pytest.raises(FencedError, match="replaced"):  # noqa: PT012 - the fence shows on a later batch
        for _ in range(50):
            next(it)
    new.close()
    with pytest.raises(FencedError):  # a replaced process reports no clean end
        old.close()


def test_ranks_that_disagree_on_world_size(server_factory: Factory) -> None:
    server = server_factory()
    with BatchClient(0, 2, server.address, "ws", timeout=30) as client:
        consume(client, limit=1)
    with (
        BatchClient(0, 3, server.address, "ws", timeout=30) as client,
        pytest.raises(BatchClientError) as info,
    ):
        consume(client, limit=1)
    assert info.value.code == "FAILED_PRECONDITION"
    assert "world_size" in str(info.value)


def test_job_started_with_another_config(server_factory: Factory, tmp_path: Path) -> None:
    server = server_factory()
    with BatchClient(0, 1, server.address, "cfg", timeout=30) as client:
        consume(client, limit=1)
    assert server.stop() == 0, "SIGTERM did not exit 0"
    other = server_factory(extra=["--seed", "99"], state=server.state)
    with (
        BatchClient(0, 1, other.address, "cfg", timeout=30) as client,
        pytest.raises(BatchClientError) as info,
    ):
        consume(client, limit=1)
    assert info.value.code == "FAILED_PRECONDITION"
    assert "config" in str(info.value)


def test_rank_out_of_range() -> None:
    with pytest.raises(ValueError, match="outside"):
        BatchClient(2, 2, "127.0.0.1:1")


def test_server_rejects_bad_open(server_factory: Factory) -> None:
    server = server_factory()
    with grpc.insecure_channel(server.address) as channel:
        stub = rpc.BatchServiceClient(channel)
        opening = pb.StreamRequest(open=pb.Open(job="raw", rank=3, world_size=2, prefetch=2))
        with pytest.raises(grpc.RpcError) as info:
            list(stub.stream(iter([opening]), timeout=10))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        details = rpc.error_details(info.value.trailing_metadata())
        assert details is not None
        assert "rank" in details.message


def test_no_server_is_a_clear_error_not_a_hang() -> None:
    began = time.monotonic()
    with pytest.raises(ServerUnavailableError, match="no batch server"):
        consume(BatchClient(0, 1, "127.0.0.1:9", "none", timeout=1.0), limit=1)
    assert time.monotonic() - began < 10


def test_a_client_that_stops_reading_holds_the_server_bounded(server_factory: Factory) -> None:
    server = server_factory()
    client = BatchClient(0, 1, server.address, "slow", timeout=30, prefetch=2)
    it = iter(client)
    next(it)
    before = server.rss_kib()
    time.sleep(2.0)  # the client reads nothing; the server may only have sent its window
    after = server.rss_kib()
    assert after - before < 20_000, f"server RSS grew {after - before} KiB for a stalled client"
    assert client._stream is not None
    assert client._stream.buffered() <= 2, "more than the window was received"
    # the server's own count: batches sent to the stalled rank beyond what it consumed
    from .test_http import metrics  # (test_http imports this module)

    labels = (("job", "slow"), ("rank", "0"))
    sent = metrics(server)[("ladle_batches_served_total", labels)]
    assert sent <= 1 + 2, f"{sent} batches sent to a client that took 1 with a window of 2"
    client.close()


def test_sigterm_exits_zero(server_factory: Factory) -> None:
    server = server_factory()
    with BatchClient(0, 1, server.address, "term", timeout=30) as client:
        consume(client, limit=2)
    assert server.stop() == 0


_DYING_TRAINER = """
import os, sys, time
from ladle.client import BatchClient
client = BatchClient(0, 1, sys.argv[1], sys.argv[2], timeout=30)
it = iter(client)
for _ in range(int(sys.argv[3])):
    batch = next(it)
print(batch.step, flush=True)
time.sleep(0.3)  # longer than the acknowledgement delay
os._exit(1)  # dies holding its last batch: no close, no state_dict
"""


def test_a_trainer_that_dies_gets_its_held_batch_again(server_factory: Factory, small_dataset: Path) -> None:
    import subprocess
    import sys

    server = server_factory()
    out = subprocess.run(
        [sys.executable, "-c", _DYING_TRAINER, server.address, "dies", "6"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    held = int(out.stdout.split()[-1])
    assert held == 5, out.stderr
    with BatchClient(0, 1, server.address, "dies", timeout=30) as client:  # no checkpoint: the store cursor
        rest = consume(client)
    assert rest[0]["step"] == held, "the batch held when the trainer died was not sent again"
    check_rank_stream(
        small_dataset, reference(small_dataset, 1), 0, consume_prefix(small_dataset, held) + rest
    )


def consume_prefix(dataset: Path, steps: int) -> list[dict[str, Any]]:
    """Placeholders for the steps a dead trainer consumed, so the stream check sees a whole epoch."""
    sched = reference(dataset, 1)
    table = open_dataset(dataset).table
    out = []
    for step in range(steps):
        rows = sched.samples(step, 0)
        width = sched.padded_len(step, 0)
        ids = np.zeros((len(rows), width), np.int32)
        mask = np.zeros((len(rows), width), np.int8)
        att = np.zeros((len(rows), width), np.int8)
        lengths = np.zeros(len(rows), np.int32)
        for i, (row_ids, row_mask) in enumerate(
            zip(
                table.column("input_ids").take(rows).to_pylist(),
                table.column("loss_mask").take(rows).to_pylist(),
                strict=True,
            )
        ):
            n = min(len(row_ids), width)
            ids[i, :n], mask[i, :n], att[i, :n], lengths[i] = row_ids[:n], row_mask[:n], 1, n
        out.append(
            {
                "epoch": 0,
                "step": step,
                "bucket": sched.bucket(step, 0),
                "sample_ids": rows,
                "input_ids": ids,
                "loss_mask": mask,
                "attention_mask": att,
                "lengths": lengths,
            }
        )
    return out
