"""Replica choice: new work goes round the replicas in turn, or to the least loaded by a given measure,
among the replicas that are connected; a stage that is starting or restarting is waited for."""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Awaitable, Callable
from typing import Any

import grpc
import httpx
import pytest
from websockets.asyncio.client import connect

from gateway.server import GatewayServer, create_server
from gateway.upstream import Replicas
from services.common.grpc_server import bind, new_server
from services.common.pb import detokenizer_pb2_grpc, engine_pb2_grpc, tokenizer_pb2_grpc
from tests.gateway.conftest import WAIT_S, collect, dead_address, gateway_settings, send
from tests.gateway.fakes import (
    MODEL,
    FakeDetokenizer,
    FakeEngine,
    FakeTokenizer,
    FakeUpstreams,
    expected_text,
    start_upstreams,
)

ADDRESSES = ("127.0.0.1:1", "127.0.0.1:2", "127.0.0.1:3")


async def test_pick_goes_round_every_replica() -> None:
    replicas = Replicas("tokenizer", ADDRESSES)
    try:
        picks = Counter(replicas.pick() for _ in range(30))
    finally:
        await replicas.close()
    assert picks == dict.fromkeys(ADDRESSES, 10)


async def test_pick_takes_the_least_loaded_and_spreads_ties() -> None:
    replicas = Replicas("engine", ADDRESSES)
    load = {"127.0.0.1:1": 5, "127.0.0.1:2": 0, "127.0.0.1:3": 0}
    try:
        first = [replicas.pick(load.__getitem__) for _ in range(4)]
        for _ in range(20):  # each pick adds one request where it went: the loads even out
            load[replicas.pick(load.__getitem__)] += 1
    finally:
        await replicas.close()
    assert "127.0.0.1:1" not in first and set(first) == {"127.0.0.1:2", "127.0.0.1:3"}
    assert max(load.values()) - min(load.values()) <= 1


async def test_one_replica_always_gets_the_work() -> None:
    replicas = Replicas("detokenizer", ADDRESSES[:1])
    try:
        assert {replicas.pick() for _ in range(5)} == {ADDRESSES[0]}
        assert replicas.pick(lambda address: 7) == ADDRESSES[0]
    finally:
        await replicas.close()


async def test_the_gateway_spreads_requests_over_engine_replicas() -> None:
    """With two engines, concurrent generations go to both (each to the one with fewer in flight)."""
    first, second = await start_upstreams(), await start_upstreams()
    for fakes in (first, second):
        fakes.engine.step_s = 0.02  # requests stay in flight while the others arrive
    engines = (first.addresses["engine"], second.addresses["engine"])
    server = await create_server(gateway_settings(first, engine=engines))
    await server.start()
    try:
        async with connect(f"ws://127.0.0.1:{server.http_port}/v1/ws") as client:
            ids = {f"g{i}" for i in range(8)}
            for frame_id in sorted(ids):
                await send(
                    client,
                    {"type": "generate", "id": frame_id, "prompt": "hello", "params": {"max_tokens": 12}},
                )
            results = await collect(client, ids)
    finally:
        await server.shutdown(0.5)
        await first.stop()
        await second.stop()
    assert all(r["end"]["type"] == "done" for r in results.values())
    counts = [len(first.engine.submits), len(second.engine.submits)]
    assert sum(counts) == 8 and min(counts) >= 3, counts


# ----- stages that are starting or restarting (a request waits up to upstream_wait_s for them)

STAGES = ("tokenizer", "engine", "detokenizer")
STAGE_SERVICES: dict[str, tuple[str, Callable[[], Any], Callable[[Any, grpc.aio.Server], None]]] = {
    "tokenizer": ("sluice.v1.Tokenizer", FakeTokenizer, tokenizer_pb2_grpc.add_TokenizerServicer_to_server),
    "engine": ("sluice.v1.Engine", FakeEngine, engine_pb2_grpc.add_EngineServicer_to_server),
    "detokenizer": (
        "sluice.v1.Detokenizer",
        FakeDetokenizer,
        detokenizer_pb2_grpc.add_DetokenizerServicer_to_server,
    ),
}


async def start_stage(stage: str, address: str) -> grpc.aio.Server:
    """A fake `stage` listening on `address` (a port that was free), SERVING."""
    service, servicer, add = STAGE_SERVICES[stage]
    server, health = new_server([service])
    add(servicer(), server)
    bind(server, "127.0.0.1", int(address.rsplit(":", 1)[1]))
    await server.start()
    await health.set_serving(True)
    return server


async def wait_for_state(channel: grpc.aio.Channel, wanted: grpc.ChannelConnectivity) -> None:
    state = channel.get_state()
    while state != wanted:
        await asyncio.wait_for(channel.wait_for_state_change(state), WAIT_S)
        state = channel.get_state()


def stage_channel(server: GatewayServer, stage: str, address: str) -> grpc.aio.Channel:
    replicas = {"tokenizer": "_tokenizers", "engine": "_engines", "detokenizer": "_detokenizers"}[stage]
    return getattr(server.pipeline, replicas).channels[address]


@pytest.mark.parametrize("stage", STAGES)
async def test_a_request_waits_for_a_stage_that_is_starting(
    stage: str, make_gateway: Callable[..., Awaitable[GatewayServer]]
) -> None:
    """The gateway is up before one stage listens: a request sent then succeeds once the stage starts
    (it is started only after the gateway's connection attempt to it has failed)."""
    address = dead_address()
    server = await make_gateway(**{stage: (address,)}, upstream_wait_s=WAIT_S)
    body = {"model": MODEL, "prompt": "x", "max_tokens": 3}
    late: grpc.aio.Server | None = None
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{server.http_port}", timeout=WAIT_S) as http:
        reply = asyncio.ensure_future(http.post("/v1/completions", json=body))
        try:
            await wait_for_state(
                stage_channel(server, stage, address), grpc.ChannelConnectivity.TRANSIENT_FAILURE
            )
            late = await start_stage(stage, address)
            response = await reply
        finally:
            reply.cancel()
            if late is not None:
                await late.stop(0)
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["text"] == expected_text(3)


@pytest.mark.parametrize("stage", STAGES)
async def test_a_stage_that_never_starts_fails_the_request_with_unavailable(
    stage: str, make_gateway: Callable[..., Awaitable[GatewayServer]]
) -> None:
    server = await make_gateway(**{stage: (dead_address(),)}, upstream_wait_s=0.2)
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{server.http_port}", timeout=WAIT_S) as http:
        response = await http.post("/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 3})
    assert response.status_code == 503
    error = response.json()["error"]
    assert (error["code"], error["message"]) == ("unavailable", f"{stage} unavailable")


async def test_a_replica_that_is_down_gets_no_work(upstreams: FakeUpstreams) -> None:
    """Of two engine replicas one never listens: every request goes to the other and succeeds."""
    engines = (dead_address(), upstreams.addresses["engine"])
    server = await create_server(gateway_settings(upstreams, engine=engines))
    await server.start()
    try:
        async with connect(f"ws://127.0.0.1:{server.http_port}/v1/ws") as client:
            ids = {f"g{i}" for i in range(6)}
            for frame_id in sorted(ids):
                await send(
                    client, {"type": "generate", "id": frame_id, "prompt": "hi", "params": {"max_tokens": 4}}
                )
            results = await collect(client, ids)
    finally:
        await server.shutdown(0.5)
    assert [r["end"]["type"] for r in results.values()] == ["done"] * 6
    assert len(upstreams.engine.submits) == 6
