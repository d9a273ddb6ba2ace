"""``python -m ladle.service.probe``: 0 on a 200 from /readyz, 1 on anything else (a 503, no server)."""

from __future__ import annotations

import http.server
import subprocess
import sys
import threading
from collections.abc import Iterator

import pytest

from ladle.service.probe import ready


@pytest.fixture
def readyz() -> Iterator[tuple[str, list[int]]]:
    answer = [200]

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(answer[0] if self.path == "/readyz" else 404)
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"127.0.0.1:{server.server_address[1]}", answer
    finally:
        server.shutdown()
        server.server_close()


def test_ready_only_on_200(readyz: tuple[str, list[int]]) -> None:
    address, answer = readyz
    assert ready(address)
    answer[0] = 503
    assert not ready(address)
    assert not ready("127.0.0.1:1")  # nothing listens
    assert not ready("no-port")


def test_the_module_exits_0_or_1(readyz: tuple[str, list[int]]) -> None:
    address, answer = readyz
    run = [sys.executable, "-m", "ladle.service.probe", address]
    assert subprocess.run(run, timeout=30).returncode == 0
    answer[0] = 503
    assert subprocess.run(run, timeout=30).returncode == 1
