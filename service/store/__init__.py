"""The cursor store: each job's identity and per-rank cursors and fencing tokens.

``CursorStore`` (``base``) is the contract every store implements; the
``EmbeddedStore`` (``embedded``, one SQLite file) is the default on one
machine. Each mutating operation is one atomic check-and-set.
"""

from .base import Clock, CursorStore, JobSpec, JobState, Position, RankState
from .embedded import EmbeddedStore

__all__ = ["Clock", "CursorStore", "EmbeddedStore", "JobSpec", "JobState", "Position", "RankState"]
