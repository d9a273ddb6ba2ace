"""Admission: an Open checked at the wire's edge, and a session slot held before the store hears of it.

Every field of the Open is checked here once (the layers below take it as
valid), and the limits on sessions (``ladle serve --max-sessions``,
``--max-sessions-per-job``) are counted before the store is called: a refused
Open fences no one.
"""

from __future__ import annotations

import urllib.parse
from collections.abc import Collection
from typing import Any

from ladle.proto import ladle_pb2 as pb

from .lease import Claim, Position, StreamAbortedError
from .limits import Limits
from .metrics import ServerMetrics
from .start import Resume

__all__ = ["RESUME_GENERATION_LIMIT", "Admission", "client_key", "printable"]

# A reconnecting client's Resume.generation at most (checked before the join): the generation of its
# last StreamStart, and one is issued per stream opened
RESUME_GENERATION_LIMIT = 2**32


def printable(text: str, most: int = 200) -> str:
    """Free text a client sent (``Open.client_id``) as it goes in one log line: escaped, cut at ``most``."""
    cut = text[:most]
    if not cut.isprintable():  # a newline would start a forged log line
        cut = cut.encode("unicode_escape").decode("ascii")
    return cut + (f"... ({len(text)} characters)" if len(text) > most else "")


def _peer_host(peer: str) -> str:
    """The host of a gRPC peer: 'ipv4:10.0.0.5:4242' -> '10.0.0.5', 'ipv6:[::1]:4242' -> '::1'."""
    kind, _, rest = urllib.parse.unquote(peer).partition(":")
    if kind in ("ipv4", "ipv6"):
        return rest.rsplit(":", 1)[0].strip("[]")
    return peer


def client_key(context: Any, client_id: str | None) -> str:
    """Who asks, for the limits per client on schedules: ``Open.client_id`` at the peer's host.

    None (a Describe, which names no client): the peer's address and port, its connection, so the
    processes of one host (a trainer's ``len(client)`` each) are not one client.
    """
    peer = getattr(context, "peer", None)
    address = str(peer()) if callable(peer) else ""
    if client_id is None:
        return urllib.parse.unquote(address) or "an unknown address"
    return f"{printable(client_id, 100) or '-'} at {_peer_host(address) or 'an unknown address'}"


def claim_of(o: pb.Open) -> Claim:
    """What a checked Open asks of its job."""
    return Claim(
        job=o.job,
        rank=o.rank,
        world_size=o.world_size,
        start=Position(o.start.epoch, o.start.step) if o.HasField("start") else None,
        fingerprint=o.schedule_fingerprint if o.HasField("schedule_fingerprint") else None,
        resume=Resume(o.resume.generation, o.resume.incarnation) if o.HasField("resume") else None,
        own_cursor=o.own_cursor,
        elastic=o.elastic,
    )


class Admission:
    """The Opens this server takes: checked, counted against the session limits, until they are streams.

    Used on the event loop only.
    """

    def __init__(self, limits: Limits, metrics: ServerMetrics) -> None:
        self.limits = limits
        self.metrics = metrics
        # sessions admitted whose Open is still with the store (off the loop), by (job, rank)
        self._opening: dict[tuple[str, int], int] = {}
        self.stopping = False

    def check(self, first: pb.StreamRequest) -> Claim:
        """The Open's claim, or its refusal before it costs a session slot or a store call."""
        if first.WhichOneof("kind") != "open":
            raise StreamAbortedError("invalid_argument", "no_open", "the first request must be Open", "open")
        o = first.open
        if not o.job:
            raise StreamAbortedError("invalid_argument", "bad_job", "Open.job is empty", "open.job")
        if o.world_size < 1:
            raise StreamAbortedError(
                "invalid_argument", "bad_world_size", "Open.world_size must be >= 1", "open.world_size"
            )
        if o.rank >= o.world_size:
            raise StreamAbortedError(
                "invalid_argument",
                "bad_rank",
                f"rank: {o.rank} is outside 0..{o.world_size - 1} (world_size={o.world_size})",
                "open.rank",
            )
        max_prefetch = self.limits.max_prefetch
        if not 1 <= o.prefetch <= max_prefetch:
            self.metrics.refused("max_prefetch")
            raise StreamAbortedError(
                "invalid_argument",
                "bad_prefetch",
                f"Open.prefetch must be in 1..{max_prefetch} on this server "
                f"(ladle serve --max-prefetch), got {o.prefetch}",
                "open.prefetch",
            )
        if o.HasField("resume") and o.resume.generation >= RESUME_GENERATION_LIMIT:
            raise StreamAbortedError(
                "invalid_argument",
                "bad_resume",
                f"Open.resume.generation must be below {RESUME_GENERATION_LIMIT} (the generation of the "
                f"client's last StreamStart), got {o.resume.generation}",
                "open.resume.generation",
            )
        if self.stopping:
            raise StreamAbortedError("unavailable", "shutting_down", "the batch server is shutting down")
        return claim_of(o)

    def admit(self, job: str, rank: int, streaming: Collection[tuple[str, int]]) -> tuple[str, int]:
        """Hold a session slot for ``rank`` of ``job``, or refuse with RESOURCE_EXHAUSTED.

        ``streaming``: the (job, rank) of every open stream. A stream that
        replaces one of the same job and rank takes its slot, so a
        reconnecting trainer is never refused for the session it is replacing.
        """
        key = (job, rank)
        held = (set(streaming) | set(self._opening)) - {key}
        limits = self.limits
        if len(held) >= limits.max_sessions:
            self.metrics.refused("max_sessions")
            raise StreamAbortedError(
                "resource_exhausted",
                "too_many_sessions",
                f"this batch server already serves {len(held)} trainer sessions, its limit "
                f"(ladle serve --max-sessions) is {limits.max_sessions}: add a replica or raise the limit",
            )
        in_job = sum(1 for held_job, _ in held if held_job == job)
        if in_job >= limits.per_job:
            self.metrics.refused("max_sessions_per_job")
            raise StreamAbortedError(
                "resource_exhausted",
                "too_many_sessions_per_job",
                f"job {job!r} already holds {in_job} sessions on this batch server, the limit per job "
                f"(ladle serve --max-sessions-per-job) is {limits.per_job}: raise it (up to --max-sessions) "
                "or add a replica",
                "open.rank",
            )
        self._opening[key] = self._opening.get(key, 0) + 1
        return key

    def release(self, key: tuple[str, int]) -> None:
        """The Open of ``key`` is a stream now, or refused: its slot is the session table's, or free."""
        left = self._opening.pop(key) - 1
        if left:
            self._opening[key] = left
