"""What a trainer can do with a ``BatchClient`` beyond the plain loop, against a real server.

Each case is a way a real training script uses (or misuses) its client: it
leaves a ``with`` block on an exception, stops right after an epoch's last
batch, saves a checkpoint before its first batch, keeps running after it was
fenced, forks, pickles a batch, forgets ``close()``, or shares the client
between threads. Each must keep exactly-once delivery or fail clearly.
"""

from __future__ import annotations

import contextlib
import copy
import gc
import itertools
import os
import pickle
import re
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from ladle.client import BatchClient
from ladle.client.errors import BatchClientError, FencedError, StateDictError
from ladle.service.synth import make_dataset

Server = Callable[..., Any]


def steps(client: BatchClient, n: int) -> list[int]:
    """The steps of the next ``n`` batches of the current iteration (a fresh one)."""
    return [batch.step for _, batch in zip(range(n), client, strict=False)]


def world_checkpoint(address: str, job: str, world: int, n: int) -> dict[str, Any]:
    """Every rank of a ``world``-rank job takes ``n`` batches and closes: rank 0's state, taken then."""
    clients = [BatchClient(r, world, address, job, timeout=30) for r in range(world)]
    for client in clients:
        steps(client, n)
    saved = clients[0].state_dict()
    for client in clients:
        client.close()
    return saved


def test_an_exception_in_a_with_block_does_not_consume_the_batch(module_server: Any) -> None:
    """The trainer died on step 5 (an OOM): the next process trains on step 5 again."""

    def train() -> None:
        with BatchClient(0, 1, module_server.address, "with-exc") as c:
            for batch in c:
                if batch.step == 5:
                    raise RuntimeError("OOM")

    with pytest.raises(RuntimeError, match="OOM"):
        train()
    with BatchClient(0, 1, module_server.address, "with-exc") as again:
        assert steps(again, 1) == [5]
    with BatchClient(0, 1, module_server.address, "with-ok") as c:  # a clean exit consumes it
        assert steps(c, 6) == list(range(6))
    with BatchClient(0, 1, module_server.address, "with-ok") as again:
        assert steps(again, 1) == [6]


@pytest.mark.parametrize("where", ["taken", "checked", "returned"])
def test_ctrl_c_inside_next_loses_no_batch(module_server: Any, where: str) -> None:
    """A KeyboardInterrupt raised just after a frame left the stream's queue, before the position moved.

    A trainer that catches it (a checkpoint, then on; a notebook's interrupted
    cell run again) must go on at the batch it did not get, not lose it
    (the next frame would then be refused as out of order) or skip it.
    """
    job = f"ctrl-c-{where}"
    with BatchClient(0, 1, module_server.address, job) as c:
        assert steps(c, 5) == list(range(5))
        checked = c._check_batch  # runs on the trainer's thread with the frame already dequeued
        interrupts: list[int] = []

        def interrupted(batch: Any) -> None:
            if not interrupts:
                interrupts.append(batch.step)
                if where == "taken":
                    raise KeyboardInterrupt
            checked(batch)
            if len(interrupts) == 1 and where == "checked":
                interrupts.append(batch.step)
                raise KeyboardInterrupt

        c._check_batch = interrupted  # type: ignore[method-assign]
        if where == "returned":  # the position moved past the batch, then the interrupt
            c._check_batch = checked  # type: ignore[method-assign]
            take = c._take

            def taken_then_interrupted(first: bool) -> Any:
                batch = take(first)
                assert batch is not None
                if not interrupts:
                    interrupts.append(batch.step)
                    raise KeyboardInterrupt
                return batch

            c._take = taken_then_interrupted  # type: ignore[method-assign]
        with pytest.raises(KeyboardInterrupt):
            next(iter(c))
        assert interrupts[0] == 5
        assert (c.state_dict()["epoch"], c.state_dict()["step"]) == (0, 5), "the checkpoint moved past step 5"
        assert steps(c, 4) == [5, 6, 7, 8], "the interrupted batch was lost or the stream broke"
        with pytest.raises(ValueError, match=r"epoch must be an integer in 0\.\.9007199254740991"):
            c.steps_in_epoch(10**20)  # was protobuf's "Value out of range", naming no argument
    with BatchClient(0, 1, module_server.address, job) as again:
        assert steps(again, 1) == [9], "the server's cursor is not where the trainer stopped"


def test_two_iterations_of_one_client_each_end_with_their_epoch(module_server: Any) -> None:
    """Two iterators of one client, taken in turn: neither runs on into the next epoch."""
    with BatchClient(0, 1, module_server.address, "two-iterators") as c:
        first, second = iter(c), iter(c)
        got = [next(first).step, next(second).step, next(first).step]
        got += [batch.step for batch in first]  # the rest of the epoch
        assert got == list(range(len(got))), "a batch was lost or repeated between the iterators"
        assert list(second) == [], "the second iteration ran on into the next epoch"
        assert [batch.epoch for batch in itertools.islice(c, 2)] == [1, 1], "the next iteration is epoch 1"


def test_stopping_after_an_epochs_last_batch_does_not_make_an_empty_epoch(module_server: Any) -> None:
    with BatchClient(0, 1, module_server.address, "last-break", timeout=30) as c:
        total = len(list(c))
        assert c.state_dict()["epoch"] == 1
        for batch in c:  # epoch 1, stopped on its last batch
            if batch.step == total - 1:
                break
        following = [(b.epoch, b.step) for b in c]
        assert following == [(2, s) for s in range(total)], "the next iteration was not epoch 2"


def test_a_checkpoint_on_an_epochs_last_batch_resumes_into_that_epochs_empty_rest(module_server: Any) -> None:
    """The usual loop, resumed: `for epoch in range(saved_epoch, N): for batch in client:` trains N epochs.

    The first iteration after the load used to be the next epoch, so a run resumed from
    a checkpoint taken on an epoch's last batch trained one epoch more than asked.
    """
    with BatchClient(0, 1, module_server.address, "last-ckpt") as c:
        total = len(list(c))  # epoch 0
        for batch in c:  # epoch 1, checkpointed after every step as a trainer does
            state = c.state_dict()
            saved_epoch = batch.epoch
        assert (state["epoch"], state["step"], saved_epoch) == (1, total, 1)
    resumed = BatchClient(0, 1, module_server.address, "last-ckpt")
    resumed.load_state_dict(state)
    seen = [[b.epoch for b in resumed] for _ in range(saved_epoch, 3)]  # epochs 1 (its rest) and 2
    resumed.close()
    assert seen == [[], [2] * total], [sorted(set(e)) for e in seen]


def test_len_after_loading_a_state_on_an_epochs_last_batch_counts_that_epoch(
    server_factory: Server, tmp_path: Path
) -> None:
    """The next iteration is the loaded epoch's empty rest, so ``len`` is that epoch's, not the next one's."""
    dataset = tmp_path / "uneven"
    make_dataset(dataset, 3000, seed=3, scale=1 / 16)
    config = "--max-seq-len 8192 --bucket-bounds 0,770,1216,1728,2432,3296,8193 --token-budget 49152"
    server = server_factory(
        [*config.split(), "--max-batch-size", "64"], dataset=dataset
    )  # 48, 48, 47 batches
    with BatchClient(0, 1, server.address, "len-last") as c:
        lengths = [c.steps_in_epoch(e) for e in range(3)]
        assert lengths[1] != lengths[2], f"the dataset no longer has uneven epochs: {lengths}"
        for _ in range(2):  # epochs 0 and 1, checkpointed after every step
            for _ in c:
                state = c.state_dict()
    assert (state["epoch"], state["step"]) == (1, lengths[1])
    with BatchClient(0, 1, server.address, "len-last") as resumed:
        resumed.load_state_dict(state)
        assert len(resumed) == lengths[1]
        assert len(list(resumed)) == 0  # the rest of epoch 1
        assert len(resumed) == lengths[2] == len(list(resumed))


def test_state_dict_after_close_is_where_the_client_ended(module_server: Any) -> None:
    """A final checkpoint taken after the ``with`` block (or after ``close()``) keeps the position."""
    with BatchClient(0, 1, module_server.address, "after-close") as c:
        assert steps(c, 3) == [0, 1, 2]
    assert (c.state_dict()["epoch"], c.state_dict()["step"]) == (0, 3)

    used: list[BatchClient] = []

    def train() -> None:
        with BatchClient(0, 1, module_server.address, "after-close") as c:
            used.append(c)
            for batch in c:
                if batch.step == 5:
                    raise RuntimeError("OOM")  # the with block does not consume the held batch

    with pytest.raises(RuntimeError, match="OOM"):
        train()
    c = used[0]
    failed = c.state_dict()
    assert failed["step"] == 5, "a state taken after the failed block skips the batch the trainer failed on"
    with BatchClient(0, 1, module_server.address, "after-close") as again:
        again.load_state_dict(failed)
        assert steps(again, 1) == [5]
    unstarted = BatchClient(0, 1, module_server.address, "after-close-2")
    unstarted.close()
    with pytest.raises(BatchClientError, match="closed before it learned its position"):
        unstarted.state_dict()  # its position was never learned
    loaded = BatchClient(0, 1, module_server.address, "after-close-3")
    saved = {**failed, "job": "after-close-3", "schedule_fingerprint": None}  # as an old state may hold
    loaded.load_state_dict(saved)
    loaded.close()
    assert loaded.state_dict() == saved, "a closed client forgot the position it was given"


def test_a_checkpoint_before_the_first_batch_holds_where_the_rank_starts(module_server: Any) -> None:
    """A restarted trainer that saves before it reads must not rewind the rank to (0, 0)."""
    with BatchClient(0, 1, module_server.address, "early-ckpt") as c:
        assert steps(c, 5) == list(range(5))
    restarted = BatchClient(0, 1, module_server.address, "early-ckpt")
    state = restarted.state_dict()
    assert (state["epoch"], state["step"]) == (0, 5)
    assert state["schedule_fingerprint"], "a checkpoint without the schedule skips its check on load"
    assert steps(restarted, 1) == [5], "state_dict() before the first batch lost or skipped one"
    restarted.close()
    with BatchClient(0, 1, module_server.address, "early-ckpt") as loaded:
        loaded.load_state_dict(state)
        assert steps(loaded, 1) == [5]


def test_a_fenced_client_stays_fenced(module_server: Any) -> None:
    """Retrying after FencedError must not take the rank back from the process that replaced it."""
    old = BatchClient(0, 1, module_server.address, "fence-stays", prefetch=1, timeout=30)
    it = iter(old)
    assert [next(it).step for _ in range(3)] == [0, 1, 2]
    new = BatchClient(0, 1, module_server.address, "fence-stays", prefetch=1, timeout=30)
    new_it = iter(new)
    first = next(new_it).step
    with pytest.raises(FencedError):  # after the window the old stream had in flight
        list(zip(range(4), it, strict=False))
    for retry in (lambda: next(iter(old)), old.state_dict):
        with pytest.raises(FencedError):
            retry()
    later = [next(new_it).step for _ in range(3)]
    assert later == [first + 1, first + 2, first + 3], (
        "the replacing process was fenced by the old one's retry"
    )
    with pytest.raises(FencedError):
        old.close()
    new.close()


def test_a_schedule_mismatch_on_load_is_a_state_dict_error(module_server: Any) -> None:
    with BatchClient(0, 1, module_server.address, "mismatch") as c:
        steps(c, 2)
        state = c.state_dict()
    with BatchClient(0, 1, module_server.address, "mismatch", timeout=10) as c:
        c.load_state_dict(dict(state, schedule_fingerprint="0" * 16))
        with pytest.raises(StateDictError, match="schedule"):
            next(iter(c))


def test_batches_pickle_and_compare_by_identity(module_server: Any) -> None:
    with BatchClient(0, 1, module_server.address, "pickled") as c:
        batch = next(iter(c))
    again = pickle.loads(pickle.dumps(batch))
    for name in ("input_ids", "loss_mask", "lengths", "sample_ids", "attention_mask"):
        np.testing.assert_array_equal(getattr(again, name), getattr(batch, name))
    assert (again.epoch, again.step, again.real_tokens) == (batch.epoch, batch.step, batch.real_tokens)
    assert copy.deepcopy(batch) != batch
    assert batch == batch
    assert len({batch, again}) == 2
    with pytest.raises(ValueError, match="read-only"):
        batch.attention_mask[0, 0] = 7  # cached: a write would change it for every later reader
    torch = pytest.importorskip("torch")
    with pytest.raises(TypeError, match="takes a device, not a dtype"):
        batch.to(torch.bfloat16)  # would round sample ids 538..541 to 536, 540, 540, 540


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"rank": 1.7, "world_size": 2}, "rank must be an integer"),
        ({"rank": True, "world_size": 2}, "rank must be an integer"),
        ({"world_size": 2.5}, "world_size must be an integer"),
        ({"prefetch": 2.7}, "prefetch must be an integer"),
        ({"prefetch": "4"}, "prefetch must be an integer"),
        ({"timeout": float("inf")}, "timeout must be seconds"),
        ({"timeout": float("nan")}, "timeout must be seconds"),
        ({"timeout": None}, "timeout must be seconds"),
        ({"job": ""}, "job must be"),
        ({"job": "team/run-1"}, "job must be"),
        ({"job": "\ud800"}, "job must be"),
        ({"server": "127.0.0.1:99999"}, "not host:port"),
        ({"server": "garbage::::"}, "not host:port"),
        ({"server": "127.0.0.1:abc"}, "not host:port"),
        ({"pin_memory": True}, "needs a torch device"),
        # each of these failed only at the first batch, untyped or after the whole timeout
        ({"server": "grpc://127.0.0.1:50051"}, "a URL, not a gRPC target: give host:port .127.0.0.1:50051."),
        ({"server": "http://127.0.0.1:50051/"}, "is a URL"),
        ({"server": 50051}, "server must be a string"),
        ({"world_size": 2**40}, "world_size must be an integer in 1..4294967295"),
        ({"prefetch": 2**40}, "prefetch must be an integer in 1..4294967295"),
        ({"client_id": "\ud800"}, "client_id must be printable ASCII"),
        ({"client_id": 123}, "client_id must be printable ASCII"),
        ({"client_id": "host\n1"}, "client_id must be printable ASCII"),
        ({"token": "secret\nvalue-of-sixteen-plus"}, "token must be printable ASCII"),
        ({"token": "sécret-value-of-sixteen-plus"}, "token must be printable ASCII"),
    ],
)
def test_bad_arguments_fail_in_the_constructor(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        BatchClient(**{"rank": 0, "world_size": 1, **kwargs})


@pytest.mark.parametrize("raw", ["1_0", "\u0663", "1.0", " "])
def test_rank_from_the_environment_is_plain_digits(monkeypatch: pytest.MonkeyPatch, raw: str) -> None:
    monkeypatch.setenv("RANK", raw)
    monkeypatch.setenv("WORLD_SIZE", "16")
    if raw.strip():
        with pytest.raises(ValueError, match="RANK"):
            BatchClient()
    else:
        assert BatchClient().rank == 0


def test_a_host_without_a_port_means_ladles_port() -> None:
    given = "127.0.0.1, trainer-host, ::1, [::1], a:1, [::1]:2, dns:///b:3, unix:/run/ladle.sock"
    assert BatchClient(0, 1, given).servers == [
        "127.0.0.1:50051", "trainer-host:50051", "[::1]:50051", "[::1]:50051",
        "a:1", "[::1]:2", "dns:///b:3", "unix:/run/ladle.sock",
    ]  # fmt: skip


def test_two_threads_at_once_are_refused_and_a_checkpoint_thread_is_not(module_server: Any) -> None:
    client = BatchClient(0, 1, module_server.address, "threads", prefetch=2, timeout=30)
    steps(client, 1)
    errors: list[BaseException] = []
    got: list[int] = []
    start = threading.Barrier(4)

    def read() -> None:
        start.wait()
        try:
            for _, batch in zip(range(15), client, strict=False):
                got.append(batch.step)
        except BatchClientError as exc:
            errors.append(exc)

    def checkpoint() -> None:
        start.wait()
        for _ in range(20):
            client.state_dict()

    threads = [threading.Thread(target=read) for _ in range(3)] + [threading.Thread(target=checkpoint)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert all(not t.is_alive() for t in threads)
    assert all("two threads" in str(e) for e in errors), errors
    assert len(got) == len(set(got)), "a batch was handed out twice"
    assert sorted(got) == list(range(1, 1 + len(got))), "a batch was skipped"
    assert steps(client, 1) == [1 + len(got)]
    client.close()


def run_trainer(address: str, body: str, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    script = tmp_path / "trainer.py"
    script.write_text(
        textwrap.dedent(
            f"""
            import os, sys
            from ladle.client import BatchClient
            client = BatchClient(0, 1, {address!r}, "exit", timeout=30)
            """
        )
        + textwrap.dedent(body)
    )
    return subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=120, cwd=tmp_path
    )


def test_a_script_that_ends_without_close_acknowledges_what_it_consumed(
    server_factory: Server, tmp_path: Path
) -> None:
    """At exit the consumed batches are acknowledged; the held one is given again, however it ended."""
    server = server_factory()
    clean = run_trainer(server.address, "it = iter(client)\nfor _ in range(5): next(it)\n", tmp_path)
    assert clean.returncode == 0, clean.stderr
    with BatchClient(0, 1, server.address, "exit") as c:
        assert steps(c, 1) == [4], "an exit without close() lost acknowledgements, or consumed the held batch"
    # 4 consumed by the check above; then 5, 6, 7 consumed and 8 held when it fails
    caught = run_trainer(
        server.address,
        """
        try:
            for batch in client:
                if batch.step == 8:
                    raise RuntimeError("diverged")
        except RuntimeError:
            sys.exit(1)
        """,
        tmp_path,
    )
    assert caught.returncode == 1, caught.stderr
    with BatchClient(0, 1, server.address, "exit") as c:
        assert steps(c, 1) == [8], "the batch the trainer failed on was not given again"
    crashed = run_trainer(
        server.address,
        "it = iter(client)\nfor _ in range(4): next(it)\nraise SystemError('crash')\n",
        tmp_path,
    )
    assert crashed.returncode != 0
    assert "crash" in crashed.stderr
    with BatchClient(0, 1, server.address, "exit") as c:
        assert steps(c, 1) == [12], "the batch held when the trainer crashed was not given again"


def test_exit_does_not_wait_long_for_a_server_that_hangs(server_factory: Server, tmp_path: Path) -> None:
    server = server_factory()
    body = f"""
        import signal, time
        clients = [BatchClient(0, 1, {server.address!r}, f"hang-{{i}}", timeout=30) for i in range(6)]
        for c in clients:
            next(iter(c))
        os.kill({server.proc.pid}, signal.SIGSTOP)
        print(f"ending at {{time.time()}}", file=sys.stderr, flush=True)
        """
    try:
        done = run_trainer(server.address, body, tmp_path)
        exited = time.time()
    finally:
        os.kill(server.proc.pid, signal.SIGCONT)
    took = exited - float(done.stderr.rsplit("ending at ", 1)[1].split()[0])
    assert took < 4.0, f"6 clients' exit took {took:.1f}s with the server stopped"


@pytest.mark.parametrize("waiting_for", ["connect", "reconnect"])
def test_ctrl_c_or_a_preemption_handler_while_waiting_for_a_server_ends_the_process(
    server_factory: Server, tmp_path: Path, waiting_for: str
) -> None:
    """A signal handler's exception while the client waits to (re)connect propagates, and the process ends.

    It used to land inside grpcio's connectivity watch, which then stayed
    registered: the handler ran, but closing (or collecting) the channel
    waited for that watch for ever.
    """
    server = server_factory()
    if waiting_for == "connect":
        with socket.socket() as s:  # a port nothing listens on: a server not up yet
            s.bind(("127.0.0.1", 0))
            address = f"127.0.0.1:{s.getsockname()[1]}"
        kill_server = ""
    else:  # the server dies mid-epoch and the client is reconnecting
        address = server.address
        kill_server = f"next(iter(client)); os.kill({server.proc.pid}, signal.SIGKILL)"
    body = f"""
        import signal, threading
        client = BatchClient(0, 1, {address!r}, "interrupted", timeout=60)
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a preemption handler
        {kill_server}
        threading.Timer(1.5, os.kill, (os.getpid(), signal.SIGINT)).start()  # Ctrl-C
        try:
            for _ in client:  # what the window holds, then the wait
                pass
        except KeyboardInterrupt:
            print("interrupted", flush=True)
        threading.Timer(1.5, os.kill, (os.getpid(), signal.SIGTERM)).start()
        try:
            for _ in client:
                pass
        finally:
            client.close()
            print("closed", flush=True)
        """
    done = run_trainer(address, body, tmp_path)
    assert done.returncode == 143, done.stderr
    assert done.stdout.split() == ["interrupted", "closed"], done.stdout


def test_a_dropped_client_ends_its_threads(module_server: Any) -> None:
    before = threading.active_count()
    for i in range(3):
        client = BatchClient(0, 1, module_server.address, f"dropped-{i}")
        steps(client, 2)  # 0 consumed, 1 held
        del client
    gc.collect()
    deadline = time.monotonic() + 10
    while threading.active_count() > before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert threading.active_count() <= before, [t.name for t in threading.enumerate()]
    for i in range(3):
        with BatchClient(0, 1, module_server.address, f"dropped-{i}") as again:
            assert steps(again, 1) == [1], "a dropped client lost its acknowledgement, or its held batch"


def test_a_dropped_client_keeps_its_channel_until_its_stream_has_ended(
    module_server: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Freed with the client, grpcio's channel cancelled the call before the flushed acknowledgement went.

    (A churn audit saw 29 of 400 clients dropped in bursts give their successor 1-3
    consumed batches again.) The thread that ends the stream must hold the channel: it
    is handed to it, and released only after the stream's end.
    """
    from ladle.client import client as client_module

    ended: list[bool] = []  # whether the thread was handed the channel (it closes it after the stream)
    end_dropped = client_module._end_dropped

    def recording(stream: Any, channel: Any, local: Any = None) -> None:
        end_dropped(stream, channel, local)
        ended.append(channel is not None)

    monkeypatch.setattr(client_module, "_end_dropped", recording)
    client = BatchClient(0, 1, module_server.address, "dropped-channel")
    steps(client, 3)  # 0 and 1 consumed (their acknowledgement held back in a group), 2 held
    channel = weakref.ref(client._connection.channel)
    del client
    gc.collect()
    deadline = time.monotonic() + 10
    while (channel() is not None or not ended) and time.monotonic() < deadline:  # and then it does go
        time.sleep(0.05)
    assert ended == [True], "the channel was not held by the thread that ends the stream"
    assert channel() is None, "the dropped client's channel was never released"
    with BatchClient(0, 1, module_server.address, "dropped-channel") as again:
        assert steps(again, 1) == [2], "a dropped client lost its acknowledgement, or its held batch"


def test_clients_dropped_while_the_process_is_busy_lose_no_acknowledgement(module_server: Any) -> None:
    busy = threading.Event()

    def spin() -> None:  # holds the GIL in turns, so the closing threads start late
        while not busy.is_set():
            sum(range(10_000))

    spinners = [threading.Thread(target=spin) for _ in range(2)]
    for thread in spinners:
        thread.start()
    try:
        for i in range(12):
            client = BatchClient(0, 1, module_server.address, f"dropped-busy-{i}")
            steps(client, 4)  # 0-2 consumed, 3 held
            del client
            gc.collect()
    finally:
        busy.set()
        for thread in spinners:
            thread.join()
    time.sleep(1.5)  # each closing thread waits at most 1 s for the server
    firsts = []
    for i in range(12):
        with BatchClient(0, 1, module_server.address, f"dropped-busy-{i}") as again:
            firsts.append(steps(again, 1)[0])
    assert firsts == [3] * 12, f"the first batch after each drop (3 expected): {firsts}"


def test_close_from_another_thread_ends_a_reconnecting_next(server_factory: Server) -> None:
    server = server_factory()
    client = BatchClient(0, 1, server.address, "closed-while-waiting", timeout=30)
    assert steps(client, 1) == [0]
    ended: list[BaseException] = []

    def train() -> None:
        try:
            for _ in client:
                time.sleep(0.01)
        except BaseException as exc:  # recorded for the assertion
            ended.append(exc)

    thread = threading.Thread(target=train)
    thread.start()
    time.sleep(0.2)
    server.kill()
    deadline = time.monotonic() + 20
    while client.reconnects == 0 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert client.reconnects > 0, "the client did not start reconnecting"
    began = time.monotonic()
    client.close()
    thread.join(timeout=10)
    assert not thread.is_alive(), "next() still waits after close()"
    assert time.monotonic() - began < 3.0
    assert len(ended) == 1
    assert isinstance(ended[0], BatchClientError), repr(ended[0])
    assert "closed" in str(ended[0])


def test_an_elastic_checkpoint_before_the_first_batch_is_the_replanned_one(server_factory: Server) -> None:
    server = server_factory()
    saved = world_checkpoint(server.address, "elastic-early", 2, 5)
    with BatchClient(0, 1, server.address, "elastic-early", elastic=True, timeout=30) as resized:
        resized.load_state_dict(saved)
        state = resized.state_dict()
        assert state["world_size"] == 1
        assert state["schedule_fingerprint"] != saved["schedule_fingerprint"], "the old world's schedule"
        first = next(iter(resized))
        assert (first.epoch, first.step) == (state["epoch"], state["step"])


@pytest.mark.skipif(not hasattr(os, "fork"), reason="fork")
def test_a_forked_child_gets_a_clear_error_and_takes_nothing(module_server: Any, tmp_path: Path) -> None:
    client = BatchClient(0, 1, module_server.address, "forked", timeout=10)
    assert steps(client, 2) == [0, 1]
    out = tmp_path / "child"
    pid = os.fork()
    if pid == 0:  # the child: must neither take a batch nor hang
        code = 1
        signal.alarm(30)
        try:
            try:
                next(iter(client))
                out.write_text("got a batch")
            except BatchClientError as exc:
                out.write_text(f"refused: {exc}")
            client.close()
            code = 0
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert out.read_text().startswith("refused: ")
    assert "fork" in out.read_text()
    assert steps(client, 1) == [2], "the parent lost or repeated a batch"
    client.close()


def test_a_device_torch_cannot_use_fails_in_the_constructor() -> None:
    torch = pytest.importorskip("torch")
    with pytest.raises(ValueError, match="not a torch device"):
        BatchClient(0, 1, device="bogus")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="needs CUDA"):
            BatchClient(0, 1, device="cuda:0")
        with pytest.raises(ValueError, match="pin_memory=True needs CUDA"):
            BatchClient(0, 1, device="cpu", pin_memory=True)
    for other in ("mps", "xpu"):  # another accelerator torch was not built for, or has none of
        available = getattr(getattr(torch, other, None), "is_available", lambda: False)()
        if not available:
            with pytest.raises(ValueError, match=f"device='{other}' cannot be used here"):
                BatchClient(0, 1, device=other)
    with pytest.raises(ValueError, match="holds no data"):
        BatchClient(0, 1, device="meta")
    assert BatchClient(0, 1, device="cpu").timeout > 0


def test_the_server_logs_why_each_stream_ended(server_factory: Server) -> None:
    server = server_factory()
    with BatchClient(0, 1, server.address, "logged") as c:
        steps(c, 2)
    old = BatchClient(0, 1, server.address, "taken", prefetch=1, timeout=30)
    steps(old, 1)
    new = BatchClient(0, 1, server.address, "taken", timeout=30)
    steps(new, 1)
    new.close()
    with pytest.raises(FencedError):  # its close() reads the stream's end: replaced
        old.close()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        log = server.log_tail()
        if "job=taken" in log and log.count("stream end:") >= 3:
            break
        time.sleep(0.1)
    assert re.search(r"stream end: job=logged rank=0 .*ended by the trainer", log), log[-1500:]
    fenced = r"stream end: job=taken rank=0 generation=1 .*failed_precondition/fenced"
    assert re.search(fenced, log), log[-1500:]


def test_a_run_that_names_no_job_is_warned_and_a_resume_is_logged(
    module_server: Any, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Two unrelated runs without LADLE_JOB share 'default': the second silently went on from the first."""
    from ladle.client import config as config_module

    monkeypatch.delenv("LADLE_JOB", raising=False)
    monkeypatch.setattr(config_module, "_warned_default_job", False)
    with caplog.at_level("INFO", logger="ladle.client"):
        with BatchClient(0, 1, module_server.address) as first:
            assert first.job == "default"
            steps(first, 4)  # close() consumes the held one too
        with BatchClient(0, 1, module_server.address) as second:
            assert steps(second, 1) == [4]
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 2, warnings  # the missing name once a process, and the resume
    assert "no job given" in warnings[0]
    assert "job 'default' continues at epoch 0 step 4, where the store left it" in warnings[1]
    caplog.clear()
    with (
        caplog.at_level("INFO", logger="ladle.client"),
        BatchClient(0, 1, module_server.address, "fresh") as c,
    ):
        steps(c, 1)
    assert "continues at" not in caplog.text
    assert "no job given" not in caplog.text


def test_a_client_refuses_to_be_pickled(module_server: Any) -> None:
    with (
        BatchClient(0, 1, module_server.address, "no-pickle") as client,
        pytest.raises(BatchClientError, match="cannot be pickled"),
    ):
        pickle.dumps(client)


def test_the_trainers_thread_never_sends_into_grpc(
    module_server: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Python handles signals on the trainer's thread: a Ctrl-C inside grpcio's send left its lock held.

    (An emergency state_dict() in the KeyboardInterrupt handler then hung: 2 of 14 tries in an audit.)
    """
    from ladle.client.reader import Stream

    senders: set[str] = set()
    requests = Stream._request_iter

    def recording(self: Any) -> Iterator[Any]:
        for request in requests(self):  # each request is taken by the thread that sends it
            senders.add(threading.current_thread().name)
            yield request

    monkeypatch.setattr(Stream, "_request_iter", recording)
    me = threading.current_thread().name
    with BatchClient(0, 1, module_server.address, "no-send-here", prefetch=4) as client:
        for i, _ in enumerate(client):
            if i % 7 == 0:
                client.state_dict()  # a flush
            if i == 40:
                break
    assert senders, "no request went through the stream's request iterator"
    assert me not in senders, f"the trainer's thread sent into gRPC (senders: {sorted(senders)})"


_KILLED_AT = """
import os, signal, sys, time
from ladle.client import BatchClient
address, job = sys.argv[1], sys.argv[2]
rank, world, held = (int(a) for a in sys.argv[3:6])
client = BatchClient(rank, world, address, job, timeout=30)
batches = (batch for _epoch in iter(int, 1) for batch in client)  # epoch after epoch
for _ in range(held + 1):  # batches 0..held-1 consumed, batch `held` in the trainer's hands
    next(batches)
time.sleep(0.5)  # the acknowledgements reach the store (the server writes them within 50 ms)
os.kill(os.getpid(), signal.SIGKILL)
"""


def _killed_at(address: str, job: str, rank: int, world: int, held: int, tmp_path: Path) -> None:
    """A trainer process of ``rank`` that is kill -9ed holding step ``held`` (as torchrun's restart does)."""
    script = tmp_path / "killed_at.py"
    script.write_text(_KILLED_AT)
    done = subprocess.run(
        [sys.executable, str(script), address, job, str(rank), str(world), str(held)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == -signal.SIGKILL, done.stderr


def test_a_ddp_group_restarted_without_checkpoints_starts_at_one_step(
    server_factory: Server, tmp_path: Path
) -> None:
    """torchrun kills every rank and starts them again; each rank at its own cursor got unequal steps.

    (An audit's group restart left the ranks at 417 and 419 batches to the epoch's end: a DDP
    job hangs in its last collective.) Without a checkpoint every rank starts at the job's
    cursor, the earliest rank's position, whichever order they come back in.
    """
    server = server_factory()
    for order, job in (((0, 1), "ddp-restart-a"), ((1, 0), "ddp-restart-b")):
        _killed_at(server.address, job, 0, 2, 7, tmp_path)  # rank 0 ran ahead, to step 7
        _killed_at(server.address, job, 1, 2, 5, tmp_path)  # rank 1 died holding step 5
        clients = {rank: BatchClient(rank, 2, server.address, job, timeout=30) for rank in order}
        try:
            # in step, as DDP runs them: each takes its first batch (in `order`), then both go on
            batches = {rank: iter(clients[rank]) for rank in order}
            got: dict[int, list[int]] = {rank: [next(batches[rank]).step] for rank in order}
            for pair in itertools.zip_longest(batches[0], batches[1]):
                for rank, batch in enumerate(pair):
                    got[rank].append(-1 if batch is None else batch.step)
        finally:
            for client in clients.values():
                client.close()
        assert got[0][0] == got[1][0] == 5, f"ranks restarted at {got[0][0]} and {got[1][0]}"
        assert got[0] == got[1], "the ranks do not have the same steps to the epoch's end"


def test_a_rank_restarted_alone_continues_where_the_store_has_it(server_factory: Server) -> None:
    """Two ranks read 30 batches in step; rank 0 closes and comes back without a checkpoint while
    rank 1 reads on. It got step 0 again (rank 1's stream had begun at 0:0 within 120 s, and that
    start held rank 0 back), and the warning said the store held no later position of it."""
    server = server_factory()
    job = "alone"
    first = BatchClient(0, 2, server.address, job, timeout=30)
    other = BatchClient(1, 2, server.address, job, timeout=30)
    try:
        mine, theirs = iter(first), iter(other)
        for _ in range(30):  # in step, as DDP runs them
            next(mine)
            next(theirs)
        first.close()
        time.sleep(0.3)  # the acknowledgements reach the store (written within 50 ms)
        with BatchClient(0, 2, server.address, job, timeout=30) as back:
            got = steps(back, 2)
        # step 29 was in its hands when it closed (not consumed): the store holds 0:29 for it
        assert got == [29, 30], f"rank 0 restarted without a checkpoint replayed from step {got[0]}"
        assert next(theirs).step == 30, "rank 1 did not read on"
    finally:
        first.close()
        other.close()
    log = (server.workdir / "server.log").read_text(errors="replace")
    assert "the store holds no later position of it" not in log, server.log_tail()


def test_own_cursor_keeps_a_ranks_own_position(server_factory: Server, tmp_path: Path) -> None:
    """Ranks that do not train in step keep exact per-rank resume; a rank behind the others is not moved."""
    server = server_factory()
    _killed_at(server.address, "own-cursor", 0, 2, 7, tmp_path)
    _killed_at(server.address, "own-cursor", 1, 2, 5, tmp_path)
    with BatchClient(0, 2, server.address, "own-cursor", own_cursor=True, timeout=30) as ahead:
        assert steps(ahead, 1) == [7], "own_cursor=True did not continue at the rank's own cursor"
    with BatchClient(1, 2, server.address, "own-cursor", timeout=30) as behind:
        assert steps(behind, 1) == [5], "the rank furthest behind did not continue at its own cursor"


def test_an_elastic_checkpoint_off_the_cut_names_the_cut(server_factory: Server) -> None:
    """Each new rank loading its own old rank's checkpoint, at other steps: the error said nothing useful."""
    server = server_factory()
    old = [BatchClient(r, 4, server.address, "elastic-cut", timeout=30) for r in range(4)]
    saved = []
    for rank, client in enumerate(old):
        steps(client, 3 + 2 * rank)
        saved.append(client.state_dict())
        client.close()
    first = BatchClient(0, 2, server.address, "elastic-cut", elastic=True, timeout=30)
    second = BatchClient(1, 2, server.address, "elastic-cut", elastic=True, timeout=30)
    try:
        first.load_state_dict(saved[0])
        steps(first, 1)  # the resize is cut at rank 0's checkpoint
        second.load_state_dict(saved[1])
        with pytest.raises(StateDictError) as info:
            steps(second, 1)
        message = str(info.value)
        assert "was resized from 4 to 2 ranks at 0:3" in message, message
        assert "this checkpoint of the old world is at 0:5" in message, message
        assert "must load a checkpoint of the same step" in message, message
    finally:
        first.close()
        second.close()


def test_an_elastic_resume_from_a_checkpoint_on_an_epochs_last_batch(server_factory: Server) -> None:
    """A checkpoint after every batch, stopped between epochs, is (e, steps): refused, and the job resized.

    The resize's cut holds that point as (e + 1, 0); the checkpoint is compared in that form.
    """
    server = server_factory()
    old = [BatchClient(r, 2, server.address, "elastic-end", timeout=30) for r in range(2)]
    saved = []
    for client in old:
        for _batch in client:
            saved_state = client.state_dict()  # after every batch, as the README's loop does
        saved.append(saved_state)
        client.close()
    assert saved[0]["epoch"] == 0, saved[0]  # the (e, steps) form
    assert saved[0]["step"] > 0, saved[0]
    with BatchClient(0, 1, server.address, "elastic-end", elastic=True, timeout=30) as resized:
        resized.load_state_dict(saved[0])
        first = next(iter(resized))
        assert first.epoch == 1, f"the resized job continued in epoch {first.epoch}"


def test_a_checkpoint_the_resized_job_cannot_take_leaves_the_job_as_it_was(server_factory: Server) -> None:
    """4 -> 2 (trained on, no checkpoint) -> 3 with the 4-rank checkpoint: refused, and nothing changed."""
    server = server_factory()
    checkpoint = world_checkpoint(server.address, "elastic-flap", 4, 4)
    two = [BatchClient(r, 2, server.address, "elastic-flap", elastic=True, timeout=30) for r in range(2)]
    for client in two:
        client.load_state_dict(checkpoint)
        steps(client, 3)  # and dies before its first checkpoint
        client.close()
    with BatchClient(0, 3, server.address, "elastic-flap", elastic=True, timeout=30) as three:
        three.load_state_dict(checkpoint)
        with pytest.raises(StateDictError, match=r"cannot be resized to 3 ranks from it.*job is unchanged"):
            steps(three, 1)
    with BatchClient(0, 2, server.address, "elastic-flap", timeout=30) as again:  # still the world of 2
        assert steps(again, 1) == [3], "the refused checkpoint changed the job"


def test_a_state_past_its_epochs_end_is_a_state_error_and_fences_no_one(module_server: Any) -> None:
    """It was a plain BatchClientError, raised after the join had fenced the rank's running process."""
    with BatchClient(0, 1, module_server.address, "past-the-end", timeout=30) as running:
        batches = iter(running)
        assert [next(batches).step for _ in range(2)] == [0, 1]
        bad = running.state_dict() | {"step": 10**6}
        with BatchClient(0, 1, module_server.address, "past-the-end", timeout=30) as other:
            other.load_state_dict(bad)
            with pytest.raises(StateDictError, match="not a position of this job"):
                steps(other, 1)
        assert next(batches).step == 2, "the refused state fenced the running process"


def test_a_world_size_the_dataset_cannot_fill_leaves_no_job_behind(server_factory: Server) -> None:
    """Refused at the first batch, the job stayed in the store, and the page (the job updated last) broke."""
    import json
    import urllib.request

    server = server_factory()
    with BatchClient(0, 1, server.address, "healthy", timeout=30) as healthy:
        steps(healthy, 2)
    with (
        BatchClient(0, 65536, server.address, "too-wide", timeout=30) as wide,
        pytest.raises(BatchClientError, match="no complete step"),
    ):
        steps(wide, 1)
    with urllib.request.urlopen(f"{server.http_url}/v1/jobs", timeout=30) as answer:
        jobs = [j["job"] for j in json.load(answer)["jobs"]]
    assert jobs == ["healthy"], f"the refused job was stored: {jobs}"
    with urllib.request.urlopen(f"{server.http_url}/", timeout=30) as page:
        assert page.status == 200
        assert "healthy" in page.read().decode()


def test_a_fenced_process_gets_no_more_batches_from_its_window(module_server: Any) -> None:
    """The replaced process still trained on the batches in its prefetch window (an audit saw 3-6
    more steps, which the newer process was given too), and only then raised FencedError."""
    old = BatchClient(0, 1, module_server.address, "fenced-window", prefetch=8, timeout=30)
    try:
        batches = iter(old)
        assert [next(batches).step for _ in range(2)] == [0, 1]  # step 0 consumed, 1 held
        deadline = time.monotonic() + 10
        while (old._stream is None or old._stream.buffered() < 6) and time.monotonic() < deadline:
            time.sleep(0.02)  # its window fills: steps 2..8 wait in the client
        time.sleep(0.2)  # and step 0's acknowledgement reaches the store
        with BatchClient(0, 1, module_server.address, "fenced-window", timeout=30) as new:
            assert steps(new, 1) == [1], "the newer process did not take over at the stored cursor"
            time.sleep(0.5)  # the old stream's end (FAILED_PRECONDITION, fenced) reaches its reader
            with pytest.raises(FencedError):
                next(batches)
    finally:
        with contextlib.suppress(FencedError):  # fenced: its close() says so too
            old.close()


def wait_for_fence(client: BatchClient) -> None:
    """Until the stream's end (FAILED_PRECONDITION, fenced) has reached the client's reader thread."""
    deadline = time.monotonic() + 20
    while client._stream is None or client._stream.fenced is None:
        assert time.monotonic() < deadline, "the fence never reached the replaced client"
        time.sleep(0.01)


def test_a_replaced_client_neither_checkpoints_nor_closes_cleanly(module_server: Any) -> None:
    """Once the fence had reached it, a replaced client's state_dict() and close() still succeeded
    (only next() raised): a stale process resumed with SIGCONT trained on and checkpointed, able to
    overwrite the newer process's checkpoint. Now every call raises FencedError, state_dict() even
    before next() has met the fence behind the batches still queued."""
    old = BatchClient(0, 1, module_server.address, "fenced-state", prefetch=4, timeout=30)
    try:
        batches = iter(old)
        assert [next(batches).step for _ in range(3)] == [0, 1, 2]  # 0 and 1 consumed, 2 held
        time.sleep(0.2)  # its acknowledgement reaches the store
        with BatchClient(0, 1, module_server.address, "fenced-state", timeout=30) as new:
            assert steps(new, 1) == [2], "the newer process did not take over at the stored cursor"
            wait_for_fence(old)
            assert old._stream is not None
            assert old._stream.buffered() > 1, "no batch was queued ahead of the fence"
            with pytest.raises(FencedError, match="replaced"):
                old.state_dict()
            with pytest.raises(FencedError, match="replaced"):
                next(batches)  # none of the batches queued ahead of the fence
            for call in (old.state_dict, old.close, old.close, old.state_dict, lambda: next(iter(old))):
                with pytest.raises(FencedError, match="replaced"):
                    call()
            assert steps(new, 2) == [3, 4], "the replaced client took its rank back"
    finally:
        with contextlib.suppress(FencedError):
            old.close()


def test_a_replaced_client_learns_of_the_fence_when_it_closes(module_server: Any) -> None:
    """Replaced while it held a batch and before its reader saw the fence: its close(), which reads the
    stream's end, raises FencedError, and so does a ``with`` block that ends without an error."""
    with (  # noqa: PT012 - the block's end raises it
        pytest.raises(FencedError, match="replaced"),
        BatchClient(0, 1, module_server.address, "fenced-close", timeout=30) as old,
    ):
        assert steps(old, 2) == [0, 1]
        with BatchClient(0, 1, module_server.address, "fenced-close", timeout=30) as new:
            steps(new, 1)
    with pytest.raises(FencedError, match="replaced"):
        old.state_dict()


# A trainer that checkpoints after every step; each step (after its batch arrived) waits for a line on
# stdin, so the test decides when the step ends and freezes the process in the middle of one.
_STEPPED_TRAINER = """
import json, os, sys
from ladle.client import BatchClient, FencedError
address, job, checkpoint = sys.argv[1:4]
try:
    with BatchClient(0, 1, address, job, timeout=30, prefetch=4) as client:
        for batch in client:
            print("training", batch.step, flush=True)
            sys.stdin.readline()  # the training step
            state = client.state_dict()
            with open(checkpoint + ".tmp", "w") as out:
                json.dump(state, out)
            os.replace(checkpoint + ".tmp", checkpoint)
            print("checkpoint", state["step"], flush=True)
except FencedError as exc:
    print("fenced:", exc, flush=True)
    sys.exit(3)
"""


def test_a_trainer_resumed_after_it_was_replaced_writes_no_checkpoint(
    module_server: Any, tmp_path: Path
) -> None:
    """A trainer frozen (SIGSTOP) in a training step was replaced, then continued (SIGCONT): its
    stream's end (fenced) had reached it, yet state_dict() returned its position, and it wrote one
    more checkpoint (able to overwrite the newer process's) before next() raised FencedError."""
    import queue as queue_module

    job, checkpoint = "frozen", tmp_path / "frozen.json"
    trainer = subprocess.Popen(
        [sys.executable, "-c", _STEPPED_TRAINER, module_server.address, job, str(checkpoint)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    lines: queue_module.SimpleQueue[str] = queue_module.SimpleQueue()
    assert trainer.stdin is not None
    assert trainer.stdout is not None
    stdout = trainer.stdout

    def read() -> None:
        for line in stdout:
            lines.put(line)

    threading.Thread(target=read, daemon=True).start()

    def said(expected: str) -> None:
        line = lines.get(timeout=30).strip()
        assert line == expected, f"the trainer said {line!r}, not {expected!r}"

    try:
        for step in range(3):
            said(f"training {step}")
            trainer.stdin.write("\n")
            trainer.stdin.flush()
            said(f"checkpoint {step + 1}")
        said("training 3")  # in its step, with batches 4.. queued behind it
        time.sleep(0.3)  # its acknowledgement of step 2 reaches the store
        trainer.send_signal(signal.SIGSTOP)
        before = checkpoint.read_text()
        with BatchClient(0, 1, module_server.address, job, timeout=30) as new:
            assert steps(new, 1) == [3], "the newer process did not take over at the stored cursor"
            deadline, ended = time.monotonic() + 20, rf"stream end: job={job} rank=0 generation=1 .*fenced"
            while not re.search(ended, module_server.log_tail()):  # its stream's end was sent
                assert time.monotonic() < deadline, module_server.log_tail()
                time.sleep(0.02)
            trainer.send_signal(signal.SIGCONT)
            time.sleep(1.0)  # the stream's end, waiting in its socket, reaches its reader thread
            trainer.stdin.write("\n")  # the step ends: it checkpoints
            trainer.stdin.flush()
            line = lines.get(timeout=30).strip()
            assert line.startswith("fenced: "), f"the replaced trainer went on: {line!r}"
            assert trainer.wait(timeout=30) == 3
            assert steps(new, 2) == [4, 5], "the replaced trainer took its rank back"
        assert checkpoint.read_text() == before, "the replaced trainer wrote a checkpoint"
    finally:
        if trainer.poll() is None:
            trainer.send_signal(signal.SIGCONT)
            trainer.kill()
            trainer.wait(timeout=30)


def test_a_resized_jobs_checkpoint_after_the_store_and_server_forgot_the_job(
    server_factory: Server, tmp_path: Path
) -> None:
    """Its Open made a new plain job, then refused the checkpoint; the job left behind refused it for good."""
    import json
    import urllib.request

    server = server_factory(state=tmp_path / "first.db")
    saved = world_checkpoint(server.address, "forgotten", 2, 3)
    with BatchClient(0, 1, server.address, "forgotten", elastic=True, timeout=30) as resized:
        resized.load_state_dict(saved)
        steps(resized, 2)
        checkpoint = resized.state_dict()  # of the resized schedule
    server.stop()
    fresh = server_factory(state=tmp_path / "empty.db")  # the store's data and the server's memory gone
    with BatchClient(0, 1, fresh.address, "forgotten", timeout=30) as again:
        again.load_state_dict(checkpoint)
        with pytest.raises(StateDictError, match=r"is not in the cursor store.*Nothing was stored"):
            steps(again, 1)
    with urllib.request.urlopen(f"{fresh.http_url}/v1/jobs", timeout=30) as answer:
        assert json.load(answer)["jobs"] == [], "the refused Open left a job behind"


def test_a_rank_that_took_micro_batches_first_does_not_move_the_others_start(
    server_factory: Server, tmp_path: Path
) -> None:
    """Under gradient accumulation the first rank back consumes micro-batches before any collective:
    the next rank's start followed its moving cursor and the two were a step apart (a hang at the end)."""
    server = server_factory()
    _killed_at(server.address, "accumulating", 0, 2, 5, tmp_path)
    _killed_at(server.address, "accumulating", 1, 2, 7, tmp_path)
    first = BatchClient(0, 2, server.address, "accumulating", timeout=30)
    second = BatchClient(1, 2, server.address, "accumulating", timeout=30)
    try:
        ahead = iter(first)
        assert [next(ahead).step for _ in range(3)] == [5, 6, 7]  # two micro-batches consumed, one held
        time.sleep(0.3)  # their acknowledgements reach the store
        behind = iter(second)
        assert next(behind).step == 5, "the second rank followed the first one's moving cursor"
        left = {0: sum(1 for _ in ahead), 1: sum(1 for _ in behind)}
        assert left[0] + 2 == left[1], f"unequal steps to the epoch's end: {left}"
    finally:
        first.close()
        second.close()


def test_ranks_that_never_joined_or_are_far_apart_do_not_move_a_restart(
    server_factory: Server, tmp_path: Path
) -> None:
    """A rank no trainer opened sits at 0:0 in the store and sent a restarted rank back there."""
    server = server_factory()
    _killed_at(server.address, "alone-so-far", 0, 2, 30, tmp_path)  # rank 1 has not started yet
    with BatchClient(0, 2, server.address, "alone-so-far", timeout=30) as restarted:
        assert steps(restarted, 1) == [30], "a rank that never joined pulled the restart back"
    _killed_at(server.address, "far-apart", 0, 2, 150, tmp_path)  # not in step: epochs apart
    _killed_at(server.address, "far-apart", 1, 2, 5, tmp_path)
    with BatchClient(0, 2, server.address, "far-apart", timeout=30) as fast:
        assert next(iter(fast)).epoch > 0, "a rank far ahead of the others was sent back to them"
