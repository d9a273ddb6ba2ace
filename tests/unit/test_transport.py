"""The client transport ladle chooses for grpcio's import (``ladle.proto.transport``).

Each case runs in a fresh interpreter: grpcio reads its experiments once, when
it is first imported, and this test process imported it long ago. Which
transport a channel runs on is read from grpcio's own ``tcp`` trace: iomgr's
endpoint logs each read and write from ``tcp_posix.cc``, and nothing else
does (the EventEngine's from ``endpoint.cc``, and the server in the same
process is on the EventEngine either way, so only iomgr has a mark of its
own: the first test is the control that the mark appears when it should).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from typing import Any

import grpc
import pytest

from ladle.proto import transport

# Connects a client channel to a server in the same process, then prints what ladle chose, whether
# GRPC_EXPERIMENTS is left in the environment, and whether a child process sees it.
_CONNECT = """
import json, os, subprocess, sys
from concurrent import futures
{before}
import ladle.client
import grpc
from ladle.proto import transport
server = grpc.server(futures.ThreadPoolExecutor(1))
port = server.add_insecure_port("127.0.0.1:0")
server.start()
channel = grpc.insecure_channel(f"127.0.0.1:{{port}}")
grpc.channel_ready_future(channel).result(timeout=30)
try:  # a call, so the endpoints read and write (and trace it), not only connect
    channel.unary_unary("/no.Such/Method")(b"", timeout=30)
except grpc.RpcError as exc:
    assert exc.code() == grpc.StatusCode.UNIMPLEMENTED, exc
channel.close()
server.stop(None)
child = subprocess.run(
    [sys.executable, "-c", "import os; print(os.environ.get('GRPC_EXPERIMENTS'))"],
    capture_output=True, text=True, check=True,
).stdout.strip()
print(json.dumps({{"chosen": transport.chosen(), "env": os.environ.get("GRPC_EXPERIMENTS"), "child": child}}))
"""


def _run(before: str = "", env: dict[str, str] | None = None) -> tuple[dict[str, Any], str]:
    """Run ``_CONNECT`` with grpcio's tcp trace on: (what it printed, grpcio's log)."""
    run_env = {k: v for k, v in os.environ.items() if k != "GRPC_EXPERIMENTS"}
    run_env.update({"GRPC_VERBOSITY": "debug", "GRPC_TRACE": "tcp", **(env or {})})
    done = subprocess.run(
        [sys.executable, "-c", _CONNECT.format(before=textwrap.dedent(before))],
        capture_output=True,
        text=True,
        env=run_env,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1]), done.stderr


needs_tested_grpc = pytest.mark.skipif(
    not transport.grpc_is_tested(grpc.__version__),
    reason=f"grpcio {grpc.__version__} is not in TESTED_GRPC: ladle leaves its transport alone",
)


@needs_tested_grpc
def test_importing_ladle_first_runs_client_channels_on_iomgr_and_leaves_the_environment_as_it_was() -> None:
    got, log = _run()
    assert got["chosen"].startswith("iomgr"), got
    assert "tcp_posix.cc" in log, "the client's connection is not on iomgr's endpoint"
    assert got["env"] is None, "GRPC_EXPERIMENTS was left in the process's environment"
    assert got["child"] == "None", "a child process inherited ladle's GRPC_EXPERIMENTS"


@needs_tested_grpc
def test_a_grpc_experiments_of_the_users_own_even_empty_is_left_to_grpcio() -> None:
    got, log = _run(env={"GRPC_EXPERIMENTS": ""})
    assert got["chosen"] == "grpcio's, as GRPC_EXPERIMENTS='' asks", got
    assert "tcp_posix.cc" not in log, "not grpcio's default transport"
    assert got["env"] == "", "the user's variable was changed"
    assert got["child"] == "", "the user's variable was not passed on"


def test_grpcio_imported_before_ladle_keeps_its_own_transport() -> None:
    got, log = _run(before="import grpc")
    assert got["chosen"] == "grpcio's own: grpcio was imported before ladle", got
    assert "tcp_posix.cc" not in log


def test_an_untested_grpcio_keeps_its_own_transport() -> None:
    got, log = _run(
        before="""
        import importlib.metadata
        importlib.metadata.version = lambda name: "1.99.0"
        """
    )
    assert got["chosen"] == "grpcio's own: grpcio 1.99.0 is not one ladle's transport was tested with", got
    assert "tcp_posix.cc" not in log


@pytest.mark.parametrize(
    ("version", "tested"),
    [("1.85.3", True), ("1.85.0rc1", True), ("1.86.0", False), ("1", False), ("", False), ("x.y", False)],
)
def test_tested_versions_are_read_by_major_and_minor(version: str, tested: bool) -> None:
    assert transport.grpc_is_tested(version) is tested


def test_choosing_again_changes_nothing() -> None:
    assert transport.choose() == transport.chosen()
    assert transport.choose() == transport.chosen()
    assert not transport.chosen().startswith("not chosen")
