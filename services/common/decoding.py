"""Registering a servicer so that a request that is not a valid protobuf is the client's error.

`add_servicer(server, service, servicer)` (`service`: e.g. `engine_pb2.DESCRIPTOR.services_by_name
["Engine"]`) registers what the generated `add_*Servicer_to_server` does, with requests decoded here
instead of inside gRPC (which answers UNKNOWN naming the parser's exception: docs/reliability.md):

- a corrupt unary request is answered INVALID_ARGUMENT ("malformed request: ...");
- on a client stream, the request iterator the servicer reads ends at the corrupt message, as if the
  client had half-closed there, and the call's status is INVALID_ARGUMENT unless the servicer sets
  another (what the servicer does with the requests it read before is its own contract).
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc
from google.protobuf import message_factory
from google.protobuf.descriptor import MethodDescriptor, ServiceDescriptor
from google.protobuf.message import DecodeError, Message

Behavior = Callable[..., Any]
_HANDLERS = {  # (client streaming, server streaming) → gRPC's handler of that kind
    (False, False): grpc.unary_unary_rpc_method_handler,
    (False, True): grpc.unary_stream_rpc_method_handler,
    (True, False): grpc.stream_unary_rpc_method_handler,
    (True, True): grpc.stream_stream_rpc_method_handler,
}


def add_servicer(server: grpc.aio.Server, service: ServiceDescriptor, servicer: object) -> None:
    """Adds every method of `service` (the servicer's method of the same name) to `server`, its
    requests decoded as the module docstring says. Call before the server starts."""
    handlers = {method.name: _method_handler(method, getattr(servicer, method.name))
                for method in service.methods}  # fmt: skip
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service.full_name, handlers),))
    server.add_registered_method_handlers(service.full_name, handlers)


def malformed(exc: DecodeError) -> str:
    """The details of the INVALID_ARGUMENT answer to a request protobuf cannot parse."""
    return f"malformed request: {exc}"


def _method_handler(method: MethodDescriptor, behavior: Behavior) -> grpc.RpcMethodHandler:
    request_type = message_factory.GetMessageClass(method.input_type)
    serialize = message_factory.GetMessageClass(method.output_type).SerializeToString

    async def request(raw: Any, context: grpc.aio.ServicerContext) -> Any:
        """The decoded request, or the iterator of a client stream's decoded requests."""
        if method.client_streaming:
            return _decoded(raw, request_type, context)
        return await _decode(raw, request_type, context)

    async def unary(raw: Any, context: grpc.aio.ServicerContext) -> Any:
        return await behavior(await request(raw, context), context)

    async def stream(raw: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        # aclosing: when the call ends early, the servicer's own generator runs its cleanup at once.
        async with contextlib.aclosing(behavior(await request(raw, context), context)) as responses:
            async for response in responses:
                yield response

    make = _HANDLERS[method.client_streaming, method.server_streaming]
    return make(stream if method.server_streaming else unary, response_serializer=serialize)


async def _decode(raw: bytes, request_type: type[Message], context: grpc.aio.ServicerContext) -> Message:
    try:
        return request_type.FromString(raw)
    except DecodeError as exc:
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, malformed(exc))
        raise  # unreachable: abort raises


async def _decoded(
    raw_requests: AsyncIterator[bytes], request_type: type[Message], context: grpc.aio.ServicerContext
) -> AsyncIterator[Message]:
    """The messages of a client stream, up to the first corrupt one (which sets INVALID_ARGUMENT)."""
    async for raw in raw_requests:
        try:
            request = request_type.FromString(raw)
        except DecodeError as exc:
            context.set_code(grpc.StatusCode.INVALID_ARGUMENT)
            context.set_details(malformed(exc))
            return
        yield request
