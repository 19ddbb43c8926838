"""The public gRPC API, `sluice.v1.Gateway`: thin protobuf ↔ pipeline glue.

Cancelling the call (or the client going away) cancels the generation, which aborts the engine
request. The call's own deadline caps the gateway's request timeout. A request's own `request_id`,
when valid (`params.client_request_id`), is its id in the responses and its trace span; else the
gateway's id is.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import AsyncIterator

import grpc

from gateway import params
from gateway.auth import ApiKeys
from gateway.events import Delta, Done, GenerateInput
from gateway.params import ParamError
from gateway.pipeline import Pipeline
from gateway.settings import GatewaySettings
from gateway.structured import check_structured
from services.common import errors
from services.common.pb import common_pb2, gateway_pb2, gateway_pb2_grpc

log = logging.getLogger(__name__)


def generation_input(request: gateway_pb2.PublicGenerateRequest) -> GenerateInput:
    """The pipeline's input for a request, its sampling and stopping protobufs checked where they are
    by `params.proto_generation_params` (the rules of the other APIs; a protobuf 0 is the field's off
    or default, not a value; temperature 0 is greedy), its messages by `params.check_chat_message` and
    its output constraint by `structured.check_structured`. Raises ParamError on the first problem."""
    kind = request.WhichOneof("input")
    if kind is None:
        raise ParamError(None, "set 'prompt' or 'chat'")
    messages = None
    if kind == "chat":
        if not request.chat.messages:
            raise ParamError("chat.messages", "'chat' needs at least one message")
        messages = tuple(
            params.check_chat_message(m, f"chat.messages[{i}]") for i, m in enumerate(request.chat.messages)
        )
    if request.sampling.HasField("prompt_logprobs"):
        raise ParamError("sampling.prompt_logprobs", "'sampling.prompt_logprobs' is not supported here")
    sampling, stopping = params.proto_generation_params(request.sampling, request.stopping)
    sampling.structured.CopyFrom(check_structured(request.sampling.structured, "sampling.structured"))
    sampling.logprobs = params.logprobs(request.sampling.logprobs, "sampling.logprobs")
    return GenerateInput(
        prompt=request.prompt if kind == "prompt" else None,
        messages=messages,
        sampling=sampling,
        stopping=stopping,
        skip_special_tokens=request.skip_special_tokens if request.HasField("skip_special_tokens") else True,
        return_token_ids=request.return_token_ids,
        request_id=params.client_request_id(request.request_id) or "",
    )


class GatewayServicer(gateway_pb2_grpc.GatewayServicer):
    """With API keys on, a call needs `authorization: Bearer KEY` metadata (else UNAUTHENTICATED)."""

    def __init__(self, pipeline: Pipeline, settings: GatewaySettings, keys: ApiKeys) -> None:
        self._pipeline = pipeline
        self._settings = settings
        self._keys = keys

    async def Generate(
        self, request: gateway_pb2.PublicGenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[gateway_pb2.PublicGenerateResponse]:
        """Any failure of the gateway itself is INTERNAL "internal error" (the log has the details)."""
        try:
            async for response in self._generate(request, context):
                yield response
        except grpc.aio.AbortError:
            raise
        except Exception:
            log.exception("Generate failed")
            await context.abort(grpc.StatusCode.INTERNAL, "internal error")

    async def _generate(
        self, request: gateway_pb2.PublicGenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[gateway_pb2.PublicGenerateResponse]:
        if self._keys.enabled:
            metadata = dict(context.invocation_metadata() or ())
            if not self._keys.check_bearer(metadata.get("authorization")):
                await context.abort(
                    grpc.StatusCode.UNAUTHENTICATED, "a valid API key is needed: authorization: Bearer KEY"
                )
        try:
            inp = generation_input(request)
            asked = [inp.stopping.max_new_tokens]
            label = "stopping.max_new_tokens"
            cap, context_length = self._settings.max_request_tokens, self._pipeline.context_length
            await params.check_request_tokens(asked, cap, context_length, label)
        except ParamError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, exc.message)
        except grpc.aio.AioRpcError as exc:
            log.warning("model info failed: %s: %s", exc.code().name, exc.details())
            await context.abort(grpc.StatusCode.UNAVAILABLE, "tokenizer unavailable")
        # The trace context in metadata is the current span's (server interceptor).
        inp = dataclasses.replace(inp, timeout_s=context.time_remaining(), api="grpc")
        generation = self._pipeline.generate(inp)
        request_id = inp.request_id or generation.id
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
                        finish_reason=errors.FINISH_REASONS[event.finish_reason],
                        usage=common_pb2.Usage(
                            prompt_tokens=event.prompt_tokens,
                            completion_tokens=event.completion_tokens,
                            cached_tokens=event.cached_tokens,
                        ),
                        stop=event.stop,
                    )
                    yield gateway_pb2.PublicGenerateResponse(request_id=request_id, final=final)
                else:
                    status = errors.STATUS_CODES.get(event.code, grpc.StatusCode.INTERNAL)
                    await context.abort(status, event.message)
        finally:
            generation.cancel()
