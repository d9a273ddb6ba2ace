"""The fault campaign (issue 30): real trainer processes, one fault per trial, every batch checked.

Each trial starts its own redis-server (AOF, ``appendfsync always``), its own
``ladle serve`` with a token file, and ``WORLD`` trainer processes
(``trainer_proc.py``: a checkpoint after every batch, every batch received
logged to a JSONL file per process). Hypothesis picks the fault, the rank it
hits and the point (the victim's number of batches received, plus a jitter):

* ``server``: kill -9 of the batch server, started again on its port;
* ``redis``: kill -9 of Redis, started again from its AOF;
* ``trainer``: kill -9 of a trainer, restarted from its checkpoint;
* ``noload``: a trainer killed (kill -9) or closed (SIGTERM: the client's
  ``with`` block closes it) and a new process started for its rank WITHOUT
  loading its checkpoint, while the other ranks run on;
* ``stale``: a trainer frozen (SIGSTOP) at the start of a training step,
  replaced by a new process that loads its checkpoint, then continued
  (SIGCONT);
* ``flood``: 100-200 calls without the token (health Watch calls and Stream
  calls whose requests never come) opened during training and held open while
  the trainers read on.

What every trial asserts, for every rank and every process that served it:

1. each process received a contiguous run of the epoch's steps in order, each
   batch's sample ids exactly ``build_schedule``'s (``reference``) for its
   (step, rank), in epoch 0 only; the first process starts at step 0 and the
   last one ends at the epoch's last step (nothing lost, nothing out of order);
2. without a restart (server, redis, flood and the ranks not hit), the rank's
   single process received exactly the schedule, once;
3. a restart from a checkpoint (trainer, stale) starts exactly at the
   checkpoint's position (its first batch is the loaded step), and the rank's
   final checkpoint records equal the schedule (nothing repeated past a
   checkpoint, nothing lost);
4. a restart without a checkpoint (noload) starts at the job's cursor
   (docs/state.md, Resume): min(own stored position, the earliest other
   rank's). With h the last step the old process received (logged before it
   trained on it) and O the other rank's stored position read from Redis just
   before the new process started (positions only grow), the new process's
   first step f satisfies ``min(own_low, O) <= f <= min(h + 1, O_after)``:
   ``own_low`` is h after a close (the held batch comes again, nothing before
   it) and h - 1 after a kill -9 (also the batch before it, whose
   acknowledgement the client may hold back up to ACK_DELAY, 5 ms, and which
   dies with the process), ``O_after`` the other rank's stored position read
   once the new process has its first batch. So the held batch (and after a
   kill the one before) may come again, and the batches beyond the rank
   furthest behind, never the epoch from its start, and nothing is skipped;
5. the stale process exits 3 (``FencedError``), receives no batch after it was
   continued and writes no checkpoint then (it logs each checkpoint before
   replacing the file). A training step here is work that does not advance
   while the process is stopped (``--slices``), and the stop lands at a step's
   start: continued, the process finishes its step before it checkpoints, so
   the fence's status (sent while it was stopped) has reached its reader
   thread. A process that checkpoints within a millisecond of SIGCONT can
   still get its position (docs/state.md, Fencing): that known limit is not
   tested;
6. the flood: every Stream without the token is refused UNAUTHENTICATED, every
   Watch is answered SERVING or refused RESOURCE_EXHAUSTED
   (too_many_watches), and every trainer finishes with exit 0 and an exact
   stream.

``LADLE_CAMPAIGN_TRIALS`` sets the number of random trials (3 in CI, after the
seven explicit examples: each fault once, noload both killed and closed);
``LADLE_CAMPAIGN_REPORT=PATH`` appends one JSON line per trial (fault, rank,
point, batches checked, seconds, outcome).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from ladle.proto import ladle_pb2 as pb
from ladle.proto import rpc
from ladle.service.schedule import Schedule
from tests.support.redis_server import RedisServer, redis_server_available

from .conftest import ServerProcess
from .test_serving import reference

TRAINER = Path(__file__).with_name("trainer_proc.py")
WORLD = 2
DELAY = 0.02  # one training step; 74 steps an epoch for the small dataset at world 2
SLICES = 20  # a step is 20 sleeps of 1 ms: work that does not advance while stopped
TOKEN = "tok-" + "campaign-Q7w8E9r0T1y2U3i4-secret"
KINDS = ("server", "redis", "trainer", "noload", "stale", "flood")
TRIALS = int(os.environ.get("LADLE_CAMPAIGN_TRIALS", "3"))
REPORT = os.environ.get("LADLE_CAMPAIGN_REPORT", "")
OWN_CONNECTION = [("grpc.use_local_subchannel_pool", 1)]
Position = tuple[int, int]


@dataclass
class Proc:
    """One trainer process of a rank, with its JSONL event log."""

    popen: subprocess.Popen[bytes]
    log: Path
    out: Path
    checkpoint: Path

    def events(self) -> list[dict[str, Any]]:
        if not self.log.exists():
            return []
        lines = self.log.read_text().splitlines()
        return [json.loads(line) for line in lines if line]

    def batches(self) -> list[dict[str, Any]]:
        return [e for e in self.events() if e["event"] == "batch"]

    def output(self) -> str:
        return self.out.read_text(errors="replace")[-3000:] if self.out.exists() else ""


@dataclass
class Ranks:
    """The trainer processes of one job, rank by rank in the order they started."""

    workdir: Path
    server: str
    job: str
    procs: dict[int, list[Proc]] = field(default_factory=dict)

    def start(
        self, rank: int, *, checkpoint: Path | None = None, no_load: bool = False, closes: bool = False
    ) -> Proc:
        n = len(self.procs.setdefault(rank, []))
        path = checkpoint or self.workdir / f"rank{rank}.json"
        log, out = self.workdir / f"rank{rank}-p{n}.jsonl", self.workdir / f"rank{rank}-p{n}.out"
        cmd = [sys.executable, str(TRAINER), self.server, self.job, str(rank), str(WORLD), str(path)]
        cmd += ["--delay", str(DELAY), "--slices", str(SLICES), "--log", str(log)]
        cmd += ["--no-load"] * no_load + ["--close-on-term"] * closes
        env = {**os.environ, "LADLE_TOKEN": TOKEN}
        with out.open("ab") as sink:
            popen = subprocess.Popen(cmd, stdout=sink, stderr=subprocess.STDOUT, env=env)
        proc = Proc(popen, log, out, path)
        self.procs[rank].append(proc)
        return proc

    def last(self, rank: int) -> Proc:
        return self.procs[rank][-1]

    def wait_for(self, proc: Proc, count: int, timeout: float = 60) -> None:
        """Until ``proc`` has received ``count`` batches."""
        deadline = time.monotonic() + timeout
        while len(proc.batches()) < count:
            assert proc.popen.poll() is None or len(proc.batches()) >= count, (
                f"the trainer exited {proc.popen.returncode} early: {proc.output()}"
            )
            assert time.monotonic() < deadline, f"no progress: {proc.output()}"
            time.sleep(0.005)

    def finish(self, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        for rank, procs in self.procs.items():
            proc = procs[-1]
            try:
                proc.popen.wait(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                raise AssertionError(f"rank {rank} did not finish: {proc.output()}") from None
            assert proc.popen.returncode == 0, f"rank {rank} exited {proc.popen.returncode}: {proc.output()}"

    def stop(self) -> None:
        for procs in self.procs.values():
            for proc in procs:
                if proc.popen.poll() is None:
                    proc.popen.send_signal(signal.SIGCONT)  # a stopped one too
                    proc.popen.kill()
                    proc.popen.wait(timeout=30)


def stored(redis: RedisServer, job: str, rank: int) -> Position:
    """The rank's position in the store (``ladle:{job}:ranks``: epoch,step,generation,last_seen)."""
    with redis.client() as admin:
        value = admin.hget(f"ladle:{{{job}}}:ranks", str(rank))
    assert value is not None, f"job {job} rank {rank} is not in the store"
    text = value.decode() if isinstance(value, bytes) else str(value)
    epoch, step = text.split(",")[:2]
    return int(epoch), int(step)


def position(sched: Schedule, epoch: int, step: int) -> Position:
    """(epoch, step) with the step past the epoch's last as the next epoch's start."""
    return (epoch + 1, 0) if step >= sched.num_steps else (epoch, step)


def check_run(sched: Schedule, rank: int, proc: Proc) -> list[int]:
    """Assert 1 for one process: contiguous steps of epoch 0, each exactly the schedule's; its steps."""
    got = proc.batches()
    steps = [b["step"] for b in got]
    assert all(b["epoch"] == 0 for b in got), f"rank {rank}: a batch of another epoch: {steps}"
    if steps:
        assert steps == list(range(steps[0], steps[0] + len(steps))), (
            f"rank {rank} ({proc.log.name}): a gap, a repeat or another order: {steps}"
        )
    for b in got:
        assert b["ids"] == sched.samples(b["step"], rank).tolist(), (
            f"rank {rank} step {b['step']}: other samples than the schedule"
        )
    return steps


# --- the flood -------------------------------------------------------------------


class Flood:
    """``size`` calls without a token: 3/4 health Watches, the rest Streams that send nothing."""

    def __init__(self, address: str, size: int) -> None:
        self.release = threading.Event()
        self.channels = [grpc.insecure_channel(address, options=OWN_CONNECTION) for _ in range(4)]
        self.watches: list[Any] = []
        self.streams: list[Any] = []
        watches = size * 3 // 4
        for i in range(watches):
            stub = health_pb2_grpc.HealthStub(self.channels[i % len(self.channels)])
            self.watches.append(stub.Watch(health_pb2.HealthCheckRequest(service=""), timeout=120))
        for i in range(size - watches):
            client = rpc.BatchServiceClient(self.channels[i % len(self.channels)])
            self.streams.append(client.stream(self._nothing(), timeout=60))

    def _nothing(self) -> Iterator[pb.StreamRequest]:
        self.release.wait(60)
        yield from ()

    def outcomes(self) -> tuple[dict[str, int], dict[str, int]]:
        """How the Watches (first answer or refusal) and the Streams ended, counted by status."""
        watched: dict[str, int] = {}
        for call in self.watches:
            try:
                key = health_pb2.HealthCheckResponse.ServingStatus.Name(next(call).status)
            except grpc.RpcError as exc:
                details = rpc.error_details(exc.trailing_metadata())
                key = f"{exc.code().name}:{details.reason if details is not None else ''}"
            watched[key] = watched.get(key, 0) + 1
        streamed: dict[str, int] = {}
        for call in self.streams:
            try:
                next(call)
                key = "a frame"
            except StopIteration:
                key = "an empty end"
            except grpc.RpcError as exc:
                key = exc.code().name
            streamed[key] = streamed.get(key, 0) + 1
        return watched, streamed

    def close(self) -> None:
        self.release.set()
        for call in self.watches + self.streams:
            call.cancel()
        for channel in self.channels:
            channel.close()


# --- one trial -------------------------------------------------------------------


def wait_in_log(server: ServerProcess, pattern: str, timeout: float = 20) -> None:
    """Until a line of the server's whole log (all its starts) matches ``pattern``."""
    path = server.workdir / "server.log"
    deadline = time.monotonic() + timeout
    while not re.search(pattern, path.read_text(errors="replace")):
        assert time.monotonic() < deadline, f"no {pattern!r} in the server log: {server.log_tail()}"
        time.sleep(0.02)


def stopped(pid: int, timeout: float = 10) -> None:
    """Until the process is in state T (stopped), so its logs no longer change."""
    deadline = time.monotonic() + timeout
    while Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] not in ("T", "t"):
        assert time.monotonic() < deadline, f"process {pid} did not stop"
        time.sleep(0.001)


def stop_in_a_step(ranks: Ranks, proc: Proc, tries: int = 20) -> int:
    """SIGSTOP ``proc`` just after it logged a batch, in that batch's training step; its batches then.

    A stop that lands after the step (the step's checkpoint was logged, or its file
    is being replaced) is undone (SIGCONT) and tried at the next batch.
    """
    for _ in range(tries):
        count = len(proc.batches())
        ranks.wait_for(proc, count + 1)
        proc.popen.send_signal(signal.SIGSTOP)
        stopped(proc.popen.pid)
        events = proc.events()
        if events[-1]["event"] == "batch":
            return len(proc.batches())
        proc.popen.send_signal(signal.SIGCONT)
    raise AssertionError(f"no stop landed in a training step in {tries} tries")


def trial(
    kind: str, rank: int, at: int, jitter_ms: int, closes: bool, flood_size: int, workdir: Path, dataset: Path
) -> dict[str, Any]:
    """Run one fault; returns the figures of a trial that passed (raises on a failed check)."""
    sched = reference(dataset, WORLD)
    at = min(at, sched.num_steps - 10)  # the victim is still training when it is hit
    if kind == "trainer":  # its first checkpoint is written (batch 1 comes after it): one to restart from
        at = max(at, 2)
    job = f"c-{kind}-{rank}-{at}"
    token_file = workdir / "token"
    token_file.write_text(f"{TOKEN}\n")
    token_file.chmod(0o600)
    redis = RedisServer(appendonly=True, appendfsync="always")
    server = ServerProcess(dataset, workdir / "state.db", workdir, ["--redis-url", redis.url])
    server.extra += ["--token-file", str(token_file)]
    ranks: Ranks | None = None
    flood: Flood | None = None
    figures: dict[str, Any] = {}
    try:
        server.start()
        ranks = Ranks(workdir, server.address, job)
        for r in range(WORLD):
            ranks.start(r, closes=kind == "noload" and closes and r == rank)
        victim = ranks.last(rank)
        ranks.wait_for(victim, at)
        if kind != "stale":  # the stale one is stopped at its step's start
            time.sleep(jitter_ms / 1000)
        noload_bounds: tuple[Position, Position] | None = None
        stale: Proc | None = None
        if kind == "server":
            server.kill()
            server.start()  # the same port: the trainers reconnect
        elif kind == "redis":
            redis.restart(kill=True)  # the AOF (fsync always) brings the state back
        elif kind == "trainer":
            victim.popen.kill()
            victim.popen.wait(timeout=30)
            ranks.start(rank)  # loads its last checkpoint
        elif kind == "noload":
            victim.popen.send_signal(signal.SIGTERM if closes else signal.SIGKILL)
            code = victim.popen.wait(timeout=30)
            assert code == (143 if closes else -9), f"the old process exited {code}: {victim.output()}"
            h = victim.batches()[-1]["step"]
            wait_in_log(server, rf"stream end: job={job} rank={rank} generation=1 ")
            other = [stored(redis, job, r) for r in range(WORLD) if r != rank]
            new = ranks.start(rank, checkpoint=workdir / f"rank{rank}-noload.json", no_load=True)
            ranks.wait_for(new, 1)
            after = [stored(redis, job, r) for r in range(WORLD) if r != rank]
            own_low = position(sched, 0, h if closes else h - 1)
            low = min([own_low, *other])
            high = min([position(sched, 0, h + 1), *after])
            first = new.batches()[0]
            f = (first["epoch"], first["step"])
            figures["noload"] = {"h": h, "f": first["step"], "others_before": other, "others_after": after}
            assert low <= f <= high, (
                f"rank {rank} restarted without a checkpoint at {f}; the old process held step {h} "
                f"({'closed' if closes else 'killed'}), the other ranks were at {other} before and "
                f"{after} after: allowed {low}..{high}"
            )
            noload_bounds = (low, high)
        elif kind == "stale":
            stale = victim
            seen = stop_in_a_step(ranks, stale)  # at the start of the step of batch `seen - 1`
            events_at_stop = len(stale.events())
            new = ranks.start(rank)  # loads the stale one's checkpoint
            ranks.wait_for(new, 2)
            wait_in_log(server, rf"stream end: job={job} rank={rank} generation=1 .*fenced")
            before = stale.events()
            stale.popen.send_signal(signal.SIGCONT)
            try:
                code = stale.popen.wait(timeout=30)
            except subprocess.TimeoutExpired:
                raise AssertionError(f"the stale trainer went on: {stale.output()}") from None
            woke = stale.events()[len(before) :]
            assert code == 3, f"the stale trainer exited {code}, not 3 (FencedError): {stale.output()}"
            assert len(before) == events_at_stop, "the stale trainer logged while it was stopped"
            assert [e["event"] for e in woke] == ["fenced"], (
                f"the stale trainer received or checkpointed past the fence: {woke}"
            )
            figures["stale"] = {"held": seen - 1}
        elif kind == "flood":
            flood = Flood(server.address, flood_size)
            ranks.wait_for(victim, min(at + 15, sched.num_steps))  # trains on while the flood is open
            watched, streamed = flood.outcomes()
            figures["flood"] = {"watches": watched, "streams": streamed}
            assert set(streamed) == {"UNAUTHENTICATED"}, f"a Stream without the token: {streamed}"
            assert set(watched) <= {"SERVING", "RESOURCE_EXHAUSTED:too_many_watches"}, watched
        ranks.finish()
        if flood is not None:
            flood.close()
            flood = None
        checked = 0
        for r in range(WORLD):
            procs = ranks.procs[r]
            runs = []
            for proc in procs:
                runs.append(check_run(sched, r, proc))
                checked += len(runs[-1])
            assert runs[0][:1] == [0], f"rank {r}: the first process did not start at step 0"
            assert runs[-1][-1:] == [sched.num_steps - 1], f"rank {r}: the epoch's end is missing"
            if len(procs) == 1:
                assert runs[0] == list(range(sched.num_steps)), f"rank {r}: not the schedule once"
                assert procs[0].events()[0]["loaded"] is None
            for i in range(1, len(procs)):
                old, new_run, start = runs[i - 1], runs[i], procs[i].events()[0]
                if kind == "noload" and r == rank:
                    assert start["loaded"] is None, "the restart without a checkpoint loaded one"
                    continue  # bounds asserted above, at the restart
                # a checkpoint restart: exactly at the loaded position, at most the held batch again
                assert start["loaded"] is not None
                loaded = tuple(start["loaded"])
                assert (0, new_run[0]) == loaded, f"rank {r}: started at {new_run[0]}, loaded {loaded}"
                assert old[-1] <= new_run[0] <= old[-1] + 1, f"rank {r}: {old[-1]} then {new_run[0]}"
            # the final checkpoint of the rank's last process (a no-load restart writes its own)
            records = json.loads(procs[-1].checkpoint.read_text())["records"]
            first_step = runs[-1][0] if kind == "noload" and r == rank else 0
            assert records == [
                [0, s, *sched.samples(s, r).tolist()] for s in range(first_step, sched.num_steps)
            ], f"rank {r}: the checkpoint's records differ from the schedule"
        if stale is not None:  # the stale one's log ends with its fence, after its run's last batch
            assert stale.events()[-1]["event"] == "fenced"
        figures.update(batches=checked, bounds=noload_bounds)
        return figures
    finally:
        if flood is not None:
            flood.close()
        if ranks is not None:
            ranks.stop()
        server.kill()
        redis.close()


# --- the property ------------------------------------------------------------------


@pytest.fixture(scope="module")
def campaign_redis() -> None:
    """The campaign needs redis-server (installed wherever CI runs; this fails rather than skips)."""
    assert redis_server_available(), "redis-server is not installed"


def _record(line: dict[str, Any]) -> None:
    if REPORT:
        with open(REPORT, "a") as out:
            out.write(json.dumps(line) + "\n")


@pytest.mark.timeout(300 + 30 * (TRIALS + 7))  # pytest-timeout bounds all the trials together
@settings(
    max_examples=TRIALS,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    kind=st.sampled_from(KINDS),
    rank=st.integers(0, WORLD - 1),
    at=st.integers(1, 64),
    jitter_ms=st.integers(0, 20),
    closes=st.booleans(),
    flood_size=st.integers(100, 200),
)
@example(kind="server", rank=0, at=20, jitter_ms=5, closes=False, flood_size=100)
@example(kind="redis", rank=0, at=30, jitter_ms=0, closes=False, flood_size=100)
@example(kind="trainer", rank=1, at=25, jitter_ms=7, closes=False, flood_size=100)
@example(kind="noload", rank=0, at=30, jitter_ms=10, closes=False, flood_size=100)
@example(kind="noload", rank=1, at=15, jitter_ms=3, closes=True, flood_size=100)
@example(kind="stale", rank=1, at=20, jitter_ms=0, closes=False, flood_size=100)
@example(kind="flood", rank=0, at=10, jitter_ms=0, closes=False, flood_size=160)
def test_a_fault_anywhere_loses_repeats_and_reorders_nothing(
    kind: str,
    rank: int,
    at: int,
    jitter_ms: int,
    closes: bool,
    flood_size: int,
    campaign_redis: None,
    small_dataset: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    workdir = tmp_path_factory.mktemp(f"campaign-{kind}")
    began = time.monotonic()
    line: dict[str, Any] = dict(kind=kind, rank=rank, at=at, jitter_ms=jitter_ms, closes=closes)
    if kind == "flood":
        line["flood_size"] = flood_size
    try:
        figures = trial(kind, rank, at, jitter_ms, closes, flood_size, workdir, small_dataset)
    except BaseException as exc:
        line.update(
            ok=False, error=f"{exc!r}"[:2000], trace=traceback.format_exc()[-3000:], workdir=str(workdir)
        )
        raise
    else:
        line.update(ok=True, **figures)
    finally:
        line["seconds"] = round(time.monotonic() - began, 2)
        _record(line)
