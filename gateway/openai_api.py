"""OpenAI-compatible HTTP API handlers: `POST /v1/completions`, `POST /v1/chat/completions` (streaming
as SSE or not). What a body means and what the answers hold (parsing, rendering, usage, the error
shape) is `gateway.openai_protocol`; this module reads bodies, runs the generations and writes the
answers.

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
from typing import Any, TypeVar

import grpc
from fastapi import Request
from fastapi.responses import JSONResponse
from fastapi.sse import EventSourceResponse, format_sse_event
from starlette.background import BackgroundTask
from starlette.types import Receive, Scope, Send

from gateway import params
from gateway.chat_output import ChatParsers, chosen
from gateway.events import Delta, Done, Event, Failed, Generation
from gateway.observability import trace_context_from
from gateway.openai_protocol import (
    DROP_CONNECTION,
    REQUEST_ID,
    ApiError,
    ParsedRequest,
    Part,
    Renderer,
    as_failure,
    chat_output,
    decode_error,
    decode_json,
    failure_error,
    kept_special_ids,
    parse_request,
    pieces_failure,
    too_large,
    unavailable,
    usage,
)
from gateway.params import ParamError
from gateway.pipeline import Pipeline
from gateway.settings import GatewaySettings

log = logging.getLogger(__name__)

OFF_LOOP_BYTES = 64 * 1024  # a body larger than this is decoded and validated in a worker thread
T = TypeVar("T")
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


async def read_json(request: Request, limit: int) -> dict[str, Any]:
    """The request body as a JSON object whose strings are all text (`params.check_text`), decoded
    and checked off the event loop when it is larger than `OFF_LOOP_BYTES`. Raises ApiError: 413 for
    a body over `limit` bytes (`read_body`); 400 for anything else."""
    return await off_loop(await read_body(request, limit), decode_json)


async def read_body(request: Request, limit: int) -> bytes:
    """The request body. Raises ApiError 413 for a body over `limit` bytes, from its Content-Length
    before reading any of it (or once the bytes read pass `limit` when it has none)."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise too_large(limit)
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise too_large(limit)
    return bytes(body)


async def off_loop(body: bytes, work: Callable[[bytes], T]) -> T:
    """`work(body)`, in a worker thread when `body` is larger than `OFF_LOOP_BYTES`: decoding and
    validating megabytes (a large `tools` list) takes about a second of CPU, which on the event loop
    would stall every stream of the gateway (in a thread it shares the interpreter with them)."""
    if len(body) > OFF_LOOP_BYTES:
        return await asyncio.to_thread(work, body)
    return work(body)


class _Choices:
    """The generations of a request's choices read as one stream of (choice index, event), in the
    order events arrive (OpenAI interleaves the choices of a stream). At most one read per
    generation is pending, so the deltas of a slow client still merge in each generation's slot.
    `cancel()` cancels every generation."""

    def __init__(self, generations: list[Generation]) -> None:
        self._generations = generations
        self._reads: dict[asyncio.Future[Event], int] = {}
        self._ready: list[tuple[int, Event]] = []
        self.open = len(generations)  # choices whose terminal event was not returned yet
        for index in range(len(generations)):
            self._read(index)

    def _read(self, index: int) -> None:
        self._reads[asyncio.ensure_future(self._generations[index].next())] = index

    async def next(self) -> tuple[int, Event]:
        """The next event of any choice; only while `open`. Safe to cancel (a timeout loses nothing)."""
        assert self.open
        while not self._ready:
            done, _ = await asyncio.wait(self._reads, return_when=asyncio.FIRST_COMPLETED)
            for future in sorted(done, key=lambda f: self._reads[f]):
                index = self._reads.pop(future)
                event = future.result()
                self._ready.append((index, event))
                if isinstance(event, Delta):
                    self._read(index)
        index, event = self._ready.pop(0)
        if not isinstance(event, Delta):
            self.open -= 1
        return index, event

    def cancel(self) -> None:
        for generation in self._generations:
            generation.cancel()
        for future in self._reads:
            future.cancel()

    async def close(self) -> None:
        """`cancel()` as a coroutine function, for a response's background task: Starlette runs a plain
        function there in its worker-thread pool (a thread per concurrent stream, up to the pool's limit,
        touching the loop's futures from another thread); this runs on the event loop."""
        self.cancel()


class OpenAIHandlers:
    """The generation endpoints and the model list; routes are added by `http_app`."""

    def __init__(self, pipeline: Pipeline, settings: GatewaySettings) -> None:
        self._pipeline = pipeline
        self._settings = settings

    async def handle(self, request: Request, *, chat: bool) -> JSONResponse | EventSourceResponse:
        raw = await read_body(request, self._settings.max_body_bytes)
        parsers = await self.chat_parsers() if chat else ChatParsers()
        try:
            parsed = await off_loop(
                raw,
                lambda body: parse_request(
                    decode_json(body), self._settings, chat=chat, tool_format=parsers.tool_format
                ),
            )
            asked = [inp.stopping.max_new_tokens for inp in parsed.inputs]
            await params.check_request_tokens(asked, self._settings.max_request_tokens, self.context_length)
        except ParamError as exc:
            raise ApiError(400, exc.message, param=exc.param) from None
        model = await self.model_name(parsed.model)
        echoes = await self._echoes(parsed)
        request_id = request.scope[REQUEST_ID]
        own = params.client_request_id(request.headers.get("x-request-id")) or ""
        context = trace_context_from(request.headers.get)
        api = "chat" if chat else "completions"
        extra = {"api": api, "trace_context": context, "request_id": own}
        extra["keep_special_ids"] = kept_special_ids(parsed, parsers)
        choices = _Choices([
            self._pipeline.generate(dataclasses.replace(inp, **extra)) for inp in parsed.inputs
        ])  # fmt: skip
        response_id = ("chatcmpl-" if chat else "cmpl-") + request_id
        created = int(time.time())
        pieces = self._pipeline.token_pieces
        renderers = [
            Renderer(parsed, pieces, response_id, model, created, i, echo, chat_output(parsed, parsers))
            for i, echo in enumerate(echoes)
        ]
        if parsed.stream:
            return await self._stream(request, choices, renderers)
        return await self._complete(request, choices, renderers)

    async def chat_parsers(self) -> ChatParsers:
        """The served model's chat parsers: the settings, `auto` ones chosen from the chat template and
        generation prompt in the tokenizer's Info (`chat_output.chosen`). Raises ApiError 503 when the
        tokenizer cannot say."""
        try:
            info = await self._pipeline.model_info()
        except grpc.aio.AioRpcError as exc:
            raise unavailable("tokenizer", "model info from the tokenizer", exc) from None
        settings, special = self._settings, {t.text: t.id for t in info.special_tokens}
        template, prompt = info.chat_template, info.generation_prompt
        return chosen(settings.tool_call_parser, settings.reasoning_parser, template, prompt, special)

    async def _echoes(self, parsed: ParsedRequest) -> list[str]:
        """Each choice's echoed prompt ("" without `echo`): a text prompt as given, token ids decoded
        by a detokenizer (special tokens kept). Raises ApiError (`decode_error`)."""
        if not parsed.echo:
            return [""] * len(parsed.inputs)
        echoes: list[str] = []
        for inp in parsed.inputs[:: parsed.n]:
            if inp.prompt_ids is None:
                text = inp.prompt or ""
            else:
                try:
                    text = await self._pipeline.decode(list(inp.prompt_ids), skip_special_tokens=False)
                except grpc.aio.AioRpcError as exc:
                    raise decode_error(exc) from None
            echoes.extend([text] * parsed.n)
        return echoes

    async def model_name(self, asked: str | None) -> str:
        """The served model's name: `served_model_name`, else the tokenizer's (the model directory's
        name). Raises ApiError: 503 when the tokenizer cannot say, 404 when `asked` names another
        model."""
        served = self._settings.served_model_name
        if not served:
            try:
                served = (await self._pipeline.model_info()).model
            except grpc.aio.AioRpcError as exc:
                raise unavailable("tokenizer", "model info from the tokenizer", exc) from None
        if asked is not None and asked != served:
            raise ApiError(404, f"the model '{asked}' does not exist; this server serves '{served}'",
                           param="model", code="model_not_found")  # fmt: skip
        return served

    async def context_length(self) -> int:
        """The model's context length from the tokenizer's Info, for the gateway's own cap on one
        request's tokens (`params.check_request_tokens`). Raises ApiError 503 when the tokenizer cannot
        say."""
        try:
            return await self._pipeline.context_length()
        except grpc.aio.AioRpcError as exc:
            raise unavailable("tokenizer", "model info from the tokenizer", exc) from None

    async def max_model_len(self) -> int:
        """The engines' context length, the figure `/v1/models` and `/tokenize` show (an engine's
        `Stats`, read once). Raises ApiError 503 when no engine can say."""
        try:
            return await self._pipeline.max_model_len()
        except grpc.aio.AioRpcError as exc:
            raise unavailable("engine", "engine stats", exc) from None

    async def _parts(
        self,
        item: tuple[int, Event] | None,
        choices: _Choices,
        renderers: list[Renderer],
        ends: list[Done | None],
        keepalive_s: float | None,
    ) -> AsyncIterator[tuple[int, Part] | Failed | None]:
        """Each choice's parts (with its index) as its events come, from `item` (the first event, when
        already read) on, each choice's end recorded in `ends`; None after `keepalive_s` without an
        event; a failure, which ends them."""
        while item is not None or choices.open:
            if item is None:
                try:
                    item = await asyncio.wait_for(choices.next(), keepalive_s)
                except TimeoutError:
                    yield None
                    continue
            (index, event), item = item, None
            failure = as_failure(event)
            if failure is not None:
                yield failure
                return
            if isinstance(event, Delta):
                try:
                    parts = await renderers[index].on_delta(event)
                except grpc.aio.AioRpcError as exc:  # the token pieces of its logprobs
                    yield pieces_failure(exc)
                    return
            else:
                assert isinstance(event, Done)
                ends[index] = event
                parts = renderers[index].on_done(event)
            for part in parts:
                yield index, part

    async def _complete(self, request: Request, choices: _Choices, renderers: list[Renderer]) -> JSONResponse:
        watcher = asyncio.get_running_loop().create_task(_cancel_on_disconnect(request, choices.cancel))
        try:
            parts: list[list[Part]] = [[] for _ in renderers]
            ends: list[Done | None] = [None] * len(renderers)
            async for item in self._parts(None, choices, renderers, ends, None):
                if isinstance(item, Failed):
                    return failure_error(item, self._settings).response()
                assert item is not None
                parts[item[0]].append(item[1])
            body = renderers[0].envelope([r.whole_choice(p) for r, p in zip(renderers, parts, strict=True)])
            body["usage"] = usage(ends, renderers[0].parsed)
            return JSONResponse(body)
        finally:
            watcher.cancel()
            choices.cancel()

    async def _stream(
        self, request: Request, choices: _Choices, renderers: list[Renderer]
    ) -> JSONResponse | EventSourceResponse:
        first: tuple[int, Event] | None = None
        with contextlib.suppress(TimeoutError):
            first = await asyncio.wait_for(choices.next(), self._settings.sse_keepalive_s)
        failure = as_failure(first[1]) if first is not None else None
        if failure is not None:
            choices.cancel()
            return failure_error(failure, self._settings).response()
        # The client's disconnect is heard even while no chunk is being written.
        watcher = asyncio.get_running_loop().create_task(_cancel_on_disconnect(request, choices.cancel))
        return _TimedEventSource(
            self._sse(first, choices, renderers, watcher),
            send_timeout_s=self._settings.send_timeout_s,
            on_timeout=choices.cancel,
            headers=SSE_HEADERS,
            background=BackgroundTask(choices.close),
        )

    async def _sse(
        self,
        first: tuple[int, Event] | None,
        choices: _Choices,
        renderers: list[Renderer],
        watcher: asyncio.Task[None],
    ) -> AsyncIterator[bytes]:
        parsed = renderers[0].parsed
        ends: list[Done | None] = [None] * len(renderers)
        try:
            if parsed.chat:
                for renderer in renderers:
                    opening = renderer.choice("delta", {"role": "assistant", "content": ""}, None, None)
                    yield _sse_data(renderer.envelope([opening]))
            async for item in self._parts(first, choices, renderers, ends, self._settings.sse_keepalive_s):
                if item is None:
                    yield KEEPALIVE
                elif isinstance(item, Failed):
                    yield _sse_data(failure_error(item, self._settings).body())
                    break
                else:
                    yield _sse_data(renderers[item[0]].chunk(item[1]))
            else:
                if parsed.include_usage:
                    usage_chunk = renderers[0].envelope([])
                    usage_chunk["usage"] = usage(ends, parsed)
                    yield _sse_data(usage_chunk)
            yield DONE
        finally:
            watcher.cancel()
            choices.cancel()


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
            log.warning(
                "an SSE client stopped reading (a write blocked %gs): its generation is cancelled",
                self._send_timeout_s,
            )
            self._on_timeout()
            aclose = getattr(self.body_iterator, "aclose", None)
            if aclose is not None:
                await aclose()
            if self._drop is not None:
                self._drop()


async def _cancel_on_disconnect(request: Request, cancel: Callable[[], None]) -> None:
    """Calls `cancel` when the client goes away."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            cancel()
            return
