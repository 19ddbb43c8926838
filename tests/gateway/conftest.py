"""A gateway on free ports in front of fake upstream services, all in the test's event loop."""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import replace
from typing import Any

import httpx
import openai
import pytest
from websockets.asyncio.client import ClientConnection, connect

from gateway.server import GatewayHandle, create_server
from gateway.settings import GatewaySettings
from tests.gateway.fakes import FakeUpstreams, start_upstreams

WAIT_S = 10.0  # upper bound on any single wait; tests normally finish far sooner


def dead_address() -> str:
    """A loopback address where nothing listens."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{sock.getsockname()[1]}"


def gateway_settings(upstreams: FakeUpstreams, **overrides: Any) -> GatewaySettings:
    settings = GatewaySettings(
        port=0,
        grpc_port=0,
        tokenizer=(upstreams.addresses["tokenizer"],),
        engine=(upstreams.addresses["engine"],),
        detokenizer=(upstreams.addresses["detokenizer"],),
        grace_s=0.5,
        health_timeout_s=1.0,
    )
    return replace(settings, **overrides)


@pytest.fixture
async def upstreams() -> AsyncIterator[FakeUpstreams]:
    fakes = await start_upstreams()
    yield fakes
    await fakes.stop()


@pytest.fixture
async def gateway(upstreams: FakeUpstreams) -> AsyncIterator[GatewayHandle]:
    server = await create_server(gateway_settings(upstreams))
    await server.start()
    yield server
    await server.stop(0.5)


@pytest.fixture
async def make_gateway(upstreams: FakeUpstreams) -> AsyncIterator[Callable[..., Awaitable[GatewayHandle]]]:
    """A factory of started gateways with settings overridden; all are shut down at the end."""
    servers: list[GatewayHandle] = []

    async def make(**overrides: Any) -> GatewayHandle:
        server = await create_server(gateway_settings(upstreams, **overrides))
        await server.start()
        servers.append(server)
        return server

    yield make
    for server in servers:
        await server.stop(0.1)


@pytest.fixture
async def client(gateway: GatewayHandle) -> AsyncIterator[openai.AsyncOpenAI]:
    async with openai.AsyncOpenAI(
        base_url=f"http://127.0.0.1:{gateway.port}/v1", api_key="unused", max_retries=0, timeout=WAIT_S
    ) as oai:
        yield oai


@pytest.fixture
async def http(gateway: GatewayHandle) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{gateway.port}", timeout=WAIT_S) as raw:
        yield raw


@pytest.fixture
async def ws(gateway: GatewayHandle) -> AsyncIterator[ClientConnection]:
    async with connect(f"ws://127.0.0.1:{gateway.port}/v1/ws") as client:
        yield client


async def send(client: ClientConnection, frame: dict[str, Any]) -> None:
    await client.send(json.dumps(frame))


async def recv(client: ClientConnection) -> dict[str, Any]:
    return json.loads(await asyncio.wait_for(client.recv(), WAIT_S))


async def collect(
    client: ClientConnection, ids: set[str], *, skip: frozenset[str] = frozenset()
) -> dict[str, dict[str, Any]]:
    """Reads frames until every id in `ids` has its terminal frame, skipping frames of the ids in
    `skip` (any other id fails). Returns id → {"text": joined deltas, "end": the terminal frame,
    "frames": every frame of that id}."""
    results: dict[str, dict[str, Any]] = {i: {"text": "", "end": None, "frames": []} for i in ids}
    pending = set(ids)
    while pending:
        frame = await recv(client)
        if frame["id"] in skip:
            continue
        result = results[frame["id"]]
        assert result["end"] is None, f"frame after the terminal frame: {frame}"
        result["frames"].append(frame)
        if frame["type"] == "delta":
            result["text"] += frame["text"]
        else:
            result["end"] = frame
            pending.discard(frame["id"])
    return results


async def wait_for(event: asyncio.Event) -> None:
    await asyncio.wait_for(event.wait(), WAIT_S)


async def until(condition: Callable[[], bool], timeout_s: float = WAIT_S, poll_s: float = 0.01) -> None:
    """Returns once `condition()` holds, checking every `poll_s`; TimeoutError after `timeout_s`."""
    async with asyncio.timeout(timeout_s):
        while not condition():
            await asyncio.sleep(poll_s)
