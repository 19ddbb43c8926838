"""The OpenAI client of `sluice bench serve` reads the stream shapes real servers send: [DONE] with a
usage chunk of its own (OpenAI, sluice), or a finish reason with usage in the last choice and no [DONE]
(transformers serve); a stream cut before either is a failed request. In chat mode it sends the prompt as
the user's message and keeps the content."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import pytest
from aiohttp import web

from sluice.bench.serve import ChunkClock, OpenAIClient, Reply, RequestFailed, Usage
from sluice.bench.serve_data import BenchRequest


def _chunk(text: str, finish: str | None = None, usage: dict[str, int] | None = None) -> dict[str, Any]:
    chunk: dict[str, Any] = {"choices": [{"index": 0, "text": text, "finish_reason": finish}]}
    if usage is not None:
        chunk["usage"] = usage
    return chunk


USAGE = {"prompt_tokens": 4, "completion_tokens": 3}
STREAMS: dict[str, list[Any]] = {
    "openai": [_chunk("a"), _chunk("b"), _chunk("c", "length"), {"choices": [], "usage": USAGE}, "[DONE]"],
    "no-done": [_chunk("a"), _chunk("b"), _chunk("c", "length", USAGE)],
    "cut": [_chunk("a"), _chunk("b")],
}


def _delta(delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
    return {"choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}


CHAT_STREAMS: dict[str, list[Any]] = {
    "content": [
        _delta({"role": "assistant", "content": ""}),
        _delta({"content": '{"a":'}),
        _delta({"content": " 1}"}, "stop"),
        {"choices": [], "usage": USAGE},
        "[DONE]",
    ],
}


@pytest.fixture
def bodies() -> list[dict[str, Any]]:
    """The request bodies the fake server received, in order."""
    return []


@pytest.fixture
async def server(bodies: list[dict[str, Any]]) -> AsyncIterator[str]:
    async def stream(request: web.Request, events: list[Any]) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for event in events:
            data = event if isinstance(event, str) else json.dumps(event)
            await resp.write(f"data: {data}\n\n".encode())
        return resp

    async def completions(request: web.Request) -> web.StreamResponse:
        bodies.append(body := await request.json())
        return await stream(request, STREAMS[body["model"]])

    async def chat(request: web.Request) -> web.StreamResponse:
        bodies.append(body := await request.json())
        return await stream(request, CHAT_STREAMS[body["model"]])

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    yield f"http://127.0.0.1:{port}/v1"
    await runner.cleanup()


async def _send(
    url: str, shape: str, request: BenchRequest | None = None, *, chat: bool = False
) -> tuple[Reply, ChunkClock]:
    client = OpenAIClient(url, shape, ignore_eos=False, temperature=0.0, chat=chat)
    await client.open()
    clock = ChunkClock()
    try:
        return await client.send(request or BenchRequest("hi", 3), clock), clock
    finally:
        await client.close()


@pytest.mark.parametrize("shape", ["openai", "no-done"])
async def test_usage_and_chunks_are_read_from_either_shape(server: str, shape: str) -> None:
    reply, clock = await _send(server, shape)
    assert reply == Reply(Usage(4, 3), "abc")
    assert clock.chunks == 3


async def test_chat_content_is_kept(server: str, bodies: list[dict[str, Any]]) -> None:
    reply, clock = await _send(server, "content", BenchRequest("hi", 3), chat=True)
    assert reply == Reply(Usage(4, 3), '{"a": 1}')
    assert clock.chunks == 2  # the role chunk carries no text
    (body,) = bodies
    assert body["messages"] == [{"role": "user", "content": "hi"}] and "prompt" not in body


async def test_a_stream_cut_before_its_finish_is_a_failure(server: str) -> None:
    with pytest.raises(RequestFailed, match="ended before"):
        await _send(server, "cut")
