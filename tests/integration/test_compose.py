"""``docker-compose.yml``, tested where no Docker engine runs.

The file is validated against the Compose specification (the ``compose-spec``
package, on the document with its YAML anchors resolved, as Compose reads
it). Then every service's own command and environment run as local
processes on loopback, in dependency order, honouring ``depends_on``
conditions and healthchecks:

* the ``redis`` image runs as Debian's ``redis-server`` with the same
  arguments; the project's images run their commands with the project's own
  entry points (``ladle``, ``python`` of this virtual environment);
* each container path of a volume becomes a local folder (a named volume) or
  the repository file it mounts (``./deploy/redis.conf``);
* each secret becomes a file with a fresh token, at the path the secret is
  mounted on (``/run/secrets/NAME``), for the services that list it;
* each ``service:port`` a container reaches, and each port a service listens
  on, becomes ``127.0.0.1:<a free port>``; ``0.0.0.0`` becomes ``127.0.0.1``.

The trainers finish their epoch and every row of the schedule was received
exactly once. A wrong command, flag, variable or dependency in the compose
file fails here.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shlex
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml

from ladle.client import AuthenticationError, BatchClient
from ladle.service.cli import build_parser, config_from_args
from ladle.service.dataset import open_dataset
from ladle.service.schedule import build_schedule

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "docker-compose.yml"
BIN = Path(sys.executable).parent


def load() -> dict[str, Any]:
    document: dict[str, Any] = yaml.safe_load(COMPOSE.read_text())
    return document


def test_the_image_gives_its_user_the_named_volumes_mount_points() -> None:
    """Docker creates a named volume with the owner of the image's folder: root's, if the image has none."""
    dockerfile = (ROOT / "deploy" / "Dockerfile").read_text()
    final = dockerfile.rsplit("\nFROM ", 1)[1]  # the runtime stage
    user = re.search(r"^USER (\S+)", final, re.MULTILINE)
    assert user is not None, "the image runs as root"
    owned = set(re.findall(r"chown " + re.escape(user.group(1)) + r" ([^\n&]+)", final))
    owned_paths = {p for group in owned for p in group.replace("\\", " ").split()}
    for name, service in load()["services"].items():
        if service.get("image", "").startswith("ladle") or "build" in service:
            for volume in service.get("volumes", []):
                source, target = str(volume).split(":")[:2]
                if not source.startswith((".", "/")):
                    assert target in owned_paths, f"{name}: {target} would be root's in a new volume"


def test_the_compose_file_follows_the_specification() -> None:
    compose_spec = pytest.importorskip("compose_spec")
    document = load()
    compose = compose_spec.PyCompose.from_json(json.dumps(document))
    assert set(compose.service_names()) >= {"redis", "dataset", "ladle", "trainer-0", "trainer-1"}
    services = document["services"]
    assert services["ladle"]["depends_on"] == {
        "redis": {"condition": "service_healthy"},
        "dataset": {"condition": "service_completed_successfully"},
    }
    # ready as /readyz says (the gRPC health service's answer), by a probe that imports only socket
    assert services["ladle"]["healthcheck"]["test"][1:4] == ["python", "-m", "ladle.service.probe"]
    assert "healthcheck" in services["redis"]
    for name, service in services.items():
        if name.startswith("trainer-"):
            assert service["depends_on"] == {"ladle": {"condition": "service_healthy"}}
            assert service["environment"]["RANK"] == name.removeprefix("trainer-")
            assert service["secrets"] == ["ladle-token"]
            assert service["environment"]["LADLE_TOKEN_FILE"] == "/run/secrets/ladle-token"
    # the server listens on the compose network, so it must demand the token, given as a secret
    command = services["ladle"]["command"]
    assert command[command.index("--host") + 1] == "0.0.0.0"
    assert command[command.index("--token-file") + 1] == "/run/secrets/ladle-token"
    assert services["ladle"]["secrets"] == ["ladle-token"]
    assert document["secrets"] == {"ladle-token": {"environment": "LADLE_TOKEN"}}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


@dataclass
class Local:
    """How the compose world maps onto this machine."""

    workdir: Path
    ports: dict[tuple[str, int], int] = field(default_factory=dict)
    paths: dict[str, Path] = field(default_factory=dict)

    def text(self, service: str, value: str) -> str:
        for (name, port), local in self.ports.items():
            value = value.replace(f"{name}:{port}", f"127.0.0.1:{local}")
            if name == service:
                value = value.replace(f"127.0.0.1:{port}", f"127.0.0.1:{local}")
                value = value.replace(f"localhost:{port}", f"127.0.0.1:{local}")
        value = value.replace("0.0.0.0", "127.0.0.1")
        for container, local_path in sorted(self.paths.items(), key=lambda kv: -len(kv[0])):
            value = re.sub(rf"(?<![\w/.]){re.escape(container)}(?=/|$|[\s'\"])", str(local_path), value)
        return value

    def args(self, service: str, args: list[str]) -> list[str]:
        out = [self.text(service, a) for a in args]
        for i in range(1, len(out)):  # the value after a port flag: --port, --grpc-port, -p ...
            flag = out[i - 1]
            if (flag.endswith("port") or flag == "-p") and out[i].isdigit():
                local = self.ports.get((service, int(out[i])))
                if local is not None:
                    out[i] = str(local)
        return out


def container_ports(service: dict[str, Any]) -> list[int]:
    ports = [int(str(p)) for p in service.get("expose", [])]
    for mapping in service.get("ports", []):
        ports.append(int(str(mapping).rsplit(":", 1)[-1].split("/")[0]))
    return ports


def dependency_order(services: dict[str, Any]) -> list[str]:
    order: list[str] = []

    def visit(name: str, path: tuple[str, ...]) -> None:
        assert name not in path, f"dependency cycle: {(*path, name)}"
        if name in order:
            return
        for dep in services[name].get("depends_on", {}):
            visit(dep, (*path, name))
        order.append(name)

    for name in services:
        visit(name, ())
    return order


class Stack:
    """The services of the compose file as local processes; ``stop`` kills every one."""

    def __init__(self, workdir: Path) -> None:
        self.document = load()
        self.services: dict[str, Any] = self.document["services"]
        self.local = Local(workdir)
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.token = secrets.token_urlsafe(32)
        for secret in self.document.get("secrets") or {}:
            path = workdir / "secrets" / secret
            path.parent.mkdir(exist_ok=True)
            path.write_text(self.token)
            self.local.paths[f"/run/secrets/{secret}"] = path
        for name, service in self.services.items():
            for port in container_ports(service):
                self.local.ports[(name, port)] = free_port()
            for volume in service.get("volumes", []):
                source, target = str(volume).split(":")[:2]
                if source.startswith("."):
                    self.local.paths[target] = (ROOT / source).resolve()
                else:
                    local = workdir / "volumes" / source
                    local.mkdir(parents=True, exist_ok=True)
                    self.local.paths[target] = local

    def env(self, name: str) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("RANK", "WORLD_SIZE", "LADLE_"))}
        env["PATH"] = f"{BIN}{os.pathsep}{env.get('PATH', '')}"
        for key, value in (self.services[name].get("environment") or {}).items():
            env[key] = self.local.text(name, str(value))
        return env

    def command(self, name: str) -> list[str]:
        service = self.services[name]
        command = service["command"]
        args = shlex.split(command) if isinstance(command, str) else [str(a) for a in command]
        if str(service.get("image", "")).startswith("redis:"):
            assert args[0] == "redis-server", "the redis service must run redis-server"
        return self.local.args(name, args)

    def start(self, name: str) -> None:
        log = (self.local.workdir / f"{name}.log").open("ab")
        self.procs[name] = subprocess.Popen(
            self.command(name),
            env=self.env(name),
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=self.local.workdir,
        )

    def log(self, name: str) -> str:
        return (self.local.workdir / f"{name}.log").read_text(errors="replace")[-3000:]

    def healthy(self, name: str) -> None:
        check = self.services[name]["healthcheck"]
        test = [str(a) for a in check["test"]]
        assert test[0] in ("CMD", "CMD-SHELL"), f"{name}: healthcheck test {test[0]!r}"
        argv = (
            self.local.args(name, test[1:])
            if test[0] == "CMD"
            else ["sh", "-c", self.local.text(name, test[1])]
        )
        attempts = int(check.get("retries", 3)) + 1
        interval = float(str(check.get("interval", "2s")).rstrip("s"))
        for _ in range(max(attempts, 30)):
            proc = self.procs[name]
            assert proc.poll() is None, f"{name} exited with {proc.returncode}: {self.log(name)}"
            if subprocess.run(argv, env=self.env(name), capture_output=True, timeout=30).returncode == 0:
                return
            time.sleep(min(interval, 1.0))
        raise AssertionError(f"{name} never became healthy: {self.log(name)}")

    def completed(self, name: str, timeout: float = 120) -> None:
        try:
            code = self.procs[name].wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"{name} did not finish: {self.log(name)}") from None
        assert code == 0, f"{name} exited with {code}: {self.log(name)}"

    def up(self) -> None:
        for name in dependency_order(self.services):
            for dep, rule in (self.services[name].get("depends_on") or {}).items():
                condition = rule.get("condition", "service_started")
                if condition == "service_healthy":
                    self.healthy(dep)
                elif condition == "service_completed_successfully":
                    self.completed(dep)
            self.start(name)

    def stop(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGKILL)
                proc.wait(timeout=30)


@pytest.fixture
def stack(tmp_path: Path) -> Iterator[Stack]:
    if not any((Path(p) / "redis-server").exists() for p in os.environ.get("PATH", "").split(os.pathsep)):
        pytest.skip("redis-server is not installed")
    running = Stack(tmp_path)
    try:
        yield running
    finally:
        running.stop()


def test_the_stack_runs_and_every_row_arrives_once(stack: Stack) -> None:
    stack.up()
    trainers = sorted(name for name in stack.services if name.startswith("trainer-"))
    for name in trainers:
        stack.completed(name, timeout=180)
    received_dir = stack.local.paths["/received"]
    rows = np.concatenate(
        [np.load(received_dir / f"rank-{n.removeprefix('trainer-')}.npy") for n in trainers]
    )
    dataset = open_dataset(stack.local.paths["/data"] / "sample")
    served = build_parser().parse_args(stack.services["ladle"]["command"][1:])  # the server's own options
    sched = build_schedule(dataset.lengths, config_from_args(served), epoch=0, world_size=len(trainers))
    assert len(np.unique(sched.buckets)) > 1, "the stack's sample fills one bucket: one colour on the page"
    assert len(np.unique(rows)) == len(rows), "a row arrived twice"
    assert np.array_equal(np.sort(rows), np.sort(sched.scheduled_rows())), "rows missing or unexpected"
    assert stack.procs["ladle"].poll() is None, "the server died"
    # the token is in force: a trainer without it is refused
    address = f"127.0.0.1:{stack.local.ports[('ladle', 50051)]}"
    client = BatchClient(0, 2, address, "compose-demo", token="", timeout=30)
    with client, pytest.raises(AuthenticationError):
        next(iter(client))
    assert stack.token not in (stack.local.workdir / "ladle.log").read_text()
