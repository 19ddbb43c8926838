"""The API clients of `sluice bench serve` (OpenAI streaming completions, WebSocket `/v1/ws`, gRPC
`Gateway/Generate`). A client only speaks its protocol: it marks each chunk that carried text on the
request's `ChunkClock` and returns the server's usage; the run loop times, counts and handles errors.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass
from typing import Any, Protocol

import aiohttp
import grpc
from websockets.asyncio.client import connect

from services.common.pb import common_pb2, gateway_pb2, gateway_pb2_grpc
from sluice.bench.serve_data import BenchRequest

CONNECT_TIMEOUT_S = 10.0
APIS = ("openai", "ws", "grpc")


class RequestFailed(Exception):
    """The server answered with an error, or the exchange broke off; the message says which."""


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int


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


class Client(Protocol):
    """One API's client, opened once per run and closed by the caller even when `open` failed."""

    async def open(self) -> None:
        """Checks that the server answers (and resolves what the client needs); raises RequestFailed."""

    async def send(self, request: BenchRequest, clock: ChunkClock) -> Usage | None:
        """Streams one request to its end; the usage the server reported, or None. Raises RequestFailed
        (or the transport's own exception) when the request did not complete."""

    async def close(self) -> None: ...


def make_client(api: str, url: str, *, model: str | None, ignore_eos: bool, temperature: float) -> Client:
    """The client of `api` (one of APIS) for the server at `url`."""
    if api == "openai":
        return OpenAIClient(url, model, ignore_eos, temperature)
    if api == "ws":
        return WebSocketClient(url, ignore_eos, temperature)
    if api == "grpc":
        return GrpcClient(url, ignore_eos, temperature)
    raise ValueError(f"unknown api {api!r}; choose from {', '.join(APIS)}")


def _length_params(request: BenchRequest, ignore_eos: bool) -> dict[str, Any]:
    """max_tokens, and with ignore_eos the vLLM extensions that make it the exact output length."""
    if ignore_eos:
        return {"max_tokens": request.output_len, "ignore_eos": True, "min_tokens": request.output_len}
    return {"max_tokens": request.output_len}


def _usage(raw: dict[str, Any]) -> Usage:
    return Usage(int(raw.get("prompt_tokens", 0)), int(raw.get("completion_tokens", 0)))


class OpenAIClient:
    """`POST {url}/completions` with `stream: true` and usage in the last chunk, over one aiohttp session
    whose connector never throttles (no connection limit). `model` None: the first of `GET {url}/models`."""

    def __init__(self, url: str, model: str | None, ignore_eos: bool, temperature: float) -> None:
        self._url = url.rstrip("/")
        self._model = model
        self._ignore_eos = ignore_eos
        self._temperature = temperature
        self._session: aiohttp.ClientSession | None = None

    async def open(self) -> None:
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

    async def send(self, request: BenchRequest, clock: ChunkClock) -> Usage | None:
        assert self._session is not None
        body = {
            "model": self._model,
            "prompt": request.prompt,
            "temperature": self._temperature,
            "stream": True,
            "stream_options": {"include_usage": True},
            **_length_params(request, self._ignore_eos),
        }
        async with self._session.post(f"{self._url}/completions", json=body) as resp:
            if resp.status != 200:
                raise RequestFailed(f"HTTP {resp.status}: {_error_message(await resp.text())}")
            usage, finished = None, False
            async for line in resp.content:
                if not line.startswith(b"data: "):
                    continue  # blank separators and keep-alive comments
                payload = line[6:].strip()
                if payload == b"[DONE]":
                    return usage
                chunk = json.loads(payload)
                if "error" in chunk:
                    raise RequestFailed(_error_message(payload))
                choices = chunk.get("choices")
                if choices:
                    if choices[0].get("text"):
                        clock.chunk()
                    finished = finished or bool(choices[0].get("finish_reason"))
                if chunk.get("usage"):  # its own chunk (OpenAI, sluice) or the last choice's (some servers)
                    usage = _usage(chunk["usage"])
        if finished:  # servers that close the stream after the finish reason, without [DONE]
            return usage
        raise RequestFailed("the stream ended before a finish reason or [DONE]")

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()


def _error_message(body: str | bytes) -> str:
    """The message of an OpenAI-style error body, or the body itself."""
    try:
        return str(json.loads(body)["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return body.decode(errors="replace") if isinstance(body, bytes) else body


class WebSocketClient:
    """One socket per request to `ws://host:port/v1/ws`: its handshake counts in the request's TTFT."""

    def __init__(self, url: str, ignore_eos: bool, temperature: float) -> None:
        self._url = url
        self._ignore_eos = ignore_eos
        self._temperature = temperature

    def _connect(self) -> connect:
        return connect(self._url, compression=None, max_size=None, ping_interval=None, open_timeout=None)

    async def open(self) -> None:
        try:
            async with asyncio.timeout(CONNECT_TIMEOUT_S), self._connect():
                pass
        except (OSError, TimeoutError) as exc:
            raise RequestFailed(f"cannot reach {self._url}: {exc or type(exc).__name__}") from None

    async def send(self, request: BenchRequest, clock: ChunkClock) -> Usage | None:
        params = {"temperature": self._temperature, **_length_params(request, self._ignore_eos)}
        frame = {"type": "generate", "id": "r", "prompt": request.prompt, "params": params}
        async with self._connect() as ws:
            await ws.send(json.dumps(frame))
            async for raw in ws:
                message = json.loads(raw)
                kind = message["type"]
                if kind == "delta":
                    clock.chunk()
                elif kind == "done":
                    if message["finish_reason"] == "cancelled":
                        raise RequestFailed("cancelled by the server")
                    return _usage(message["usage"])
                elif kind == "error":
                    raise RequestFailed(f"{message['code']}: {message['message']}")
        raise RequestFailed("the socket closed before the done frame")

    async def close(self) -> None:
        return None


class GrpcClient:
    """`sluice.v1.Gateway/Generate` calls on one channel to `host:port`."""

    def __init__(self, url: str, ignore_eos: bool, temperature: float) -> None:
        self._url = url
        self._ignore_eos = ignore_eos
        self._sampling = common_pb2.SamplingParams(temperature=temperature)
        self._channel: grpc.aio.Channel | None = None
        self._stub: gateway_pb2_grpc.GatewayStub | None = None

    async def open(self) -> None:
        """Waits for the channel to connect; a refused connection fails at once, not after the timeout."""
        self._channel = channel = grpc.aio.insecure_channel(self._url)
        self._stub = gateway_pb2_grpc.GatewayStub(channel)
        try:
            async with asyncio.timeout(CONNECT_TIMEOUT_S):
                state = channel.get_state(try_to_connect=True)
                while state != grpc.ChannelConnectivity.READY:
                    if state == grpc.ChannelConnectivity.TRANSIENT_FAILURE:
                        raise RequestFailed(f"cannot reach {self._url}: the connection failed")
                    await channel.wait_for_state_change(state)
                    state = channel.get_state(try_to_connect=True)
        except TimeoutError:
            within = f"no connection within {CONNECT_TIMEOUT_S:g} s"
            raise RequestFailed(f"cannot reach {self._url}: {within}") from None

    async def send(self, request: BenchRequest, clock: ChunkClock) -> Usage | None:
        n = request.output_len
        stopping = common_pb2.StoppingParams(
            max_new_tokens=n, min_new_tokens=n if self._ignore_eos else 0, ignore_eos=self._ignore_eos
        )
        assert self._stub is not None
        call = self._stub.Generate(
            gateway_pb2.PublicGenerateRequest(
                prompt=request.prompt, sampling=self._sampling, stopping=stopping
            )
        )
        try:
            async for reply in call:
                if reply.WhichOneof("kind") == "delta":
                    if reply.delta.text:
                        clock.chunk()
                    continue
                if reply.final.finish_reason == common_pb2.FINISH_REASON_CANCELLED:
                    raise RequestFailed("cancelled by the server")
                usage = reply.final.usage
                return Usage(usage.prompt_tokens, usage.completion_tokens)
        except grpc.aio.AioRpcError as exc:
            raise RequestFailed(f"{exc.code().name}: {exc.details()}") from None
        finally:
            call.cancel()
        raise RequestFailed("the call ended without a final message")

    async def close(self) -> None:
        if self._channel is not None:
            await self._channel.close()
