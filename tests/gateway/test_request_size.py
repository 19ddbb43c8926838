"""One request's size is capped on every API (`params.check_generations`, `check_request_tokens`): at
most `max_generations` generations (OpenAI: prompts times n) and at most `max_request_tokens` tokens
asked for over them (a generation without max_tokens counts as the whole context; default cap: 16
contexts), refused with 400 / INVALID_ARGUMENT naming the limit, before anything reaches a stage. The
fake engine's context is `FakeEngine.max_model_len` (64) tokens."""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from typing import Any

import grpc
import httpx
import pytest
from websockets.asyncio.client import connect

from gateway import params
from gateway.params import REQUEST_CONTEXTS, ParamError
from gateway.server import GatewayHandle
from gateway.settings import GatewaySettings
from services.common.pb import common_pb2, gateway_pb2, gateway_pb2_grpc
from tests.gateway.conftest import WAIT_S, collect
from tests.gateway.fakes import MODEL, FakeUpstreams

MakeGateway = Callable[..., Awaitable[GatewayHandle]]


async def post(server: GatewayHandle, path: str, body: dict[str, Any]) -> httpx.Response:
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{server.port}", timeout=WAIT_S) as http:
        return await http.post(path, json={"model": MODEL, **body})


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/completions", {"prompt": "a", "n": 65, "max_tokens": 1}),
        ("/v1/completions", {"prompt": ["a"] * 8, "n": 9, "max_tokens": 1}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}], "n": 65, "max_tokens": 1}),
    ],
)
async def test_more_generations_than_the_cap_are_400(
    make_gateway: MakeGateway, upstreams: FakeUpstreams, path: str, body: dict[str, Any]
) -> None:
    server = await make_gateway()
    response = await post(server, path, body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert (
        error["param"] == "n" and "at most 64" in error["message"] and "--max-generations" in error["message"]
    )
    assert upstreams.engine.submits == [] and upstreams.tokenizer.requests == []


async def test_the_generation_cap_is_a_setting(make_gateway: MakeGateway, upstreams: FakeUpstreams) -> None:
    server = await make_gateway(max_generations=4)
    assert (
        await post(server, "/v1/completions", {"prompt": ["a", "b"], "n": 2, "max_tokens": 1})
    ).status_code == 200
    refused = await post(server, "/v1/completions", {"prompt": ["a", "b"], "n": 3, "max_tokens": 1})
    assert refused.status_code == 400 and "asks for 6 generations" in refused.json()["error"]["message"]


async def test_generations_without_max_tokens_count_the_whole_context(
    make_gateway: MakeGateway, upstreams: FakeUpstreams
) -> None:
    """By default a request may ask for 16 contexts: 16 generations without max_tokens pass, 17 do
    not; with max_tokens set, as many as fit (and a max_tokens past the context counts as the context)."""
    server = await make_gateway()
    assert (await post(server, "/v1/completions", {"prompt": "a", "n": REQUEST_CONTEXTS})).status_code == 200
    refused = await post(server, "/v1/completions", {"prompt": "a", "n": REQUEST_CONTEXTS + 1})
    assert refused.status_code == 400, refused.text
    error = refused.json()["error"]
    assert error["param"] == "max_tokens"
    assert f"up to {(REQUEST_CONTEXTS + 1) * 64} tokens" in error["message"]
    assert (
        f"at most {REQUEST_CONTEXTS * 64}" in error["message"] and "--max-request-tokens" in error["message"]
    )
    fits = {"prompt": ["a", "b"], "n": 32, "max_tokens": 16}
    assert (await post(server, "/v1/completions", fits)).status_code == 200


async def test_a_max_tokens_past_the_context_counts_as_the_context() -> None:
    async def context() -> int:
        return 64

    await params.check_request_tokens([10**6] * 3, 200, context)  # 3 contexts: 192 tokens
    with pytest.raises(ParamError, match="up to 256 tokens over its 4 generation"):
        await params.check_request_tokens([10**6] * 4, 200, context)


async def test_the_token_cap_on_chat_completions(make_gateway: MakeGateway, upstreams: FakeUpstreams) -> None:
    server = await make_gateway(max_request_tokens=100)
    messages = [{"role": "user", "content": "a"}]
    ok = await post(server, "/v1/chat/completions", {"messages": messages, "n": 2, "max_tokens": 50})
    assert ok.status_code == 200, ok.text
    submitted = len(upstreams.engine.submits)
    refused = await post(
        server, "/v1/chat/completions", {"messages": messages, "n": 2, "max_completion_tokens": 51}
    )
    assert refused.status_code == 400
    assert (
        "up to 102 tokens" in refused.json()["error"]["message"]
        and "at most 100" in refused.json()["error"]["message"]
    )
    assert len(upstreams.engine.submits) == submitted


async def test_the_token_cap_on_the_websocket(make_gateway: MakeGateway, upstreams: FakeUpstreams) -> None:
    server = await make_gateway(max_request_tokens=50)
    async with connect(f"ws://127.0.0.1:{server.port}/v1/ws") as ws:
        frames = [
            {"type": "generate", "id": "fits", "prompt": "a", "params": {"max_tokens": 50}},
            {"type": "generate", "id": "over", "prompt": "a", "params": {"max_tokens": 51}},
            {"type": "generate", "id": "context", "prompt": "a"},  # the 64-token context
        ]
        for frame in frames:
            await ws.send(json.dumps(frame))
        results = await collect(ws, {"fits", "over", "context"})
    assert results["fits"]["end"]["type"] == "done"
    for refused in ("over", "context"):
        end = results[refused]["end"]
        assert (end["type"], end["code"]) == ("error", "invalid_argument"), end
        assert "at most 50" in end["message"] and "--max-request-tokens" in end["message"]
    assert [s.stopping.max_new_tokens for s in upstreams.engine.submits] == [50]


async def test_the_token_cap_on_the_grpc_api(make_gateway: MakeGateway, upstreams: FakeUpstreams) -> None:
    server = await make_gateway(max_request_tokens=50)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.server.grpc_port}") as channel:
        stub = gateway_pb2_grpc.GatewayStub(channel)
        for max_new_tokens in (51, 0):  # 0: none given, the 64-token context
            request = gateway_pb2.PublicGenerateRequest(
                prompt="a", stopping=common_pb2.StoppingParams(max_new_tokens=max_new_tokens)
            )
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                async for _ in stub.Generate(request, timeout=WAIT_S):
                    pass
            assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "at most 50" in (caught.value.details() or "")
        request = gateway_pb2.PublicGenerateRequest(
            prompt="a", stopping=common_pb2.StoppingParams(max_new_tokens=50)
        )
        replies = [reply async for reply in stub.Generate(request, timeout=WAIT_S)]
    assert replies[-1].WhichOneof("kind") == "final"
    assert [s.stopping.max_new_tokens for s in upstreams.engine.submits] == [50]


def test_the_caps_are_validated() -> None:
    with pytest.raises(ValueError, match="max_generations"):
        GatewaySettings(max_generations=0)
    with pytest.raises(ValueError, match="max_request_tokens"):
        GatewaySettings(max_request_tokens=-1)
