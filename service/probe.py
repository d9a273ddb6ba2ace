"""``python -m ladle.service.probe HOST:PORT``: exit 0 when ``GET /readyz`` answers 200, else 1.

The container healthcheck of the compose stack: ``/readyz`` says what the
gRPC health service says (the dataset and the cursor store answer), and this
probe imports nothing but ``socket``, so a check every 2 s costs a few
milliseconds of CPU where ``ladle health`` (grpcio and the CLI) cost about
450 ms (docs/deploy.md). The HTTP face must be on (``--http-port``).
"""

from __future__ import annotations

import socket
import sys


def ready(address: str, timeout: float = 2.0) -> bool:
    """Whether ``http://address/readyz`` answers 200 within ``timeout`` seconds."""
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout) as sock:
            sock.sendall(f"GET /readyz HTTP/1.0\r\nHost: {address}\r\n\r\n".encode())
            status = sock.recv(64).split(b"\r\n", 1)[0].split()
    except (OSError, ValueError):
        return False
    return len(status) > 1 and status[1] == b"200"


if __name__ == "__main__":
    sys.exit(0 if len(sys.argv) == 2 and ready(sys.argv[1]) else 1)
