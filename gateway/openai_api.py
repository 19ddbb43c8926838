"""OpenAI-compatible HTTP API: `POST /v1/completions`, `POST /v1/chat/completions` (streaming as SSE
or not), and the error shape `{"error": {"message", "type", "param", "code"}}`.

A streaming request waits up to `sse_keepalive_s` for its first event before it answers: a request
refused at once (admission, bad prompt) gets a proper HTTP status; a slow one gets 200 and keep-alive
comments. A client that disconnects, streaming or not, cancels its generation. Events are framed by
`fastapi.sse`; a stream whose client stops reading (one write blocked for `send_timeout_s`) is cut
off: its generation cancelled and its connection dropped, so it holds at most the socket's buffers.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import grpc
from fastapi import Request
from fastapi.responses import JSONResponse
from fastapi.sse import EventSourceResponse, format_sse_event
from starlette.background import BackgroundTask
from starlette.types import Receive, Scope, Send

from gateway import params
from gateway.chat_output import ChatDelta, ChatOutput
from gateway.events import Delta, Done, Event, Failed, GenerateInput, Generation, TokenPiece
from gateway.observability import trace_context_from
from gateway.params import ParamError
from gateway.pipeline import Pipeline
from gateway.settings import GatewaySettings
from gateway.structured import structured_output
from gateway.tool_calls import ToolRequest, tool_request
from services.common import errors
from services.common.pb import common_pb2

log = logging.getLogger(__name__)

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
# Scope key of a callable that drops the request's connection at once (`http_app.with_connection_drop`).
DROP_CONNECTION = "sluice.drop_connection"


class ApiError(Exception):
    """An error answered as OpenAI-style JSON with an HTTP status."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type_: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def failure_error(failure: Failed, settings: GatewaySettings) -> ApiError:
    """The HTTP answer to a pipeline failure."""
    if failure.code == errors.INVALID_ARGUMENT:
        return ApiError(400, failure.message)
    if failure.code == errors.RESOURCE_EXHAUSTED:
        headers = {"Retry-After": str(settings.retry_after_s)}
        return ApiError(
            429, failure.message, type_="rate_limit_error", code="rate_limit_exceeded", headers=headers
        )
    if failure.code == errors.UNAVAILABLE:
        return ApiError(503, failure.message, type_="service_unavailable", code=failure.code)
    if failure.code == errors.DEADLINE_EXCEEDED:
        return ApiError(504, failure.message, type_="timeout_error", code=failure.code)
    return ApiError(500, failure.message, type_="server_error", code="internal_error")


@dataclass(frozen=True)
class ParsedRequest:
    chat: bool
    input: GenerateInput
    model: str | None
    stream: bool
    include_usage: bool
    logprobs: int | None  # None = no logprobs; else how many top alternatives per token
    tools: ToolRequest | None = None  # chat: the request's tools, None = none


async def read_json(request: Request, limit: int) -> dict[str, Any]:
    """The request body as a JSON object whose strings are all text (`params.check_text`). Raises
    ApiError: 413 for a body over `limit` bytes, from its Content-Length before reading any of it (or
    once the bytes read pass `limit` when it has none); 400 for anything else."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise _too_large(limit)
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise _too_large(limit)
    try:
        parsed = params.parse_json(body)
        params.check_text(parsed)
    except ParamError as exc:
        raise ApiError(400, exc.message, param=exc.param) from None
    if not isinstance(parsed, dict):
        raise ApiError(400, "the body must be a JSON object")
    return parsed


def _too_large(limit: int) -> ApiError:
    message = f"the request body is larger than {limit} bytes"
    return ApiError(413, message, code="request_too_large")


_UNSUPPORTED = ("functions", "function_call", "logit_bias", "suffix")
# OpenAI chat fields the gateway does not implement: refused when given (not null), never ignored.
_UNSUPPORTED_CHAT = (
    "audio", "metadata", "modalities", "moderation", "prediction", "prompt_cache_key", "prompt_cache_options",
    "prompt_cache_retention", "reasoning_effort", "safety_identifier", "service_tier", "store", "verbosity",
    "web_search_options",
)  # fmt: skip


def parse_request(body: dict[str, Any], settings: GatewaySettings, *, chat: bool) -> ParsedRequest:
    """Validates a completions (chat=False) or chat completions body. Raises ParamError."""
    for name in _UNSUPPORTED:
        if body.get(name):
            raise ParamError(name, f"'{name}' is not supported")
    _refuse_unsupported(body, chat)
    if body.get("echo"):
        raise ParamError("echo", "'echo' is not supported")
    n = params.integer(body, "n", 1, params.MAX_INT32)
    if n not in (None, 1):
        raise ParamError("n", "only n = 1 is supported")
    best_of = params.integer(body, "best_of", 1, params.MAX_INT32)
    if best_of not in (None, 1):
        raise ParamError("best_of", "only best_of = 1 is supported")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise ParamError("model", "'model' must be a string")
    user = body.get("user")
    if user is not None and not isinstance(user, str):
        raise ParamError("user", "'user' must be a string")
    stream = bool(params.boolean(body, "stream"))
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise ParamError("stream_options", "'stream_options' must be an object")
    include_usage = bool(params.boolean(options or {}, "include_usage", where="stream_options."))
    prompt, messages, logprobs = _parse_input(body, chat)
    sampling, stopping = _sampling_and_stopping(body, settings, chat)
    if logprobs is not None:
        sampling.logprobs = max(1, logprobs)  # the sampled token's own logprob needs one
    tools = _constraints(body, sampling, chat)
    inp = GenerateInput(prompt=prompt, messages=messages, sampling=sampling, stopping=stopping,
                        tools_json=tools.tools_json() if tools else "", user=user or "")  # fmt: skip
    return ParsedRequest(chat, inp, model, stream, include_usage, logprobs, tools)


def _refuse_unsupported(body: dict[str, Any], chat: bool) -> None:
    """Fields the gateway does not implement, refused when given: OpenAI chat's (`_UNSUPPORTED_CHAT`),
    and tools on completions."""
    for name in _UNSUPPORTED_CHAT if chat else ("tools", "tool_choice", "parallel_tool_calls"):
        if body.get(name) is not None:
            raise ParamError(name, f"'{name}' is not supported")


def _constraints(body: dict[str, Any], sampling: common_pb2.SamplingParams, chat: bool) -> ToolRequest | None:
    """The output constraint (`structured.structured_output`, or the grammar of a chat request whose
    tool_choice requires a call) set on `sampling`; returns the chat request's tools. Raises
    ParamError, naming both fields when a required tool call and a response format both constrain."""
    constraint = structured_output(body)
    tools = tool_request(body) if chat else None
    grammar = tools.grammar() if tools is not None else None
    if grammar is not None and constraint is not None:
        raise ParamError(constraint[0], f"tool_choice (a required call) and {constraint[0]} both constrain "
                         "the output: give at most one")  # fmt: skip
    if grammar is not None:
        sampling.structured.kind, sampling.structured.text = grammar
    elif constraint is not None:
        sampling.structured.CopyFrom(constraint[1])
    return tools


def _parse_input(
    body: dict[str, Any], chat: bool
) -> tuple[str | None, tuple[common_pb2.ChatMessage, ...] | None, int | None]:
    if chat:
        if "messages" not in body:
            raise ParamError("messages", "'messages' is required")
        messages = params.chat_messages(body["messages"], "messages")
        want = params.boolean(body, "logprobs")
        top = params.integer(body, "top_logprobs", 0, params.MAX_LOGPROBS)
        if top is not None and not want:
            raise ParamError("top_logprobs", "'top_logprobs' needs 'logprobs': true")
        return None, messages, (top or 0) if want else None
    raw = body.get("prompt")
    if isinstance(raw, list) and len(raw) == 1 and isinstance(raw[0], str):
        raw = raw[0]
    if not isinstance(raw, str):
        raise ParamError("prompt", "'prompt' must be a string (or a list of one string)")
    return raw, None, params.integer(body, "logprobs", 0, params.MAX_LOGPROBS_COMPLETIONS)


def _sampling_and_stopping(
    body: dict[str, Any], settings: GatewaySettings, chat: bool
) -> tuple[common_pb2.SamplingParams, common_pb2.StoppingParams]:
    values = {name: body[name] for name in params.GENERATION_KEYS if name in body}
    if chat:  # the newer name wins
        newer = params.integer(body, "max_completion_tokens", 1, params.MAX_INT32)
        if newer is not None:
            values["max_tokens"] = newer
    return params.generation_params(values, settings)


@dataclass
class _Renderer:
    """Builds OpenAI response objects for one request."""

    parsed: ParsedRequest
    pipeline: Pipeline
    request_id: str
    model: str
    output: ChatOutput | None = None  # chat: splits reasoning and tool calls out of the text
    created: int = field(default_factory=lambda: int(time.time()))
    text_offset: int = 0

    @property
    def object_name(self) -> str:
        if self.parsed.chat:
            return "chat.completion.chunk" if self.parsed.stream else "chat.completion"
        return "text_completion"

    def envelope(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        body: dict[str, Any] = {
            "id": self.request_id,
            "object": self.object_name,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }
        if self.parsed.stream and self.parsed.include_usage:
            body["usage"] = None
        return body

    async def logprobs(self, delta: Delta) -> dict[str, Any] | None:
        """OpenAI logprobs for the tokens of `delta` (None when not asked for)."""
        top_n = self.parsed.logprobs
        if top_n is None:
            return None
        entries = delta.logprobs[: len(delta.token_ids)]
        ids = list(delta.token_ids[: len(entries)])
        top_ids = [list(e.top_token_ids[:top_n]) for e in entries]
        pieces = await self.pipeline.token_pieces(ids + [i for row in top_ids for i in row])
        own, rest = pieces[: len(ids)], pieces[len(ids) :]
        tops: list[list[tuple[TokenPiece, float]]] = []
        for entry, row in zip(entries, top_ids, strict=True):
            tops.append(list(zip(rest[: len(row)], entry.top_logprobs[: len(row)], strict=True)))
            rest = rest[len(row) :]
        if self.parsed.chat:
            content = [
                {
                    "token": piece.text,
                    "logprob": entry.logprob,
                    "bytes": list(piece.data),
                    "top_logprobs": [
                        {"token": t.text, "logprob": lp, "bytes": list(t.data)} for t, lp in top
                    ],
                }
                for piece, entry, top in zip(own, entries, tops, strict=True)
            ]
            return {"content": content}
        token_texts = [piece.text for piece in own]
        offsets = []
        for text in token_texts:
            offsets.append(self.text_offset)
            self.text_offset += len(text)
        return {
            "tokens": token_texts,
            "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": [{t.text: lp for t, lp in top} for top in tops],
            "text_offset": offsets,
        }

    def choice(self, text: str, logprobs: dict[str, Any] | None, finish_reason: str | None) -> dict[str, Any]:
        """A completions choice."""
        return {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}

    def chat_chunk(
        self, out: ChatDelta, logprobs: dict[str, Any] | None, finish_reason: str | None
    ) -> dict[str, Any]:
        """A streamed chat choice: the delta's reasoning_content, content and tool_calls, those not empty."""
        delta: dict[str, Any] = {}
        if out.reasoning:
            delta["reasoning_content"] = out.reasoning
        if out.content:
            delta["content"] = out.content
        if out.tool_calls:
            delta["tool_calls"] = [call.to_openai() for call in out.tool_calls]
        return {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}

    async def chunk(self, event: Delta) -> dict[str, Any] | None:
        """The streamed chunk of a delta, or None when it has nothing to show yet (text held back)."""
        logprobs = await self.logprobs(event)
        if self.output is None:
            choice = self.choice(event.text, logprobs, None) if event.text or logprobs else None
        else:
            out = self.output.feed(event.text)
            choice = self.chat_chunk(out, logprobs, None) if out or logprobs else None
        return None if choice is None else self.envelope([choice])

    def last_chunks(self, finish_reason: str) -> list[dict[str, Any]]:
        """The chunks that end a stream: what the chat output held back, if any, then the finish reason."""
        if self.output is None:
            return [self.envelope([self.choice("", None, finish_reason)])]
        held = self.output.finish()
        reason = self.output.finish_reason(finish_reason)
        chunks = [self.chat_chunk(held, None, None)] if held else []
        return [self.envelope([c]) for c in [*chunks, self.chat_chunk(ChatDelta(), None, reason)]]

    def chat_choice(self, text: str, logprobs: dict[str, Any] | None, finish_reason: str) -> dict[str, Any]:
        """The whole chat choice for the generated `text`: content null when it is empty and there
        are tool calls; reasoning_content with the reasoning parser on; tool_calls when there are
        calls; finish_reason `tool_calls` for an output that ended with calls."""
        assert self.output is not None
        reasoning, content, calls = self.output.parse(text)
        message: dict[str, Any] = {"role": "assistant", "content": content or (None if calls else "")}
        if self.output.splits_reasoning:
            message["reasoning_content"] = reasoning or None
        if calls:
            message["tool_calls"] = [call.to_openai() for call in calls]
        reason = self.output.finish_reason(finish_reason)
        return {"index": 0, "message": message, "logprobs": logprobs, "finish_reason": reason}


def _usage(done: Done) -> dict[str, int]:
    return {
        "prompt_tokens": done.prompt_tokens,
        "completion_tokens": done.completion_tokens,
        "total_tokens": done.prompt_tokens + done.completion_tokens,
    }


def _as_failure(event: Event) -> Failed | None:
    """Failures, and cancellations the client did not ask for (the server stopped the request)."""
    if isinstance(event, Failed):
        return event
    if isinstance(event, Done) and event.finish_reason == "cancelled":
        return Failed(errors.UNAVAILABLE, "the request was cancelled by the server")
    return None


def _merge_logprobs(parts: list[dict[str, Any]], chat: bool) -> dict[str, Any]:
    if chat:
        return {"content": [item for part in parts for item in part["content"]]}
    return {
        key: [v for part in parts for v in part[key]]
        for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset")
    }


class OpenAIHandlers:
    """The two generation endpoints; routes are added by `http_app`."""

    def __init__(self, pipeline: Pipeline, settings: GatewaySettings) -> None:
        self._pipeline = pipeline
        self._settings = settings

    async def handle(self, request: Request, *, chat: bool) -> JSONResponse | EventSourceResponse:
        body = await read_json(request, self._settings.max_body_bytes)
        try:
            parsed = parse_request(body, self._settings, chat=chat)
        except ParamError as exc:
            raise ApiError(400, exc.message, param=exc.param) from None
        model = await self.model_name(parsed.model)
        inp = dataclasses.replace(parsed.input, api="chat" if chat else "completions",
                                  trace_context=trace_context_from(request.headers.get))
        generation = self._pipeline.generate(inp)
        prefix = "chatcmpl-" if chat else "cmpl-"
        renderer = _Renderer(parsed, self._pipeline, prefix + generation.id, model, self._chat_output(parsed))
        if parsed.stream:
            return await self._stream(request, generation, renderer)
        return await self._complete(request, generation, renderer)

    def _chat_output(self, parsed: ParsedRequest) -> ChatOutput | None:
        """The splitter of a chat request's output (None for completions): reasoning with
        `reasoning_parser` on, tool calls when the request has tools and tool_choice is not none."""
        if not parsed.chat:
            return None
        reads_calls = parsed.tools is not None and parsed.tools.parses_calls
        return ChatOutput(
            reasoning=self._settings.reasoning_parser == "think",
            tool_parser=self._settings.tool_call_parser if reads_calls else None,
        )

    async def model_name(self, asked: str | None) -> str:
        """The served model's name: `served_model_name`, else the tokenizer's (the model directory's
        name). Raises ApiError: 503 when the tokenizer cannot say, 404 when `asked` names another
        model."""
        served = self._settings.served_model_name
        if not served:
            try:
                served = (await self._pipeline.model_info()).model
            except grpc.aio.AioRpcError as exc:
                log.warning("model info from the tokenizer failed: %s: %s", exc.code().name, exc.details())
                message, kind = "tokenizer unavailable", "service_unavailable"
                raise ApiError(503, message, type_=kind, code="unavailable") from None
        if asked is not None and asked != served:
            raise ApiError(404, f"the model '{asked}' does not exist; this server serves '{served}'",
                           param="model", code="model_not_found")  # fmt: skip
        return served

    async def _complete(self, request: Request, generation: Generation, renderer: _Renderer) -> JSONResponse:
        watcher = asyncio.get_running_loop().create_task(_cancel_on_disconnect(request, generation))
        try:
            texts: list[str] = []
            logprob_parts: list[dict[str, Any]] = []
            async for event in generation:
                failure = _as_failure(event)
                if failure is not None:
                    return failure_error(failure, self._settings).response()
                if isinstance(event, Delta):
                    texts.append(event.text)
                    part = await renderer.logprobs(event)
                    if part is not None:
                        logprob_parts.append(part)
                    continue
                assert isinstance(event, Done)
                wanted = renderer.parsed.logprobs is not None
                logprobs = _merge_logprobs(logprob_parts, renderer.parsed.chat) if wanted else None
                if renderer.parsed.chat:
                    choice = renderer.chat_choice("".join(texts), logprobs, event.finish_reason)
                else:
                    choice = renderer.choice("".join(texts), logprobs, event.finish_reason)
                body = renderer.envelope([choice])
                body["usage"] = _usage(event)
                return JSONResponse(body)
            raise AssertionError("a generation always ends with a terminal event")
        finally:
            watcher.cancel()
            generation.cancel()

    async def _stream(
        self, request: Request, generation: Generation, renderer: _Renderer
    ) -> JSONResponse | EventSourceResponse:
        first: Event | None = None
        with contextlib.suppress(TimeoutError):
            first = await asyncio.wait_for(generation.next(), self._settings.sse_keepalive_s)
        failure = _as_failure(first) if first is not None else None
        if failure is not None:
            return failure_error(failure, self._settings).response()
        # The client's disconnect is heard even while no chunk is being written.
        watcher = asyncio.get_running_loop().create_task(_cancel_on_disconnect(request, generation))
        return _TimedEventSource(
            self._sse(first, generation, renderer, watcher),
            send_timeout_s=self._settings.send_timeout_s,
            on_timeout=generation.cancel,
            headers=SSE_HEADERS,
            background=BackgroundTask(generation.cancel),
        )

    async def _sse(
        self, first: Event | None, generation: Generation, renderer: _Renderer, watcher: asyncio.Task[None]
    ) -> AsyncIterator[bytes]:
        try:
            if renderer.parsed.chat:
                opening = {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                           "finish_reason": None}  # fmt: skip
                yield _sse_data(renderer.envelope([opening]))
            event = first
            while True:
                if event is None:
                    try:
                        event = await asyncio.wait_for(generation.next(), self._settings.sse_keepalive_s)
                    except TimeoutError:
                        yield KEEPALIVE
                        continue
                failure = _as_failure(event)
                if failure is not None:
                    yield _sse_data(failure_error(failure, self._settings).body())
                    break
                if isinstance(event, Delta):
                    chunk = await renderer.chunk(event)
                    if chunk is not None:
                        yield _sse_data(chunk)
                else:
                    assert isinstance(event, Done)
                    for chunk in renderer.last_chunks(event.finish_reason):
                        yield _sse_data(chunk)
                    if renderer.parsed.include_usage:
                        usage_chunk = renderer.envelope([])
                        usage_chunk["usage"] = _usage(event)
                        yield _sse_data(usage_chunk)
                    break
                event = None
            yield DONE
        finally:
            watcher.cancel()
            generation.cancel()


KEEPALIVE = format_sse_event(comment="keep-alive")
DONE = format_sse_event(data_str="[DONE]")


def _sse_data(obj: dict[str, Any]) -> bytes:
    return format_sse_event(data_str=json.dumps(obj, ensure_ascii=False, separators=(",", ":")))


class _TimedEventSource(EventSourceResponse):
    """An SSE response whose every write must complete within `send_timeout_s`. When one blocks
    longer (the client stopped reading), `on_timeout` runs (it cancels the generation), the event
    iterator is closed and the connection dropped: the stream ends instead of waiting on the client
    for as long as the generation would run."""

    def __init__(
        self,
        content: AsyncIterator[bytes],
        *,
        send_timeout_s: float,
        on_timeout: Callable[[], None],
        headers: dict[str, str],
        background: BackgroundTask,
    ) -> None:
        super().__init__(content, headers=headers, background=background)
        self._send_timeout_s = send_timeout_s
        self._on_timeout = on_timeout
        self._drop: Callable[[], None] | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        self._drop = scope.get(DROP_CONNECTION)
        await super().__call__(scope, receive, send)

    async def stream_response(self, send: Send) -> None:
        async def timed_send(message: Any) -> None:
            async with asyncio.timeout(self._send_timeout_s):
                await send(message)

        try:
            await super().stream_response(timed_send)
        except TimeoutError:
            log.warning("an SSE client stopped reading (a write blocked %gs): its generation is cancelled",
                        self._send_timeout_s)
            self._on_timeout()
            aclose = getattr(self.body_iterator, "aclose", None)
            if aclose is not None:
                await aclose()
            if self._drop is not None:
                self._drop()


async def _cancel_on_disconnect(request: Request, generation: Generation) -> None:
    """Cancels `generation` when the client goes away."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            generation.cancel()
            return
