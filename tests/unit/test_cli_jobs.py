"""``ladle jobs`` (list, delete) on both stores, and the store options of ``ladle serve``."""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from ladle.service import cli  # noqa: E402
from ladle.service.store import CursorStore, EmbeddedStore, JobSpec, Position, RedisCursorStore  # noqa: E402
from ladle.service.store.base import Resize  # noqa: E402
from tests.support.redis_server import RedisServer  # noqa: E402

T0 = 1_700_000_000.0


class Target:
    """One store to run ``ladle jobs`` against: the flags that name it and a handle to fill it."""

    def __init__(self, flags: list[str], store: CursorStore) -> None:
        self.flags = flags
        self.store = store


@pytest.fixture(params=["embedded", "redis"])
def target(
    request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[Target]:
    monkeypatch.delenv(cli.REDIS_URL_ENV, raising=False)
    store: CursorStore
    if request.param == "embedded":
        path = tmp_path / "state.db"
        store = EmbeddedStore(path, clock=lambda: T0)
        flags = ["--state", str(path)]
    else:
        server: RedisServer = request.getfixturevalue("redis_server")
        store = RedisCursorStore(server.url, clock=lambda: T0)
        flags = ["--redis-url", server.url]
    with store:
        yield Target(flags, store)


def _fill(store: CursorStore) -> None:
    store.open_job(JobSpec("run-b", "d", "c", 2), incarnation="feedbeef")
    store.open_job(
        JobSpec("run-a", "d", "c", 3), incarnation="abad1dea", plan=(Resize(1, (Position(0, 4),)),)
    )
    for rank, step in ((0, 5), (1, 9), (1, 12)):
        generation = store.join("run-a", rank, 3).generation
        store.advance("run-a", rank, generation, Position(1, step))


def test_an_empty_store(target: Target, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["jobs", *target.flags]) == 0
    assert "no jobs" in capsys.readouterr().out
    assert cli.main(["jobs", *target.flags, "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == []


def test_the_table(target: Target, capsys: pytest.CaptureFixture[str]) -> None:
    _fill(target.store)
    assert cli.main(["jobs", *target.flags]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split()[:5] == ["job", "world", "min", "pos", "max"]
    assert lines[2].split() == [
        "run-a",
        "3",
        "0:0",
        "1:12",
        "0..2",
        "2023-11-14",
        "22:13:20",
        "abad1dea",
        "1",
    ]
    assert lines[3].split() == ["run-b", "2", "0:0", "0:0", "0", "2023-11-14", "22:13:20", "feedbeef", "0"]


def test_the_json(target: Target, capsys: pytest.CaptureFixture[str]) -> None:
    _fill(target.store)
    assert cli.main(["jobs", *target.flags, "--json"]) == 0
    docs = json.loads(capsys.readouterr().out)
    assert [d["job"] for d in docs] == ["run-a", "run-b"]
    a = docs[0]
    assert a["world_size"] == 3
    assert (a["min_position"], a["max_position"], a["generations"]) == ([0, 0], [1, 12], [0, 2])
    assert (a["updated"], a["incarnation"], a["resizes"]) == (T0, "abad1dea", 1)
    assert a["ranks"][1] == {"rank": 1, "epoch": 1, "step": 12, "generation": 2, "last_seen": T0}


def test_delete(target: Target, capsys: pytest.CaptureFixture[str]) -> None:
    _fill(target.store)
    assert cli.main(["jobs", *target.flags, "--delete", "run-b"]) == 0
    assert "deleted job 'run-b'" in capsys.readouterr().out
    assert [j.job for j in target.store.list_jobs()] == ["run-a"]
    # an unknown name: the others are still deleted, the exit status says one was not there
    assert cli.main(["jobs", *target.flags, "--delete", "run-a", "no-such-job"]) == 1
    out = capsys.readouterr()
    assert "deleted job 'run-a'" in out.out
    assert "job 'no-such-job' not found" in out.err
    assert target.store.list_jobs() == []
    assert cli.main(["jobs", *target.flags, "--delete", "gone", "--json"]) == 1
    assert json.loads(capsys.readouterr().out) == {"deleted": [], "not_found": ["gone"]}


def test_a_bad_job_name_is_a_usage_error(target: Target, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["jobs", *target.flags, "--delete", "has space"]) == 2
    assert "job" in capsys.readouterr().err


def test_a_missing_state_file_is_not_created(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "nothing.db"
    assert cli.main(["jobs", "--state", str(path)]) == 2
    assert "no cursor store at" in capsys.readouterr().err
    assert not path.exists()


def test_the_redis_url_comes_from_the_environment(
    redis_server_factory: Callable[..., RedisServer],
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    server = redis_server_factory(password="pa55-Word")
    with RedisCursorStore(server.url) as store:
        _fill(store)
    monkeypatch.setenv(cli.REDIS_URL_ENV, server.url)
    assert cli.main(["jobs", "--json"]) == 0
    assert [d["job"] for d in json.loads(capsys.readouterr().out)] == ["run-a", "run-b"]
    monkeypatch.setenv(cli.REDIS_URL_ENV, server.url_for(password="wrong-pa55"))
    assert cli.main(["jobs"]) == 2
    out = capsys.readouterr()
    assert "password" in out.err
    assert "wrong-pa55" not in out.err + out.out, "the password leaked into the output"


def test_a_listing_reads_a_redis_replica_and_warns_of_nothing(
    redis_server_factory: Callable[..., RedisServer],
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A listing is a read: an operator may look at a replica, and the server's start-up warnings
    (no persistence, eviction) are not the listing's to repeat on every run. --delete writes."""
    monkeypatch.delenv(cli.REDIS_URL_ENV, raising=False)
    primary = redis_server_factory()  # no persistence: what the server would warn of
    with RedisCursorStore(primary.url) as store:
        _fill(store)
    replica = redis_server_factory(extra_args=("--replicaof", "127.0.0.1", str(primary.port)))
    with replica.client() as admin:
        for _ in range(200):  # the first sync takes a moment
            if admin.dbsize():
                break
            time.sleep(0.05)
    caplog.clear()
    assert cli.main(["jobs", "--redis-url", replica.url, "--json"]) == 0
    assert [d["job"] for d in json.loads(capsys.readouterr().out)] == ["run-a", "run-b"]
    assert not [r for r in caplog.records if r.levelname == "WARNING"], caplog.text
    assert cli.main(["jobs", "--redis-url", replica.url, "--delete", "run-b", "--force"]) == 2
    assert "is a replica" in capsys.readouterr().err


def test_serve_passes_the_store_options(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from ladle.service import server as server_module

    seen: dict[str, Any] = {}

    class FakeServer:
        def __init__(self, dataset: str, config: Any, **kwargs: Any) -> None:
            seen.update(kwargs)

    monkeypatch.setattr(server_module, "BatchServer", FakeServer)
    monkeypatch.setattr(server_module, "serve_forever", lambda server, **files: 0)
    monkeypatch.delenv(cli.REDIS_URL_ENV, raising=False)
    assert cli.main(["serve", str(tmp_path), "--redis-url", "redis://h:1/2", "--job-ttl", "60"]) == 0
    assert (seen["redis_url"], seen["job_ttl_s"]) == ("redis://h:1/2", 60.0)
    monkeypatch.setenv(cli.REDIS_URL_ENV, "redis://from-env:1/0")
    assert cli.main(["serve", str(tmp_path)]) == 0
    assert (seen["redis_url"], seen["job_ttl_s"]) == ("redis://from-env:1/0", 7 * 86400.0)
    # an explicit --state wins over the environment (it silently went to Redis, where `jobs` did not)
    assert cli.main(["serve", str(tmp_path), "--state", str(tmp_path / "s.db")]) == 0
    assert seen["redis_url"] is None
    assert seen["state"] == str(tmp_path / "s.db")
    monkeypatch.delenv(cli.REDIS_URL_ENV)
    assert cli.main(["serve", str(tmp_path)]) == 0
    assert (seen["redis_url"], seen["state"]) == (None, cli.DEFAULT_STATE)
    with pytest.raises(SystemExit) as refused:  # both: one store or the other, as for `jobs`
        cli.main(["serve", str(tmp_path), "--state", "s.db", "--redis-url", "redis://h:1/2"])
    assert refused.value.code == 2


def _with_the_real_clock(target: Target) -> CursorStore:
    """Another handle on the target's store whose clock is now (the fixture's stands in 2023)."""
    flag, where = target.flags
    return EmbeddedStore(where) if flag == "--state" else RedisCursorStore(where)


def test_delete_refuses_a_job_whose_trainers_run(target: Target, capsys: pytest.CaptureFixture[str]) -> None:
    _fill(target.store)  # run-a and run-b, last seen in 2023
    with _with_the_real_clock(target) as store:
        store.open_job(JobSpec("live", "d", "c", 2))
        store.join("live", 1, 2)  # a trainer of rank 1 opened its stream just now
    assert cli.main(["jobs", *target.flags, "--delete", "run-b", "live"]) == 2
    out = capsys.readouterr()
    # right whether its trainers still run or stopped cleanly a moment ago: the store cannot tell
    assert out.err.startswith(
        "ladle: error: job 'live' has ranks seen 0 s ago: if its trainers are still running, stop them first"
    ), out.err
    assert "a job can be deleted 5 minutes after its last rank was seen, or now with --force" in out.err
    assert out.err.count("\n") == 1, f"not one line: {out.err!r}"
    assert "deleted" not in out.out
    assert [j.job for j in target.store.list_jobs()] == ["live", "run-a", "run-b"], "a refusal deleted a job"
    # a job last seen long ago is deleted as before; --force deletes a live one
    assert cli.main(["jobs", *target.flags, "--delete", "run-b"]) == 0
    assert cli.main(["jobs", *target.flags, "--delete", "live", "--force"]) == 0
    assert "deleted job 'live'" in capsys.readouterr().out
    assert [j.job for j in target.store.list_jobs()] == ["run-a"]


def test_a_redis_url_needs_its_scheme(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.delenv(cli.REDIS_URL_ENV, raising=False)
    assert cli.main(["jobs", "--redis-url", "localhost:26391"]) == 2
    err = capsys.readouterr().err
    assert "redis_url: --redis-url needs a URL that starts with redis://" in err, err
    assert "did you mean redis://localhost:26391?" in err
    assert "localhost://" not in err, "the URL was echoed as if localhost were its scheme"
    # a value that may hold a password is not echoed
    monkeypatch.setenv(cli.REDIS_URL_ENV, ":s3cret@localhost:26391")
    assert cli.main(["jobs"]) == 2
    err = capsys.readouterr().err
    assert "$LADLE_REDIS_URL needs a URL that starts with redis://" in err
    assert "s3cret" not in err, "the password leaked into the output"


@pytest.mark.parametrize("command", [["jobs"], ["serve", "no-such-dataset"]])
def test_an_empty_redis_url_is_refused_not_taken_for_the_embedded_store(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path, command: list[str]
) -> None:
    """An empty Secret or unset shell variable gave each replica an embedded store of its own."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv(cli.REDIS_URL_ENV, "")
    assert cli.main(command) == 2
    assert "$LADLE_REDIS_URL is set but empty" in capsys.readouterr().err
    monkeypatch.delenv(cli.REDIS_URL_ENV)
    assert cli.main([*command, "--redis-url", ""]) == 2
    assert "--redis-url is set but empty" in capsys.readouterr().err
    assert not (tmp_path / ".ladle").exists(), "an embedded store was made"


def test_a_listing_reads_the_file_as_it_is_beside_a_busy_writer(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """It took the write lock (failing after 14 s beside another writer, and on a read-only mount) and
    migrated an older ladle's file, which that ladle then refused."""
    import sqlite3
    import time

    monkeypatch.delenv(cli.REDIS_URL_ENV, raising=False)
    path = tmp_path / "state.db"
    with EmbeddedStore(path) as store:
        _fill(store)
    holder = sqlite3.connect(path, isolation_level=None)
    holder.execute("BEGIN IMMEDIATE")  # another process's write in progress (a VACUUM, a sqlite3 shell)
    try:
        before = path.read_bytes()
        began = time.monotonic()
        assert cli.main(["jobs", "--state", str(path), "--json"]) == 0
        assert time.monotonic() - began < 5.0, "the listing waited for the write lock"
        assert [job["job"] for job in json.loads(capsys.readouterr().out)] == ["run-a", "run-b"]
        assert path.read_bytes() == before, "a listing changed the file"
    finally:
        holder.rollback()
        holder.close()
    with sqlite3.connect(path) as db:  # an older schema is listed, not migrated
        db.execute("PRAGMA user_version = 2")
        db.execute("ALTER TABLE jobs DROP COLUMN expires")
    assert cli.main(["jobs", "--state", str(path)]) == 0
    assert "run-a" in capsys.readouterr().out
    with sqlite3.connect(path) as db:
        assert db.execute("PRAGMA user_version").fetchone() == (2,), "a listing migrated the file"
