"""The gateway in front of the real tokenizer, engine and detokenizer (in this process, tiny model):
every way a client can leave frees the engine: running requests and free KV blocks are back to
their idle values soon after (the time taken is printed; run with -s to see it)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

import grpc
import httpx
import pytest
from websockets.asyncio.client import connect

from gateway.server import GatewayHandle, create_server
from gateway.settings import GatewaySettings
from services.common.pb import common_pb2, engine_pb2, engine_pb2_grpc, gateway_pb2, gateway_pb2_grpc
from services.detokenizer.server import create_server as create_detokenizer
from services.detokenizer.settings import DetokenizerSettings
from services.engine.server import create_server as create_engine
from services.engine.settings import EngineSettings
from services.tokenizer.server import create_server as create_tokenizer
from services.tokenizer.settings import TokenizerSettings
from tests.gateway.conftest import WAIT_S, collect, recv, send

# The engine frees an aborted request before its next step: about 10-100 ms here. The bound is far above
# that, so a loaded machine never fails the test, and far below the 100,000 tokens a request that was
# not aborted would run for. Every request ignores EOS: the random model may pick it at a near-tie, and a
# request that ended by itself would prove nothing about leaving.
IDLE_WITHIN_S = 10.0
LONG = 100_000


@dataclass
class Stack:
    gateway: GatewayHandle
    engine: engine_pb2_grpc.EngineStub
    model: str

    async def stats(self) -> engine_pb2.StatsResponse:
        return await self.engine.Stats(engine_pb2.StatsRequest(), timeout=WAIT_S)

    async def assert_running(self) -> None:
        """Waits until the engine counts the one request (its figures may lag its outputs by a step)."""
        deadline = time.monotonic() + WAIT_S
        while (stats := await self.stats()).running + stats.waiting != 1:
            assert time.monotonic() < deadline, f"the request is not running: {stats}"
            await asyncio.sleep(0.01)

    async def assert_idle_soon(self) -> None:
        """Polls the engine's figures until idle; fails if that takes longer than IDLE_WITHIN_S."""
        start = time.monotonic()
        deadline = start + IDLE_WITHIN_S
        while True:
            stats = await self.stats()
            if stats.running == 0 and stats.waiting == 0 and stats.free_blocks == stats.num_blocks:
                print(f"engine idle {1000 * (time.monotonic() - start):.0f} ms after the client left")
                return
            assert time.monotonic() < deadline, f"engine not idle after {IDLE_WITHIN_S}s: {stats}"
            await asyncio.sleep(0.01)


@pytest.fixture
async def stack(tiny_model_dir: Path) -> AsyncIterator[Stack]:
    model = str(tiny_model_dir)
    tok = await create_tokenizer(TokenizerSettings(model=model, port=0))
    det = await create_detokenizer(DetokenizerSettings(model=model, port=0))
    eng = await create_engine(EngineSettings(model=model, port=0, device="cpu", num_kv_blocks=256))
    for stage in (tok, det, eng):
        await stage.start()
    settings = GatewaySettings(
        port=0,
        grpc_port=0,
        tokenizer=(f"127.0.0.1:{tok.port}",),
        engine=(f"127.0.0.1:{eng.port}",),
        detokenizer=(f"127.0.0.1:{det.port}",),
    )
    gateway = await create_server(settings)
    await gateway.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{eng.port}") as channel:
            stack = Stack(gateway, engine_pb2_grpc.EngineStub(channel), tiny_model_dir.name)
            await stack.assert_idle_soon()
            yield stack
    finally:
        await gateway.stop(0.5)
        for stage in (tok, det, eng):
            await stage.stop(0)


async def _ws_cancel(stack: Stack) -> None:
    async with connect(f"ws://127.0.0.1:{stack.gateway.port}/v1/ws") as ws:
        params = {"max_tokens": LONG, "temperature": 0, "ignore_eos": True}
        await send(ws, {"type": "generate", "id": "c", "prompt": "Once upon", "params": params})
        assert (await recv(ws))["type"] == "delta"
        await stack.assert_running()
        await send(ws, {"type": "cancel", "id": "c"})
        assert (await collect(ws, {"c"}))["c"]["end"]["finish_reason"] == "cancelled"
        await stack.assert_idle_soon()


async def _ws_close(stack: Stack) -> None:
    async with connect(f"ws://127.0.0.1:{stack.gateway.port}/v1/ws") as ws:
        params = {"max_tokens": LONG, "temperature": 0, "ignore_eos": True}
        await send(
            ws,
            {
                "type": "generate",
                "id": "c",
                "messages": [{"role": "user", "content": "hi"}],
                "params": params,
            },
        )
        assert (await recv(ws))["type"] == "delta"
        await stack.assert_running()
    await stack.assert_idle_soon()


async def _sse_drop(stack: Stack) -> None:
    body = {
        "model": stack.model,
        "prompt": "Once upon",
        "max_tokens": LONG,
        "temperature": 0,
        "stream": True,
        "ignore_eos": True,
    }
    url = f"http://127.0.0.1:{stack.gateway.port}/v1/completions"
    async with httpx.AsyncClient(timeout=WAIT_S) as http, http.stream("POST", url, json=body) as response:
        assert response.status_code == 200
        # Held, so the line iterator is not finalized after the break: finalizing it closes the connection,
        # and the gateway would rightly cancel the request before the engine is asked whether it runs.
        lines = response.aiter_lines()
        async for line in lines:
            if line.startswith("data: ") and json.loads(line[6:])["choices"][0]["text"]:
                break
        await stack.assert_running()
    await stack.assert_idle_soon()


async def _http_drop(stack: Stack) -> None:
    body = {
        "model": stack.model,
        "prompt": "Once upon",
        "max_tokens": LONG,
        "temperature": 0,
        "ignore_eos": True,
    }
    url = f"http://127.0.0.1:{stack.gateway.port}/v1/completions"
    async with httpx.AsyncClient(timeout=WAIT_S) as http:
        task = asyncio.ensure_future(http.post(url, json=body))
        while (await stack.stats()).running == 0:
            await asyncio.sleep(0.01)
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
    await stack.assert_idle_soon()


async def _grpc_cancel(stack: Stack) -> None:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{stack.gateway.server.grpc_port}") as channel:
        request = gateway_pb2.PublicGenerateRequest(
            prompt="Once upon", stopping=common_pb2.StoppingParams(max_new_tokens=LONG, ignore_eos=True)
        )
        call = gateway_pb2_grpc.GatewayStub(channel).Generate(request, timeout=WAIT_S)
        while (await call.read()).WhichOneof("kind") != "delta":
            pass
        await stack.assert_running()
        call.cancel()
    await stack.assert_idle_soon()


@pytest.mark.parametrize("leave", [_ws_cancel, _ws_close, _sse_drop, _http_drop, _grpc_cancel])
async def test_a_client_that_leaves_frees_the_engine(
    stack: Stack, leave: Callable[[Stack], Awaitable[None]]
) -> None:
    await leave(stack)
