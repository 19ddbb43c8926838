"""The client of `sluice bench serve`: OpenAI streaming completions or chat completions. It only speaks
the protocol: it marks each chunk that carried text on the request's `ChunkClock`, sends the request's
output constraint or tools in the API's form, and returns the answer's text, tool calls and the server's
usage; the run loop times, counts, checks and handles errors.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from sluice.bench.serve_data import BenchRequest, Constraint, ToolCall

CONNECT_TIMEOUT_S = 10.0
APIS = ("openai", "openai-chat")


class RequestFailed(Exception):
    """The server answered with an error, or the exchange broke off; the message says which."""


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int


@dataclass
class Reply:
    """A completed answer: the server's usage (None when it sent none), the generated text (chat: the
    message's content) and the tool calls read from it (chat with tools only)."""

    usage: Usage | None
    text: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)


class ChunkClock:
    """Times the text-carrying chunks of one request from its send (`t0`, perf_counter seconds)."""

    __slots__ = ("chunks", "itl_s", "last", "t0", "ttft_s")

    def __init__(self) -> None:
        self.t0 = time.perf_counter()
        self.last = self.t0
        self.ttft_s = 0.0
        self.itl_s: list[float] = []
        self.chunks = 0

    def chunk(self) -> None:
        now = time.perf_counter()
        if self.chunks:
            self.itl_s.append(now - self.last)
        else:
            self.ttft_s = now - self.t0
        self.last = now
        self.chunks += 1


def _length_params(request: BenchRequest, ignore_eos: bool) -> dict[str, Any]:
    """max_tokens, and with ignore_eos the vLLM extensions that make it the exact output length (a
    constrained output still ends where its grammar ends)."""
    if ignore_eos:
        return {"max_tokens": request.output_len, "ignore_eos": True, "min_tokens": request.output_len}
    return {"max_tokens": request.output_len}


def _constraint_fields(constraint: Constraint | None) -> dict[str, Any]:
    """The constraint as OpenAI body fields: OpenAI's strict `response_format`
    for a JSON schema, vLLM's `structured_outputs` for a regex or a choice."""
    if constraint is None:
        return {}
    if constraint.kind == "json_schema":
        schema = {"name": constraint.name, "schema": constraint.spec, "strict": True}
        return {"response_format": {"type": "json_schema", "json_schema": schema}}
    return {"structured_outputs": {constraint.kind: constraint.spec}}


def _usage(raw: dict[str, Any]) -> Usage:
    return Usage(int(raw.get("prompt_tokens", 0)), int(raw.get("completion_tokens", 0)))


class _StreamedAnswer:
    """An answer put together from the chunks of its (first) choice: the text (completions: `text`;
    chat: `delta.content`) and a chat's tool calls (by `index`: the first delta of a call brings its
    name, every delta a fragment of its arguments)."""

    def __init__(self, chat: bool) -> None:
        self._chat = chat
        self._text: list[str] = []
        self._calls: dict[int, tuple[str, list[str]]] = {}

    def feed(self, choice: dict[str, Any]) -> bool:
        """Takes one chunk's choice; whether it carried text (content, reasoning or a call)."""
        if not self._chat:
            self._text.append(choice.get("text") or "")
            return bool(choice.get("text"))
        delta = choice.get("delta") or {}
        self._text.append(delta.get("content") or "")
        for call in delta.get("tool_calls") or ():
            function = call.get("function") or {}
            _, fragments = self._calls.setdefault(int(call["index"]), (function.get("name") or "", []))
            fragments.append(function.get("arguments") or "")
        return bool(delta.get("content") or delta.get("reasoning_content") or delta.get("tool_calls"))

    def reply(self, usage: Usage | None) -> Reply:
        calls = [ToolCall(name, "".join(parts)) for _, (name, parts) in sorted(self._calls.items())]
        return Reply(usage, "".join(self._text), calls)


class OpenAIClient:
    """`POST {url}/completions` (or, with `chat`, `{url}/chat/completions` with the prompt as one user
    message) with `stream: true` and usage in the last chunk, over one aiohttp session whose connector
    never throttles (no connection limit), opened once per run and closed by the caller even when `open`
    failed. `model` None: the first of `GET {url}/models`. It samples at `temperature` and, with
    `ignore_eos`, asks for exactly each request's output length. A request's tools go with `tool_choice:
    "required"` and `parallel_tool_calls: false` (one call per answer)."""

    def __init__(
        self, url: str, model: str | None, ignore_eos: bool, temperature: float, *, chat: bool = False
    ) -> None:
        self._url, self._ignore_eos, self._temperature = url.rstrip("/"), ignore_eos, temperature
        self._model = model
        self._chat = chat
        self._session: aiohttp.ClientSession | None = None

    async def open(self) -> None:
        """Checks that the server answers and resolves the model; raises RequestFailed."""
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0), timeout=aiohttp.ClientTimeout(total=None)
        )
        if self._model is None:
            self._model = await self._first_model()

    async def _first_model(self) -> str:
        assert self._session is not None
        timeout = aiohttp.ClientTimeout(total=CONNECT_TIMEOUT_S)
        try:
            async with self._session.get(f"{self._url}/models", timeout=timeout) as resp:
                if resp.status != 200:
                    raise RequestFailed(f"GET {self._url}/models: HTTP {resp.status}: {await resp.text()}")
                models = (await resp.json())["data"]
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise RequestFailed(f"cannot reach {self._url}: {exc or type(exc).__name__}") from None
        if not models:
            raise RequestFailed(f"GET {self._url}/models: the server lists no model")
        return str(models[0]["id"])

    def _body(self, request: BenchRequest) -> dict[str, Any]:
        body = {
            "model": self._model,
            "temperature": self._temperature,
            "stream": True,
            "stream_options": {"include_usage": True},
            **_length_params(request, self._ignore_eos),
            **_constraint_fields(request.constraint),
        }
        if not self._chat:
            return {**body, "prompt": request.prompt}
        body["messages"] = [{"role": "user", "content": request.prompt}]
        if request.tools:
            body.update(tools=list(request.tools), tool_choice="required", parallel_tool_calls=False)
        return body

    async def send(self, request: BenchRequest, clock: ChunkClock) -> Reply:
        """Streams one request to its end and returns its answer. Raises RequestFailed (or aiohttp's own
        exception) when the request did not complete."""
        assert self._session is not None
        endpoint = "chat/completions" if self._chat else "completions"
        async with self._session.post(f"{self._url}/{endpoint}", json=self._body(request)) as resp:
            if resp.status != 200:
                raise RequestFailed(f"HTTP {resp.status}: {_error_message(await resp.text())}")
            usage, finished = None, False
            answer = _StreamedAnswer(self._chat)
            async for line in resp.content:
                if not line.startswith(b"data: "):
                    continue  # blank separators and keep-alive comments
                payload = line[6:].strip()
                if payload == b"[DONE]":
                    finished = True
                    break
                chunk = json.loads(payload)
                if "error" in chunk:
                    raise RequestFailed(_error_message(payload))
                choices = chunk.get("choices")
                if choices:
                    if answer.feed(choices[0]):
                        clock.chunk()
                    finished = finished or bool(choices[0].get("finish_reason"))
                if chunk.get("usage"):  # its own chunk (OpenAI, sluice) or the last choice's (some servers)
                    usage = _usage(chunk["usage"])
        # Servers that close the stream after the finish reason, without [DONE], are served too.
        if not finished:
            raise RequestFailed("the stream ended before a finish reason or [DONE]")
        return answer.reply(usage)

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()


def _error_message(body: str | bytes) -> str:
    """The message of an OpenAI-style error body, or the body itself."""
    try:
        return str(json.loads(body)["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return body.decode(errors="replace") if isinstance(body, bytes) else body
