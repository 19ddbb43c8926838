"""WebSocket `/v1/ws`: JSON text frames, several generations per socket.

Client → server: `{"type": "generate", "id": ..., "prompt": ... | "messages": [...], "params": {...}}`
and `{"type": "cancel", "id": ...}`. Server → client: `delta` frames, then exactly one `done` or
`error` per generate. With API keys on, the first frame may be `{"type": "auth", "token": ...}`
(see `SocketSession`). A frame that is not a valid message gets an `error` with the id it carried (or
null). A generate reusing an id still in flight is refused with `invalid_argument` and that id; the
first generation goes on. A cancel for an id not in flight (already ended, or never started) is
ignored: its generate has had, or will have, its own terminal frame. Closing the socket cancels every
generation of that socket.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
from dataclasses import dataclass
from typing import Any

from fastapi import WebSocket

from gateway import params
from gateway import pipeline as pl
from gateway.auth import ApiKeys
from gateway.observability import TRACE_KEYS, trace_context_from
from gateway.params import ParamError
from gateway.pipeline import Delta, Done, Failed, GenerateInput, Generation, Pipeline
from gateway.settings import GatewaySettings

log = logging.getLogger(__name__)

MAX_ID_CHARS = 256

# Pipeline error codes → the protocol's codes.
_WS_CODES = {
    pl.INVALID_ARGUMENT: "invalid_argument",
    pl.RESOURCE_EXHAUSTED: "resource_exhausted",
    pl.UNAVAILABLE: "unavailable",
    pl.DEADLINE_EXCEEDED: "deadline_exceeded",
    pl.INTERNAL: "internal",
}


class FrameError(Exception):
    """A client frame that is not a valid message; `frame_id` is the id it carried, or None."""

    def __init__(self, frame_id: str | int | None, message: str) -> None:
        super().__init__(message)
        self.frame_id = frame_id
        self.message = message


@dataclass(frozen=True)
class GenerateFrame:
    id: str
    input: GenerateInput


@dataclass(frozen=True)
class CancelFrame:
    id: str


@dataclass(frozen=True)
class AuthFrame:
    token: str


def error_frame(frame_id: str | int | None, code: str, message: str) -> dict[str, Any]:
    return {"type": "error", "id": frame_id, "code": code, "message": message}


def parse_frame(raw: str, settings: GatewaySettings) -> GenerateFrame | CancelFrame | AuthFrame:
    """Parses one client text frame. Raises FrameError with the carried id on anything invalid."""
    try:
        frame = params.parse_json(raw)
    except ParamError as exc:
        raise FrameError(None, exc.message) from None
    if not isinstance(frame, dict):
        raise FrameError(None, "a frame must be a JSON object")
    carried = frame.get("id")
    frame_id = _echoable_id(carried)
    try:
        params.check_text(frame)
    except ParamError as exc:
        raise FrameError(frame_id, exc.message) from None
    if frame.get("type") == "auth":
        token = frame.get("token")
        if not isinstance(token, str) or set(frame) != {"type", "token"}:
            raise FrameError(None, 'an auth frame is {"type": "auth", "token": "KEY"}')
        return AuthFrame(token)
    if not isinstance(carried, str) or not carried or len(carried) > MAX_ID_CHARS:
        raise FrameError(frame_id, f"'id' must be a non-empty string of at most {MAX_ID_CHARS} characters")
    kind = frame.get("type")
    try:
        if kind == "cancel":
            params.only_keys(frame, {"type", "id"}, "frame")
            return CancelFrame(carried)
        if kind == "generate":
            return GenerateFrame(carried, _parse_generate(frame, settings))
    except ParamError as exc:
        raise FrameError(carried, exc.message) from None
    raise FrameError(carried, "'type' must be 'generate' or 'cancel'")


def _echoable_id(carried: Any) -> str | int | None:
    """The id a frame carried, as its error frame may echo it: a string that is text, or an int."""
    if isinstance(carried, bool) or not isinstance(carried, str | int):
        return None
    return None if isinstance(carried, str) and not params.is_text(carried) else carried


def _parse_generate(frame: dict[str, Any], settings: GatewaySettings) -> GenerateInput:
    params.only_keys(frame, {"type", "id", "prompt", "messages", "params", *TRACE_KEYS}, "frame")
    for key in TRACE_KEYS:
        if key in frame and not isinstance(frame[key], str):
            raise ParamError(key, f"'{key}' must be a string (W3C trace context)")
    has_prompt, has_messages = "prompt" in frame, "messages" in frame
    if has_prompt == has_messages:
        raise ParamError(None, "give exactly one of 'prompt' and 'messages'")
    prompt: str | None = None
    messages: tuple[tuple[str, str], ...] | None = None
    if has_prompt:
        prompt = frame["prompt"]
        if not isinstance(prompt, str):
            raise ParamError("prompt", "'prompt' must be a string")
    else:
        messages = params.chat_messages(frame["messages"], "messages")
    given = frame.get("params", {})
    if not isinstance(given, dict):
        raise ParamError("params", "'params' must be an object")
    params.only_keys(given, params.GENERATION_KEYS, "params")
    sampling, stopping = params.generation_params(given, settings, where="params.")
    return GenerateInput(prompt=prompt, messages=messages, sampling=sampling, stopping=stopping, api="ws",
                         trace_context=trace_context_from(frame.get))


# Close codes (RFC 6455): 1000 normal (client's choice), 1008 policy violation (authentication),
# 1009 frame too big (sent by the server library), 1012 service restart (gateway draining).
CLOSE_POLICY_VIOLATION = 1008


class SocketSession:
    """One accepted WebSocket: reads frames, runs one task per generation, serialises writes.

    With API keys on, the socket must authenticate first: an `Authorization: Bearer KEY` header on
    the handshake, or a first frame `{"type": "auth", "token": "KEY"}` (browsers cannot set
    headers). Anything else gets an `unauthenticated` error and the socket is closed with 1008.
    An auth frame is accepted (and ignored) when keys are off.

    A generation's task takes events from its handle and writes them; while a write is pending,
    later deltas merge in the handle, so a slow reader receives fewer, larger deltas. The id of a
    generation is freed before its terminal frame is written, so the client may reuse it at once.
    """

    def __init__(
        self, websocket: WebSocket, pipeline: Pipeline, settings: GatewaySettings, keys: ApiKeys
    ) -> None:
        self._ws = websocket
        self._pipeline = pipeline
        self._settings = settings
        self._keys = keys
        self._in_flight: dict[str, Generation] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._write_lock = asyncio.Lock()
        self._closed = False

    async def run(self) -> None:
        await self._ws.accept()
        header = self._ws.headers.get("authorization")
        authenticated = not self._keys.enabled or (header is not None and self._keys.check_bearer(header))
        if header is not None and not authenticated:
            await self._refuse(None, "invalid API key")
            return
        try:
            while True:
                message = await self._ws.receive()
                if message["type"] == "websocket.disconnect":
                    break
                if not authenticated:
                    authenticated = await self._authenticate(message)
                    if not authenticated:
                        break
                    continue
                await self._on_message(message)
        finally:
            self._closed = True
            for generation in list(self._in_flight.values()):
                generation.cancel()
            if self._tasks:
                await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _authenticate(self, message: dict[str, Any]) -> bool:
        """Checks the first frame of a socket that sent no valid header; refuses it on failure."""
        frame: GenerateFrame | CancelFrame | AuthFrame | None = None
        frame_id = None
        text = message.get("text")
        try:
            frame = parse_frame(text, self._settings) if text is not None else None
        except FrameError as exc:
            frame_id = exc.frame_id
        if isinstance(frame, AuthFrame):
            if self._keys.check(frame.token):
                return True
            await self._refuse(None, "invalid API key")
            return False
        if isinstance(frame, GenerateFrame | CancelFrame):
            frame_id = frame.id
        await self._refuse(frame_id, 'authenticate first: send {"type": "auth", "token": "KEY"}')
        return False

    async def _refuse(self, frame_id: str | int | None, message: str) -> None:
        await self._write(error_frame(frame_id, "unauthenticated", message))
        self._closed = True
        await self._ws.close(CLOSE_POLICY_VIOLATION)

    async def _on_message(self, message: dict[str, Any]) -> None:
        text = message.get("text")
        if text is None:
            await self._write(error_frame(None, "invalid_argument", "frames must be JSON text, not binary"))
            return
        try:
            frame = parse_frame(text, self._settings)
        except FrameError as exc:
            await self._write(error_frame(exc.frame_id, "invalid_argument", exc.message))
            return
        if isinstance(frame, AuthFrame):
            return
        if isinstance(frame, CancelFrame):
            generation = self._in_flight.get(frame.id)
            if generation is not None:
                generation.cancel()
            return
        if frame.id in self._in_flight:
            await self._write(
                error_frame(frame.id, "invalid_argument", f"id {frame.id!r} is already in flight")
            )
            return
        inp = frame.input
        if not inp.trace_context:  # a frame's own traceparent wins over the handshake's header
            inp = dataclasses.replace(inp, trace_context=trace_context_from(self._ws.headers.get))
        generation = self._pipeline.generate(inp)
        self._in_flight[frame.id] = generation
        task = asyncio.get_running_loop().create_task(self._stream(frame.id, generation))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _stream(self, frame_id: str, generation: Generation) -> None:
        try:
            async for event in generation:
                if isinstance(event, Delta):
                    if event.text:
                        await self._write({"type": "delta", "id": frame_id, "text": event.text})
                    continue
                self._in_flight.pop(frame_id, None)
                await self._write(_terminal_frame(frame_id, event))
        except Exception as exc:  # the client went away mid-write
            log.debug("websocket write failed: %s", exc)
        finally:
            if self._in_flight.get(frame_id) is generation:
                del self._in_flight[frame_id]
            generation.cancel()

    async def _write(self, frame: dict[str, Any]) -> None:
        if self._closed:
            return
        async with self._write_lock:
            await self._ws.send_text(json.dumps(frame, ensure_ascii=False))


def _terminal_frame(frame_id: str, event: Done | Failed) -> dict[str, Any]:
    if isinstance(event, Failed):
        return error_frame(frame_id, _WS_CODES.get(event.code, "internal"), event.message)
    usage = {"prompt_tokens": event.prompt_tokens, "completion_tokens": event.completion_tokens}
    return {"type": "done", "id": frame_id, "finish_reason": event.finish_reason, "usage": usage}


async def serve_socket(
    websocket: WebSocket, pipeline: Pipeline, settings: GatewaySettings, keys: ApiKeys
) -> None:
    """Runs one WebSocket session until the client leaves; its generations are cancelled then."""
    session = SocketSession(websocket, pipeline, settings, keys)
    try:
        await session.run()
    except Exception as exc:  # a write to a client that already left
        log.info("websocket session ended: %r", exc)
