"""The OpenAI client of `sluice bench serve` reads the stream shapes real servers send: [DONE] with a
usage chunk of its own (OpenAI, sluice), or a finish reason with usage in the last choice and no [DONE]
(transformers serve); a stream cut before either is a failed request."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import pytest
from aiohttp import web

from sluice.bench.serve_clients import ChunkClock, OpenAIClient, RequestFailed, Usage
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


@pytest.fixture
async def server() -> AsyncIterator[str]:
    async def completions(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for event in STREAMS[body["model"]]:
            data = event if isinstance(event, str) else json.dumps(event)
            await resp.write(f"data: {data}\n\n".encode())
        return resp

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    yield f"http://127.0.0.1:{port}/v1"
    await runner.cleanup()


async def _send(url: str, shape: str) -> tuple[Usage | None, ChunkClock]:
    client = OpenAIClient(url, shape, ignore_eos=False, temperature=0.0)
    await client.open()
    clock = ChunkClock()
    try:
        return await client.send(BenchRequest("hi", 3), clock), clock
    finally:
        await client.close()


@pytest.mark.parametrize("shape", ["openai", "no-done"])
async def test_usage_and_chunks_are_read_from_either_shape(server: str, shape: str) -> None:
    usage, clock = await _send(server, shape)
    assert usage == Usage(4, 3)
    assert clock.chunks == 3


async def test_a_stream_cut_before_its_finish_is_a_failure(server: str) -> None:
    with pytest.raises(RequestFailed, match="ended before"):
        await _send(server, "cut")
