"""The k8s Redis container's start script, run with a real ``redis-server``: the Secret's password works.

``deploy/k8s/redis.yaml`` writes the password into an included config file
(not onto the command line, which ``/proc`` shows). A password holding ``"``
or ``\\`` broke that file's quoting: Redis refused to start, or required
another password than the Secret's. The test runs the manifest's own script,
with its two paths pointed into a temporary folder and the ConfigMap's
``redis.conf`` bound to loopback on a free port.
"""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
import redis
import yaml
from redis.backoff import NoBackoff
from redis.retry import Retry

from tests.support.redis_server import _free_port, redis_server_available

pytestmark = pytest.mark.skipif(not redis_server_available(), reason="needs redis-server")

MANIFEST = Path(__file__).resolve().parents[2] / "deploy" / "k8s" / "redis.yaml"


def _manifest() -> tuple[str, str]:
    """The redis container's shell script and the ConfigMap's redis.conf."""
    docs: list[dict[str, Any]] = [d for d in yaml.safe_load_all(MANIFEST.read_text()) if d]
    config = next(d for d in docs if d["kind"] == "ConfigMap")["data"]["redis.conf"]
    pod = next(d for d in docs if d["kind"] == "StatefulSet")["spec"]["template"]["spec"]
    (container,) = [c for c in pod["containers"] if c["name"] == "redis"]
    assert container["command"] == ["sh", "-c"]
    return container["args"][0], config


def _start(tmp_path: Path, password: str) -> tuple[subprocess.Popen[bytes], int, Path]:
    script, config = _manifest()
    port = _free_port()
    for line, local in (("bind 0.0.0.0", "bind 127.0.0.1"), ("port 6379", f"port {port}"), ("dir /data", "")):
        assert line in config, f"the ConfigMap's redis.conf changed: no {line!r}"
        config = config.replace(line, local)
    (tmp_path / "run").mkdir()
    conf = tmp_path / "redis.conf"
    conf.write_text(f"{config}\ndir {tmp_path}\nlogfile {tmp_path / 'redis.log'}\n")
    for path, local in (("/etc/redis/redis.conf", str(conf)), ("/run/redis", str(tmp_path / "run"))):
        assert path in script, f"the script no longer uses {path}"
        script = script.replace(path, local)
    env = {"PATH": os.environ["PATH"], "REDIS_PASSWORD": password}
    proc = subprocess.Popen(["sh", "-c", script], env=env, stderr=subprocess.PIPE)
    return proc, port, tmp_path / "run" / "auth.conf"


def _client(port: int, password: str | None) -> redis.Redis:
    """A client that reports a refused password at once (redis-py retries errors for seconds by default)."""
    return redis.Redis(
        host="127.0.0.1", port=port, password=password, socket_timeout=5, retry=Retry(NoBackoff(), 0)
    )


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.kill()
    proc.wait(timeout=10)
    if proc.stderr is not None:
        proc.stderr.close()


@pytest.mark.parametrize(
    "password",
    [
        "pa\"ss\\word $HOME 'q' %s `id` ü",  # quotes, backslash, shell and printf syntax, UTF-8
        "Zq8v1Xw0n4TtE3yKc7mB2aR9dL5hJ6gF",  # an ordinary generated one
        "\\",
    ],
)
def test_the_secrets_password_is_the_one_redis_requires(tmp_path: Path, password: str) -> None:
    proc, port, auth = _start(tmp_path, password)
    try:
        client = _client(port, password)
        deadline = time.monotonic() + 20
        while True:
            assert proc.poll() is None, f"redis-server exited: {(tmp_path / 'redis.log').read_text()[-1500:]}"
            try:
                assert client.ping()
                break
            except redis.ConnectionError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
        with pytest.raises(redis.AuthenticationError):
            _client(port, None).ping()
        with pytest.raises(redis.AuthenticationError):
            _client(port, password + "x").ping()
        assert auth.stat().st_mode & 0o077 == 0, "the password file is readable by others"
        cmdline = Path(f"/proc/{proc.pid}/cmdline").read_bytes()
        assert password.encode() not in cmdline, "the password is on redis-server's command line"
    finally:
        client.close()
        _stop(proc)


def test_an_empty_password_is_refused(tmp_path: Path) -> None:
    proc, _port, auth = _start(tmp_path, "")
    try:
        assert proc.wait(timeout=20) == 1
        assert proc.stderr is not None
        assert "empty password" in proc.stderr.read().decode()
        assert not auth.exists(), "a config without a password was written"
    finally:
        _stop(proc)
