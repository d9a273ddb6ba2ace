"""A reconnecting client's claimed generation can never leave its rank unable to reconnect.

A Resume whose generation the store lost is written back to the store (the
new stream gets one more): a claim the server accepted, plus the joins that
follow it, must stay generations the server accepts from a reconnecting
trainer, or a real trainer of that rank is refused after every restart.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import pytest

from ladle.client import BatchClient
from ladle.proto import codec, rpc
from ladle.proto import ladle_pb2 as pb
from ladle.service.grpc_server import RESUME_CLAIM_LIMIT, RESUME_GENERATION_LIMIT

from .conftest import ServerProcess
from .test_serving import check_rank_stream, consume, reference

Factory = Callable[..., ServerProcess]
GOOD = {"rank": 0, "world_size": 1, "prefetch": 2}


def open_once(server: ServerProcess, **fields: Any) -> codec.DecodedStreamStart | pb.Error:
    """Send one raw Open: the StreamStart it began with, or the ladle error it was refused with."""
    request = pb.StreamRequest(open=pb.Open(**fields)).SerializeToString()
    with grpc.insecure_channel(server.address) as channel:
        call = channel.stream_stream(rpc.STREAM_METHOD, request_serializer=None, response_deserializer=None)
        frames = call(iter([request]), timeout=30)
        try:
            first = codec.decode_frame(next(frames))
        except grpc.RpcError as exc:
            details = rpc.error_details(exc.trailing_metadata())
            if details is None:
                raise AssertionError(f"refused with no ladle error trailer: {exc}") from None
            return details
        finally:
            frames.cancel()
    assert isinstance(first, codec.DecodedStreamStart), first
    return first


def refused(server: ServerProcess, job: str, generation: int, incarnation: str) -> None:
    error = open_once(
        server, job=job, resume=pb.Resume(generation=generation, incarnation=incarnation), **GOOD
    )
    assert isinstance(error, pb.Error), f"a claim of {generation} was accepted: {error}"
    assert (error.code, error.reason, error.field) == (
        "INVALID_ARGUMENT",
        "bad_resume",
        "open.resume.generation",
    )


def stored_generation(server: ServerProcess, job: str) -> codec.DecodedStreamStart:
    """Open the rank with no Resume: its StreamStart carries the stored generation plus one."""
    start = open_once(server, job=job, **GOOD)
    assert isinstance(start, codec.DecodedStreamStart), start
    return start


@pytest.mark.timeout(240)
def test_no_accepted_claim_leaves_a_rank_unable_to_reconnect_after_a_restart(
    server_factory: Factory, small_dataset: Path
) -> None:
    server = server_factory()
    # the claim one below the up-front limit, which used to be stored as 2**32: refused, whether the
    # store "lost" the job (another incarnation) or only the trainer's joins (a newer generation)
    poisoned = "resume-claim-refused"
    refused(server, poisoned, RESUME_GENERATION_LIMIT - 1, "x")
    start = stored_generation(server, poisoned)
    assert start.generation < RESUME_CLAIM_LIMIT, "the refused claim was stored"
    for generation in (RESUME_GENERATION_LIMIT - 1, RESUME_GENERATION_LIMIT - 2, RESUME_CLAIM_LIMIT):
        refused(server, poisoned, generation, start.incarnation)
    assert stored_generation(server, poisoned).generation < RESUME_CLAIM_LIMIT, "a refused claim was stored"
    # the largest claim restored: the trainers that follow have generations above it to reconnect with
    largest = "resume-claim-largest"
    start = open_once(
        server, job=largest, resume=pb.Resume(generation=RESUME_CLAIM_LIMIT - 1, incarnation="x"), **GOOD
    )
    assert isinstance(start, codec.DecodedStreamStart), start
    assert start.generation == RESUME_CLAIM_LIMIT
    # a real trainer of each rank is served across a restart of the server: it reconnects with its last
    # StreamStart's generation (above the restored claim for the second)
    clients = [BatchClient(0, 1, server.address, job, timeout=60) for job in (poisoned, largest)]
    try:
        parts = [consume(client, limit=5) for client in clients]
        server.kill()
        server_factory(state=server.state, port=server.port)
        for client, part in zip(clients, parts, strict=True):
            got = part + consume(client)
            assert client.reconnects >= 1, "the client never had to reconnect"
            check_rank_stream(small_dataset, reference(small_dataset, 1), 0, got)
    finally:
        for client in clients:
            client.close()
