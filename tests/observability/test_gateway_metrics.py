"""The gateway's `/metrics` and its reading of trace context, against fake upstream services (no
tracer provider in this process: spans are checked in test_trace_e2e.py)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import httpx
import pytest
from websockets.asyncio.client import connect

from gateway.server import GatewayHandle, create_server
from tests.gateway.conftest import collect, gateway_settings, recv, send
from tests.gateway.fakes import FakeUpstreams, start_upstreams
from tests.observability.processes import parse_metrics

TRACEPARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


@pytest.fixture
async def gateway() -> AsyncIterator[tuple[GatewayHandle, FakeUpstreams]]:
    upstreams = await start_upstreams()
    server = await create_server(gateway_settings(upstreams))
    await server.start()
    yield server, upstreams
    await server.stop(0.5)
    await upstreams.stop()


async def _metrics(server: GatewayHandle) -> dict[str, float]:
    async with httpx.AsyncClient() as client:
        reply = await client.get(f"http://127.0.0.1:{server.port}/metrics")
    assert reply.status_code == 200
    assert reply.headers["content-type"].startswith("text/plain")
    return parse_metrics(reply.text)


async def test_metrics_count_websocket_generations(gateway: tuple[GatewayHandle, FakeUpstreams]) -> None:
    server, _ = gateway
    async with connect(f"ws://127.0.0.1:{server.port}/v1/ws") as ws:
        await send(
            ws,
            {
                "type": "generate",
                "id": "a",
                "prompt": "Once",
                "params": {"max_tokens": 5},
                "traceparent": TRACEPARENT,
            },
        )
        await send(ws, {"type": "generate", "id": "b", "prompt": "Upon", "params": {"max_tokens": 3}})
        results = await collect(ws, {"a", "b"})
    assert {r["end"]["finish_reason"] for r in results.values()} == {"length"}
    samples = await _metrics(server)
    assert samples['sluice_gateway_requests_total{api="ws",outcome="length"}'] == 2
    assert samples["sluice_gateway_time_to_first_token_seconds_count"] == 2
    assert samples["sluice_gateway_e2e_request_latency_seconds_count"] == 2
    assert samples["sluice_gateway_requests_in_flight"] == 0
    for stage in ("tokenize", "engine_first_token", "detokenize"):
        assert samples[f'sluice_gateway_stage_duration_seconds_count{{stage="{stage}"}}'] == 2, stage
    assert (
        samples["sluice_gateway_e2e_request_latency_seconds_sum"]
        >= samples["sluice_gateway_time_to_first_token_seconds_sum"]
    )


async def test_bad_traceparent_field_is_refused(gateway: tuple[GatewayHandle, FakeUpstreams]) -> None:
    server, upstreams = gateway
    async with connect(f"ws://127.0.0.1:{server.port}/v1/ws") as ws:
        await send(ws, {"type": "generate", "id": "x", "prompt": "hi", "traceparent": 7})
        frame = await recv(ws)
    assert frame["type"] == "error" and frame["id"] == "x"
    assert "traceparent" in frame["message"]
    assert upstreams.tokenizer.requests == []


async def test_openai_requests_are_counted_by_api(gateway: tuple[GatewayHandle, FakeUpstreams]) -> None:
    server, _ = gateway
    async with httpx.AsyncClient(timeout=10) as client:
        reply = await client.post(
            f"http://127.0.0.1:{server.port}/v1/completions",
            json={"prompt": "Once", "max_tokens": 4},
            headers={"traceparent": TRACEPARENT},
        )
    assert reply.status_code == 200, reply.text
    samples = await _metrics(server)
    assert samples['sluice_gateway_requests_total{api="completions",outcome="length"}'] == 1
