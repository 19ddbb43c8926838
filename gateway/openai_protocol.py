"""The OpenAI-compatible protocol, with no I/O: a completions or chat completions body parsed and
validated into the pipeline's inputs (`parse_request`), the response objects of its choices rendered
(`Renderer`: chunks, whole choices; chat replies split by `gateway.chat_output`), the usage, and the
error shape `{"error": {"message", "type", "param", "code"}}` with the HTTP status of each failure
(`ApiError`, `failure_error`). The handlers that read bodies, run generations and stream SSE are
`gateway.openai_api`; the token pieces a choice's logprobs show are looked up through the function it
is given (`Renderer.token_pieces`).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import grpc
from fastapi.responses import JSONResponse

from gateway import params
from gateway.chat_output import ChatDelta, ChatOutput, ChatParsers
from gateway.events import Delta, Done, Event, Failed, GenerateInput, TokenPiece
from gateway.params import ParamError
from gateway.settings import GatewaySettings
from gateway.structured import structured_output
from gateway.tool_parsers.base import ToolCallStream, merge
from gateway.tools import ToolRequest, tool_request
from services.common import errors
from services.common.pb import common_pb2

log = logging.getLogger(__name__)

# Scope key of a callable that drops the request's connection at once (`http_app.with_connection_drop`).
DROP_CONNECTION = "sluice.drop_connection"
# Scope key of the request's id: the client's valid `X-Request-Id`, else a fresh one (`http_app.RequestIds`).
REQUEST_ID = "sluice.request_id"


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


# A pipeline failure's code → the HTTP status, OpenAI error type and code of its answer.
_FAILURE_ANSWERS = {
    errors.INVALID_ARGUMENT: (400, "invalid_request_error", None),
    errors.RESOURCE_EXHAUSTED: (429, "rate_limit_error", "rate_limit_exceeded"),
    errors.UNAVAILABLE: (503, "service_unavailable", errors.UNAVAILABLE),
    errors.DEADLINE_EXCEEDED: (504, "timeout_error", errors.DEADLINE_EXCEEDED),
}


def failure_error(failure: Failed, settings: GatewaySettings) -> ApiError:
    """The HTTP answer to a pipeline failure (a 429 with `Retry-After`)."""
    status, kind, code = _FAILURE_ANSWERS.get(failure.code, (500, "server_error", "internal_error"))
    headers = {"Retry-After": str(settings.retry_after_s)} if status == 429 else None
    return ApiError(status, failure.message, type_=kind, code=code, headers=headers)


def decode_error(exc: grpc.aio.AioRpcError) -> ApiError:
    """The HTTP answer to a failed Decode call: 400 with the detokenizer's words for ids it refused,
    else 503."""
    if exc.code() == grpc.StatusCode.INVALID_ARGUMENT:
        return ApiError(400, f"detokenizer: {exc.details()}")
    return unavailable("detokenizer", "decode", exc)


def unavailable(stage: str, call: str, exc: grpc.aio.AioRpcError) -> ApiError:
    """The HTTP answer (503) to a `call` that failed on a `stage`; the log has the details (addresses
    included), the client only the stage's name."""
    log.warning("%s failed: %s: %s", call, exc.code().name, exc.details())
    return ApiError(503, f"{stage} unavailable", type_="service_unavailable", code="unavailable")


def pieces_failure(exc: grpc.aio.AioRpcError) -> Failed:
    """The failure of a request whose logprobs need token pieces that no detokenizer gave: the
    request ends (unavailable, or the detokenizer's own refusal), the other requests go on."""
    log.warning("token pieces failed: %s: %s", exc.code().name, exc.details())
    if exc.code() == grpc.StatusCode.INVALID_ARGUMENT:
        return Failed(errors.INVALID_ARGUMENT, f"detokenizer: {exc.details()}")
    return Failed(errors.UNAVAILABLE, "detokenizer unavailable")


def requested_model(body: dict[str, Any]) -> str | None:
    """The body's `model` (None when absent). Raises ParamError."""
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise ParamError("model", "'model' must be a string")
    return model


@dataclass(frozen=True)
class ParsedRequest:
    chat: bool
    inputs: tuple[GenerateInput, ...]  # one generation per choice, in the order of the choices' index
    model: str | None
    stream: bool
    include_usage: bool
    logprobs: int | None  # None = no logprobs; else how many top alternatives per token
    n: int = 1  # choices per prompt: choice i is prompt i // n
    echo: bool = False  # completions: each choice's text (and logprobs) starts with its prompt's
    scoring: bool = False  # completions' max_tokens 0: the prompt only (1 token generated, then dropped)
    tools: ToolRequest | None = None  # chat: the request's tools, None = none


def decode_json(body: bytes) -> dict[str, Any]:
    """`body` as a JSON object whose strings are all text. Raises ApiError 400."""
    try:
        parsed = params.parse_json(body)
        params.check_text(parsed)
    except ParamError as exc:
        raise ApiError(400, exc.message, param=exc.param) from None
    if not isinstance(parsed, dict):
        raise ApiError(400, "the body must be a JSON object")
    return parsed


def too_large(limit: int) -> ApiError:
    message = f"the request body is larger than {limit} bytes"
    return ApiError(413, message, code="request_too_large")


_UNSUPPORTED = ("functions", "function_call", "suffix")
# OpenAI chat fields the gateway does not implement: refused when given (not null), never ignored.
_UNSUPPORTED_CHAT = (
    "audio", "metadata", "modalities", "moderation", "prediction", "prompt_cache_key", "prompt_cache_options",
    "prompt_cache_retention", "reasoning_effort", "safety_identifier", "service_tier", "store", "verbosity",
    "web_search_options",
)  # fmt: skip


def kept_special_ids(parsed: ParsedRequest, parsers: ChatParsers) -> tuple[int, ...]:
    """The special tokens a chat reply's text keeps for its parsers (none for completions)."""
    if not parsed.chat:
        return ()
    return parsers.keep_special_ids(reads_calls=parsed.tools is not None and parsed.tools.parses_calls)


def chat_output(parsed: ParsedRequest, parsers: ChatParsers) -> ChatOutput | None:
    """A splitter of one chat choice's output (None for completions): reasoning when the model's
    parsers split it, tool calls when the request has tools and tool_choice is not none."""
    if not parsed.chat:
        return None
    reads_calls = parsed.tools is not None and parsed.tools.parses_calls
    return ChatOutput(
        reasoning=parsers.reasoning,
        in_reasoning=parsers.in_reasoning,
        tool_parser=parsers.tool_parser if reads_calls else None,
    )


def parse_request(
    body: dict[str, Any],
    settings: GatewaySettings,
    *,
    chat: bool,
    tool_format: type[ToolCallStream],
) -> ParsedRequest:
    """Validates a completions (chat=False) or chat completions body; a required tool call's grammar
    follows `tool_format` (the format of the tool-call parser in use, `ChatParsers.tool_format`), so
    that the parser reads the calls back. Raises ParamError."""
    for name in _UNSUPPORTED:
        if body.get(name):
            raise ParamError(name, f"'{name}' is not supported")
    for name in _UNSUPPORTED_CHAT if chat else ("tools", "tool_choice", "parallel_tool_calls"):
        if body.get(name) is not None:  # tools are chat's
            raise ParamError(name, f"'{name}' is not supported")
    if chat and body.get("echo"):
        raise ParamError("echo", "'echo' is not supported on chat completions")
    echo = not chat and bool(params.boolean(body, "echo"))
    n = params.choices_per_prompt(body)
    model = requested_model(body)
    user = body.get("user")
    if user is not None and not isinstance(user, str):
        raise ParamError("user", "'user' must be a string")
    stream = bool(params.boolean(body, "stream"))
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise ParamError("stream_options", "'stream_options' must be an object")
    include_usage = bool(params.boolean(options or {}, "include_usage", where="stream_options."))
    sources, logprobs = _parse_input(body, chat)
    params.check_generations(len(sources) * n, settings.max_generations)
    scoring = params.scoring_only(body, echo) if not chat else False
    sampling, stopping = _sampling_and_stopping(body, settings, chat, scoring)
    if logprobs is not None:
        sampling.logprobs = max(1, logprobs)  # the sampled token's own logprob needs one
        if echo:
            sampling.prompt_logprobs = logprobs
    tools = _constraints(body, sampling, chat, tool_format)
    extra = {"tools_json": tools.tools_json() if tools else "", "user": user or ""}
    sources = [dataclasses.replace(source, **extra) for source in sources]
    inputs = _choice_inputs(sources, sampling, stopping, n)
    return ParsedRequest(chat, inputs, model, stream, include_usage, logprobs, n, echo, scoring, tools)


def _constraints(
    body: dict[str, Any],
    sampling: common_pb2.SamplingParams,
    chat: bool,
    tool_format: type[ToolCallStream],
) -> ToolRequest | None:
    """The output constraint (`structured.structured_output`, or the grammar of a chat request whose
    tool_choice requires a call) set on `sampling`; returns the chat request's tools. Raises
    ParamError, naming both fields when a required tool call and a response format both constrain."""
    constraint = structured_output(body)
    tools = tool_request(body) if chat else None
    grammar = tools.grammar(tool_format) if tools is not None else None
    if grammar is not None and constraint is not None:
        raise ParamError(constraint[0], f"tool_choice (a required call) and {constraint[0]} both constrain "
                         "the output: give at most one")  # fmt: skip
    if grammar is not None:
        sampling.structured.kind, sampling.structured.text = grammar
    elif constraint is not None:
        sampling.structured.CopyFrom(constraint[1])
    return tools


def _parse_input(body: dict[str, Any], chat: bool) -> tuple[list[GenerateInput], int | None]:
    """One input per prompt (chat: the one conversation) and the logprobs asked for."""
    if chat:
        if "messages" not in body:
            raise ParamError("messages", "'messages' is required")
        messages = params.chat_messages(body["messages"], "messages")
        want = params.boolean(body, "logprobs")
        top = params.integer(body, "top_logprobs", 0, params.MAX_LOGPROBS)
        if top is not None and not want:
            raise ParamError("top_logprobs", "'top_logprobs' needs 'logprobs': true")
        return [GenerateInput(messages=messages)], (top or 0) if want else None
    prompts = [
        GenerateInput(prompt=p) if isinstance(p, str) else GenerateInput(prompt_ids=p)
        for p in params.completion_prompts(body.get("prompt"))
    ]
    return prompts, params.integer(body, "logprobs", 0, params.MAX_LOGPROBS_COMPLETIONS)


def _sampling_and_stopping(
    body: dict[str, Any], settings: GatewaySettings, chat: bool, scoring: bool
) -> tuple[common_pb2.SamplingParams, common_pb2.StoppingParams]:
    values = {name: body[name] for name in params.GENERATION_KEYS if name in body}
    if chat:  # the newer name wins
        newer = params.integer(body, "max_completion_tokens", 1, params.MAX_INT32)
        if newer is not None:
            values["max_tokens"] = newer
    if scoring:  # the engine emits at least one token: it is dropped
        values["max_tokens"] = 1
    return params.generation_params(values, settings.default_temperature)


def _choice_inputs(
    sources: list[GenerateInput],
    sampling: common_pb2.SamplingParams,
    stopping: common_pb2.StoppingParams,
    n: int,
) -> tuple[GenerateInput, ...]:
    """`n` inputs per source, in order; with a seed, the i-th of each source samples with seed + i."""
    inputs = []
    for source in sources:
        for i in range(n):
            own = common_pb2.SamplingParams()
            own.CopyFrom(sampling)
            if sampling.HasField("seed"):
                own.seed = (sampling.seed + i) % (params.MAX_SEED + 1)
            inputs.append(dataclasses.replace(source, sampling=own, stopping=stopping))
    return tuple(inputs)


# One step of a choice's output: what it shows (completions: its text as content), its logprobs, its
# finish reason (None until the last).
Part = tuple[ChatDelta, dict[str, Any] | None, str | None]


@dataclass
class Renderer:
    """Builds OpenAI response objects for one choice of a request. `echo` is the text that starts the
    choice's text (completions' `echo`: its prompt), "" for none."""

    parsed: ParsedRequest
    token_pieces: Callable[[list[int]], Awaitable[list[TokenPiece]]]  # each id's text and bytes
    request_id: str
    model: str
    created: int
    index: int = 0
    echo: str = ""
    output: ChatOutput | None = None  # chat: splits reasoning and tool calls out of the text
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

    def text(self, delta: Delta | None) -> str:
        """The choice's text for `delta` (None: the choice's end): the echoed prompt first, once; no
        generated text when scoring only."""
        text = "" if delta is None or self.parsed.scoring else delta.text
        echo, self.echo = self.echo, ""
        return echo + text

    def finish(self, done: Done) -> str:
        """The choice's finish reason: "length" when scoring only (its one token dropped)."""
        return "length" if self.parsed.scoring else done.finish_reason

    async def logprobs(self, delta: Delta) -> dict[str, Any] | None:
        """OpenAI logprobs for the tokens of `delta` (None when not asked for): the prompt's first
        (with no logprob, as OpenAI gives it) when `delta` brings the prompt's, then the generated."""
        top_n = self.parsed.logprobs
        if top_n is None:
            return None
        entries: list[tuple[int, common_pb2.TokenLogprob | None]] = []
        if delta.prompt_ids:
            entries.append((delta.prompt_ids[0], None))
            entries.extend(zip(delta.prompt_ids[1:], delta.prompt_logprobs, strict=False))
        if not self.parsed.scoring:
            entries.extend(zip(delta.token_ids, delta.logprobs, strict=False))
        top_ids = [list(e.top_token_ids[:top_n]) if e is not None else [] for _, e in entries]
        pieces = await self.token_pieces([i for i, _ in entries] + [i for row in top_ids for i in row])
        own, rest = pieces[: len(entries)], pieces[len(entries) :]
        tops: list[list[tuple[TokenPiece, float]]] = []
        for (_, entry), row in zip(entries, top_ids, strict=True):
            top_logprobs = entry.top_logprobs[: len(row)] if entry is not None else []
            tops.append(list(zip(rest[: len(row)], top_logprobs, strict=True)))
            rest = rest[len(row) :]
        if self.parsed.chat:
            content = [
                {
                    "token": piece.text,
                    "logprob": entry.logprob if entry is not None else None,
                    "bytes": list(piece.data),
                    "top_logprobs": [
                        {"token": t.text, "logprob": lp, "bytes": list(t.data)} for t, lp in top
                    ],
                }
                for piece, (_, entry), top in zip(own, entries, tops, strict=True)
            ]
            return {"content": content}
        offsets = []
        for piece in own:
            offsets.append(self.text_offset)
            self.text_offset += len(piece.text)
        return {
            "tokens": [piece.text for piece in own],
            "token_logprobs": [e.logprob if e is not None else None for _, e in entries],
            "top_logprobs": [
                {t.text: lp for t, lp in top} if e is not None else None
                for (_, e), top in zip(entries, tops, strict=True)
            ],
            "text_offset": offsets,
        }

    async def on_delta(self, delta: Delta) -> list[Part]:
        """The parts of the choice a delta brings: none while it shows nothing (text held back)."""
        text, logprobs = self.text(delta), await self.logprobs(delta)
        out = ChatDelta(text) if self.output is None else self.output.feed(text)
        return [(out, logprobs, None)] if out or logprobs else []

    def on_done(self, done: Done) -> list[Part]:
        """The parts that end the choice: completions, the rest of the text (an echo not yet given)
        with the finish reason; chat, what the chat output held back, if any, then the finish reason."""
        if self.output is None:
            return [(ChatDelta(self.text(None)), None, self.finish(done))]
        held = self.output.finish()
        last: Part = (ChatDelta(), None, self.output.finish_reason(done.finish_reason))
        return [(held, None, None), last] if held else [last]

    def chunk(self, part: Part) -> dict[str, Any]:
        """A part as a streamed chunk: chat, the delta's reasoning_content, content and tool_calls,
        those not empty."""
        out, logprobs, finish_reason = part
        if self.output is None:
            return self.envelope([self.choice("text", out.content, logprobs, finish_reason)])
        delta: dict[str, Any] = {}
        if out.reasoning:
            delta["reasoning_content"] = out.reasoning
        if out.content:
            delta["content"] = out.content
        if out.tool_calls:
            delta["tool_calls"] = [call.to_openai() for call in out.tool_calls]
        return self.envelope([self.choice("delta", delta, logprobs, finish_reason)])

    def whole_choice(self, parts: list[Part]) -> dict[str, Any]:
        """The whole choice, the fold of its parts. Chat: content null when it is empty and there are
        tool calls; reasoning_content with the reasoning parser on; tool_calls when there are calls."""
        content, calls = merge(out for out, _, _ in parts)
        logprobs = None
        if self.parsed.logprobs is not None:
            logprobs = _merge_logprobs([lp for _, lp, _ in parts if lp is not None], self.parsed.chat)
        finish_reason = parts[-1][2]
        if self.output is None:
            return self.choice("text", content, logprobs, finish_reason)
        message: dict[str, Any] = {"role": "assistant", "content": content or (None if calls else "")}
        if self.output.splits_reasoning:
            message["reasoning_content"] = "".join(out.reasoning for out, _, _ in parts) or None
        if calls:
            message["tool_calls"] = [call.to_openai() for call in calls]
        return self.choice("message", message, logprobs, finish_reason)

    def choice(
        self, key: str, value: Any, logprobs: dict[str, Any] | None, reason: str | None
    ) -> dict[str, Any]:
        """A choice object: its `text`, `delta` or `message` under `key`."""
        return {"index": self.index, key: value, "logprobs": logprobs, "finish_reason": reason}


def usage(ends: list[Done | None], parsed: ParsedRequest) -> dict[str, Any]:
    """The usage of a request's choices, every one ended: completion tokens summed over every choice
    (none when scoring only); prompt and cached tokens once per prompt, those of its first choice."""
    every = [end for end in ends if end is not None]
    assert len(every) == len(ends), "every choice ended"
    firsts = every[:: parsed.n]
    prompt_tokens = sum(done.prompt_tokens for done in firsts)
    completion_tokens = 0 if parsed.scoring else sum(done.completion_tokens for done in every)
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": sum(done.cached_tokens for done in firsts)},
    }


def as_failure(event: Event) -> Failed | None:
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
