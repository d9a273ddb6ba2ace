"""The log of a real ``ladle serve``: uvicorn's own lines come in ladle's format."""

from __future__ import annotations

import re
import socket
import time
from collections.abc import Callable

from .conftest import ServerProcess

Factory = Callable[..., ServerProcess]

# logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s") in `ladle serve`
LADLE_LINE = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} (DEBUG|INFO|WARNING|ERROR|CRITICAL) [\w.]+: ")


def test_uvicorn_warnings_have_a_timestamp_and_a_logger_name(server_factory: Factory) -> None:
    server = server_factory()
    with socket.create_connection(("127.0.0.1", server.http_port), timeout=10) as sock:
        sock.sendall(b"not http at all\r\n\r\n")  # uvicorn: "Invalid HTTP request received."
        assert sock.recv(100).startswith(b"HTTP/1.1 400")
    deadline = time.monotonic() + 10
    while "Invalid HTTP request received." not in server.log_tail() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert server.stop() == 0
    lines = [line for line in server.log_tail().splitlines() if "Invalid HTTP request received." in line]
    assert lines, f"uvicorn's warning is not in the log: {server.log_tail()}"
    for line in lines:
        assert LADLE_LINE.match(line), f"not in ladle's log format: {line!r}"
        assert " WARNING uvicorn.error: " in line, line
