"""The scoring side of the OpenAI API over the fake upstreams: prompt batches and token ids, echo and
prompt logprobs, n choices, logit_bias, cached tokens, /tokenize and /detokenize, X-Request-Id, the
context length in /v1/models and the default max tokens."""

from __future__ import annotations

import json
from typing import Any

import grpc
import httpx
import openai
import pytest
from websockets.asyncio.client import connect

from gateway import observability, pipeline
from gateway.server import GatewayHandle
from services.common.pb import gateway_pb2, gateway_pb2_grpc
from tests.gateway.conftest import collect, send
from tests.gateway.fakes import BOS, MODEL, PROMPT_LOGPROB, FakeUpstreams, encode, expected_text


async def sse_chunks(http: httpx.AsyncClient, body: dict[str, Any]) -> list[dict[str, Any]]:
    """The JSON chunks of a streamed completion, up to [DONE] (which must come)."""
    chunks: list[dict[str, Any]] = []
    async with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as response:
        assert response.status_code == 200
        async for line in response.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                return chunks
            chunks.append(json.loads(line.removeprefix("data: ")))
    raise AssertionError("the stream ended without [DONE]")


# ----- prompts


async def test_a_batch_of_prompts_gets_one_choice_each_in_order(
    client: openai.AsyncOpenAI, upstreams: FakeUpstreams
) -> None:
    reply = await client.completions.create(model=MODEL, prompt=["ab", "cde", "f"], max_tokens=3)
    assert [c.index for c in reply.choices] == [0, 1, 2]
    assert [c.text for c in reply.choices] == [expected_text(3)] * 3
    assert sorted(list(s.prompt_ids) for s in upstreams.engine.submits) == sorted(
        encode(p) for p in ("ab", "cde", "f")
    )
    assert reply.usage is not None
    assert reply.usage.prompt_tokens == sum(len(encode(p)) for p in ("ab", "cde", "f"))
    assert reply.usage.completion_tokens == 9


@pytest.mark.parametrize(
    ("prompt", "expected"), [([5, 6, 7], [[5, 6, 7]]), ([[5, 6], [7], [8, 9, 10]], [[5, 6], [7], [8, 9, 10]])]
)
async def test_token_id_prompts_skip_the_tokenizer(
    client: openai.AsyncOpenAI, upstreams: FakeUpstreams, prompt: Any, expected: list[list[int]]
) -> None:
    reply = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=2)
    assert len(reply.choices) == len(expected)
    assert sorted(list(s.prompt_ids) for s in upstreams.engine.submits) == sorted(expected)
    assert upstreams.tokenizer.requests == []


@pytest.mark.parametrize(
    "prompt", [[], [[]], [1, "a"], [[1], "a"], [-1], [2**31], [True], [[1.5]], {"a": 1}, None]
)
async def test_malformed_prompts_are_400(http: httpx.AsyncClient, prompt: Any) -> None:
    response = await http.post("/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 1})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"].startswith("prompt")


# ----- echo and prompt logprobs


async def test_echo_puts_the_prompt_before_the_text(client: openai.AsyncOpenAI) -> None:
    reply = await client.completions.create(model=MODEL, prompt="hi", max_tokens=3, echo=True)
    assert reply.choices[0].text == "hi" + expected_text(3)


async def test_echo_of_token_ids_decodes_them(client: openai.AsyncOpenAI) -> None:
    reply = await client.completions.create(
        model=MODEL, prompt=[[BOS, ord("o"), ord("k")]], max_tokens=2, echo=True
    )
    assert reply.choices[0].text == chr(BOS) + "ok" + expected_text(2)  # special tokens kept, as vLLM


async def test_scoring_a_prompt_returns_its_logprobs_and_no_generated_token(
    client: openai.AsyncOpenAI, upstreams: FakeUpstreams
) -> None:
    reply = await client.completions.create(model=MODEL, prompt="hi", max_tokens=0, echo=True, logprobs=1)
    submit = upstreams.engine.submits[-1]
    assert submit.sampling.prompt_logprobs == 1
    assert submit.stopping.max_new_tokens == 1  # the engine emits at least one token: it is dropped
    choice = reply.choices[0]
    assert choice.text == "hi"
    assert choice.finish_reason == "length"
    assert choice.logprobs is not None
    assert choice.logprobs.tokens == [chr(BOS), "h", "i"]
    assert choice.logprobs.token_logprobs == [None, PROMPT_LOGPROB, PROMPT_LOGPROB]
    assert choice.logprobs.top_logprobs == [None, {"h": PROMPT_LOGPROB}, {"i": PROMPT_LOGPROB}]
    assert choice.logprobs.text_offset == [0, 1, 2]
    assert reply.usage is not None
    assert (reply.usage.prompt_tokens, reply.usage.completion_tokens) == (3, 0)


async def test_scoring_ends_with_length_whatever_stopped_the_dropped_token(
    client: openai.AsyncOpenAI,
) -> None:
    reply = await client.completions.create(model=MODEL, prompt="hi", max_tokens=0, echo=True, stop="h")
    assert (reply.choices[0].text, reply.choices[0].finish_reason) == ("hi", "length")


async def test_echo_with_logprobs_gives_the_prompt_then_the_generated_tokens(
    client: openai.AsyncOpenAI,
) -> None:
    reply = await client.completions.create(model=MODEL, prompt="hi", max_tokens=2, echo=True, logprobs=0)
    logprobs = reply.choices[0].logprobs
    assert logprobs is not None
    assert logprobs.tokens == [chr(BOS), "h", "i", *expected_text(2)]
    assert logprobs.token_logprobs == [None, PROMPT_LOGPROB, PROMPT_LOGPROB, -0.5, -0.5]
    assert logprobs.top_logprobs == [None, {}, {}, {}, {}]


async def test_streamed_echo_with_logprobs(http: httpx.AsyncClient) -> None:
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 3, "echo": True, "logprobs": 1}
    chunks = await sse_chunks(http, body)
    choices = [c["choices"][0] for c in chunks]
    assert "".join(c["text"] for c in choices) == "hi" + expected_text(3)
    tokens = [t for c in choices if c["logprobs"] for t in c["logprobs"]["tokens"]]
    values = [v for c in choices if c["logprobs"] for v in c["logprobs"]["token_logprobs"]]
    assert tokens == [chr(BOS), "h", "i", *expected_text(3)]
    assert values == [None, PROMPT_LOGPROB, PROMPT_LOGPROB, -0.5, -0.5, -0.5]
    assert [c["finish_reason"] for c in choices if c["finish_reason"]] == ["length"]


async def test_max_tokens_zero_needs_echo(http: httpx.AsyncClient) -> None:
    response = await http.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 0})
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "max_tokens"


# ----- n choices


async def test_n_choices_fan_out_with_consecutive_seeds(
    client: openai.AsyncOpenAI, upstreams: FakeUpstreams
) -> None:
    reply = await client.completions.create(
        model=MODEL, prompt=["ab", "c"], max_tokens=2, n=3, best_of=3, seed=2**64 - 2
    )
    assert [c.index for c in reply.choices] == list(range(6))
    seeds = sorted(s.sampling.seed for s in upstreams.engine.submits)
    assert seeds == sorted([2**64 - 2, 2**64 - 1, 0] * 2)  # seed + i, modulo 2**64
    assert reply.usage is not None
    assert reply.usage.prompt_tokens == len(encode("ab")) + len(encode("c"))  # once per prompt
    assert reply.usage.completion_tokens == 12


async def test_n_choices_on_chat(client: openai.AsyncOpenAI, upstreams: FakeUpstreams) -> None:
    reply = await client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2, n=2
    )
    assert [(c.index, c.message.content) for c in reply.choices] == [(0, "he"), (1, "he")]
    assert not any(s.sampling.HasField("seed") for s in upstreams.engine.submits)


async def test_streamed_choices_interleave_and_each_ends_once(http: httpx.AsyncClient) -> None:
    body = {"model": MODEL, "prompt": ["a", "b"], "max_tokens": 4, "n": 2,
            "stream_options": {"include_usage": True}}  # fmt: skip
    chunks = await sse_chunks(http, body)
    texts: dict[int, str] = {}
    finishes: dict[int, list[str]] = {}
    for chunk in chunks[:-1]:
        assert len(chunk["choices"]) == 1 and chunk["usage"] is None
        choice = chunk["choices"][0]
        assert not finishes.get(choice["index"]), "a chunk after the choice's finish"
        texts[choice["index"]] = texts.get(choice["index"], "") + choice["text"]
        if choice["finish_reason"]:
            finishes.setdefault(choice["index"], []).append(choice["finish_reason"])
    assert texts == {i: expected_text(4) for i in range(4)}
    assert finishes == {i: ["length"] for i in range(4)}
    assert chunks[-1]["choices"] == []
    assert chunks[-1]["usage"]["completion_tokens"] == 16
    assert chunks[-1]["usage"]["prompt_tokens"] == 2 * len(encode("a"))


@pytest.mark.parametrize(
    "extra", [{"n": 0}, {"n": 129}, {"n": 2, "best_of": 1}, {"best_of": 2}, {"n": 128, "prompt": ["a"] * 9}]
)
async def test_bad_choice_counts_are_400(http: httpx.AsyncClient, extra: dict[str, Any]) -> None:
    body = {"model": MODEL, "prompt": "a", "max_tokens": 1, **extra}
    response = await http.post("/v1/completions", json=body)
    assert response.status_code == 400
    assert response.json()["error"]["param"] in ("n", "best_of")


async def test_a_failed_choice_fails_the_request_and_cancels_the_others(
    http: httpx.AsyncClient, upstreams: FakeUpstreams
) -> None:
    upstreams.engine.error_next_submit = "invalid_argument: token id 99 is outside the vocabulary"
    body = {"model": MODEL, "prompt": "a", "max_tokens": 10**6, "n": 3}
    response = await http.post("/v1/completions", json=body)
    assert response.status_code == 400
    assert "outside the vocabulary" in response.json()["error"]["message"]


# ----- logit_bias


@pytest.mark.parametrize("api", ["completions", "chat", "ws"])
async def test_logit_bias_reaches_the_engine(
    http: httpx.AsyncClient, upstreams: FakeUpstreams, gateway: GatewayHandle, api: str
) -> None:
    bias = {"65": 10, "66": -100, "7": 0.5}
    if api == "ws":
        async with connect(f"ws://127.0.0.1:{gateway.port}/v1/ws") as ws:
            await send(ws, {"type": "generate", "id": "b", "prompt": "x",
                            "params": {"max_tokens": 1, "logit_bias": bias}})  # fmt: skip
            await collect(ws, {"b"})
    else:
        body: dict[str, Any] = {"model": MODEL, "max_tokens": 1, "logit_bias": bias}
        body.update({"messages": [{"role": "user", "content": "x"}]} if api == "chat" else {"prompt": "x"})
        path = "/v1/chat/completions" if api == "chat" else "/v1/completions"
        assert (await http.post(path, json=body)).status_code == 200
    assert dict(upstreams.engine.submits[-1].sampling.logit_bias) == {65: 10.0, 66: -100.0, 7: 0.5}


@pytest.mark.parametrize(
    "bias", [{"x": 1}, {"-1": 1}, {"1": 100.5}, {"1": "2"}, {"1": None}, [1], {str(i): 1 for i in range(301)}]
)
async def test_bad_logit_bias_is_400(http: httpx.AsyncClient, bias: Any) -> None:
    body = {"model": MODEL, "prompt": "x", "max_tokens": 1, "logit_bias": bias}
    response = await http.post("/v1/completions", json=body)
    assert response.status_code == 400
    assert response.json()["error"]["param"].startswith("logit_bias")


async def test_logit_bias_over_grpc(gateway: GatewayHandle, upstreams: FakeUpstreams) -> None:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{gateway.server.grpc_port}") as channel:
        stub = gateway_pb2_grpc.GatewayStub(channel)
        request = gateway_pb2.PublicGenerateRequest(prompt="x")
        request.stopping.max_new_tokens = 1
        request.sampling.logit_bias[3] = -5.0
        finals = [r async for r in stub.Generate(request) if r.HasField("final")]
        assert len(finals) == 1
        request.sampling.logit_bias[4] = 101.0
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            _ = [r async for r in stub.Generate(request)]
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert dict(upstreams.engine.submits[-1].sampling.logit_bias) == {3: -5.0}


# ----- cached tokens


async def test_cached_tokens_in_every_usage(
    http: httpx.AsyncClient, upstreams: FakeUpstreams, gateway: GatewayHandle
) -> None:
    upstreams.engine.cached_tokens = 2
    response = await http.post("/v1/completions", json={"model": MODEL, "prompt": "abc", "max_tokens": 1})
    assert response.json()["usage"]["prompt_tokens_details"] == {"cached_tokens": 2}
    body = {"model": MODEL, "prompt": "abc", "max_tokens": 1, "stream_options": {"include_usage": True}}
    chunks = await sse_chunks(http, body)
    assert chunks[-1]["usage"]["prompt_tokens_details"] == {"cached_tokens": 2}
    async with connect(f"ws://127.0.0.1:{gateway.port}/v1/ws") as ws:
        await send(ws, {"type": "generate", "id": "c", "prompt": "x", "params": {"max_tokens": 1}})
        assert (await collect(ws, {"c"}))["c"]["end"]["usage"]["cached_tokens"] == 2
    async with grpc.aio.insecure_channel(f"127.0.0.1:{gateway.server.grpc_port}") as channel:
        stub = gateway_pb2_grpc.GatewayStub(channel)
        request = gateway_pb2.PublicGenerateRequest(prompt="x")
        request.stopping.max_new_tokens = 1
        finals = [r.final async for r in stub.Generate(request) if r.HasField("final")]
        assert finals[0].usage.cached_tokens == 2


# ----- /tokenize, /detokenize, /v1/models, the default max tokens


async def test_tokenize_a_prompt_and_messages(http: httpx.AsyncClient) -> None:
    reply = await http.post("/tokenize", json={"model": MODEL, "prompt": "hey"})
    assert reply.status_code == 200
    assert reply.json() == {"count": 4, "max_model_len": 64, "tokens": encode("hey")}
    reply = await http.post("/tokenize", json={"prompt": "hey", "add_special_tokens": False})
    assert reply.json()["tokens"] == encode("hey")[1:]
    messages = [{"role": "user", "content": "hi"}]
    reply = await http.post("/tokenize", json={"messages": messages})
    assert reply.json()["tokens"] == encode("user: hi\nassistant: ")
    reply = await http.post("/tokenize", json={"messages": messages, "add_generation_prompt": False})
    assert reply.json()["tokens"] == encode("user: hi\n")


async def test_detokenize(http: httpx.AsyncClient) -> None:
    reply = await http.post("/detokenize", json={"model": MODEL, "tokens": encode("hey")})
    assert reply.status_code == 200
    assert reply.json() == {"prompt": chr(BOS) + "hey"}


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/tokenize", {"prompt": "a", "messages": [{"role": "user", "content": "a"}]}, None),
        ("/tokenize", {"prompt": 3}, "prompt"),
        ("/tokenize", {"prompt": "a", "add_generation_prompt": True}, "add_generation_prompt"),
        ("/tokenize", {"messages": [{"role": "user", "content": "a"}], "add_special_tokens": True},
         "add_special_tokens"),
        ("/tokenize", {"prompt": "a", "return_token_strs": True}, "return_token_strs"),
        ("/tokenize", {"prompt": "INVALID"}, None),
        ("/detokenize", {"tokens": [1, -2]}, "tokens"),
        ("/detokenize", {"tokens": "12"}, "tokens"),
        ("/detokenize", {"tokens": [1], "model": 5}, "model"),
    ],
)  # fmt: skip
async def test_bad_tokenize_requests_are_400(
    http: httpx.AsyncClient, path: str, body: dict[str, Any], param: str | None
) -> None:
    response = await http.post(path, json=body)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


async def test_tokenize_of_another_model_is_404(http: httpx.AsyncClient) -> None:
    response = await http.post("/tokenize", json={"model": "other", "prompt": "a"})
    assert response.status_code == 404


async def test_models_carry_the_context_length(http: httpx.AsyncClient) -> None:
    card = (await http.get("/v1/models")).json()["data"][0]
    assert (card["id"], card["max_model_len"]) == (MODEL, 64)


async def test_an_unset_max_tokens_reaches_the_engine_as_0(
    client: openai.AsyncOpenAI, upstreams: FakeUpstreams
) -> None:
    """The engine owns the context limit: an unset max tokens goes to it as 0, which it fills with the
    rest of its context (the fake does as the engine does)."""
    reply = await client.completions.create(model=MODEL, prompt="abcd")
    assert reply.usage is not None
    assert reply.usage.completion_tokens == upstreams.engine.max_model_len - len(encode("abcd"))
    assert upstreams.engine.submits[-1].stopping.max_new_tokens == 0


# ----- X-Request-Id


@pytest.mark.parametrize(
    ("method", "path", "body"),
    [
        ("POST", "/v1/completions", {"model": MODEL, "prompt": "a", "max_tokens": 1}),
        ("POST", "/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "a"}],
                                          "max_tokens": 1}),
        ("GET", "/v1/models", None),
        ("POST", "/tokenize", {"prompt": "a"}),
        ("POST", "/detokenize", {"tokens": [70]}),
        ("POST", "/v1/completions", {"model": MODEL, "prompt": "a", "temperature": 9}),  # an error
    ],
)  # fmt: skip
async def test_every_endpoint_returns_the_request_id(
    http: httpx.AsyncClient, method: str, path: str, body: dict[str, Any] | None
) -> None:
    response = await http.request(method, path, json=body, headers={"X-Request-Id": "req-7 ok"})
    assert response.headers["x-request-id"] == "req-7 ok"
    fresh = await http.request(method, path, json=body)
    assert len(fresh.headers["x-request-id"]) == 32


@pytest.mark.parametrize("asked", ["x" * 129, "tab\there", "é"])
async def test_an_invalid_request_id_is_replaced(http: httpx.AsyncClient, asked: str) -> None:
    body = {"model": MODEL, "prompt": "a", "max_tokens": 1}
    response = await http.post("/v1/completions", json=body, headers={"X-Request-Id": asked.encode()})
    assert response.status_code == 200
    returned = response.headers["x-request-id"]
    assert returned != asked and len(returned) == 32
    assert response.json()["id"] == f"cmpl-{returned}"


async def test_the_request_id_names_the_response_and_the_trace_span(
    http: httpx.AsyncClient, upstreams: FakeUpstreams, monkeypatch: pytest.MonkeyPatch
) -> None:
    traced: list[tuple[str, object]] = []

    class Recorded(observability.RequestTrace):
        def __init__(self, metrics: Any, request_id: str, api: str, context: Any, attributes: Any) -> None:
            traced.append((request_id, attributes.get("sluice.upstream_request_id")))
            super().__init__(metrics, request_id, api, context, attributes)

    monkeypatch.setattr(pipeline, "RequestTrace", Recorded)
    body = {"model": MODEL, "prompt": "a", "max_tokens": 1, "n": 2}
    response = await http.post("/v1/completions", json=body, headers={"X-Request-Id": "abc-123"})
    assert response.json()["id"] == "cmpl-abc-123"
    assert [name for name, _ in traced] == ["abc-123", "abc-123"]
    submitted = {s.request_id for s in upstreams.engine.submits}
    assert {upstream for _, upstream in traced} == submitted and len(submitted) == 2
    traced.clear()
    response = await http.post("/v1/completions", json=body)  # no id of its own: the gateway's names the span
    assert [name for name, _ in traced] == [s.request_id for s in upstreams.engine.submits[2:]]
    assert traced[0][0] != response.headers["x-request-id"] and traced[0][1] is None


async def test_grpc_request_id_names_the_trace_span(
    gateway: GatewayHandle, monkeypatch: pytest.MonkeyPatch
) -> None:
    traced: list[str] = []

    class Recorded(observability.RequestTrace):
        def __init__(self, metrics: Any, request_id: str, *args: Any) -> None:
            traced.append(request_id)
            super().__init__(metrics, request_id, *args)

    monkeypatch.setattr(pipeline, "RequestTrace", Recorded)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{gateway.server.grpc_port}") as channel:
        stub = gateway_pb2_grpc.GatewayStub(channel)
        for given in ("mine", "x" * 129):
            request = gateway_pb2.PublicGenerateRequest(prompt="x", request_id=given)
            request.stopping.max_new_tokens = 1
            ids = {r.request_id async for r in stub.Generate(request)}
            assert ids == {traced[-1]}
    assert traced[0] == "mine" and traced[1] != "x" * 129
