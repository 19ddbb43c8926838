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
from typing import Any

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


def generation_input(request: gateway_pb2.PublicGenerateRequest, settings: GatewaySettings) -> GenerateInput:
    """The pipeline's input for a request, its sampling and stopping values checked by
    `params.generation_params` as the other APIs' are (a protobuf 0 is the field's off or default,
    not a value; temperature 0 is greedy), its messages by `params.check_chat_message` and its
    output constraint by `structured.check_structured`. Raises ParamError on the first problem."""
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
    sampling, stopping = params.generation_params(_generation_values(request), settings)
    sampling.structured.CopyFrom(check_structured(request.sampling.structured, "sampling.structured"))
    sampling.logprobs = params.logprobs(request.sampling.logprobs, "sampling.logprobs")
    stopping.include_stop_str_in_output = request.stopping.include_stop_str_in_output
    return GenerateInput(
        prompt=request.prompt if kind == "prompt" else None,
        messages=messages,
        sampling=sampling,
        stopping=stopping,
        skip_special_tokens=request.skip_special_tokens if request.HasField("skip_special_tokens") else True,
        return_token_ids=request.return_token_ids,
        request_id=params.client_request_id(request.request_id) or "",
    )


def _generation_values(request: gateway_pb2.PublicGenerateRequest) -> dict[str, Any]:
    """The request's sampling and stopping fields under the names `params.GENERATION_KEYS` uses."""
    s, t = request.sampling, request.stopping
    values: dict[str, Any] = {
        "temperature": s.temperature,
        "ignore_eos": t.ignore_eos,
        "stop": list(t.stop),
        "stop_token_ids": list(t.stop_token_ids),
    }
    unless_zero = {
        "top_p": s.top_p,
        "top_k": s.top_k,
        "min_p": s.min_p,
        "presence_penalty": s.presence_penalty,
        "frequency_penalty": s.frequency_penalty,
        "repetition_penalty": s.repetition_penalty,
        "max_tokens": t.max_new_tokens,
        "min_tokens": t.min_new_tokens,
    }
    values.update((name, value) for name, value in unless_zero.items() if value)  # NaN is kept: refused
    if s.HasField("seed"):
        values["seed"] = s.seed
    if s.logit_bias:
        values["logit_bias"] = dict(s.logit_bias)
    return values


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
            inp = generation_input(request, self._settings)
            asked = [inp.stopping.max_new_tokens]
            label = "stopping.max_new_tokens"
            await params.check_request_tokens(asked, self._settings, self._pipeline.max_model_len, label)
        except ParamError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, exc.message)
        except grpc.aio.AioRpcError as exc:
            log.warning("engine stats failed: %s: %s", exc.code().name, exc.details())
            await context.abort(grpc.StatusCode.UNAVAILABLE, "engine unavailable")
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
