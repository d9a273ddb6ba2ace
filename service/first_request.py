"""Every gRPC call sends its first request in time, and a request that does not parse is the caller's fault.

grpc.aio waits for the one request of a unary-request call (Describe, the
health service's Check and Watch) before the handler runs, with no time
limit, and each waiting call holds a slot of its kind's call budget
(``security.CallGate``): calls that open and never send their request would
hold those slots for ever (no token needed for the health service's).
It also parses that request itself, so bytes that are not the message ended
the call as UNKNOWN with an ERROR and a traceback in the log, one per call.

``FirstRequestInterceptor`` serves every unary-request method as a
stream-request one that reads its request within ``timeout`` seconds
(DEADLINE_EXCEEDED after it, reason ``no_request``), parses it
(INVALID_ARGUMENT, reason ``bad_request``, if it does not parse) and then
calls the method as registered. The Stream method reads its own ``Open``
under the same limit (``BatchServicer.stream``). Only calls with one request
go through here, so no batch does.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
from google.protobuf.message import DecodeError  # type: ignore[import-untyped]

from ladle.proto import rpc

__all__ = ["FirstRequestInterceptor", "NoRequestError", "first_request"]

log = logging.getLogger("ladle.server")


class NoRequestError(Exception):
    """A call sent no request in time, or one that does not parse: ``status``, ``reason``, ``message``."""

    def __init__(self, status: Any, reason: str, message: str) -> None:
        self.status = status
        self.reason = reason
        super().__init__(message)

    async def abort(self, context: Any) -> None:
        """End the call with this status and a ``ladle.v1.Error`` trailer (never returns)."""
        await rpc.abort(context, self.status, self.reason, str(self))


async def first_request(
    requests: AsyncIterator[Any], timeout: float, what: str, *, missing: str = "no_request"
) -> Any:
    """The call's first request, read within ``timeout`` seconds; ``NoRequestError`` if none came.

    ``what`` names the request in the messages ("Open"); ``missing`` is the
    reason when none came (in time).
    """
    try:
        return await asyncio.wait_for(requests.__anext__(), timeout)
    except TimeoutError:
        raise NoRequestError(
            grpc.StatusCode.DEADLINE_EXCEEDED,
            missing,
            f"the call sent no {what} within {timeout:g} s of opening (ladle serve --handshake-timeout)",
        ) from None
    except StopAsyncIteration:
        raise NoRequestError(
            grpc.StatusCode.INVALID_ARGUMENT, missing, f"the call ended before its {what}"
        ) from None
    except DecodeError as exc:
        raise NoRequestError(
            grpc.StatusCode.INVALID_ARGUMENT, "bad_request", f"a request is not a valid {what}: {exc}"
        ) from None


class FirstRequestInterceptor(grpc.aio.ServerInterceptor):  # type: ignore[misc]
    """Serves each unary-request method so that its request must come within ``timeout`` and parse."""

    def __init__(self, timeout: float) -> None:
        self.timeout = timeout

    async def intercept_service(self, continuation: Callable[[Any], Awaitable[Any]], details: Any) -> Any:
        handler = await continuation(details)
        if handler is None or handler.request_streaming:
            return handler
        return _reading_first(handler, self.timeout, details.method)


def _reading_first(handler: Any, timeout: float, method: str) -> Any:
    """``handler`` (a unary-request one) as a stream-request handler that reads and parses the request."""
    parse = handler.request_deserializer or (lambda data: data)
    what = f"request of {method}"

    async def request(requests: AsyncIterator[bytes], context: Any) -> Any:
        """The call's request, parsed; else the call ends here (``context.abort`` raises)."""
        try:
            raw = await first_request(requests, timeout, what)
            try:
                return parse(raw)
            except DecodeError as exc:
                raise NoRequestError(
                    grpc.StatusCode.INVALID_ARGUMENT, "bad_request", f"the {what} does not parse: {exc}"
                ) from None
        except NoRequestError as exc:
            log.debug("%s: %s", method, exc)
            await exc.abort(context)
            raise

    if handler.response_streaming:

        async def stream(requests: AsyncIterator[bytes], context: Any) -> None:
            # writes with context.write (as the health service's Watch does), never yields: grpc.aio
            # does not take both ways in one handler
            answer = handler.unary_stream(await request(requests, context), context)
            if inspect.isasyncgen(answer):
                async for item in answer:
                    await context.write(item)
            elif inspect.isawaitable(answer):
                await answer
            else:  # a synchronous generator
                for item in answer:
                    await context.write(item)

        return grpc.stream_stream_rpc_method_handler(
            stream, request_deserializer=None, response_serializer=handler.response_serializer
        )

    async def unary(requests: AsyncIterator[bytes], context: Any) -> Any:
        answer = handler.unary_unary(await request(requests, context), context)
        return await answer if inspect.isawaitable(answer) else answer

    return grpc.stream_unary_rpc_method_handler(
        unary, request_deserializer=None, response_serializer=handler.response_serializer
    )
