"""The public gRPC API, `sluice.v1.Gateway`: thin protobuf ↔ pipeline glue.

Cancelling the call (or the client going away) cancels the generation, which aborts the engine
request. The call's own deadline caps the gateway's request timeout.
"""

from __future__ import annotations

import math
from collections.abc import AsyncIterator

import grpc

from gateway import params
from gateway import pipeline as pl
from gateway.auth import ApiKeys
from gateway.params import ParamError
from gateway.pipeline import Delta, Done, GenerateInput, Pipeline
from services.common.pb import common_pb2, gateway_pb2, gateway_pb2_grpc

MAX_LOGPROBS = 20

_STATUS = {
    pl.INVALID_ARGUMENT: grpc.StatusCode.INVALID_ARGUMENT,
    pl.RESOURCE_EXHAUSTED: grpc.StatusCode.RESOURCE_EXHAUSTED,
    pl.UNAVAILABLE: grpc.StatusCode.UNAVAILABLE,
    pl.DEADLINE_EXCEEDED: grpc.StatusCode.DEADLINE_EXCEEDED,
    pl.INTERNAL: grpc.StatusCode.INTERNAL,
}

_FINISH = {
    "stop": common_pb2.FINISH_REASON_STOP,
    "length": common_pb2.FINISH_REASON_LENGTH,
    "cancelled": common_pb2.FINISH_REASON_CANCELLED,
}


def validate(request: gateway_pb2.PublicGenerateRequest) -> str | None:
    """The first problem with a request, or None."""
    kind = request.WhichOneof("input")
    if kind is None:
        return "set 'prompt' or 'chat'"
    if kind == "chat":
        if not request.chat.messages:
            return "'chat' needs at least one message"
        for i, message in enumerate(request.chat.messages):
            try:
                params.chat_role(message.role, f"chat.messages[{i}]")
            except ParamError as exc:
                return exc.message
    s = request.sampling
    for name in (
        "temperature",
        "top_p",
        "min_p",
        "presence_penalty",
        "frequency_penalty",
        "repetition_penalty",
    ):
        if not math.isfinite(getattr(s, name)):
            return f"sampling.{name} must be finite"
    if s.temperature < 0:
        return "sampling.temperature must be >= 0"
    if not 0 <= s.top_p <= 1 or not 0 <= s.min_p <= 1:
        return "sampling.top_p and sampling.min_p must be between 0 and 1"
    if s.top_k < 0:
        return "sampling.top_k must be >= 0"
    if s.repetition_penalty < 0:
        return "sampling.repetition_penalty must be >= 0"
    if s.logprobs > MAX_LOGPROBS:
        return f"sampling.logprobs must be at most {MAX_LOGPROBS}"
    if any(not stop for stop in request.stopping.stop):
        return "stop strings must not be empty"
    return None


class GatewayServicer(gateway_pb2_grpc.GatewayServicer):
    """With API keys on, a call needs `authorization: Bearer KEY` metadata (else UNAUTHENTICATED)."""

    def __init__(self, pipeline: Pipeline, keys: ApiKeys) -> None:
        self._pipeline = pipeline
        self._keys = keys

    async def Generate(
        self, request: gateway_pb2.PublicGenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[gateway_pb2.PublicGenerateResponse]:
        if self._keys.enabled:
            metadata = dict(context.invocation_metadata() or ())
            if not self._keys.check_bearer(metadata.get("authorization")):
                await context.abort(
                    grpc.StatusCode.UNAUTHENTICATED, "a valid API key is needed: authorization: Bearer KEY"
                )
        problem = validate(request)
        if problem is not None:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, problem)
        inp = GenerateInput(
            prompt=request.prompt if request.WhichOneof("input") == "prompt" else None,
            messages=tuple((m.role, m.content) for m in request.chat.messages)
            if request.WhichOneof("input") == "chat"
            else None,
            sampling=request.sampling,
            stopping=request.stopping,
            skip_special_tokens=request.skip_special_tokens
            if request.HasField("skip_special_tokens")
            else True,
            return_token_ids=request.return_token_ids,
            timeout_s=context.time_remaining(),
            api="grpc",  # the trace context in metadata is the current span's (server interceptor)
        )
        generation = self._pipeline.generate(inp)
        request_id = request.request_id or generation.id
        with_ids, with_logprobs = request.return_token_ids, request.sampling.logprobs > 0
        try:
            async for event in generation:
                if isinstance(event, Delta):
                    delta = gateway_pb2.GenerateDelta(
                        text=event.text,
                        token_ids=event.token_ids if with_ids else [],
                        logprobs=event.logprobs if with_logprobs else [],
                    )
                    yield gateway_pb2.PublicGenerateResponse(request_id=request_id, delta=delta)
                elif isinstance(event, Done):
                    final = gateway_pb2.GenerateFinal(
                        finish_reason=_FINISH[event.finish_reason],
                        usage=common_pb2.Usage(
                            prompt_tokens=event.prompt_tokens, completion_tokens=event.completion_tokens
                        ),
                        stop=event.stop,
                    )
                    yield gateway_pb2.PublicGenerateResponse(request_id=request_id, final=final)
                else:
                    await context.abort(_STATUS.get(event.code, grpc.StatusCode.INTERNAL), event.message)
        finally:
            generation.cancel()
