"""The cursor store: each job's identity and per-rank cursors and fencing tokens.

``CursorStore`` (``base``) is the contract every store implements; the
``EmbeddedStore`` (``embedded``, one SQLite file) is the default on one
machine and ``RedisCursorStore`` (``redis``, one Lua script per operation) is
shared by servers on many hosts. Each mutating operation is one atomic
check-and-set. ``open_store`` picks one from the server's options.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

from .base import Clock, CursorStore, JobSpec, JobState, Position, RankState
from .embedded import EmbeddedStore

# How long Redis keeps a job nobody touches (each write starts the clock again).
DEFAULT_JOB_TTL_S: Final = 7 * 86400.0

if TYPE_CHECKING:
    from .redis import RedisCursorStore

__all__ = [
    "DEFAULT_JOB_TTL_S",
    "Clock",
    "CursorStore",
    "EmbeddedStore",
    "JobSpec",
    "JobState",
    "Position",
    "RankState",
    "RedisCursorStore",
    "open_store",
]


def __getattr__(name: str) -> Any:
    # redis-py is imported only by those who use Redis (it costs ~0.1 s at start-up).
    if name == "RedisCursorStore":
        from .redis import RedisCursorStore

        return RedisCursorStore
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def open_store(*, redis_url: str | None, state_path: str | Path, job_ttl_s: float) -> CursorStore:
    """The server's store: Redis at ``redis_url`` if one is given, else the embedded file ``state_path``.

    ``job_ttl_s`` is how long either store keeps a job nobody writes to (0:
    forever). The embedded file's folder is created if needed.
    """
    if redis_url:
        from .redis import RedisCursorStore

        return RedisCursorStore(redis_url, job_ttl_s=job_ttl_s)
    path = Path(state_path)
    path.parent.mkdir(parents=True, exist_ok=True)
    return EmbeddedStore(path, job_ttl_s=job_ttl_s)
