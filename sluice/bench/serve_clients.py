"""The client of `sluice bench serve`: OpenAI streaming completions or chat completions. It only speaks
the protocol: it marks each chunk that carried text on the request's `ChunkClock` and returns the
answer's text and the server's usage; the run loop times, counts and handles errors.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any

import aiohttp

from sluice.bench.serve_data import BenchRequest

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
    """A completed answer: the server's usage (None when it sent none) and the generated text (chat: the
    message's content)."""

    usage: Usage | None
    text: str = ""


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


def _chunk_text(choice: dict[str, Any], chat: bool) -> tuple[str, bool]:
    """One chunk's (first) choice: its text (completions: `text`; chat: `delta.content`) and whether it
    carried any (chat: reasoning too)."""
    if not chat:
        return choice.get("text") or "", bool(choice.get("text"))
    delta = choice.get("delta") or {}
    return delta.get("content") or "", bool(delta.get("content") or delta.get("reasoning_content"))


class OpenAIClient:
    """`POST {url}/completions` (or, with `chat`, `{url}/chat/completions` with the prompt as one user
    message) with `stream: true` and usage in the last chunk, over one aiohttp session whose connector
    never throttles (no connection limit), opened once per run and closed by the caller even when `open`
    failed. `model` None: the first of `GET {url}/models`. It samples at `temperature` and, with
    `ignore_eos`, asks for exactly each request's output length."""

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
            "max_tokens": request.output_len,
        }
        if self._ignore_eos:  # vLLM's extensions that make max_tokens the exact output length
            body.update(ignore_eos=True, min_tokens=request.output_len)
        if self._chat:
            return {**body, "messages": [{"role": "user", "content": request.prompt}]}
        return {**body, "prompt": request.prompt}

    async def send(self, request: BenchRequest, clock: ChunkClock) -> Reply:
        """Streams one request to its end and returns its answer. Raises RequestFailed (or aiohttp's own
        exception) when the request did not complete."""
        assert self._session is not None
        endpoint = "chat/completions" if self._chat else "completions"
        async with self._session.post(f"{self._url}/{endpoint}", json=self._body(request)) as resp:
            if resp.status != 200:
                raise RequestFailed(f"HTTP {resp.status}: {_error_message(await resp.text())}")
            usage, finished, text = None, False, []
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
                    piece, carried = _chunk_text(choices[0], self._chat)
                    text.append(piece)
                    if carried:
                        clock.chunk()
                    finished = finished or bool(choices[0].get("finish_reason"))
                if chunk.get("usage"):  # its own chunk (OpenAI, sluice) or the last choice's (some servers)
                    raw = chunk["usage"]
                    usage = Usage(int(raw.get("prompt_tokens", 0)), int(raw.get("completion_tokens", 0)))
        # Servers that close the stream after the finish reason, without [DONE], are served too.
        if not finished:
            raise RequestFailed("the stream ended before a finish reason or [DONE]")
        return Reply(usage, "".join(text))

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()


def _error_message(body: str | bytes) -> str:
    """The message of an OpenAI-style error body, or the body itself."""
    try:
        return str(json.loads(body)["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return body.decode(errors="replace") if isinstance(body, bytes) else body
