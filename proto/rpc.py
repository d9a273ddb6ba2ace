"""The gRPC side of the contract: method names, handlers and calls that speak frames.

``Stream`` carries raw frames (see ``ladle.proto`` and ``ladle.proto.codec``),
so neither side may use the generated stub or servicer helper for it: the
server registers :func:`batch_service_handler` and the client calls through
:class:`BatchServiceClient`, both with identity serializers for the frames and
protobuf for everything else. Only grpcio and the generated messages are
imported, so the client can use this module.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, Final

import grpc

from ladle.proto import ladle_pb2 as pb

__all__ = [
    "DESCRIBE_METHOD",
    "ERROR_TRAILER",
    "SERVICE",
    "STREAM_METHOD",
    "BatchServiceClient",
    "abort",
    "batch_service_handler",
    "error_details",
    "error_trailer",
    "message_options",
]

SERVICE: Final = "ladle.v1.BatchService"
STREAM_METHOD: Final = f"/{SERVICE}/Stream"
DESCRIBE_METHOD: Final = f"/{SERVICE}/Describe"
ERROR_TRAILER: Final = "ladle-error-bin"
"""Trailing metadata key of a failed call: a serialized ``ladle.v1.Error``."""

StreamHandler = Callable[[Any, Any], Any]
"""``(requests, context)``: the server's Stream implementation, in any shape grpc serves.

A generator of frames on grpc's synchronous server; on grpc.aio, ladle's
server is a coroutine that writes each frame with ``context.write``.
"""
DescribeHandler = Callable[[pb.DescribeRequest, Any], pb.JobInfo]
"""``(request, context) -> JobInfo``: the server's Describe implementation."""


def batch_service_handler(stream: StreamHandler, describe: DescribeHandler) -> Any:
    """A ``grpc.GenericRpcHandler`` for ``ladle.v1.BatchService``; frames go out unserialized.

    Register it with ``server.add_generic_rpc_handlers((handler,))``.
    """
    return grpc.method_handlers_generic_handler(
        SERVICE,
        {
            "Stream": grpc.stream_stream_rpc_method_handler(
                stream, request_deserializer=pb.StreamRequest.FromString, response_serializer=None
            ),
            "Describe": grpc.unary_unary_rpc_method_handler(
                describe,
                request_deserializer=pb.DescribeRequest.FromString,
                response_serializer=pb.JobInfo.SerializeToString,
            ),
        },
    )


class BatchServiceClient:
    """Calls of ``ladle.v1.BatchService`` on a channel; ``stream`` yields raw frames (``bytes``)."""

    def __init__(self, channel: Any, metadata: Sequence[tuple[str, str]] = ()) -> None:
        # sent with every call: the server's token (``authorization: Bearer ...``) when it has one
        self._metadata = tuple(metadata) or None
        self._stream = channel.stream_stream(
            STREAM_METHOD,
            request_serializer=pb.StreamRequest.SerializeToString,
            response_deserializer=None,
        )
        self._describe = channel.unary_unary(
            DESCRIBE_METHOD,
            request_serializer=pb.DescribeRequest.SerializeToString,
            response_deserializer=pb.JobInfo.FromString,
        )

    def stream(self, requests: Iterator[pb.StreamRequest], timeout: float | None = None) -> Any:
        """Open a Stream: the call is also an iterator of frames (decode with ``codec.decode_frame``)."""
        return self._stream(requests, timeout=timeout, metadata=self._metadata)

    def describe(
        self,
        job: str,
        timeout: float | None = None,
        *,
        world_size: int = 0,
        epoch: int | None = None,
        rank: int | None = None,
        own_cursor: bool = False,
    ) -> pb.JobInfo:
        """The server's ``JobInfo`` of ``job`` (``DescribeRequest`` says what the other fields ask)."""
        request = pb.DescribeRequest(job=job, world_size=world_size, own_cursor=own_cursor)
        if epoch is not None:
            request.epoch = epoch
        if rank is not None:
            request.rank = rank
        info: pb.JobInfo = self._describe(request, timeout=timeout, metadata=self._metadata)
        return info


def message_options(max_frame_bytes: int) -> list[tuple[str, int]]:
    """Channel / server options that let frames up to ``max_frame_bytes`` through, both ways.

    gRPC refuses received messages over 4 MiB by default, and raising only
    the sender's limit does not help: give these to the server and to every
    client channel (``codec.max_frame_bytes`` computes the size).
    """
    limit = max(int(max_frame_bytes), 4 << 20)
    return [("grpc.max_send_message_length", limit), ("grpc.max_receive_message_length", limit)]


def error_trailer(error: pb.Error) -> tuple[tuple[str, bytes], ...]:
    """Trailing metadata carrying ``error``; pass to ``context.set_trailing_metadata``."""
    return ((ERROR_TRAILER, error.SerializeToString()),)


async def abort(context: Any, code: Any, reason: str, message: str, field: str = "") -> None:
    """End a grpc.aio call with status ``code`` and a ``ladle.v1.Error`` trailer (never returns)."""
    error = pb.Error(code=code.name, reason=reason, message=message, field=field)
    context.set_trailing_metadata(error_trailer(error))
    await context.abort(code, message)


def error_details(trailing_metadata: Iterable[tuple[str, str | bytes]] | None) -> pb.Error | None:
    """The ``ladle.v1.Error`` of a failed call's trailing metadata, or None if it has none."""
    for key, value in trailing_metadata or ():
        if key == ERROR_TRAILER and isinstance(value, bytes):
            error = pb.Error()
            error.ParseFromString(value)
            return error
    return None
