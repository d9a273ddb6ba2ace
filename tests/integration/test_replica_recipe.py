"""docs/deploy.md's "Replicas on one Redis without Kubernetes", run as written.

Every bash block of the section runs unchanged, with this virtual
environment's ``ladle`` and ``python`` first on the PATH, inside a private
network namespace (``unshare --net``): the fixed ports the page names
(Redis 6379, gRPC 50051/50052, HTTP 8080/8081) meet nothing else, not the
machine's own Redis nor other tests, and the recipe is shown to need nothing
else on the host. The one-host block runs alone on its namespace's loopback,
from Redis to its last ``kill``. The several-hosts blocks run on two
namespaces joined by a virtual Ethernet pair that carries the page's
10.0.0.1 and 10.0.0.2: host 1's block, then the replica block on each host
(the secrets copied to host 2 as the page says), then the trainers on host 2.

Each run is checked the same way: every row of the epoch's schedule reached
exactly one rank, each replica served some of the ranks, and the job's
cursor (every rank at the next epoch) is in Redis's append-only file, read
back by a redis-server started on the recipe's data folder. Every process in
the namespaces is stopped at the end, even when the test fails.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from ladle.service.cli import build_parser, config_from_args
from ladle.service.dataset import open_dataset
from ladle.service.schedule import build_schedule
from tests.support.redis_server import RedisServer, redis_server_available

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "deploy.md"
SECTION = "## Replicas on one Redis without Kubernetes"
BIN = Path(sys.executable).parent
WORLD_SIZE = 4
BLOCK_TIMEOUT_S = 300.0  # about 15 s on an idle machine; 2 min seen under a load of 95
HOSTS = ("10.0.0.1", "10.0.0.2")  # the page's addresses for host 1 and host 2


def blocks() -> dict[str, str]:
    """The section's bash blocks, each keyed by its first line (a comment saying where it runs)."""
    text = DOC.read_text(encoding="utf-8")
    start = text.index(SECTION)
    end = text.find("\n## ", start + len(SECTION))
    found = re.findall(r"```bash\n(.*?)```", text[start : end if end > 0 else len(text)], flags=re.S)
    return {code.splitlines()[0]: code for code in found}


def block(start: str) -> str:
    """The section's one bash block whose first line starts with ``start``."""
    found = [code for first, code in blocks().items() if first.startswith(start)]
    assert len(found) == 1, f"{len(found)} bash blocks start with {start!r} in {DOC.name}: {list(blocks())}"
    return found[0]


def serve_argv(code: str) -> list[str]:
    """The arguments of the block's first ``ladle serve`` (after ``ladle``), its redirections left out."""
    line = next(line for line in code.replace("\\\n", " ").splitlines() if line.startswith("ladle serve "))
    return shlex.split(line.split(">")[0])[1:]


def block_env() -> dict[str, str]:
    """The environment a user's shell would have: no trainer or ladle variables, ladle on the PATH."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RANK", "WORLD_SIZE", "LADLE_"))}
    env["PATH"] = f"{BIN}{os.pathsep}{env.get('PATH', '')}"
    return env


class Namespace:
    """A private network and process namespace, held by ``unshare``; ``bash`` runs a block inside it.

    Everything a block starts stays in the namespace, so ``close`` finds
    every such process by its namespace and stops it: the replicas first,
    then Redis (both with SIGTERM, so Redis flushes its append-only file),
    then the holder, whose end kills whatever is left (the kernel ends a
    process namespace with its first process). The holder dies with the
    test process too (setpriv's parent-death signal), so nothing outlives a
    killed test run.
    """

    def __init__(self) -> None:
        self.holder = subprocess.Popen(
            [
                *("setpriv", "--pdeathsig", "KILL", "--"),
                *("unshare", "--net", "--pid", "--fork", "--kill-child"),
                *("sh", "-c", "ip link set lo up && echo up && exec sleep 3600"),
            ],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        assert self.holder.stdout is not None
        if self.holder.stdout.readline().strip() != "up":
            why = self.holder.communicate(timeout=30)[1].strip()
            raise PermissionError(f"unshare --net --pid: {why or 'refused'}")
        self.net = os.readlink(f"/proc/{self.holder.pid}/ns/net")
        # never configure the machine's own network by mistake
        assert self.net != os.readlink("/proc/self/ns/net"), "unshare left the process in this namespace"

    @property
    def enter(self) -> list[str]:
        ns = f"/proc/{self.holder.pid}/ns"
        return ["nsenter", f"--net={ns}/net", f"--pid={ns}/pid_for_children", "--"]

    def ip(self, *args: str) -> None:
        """``ip ARGS`` in the network namespace only: its ``netns PID`` takes this machine's process ids."""
        enter = ["nsenter", f"--net=/proc/{self.holder.pid}/ns/net", "--"]
        subprocess.run([*enter, "ip", *args], check=True, capture_output=True, timeout=30)

    def bash(self, code: str, cwd: Path, name: str) -> str:
        """Run ``code`` with ``bash -e`` in ``cwd``; its output (in ``cwd/../name.out``) once it exits 0."""
        out = cwd.parent / f"{name}.out"
        with out.open("wb") as sink:  # a file: background processes keep it open after bash exits
            proc = subprocess.Popen(
                [*self.enter, "bash", "-e", "-c", code],
                cwd=cwd,
                env=block_env(),
                stdin=subprocess.DEVNULL,
                stdout=sink,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        try:
            returncode = proc.wait(timeout=BLOCK_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
            raise AssertionError(f"{name} did not finish in {BLOCK_TIMEOUT_S:.0f}s: {tail(out)}") from None
        assert returncode == 0, f"{name} exited with {returncode}:\n{tail(out)}\n{logs(cwd)}"
        return out.read_text(errors="replace")

    def processes(self) -> dict[int, str]:
        """Process id -> command name of every process in the namespace but the holder and its child."""
        found = {}
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit() or int(entry.name) == self.holder.pid:
                continue
            try:
                if os.readlink(entry / "ns" / "net") != self.net:
                    continue
                status = dict(line.split(":\t", 1) for line in (entry / "status").read_text().splitlines())
            except (OSError, ValueError):
                continue  # gone meanwhile
            if int(status["PPid"]) != self.holder.pid:
                found[int(entry.name)] = status["Name"].strip()
        return found

    def stop(self, which: list[int], sig: signal.Signals, wait_s: float) -> None:
        for pid in which:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline and set(which) & set(self.processes()):
            time.sleep(0.05)

    def close(self) -> None:
        if self.holder.poll() is not None:
            return  # closed already
        procs = self.processes()
        self.stop([p for p, comm in procs.items() if comm != "redis-server"], signal.SIGTERM, 15)
        self.stop(list(self.processes()), signal.SIGTERM, 15)
        self.holder.kill()
        self.holder.communicate(timeout=30)


def tail(path: Path, chars: int = 3000) -> str:
    return path.read_text(errors="replace")[-chars:] if path.exists() else "(no output)"


def logs(folder: Path) -> str:
    return "\n".join(f"--- {p.name}\n{tail(p, 1500)}" for p in sorted(folder.glob("*.log")))


@pytest.fixture
def namespaces() -> Iterator[list[Namespace]]:
    """The namespaces a test makes (with ``namespace``), every one closed at its end, pass or fail."""
    if sys.platform != "linux" or os.geteuid() != 0:
        pytest.skip("private network namespaces need root on Linux (unshare --net)")
    missing = [tool for tool in ("setpriv", "unshare", "nsenter", "ip") if shutil.which(tool) is None]
    if missing:
        pytest.skip(f"needs {', '.join(missing)} for a private network namespace")
    if not redis_server_available():
        pytest.skip("redis-server is not installed")
    made: list[Namespace] = []
    try:
        yield made
    finally:
        for each in made:
            each.close()


def namespace(made: list[Namespace]) -> Namespace:
    """A new namespace, kept in ``made`` to be closed; skips the test where none can be made."""
    try:
        made.append(Namespace())
    except PermissionError as exc:
        pytest.skip(f"cannot make a private network namespace here: {exc}")
    return made[-1]


def check_every_row_once(received: Path, dataset: Path, serve: list[str]) -> None:
    """Every row of epoch 0's schedule (the replicas' dataset and options) reached exactly one rank."""
    rows = np.concatenate([np.load(received / f"rank-{rank}.npy") for rank in range(WORLD_SIZE)])
    config = config_from_args(build_parser().parse_args(serve))
    sched = build_schedule(open_dataset(dataset).lengths, config, epoch=0, world_size=WORLD_SIZE)
    assert len(np.unique(rows)) == len(rows), "duplicate samples: a row reached two ranks"
    assert np.array_equal(np.sort(rows), np.sort(sched.scheduled_rows())), "missing samples"


def check_spread(replica_logs: list[Path], job: str) -> None:
    """Each replica served some of the job's ranks, and together all of them."""
    opened = re.compile(rf"stream open: job={job} rank=(\d+)/")
    served = {
        f"{log.parent.name}/{log.name}": {int(r) for r in opened.findall(log.read_text())}
        for log in replica_logs
    }
    assert all(served.values()), f"a replica served no rank: {served}"
    assert set().union(*served.values()) == set(range(WORLD_SIZE)), f"ranks never served: {served}"


def check_cursor_in_redis(redis_data: Path, job: str) -> None:
    """The job is in Redis's files with every rank at epoch 1, step 0: the epoch was read and stored."""
    with RedisServer(appendonly=True, extra_args=("--dir", str(redis_data))) as redis:
        listed = subprocess.run(
            [str(BIN / "ladle"), "jobs", "--json", "--redis-url", redis.url],
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert listed.returncode == 0, listed.stderr
    jobs: list[dict[str, Any]] = json.loads(listed.stdout)
    stored = next((j for j in jobs if j["job"] == job), None)
    assert stored is not None, f"job {job} is not in Redis's append-only file: {[j['job'] for j in jobs]}"
    assert stored["world_size"] == WORLD_SIZE
    positions = {r["rank"]: (r["epoch"], r["step"]) for r in stored["ranks"]}
    epoch_read = {rank: (1, 0) for rank in range(WORLD_SIZE)}
    assert positions == epoch_read, f"cursor not at the epoch's end: {positions}"


def test_one_host_recipe_runs_as_written(namespaces: list[Namespace], tmp_path: Path) -> None:
    code = block("# Redis, persisting to redis-data/")
    folder = tmp_path / "host"
    folder.mkdir()
    out = namespace(namespaces).bash(code, folder, "one-host")
    assert re.search(r"^replicas-demo\s+4\s+1:0\s+1:0\s", out, flags=re.M), f"ladle jobs: no cursor\n{out}"
    check_every_row_once(folder / "received", folder / "sample", serve_argv(code))
    check_spread([folder / "replica-a.log", folder / "replica-b.log"], "replicas-demo")
    check_cursor_in_redis(folder / "redis-data", "replicas-demo")


def test_several_hosts_recipe_runs_as_written(namespaces: list[Namespace], tmp_path: Path) -> None:
    host1, host2 = namespace(namespaces), namespace(namespaces)
    # one cable between the hosts: a veth pair made in host 1 with its other end in host 2
    host1.ip(*f"link add eth-ladle type veth peer name eth-ladle netns {host2.holder.pid}".split())
    for host, address in zip((host1, host2), HOSTS, strict=True):
        host.ip("addr", "add", f"{address}/24", "dev", "eth-ladle")
        host.ip("link", "set", "eth-ladle", "up")
    one, two, trainers = (tmp_path / name for name in ("host1", "host2", "trainers"))
    for folder in (one, two, trainers):
        folder.mkdir()
    replica = block("# every replica host:")

    host1.bash(block("# host 1 (10.0.0.1):"), one, "host1")
    for secret, to in (("ladle.token", two), ("redis.password", two), ("ladle.token", trainers)):
        shutil.copy(one / secret, to / secret)  # the page's "copy ... (scp, or your secret store)"
    host1.bash(replica, one, "host1-replica")
    host2.bash(replica, two, "host2-replica")
    host2.bash(block("# trainers:"), trainers, "trainers")
    for host in (host1, host2):
        host.close()

    check_every_row_once(trainers / "received", two / "sample", serve_argv(replica))
    check_spread([one / "replica.log", two / "replica.log"], "replicas-hosts")
    check_cursor_in_redis(one / "redis-data", "replicas-hosts")
