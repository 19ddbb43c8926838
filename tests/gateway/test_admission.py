"""Admission control (in-flight cap, prompt cap, body and frame size) and API keys, on every API."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import grpc
import httpx
import openai
import pytest
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed

from gateway import routing
from gateway.server import GatewayHandle
from services.common.block_keys import chain_hashes
from services.common.pb import common_pb2, engine_pb2, gateway_pb2, gateway_pb2_grpc
from tests.gateway.conftest import WAIT_S, collect, recv, send
from tests.gateway.fakes import MODEL, FakeUpstreams, expected_text, start_upstreams

MakeGateway = Callable[..., Awaitable[GatewayHandle]]
LONG = 10**6


def oai(server: GatewayHandle, key: str = "unused") -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(
        base_url=f"http://127.0.0.1:{server.port}/v1", api_key=key, max_retries=0, timeout=WAIT_S
    )


async def test_in_flight_cap_refuses_at_once_on_every_api(make_gateway: MakeGateway) -> None:
    server = await make_gateway(max_in_flight=1, retry_after_s=7)
    async with connect(f"ws://127.0.0.1:{server.port}/v1/ws") as ws:
        await send(ws, {"type": "generate", "id": "busy", "prompt": "x", "params": {"max_tokens": LONG}})
        assert (await recv(ws))["type"] == "delta"
        # WebSocket
        await send(ws, {"type": "generate", "id": "more", "prompt": "x"})
        end = (await collect(ws, {"more"}, skip=frozenset({"busy"})))["more"]["end"]
        assert end["type"] == "error" and end["code"] == "resource_exhausted"
        # OpenAI HTTP, streaming or not: 429 with Retry-After
        async with oai(server) as client:
            for stream in (False, True):
                with pytest.raises(openai.RateLimitError) as caught:
                    await client.completions.create(model=MODEL, prompt="x", stream=stream)
                assert caught.value.response.headers["retry-after"] == "7"
        # gRPC
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.server.grpc_port}") as channel:
            call = gateway_pb2_grpc.GatewayStub(channel).Generate(
                gateway_pb2.PublicGenerateRequest(prompt="x"), timeout=WAIT_S
            )
            with pytest.raises(grpc.aio.AioRpcError) as rpc_error:
                await call.read()
            assert rpc_error.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        # Once the first one ends, there is room again.
        await send(ws, {"type": "cancel", "id": "busy"})
        await collect(ws, {"busy"})
        await send(ws, {"type": "generate", "id": "again", "prompt": "x", "params": {"max_tokens": 2}})
        assert (await collect(ws, {"again"}))["again"]["text"] == expected_text(2)


async def test_prompt_token_cap(make_gateway: MakeGateway, upstreams: FakeUpstreams) -> None:
    server = await make_gateway(max_prompt_tokens=4)
    async with connect(f"ws://127.0.0.1:{server.port}/v1/ws") as ws:
        await send(ws, {"type": "generate", "id": "big", "prompt": "far too long"})
        end = (await collect(ws, {"big"}))["big"]["end"]
        assert end["code"] == "invalid_argument" and "tokens" in end["message"]
        await send(ws, {"type": "generate", "id": "ok", "prompt": "abc", "params": {"max_tokens": 1}})
        assert (await collect(ws, {"ok"}))["ok"]["end"]["type"] == "done"
    async with oai(server) as client:
        with pytest.raises(openai.BadRequestError):
            await client.completions.create(model=MODEL, prompt="far too long")
    assert len(upstreams.engine.submits) == 1


async def test_body_size_cap(make_gateway: MakeGateway) -> None:
    server = await make_gateway(max_body_bytes=200)
    body = {"model": MODEL, "prompt": "x" * 500}
    async with httpx.AsyncClient(timeout=WAIT_S) as http:
        response = await http.post(f"http://127.0.0.1:{server.port}/v1/completions", json=body)
    assert response.status_code == 413
    assert "larger than 200 bytes" in response.json()["error"]["message"]


async def test_websocket_frame_size_cap(make_gateway: MakeGateway) -> None:
    server = await make_gateway(max_ws_frame_bytes=1000)
    async with connect(f"ws://127.0.0.1:{server.port}/v1/ws") as ws:
        await send(ws, {"type": "generate", "id": "big", "prompt": "x" * 2000})
        with pytest.raises(ConnectionClosed) as caught:
            await recv(ws)
    assert caught.value.rcvd is not None and caught.value.rcvd.code == 1009


async def test_api_keys_on_http(make_gateway: MakeGateway) -> None:
    server = await make_gateway(api_keys=("k1", "k2"))
    async with oai(server, "wrong") as client:
        with pytest.raises(openai.AuthenticationError) as caught:
            await client.models.list()
        assert isinstance(caught.value.body, dict) and caught.value.body["code"] == "invalid_api_key"
        with pytest.raises(openai.AuthenticationError):
            await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}])
    async with oai(server, "k2") as client:
        reply = await client.completions.create(model=MODEL, prompt="x", max_tokens=2)
        assert reply.choices[0].text == expected_text(2)
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{server.port}", timeout=WAIT_S) as http:
        assert (await http.get("/healthz")).status_code == 200
        assert (await http.get("/")).status_code == 200
        assert (await http.get("/v1/models")).status_code == 401


async def test_api_keys_from_a_file(make_gateway: MakeGateway, tmp_path) -> None:  # type: ignore[no-untyped-def]
    keys = tmp_path / "keys"
    keys.write_text("# one key a line\n\nfile-key\n")
    server = await make_gateway(api_keys_file=str(keys))
    async with oai(server, "file-key") as client:
        assert [m.id for m in (await client.models.list()).data] == [MODEL]


async def test_api_keys_on_the_websocket(make_gateway: MakeGateway) -> None:
    server = await make_gateway(api_keys=("k1",))
    url = f"ws://127.0.0.1:{server.port}/v1/ws"
    generate = {"type": "generate", "id": "g", "prompt": "x", "params": {"max_tokens": 2}}
    # No key: the first frame is refused and the socket closed with 1008.
    async with connect(url) as ws:
        await send(ws, generate)
        frame = await recv(ws)
        assert frame["code"] == "unauthenticated" and frame["id"] == "g"
        with pytest.raises(ConnectionClosed) as caught:
            await recv(ws)
        assert caught.value.rcvd is not None and caught.value.rcvd.code == 1008
    # A wrong key in the first frame.
    async with connect(url) as ws:
        await ws.send(json.dumps({"type": "auth", "token": "nope"}))
        assert (await recv(ws))["code"] == "unauthenticated"
    # The key in the first frame, then in the handshake header.
    async with connect(url) as ws:
        await ws.send(json.dumps({"type": "auth", "token": "k1"}))
        await send(ws, generate)
        assert (await collect(ws, {"g"}))["g"]["text"] == expected_text(2)
    async with connect(url, additional_headers={"Authorization": "Bearer k1"}) as ws:
        await send(ws, generate)
        assert (await collect(ws, {"g"}))["g"]["text"] == expected_text(2)
    async with connect(url, additional_headers={"Authorization": "Bearer bad"}) as ws:
        assert (await recv(ws))["code"] == "unauthenticated"


async def test_api_keys_on_grpc(make_gateway: MakeGateway) -> None:
    server = await make_gateway(api_keys=("k1",))
    request = gateway_pb2.PublicGenerateRequest(
        prompt="x", stopping=common_pb2.StoppingParams(max_new_tokens=2)
    )
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.server.grpc_port}") as channel:
        stub = gateway_pb2_grpc.GatewayStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            async for _ in stub.Generate(request, timeout=WAIT_S):
                pass
        assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED
        text = ""
        async for response in stub.Generate(
            request, timeout=WAIT_S, metadata=(("authorization", "Bearer k1"),)
        ):
            text += response.delta.text
        assert text == expected_text(2)


async def test_a_prompt_past_the_context_length_is_refused_before_it_is_hashed(
    make_gateway: MakeGateway, upstreams: FakeUpstreams, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Routing hashes a prompt's blocks on the event loop: a prompt that leaves the model's context
    (4096 here) no room for a token is refused before any block is hashed, by the engine's own rule
    (prompt < context), and one within it hashes at most the context length's blocks."""
    second = await start_upstreams()
    upstreams.tokenizer.context_length = 4096
    upstreams.engine.max_model_len = second.engine.max_model_len = 4096
    report = engine_pb2.EngineReport(
        snapshot=True, prefix_caching=True, load=engine_pb2.EngineLoad(block_size=16)
    )
    upstreams.engine.report = second.engine.report = report
    hashed: list[int] = []

    def counting(ids: Sequence[int], block_size: int, *args: Any) -> list[bytes]:
        hashed.append(len(ids) // block_size)
        return chain_hashes(ids, block_size, *args)

    monkeypatch.setattr(routing, "chain_hashes", counting)
    server = await make_gateway(engine=(upstreams.addresses["engine"], second.addresses["engine"]))
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{server.port}", timeout=WAIT_S) as http:
            engines = server.core._stages.engines
            async with asyncio.timeout(WAIT_S):
                while len(engines.connected()) < 2:
                    await asyncio.sleep(0.01)
                warm = await http.post(
                    "/v1/completions", json={"model": MODEL, "prompt": "w", "max_tokens": 1}
                )
                assert warm.status_code == 200  # each engine now has a link, and reports
                while len(engines.picker._views) < 2:
                    await asyncio.sleep(0.01)
            big = await http.post("/v1/completions", json={"model": MODEL, "prompt": "a" * (1 << 20)})
            full = await http.post("/v1/completions", json={"model": MODEL, "prompt": "a" * 4095})  # + bos
            assert hashed == []
            fits = await http.post(
                "/v1/completions", json={"model": MODEL, "prompt": "b" * 4000, "max_tokens": 2}
            )
    finally:
        await second.stop()
    assert big.status_code == 400, big.text
    assert "more than the 4095 allowed (the context length is 4096" in big.json()["error"]["message"]
    assert full.status_code == 400 and "the prompt has 4096 tokens" in full.json()["error"]["message"]
    assert fits.status_code == 200, fits.text
    assert hashed and max(hashed) <= 4096 // 16
