"""gRPC servicer of the tokenizer: protobuf ↔ `TokenizerCore` jobs, run micro-batched off the loop."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

import grpc
from opentelemetry import trace

from services.common import telemetry
from services.common.batching import MicroBatcher
from services.common.metrics import TokenizerMetrics
from services.common.pb import common_pb2, tokenizer_pb2, tokenizer_pb2_grpc
from services.tokenizer.core import (
    Encoded,
    InvalidInput,
    TokenizeJob,
    TokenizerCore,
    Truncation,
    chat_message,
    parse_tools,
)

_SIDES = {
    tokenizer_pb2.TRUNCATION_SIDE_UNSPECIFIED: "",
    tokenizer_pb2.TRUNCATION_SIDE_LEFT: "left",
    tokenizer_pb2.TRUNCATION_SIDE_RIGHT: "right",
}


def _message(m: common_pb2.ChatMessage, where: str) -> dict[str, Any]:
    content = m.content if m.HasField("content") else None
    return chat_message(
        m.role,
        content,
        name=m.name,
        tool_call_id=m.tool_call_id,
        tool_calls_json=m.tool_calls_json,
        where=where,
    )


def job_from_request(request: tokenizer_pb2.TokenizeRequest) -> TokenizeJob:
    """Raises InvalidInput for a request that sets neither text nor chat, an unknown side, or
    malformed tools or tool calls."""
    side = _SIDES.get(request.truncation_side)
    if side is None:
        raise InvalidInput(f"unknown truncation_side {request.truncation_side}")
    truncation = Truncation(side=side, max_tokens=request.max_tokens)
    add_special = request.add_special_tokens if request.HasField("add_special_tokens") else True
    add_prompt = request.add_generation_prompt if request.HasField("add_generation_prompt") else True
    kind = request.WhichOneof("input")
    if kind == "chat":
        messages = [_message(m, f"chat.messages[{i}]") for i, m in enumerate(request.chat.messages)]
        return TokenizeJob(
            messages=messages,
            tools=parse_tools(request.tools_json),
            add_generation_prompt=add_prompt,
            truncation=truncation,
        )
    if kind == "text":
        return TokenizeJob(text=request.text, add_special_tokens=add_special, truncation=truncation)
    raise InvalidInput("empty input: set text or chat")


def _annotate(
    span: trace.Span, request: tokenizer_pb2.TokenizeRequest, result: Encoded | InvalidInput
) -> None:
    if not span.is_recording():
        return
    span.set_attribute("sluice.request_id", request.request_id)
    if isinstance(result, InvalidInput):
        span.set_status(trace.Status(trace.StatusCode.ERROR, str(result)))
    else:
        span.set_attribute("gen_ai.usage.input_tokens", len(result.ids))
        span.set_attribute("sluice.truncated", result.truncated)


def _response(
    request: tokenizer_pb2.TokenizeRequest, result: Encoded | InvalidInput
) -> tokenizer_pb2.TokenizeResponse:
    if isinstance(result, InvalidInput):
        return tokenizer_pb2.TokenizeResponse(request_id=request.request_id, error=str(result))
    return tokenizer_pb2.TokenizeResponse(
        request_id=request.request_id, ids=result.ids, truncated=result.truncated
    )


class TokenizerServicer(tokenizer_pb2_grpc.TokenizerServicer):
    def __init__(self, core: TokenizerCore, metrics: TokenizerMetrics, *, max_batch_size: int) -> None:
        self.core = core
        self.metrics = metrics
        self.tracer = telemetry.get_tracer(__name__)
        self.batcher: MicroBatcher[TokenizeJob, Encoded | InvalidInput] = MicroBatcher(
            self._tokenize_many, max_batch=max_batch_size, name="tokenize"
        )

    def _tokenize_many(self, jobs: list[TokenizeJob]) -> list[Encoded | InvalidInput]:
        self.metrics.batch_size.observe(len(jobs))
        return self.core.tokenize_many(jobs)

    async def _tokenize(self, request: tokenizer_pb2.TokenizeRequest) -> Encoded | InvalidInput:
        """Tokenizes one request (the current span, if any, gets its attributes)."""
        start = time.monotonic()
        try:
            job = job_from_request(request)
        except InvalidInput as exc:
            result: Encoded | InvalidInput = exc
        else:
            result = await self.batcher.run(job)
        self.metrics.duration.observe(time.monotonic() - start)
        _annotate(trace.get_current_span(), request, result)
        return result

    async def _tokenize_in_stream(self, request: tokenizer_pb2.TokenizeRequest) -> Encoded | InvalidInput:
        """One request of a TokenizeStream: its span continues the request's own trace context."""
        if not telemetry.tracing_enabled():
            return await self._tokenize(request)
        with self.tracer.start_as_current_span(
            "sluice.v1.Tokenizer/TokenizeStream",
            context=telemetry.extract(request.trace_context),
            kind=trace.SpanKind.SERVER,
        ):
            return await self._tokenize(request)

    async def Tokenize(
        self, request: tokenizer_pb2.TokenizeRequest, context: grpc.aio.ServicerContext
    ) -> tokenizer_pb2.TokenizeResponse:
        result = await self._tokenize(request)
        if isinstance(result, InvalidInput):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(result))
        return _response(request, result)

    async def TokenizeStream(
        self,
        request_iterator: AsyncIterator[tokenizer_pb2.TokenizeRequest],
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[tokenizer_pb2.TokenizeResponse]:
        """Every request is tokenized concurrently; answers come back as they are ready. A bad
        request gets a response with `error` set and the call goes on. When reading the requests
        fails, the call ends at once (its pending requests are dropped) with that failure."""
        done: asyncio.Queue[tokenizer_pb2.TokenizeResponse | None] = asyncio.Queue()
        tasks: set[asyncio.Task[None]] = set()

        async def one(request: tokenizer_pb2.TokenizeRequest) -> None:
            done.put_nowait(_response(request, await self._tokenize_in_stream(request)))

        async def read_all() -> None:
            try:
                async for request in request_iterator:
                    task = asyncio.create_task(one(request))
                    tasks.add(task)
                    task.add_done_callback(tasks.discard)
                await asyncio.gather(*tasks)
            finally:  # also when reading fails: the writer below must not wait forever
                done.put_nowait(None)

        reader = asyncio.create_task(read_all())
        try:
            while (response := await done.get()) is not None:
                yield response
            await reader
        finally:
            reader.cancel()
            for task in list(tasks):
                task.cancel()

    async def Info(
        self, request: tokenizer_pb2.InfoRequest, context: grpc.aio.ServicerContext
    ) -> tokenizer_pb2.InfoResponse:
        core = self.core
        return tokenizer_pb2.InfoResponse(
            model=core.model_name,
            vocab_size=core.vocab_size,
            context_length=core.context_length,
            special_tokens=[
                tokenizer_pb2.SpecialToken(name=t.name, text=t.text, id=t.id) for t in core.special_tokens
            ],
            eos_token_ids=core.eos_token_ids,
            has_chat_template=core.chat_template is not None,
            chat_template=core.chat_template or "",
            generation_prompt=core.generation_prompt,
        )

    def close(self) -> None:
        self.batcher.close()
