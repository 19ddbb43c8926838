"""Error classes at the edges: oversized bodies are 413 before they are read, every 5xx is OpenAI-style
JSON, deadlines are deadline_exceeded (HTTP 504), and no client sees an internal address or a trace."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
import httpx
import pytest
from websockets.asyncio.client import connect

from gateway.server import GatewayHandle
from services.common.pb import gateway_pb2, gateway_pb2_grpc
from tests.gateway.conftest import WAIT_S, collect, dead_address, send
from tests.gateway.fakes import FakeUpstreams

LONG = 10**6  # max_tokens of a generation that runs until it is stopped
INTERNAL_ADDRESS = "127.0.0.1"  # every upstream of these tests listens there

MakeGateway = Callable[..., Awaitable[GatewayHandle]]


def http_client(server: GatewayHandle) -> httpx.AsyncClient:
    return httpx.AsyncClient(base_url=f"http://127.0.0.1:{server.port}", timeout=WAIT_S)


def assert_openai_json(response: httpx.Response, status: int) -> dict[str, Any]:
    assert response.status_code == status
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert INTERNAL_ADDRESS not in response.text and "Traceback" not in response.text
    return error


async def test_declared_oversized_body_is_413_before_it_is_sent(gateway: GatewayHandle) -> None:
    """The client declares 12 MiB and sends none of it: the answer comes from the header alone."""
    reader, writer = await asyncio.open_connection("127.0.0.1", gateway.port)
    head = (
        "POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        f"Content-Length: {12 * 1024 * 1024}\r\n\r\n"
    )
    writer.write(head.encode())
    await writer.drain()
    status_line = await asyncio.wait_for(reader.readline(), WAIT_S)
    writer.close()
    assert status_line.split()[1] == b"413"


async def test_client_sending_12_mib_reads_413_and_keeps_its_connection(gateway: GatewayHandle) -> None:
    async with http_client(gateway) as http:
        response = await http.post("/v1/completions", content=b"x" * (12 * 1024 * 1024))
        assert assert_openai_json(response, 413)["code"] == "request_too_large"
        assert (await http.get("/v1/models")).status_code == 200


async def test_streamed_oversized_body_is_413(make_gateway: MakeGateway) -> None:
    server = await make_gateway(max_body_bytes=1024)

    async def chunks() -> AsyncIterator[bytes]:  # no Content-Length: chunked transfer
        yield b'{"prompt": "'
        for _ in range(8):
            yield b"x" * 512

    async with http_client(server) as http:
        response = await http.post("/v1/completions", content=chunks())
    assert assert_openai_json(response, 413)["code"] == "request_too_large"


async def test_unexpected_failure_is_a_json_500_without_internals(
    gateway: GatewayHandle, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def broken() -> None:
        raise RuntimeError(f"engine at {INTERNAL_ADDRESS}:42804: failed to connect")

    monkeypatch.setattr(gateway.core, "model_info", broken)
    async with http_client(gateway) as http:
        response = await http.get("/v1/models")
    error = assert_openai_json(response, 500)
    assert (error["message"], error["type"]) == ("internal error", "server_error")


async def test_unexpected_failure_over_grpc_is_internal_without_internals(
    gateway: GatewayHandle, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(*_: object) -> None:
        raise RuntimeError(f"engine at {INTERNAL_ADDRESS}:42804: failed to connect")

    monkeypatch.setattr(gateway.core, "generate", broken)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{gateway.server.grpc_port}") as channel:
        call = gateway_pb2_grpc.GatewayStub(channel).Generate(
            gateway_pb2.PublicGenerateRequest(prompt="x"), timeout=WAIT_S
        )
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            async for _ in call:
                pass
    assert (caught.value.code(), caught.value.details()) == (grpc.StatusCode.INTERNAL, "internal error")


async def test_broken_engine_stream_is_engine_unavailable_without_its_address(
    gateway: GatewayHandle, upstreams: FakeUpstreams
) -> None:
    upstreams.engine.fail_next_submit = True
    async with http_client(gateway) as http:
        response = await http.post("/v1/completions", json={"prompt": "x", "max_tokens": LONG})
    error = assert_openai_json(response, 503)
    assert (error["message"], error["code"]) == ("engine unavailable", "unavailable")


async def test_unreachable_tokenizer_is_unavailable_without_its_address(make_gateway: MakeGateway) -> None:
    server = await make_gateway(tokenizer=(dead_address(),), upstream_wait_s=0.2)
    async with connect(f"ws://127.0.0.1:{server.port}/v1/ws") as client:
        await send(client, {"type": "generate", "id": "u", "prompt": "x"})
        end = (await collect(client, {"u"}))["u"]["end"]
    assert (end["code"], end["message"]) == ("unavailable", "tokenizer unavailable")
    async with http_client(server) as http:
        response = await http.get("/v1/models")
    assert assert_openai_json(response, 503)["message"] == "tokenizer unavailable"


async def test_deadline_is_504_with_a_json_body(make_gateway: MakeGateway) -> None:
    server = await make_gateway(request_timeout_s=0.2)
    async with http_client(server) as http:
        response = await http.post("/v1/completions", content=json.dumps({"prompt": "x", "max_tokens": LONG}))
    error = assert_openai_json(response, 504)
    assert error["code"] == "deadline_exceeded"


@pytest.mark.parametrize(
    ("error", "status"),
    [
        ("invalid_argument: the prompt is too long", 400),
        ("deadline_exceeded: deadline exceeded", 504),
        ("unavailable: engine loop stopped", 503),
        (f"internal: step failed near {INTERNAL_ADDRESS}", 500),
    ],
)
async def test_engine_error_classes_over_http(
    gateway: GatewayHandle, upstreams: FakeUpstreams, error: str, status: int
) -> None:
    upstreams.engine.error_next_submit = error
    async with http_client(gateway) as http:
        response = await http.post("/v1/completions", json={"prompt": "x"})
    assert_openai_json(response, status)
