"""The OpenAI-compatible HTTP API, driven by the official `openai` client where it can be."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket

import anyio.to_thread
import httpx
import openai
import pytest

from gateway.server import GatewayHandle
from tests.gateway.conftest import WAIT_S, wait_for
from tests.gateway.fakes import MODEL, OUTPUT, FakeUpstreams, encode, expected_text

LONG = 10**6
CHAT_PROMPT = "user: hi\nassistant: "
MESSAGES = [{"role": "user", "content": "hi"}]


async def test_chat_completion(client: openai.AsyncOpenAI, upstreams: FakeUpstreams) -> None:
    reply = await client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_completion_tokens=5, temperature=0, seed=3, user="u1"
    )
    assert reply.object == "chat.completion"
    assert reply.model == MODEL
    choice = reply.choices[0]
    assert choice.message.role == "assistant"
    assert choice.message.content == expected_text(5)
    assert choice.finish_reason == "length"
    assert reply.usage is not None
    assert reply.usage.prompt_tokens == len(encode(CHAT_PROMPT))
    assert reply.usage.completion_tokens == 5
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + 5
    submit = upstreams.engine.submits[-1]
    assert submit.sampling.temperature == 0 and submit.sampling.seed == 3
    assert submit.stopping.max_new_tokens == 5


async def test_chat_completion_stream_with_usage(client: openai.AsyncOpenAI) -> None:
    stream = await client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=8, stream=True, stream_options={"include_usage": True}
    )
    chunks = [chunk async for chunk in stream]
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == expected_text(8)
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["length"]
    assert chunks[-1].choices == []
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 8
    assert all(c.usage is None for c in chunks[:-1])


async def test_completion_with_stop(client: openai.AsyncOpenAI, upstreams: FakeUpstreams) -> None:
    reply = await client.completions.create(model=MODEL, prompt="x", max_tokens=100, stop="world")
    assert reply.object == "text_completion"
    assert reply.choices[0].text == "hello "
    assert reply.choices[0].finish_reason == "stop"
    assert reply.usage is not None
    assert reply.usage.completion_tokens == OUTPUT.index("world") + len("world")
    await wait_for(upstreams.engine.aborted)


async def test_fixed_length_extensions_reach_the_engine(
    client: openai.AsyncOpenAI, upstreams: FakeUpstreams
) -> None:
    extra = {"ignore_eos": True, "min_tokens": 5}
    reply = await client.completions.create(model=MODEL, prompt="x", max_tokens=5, extra_body=extra)
    assert reply.usage is not None and reply.usage.completion_tokens == 5
    stopping = upstreams.engine.submits[-1].stopping
    assert (stopping.max_new_tokens, stopping.min_new_tokens, stopping.ignore_eos) == (5, 5, True)
    await client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=3)
    stopping = upstreams.engine.submits[-1].stopping
    assert (stopping.min_new_tokens, stopping.ignore_eos) == (0, False)


async def test_completion_stream(client: openai.AsyncOpenAI) -> None:
    stream = await client.completions.create(model=MODEL, prompt=["Once"], max_tokens=6, stream=True)
    chunks = [chunk async for chunk in stream]
    assert "".join(c.choices[0].text for c in chunks) == expected_text(6)
    assert chunks[-1].choices[0].finish_reason == "length"


async def test_streams_hand_nothing_to_worker_threads(
    client: openai.AsyncOpenAI, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An SSE stream's clean-up runs on the event loop: no call per request goes to the worker-thread
    pool (which grows a thread per concurrent call up to its limit, and whose threads may not touch the
    loop's futures)."""
    handed: list[str] = []
    run_sync = anyio.to_thread.run_sync

    async def recorded(func, *args, **kwargs):  # type: ignore[no-untyped-def]
        handed.append(getattr(func, "__qualname__", repr(func)))
        return await run_sync(func, *args, **kwargs)

    monkeypatch.setattr(anyio.to_thread, "run_sync", recorded)
    stream = await client.completions.create(model=MODEL, prompt="x", max_tokens=4, stream=True)
    assert "".join([c.choices[0].text async for c in stream]) == expected_text(4)
    chat = await client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=3, stream=True)
    assert "".join([c.choices[0].delta.content or "" async for c in chat if c.choices]) == expected_text(3)
    reply = await client.completions.create(model=MODEL, prompt="x", max_tokens=2)
    assert reply.choices[0].text == expected_text(2)
    assert handed == []


async def test_chat_logprobs(client: openai.AsyncOpenAI) -> None:
    reply = await client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=4, logprobs=True, top_logprobs=0
    )
    logprobs = reply.choices[0].logprobs
    assert logprobs is not None and logprobs.content is not None
    assert [t.token for t in logprobs.content] == list(expected_text(4))
    assert all(t.logprob == pytest.approx(-0.5) for t in logprobs.content)
    assert logprobs.content[0].bytes == list(expected_text(1).encode())


async def test_completion_logprobs_stream(client: openai.AsyncOpenAI) -> None:
    stream = await client.completions.create(model=MODEL, prompt="x", max_tokens=5, logprobs=1, stream=True)
    tokens: list[str] = []
    async for chunk in stream:
        if chunk.choices[0].logprobs is not None:
            tokens.extend(chunk.choices[0].logprobs.tokens or [])
    assert "".join(tokens) == expected_text(5)


@pytest.mark.parametrize(
    "body",
    [
        {"model": MODEL, "messages": MESSAGES, "n": 0},
        {"model": MODEL, "messages": MESSAGES, "n": 2, "best_of": 3},
        {"model": MODEL, "messages": MESSAGES, "temperature": 5},
        {"model": MODEL, "messages": []},
        {"model": MODEL, "messages": MESSAGES, "top_logprobs": 3},
        {"model": MODEL, "messages": MESSAGES, "max_tokens": 0},
        {"model": MODEL, "messages": MESSAGES, "tools": [{"type": "function"}]},
        {"model": MODEL, "messages": MESSAGES, "max_tokens": 4, "min_tokens": 5},
        {"model": MODEL, "messages": MESSAGES, "min_tokens": -1},
        {"model": MODEL, "messages": MESSAGES, "ignore_eos": "yes"},
        {"model": MODEL, "messages": [{"role": "wizard", "content": "hi"}]},
    ],
)
async def test_bad_requests_are_400(client: openai.AsyncOpenAI, body: dict[str, object]) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        await client.post("/chat/completions", cast_to=object, body=body)
    assert caught.value.status_code == 400
    error = caught.value.body
    assert isinstance(error, dict) and error["type"] == "invalid_request_error" and error["message"]


DEEP = "[" * 100_000 + "]" * 100_000  # JSON nested past any recursion limit
CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"


@pytest.mark.parametrize(
    ("path", "raw", "param"),
    [
        # A lone surrogate (what JavaScript gives when it slices an emoji) is not text.
        (COMPLETIONS, '{"prompt": "a\\ud83d"}', "prompt"),
        (COMPLETIONS, '{"prompt": "x", "stop": ["ok", "\\udc00"]}', "stop[1]"),
        (COMPLETIONS, '{"prompt": "x", "stream": true, "stop": "\\ud83d"}', "stop"),
        (CHAT, '{"messages": [{"role": "user", "content": "\\ud83d"}]}', "messages[0].content"),
        (CHAT, '{"messages": [{"role": "user", "content": "x"}], "model": "\\ud83d"}', "model"),
        (CHAT, '{"messages": [{"role": "user", "content": "x"}], "\\ud83d": 1}', None),
        (CHAT, '{"messages": [{"role": "user", "content": "x", "\\udfff": 1}]}', "messages[0]"),
        (COMPLETIONS, '{"prompt": "x", "stop": ' + DEEP + "}", None),
    ],
)
async def test_text_that_is_not_unicode_or_too_deep_is_400(
    http: httpx.AsyncClient,
    gateway: GatewayHandle,
    upstreams: FakeUpstreams,
    path: str,
    raw: str,
    param: str | None,
) -> None:
    response = await http.post(path, content=raw.encode(), headers={"content-type": "application/json"})
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["message"] and error["param"] == param
    assert upstreams.engine.submits == [] and gateway.core.in_flight == 0


@pytest.mark.parametrize("top_p", [0, -0.5, 1.5])
@pytest.mark.parametrize("chat", [False, True])
async def test_top_p_outside_0_1_is_400_naming_it(
    client: openai.AsyncOpenAI, top_p: float, chat: bool
) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        if chat:
            await client.chat.completions.create(model=MODEL, messages=MESSAGES, top_p=top_p)  # type: ignore[arg-type]
        else:
            await client.completions.create(model=MODEL, prompt="x", top_p=top_p)
    assert isinstance(caught.value.body, dict) and caught.value.body["param"] == "top_p"


async def test_unknown_model_is_404(client: openai.AsyncOpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as caught:
        await client.completions.create(model="other", prompt="x")
    assert isinstance(caught.value.body, dict) and caught.value.body["code"] == "model_not_found"


async def test_tokenizer_refusal_is_400(client: openai.AsyncOpenAI) -> None:
    with pytest.raises(openai.BadRequestError):
        await client.completions.create(model=MODEL, prompt="INVALID", stream=True)


async def test_models(client: openai.AsyncOpenAI) -> None:
    models = await client.models.list()
    assert [m.id for m in models.data] == [MODEL]


async def test_errors_are_openai_json(http: httpx.AsyncClient) -> None:
    response = await http.post("/v1/completions", content=b"{not json")
    assert response.status_code == 400
    assert set(response.json()["error"]) == {"message", "type", "param", "code"}
    response = await http.get("/v1/nothing-here")
    assert response.status_code == 404
    assert response.json()["error"]["message"]


async def test_sse_headers_and_keepalive_comments(make_gateway, upstreams: FakeUpstreams) -> None:  # type: ignore[no-untyped-def]
    server = await make_gateway(sse_keepalive_s=0.05)
    upstreams.tokenizer.gate = asyncio.Event()
    body = {"model": MODEL, "prompt": "x", "max_tokens": 3, "stream": True}
    url = f"http://127.0.0.1:{server.port}/v1/completions"
    async with httpx.AsyncClient(timeout=WAIT_S) as raw, raw.stream("POST", url, json=body) as response:
        assert response.status_code == 200
        assert response.headers["x-accel-buffering"] == "no"
        assert response.headers["content-type"].startswith("text/event-stream")
        lines = response.aiter_lines()
        line = await anext(lines)
        while not line:
            line = await anext(lines)
        assert line.startswith(": keep-alive")
        upstreams.tokenizer.gate.set()
        text, done = "", False
        async for line in lines:
            if line == "data: [DONE]":
                done = True
            elif line.startswith("data: "):
                text += json.loads(line[6:])["choices"][0]["text"]
        assert done and text == expected_text(3)


async def test_dropped_stream_aborts_the_engine(http: httpx.AsyncClient, upstreams: FakeUpstreams) -> None:
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": LONG, "stream": True}
    async with http.stream("POST", "/v1/chat/completions", json=body) as response:
        async for line in response.aiter_lines():
            if line.startswith("data: ") and '"content":"h' in line:
                break
    await wait_for(upstreams.engine.aborted)
    assert upstreams.engine.aborts == [upstreams.engine.submits[0].request_id]


async def test_dropped_plain_request_aborts_the_engine(
    http: httpx.AsyncClient, upstreams: FakeUpstreams
) -> None:
    body = {"model": MODEL, "prompt": "x", "max_tokens": LONG}
    task = asyncio.ensure_future(http.post("/v1/completions", json=body))
    await wait_for(upstreams.engine.submitted)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await wait_for(upstreams.engine.aborted)


async def test_served_model_name_is_the_name_the_api_answers_to(make_gateway) -> None:  # type: ignore[no-untyped-def]
    server = await make_gateway(served_model_name="tiny")
    base_url = f"http://127.0.0.1:{server.port}/v1"
    async with openai.AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=WAIT_S) as oai:
        assert [m.id for m in (await oai.models.list()).data] == ["tiny"]
        reply = await oai.completions.create(model="tiny", prompt="x", max_tokens=2)
        assert (reply.model, reply.choices[0].text) == ("tiny", expected_text(2))
        with pytest.raises(openai.NotFoundError) as caught:
            await oai.completions.create(model=MODEL, prompt="x", max_tokens=2)
    assert isinstance(caught.value.body, dict) and "'tiny'" in caught.value.body["message"]


async def test_a_client_that_stops_reading_is_timed_out(make_gateway, upstreams: FakeUpstreams) -> None:  # type: ignore[no-untyped-def]
    """A raw client sends a streaming request and never reads: once a write has blocked for
    send_timeout_s the generation is cancelled (nothing left in flight, the engine told) and the
    connection closed, instead of the stream waiting on the client for as long as it runs."""
    upstreams.engine.step_s = 0  # tokens as fast as the pipeline goes: the socket's buffers fill
    server = await make_gateway(send_timeout_s=0.3)
    # Small socket buffers at both ends (accepted sockets inherit the listener's): they fill in
    # kilobytes, not the megabytes loopback's autotuning would allow.
    server.server._socket.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    body = json.dumps({"model": MODEL, "prompt": "x", "max_tokens": LONG, "stream": True}).encode()
    head = (
        "POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode()
    loop = asyncio.get_running_loop()
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.setblocking(False)
        await loop.sock_connect(sock, ("127.0.0.1", server.port))
        await loop.sock_sendall(sock, head + body)
        await wait_for(upstreams.engine.submitted)
        assert await server.core.wait_idle(WAIT_S), "the generation still runs"
        await wait_for(upstreams.engine.aborted)
        assert upstreams.engine.aborts == [upstreams.engine.submits[0].request_id]
        received = 0
        with contextlib.suppress(ConnectionResetError):  # what was buffered, then the end
            while chunk := await asyncio.wait_for(loop.sock_recv(sock, 1 << 16), WAIT_S):
                received += len(chunk)
    assert received > 0
