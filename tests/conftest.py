"""Shared test settings: hypothesis runs a short profile in CI, a longer one on demand."""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

settings.register_profile(
    "ci",
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
    derandomize=True,
)
settings.register_profile(
    "dev", max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.register_profile(
    "long", max_examples=2000, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci" if os.environ.get("CI") else "dev"))


# --- a throwaway redis-server per test (tests/support/redis_server.py) ---------
# The repository root goes on sys.path so that ``tests.support`` imports by its
# full name, as the store tests import ``tests.contract``.

import sys  # noqa: E402
from collections.abc import Callable, Iterator  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import pytest  # noqa: E402

_ROOT = str(Path(__file__).resolve().parents[1])
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

from tests.support.redis_server import RedisServer, redis_server_available  # noqa: E402


@pytest.fixture
def redis_server_factory() -> Iterator[Callable[..., RedisServer]]:
    """Start ``RedisServer(**options)`` on demand; every server started is killed at the end, pass or fail."""
    if not redis_server_available():
        pytest.skip("redis-server is not installed")
    started: list[RedisServer] = []

    def start(**options: Any) -> RedisServer:
        started.append(RedisServer(**options))
        return started[-1]

    try:
        yield start
    finally:
        for server in started:
            server.close()


@pytest.fixture
def redis_server(redis_server_factory: Callable[..., RedisServer]) -> RedisServer:
    """A fresh, empty redis-server on a free loopback port (no persistence), killed after the test."""
    return redis_server_factory()
