"""A client churning through world sizes against a real ``ladle serve``: refused, and memory stays flat.

Every Open of a world size the server has no schedule for builds one (and its
stream prepares the next epoch). Nothing bounded them: 300 such Opens on the
200,000-row sample took the server from 239 MB to 1.47 GB, which it kept, and
each left a job behind. Now the schedules that Opens had built and no stream
uses count against ``--max-schedules`` (16) and ``--max-schedules-per-client``
(8) for a minute; beyond, Opens are refused with RESOURCE_EXHAUSTED, nothing
stored. ``benchmarks/bench_churn.py`` measures the sample itself.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest

from ladle.client import BatchClient
from ladle.proto import ladle_pb2 as pb
from ladle.proto import rpc
from ladle.service.synth import make_dataset

from .conftest import ServerProcess

Factory = Callable[..., ServerProcess]

# A schedule of this dataset holds about 0.6 MB (6 bytes a row); the server keeps at most 16 that
# Opens built and no stream uses, 4 spare ones, and those streams are on (one here). Before the limit
# the loops below had it build about 300 (2 for each Open): RssAnon grew by 300 MB and more.
ROWS = 100_000
GROWTH_LIMIT_KIB = 96 * 1024


@pytest.fixture(scope="module")
def churn_dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("churn-ds") / "ds"
    make_dataset(out, ROWS, seed=5, scale=1 / 16)
    return out


def rss_anon_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1])
    raise AssertionError("no RssAnon in /proc/PID/status")


def open_once(channel: grpc.Channel, job: str, world_size: int, client_id: str) -> pb.Error | None:
    """Rank 0 of a new job reads its first batch and goes (None), or is refused (its ``ladle.v1.Error``)."""
    stop = threading.Event()

    def requests() -> Iterator[pb.StreamRequest]:
        yield pb.StreamRequest(
            open=pb.Open(job=job, rank=0, world_size=world_size, prefetch=1, client_id=client_id)
        )
        stop.wait(60)

    call = rpc.BatchServiceClient(channel).stream(requests(), timeout=60)
    try:
        for i, _ in enumerate(call):
            if i == 1:  # the StreamStart, then a batch
                return None
        raise AssertionError(f"the stream of {job} ended without a batch or a status")
    except grpc.RpcError as exc:
        refused = exc
    finally:
        stop.set()
        call.cancel()
    assert refused.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, (
        f"{job}: {refused.code()} {refused.details()}"
    )
    error = rpc.error_details(refused.trailing_metadata())
    assert error is not None, f"{job}: refused without a ladle.v1.Error trailer"
    return error


def test_a_client_churning_through_world_sizes_is_refused_and_memory_stays_flat(
    server_factory: Factory, churn_dataset: Path
) -> None:
    server = server_factory(dataset=churn_dataset)
    assert server.proc is not None
    pid = server.proc.pid
    # a trainer streaming through all of it: what it is on is in use, never dropped nor counted
    trainer = BatchClient(0, 1, server.address, "trainer", timeout=60, client_id="trainer")
    batches = iter(trainer)
    try:
        for _ in range(20):
            next(batches)
        time.sleep(0.5)
        steady = peak = rss_anon_kib(pid)
        with grpc.insecure_channel(server.address) as channel:
            # one client: refused past its own limit, naming it
            one = [open_once(channel, f"one-{w}", w, "churner") for w in range(2, 14)]
            peak = max(peak, rss_anon_kib(pid))
            assert [e is None for e in one] == [True] * 8 + [False] * 4, [e and e.reason for e in one]
            refusal = one[-1]
            assert refusal is not None
            assert refusal.reason == "too_many_schedules_per_client", refusal
            assert "--max-schedules-per-client) is 8" in refusal.message, refusal.message
            assert "client churner at 127.0.0.1" in refusal.message, refusal.message
            # ... and it starves no one else
            assert open_once(channel, "other-100", 100, "someone-else") is None
            # a client_id per Open: the server's limit holds (8 + 1 built above, 7 more)
            many = []
            for w in range(200, 350):
                many.append(open_once(channel, f"many-{w}", w, f"churner-{w}"))
                peak = max(peak, rss_anon_kib(pid))
            admitted = sum(e is None for e in many)
            assert admitted == 7, f"{admitted} of 150 Opens of new world sizes admitted"
            refused = [e for e in many if e is not None]
            assert {e.reason for e in refused} == {"too_many_schedules"}, {e.reason for e in refused}
            assert "(ladle serve --max-schedules) is 16" in refused[0].message, refused[0].message
            # refused before anything was stored: no job left behind
            stub = rpc.BatchServiceClient(channel)
            for job in ("many-349", "one-13"):
                with pytest.raises(grpc.RpcError) as info:
                    stub.describe(job, timeout=30)
                assert info.value.code() == grpc.StatusCode.NOT_FOUND, f"{job}: {info.value.details()}"
            assert stub.describe("many-200", timeout=30).world_size == 200  # admitted: stored
            # a world size built already needs no build: admitted however full the limits are
            assert open_once(channel, "again-2", 2, "churner") is None
        time.sleep(1.0)
        after = rss_anon_kib(pid)
        grown = max(peak, after) - steady
        assert grown < GROWTH_LIMIT_KIB, (
            f"RssAnon grew {grown // 1024} MiB over the steady {steady // 1024} MiB (peak {peak // 1024}, "
            f"after {after // 1024}) for Opens of new world sizes, limit {GROWTH_LIMIT_KIB // 1024} MiB"
        )
        # the trainer streamed on throughout, and a new one of a kept world size starts
        for _ in range(100):
            next(batches)
        with BatchClient(0, 1, server.address, "after-churn", timeout=60) as client:
            fresh = iter(client)
            for _ in range(10):
                next(fresh)
    finally:
        trainer.close()
    log = server.log_tail()
    assert "Traceback" not in log, log
