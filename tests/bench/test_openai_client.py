"""The OpenAI client of `sluice bench serve` reads the stream shapes real servers send: [DONE] with a
usage chunk of its own (OpenAI, sluice), or a finish reason with usage in the last choice and no [DONE]
(transformers serve); a stream cut before either is a failed request. In chat mode it keeps the content
and puts streamed tool calls back together, and sends a request's constraint and tools."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import pytest
from aiohttp import web

from sluice.bench.serve_clients import ChunkClock, OpenAIClient, Reply, RequestFailed, Usage
from sluice.bench.serve_data import CONSTRAINTS, TOOLS, BenchRequest, ToolCall


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


def _call(index: int, arguments: str, name: str | None = None) -> dict[str, Any]:
    if name is None:
        return {"index": index, "function": {"arguments": arguments}}
    return {
        "index": index,
        "id": f"call-{index}",
        "type": "function",
        "function": {"name": name, "arguments": arguments},
    }


CHAT_STREAMS: dict[str, list[Any]] = {
    "content": [
        _delta({"role": "assistant", "content": ""}),
        _delta({"content": '{"a":'}),
        _delta({"content": " 1}"}, "stop"),
        {"choices": [], "usage": USAGE},
        "[DONE]",
    ],
    "calls": [
        _delta({"role": "assistant", "content": ""}),
        _delta({"tool_calls": [_call(0, '{"city": ', "get_weather")]}),
        _delta({"tool_calls": [_call(0, '"Oslo"}')]}),
        _delta({"tool_calls": [_call(1, "{}", "get_time")]}, "tool_calls"),
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


async def test_chat_content_is_kept_and_the_constraint_sent(
    server: str, bodies: list[dict[str, Any]]
) -> None:
    schema = CONSTRAINTS["json_schema"][0]
    reply, clock = await _send(server, "content", BenchRequest("hi", 3, constraint=schema), chat=True)
    assert reply == Reply(Usage(4, 3), '{"a": 1}')
    assert clock.chunks == 2  # the role chunk carries no text
    (body,) = bodies
    assert body["messages"] == [{"role": "user", "content": "hi"}] and "tools" not in body
    assert body["response_format"] == {
        "type": "json_schema",
        "json_schema": {"name": "pet", "schema": schema.spec, "strict": True},
    }


async def test_streamed_tool_calls_are_put_together(server: str, bodies: list[dict[str, Any]]) -> None:
    reply, clock = await _send(server, "calls", BenchRequest("hi", 3, tools=TOOLS), chat=True)
    assert reply.text == ""
    assert reply.tool_calls == [ToolCall("get_weather", '{"city": "Oslo"}'), ToolCall("get_time", "{}")]
    assert clock.chunks == 3
    (body,) = bodies
    assert (body["tools"], body["tool_choice"], body["parallel_tool_calls"]) == (
        list(TOOLS),
        "required",
        False,
    )


async def test_completions_send_regex_and_choice_as_structured_outputs(
    server: str, bodies: list[dict[str, Any]]
) -> None:
    for constraint in (CONSTRAINTS["regex"][0], CONSTRAINTS["choice"][0]):
        await _send(server, "openai", BenchRequest("hi", 3, constraint=constraint))
    assert [b["structured_outputs"] for b in bodies] == [
        {"regex": CONSTRAINTS["regex"][0].spec},
        {"choice": CONSTRAINTS["choice"][0].spec},
    ]
    assert all(b["prompt"] == "hi" and "response_format" not in b for b in bodies)


async def test_a_stream_cut_before_its_finish_is_a_failure(server: str) -> None:
    with pytest.raises(RequestFailed, match="ended before"):
        await _send(server, "cut")
