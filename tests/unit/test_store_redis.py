"""The Redis cursor store: the whole store contract, plus what only a Redis server can show.

Every test gets its own ``redis-server`` on a free loopback port
(``tests/support/redis_server.py``, started in a few milliseconds), never the
shared one on 6379. Tests are skipped where no ``redis-server`` is installed.
"""

from __future__ import annotations

import functools
import itertools
import json
import logging
import multiprocessing
import os
import pickle
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from urllib.parse import quote

import pytest
import redis
from redis.crc import key_slot

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from ladle.service import cli  # noqa: E402
from ladle.service.errors import (  # noqa: E402
    ConfigError,
    FencedError,
    JobNotFoundError,
    StoreCorruptError,
    StoreError,
    StoreFormatError,
    StoreUnavailableError,
    reason_of,
)
from ladle.service.store import (  # noqa: E402
    Clock,
    CursorStore,
    EmbeddedStore,
    JobSpec,
    Position,
    RedisCursorStore,
    open_store,
)
from ladle.service.store.base import MAX_INDEX  # noqa: E402
from ladle.service.store.redis import FORMAT_VERSION, redact_url, redis_client  # noqa: E402
from tests.contract.store_contract import SPEC, MakeStore, StoreContract, StoreFactory  # noqa: E402
from tests.support.certs import Pki, make_pki, openssl_available  # noqa: E402
from tests.support.redis_server import RedisServer  # noqa: E402

StartServer = Callable[..., RedisServer]
PASSWORD = "s3cret-Pa55word"


class TestRedisStore(StoreContract):
    @pytest.fixture
    def make_store(self, redis_server: RedisServer) -> Iterator[MakeStore]:
        made: list[RedisCursorStore] = []

        def make(clock: Clock) -> CursorStore:
            made.append(RedisCursorStore(redis_server.url, clock=clock))
            return made[-1]

        yield make
        for store in made:
            store.close()

    @pytest.fixture
    def process_factory(self, redis_server: RedisServer) -> StoreFactory:
        return functools.partial(RedisCursorStore, redis_server.url)


# --- the layout in Redis --------------------------------------------------------


def test_keys_live_under_the_namespace_and_the_jobs_hash_tag(redis_server: RedisServer) -> None:
    with RedisCursorStore(redis_server.url, clock=lambda: 1234.5) as store, redis_server.client() as client:
        store.open_job(SPEC)
        generation = store.join(SPEC.job, 2, 4).generation
        store.advance(SPEC.job, 2, generation, Position(3, 7))
        # and the readiness check's own key (a write, so a replica or a full Redis is not ready)
        assert sorted(client.keys("*")) == ["ladle:readiness", "ladle:{run-42}:job", "ladle:{run-42}:ranks"]
        job = client.hgetall("ladle:{run-42}:job")
        assert {k: job[k] for k in ("dataset_fingerprint", "config_fingerprint", "world_size", "plan")} == {
            "dataset_fingerprint": SPEC.dataset_fingerprint,
            "config_fingerprint": SPEC.config_fingerprint,
            "world_size": "4",
            "plan": "[]",
        }
        assert float(job["created"]) == 1234.5
        ranks = client.hgetall("ladle:{run-42}:ranks")
        assert ranks == {"0": "0,0,0,1234.5", "1": "0,0,0,1234.5", "2": "3,7,1,1234.5", "3": "0,0,0,1234.5"}
        # both keys hash to one cluster slot (the {run-42} tag)
        assert key_slot(b"ladle:{run-42}:job") == key_slot(b"ladle:{run-42}:ranks") == key_slot(b"run-42")


def test_namespaces_keep_stores_apart(redis_server: RedisServer) -> None:
    with (
        RedisCursorStore(redis_server.url) as a,
        RedisCursorStore(redis_server.url, namespace="other") as b,
    ):
        a.open_job(SPEC)
        assert b.list_jobs() == []
        with pytest.raises(JobNotFoundError):
            b.get(SPEC.job)
        assert [j.job for j in a.list_jobs()] == [SPEC.job]
    with pytest.raises(ConfigError) as info:
        RedisCursorStore(redis_server.url, namespace="a{b}")
    assert info.value.field == "namespace"


def test_integers_to_2_53_and_float_times_round_trip_exactly(redis_server: RedisServer) -> None:
    times = itertools.chain([0.1 + 0.2, 1e-300, 1.7976931348623157e308], itertools.repeat(1.7e9 + 1 / 3))
    with RedisCursorStore(redis_server.url, clock=lambda: next(times)) as store:
        store.open_job(SPEC)
        top = Position(MAX_INDEX, MAX_INDEX)
        assert store.reconcile(SPEC.job, 1, MAX_INDEX, top).position == top
        assert store.advance(SPEC.job, 1, MAX_INDEX, top).last_seen == 1.7976931348623157e308
        state = store.get(SPEC.job)
        assert state.ranks[1].position == top
        assert state.ranks[1].generation == MAX_INDEX
        assert state.ranks[0].last_seen == 0.1 + 0.2
        assert state.updated == 1.7976931348623157e308
        with pytest.raises(FencedError) as info:
            store.advance(SPEC.job, 1, MAX_INDEX - 1, top)
        assert info.value.current == MAX_INDEX, "a generation near 2**53 must not be rounded"
        resized = store.resize(SPEC.job, 4, 2)
        assert resized.updated == 1.7e9 + 1 / 3
        assert resized.plan[0].cut[1] == top
        assert resized.ranks[0].generation == MAX_INDEX + 1


def test_a_large_world_size(redis_server: RedisServer) -> None:
    with RedisCursorStore(redis_server.url) as store:
        big = JobSpec("big", "d", "c", 65536)
        began = time.perf_counter()
        assert len(store.open_job(big).ranks) == 65536
        assert len(store.get("big").ranks) == 65536
        assert store.join("big", 65535, 65536).generation == 1
        state = store.resize("big", 65536, 3)
        assert len(state.plan[0].cut) == 65536
        assert state.ranks[2].generation == 2
        assert time.perf_counter() - began < 10


# --- TTL ------------------------------------------------------------------------


def test_writes_set_and_refresh_the_ttl(redis_server: RedisServer) -> None:
    keys = ("ladle:{run-42}:job", "ladle:{run-42}:ranks")
    with RedisCursorStore(redis_server.url, job_ttl_s=100) as store, redis_server.client() as client:
        store.open_job(SPEC)
        for key in keys:
            assert 99_000 < client.pttl(key) <= 100_000, f"{key} has no TTL after open_job"
        generation = store.join(SPEC.job, 0, 4).generation
        writes: list[Callable[[], object]] = [
            lambda: store.advance(SPEC.job, 0, generation, Position(0, 1)),
            lambda: store.rewind(SPEC.job, 0, generation, Position(0, 0)),
            lambda: store.reconcile(SPEC.job, 0, generation, Position(0, 2)),
            lambda: store.join(SPEC.job, 1, 4),
            lambda: store.open_job(SPEC),
            lambda: store.resize(SPEC.job, 4, 3),
        ]
        for write in writes:
            for key in keys:
                client.pexpire(key, 5_000)
            write()
            for key in keys:
                assert client.pttl(key) > 99_000, f"{key}: a write did not refresh the TTL"
        # a refused write changes nothing, the TTL included
        for key in keys:
            client.pexpire(key, 5_000)
        with pytest.raises(FencedError):
            store.advance(SPEC.job, 0, generation, Position(9, 9))
        assert client.pttl(keys[0]) <= 5_000
    with RedisCursorStore(redis_server.url, job_ttl_s=0) as forever:
        forever.join(SPEC.job, 0, 3)
        with redis_server.client() as client:
            assert [client.pttl(key) for key in keys] == [-1, -1], "job_ttl_s=0 must keep the job forever"


def test_an_idle_job_expires(redis_server: RedisServer) -> None:
    with RedisCursorStore(redis_server.url, job_ttl_s=1) as store:
        store.open_job(SPEC)
        store.open_job(JobSpec("busy", "d", "c", 1))
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            store.join("busy", 0, 1)  # the other job is kept alive by its writes
            try:
                store.get(SPEC.job)
            except JobNotFoundError:
                break
            time.sleep(0.1)
        else:
            pytest.fail("a job idle for longer than job_ttl_s=1 did not expire")
        assert [j.job for j in store.list_jobs()] == ["busy"]
        with redis_server.client() as client:
            assert client.keys("ladle:{run-42}:*") == [], "an expired job left keys behind"
    with pytest.raises(ConfigError) as info:
        RedisCursorStore(redis_server.url, job_ttl_s=-1)
    assert info.value.field == "job_ttl_s"


# --- connecting -----------------------------------------------------------------


def _all_text(exc: BaseException) -> str:
    return "".join(traceback.format_exception(exc))


def test_a_wrong_password_is_refused_clearly_at_start_up(redis_server_factory: StartServer) -> None:
    server = redis_server_factory(password=PASSWORD)
    for url in (server.url_for(password="wrong-Pa55"), f"redis://{server.host}:{server.port}/0"):
        began = time.perf_counter()
        with pytest.raises(StoreUnavailableError) as info:
            RedisCursorStore(url, socket_timeout_s=2)
        assert time.perf_counter() - began < 2
        message = str(info.value)
        assert "password" in message, f"the message must say the password was refused: {message}"
        assert f"{server.port}" in message, "the message must name the server"
        assert "wrong-Pa55" not in _all_text(info.value), "the password leaked into the error"
    with RedisCursorStore(server.url) as store:
        store.open_job(SPEC)
        assert PASSWORD not in repr(store)
        assert PASSWORD not in store.url


def test_a_password_for_a_redis_without_one_is_explained(redis_server: RedisServer) -> None:
    with pytest.raises(StoreUnavailableError, match="has none configured") as info:
        RedisCursorStore(redis_server.url_for(password=PASSWORD))
    assert PASSWORD not in _all_text(info.value)


def test_an_unreachable_redis_fails_fast_and_names_it(redis_server_factory: StartServer) -> None:
    server = redis_server_factory(password=PASSWORD)
    url = server.url
    server.kill()
    began = time.perf_counter()
    with pytest.raises(StoreUnavailableError) as info:
        RedisCursorStore(url, socket_timeout_s=2)
    assert time.perf_counter() - began < 2
    assert f"127.0.0.1:{server.port}" in str(info.value)
    assert "***" in str(info.value), "the URL in the message must have its password redacted"
    assert PASSWORD not in _all_text(info.value), "the password leaked into the error"


def test_a_server_that_never_answers_times_out(tmp_path: Path) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)  # accepts connections (the kernel does), never replies
        port = silent.getsockname()[1]
        began = time.perf_counter()
        with pytest.raises(StoreUnavailableError, match="cannot be reached"):
            RedisCursorStore(f"redis://127.0.0.1:{port}/0", socket_timeout_s=0.3)
        assert time.perf_counter() - began < 3, "start-up must not hang on a silent server"


def test_urls_are_parsed_with_tls_unix_sockets_and_database_numbers() -> None:
    tls = redis_client("rediss://:pw@redis.example.com:6380/2?ssl_cert_reqs=none")
    pool = tls.connection_pool
    assert pool.connection_class is redis.SSLConnection
    kwargs = pool.connection_kwargs
    assert (kwargs["host"], kwargs["port"], kwargs["db"]) == ("redis.example.com", 6380, 2)
    assert kwargs["password"] == "pw"
    assert kwargs["ssl_cert_reqs"] == "none"
    unix = redis_client("unix:///run/redis.sock?db=4")
    assert unix.connection_pool.connection_class is redis.UnixDomainSocketConnection
    assert unix.connection_pool.connection_kwargs["path"] == "/run/redis.sock"
    assert unix.connection_pool.connection_kwargs["db"] == 4
    with pytest.raises(ConfigError) as info:
        RedisCursorStore("http://:pw@localhost:6379/0")
    assert info.value.field == "redis_url"
    assert ":pw@" not in str(info.value)


def test_redact_url() -> None:
    assert redact_url("redis://:hunter2@h:1/0") == "redis://:***@h:1/0"
    assert redact_url("rediss://user:hunter2@h:1/0") == "rediss://user:***@h:1/0"
    assert redact_url("redis://user@h:1/0") == "redis://user@h:1/0"
    assert redact_url("unix:///s.sock?db=1&password=hunter2") == "unix:///s.sock?db=1&password=***"
    assert redact_url("redis://h:1") == "redis://h:1"


def test_redact_url_hides_every_password_parameter() -> None:
    # redis-py passes unknown query keys on: ssl_password is the client key's passphrase
    assert redact_url("rediss://h/0?ssl_password=pw7secret") == "rediss://h/0?ssl_password=***"
    # any case, %-encoded names; other parameters and a bare name are kept
    url = "rediss://:pw@h/0?ssl_ca_certs=/ca.pem&SSL_Password=pw2&ssl%5Fpassword=pw3&db=1&password"
    assert redact_url(url) == (
        "rediss://:***@h/0?ssl_ca_certs=/ca.pem&SSL_Password=***&ssl%5Fpassword=***&db=1&password"
    ), "a password parameter was not redacted"


def test_tls_to_a_plain_server_fails_cleanly(redis_server: RedisServer) -> None:
    began = time.perf_counter()
    with pytest.raises(StoreUnavailableError):
        RedisCursorStore(f"rediss://{redis_server.host}:{redis_server.port}/0", socket_timeout_s=0.5)
    assert time.perf_counter() - began < 3


def tls_redis(redis_server_factory: StartServer, tmp_path: Path) -> tuple[Pki, int]:
    """A Redis with a TLS port (a test CA's certificate, no client certificates): the PKI and the port."""
    pki = make_pki(tmp_path / "pki")
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        tls_port = probe.getsockname()[1]
    redis_server_factory(
        extra_args=(
            "--tls-port", str(tls_port), "--tls-cert-file", str(pki.server_cert),
            "--tls-key-file", str(pki.server_key), "--tls-ca-cert-file", str(pki.ca),
            "--tls-auth-clients", "no",
        )
    )  # fmt: skip
    return pki, tls_port


@pytest.mark.skipif(not openssl_available(), reason="the openssl command is not installed")
def test_rediss_to_a_tls_redis_verified_against_a_test_ca(
    redis_server_factory: StartServer, tmp_path: Path
) -> None:
    """``rediss://`` end to end: Redis's own TLS port, the CA given in the URL, a wrong CA refused."""
    pki, tls_port = tls_redis(redis_server_factory, tmp_path)
    url = f"rediss://127.0.0.1:{tls_port}/0?ssl_ca_certs={pki.ca}"
    with RedisCursorStore(url) as store:
        store.open_job(SPEC)
        assert [j.job for j in store.list_jobs()] == [SPEC.job]
    with pytest.raises(StoreUnavailableError):
        RedisCursorStore(f"rediss://127.0.0.1:{tls_port}/0?ssl_ca_certs={pki.other_ca}", socket_timeout_s=2)


def test_the_database_number_in_the_url_is_used(redis_server: RedisServer) -> None:
    with RedisCursorStore(redis_server.url_for(3)) as store:
        store.open_job(SPEC)
    with redis_server.client(3) as db3, redis_server.client(0) as db0:
        assert sorted(db3.keys("*")) == ["ladle:readiness", "ladle:{run-42}:job", "ladle:{run-42}:ranks"]
        assert db0.keys("*") == []


def test_a_unix_socket_url(redis_server_factory: StartServer) -> None:
    server = redis_server_factory(unixsocket=True)
    with RedisCursorStore(f"unix://{server.unix_socket}?db=2") as store:
        store.open_job(SPEC)
    with server.client(2) as client:
        assert client.exists("ladle:{run-42}:job") == 1


# --- Redis going away and coming back -------------------------------------------


def test_state_survives_kill_9_with_appendfsync_always(redis_server_factory: StartServer) -> None:
    server = redis_server_factory(appendonly=True, appendfsync="always")
    with RedisCursorStore(server.url) as store:
        store.open_job(SPEC)
        generations = [store.join(SPEC.job, r, 4).generation for r in range(4)]
        for step in range(1, 21):
            for r in range(4):
                store.advance(SPEC.job, r, generations[r], Position(0, step))
        before = store.get(SPEC.job)
        server.restart(kill=True)
        after = store.get(SPEC.job)
        assert after == before, "an acknowledged write was lost across kill -9 with appendfsync always"
        assert [r.position for r in after.ranks] == [Position(0, 20)] * 4


def test_the_store_survives_a_redis_restart_and_a_flushed_script_cache(
    redis_server_factory: StartServer,
) -> None:
    server = redis_server_factory(appendonly=True, appendfsync="always")
    with RedisCursorStore(server.url, socket_timeout_s=2) as store:
        store.open_job(SPEC)
        generation = store.join(SPEC.job, 0, 4).generation
        with server.client() as client:
            client.script_flush()
        assert store.advance(SPEC.job, 0, generation, Position(0, 1)).position == Position(0, 1)
        server.kill()
        for call in (
            lambda: store.advance(SPEC.job, 0, generation, Position(0, 2)),
            lambda: store.get(SPEC.job),
            store.ping,
            store.list_jobs,
        ):
            began = time.perf_counter()
            with pytest.raises(StoreUnavailableError, match="cannot be reached"):
                call()
            assert time.perf_counter() - began < 2, "a call to a dead Redis must fail fast, not hang"
        server.start()  # an empty script cache: the next EVALSHA gets NOSCRIPT and reloads
        assert store.advance(SPEC.job, 0, generation, Position(0, 2)).position == Position(0, 2)
        assert store.get(SPEC.job).ranks[0].position == Position(0, 2)


def test_a_read_only_redis_is_unavailable(redis_server_factory: StartServer) -> None:
    server = redis_server_factory()
    with RedisCursorStore(server.url) as store, server.client() as client:
        store.open_job(SPEC)
        client.config_set("replica-read-only", "yes")
        client.execute_command("REPLICAOF", "127.0.0.1", "1")  # a replica of nothing: read-only
        try:
            with pytest.raises(StoreUnavailableError, match=r"read-only replica.*at the primary"):
                store.join(SPEC.job, 0, 4)
            # made a replica after start-up (a failover): readiness says so, not only a trainer's write
            with pytest.raises(StoreUnavailableError, match=r"read-only replica.*at the primary"):
                store.ping()
        finally:
            client.execute_command("REPLICAOF", "NO", "ONE")


def test_the_recommended_config_loads_and_never_evicts(redis_server_factory: StartServer) -> None:
    server = redis_server_factory(config_file=ROOT / "deploy" / "redis.conf")
    with server.client() as client:
        config = client.config_get("*")
    assert config["maxmemory-policy"] == "noeviction", "eviction would silently drop cursors"
    assert (config["appendonly"], config["appendfsync"]) == ("yes", "everysec")
    assert config["protected-mode"] == "yes"
    with RedisCursorStore(server.url) as store:
        assert store.open_job(SPEC).spec == SPEC


# --- processes ------------------------------------------------------------------


def _advance_in_child(store: RedisCursorStore, generation: int) -> None:
    store.advance(SPEC.job, 2, generation, Position(0, 4))


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_a_store_object_crosses_to_a_child_process(redis_server: RedisServer, method: str) -> None:
    if method not in multiprocessing.get_all_start_methods():
        pytest.skip(f"no {method} start method here")
    with RedisCursorStore(redis_server.url) as store:
        store.open_job(SPEC)
        generation = store.join(SPEC.job, 2, 4).generation
        store.ping()  # the parent's pool holds a connection the child must not share
        context = (
            multiprocessing.get_context("fork") if method == "fork" else multiprocessing.get_context("spawn")
        )
        child = context.Process(target=_advance_in_child, args=(store, generation))
        child.start()
        child.join(timeout=60)
        assert child.exitcode == 0
        assert store.get(SPEC.job).ranks[2].position == Position(0, 4)
        again = pickle.loads(pickle.dumps(store))
        try:
            assert again.get(SPEC.job) == store.get(SPEC.job)
        finally:
            again.close()


def test_many_threads_share_one_store(redis_server: RedisServer) -> None:
    with RedisCursorStore(redis_server.url) as store:
        spec = JobSpec("threads", "d", "c", 16)
        store.open_job(spec)
        errors: list[BaseException] = []

        def work(rank: int) -> None:
            try:
                generation = store.join(spec.job, rank, 16).generation
                for step in range(1, 51):
                    store.advance(spec.job, rank, generation, Position(0, step))
            except BaseException as exc:
                errors.append(exc)

        pool = [threading.Thread(target=work, args=(r,)) for r in range(16)]
        for thread in pool:
            thread.start()
        for thread in pool:
            thread.join(timeout=60)
        assert not errors
        assert [r.position for r in store.get(spec.job).ranks] == [Position(0, 50)] * 16


# --- open_store -----------------------------------------------------------------


def test_open_store_picks_redis_or_the_file(redis_server: RedisServer, tmp_path: Path) -> None:
    with open_store(redis_url=redis_server.url, state_path=tmp_path / "x.db", job_ttl_s=60) as store:
        assert isinstance(store, RedisCursorStore)
        assert store.job_ttl_s == 60
    assert not (tmp_path / "x.db").exists()
    with open_store(redis_url=None, state_path=tmp_path / "sub" / "x.db", job_ttl_s=60) as store:
        assert isinstance(store, EmbeddedStore)
        assert store.job_ttl_s == 60, "the embedded store ignored --job-ttl"
    assert (tmp_path / "sub" / "x.db").exists()
    assert os.path.basename(store.path) == "x.db"


# --- what a Redis server must allow, checked at start-up ------------------------


def test_a_redis_that_evicts_keys_is_named_at_start_up(
    redis_server_factory: StartServer, caplog: pytest.LogCaptureFixture
) -> None:
    """allkeys-lru can drop a job's cursors under memory pressure: nothing said so."""
    server = redis_server_factory(
        appendonly=True, extra_args=("--maxmemory", "100mb", "--maxmemory-policy", "allkeys-lru")
    )
    with caplog.at_level("WARNING", logger="ladle.store"), RedisCursorStore(server.url):
        pass
    assert "maxmemory-policy allkeys-lru" in caplog.text, caplog.text
    caplog.clear()
    with (
        caplog.at_level("WARNING", logger="ladle.store"),
        RedisCursorStore(redis_server_factory(appendonly=True).url),
    ):
        pass
    assert not caplog.text, "a Redis that never evicts was warned about"


def acl_user(redis_server: RedisServer, name: str, *denied: str) -> str:
    """An ACL user allowed every command but ``denied`` (``-eval``...): its URL."""
    with redis_server.client() as admin:
        admin.acl_setuser(
            name,
            enabled=True,
            passwords=["+" + PASSWORD],
            keys=["*"],
            channels=["*"],
            commands=["+@all", *denied],
        )
    return f"redis://{name}:{PASSWORD}@{redis_server.host}:{redis_server.port}/0"


def test_a_user_that_cannot_run_scripts_is_refused_at_start_up(redis_server: RedisServer) -> None:
    """The server started and said ready; every trainer then retried UNAVAILABLE for its whole timeout."""
    url = acl_user(redis_server, "noscripts", "-eval", "-evalsha", "-script")
    with pytest.raises(StoreError, match="lacks a permission ladle needs") as info:
        RedisCursorStore(url)
    assert not isinstance(info.value, StoreUnavailableError), "a missing permission is not transient"
    assert PASSWORD not in str(info.value)


def test_a_port_that_does_not_speak_redis_is_named_so() -> None:
    """It said 'Redis refused an operation: Protocol error, got "H" as reply type byte'."""
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]

    def answer() -> None:
        conn, _ = listener.accept()
        with conn:
            conn.recv(100)
            conn.sendall(b"HTTP/1.1 400 Bad Request\r\n\r\n")

    thread = threading.Thread(target=answer, daemon=True)
    thread.start()
    try:
        with pytest.raises(StoreError, match="does not speak Redis"):
            RedisCursorStore(f"redis://127.0.0.1:{port}/0")
    finally:
        listener.close()
        thread.join(timeout=5)


# --- a password with reserved characters in the URL -----------------------------

SECRET_PIECES = ("Kq3", "SECRETpart")


@pytest.mark.parametrize(
    "userinfo",
    [
        ":Kq3/xZSECRETpart",
        ":Kq3#xZSECRETpart",
        ":Kq3?xZSECRETpart",
        ":/Kq3xZSECRETpart",  # redis-py read this one as no password and connected to localhost:6379
        ":Kq3[xZSECRETpart",
        ":Kq3/x@ZSECRETpart",
        "ladle:Kq3/xZSECRETpart",
    ],
)
def test_a_password_with_a_reserved_character_is_never_shown(
    userinfo: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """It printed the whole URL, and redis-py's 'Port could not be cast to integer value as 'Kq3''."""
    url = f"redis://{userinfo}@127.0.0.1:1/0?db=0"
    assert redact_url(url) == "redis://***@127.0.0.1:1/0?db=0"
    with pytest.raises(ConfigError) as info:
        RedisCursorStore(url, socket_timeout_s=0.5)
    assert info.value.field == "redis_url"
    text = _all_text(info.value)
    assert not [piece for piece in SECRET_PIECES if piece in text], f"the password leaked: {text}"
    for advice in ("percent-encode", "/ as %2F", "# as %23", "? as %3F", "% as %25", "@ as %40"):
        assert advice in str(info.value), f"the error does not say {advice!r}: {info.value}"
    # the same through the command line, from the flag and from the environment
    monkeypatch.setenv(cli.REDIS_URL_ENV, url)
    assert cli.main(["jobs"]) == 2
    assert cli.main(["jobs", "--redis-url", url]) == 2
    printed = capsys.readouterr()
    assert "%2F" in printed.err
    assert not [piece for piece in SECRET_PIECES if piece in printed.out + printed.err], printed.err


def test_a_percent_encoded_password_with_reserved_characters_works(
    redis_server_factory: StartServer,
) -> None:
    """What the error and docs/deploy.md tell the operator to do, against a real Redis."""
    password = "Kq3/x#y?z%w@v:u+SECRETpart"
    server = redis_server_factory(password=password)
    with RedisCursorStore(server.url_for(password=quote(password, safe=""))) as store:
        assert store.open_job(SPEC).spec == SPEC
        assert "SECRETpart" not in repr(store)


def test_a_refused_password_with_percent_sequences_says_they_are_decoded(
    redis_server_factory: StartServer,
) -> None:
    """'Redis refused the password' and nothing else, for a password with a % written as it is."""
    password = "pa%41ss-SECRETpart"  # %41 reaches Redis as "A"
    server = redis_server_factory(password=password)
    with pytest.raises(StoreUnavailableError, match="refused the password") as info:
        RedisCursorStore(server.url_for(password=password))
    assert "%25" in str(info.value), f"no word of the decoding: {info.value}"
    assert "SECRETpart" not in _all_text(info.value)
    with pytest.raises(StoreUnavailableError) as wrong:
        RedisCursorStore(server.url_for(password="plain-wrong"))
    assert "%25" not in str(wrong.value), "a password without %-sequences got the decoding hint"
    with RedisCursorStore(server.url_for(password=quote(password, safe=""))) as store:
        store.open_job(SPEC)


def test_a_url_without_the_password_redis_requires_is_named_so(redis_server_factory: StartServer) -> None:
    server = redis_server_factory(password=PASSWORD)
    with pytest.raises(StoreUnavailableError, match="the URL gives no password but Redis requires one"):
        RedisCursorStore(f"redis://{server.host}:{server.port}/0")


# --- TLS on one side only -------------------------------------------------------


def test_tls_to_a_plain_port_hints_at_redis_scheme(redis_server: RedisServer) -> None:
    """'cannot be reached: Timeout connecting to server', after the whole timeout, and no hint."""
    with pytest.raises(StoreUnavailableError, match=r"use redis:// rather than rediss://"):
        RedisCursorStore(f"rediss://{redis_server.host}:{redis_server.port}/0", socket_timeout_s=0.5)


@pytest.mark.skipif(not openssl_available(), reason="the openssl command is not installed")
def test_plain_redis_to_a_tls_port_hints_at_rediss(redis_server_factory: StartServer, tmp_path: Path) -> None:
    """'Connection reset by peer', and no hint."""
    _, tls_port = tls_redis(redis_server_factory, tmp_path)
    with pytest.raises(StoreUnavailableError, match=r"use rediss:// rather than redis://"):
        RedisCursorStore(f"redis://127.0.0.1:{tls_port}/0", socket_timeout_s=2)


# --- replicas and persistence, checked at start-up ------------------------------


def test_a_replica_is_refused_at_start_up(redis_server: RedisServer) -> None:
    """It passed start-up and the server said ready; every Open then failed with READONLY."""
    with redis_server.client() as client:
        client.execute_command("REPLICAOF", "127.0.0.1", "1")  # a replica (of nothing)
    with pytest.raises(StoreError, match="point LADLE_REDIS_URL / --redis-url at the primary") as info:
        RedisCursorStore(redis_server.url)
    assert "\n" not in str(info.value)
    assert not isinstance(info.value, StoreUnavailableError), "a replica stays a replica: not transient"


def test_role_and_config_refused_by_an_acl_are_skipped(
    redis_server: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    """A managed Redis may refuse ROLE, INFO and CONFIG: those checks are skipped, and the start-up write
    names the replica."""
    url = acl_user(redis_server, "app", "-role", "-info", "-config")
    with redis_server.client() as admin:
        admin.execute_command("REPLICAOF", "127.0.0.1", "1")
    with (
        caplog.at_level("DEBUG", logger="ladle.store"),
        pytest.raises(StoreUnavailableError, match=r"read-only replica.*at the primary"),
    ):
        RedisCursorStore(url)
    assert "ROLE refused" in caplog.text
    assert "CONFIG GET save refused" in caplog.text
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text
    assert PASSWORD not in caplog.text


def test_a_redis_without_persistence_is_named_at_start_up(
    redis_server_factory: StartServer, caplog: pytest.LogCaptureFixture
) -> None:
    """A restart of such a Redis forgets every job; nothing said so at start-up."""
    with caplog.at_level("WARNING", logger="ladle.store"), RedisCursorStore(redis_server_factory().url):
        pass
    assert "keeps nothing on disk" in caplog.text, caplog.text
    assert "appendonly yes" in caplog.text, "the warning does not say what to set"
    for options in ({"appendonly": True}, {"save": True}):
        caplog.clear()
        with (
            caplog.at_level("WARNING", logger="ladle.store"),
            RedisCursorStore(redis_server_factory(**options).url),
        ):
            pass
        assert not caplog.text, f"a Redis with {options} was warned about: {caplog.text}"


# --- a job's hashes as something other than this ladle left them ----------------

GOOD = JobSpec("good", "d", "c", 2)
BAD = JobSpec("bad", "d", "c", 2)
BAD_JOB, BAD_RANKS = "ladle:{bad}:job", "ladle:{bad}:ranks"


def _missing_field(store: CursorStore, client: redis.Redis) -> None:
    client.hset(BAD_JOB, "world_size", 4)  # a hand edit, a half-restored backup, another tool's key


def _bad_rank(store: CursorStore, client: redis.Redis) -> None:
    store.open_job(BAD)
    client.hset(BAD_RANKS, "0", "0,0,0")


def _missing_rank(store: CursorStore, client: redis.Redis) -> None:
    store.open_job(BAD)
    client.hdel(BAD_RANKS, "1")


def _bad_plan(store: CursorStore, client: redis.Redis) -> None:
    store.open_job(BAD)
    client.hset(BAD_JOB, "plan", '{"v2": []}')


def _bad_world_size(store: CursorStore, client: redis.Redis) -> None:
    store.open_job(BAD)
    client.hset(BAD_JOB, "world_size", "two")


def _not_a_hash(store: CursorStore, client: redis.Redis) -> None:
    client.set(BAD_JOB, "{}")


def _bad_format(store: CursorStore, client: redis.Redis) -> None:
    store.open_job(BAD)
    client.hset(BAD_JOB, "format", "v2")


SPOILS: dict[str, tuple[Callable[[CursorStore, redis.Redis], None], str, str]] = {
    "missing field": (_missing_field, BAD_JOB, "dataset_fingerprint"),
    "bad rank value": (_bad_rank, BAD_RANKS, "0"),
    "missing rank": (_missing_rank, BAD_RANKS, "ranks"),
    "bad plan": (_bad_plan, BAD_JOB, "plan"),
    "bad world size": (_bad_world_size, BAD_JOB, "world_size"),
    "not a hash": (_not_a_hash, BAD_JOB, ""),
    "bad format": (_bad_format, BAD_JOB, "format"),
}


@pytest.mark.parametrize("spoil", SPOILS)
def test_a_malformed_job_is_a_typed_error_and_left_out_of_listings(
    spoil: str, redis_server: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    """One malformed job hash: KeyError/ValueError from get and open, and list_jobs failed for every job."""
    make, key, field = SPOILS[spoil]
    with RedisCursorStore(redis_server.url) as store, redis_server.client() as client:
        store.open_job(GOOD)
        make(store, client)
        reads: list[Callable[[], object]] = [lambda: store.get("bad"), lambda: store.open_job(BAD)]
        for call in reads:
            with pytest.raises(StoreCorruptError) as info:
                call()
            assert (info.value.job, info.value.key, info.value.field) == ("bad", key, field), str(info.value)
            assert "ladle jobs --delete bad --force" in str(info.value), "the error gives no remedy"
            assert info.value.kind == "failed_precondition"
        again = pickle.loads(pickle.dumps(info.value))
        assert (type(again), str(again)) == (StoreCorruptError, str(info.value))
        with caplog.at_level("WARNING", logger="ladle.store"):
            assert [j.job for j in store.list_jobs()] == ["good"], "the malformed job was not left out"
            assert [j.job for j in store.list_jobs()] == ["good"]
        warnings = [r.getMessage() for r in caplog.records if "left out" in r.getMessage()]
        assert len(warnings) == 1, f"one warning for the left-out job, not {warnings}"
        assert "'bad'" in warnings[0], warnings
        assert store.delete_job("bad")
        assert store.open_job(BAD).spec == BAD, "the job cannot be started again after its deletion"


@pytest.mark.parametrize(
    ("spoil", "refused"),
    [
        ("bad rank value", ("join", "advance", "resize")),
        ("bad world size", ("join", "resize")),
        ("bad format", ("join", "advance", "resize")),
    ],
)
def test_a_trainer_of_a_malformed_job_gets_the_typed_error(
    spoil: str, refused: tuple[str, ...], redis_server: RedisServer
) -> None:
    """The writes' scripts read the hashes too: a Lua error or an int() of garbage, not a store error."""
    with RedisCursorStore(redis_server.url) as store, redis_server.client() as client:
        store.open_job(BAD)
        generation = store.join("bad", 0, 2).generation
        SPOILS[spoil][0](store, client)
        calls: dict[str, Callable[[], object]] = {
            "join": lambda: store.join("bad", 0, 2),
            "advance": lambda: store.advance("bad", 0, generation, Position(0, 1)),
            "resize": lambda: store.resize("bad", 2, 3),
        }
        for name in refused:
            with pytest.raises(StoreCorruptError, match="ladle jobs --delete bad --force"):
                calls[name]()


def test_ladle_jobs_lists_around_a_malformed_job_and_deletes_it_with_force(
    redis_server: RedisServer,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    caplog: pytest.LogCaptureFixture,
) -> None:
    """`ladle jobs` and `ladle jobs --delete bad` (the remedy) both ended in a KeyError traceback."""
    monkeypatch.delenv(cli.REDIS_URL_ENV, raising=False)
    flags = ["--redis-url", redis_server.url]
    with RedisCursorStore(redis_server.url) as store, redis_server.client() as client:
        store.open_job(GOOD)
        _missing_field(store, client)
    with caplog.at_level("WARNING", logger="ladle.store"):
        assert cli.main(["jobs", *flags]) == 0
    assert "good" in capsys.readouterr().out
    assert "'bad'" in caplog.text, caplog.text
    assert "dataset_fingerprint" in caplog.text, caplog.text
    assert cli.main(["jobs", *flags, "--delete", "bad"]) == 2
    refused = capsys.readouterr().err
    assert "--force" in refused, refused
    assert "Traceback" not in refused, refused
    assert cli.main(["jobs", *flags, "--delete", "bad", "--force"]) == 0
    assert "deleted job 'bad'" in capsys.readouterr().out
    caplog.clear()
    assert cli.main(["jobs", *flags, "--json"]) == 0
    assert [j["job"] for j in json.loads(capsys.readouterr().out)] == ["good"]
    assert "left out" not in caplog.text, "a deleted job is still reported"


# --- the format version -----------------------------------------------------------
# A job hash records the version of its layout (``format``); a ladle refuses a job of a newer
# layout rather than misread it or call it corrupt, and writes nothing to it.


def _hashes(client: redis.Redis) -> dict[str, tuple[object, object]]:
    """Both keys of the job ``bad``: their fields and their TTL (a refused write touches neither)."""
    return {key: (client.hgetall(key), client.pttl(key)) for key in (BAD_JOB, BAD_RANKS)}


def _persisted(client: redis.Redis) -> dict[str, tuple[object, object]]:
    """``_hashes`` after removing the TTLs: a write that refreshed one would show as a PTTL other than -1."""
    for key in (BAD_JOB, BAD_RANKS):
        client.persist(key)
    return _hashes(client)


def test_a_new_job_records_the_format_version(redis_server: RedisServer) -> None:
    with RedisCursorStore(redis_server.url) as store, redis_server.client() as client:
        store.open_job(BAD)
        assert FORMAT_VERSION == 1
        assert client.hget(BAD_JOB, "format") == "1", "a new job does not record its format"
        # a reset re-creates the job: with the format, whatever was there (here a job of a newer ladle)
        client.hset(BAD_JOB, "format", "2")
        assert store.open_job(BAD, reset=True).spec == BAD
        assert client.hget(BAD_JOB, "format") == "1", "a reset job does not record its format"


def test_a_job_without_a_format_is_version_1_and_kept_as_it_is(redis_server: RedisServer) -> None:
    """Jobs written by releases before the field existed: read and written, the field never added."""
    with RedisCursorStore(redis_server.url) as store, redis_server.client() as client:
        store.open_job(BAD)
        assert client.hdel(BAD_JOB, "format") == 1
        assert store.get("bad").spec == BAD
        assert store.open_job(BAD).spec == BAD
        generation = store.join("bad", 0, 2).generation
        assert store.advance("bad", 0, generation, Position(0, 5)).position == Position(0, 5)
        assert store.rewind("bad", 0, generation, Position(0, 2)).position == Position(0, 2)
        assert store.reconcile("bad", 1, 7, Position(0, 3)).generation == 7
        assert store.get("bad").ranks[0].position == Position(0, 2), "an old job did not advance"
        assert [j.job for j in store.list_jobs()] == ["bad"]
        assert store.resize("bad", 2, 3).spec.world_size == 3
        assert store.resize("bad", 2, 3).spec.world_size == 3  # the same size: returned unchanged
        assert not client.hexists(BAD_JOB, "format"), "a write rewrote an old job's hash"


NEWER_FORMAT_OPERATIONS: dict[str, Callable[[CursorStore, int], object]] = {
    "get": lambda store, _: store.get("bad"),
    "open_job": lambda store, _: store.open_job(BAD),
    "open_job, another spec": lambda store, _: store.open_job(JobSpec("bad", "other", "c", 4)),
    "join": lambda store, _: store.join("bad", 0, 2),
    "advance": lambda store, generation: store.advance("bad", 0, generation, Position(0, 1)),
    "rewind": lambda store, generation: store.rewind("bad", 0, generation, Position(0, 0)),
    "reconcile": lambda store, generation: store.reconcile("bad", 1, generation + 5, Position(0, 3)),
    "resize": lambda store, _: store.resize("bad", 2, 3),
    "resize, already at the size": lambda store, _: store.resize("bad", 3, 2),
}


@pytest.mark.parametrize("layout", ["same fields", "other fields"])
@pytest.mark.parametrize("operation", NEWER_FORMAT_OPERATIONS)
def test_a_job_of_a_newer_format_is_refused_and_left_unchanged(
    operation: str, layout: str, redis_server: RedisServer
) -> None:
    """A read and every write refuse it with one typed error; the scripts write nothing, TTL included."""
    with RedisCursorStore(redis_server.url) as store, redis_server.client() as client:
        store.open_job(BAD)
        generation = store.join("bad", 0, 2).generation
        store.advance("bad", 0, generation, Position(0, 4))
        client.hset(BAD_JOB, "format", str(FORMAT_VERSION + 1))
        if layout == "other fields":  # what a newer layout may do: no field this ladle looks for
            client.hdel(BAD_JOB, "world_size", "plan")
            client.hset(BAD_JOB, "shape", "[2]")
        before = _persisted(client)
        with pytest.raises(StoreFormatError) as info:
            NEWER_FORMAT_OPERATIONS[operation](store, generation)
        assert _hashes(client) == before, f"{operation} changed a job of a newer format"
        exc = info.value
        assert isinstance(exc, StoreCorruptError)
        assert (exc.job, exc.key, exc.field, exc.version, exc.supported) == ("bad", BAD_JOB, "format", 2, 1)
        assert str(exc).startswith(
            "job 'bad' in the cursor store (key ladle:{bad}:job) has format version 2, newer than this "
            "ladle's 1: upgrade ladle, or delete the job with `ladle jobs --delete bad --force`"
        ), str(exc)
        assert (exc.kind, reason_of(exc)) == ("failed_precondition", "store_format_newer")
        again = pickle.loads(pickle.dumps(exc))
        assert (type(again), str(again), again.version) == (StoreFormatError, str(exc), 2)


@pytest.mark.parametrize("value", ["", "two", "1.0", "0", "-1", " 1", "1 ", "+1", "1e0", "\u0661"])
def test_a_format_that_is_no_version_is_corrupt_for_reads_and_writes(
    value: str, redis_server: RedisServer
) -> None:
    with RedisCursorStore(redis_server.url) as store, redis_server.client() as client:
        store.open_job(BAD)
        generation = store.join("bad", 0, 2).generation
        client.hset(BAD_JOB, "format", value)
        before = _persisted(client)
        for operation in ("get", "open_job", "join", "advance", "resize"):
            with pytest.raises(StoreCorruptError) as info:
                NEWER_FORMAT_OPERATIONS[operation](store, generation)
            assert type(info.value) is StoreCorruptError, f"{operation}: {info.value}"
            assert (info.value.key, info.value.field) == (BAD_JOB, "format"), str(info.value)
            assert _hashes(client) == before, f"{operation} changed a job whose format is {value!r}"


@pytest.mark.parametrize("value", ["1", "01", "0001", "2", "10", "9" * 30, "9" * 5000])
def test_the_scripts_and_the_reader_agree_on_each_format(value: str, redis_server: RedisServer) -> None:
    """The Lua check and ``_Record.version`` are written twice: a read and a write must say the same."""
    with RedisCursorStore(redis_server.url) as store, redis_server.client() as client:
        store.open_job(BAD)
        client.hset(BAD_JOB, "format", value)
        outcomes = []
        for call in (lambda: store.get("bad"), lambda: store.join("bad", 0, 2)):
            try:
                call()
                outcomes.append("ok")
            except StoreCorruptError as exc:
                outcomes.append(type(exc).__name__)
        read, write = outcomes
        assert read == write, f"format {value[:20]!r}: a read says {read}, a write says {write}"
        assert (outcomes[0] == "ok") == (value.lstrip("0") == "1"), outcomes


def test_listings_leave_out_a_job_of_a_newer_format(
    redis_server: RedisServer,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    caplog: pytest.LogCaptureFixture,
) -> None:
    monkeypatch.delenv(cli.REDIS_URL_ENV, raising=False)
    flags = ["--redis-url", redis_server.url]
    with RedisCursorStore(redis_server.url) as store, redis_server.client() as client:
        store.open_job(GOOD)
        store.open_job(BAD)
        client.hset(BAD_JOB, "format", "2")
        with caplog.at_level("WARNING", logger="ladle.store"):
            assert [j.job for j in store.list_jobs()] == ["good"], "the newer job was not left out"
            assert [j.job for j in store.list_jobs()] == ["good"]
        warnings = [r.getMessage() for r in caplog.records if "left out" in r.getMessage()]
        assert len(warnings) == 1, f"one warning for the left-out job, not {warnings}"
        assert "format version 2" in warnings[0], warnings
        assert "upgrade ladle" in warnings[0], warnings
    assert cli.main(["jobs", *flags, "--json"]) == 0
    assert [j["job"] for j in json.loads(capsys.readouterr().out)] == ["good"]
    assert cli.main(["jobs", *flags, "--delete", "bad"]) == 2
    refused = capsys.readouterr().err
    assert "upgrade ladle" in refused, refused
    assert "--force" in refused, refused
    assert cli.main(["jobs", *flags, "--delete", "bad", "--force"]) == 0
    assert "deleted job 'bad'" in capsys.readouterr().out
