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


def test_a_refused_stream_is_logged_on_the_server(server_factory: Factory) -> None:
    """A replica that refused every trainer (another world size, config or dataset) logged nothing at all."""
    from ladle.client import BatchClient
    from ladle.client.errors import BatchClientError

    server = server_factory()
    with BatchClient(0, 2, server.address, "refused-here", timeout=30) as running:
        next(iter(running))
        with BatchClient(0, 3, server.address, "refused-here", client_id="node-7:42", timeout=30) as wrong:
            try:
                next(iter(wrong))
            except BatchClientError:
                pass
            else:
                raise AssertionError("another world size was served")
    deadline = time.monotonic() + 10
    while "stream refused" not in server.log_tail() and time.monotonic() < deadline:
        time.sleep(0.05)
    lines = [line for line in server.log_tail().splitlines() if "stream refused" in line]
    assert lines, f"the refusal is not in the server's log: {server.log_tail()}"
    assert " WARNING ladle.server: stream refused: job=refused-here rank=0/3 client=node-7:42: " in lines[0]
    assert "world_size=2" in lines[0] or "world size" in lines[0], lines[0]


def test_a_rank_that_starts_an_epoch_behind_the_others_is_named(server_factory: Factory) -> None:
    """After a store lost a rank's position (or it never ran), it replayed an epoch without a word."""
    from ladle.client import BatchClient

    server = server_factory()
    with BatchClient(0, 2, server.address, "behind", timeout=30) as ahead:
        for _batch in ahead:  # one whole epoch, then a few steps into the next
            pass
        batches = iter(ahead)
        for _ in range(3):
            next(batches)
    with BatchClient(1, 2, server.address, "behind", timeout=30) as late:
        first = next(iter(late))
        assert (first.epoch, first.step) == (0, 0)
    deadline = time.monotonic() + 10
    while "behind rank 0" not in server.log_tail() and time.monotonic() < deadline:
        time.sleep(0.05)
    lines = [line for line in server.log_tail().splitlines() if "behind rank 0" in line]
    assert lines, f"no warning: {server.log_tail()}"
    assert " WARNING ladle.server: job behind rank 1 starts at " in lines[0], lines[0]
    assert "load_state_dict" in lines[0]
    assert "no record of this rank (its first start" in lines[0], "a first start is not told apart"


def test_samples_cut_at_max_seq_len_are_named_at_start_up(server_factory: Factory) -> None:
    server = server_factory(["--max-seq-len", "200", "--bucket-bounds", "0,48,76,108,152,201"])
    lines = [line for line in server.log_tail().splitlines() if "longer than max_seq_len=200" in line]
    assert len(lines) == 1, server.log_tail()
    assert " WARNING ladle.server: " in lines[0], lines[0]
    assert "are served cut to it" in lines[0], lines[0]
    assert "--overlong drop" in lines[0], lines[0]
    quiet = server_factory(["--max-seq-len", "3072", "--bucket-bounds", "0,48,76,108,152,206,3073"])
    assert "longer than max_seq_len=3072" not in quiet.log_tail()
