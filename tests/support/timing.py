"""How long a call takes, and what it raised (tests that bound a wait)."""

from __future__ import annotations

import time
from collections.abc import Callable


def timed(call: Callable[[], object]) -> tuple[float, BaseException | None]:
    """(seconds, the exception ``call`` raised or None)."""
    start = time.monotonic()
    try:
        call()
    except BaseException as exc:
        return time.monotonic() - start, exc
    return time.monotonic() - start, None
