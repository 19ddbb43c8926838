"""WebSocket `/v1/ws`: JSON text frames, several generations per socket (the frames: README, "APIs").

Each `generate` gets `delta` frames, then exactly one `done` or `error`. A frame that is not a valid
message gets an `error` with the id it carried (or null); a generate reusing an id in flight is refused
`invalid_argument`, one beyond `ws_max_in_flight` `resource_exhausted`, and the others go on. A cancel
for an id not in flight is ignored (its generate has had, or will have, its own terminal frame). With API
keys on, the first frame may be `auth` (`SocketSession`). Closing the socket cancels its generations. A
handshake whose `Origin` is not allowed is refused before the socket opens (HTTP 403). A client that
stops reading is cut off once one write has waited `send_timeout_s`: its generations cancelled, the
transport aborted at once (nothing it left unread is kept for it).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
from dataclasses import dataclass
from typing import Any

import grpc
from fastapi import WebSocket

from gateway import params
from gateway.auth import ApiKeys, origin_allowed
from gateway.events import Delta, Done, Failed, GenerateInput, Generation
from gateway.observability import TRACE_KEYS, trace_context_from
from gateway.openai_protocol import DROP_CONNECTION
from gateway.params import ParamError
from gateway.pipeline import Pipeline
from gateway.settings import GatewaySettings
from gateway.structured import STRUCTURED_KEYS, structured_output
from services.common import errors

log = logging.getLogger(__name__)

MAX_ID_CHARS = 256
MAX_TOKENS = "params.max_tokens"  # the name of a generate's max tokens in errors


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
    prompt, messages = params.prompt_or_messages(frame)
    given = frame.get("params", {})
    if not isinstance(given, dict):
        raise ParamError("params", "'params' must be an object")
    params.only_keys(given, params.GENERATION_KEYS | set(STRUCTURED_KEYS), "params")
    sampling, stopping = params.generation_params(given, settings.default_temperature, where="params.")
    constraint = structured_output(given, where="params.")
    if constraint is not None:
        sampling.structured.CopyFrom(constraint[1])
    return GenerateInput(
        prompt=prompt,
        messages=messages,
        sampling=sampling,
        stopping=stopping,
        api="ws",
        trace_context=trace_context_from(frame.get),
    )


# Close codes (RFC 6455): 1000 normal (client's choice), 1008 policy violation (authentication, a
# client that stopped reading), 1009 frame too big (sent by the server library), 1012 service restart
# (gateway draining). A handshake refused before the socket opens is HTTP 403.
CLOSE_POLICY_VIOLATION = 1008


class SendTimeout(ConnectionError):
    """A write to the client waited longer than `send_timeout_s`: the client stopped reading."""


class SocketSession:
    """One WebSocket: reads frames, runs one task per generation, serialises writes.

    The handshake is refused (403) unless `origin_allowed`. With API keys on, the socket must
    authenticate first: an `Authorization: Bearer KEY` header on the handshake, or a first frame
    `{"type": "auth", "token": "KEY"}` (browsers cannot set headers) within `ws_auth_timeout_s`.
    Anything else, or nothing in time, gets an `unauthenticated` error and the socket is closed with
    1008. An auth frame is accepted (and ignored) when keys are off.

    A generation's task takes events from its handle and writes them; while a write is pending,
    later deltas merge in the handle, so a slow reader receives fewer, larger deltas. The id of a
    generation is freed before its terminal frame is written, so the client may reuse it at once.
    A write that waits longer than `send_timeout_s` (the client stopped reading; the server's buffers
    for it are full) cancels every generation of the socket and closes it with 1008.
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
        self._send_timed_out = False
        self._reader: asyncio.Task[None] | None = None

    async def run(self) -> None:
        headers = self._ws.headers
        if not origin_allowed(headers.get("origin"), headers.get("host"), self._settings.allowed_origins):
            log.info("websocket refused: origin %r is not allowed", headers.get("origin"))
            await self._ws.close(CLOSE_POLICY_VIOLATION)  # before accept: HTTP 403
            return
        await self._ws.accept()
        self._reader = asyncio.get_running_loop().create_task(self._read())
        try:
            await asyncio.wait({self._reader})
        finally:
            self._reader.cancel()
            await self._end()
        failure = None if self._reader.cancelled() else self._reader.exception()
        if failure is not None and not isinstance(failure, SendTimeout):
            raise failure

    async def _read(self) -> None:
        """Authenticates the socket, then handles its frames until the client leaves."""
        header = self._ws.headers.get("authorization")
        if header is not None and not self._keys.check_bearer(header):
            await self._refuse(None, "invalid API key")
            return
        if header is None and self._keys.enabled and not await self._authenticate():
            return
        while True:
            message = await self._ws.receive()
            if message["type"] == "websocket.disconnect":
                return
            await self._on_message(message)

    async def _end(self) -> None:
        """Cancels what the socket still runs; after a send timeout, drops the connection (aborts its
        transport) where the server allows, else closes it if it can."""
        self._closed = True
        for generation in list(self._in_flight.values()):
            generation.cancel()
        if self._send_timed_out:
            for task in self._tasks:  # writes still waiting on a client that does not read
                task.cancel()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._send_timed_out:
            drop = self._ws.scope.get(DROP_CONNECTION)
            if drop is not None:
                # A close frame would wait behind what the client has not read, and the server's
                # buffer would hold the connection until it drains: drop it at once instead.
                drop()
                return
            with contextlib.suppress(Exception):
                async with asyncio.timeout(self._settings.send_timeout_s):
                    await self._ws.close(CLOSE_POLICY_VIOLATION, "send timed out")

    async def _authenticate(self) -> bool:
        """Checks the first frame of a socket that sent no Authorization header, waiting for it up
        to `ws_auth_timeout_s`; refuses the socket on failure."""
        timeout = self._settings.ws_auth_timeout_s
        try:
            async with asyncio.timeout(timeout):
                message = await self._ws.receive()
        except TimeoutError:
            message_text = f"no auth frame within {timeout:g}s"
            await self._refuse(None, message_text, reason="authentication timed out")
            return False
        if message["type"] == "websocket.disconnect":
            return False
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

    async def _refuse(self, frame_id: str | int | None, message: str, *, reason: str = "") -> None:
        await self._write(error_frame(frame_id, "unauthenticated", message))
        self._closed = True
        await self._ws.close(CLOSE_POLICY_VIOLATION, reason)

    async def _on_message(self, message: dict[str, Any]) -> None:
        text = message.get("text")
        if text is None:
            refusal = error_frame(None, errors.INVALID_ARGUMENT, "frames must be JSON text, not binary")
            await self._write(refusal)
            return
        try:
            frame = parse_frame(text, self._settings)
        except FrameError as exc:
            await self._write(error_frame(exc.frame_id, errors.INVALID_ARGUMENT, exc.message))
            return
        if isinstance(frame, AuthFrame):
            return
        if isinstance(frame, CancelFrame):
            generation = self._in_flight.get(frame.id)
            if generation is not None:
                generation.cancel()
            return
        refusal = self._refusal(frame.id)
        if refusal is not None:
            await self._write(refusal)
            return
        inp = frame.input
        refusal = await self._size_refusal(frame.id, inp)
        if refusal is not None:
            await self._write(refusal)
            return
        if not inp.trace_context:  # a frame's own traceparent wins over the handshake's header
            inp = dataclasses.replace(inp, trace_context=trace_context_from(self._ws.headers.get))
        generation = self._pipeline.generate(inp)
        self._in_flight[frame.id] = generation
        task = asyncio.get_running_loop().create_task(self._stream(frame.id, generation))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _refusal(self, frame_id: str) -> dict[str, Any] | None:
        """The error frame for a generate this socket may not start now, or None."""
        if frame_id in self._in_flight:
            return error_frame(frame_id, errors.INVALID_ARGUMENT, f"id {frame_id!r} is already in flight")
        cap = self._settings.ws_max_in_flight
        if cap and len(self._in_flight) >= cap:
            message = f"this socket already runs {cap} generations, the most allowed; wait for one to end"
            return error_frame(frame_id, errors.RESOURCE_EXHAUSTED, message)
        return None

    async def _size_refusal(self, frame_id: str, inp: GenerateInput) -> dict[str, Any] | None:
        """The error frame for a generate that asks for more tokens than one request may, or None."""
        asked = [inp.stopping.max_new_tokens]
        try:
            cap, context_length = self._settings.max_request_tokens, self._pipeline.context_length
            await params.check_request_tokens(asked, cap, context_length, MAX_TOKENS)
        except ParamError as exc:
            return error_frame(frame_id, errors.INVALID_ARGUMENT, exc.message)
        except grpc.aio.AioRpcError as exc:
            log.warning("model info failed: %s: %s", exc.code().name, exc.details())
            return error_frame(frame_id, errors.UNAVAILABLE, "tokenizer unavailable")
        return None

    async def _stream(self, frame_id: str, generation: Generation) -> None:
        try:
            async for event in generation:
                if isinstance(event, Delta):
                    if event.text:
                        await self._write({"type": "delta", "id": frame_id, "text": event.text})
                    continue
                self._in_flight.pop(frame_id, None)
                await self._write(_terminal_frame(frame_id, event))
        except Exception as exc:  # the client went away, or stopped reading, mid-write
            log.debug("websocket write failed: %r", exc)
        finally:
            if self._in_flight.get(frame_id) is generation:
                del self._in_flight[frame_id]
            generation.cancel()

    async def _write(self, frame: dict[str, Any]) -> None:
        """Sends one frame, unless the socket is closing. Raises SendTimeout (after giving the socket
        up) when the write, its turn included, waits longer than `send_timeout_s`."""
        if self._closed:
            return
        text = json.dumps(frame, ensure_ascii=False)
        try:
            async with asyncio.timeout(self._settings.send_timeout_s), self._write_lock:
                if not self._closed:
                    await self._ws.send_text(text)
        except TimeoutError:
            self._give_up()
            raise SendTimeout(f"a write waited more than {self._settings.send_timeout_s:g}s") from None

    def _give_up(self) -> None:
        """The client stopped reading: cancels the socket's generations and stops reading it."""
        if self._send_timed_out:
            return
        log.info("websocket client read nothing for %gs; closing it", self._settings.send_timeout_s)
        self._send_timed_out = self._closed = True
        for generation in list(self._in_flight.values()):
            generation.cancel()
        if self._reader is not None:
            self._reader.cancel()


def _terminal_frame(frame_id: str, event: Done | Failed) -> dict[str, Any]:
    if isinstance(event, Failed):
        return error_frame(frame_id, event.code, event.message)
    usage = {
        "prompt_tokens": event.prompt_tokens,
        "completion_tokens": event.completion_tokens,
        "cached_tokens": event.cached_tokens,
    }
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
