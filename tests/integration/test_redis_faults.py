"""Shared state in a real redis-server: crashes, lost writes and replicas (docs/product.md guarantees 6-8).

Every test starts its own redis-server on a free port and its own ``ladle
serve`` processes, and stops them all, pass or fail. A trainer here is a real
process (``trainer_proc.py``) that checkpoints after every batch; a crash of
anything (kill -9 of a batch server, a trainer, or Redis with its AOF) must
leave every rank's record of batches equal to the uninterrupted schedule.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ladle.client import BatchClient, BatchClientError, FencedError, ServerUnavailableError
from ladle.service.schedule import Schedule

from .test_serving import Factory, consume, reference

TRAINER = Path(__file__).with_name("trainer_proc.py")
WORLD = 2
# CI runs a short form; LADLE_FAULT_EXAMPLES=50 for a soak
FAULT_EXAMPLES = int(os.environ.get("LADLE_FAULT_EXAMPLES", "4"))


class Trainers:
    """``WORLD`` trainer processes of one job, each checkpointing to its own file."""

    def __init__(self, workdir: Path, server: str, job: str, delay: float = 0.01) -> None:
        self.workdir, self.server, self.job, self.delay = workdir, server, job, delay
        self.procs: dict[int, subprocess.Popen[bytes]] = {}
        for rank in range(WORLD):
            self.start(rank)

    def checkpoint(self, rank: int) -> Path:
        return self.workdir / f"{self.job}-rank{rank}.json"

    def start(self, rank: int) -> None:
        log = (self.workdir / f"{self.job}-rank{rank}.log").open("ab")
        cmd = [sys.executable, str(TRAINER), self.server, self.job, str(rank), str(WORLD)]
        cmd += [str(self.checkpoint(rank)), "--delay", str(self.delay)]
        self.procs[rank] = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)

    def kill(self, rank: int) -> None:
        self.procs[rank].kill()
        self.procs[rank].wait(timeout=30)

    def records(self, rank: int) -> list[list[int]]:
        path = self.checkpoint(rank)
        if not path.exists():
            return []
        for _ in range(50):
            try:
                records: list[list[int]] = json.loads(path.read_text())["records"]
                return records
            except (json.JSONDecodeError, FileNotFoundError):  # replaced while we read
                time.sleep(0.01)
        raise AssertionError(f"cannot read {path}")

    def wait_for(self, rank: int, count: int, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while len(self.records(rank)) < count:
            assert time.monotonic() < deadline, f"rank {rank} made no progress: {self.log(rank)}"
            time.sleep(0.01)

    def log(self, rank: int) -> str:
        return (self.workdir / f"{self.job}-rank{rank}.log").read_text(errors="replace")[-3000:]

    def finish(self, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        for rank, proc in self.procs.items():
            try:
                proc.wait(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                raise AssertionError(f"rank {rank} did not finish: {self.log(rank)}") from None
            assert proc.returncode == 0, f"rank {rank} exited {proc.returncode}: {self.log(rank)}"

    def stop(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=30)


def expected(sched: Schedule, rank: int) -> list[list[int]]:
    return [[0, step, *sched.samples(step, rank).tolist()] for step in range(sched.num_steps)]


def redis_args(url: str) -> list[str]:
    return ["--redis-url", url]


@settings(
    max_examples=FAULT_EXAMPLES,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(victim=st.sampled_from(["server", "trainer", "redis"]), at=st.integers(1, 40))
def test_a_crash_anywhere_changes_no_rank_stream(
    victim: str,
    at: int,
    redis_server_factory: Callable[..., Any],
    server_factory: Factory,
    small_dataset: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    workdir = tmp_path_factory.mktemp("faults")
    redis = redis_server_factory(appendonly=True, appendfsync="always")
    server = server_factory(extra=redis_args(redis.url))
    trainers = Trainers(workdir, server.address, f"fault-{victim}-{at}")
    try:
        sched = reference(small_dataset, WORLD)
        trainers.wait_for(0, min(at, sched.num_steps - 1))
        if victim == "server":
            server.kill()
            server.start()  # same port: the trainers reconnect
        elif victim == "trainer":
            trainers.kill(0)
            trainers.start(0)  # loads its last checkpoint
        else:
            redis.restart(kill=True)  # kill -9; the AOF (fsync always) brings the state back
        trainers.finish()
        for rank in range(WORLD):
            assert trainers.records(rank) == expected(sched, rank), f"rank {rank}: stream differs ({victim})"
    finally:
        trainers.stop()


def test_a_redis_that_lost_everything_is_reconciled_from_the_trainers(
    redis_server_factory: Callable[..., Any], server_factory: Factory, small_dataset: Path, tmp_path: Path
) -> None:
    """No persistence: a restarted Redis has lost the job; the server notices and puts it back."""
    redis = redis_server_factory(appendonly=False)
    server = server_factory(extra=redis_args(redis.url))
    trainers = Trainers(tmp_path, server.address, "lost", delay=0.02)
    try:
        sched = reference(small_dataset, WORLD)
        trainers.wait_for(0, sched.num_steps // 3)
        redis.restart(kill=True)  # comes back empty (no AOF, no RDB): the server recreates the job at once
        trainers.finish()
        for rank in range(WORLD):
            assert trainers.records(rank) == expected(sched, rank), (
                f"rank {rank}: a batch was replayed or lost"
            )
        assert "lost recent writes" in server.log_tail(), "the loss was not detected and logged"
        # the store holds the trainers' positions again: a trainer without a checkpoint continues there
        with BatchClient(0, WORLD, server.address, "lost", timeout=30) as client:
            first = next(iter(client))
            assert (first.epoch, first.step) == (1, 0)
    finally:
        trainers.stop()


def test_three_replicas_one_killed_mid_epoch(
    redis_server_factory: Callable[..., Any], server_factory: Factory, small_dataset: Path
) -> None:
    redis = redis_server_factory(appendonly=True)
    replicas = [server_factory(extra=redis_args(redis.url)) for _ in range(3)]
    addresses = ",".join(r.address for r in replicas)
    world = 3
    sched = reference(small_dataset, world)
    half = sched.num_steps // 2
    clients = [BatchClient(r, world, addresses, "replicas", timeout=30) for r in range(world)]
    try:
        got = {r: consume(c, half) for r, c in enumerate(clients)}
        for client in clients:
            client.state_dict()  # the batch each holds counts as consumed
        replicas[1].kill()  # rank 1 was on replica 1 (rank % 3)
        for rank, client in enumerate(clients):
            got[rank] += consume(client)
        assert clients[1].reconnects >= 1, "rank 1 did not fail over"
        for rank in range(world):
            steps = [b["step"] for b in got[rank]]
            assert steps == list(range(sched.num_steps)), f"rank {rank}: a gap or a duplicate"
            for b in got[rank]:
                assert np.array_equal(b["sample_ids"], sched.samples(b["step"], rank))
    finally:
        for client in clients:
            client.close()


def test_a_redis_outage_under_replicas_backs_off_and_loses_nothing(
    redis_server_factory: Callable[..., Any], server_factory: Factory, small_dataset: Path
) -> None:
    """Redis down fails every replica alike: the trainer's waits grow with each round over them.

    Before, each switch to the other replica reset the wait to 50 ms: about
    18 reconnects (and log lines) a second per rank for the whole outage.
    """
    redis = redis_server_factory(appendonly=True)
    replicas = [server_factory(extra=redis_args(redis.url)) for _ in range(2)]
    addresses = ",".join(r.address for r in replicas)
    sched = reference(small_dataset, 1)
    with BatchClient(0, 1, addresses, "outage", timeout=30) as client:
        got = consume(client, 5)
        state = client.state_dict()
    redis.stop()  # a stream that is open goes on; one that opens now (a restarted trainer) cannot join
    client = BatchClient(0, 1, addresses, "outage", timeout=30)
    client.load_state_dict(state)
    rest: list[Any] = []
    failed: list[BaseException] = []

    def trainer() -> None:
        try:
            rest.extend(consume(client))
        except BaseException as exc:  # reported below
            failed.append(exc)

    thread = threading.Thread(target=trainer, daemon=True)
    thread.start()
    try:
        time.sleep(4.0)
    finally:
        redis.restart()  # on this thread: a server started from a thread that ends dies with it
        thread.join(60)
        client.close()
    assert not failed, f"the trainer failed: {failed[0]!r}"
    got += rest
    reconnects = client.reconnects
    assert [b["step"] for b in got] == list(range(sched.num_steps)), "a gap or a duplicate"
    # 4 s of outage: waits of 0.05, 0.05, 0.1, 0.1, 0.2, 0.2, 0.4, 0.4, 0.8, 0.8, ... (about 12)
    assert 1 <= reconnects <= 20, f"{reconnects} reconnects in a 4 s outage: the client does not back off"


def test_a_replica_that_hangs_is_left_for_the_next(
    redis_server_factory: Callable[..., Any], server_factory: Factory, small_dataset: Path
) -> None:
    """A frozen replica (SIGSTOP: connected, silent, no reset) kept its trainer waiting its whole
    timeout, then the trainer raised without ever trying the healthy replica."""
    import signal

    redis = redis_server_factory(appendonly=True)
    replicas = [server_factory(extra=redis_args(redis.url)) for _ in range(2)]
    addresses = ",".join(r.address for r in replicas)
    sched = reference(small_dataset, 1)
    half = sched.num_steps // 2
    client = BatchClient(0, 1, addresses, "frozen-replica", timeout=4)  # rank 0 starts on replica 0
    frozen = replicas[0].proc
    assert frozen is not None
    try:
        got = consume(client, half)
        client.state_dict()  # the held batch counts as consumed
        os.kill(frozen.pid, signal.SIGSTOP)
        began = time.monotonic()
        got += consume(client)
        assert client.reconnects >= 1, "the trainer did not leave the frozen replica"
        assert time.monotonic() - began < 30, "the failover took longer than the timeout and a connect"
        steps = [b["step"] for b in got]
        assert steps == list(range(sched.num_steps)), "a gap or a duplicate"
        for b in got:
            assert np.array_equal(b["sample_ids"], sched.samples(b["step"], 0))
    finally:
        os.kill(frozen.pid, signal.SIGCONT)
        client.close()


def test_a_replaced_trainer_is_fenced_across_replicas(
    redis_server_factory: Callable[..., Any], server_factory: Factory
) -> None:
    """The old process streams from replica A; its replacement joins through replica B."""
    redis = redis_server_factory()
    a, b = (server_factory(extra=redis_args(redis.url)) for _ in range(2))
    old = BatchClient(0, 1, a.address, "fenced", prefetch=1, timeout=10)
    it = iter(old)
    next(it)
    new = BatchClient(0, 1, b.address, "fenced", timeout=10)
    next(iter(new))

    # its next cursor write is refused by the store: at most ACK_FLUSH_SECONDS and a round trip
    # after its next acknowledgement, so the old trainer takes its batches at a training step's
    # pace here (taken as fast as possible, all 5 could arrive before the refusal does)
    def train_slowly() -> None:
        for _ in range(5):
            next(it)
            time.sleep(0.1)

    with pytest.raises(FencedError, match="replaced"):
        train_slowly()
    with pytest.raises(FencedError):  # a replaced process reports no clean end
        old.close()
    new.close()


def test_bad_redis_settings_fail_at_start_up(
    redis_server_factory: Callable[..., Any], server_factory: Factory, small_dataset: Path, tmp_path: Path
) -> None:
    secured = redis_server_factory(password="right-password")
    for url, words in (
        (secured.url_for(password="wrong-password"), "password"),
        ("redis://127.0.0.1:1/0", "127.0.0.1:1"),
    ):
        with pytest.raises(RuntimeError) as info:
            server_factory(extra=redis_args(url))
        assert words in str(info.value)
        assert "wrong-password" not in str(info.value), "a password was printed"


def test_store_wait_rides_out_a_redis_that_starts_after_the_server(
    redis_server_factory: Callable[..., Any], server_factory: Factory, tmp_path: Path
) -> None:
    """Redis and ladle applied together (Kubernetes): ladle waited for nothing and exited 2."""
    redis = redis_server_factory(appendonly=True)
    redis.stop()
    started: list[Any] = []
    failed: list[BaseException] = []

    def serve() -> None:  # blocks until the server is ready
        try:
            started.append(server_factory(extra=[*redis_args(redis.url), "--store-wait", "60"]))
        except BaseException as exc:  # reported below
            failed.append(exc)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    log = tmp_path / "server.log"  # the factory's servers log there
    deadline = time.monotonic() + 60  # a loaded machine takes seconds to start Python and import
    while "waiting for it (up to" not in (log.read_text(errors="replace") if log.exists() else ""):
        assert not failed, f"the server did not wait for Redis: {failed[0]!r}"
        assert time.monotonic() < deadline, "the server never said it waits for Redis"
        time.sleep(0.1)
    time.sleep(1.0)  # and it goes on waiting
    try:
        assert not failed, f"the server did not wait for Redis: {failed[0]!r}"
        assert not started, "the server was ready without its cursor store"
    finally:
        redis.restart()  # on this thread: a server started from a thread that ends dies with it
        thread.join(90)
    assert not failed, f"the server did not start once Redis was up: {failed[0]!r}"
    (server,) = started
    assert "waiting for it (up to" in server.log_tail()
    with BatchClient(0, 1, server.address, "waited", timeout=30) as client:
        assert next(iter(client)).step == 0
    # a refused password is not waited for: it will not change by itself
    secured = redis_server_factory(password="right-password")
    began = time.monotonic()
    with pytest.raises(RuntimeError, match="password"):
        server_factory(extra=[*redis_args(secured.url_for(password="wrong-password")), "--store-wait", "60"])
    assert time.monotonic() - began < 30, "the server waited for a password that will not change"


def test_a_password_with_a_slash_is_never_printed(server_factory: Factory) -> None:
    """`openssl rand -base64` puts a / in many passwords: the server printed the URL whole, and
    redis-py's message quoted the password's head ("Port could not be cast to integer value as 'Kq3'")."""
    for password in ("Kq3/xZSECRETpart", "Kq3#xZSECRETpart", "Kq3?xZSECRETpart"):
        with pytest.raises(RuntimeError) as info:
            server_factory(extra=redis_args(f"redis://:{password}@127.0.0.1:1/0"))
        log = str(info.value)
        assert "Kq3" not in log, f"the password was printed: {log}"
        assert "SECRETpart" not in log, f"the password was printed: {log}"
        assert "/ as %2F" in log, f"the error does not say to percent-encode the password: {log}"


def test_a_replica_fails_at_start_up(
    redis_server_factory: Callable[..., Any], server_factory: Factory
) -> None:
    """A read-only replica passed start-up and readiness; every trainer's Open then failed."""
    primary = redis_server_factory()
    replica = redis_server_factory(extra_args=("--replicaof", "127.0.0.1", str(primary.port)))
    deadline = time.monotonic() + 30
    with replica.client() as client:  # synced: a replica still loading answers LOADING, not its role
        while client.info("replication").get("master_link_status") != "up":
            assert time.monotonic() < deadline, "the replica did not sync"
            time.sleep(0.05)
    with pytest.raises(RuntimeError, match="point LADLE_REDIS_URL / --redis-url at the primary"):
        server_factory(extra=redis_args(replica.url))
    server_factory(extra=redis_args(primary.url)).stop()


def test_a_malformed_job_in_redis_fails_only_itself(
    redis_server_factory: Callable[..., Any], server_factory: Factory
) -> None:
    """One job hash missing a field broke `/v1/jobs` and the page for every job (500), and its trainer
    got `Unexpected <class 'KeyError'>` (gRPC UNKNOWN)."""
    redis = redis_server_factory()
    server = server_factory(extra=redis_args(redis.url))
    with BatchClient(0, 1, server.address, "good", timeout=30) as client:
        next(iter(client))
    with redis.client() as admin:
        admin.hset("ladle:{bad}:job", "world_size", 4)
    for path in ("/v1/jobs", "/"):
        try:
            with urllib.request.urlopen(server.http_url + path, timeout=30) as response:
                body = response.read().decode()
        except urllib.error.HTTPError as exc:
            raise AssertionError(f"GET {path}: HTTP {exc.code}") from None
        assert "good" in body, f"GET {path} lost the healthy job"
    with pytest.raises(BatchClientError) as info, BatchClient(0, 4, server.address, "bad", timeout=10) as bad:
        next(iter(bad))
    assert not isinstance(info.value, ServerUnavailableError), "a malformed job is not a passing outage"
    assert "ladle jobs --delete bad --force" in str(info.value), str(info.value)
    assert "Traceback" not in server.log_tail(), server.log_tail()
