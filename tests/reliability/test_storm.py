"""A disconnect storm against one real stack: 100 clients (half WebSocket, half SSE) stream long
generations, and once all of them are mid-stream every one leaves at once, in four ways (a WebSocket
close handshake, a WebSocket connection reset, an SSE response closed, an SSE connection reset).
Afterwards the engine runs and waits for nothing, its KV free list is full again, the gateway has
nothing in flight, and a new request completes."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import struct
import time
from collections.abc import AsyncIterator

import httpx
import pytest
from websockets.asyncio.client import ClientConnection, connect

from tests.reliability.conftest import WAIT_S, RealStack

pytestmark = pytest.mark.e2e

CLIENTS = 100
LONG = 1900  # tokens: far more than a client sees before it leaves (the context is 2048)
PARAMS = {"temperature": 0, "max_tokens": LONG, "ignore_eos": True}
RUNNING_WITHIN_S = 120.0  # every client mid-stream; normally a few seconds


def reset_on_close(sock: socket.socket) -> None:
    """Closing `sock` will reset the connection (RST) instead of closing it in order (FIN)."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))


async def ws_client(stack: RealStack, i: int, streaming: asyncio.Event, leave: asyncio.Event) -> None:
    """Streams over a WebSocket; leaves with a close handshake (even i) or by resetting the TCP
    connection (odd i)."""
    ws: ClientConnection = await connect(stack.ws_url, open_timeout=WAIT_S)
    try:
        frame = {
            "type": "generate",
            "id": f"c{i}",
            "prompt": f"Story {i}: once upon a time",
            "params": PARAMS,
        }
        await ws.send(json.dumps(frame))
        reply = json.loads(await asyncio.wait_for(ws.recv(), WAIT_S))
        assert reply["type"] == "delta", reply
        streaming.set()
        await leave.wait()
    finally:
        if i % 2:
            reset_on_close(ws.transport.get_extra_info("socket"))
            ws.transport.abort()
        else:
            await ws.close()


async def sse_client(stack: RealStack, i: int, streaming: asyncio.Event, leave: asyncio.Event) -> None:
    """Streams SSE on a connection of its own; leaves by closing the response (even i) or by resetting
    the TCP connection (odd i)."""
    body = {"model": stack.model, "prompt": f"Story {i}: once upon a time", "stream": True, **PARAMS}
    client = httpx.AsyncClient(base_url=stack.http_url, timeout=WAIT_S)
    try:
        async with client.stream("POST", "/v1/completions", json=body) as response:
            assert response.status_code == 200
            lines: AsyncIterator[str] = response.aiter_lines()  # held: finalizing it closes the connection
            async for line in lines:
                if line.startswith("data: ") and json.loads(line[6:])["choices"][0]["text"]:
                    break
            streaming.set()
            await leave.wait()
            if i % 2:
                reset_on_close(response.extensions["network_stream"].get_extra_info("socket"))
    finally:
        with contextlib.suppress(httpx.HTTPError, OSError):
            await client.aclose()


async def wait_running(stack: RealStack, count: int) -> None:
    """Polls the engine until `count` requests run (its figures may lag a step)."""
    deadline = time.monotonic() + RUNNING_WITHIN_S
    while (stats := await stack.engine_stats()).running != count:
        assert time.monotonic() < deadline, f"{count} requests not running: {stats}"
        await asyncio.sleep(0.05)


async def test_a_storm_of_clients_leaving_mid_stream_frees_everything(real_stack: RealStack) -> None:
    await real_stack.wait_quiet()
    leave = asyncio.Event()
    streaming = [asyncio.Event() for _ in range(CLIENTS)]
    clients = [
        asyncio.ensure_future((ws_client if i % 4 < 2 else sse_client)(real_stack, i, streaming[i], leave))
        for i in range(CLIENTS)
    ]
    try:
        await asyncio.wait_for(asyncio.gather(*(event.wait() for event in streaming)), RUNNING_WITHIN_S)
        await wait_running(real_stack, CLIENTS)
        began = time.monotonic()
        leave.set()
        await asyncio.wait_for(asyncio.gather(*clients), WAIT_S)
    finally:
        leave.set()
        for client in clients:
            client.cancel()
        await asyncio.gather(*clients, return_exceptions=True)
    quiet = await real_stack.wait_quiet()
    print(f"{CLIENTS} clients left; quiet {1000 * (time.monotonic() - began):.0f} ms later: {quiet}")
    assert await real_stack.health() == dict.fromkeys(
        ("gateway", "tokenizer", "engine", "detokenizer"), "SERVING"
    )
    body = {"model": real_stack.model, "prompt": "After the storm", **PARAMS, "max_tokens": 4}
    async with httpx.AsyncClient(base_url=real_stack.http_url, timeout=WAIT_S) as http:
        reply = await http.post("/v1/completions", json=body)
    assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] == 4
