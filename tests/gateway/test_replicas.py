"""Replica choice: new work goes round the replicas in turn, or to the least loaded by a given measure,
among the replicas that are connected; a stage that is starting or restarting is waited for. Endpoints:
fixed addresses, or DNS names re-resolved to a replica per address; several channels per replica."""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest
import trustme
from websockets.asyncio.client import connect

from gateway import upstream
from gateway.routing import Picker
from gateway.server import GatewayHandle, create_server
from gateway.settings import GatewaySettings
from gateway.upstream import Endpoint, Replicas, host_port, resolve_host
from services.common import grpc_server
from services.common.grpc_server import ChannelTls, bind, new_server, server_credentials
from services.common.pb import (
    common_pb2,
    detokenizer_pb2_grpc,
    engine_pb2,
    engine_pb2_grpc,
    tokenizer_pb2_grpc,
)
from services.common.settings import StageTlsSettings
from tests.gateway.conftest import WAIT_S, collect, dead_address, gateway_settings, send, until
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
TOKENS = 100  # a stream of 2 s at the fake engine's 20 ms steps


async def test_pick_goes_round_every_replica() -> None:
    replicas = Replicas("tokenizer", ADDRESSES)
    try:
        picks = Counter(replicas.pick() for _ in range(30))
    finally:
        await replicas.close()
    assert picks == dict.fromkeys(ADDRESSES, 10)


async def test_pick_takes_the_least_loaded_and_spreads_ties() -> None:
    load = {"127.0.0.1:1": 5, "127.0.0.1:2": 0, "127.0.0.1:3": 0}
    replicas = Replicas("engine", ADDRESSES, picker=Picker("least_load", load.__getitem__))
    try:
        first = [replicas.pick() for _ in range(4)]
        for _ in range(20):  # each pick adds one request where it went: the loads even out
            load[replicas.pick()] += 1
    finally:
        await replicas.close()
    assert "127.0.0.1:1" not in first and set(first) == {"127.0.0.1:2", "127.0.0.1:3"}
    assert max(load.values()) - min(load.values()) <= 1


async def test_one_replica_always_gets_the_work() -> None:
    for picker in (Picker(), Picker("least_load", lambda address: 7)):
        replicas = Replicas("detokenizer", ADDRESSES[:1], picker=picker)
        try:
            assert {replicas.pick() for _ in range(5)} == {ADDRESSES[0]}
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
        await until(lambda: len(server.core._stages.engines.connected()) == 2)  # else the first up gets all
        async with connect(f"ws://127.0.0.1:{server.port}/v1/ws") as client:
            ids = {f"g{i}" for i in range(8)}
            for frame_id in sorted(ids):
                await send(
                    client,
                    {"type": "generate", "id": frame_id, "prompt": "hello", "params": {"max_tokens": 12}},
                )
            results = await collect(client, ids)
    finally:
        await server.stop(0.5)
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


def stage_channel(server: GatewayHandle, stage: str, address: str) -> grpc.aio.Channel:
    """The first channel to the replica at `address`."""
    name = {"tokenizer": "tokenizers", "engine": "engines", "detokenizer": "detokenizers"}[stage]
    replicas: Replicas = getattr(server.core._stages, name)
    return next(channel for key, channel in replicas.channels.items() if replicas.replica_of(key) == address)


@pytest.mark.parametrize("stage", STAGES)
async def test_a_request_waits_for_a_stage_that_is_starting(
    stage: str, make_gateway: Callable[..., Awaitable[GatewayHandle]]
) -> None:
    """The gateway is up before one stage listens: a request sent then succeeds once the stage starts
    (it is started only after the gateway's connection attempt to it has failed)."""
    address = dead_address()
    server = await make_gateway(**{stage: (address,)}, upstream_wait_s=WAIT_S)
    body = {"model": MODEL, "prompt": "x", "max_tokens": 3}
    late: grpc.aio.Server | None = None
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{server.port}", timeout=WAIT_S) as http:
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
    stage: str, make_gateway: Callable[..., Awaitable[GatewayHandle]]
) -> None:
    server = await make_gateway(**{stage: (dead_address(),)}, upstream_wait_s=0.2)
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{server.port}", timeout=WAIT_S) as http:
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
        async with connect(f"ws://127.0.0.1:{server.port}/v1/ws") as client:
            ids = {f"g{i}" for i in range(6)}
            for frame_id in sorted(ids):
                await send(
                    client, {"type": "generate", "id": frame_id, "prompt": "hi", "params": {"max_tokens": 4}}
                )
            results = await collect(client, ids)
    finally:
        await server.stop(0.5)
    assert [r["end"]["type"] for r in results.values()] == ["done"] * 6
    assert len(upstreams.engine.submits) == 6


# ----- endpoints: fixed addresses, or DNS names that resolve to many replicas


def test_endpoints_are_addresses_or_dns_names() -> None:
    assert Endpoint.parse("engine:50052") == Endpoint("engine:50052", "engine", 50052, dns=False)
    assert Endpoint.parse("dns:///engine:50052") == Endpoint("dns:///engine:50052", "engine", 50052, dns=True)
    assert Endpoint.parse("[::1]:7").host == "::1"
    for bad in ("engine", "dns:///engine", "engine:0", "engine:x", ":5", "dns:///:5"):
        with pytest.raises(ValueError):
            Endpoint.parse(bad)
    with pytest.raises(ValueError, match="engine: 'engine' is not host:port"):
        GatewaySettings(engine=("engine",)).validate()
    GatewaySettings(engine=("dns:///engine:50052", "10.0.0.1:50052")).validate()


async def test_the_system_resolver_gives_every_address_of_a_name() -> None:
    assert "127.0.0.1" in await resolve_host("localhost", 50052)
    assert host_port("::1", 7) == "[::1]:7" and host_port("10.0.0.1", 7) == "10.0.0.1:7"


class FakeDns:
    """An injected resolver: `names[host]` is what the name resolves to now (absent: an OSError)."""

    def __init__(self, **names: list[str]) -> None:
        self.names = names
        self.asked = 0

    async def __call__(self, host: str, port: int) -> list[str]:
        self.asked += 1
        if host not in self.names:
            raise OSError(f"cannot resolve {host}")
        return self.names[host]


async def test_a_name_gives_a_replica_per_address_and_follows_the_changes() -> None:
    dns = FakeDns(engines=["127.0.0.1", "127.0.0.2"])
    replicas = Replicas("engine", ["dns:///engines:1", "127.0.0.3:9"], resolve=dns, resolve_interval_s=60)
    try:
        assert replicas.addresses == ("dns:///engines:1", "127.0.0.3:9")  # the name stands for itself
        await replicas.refresh()
        assert replicas.addresses == ("127.0.0.1:1", "127.0.0.2:1", "127.0.0.3:9")
        dns.names["engines"] = ["127.0.0.2", "::1"]
        await replicas.refresh()
        assert replicas.addresses == ("127.0.0.2:1", "[::1]:1", "127.0.0.3:9")
        assert set(replicas.channels) == set(replicas.addresses)  # the gone replica's idle channel closed
        del dns.names["engines"]
        await replicas.refresh()  # a failed resolution keeps the last set
        assert replicas.addresses == ("127.0.0.2:1", "[::1]:1", "127.0.0.3:9")
        assert {replicas.pick() for _ in range(6)} == set(replicas.addresses)
    finally:
        await replicas.close()


async def test_several_channels_per_replica_are_members_in_turn() -> None:
    replicas = Replicas("tokenizer", ["127.0.0.1:1", "127.0.0.1:2"], channels_per_replica=3)
    try:
        assert replicas.addresses == tuple(f"127.0.0.1:{p}#{i}" for p in (1, 2) for i in range(3))
        assert len({id(c) for c in replicas.channels.values()}) == 6
        assert Counter(replicas.pick() for _ in range(12)) == dict.fromkeys(replicas.addresses, 2)
        assert {replicas.replica_of(key) for key in replicas.addresses} == {"127.0.0.1:1", "127.0.0.1:2"}
    finally:
        await replicas.close()


async def start_stage_on(stage: str, host: str, port: int) -> tuple[grpc.aio.Server, Any, int]:
    """A fake `stage` on host:port (port 0: any), SERVING: (server, servicer, port)."""
    service, make, add = STAGE_SERVICES[stage]
    server, health = new_server([service])
    servicer = make()
    add(servicer, server)
    bound = bind(server, host, port)
    await server.start()
    await health.set_serving(True)
    return server, servicer, bound


async def test_the_gateway_uses_every_replica_a_name_resolves_to_and_re_resolves(
    upstreams: FakeUpstreams, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`--engine dns:///engines:P` with two engines behind the name (127.0.0.1 and 127.0.0.2, one port):
    requests go to both; when the name drops one, the periodic re-resolution takes it out of the
    rotation and new requests go to the other."""
    one, engine_a, port = await start_stage_on("engine", "127.0.0.1", 0)
    two, engine_b, _ = await start_stage_on("engine", "127.0.0.2", port)
    dns = FakeDns(engines=["127.0.0.1", "127.0.0.2"])
    monkeypatch.setattr(upstream, "resolve_host", dns)
    for engine in (engine_a, engine_b):
        engine.step_s = 0.02
    settings = gateway_settings(upstreams, engine=(f"dns:///engines:{port}",), resolve_interval_s=0.05)
    server = await create_server(settings)
    await server.start()
    engines: Replicas = server.core._stages.engines  # type: ignore[attr-defined]
    try:
        ids = {f"g{i}" for i in range(8)}
        async with connect(f"ws://127.0.0.1:{server.port}/v1/ws") as client:
            await until(lambda: len(engines.connected()) == 2)
            for frame_id in sorted(ids):
                await send(
                    client, {"type": "generate", "id": frame_id, "prompt": "hi", "params": {"max_tokens": 8}}
                )
            first = await collect(client, ids)
            assert min(len(engine_a.submits), len(engine_b.submits)) >= 2, (
                engine_a.submits,
                engine_b.submits,
            )
            dns.names["engines"] = ["127.0.0.2"]
            await until(lambda: engines.addresses == (f"127.0.0.2:{port}",))
            before = len(engine_a.submits)
            for frame_id in sorted(ids):
                await send(
                    client,
                    {"type": "generate", "id": f"{frame_id}b", "prompt": "hi", "params": {"max_tokens": 2}},
                )
            second = await collect(client, {f"{i}b" for i in ids})
    finally:
        await server.stop(0.5)
        await one.stop(0)
        await two.stop(0)
    assert all(r["end"]["type"] == "done" for r in [*first.values(), *second.values()])
    assert len(engine_a.submits) == before and len(engine_b.submits) >= 8


async def test_a_gateway_stream_outlives_the_servers_maximum_connection_age(
    upstreams: FakeUpstreams, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Servers end connections past an age (clients reconnect and re-resolve); a long generation on the
    gateway's multiplexed streams goes on across that, and new requests still get through."""
    options = [o for o in grpc_server.SERVER_OPTIONS if o[0] != "grpc.max_connection_age_ms"]
    monkeypatch.setattr(grpc_server, "SERVER_OPTIONS", [*options, ("grpc.max_connection_age_ms", 200)])
    fakes = await start_upstreams()
    fakes.engine.step_s = 0.02
    server = await create_server(gateway_settings(fakes))
    await server.start()
    try:
        async with connect(f"ws://127.0.0.1:{server.port}/v1/ws") as client:
            await send(
                client, {"type": "generate", "id": "long", "prompt": "hi", "params": {"max_tokens": 40}}
            )
            long = asyncio.ensure_future(collect(client, {"long"}))
            await until(lambda: len(fakes.engine.submits) == 1)
            await asyncio.sleep(0.3)  # past the connection age while "long" streams
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{server.port}", timeout=WAIT_S) as http:
                reply = await http.post(
                    "/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 3}
                )
            results = await long
    finally:
        await server.stop(0.5)
        await fakes.stop()
    assert reply.status_code == 200, reply.text
    assert results["long"]["end"]["type"] == "done" and results["long"]["text"] == expected_text(40)


async def test_a_resolved_replica_is_checked_over_tls_against_the_names_host(tmp_path: Path) -> None:
    """`dns:///engines.sluice.test:P` resolved to 127.0.0.1: the engine's certificate names only
    engines.sluice.test, and the TLS handshake checks that name, not the address."""
    ca = trustme.CA()
    ca.cert_pem.write_to_path(str(tmp_path / "ca.pem"))
    leaf = ca.issue_cert("engines.sluice.test")
    leaf.private_key_pem.write_to_path(str(tmp_path / "key.pem"))
    (tmp_path / "cert.pem").write_bytes(b"".join(blob.bytes() for blob in leaf.cert_chain_pems))
    tls = StageTlsSettings(tls_cert_file=str(tmp_path / "cert.pem"), tls_key_file=str(tmp_path / "key.pem"))
    service, make, add = STAGE_SERVICES["engine"]
    server, health = new_server([service])
    add(make(), server)
    port = bind(server, "127.0.0.1", 0, server_credentials(tls))
    await server.start()
    await health.set_serving(True)
    dns = FakeDns(**{"engines.sluice.test": ["127.0.0.1"]})
    replicas = Replicas(
        "engine", [f"dns:///engines.sluice.test:{port}"], ChannelTls(str(tmp_path / "ca.pem")), resolve=dns
    )
    try:
        assert await replicas.pick_ready(WAIT_S) == f"127.0.0.1:{port}"
        assert await replicas.check_health(WAIT_S) == {f"127.0.0.1:{port}": True}
    finally:
        await replicas.close()
        await server.stop(0)


async def test_a_stream_on_a_replica_the_name_drops_runs_to_its_end(monkeypatch: pytest.MonkeyPatch) -> None:
    """The name stops giving a replica while a stream runs there, and the replica's connection ages
    out (GOAWAY, the channel goes IDLE): the channel is swept, and the stream still ends normally."""
    options = [o for o in grpc_server.SERVER_OPTIONS if o[0] != "grpc.max_connection_age_ms"]
    monkeypatch.setattr(grpc_server, "SERVER_OPTIONS", [*options, ("grpc.max_connection_age_ms", 200)])
    server, engine, port = await start_stage_on("engine", "127.0.0.1", 0)
    engine.step_s = 0.02
    dns = FakeDns(engines=["127.0.0.1"])
    replicas = Replicas("engine", [f"dns:///engines:{port}"], resolve=dns)
    streaming = asyncio.Event()
    outs: list[engine_pb2.EngineOut] = []

    async def drop_and_sweep(member: str) -> int:
        await streaming.wait()
        dns.names["engines"] = ["127.0.0.2"]
        await replicas.refresh()
        while member in replicas.channels:  # swept once the connection's GOAWAY leaves it IDLE
            await asyncio.sleep(0.05)
            await replicas.refresh()
        return len(outs)

    try:
        member = await replicas.pick_ready(WAIT_S)
        stopping = common_pb2.StoppingParams(max_new_tokens=TOKENS)
        submit = engine_pb2.GenerateRequest(request_id="r", prompt_ids=[1], stopping=stopping)
        stub = engine_pb2_grpc.EngineStub(replicas.channels[member])
        sweeper = asyncio.ensure_future(drop_and_sweep(member))
        async for out in stub.Stream(iter([engine_pb2.EngineIn(submit=submit)])):
            outs.append(out)
            streaming.set()
            if any(e.WhichOneof("kind") == "final" for e in out.entries):
                break
        swept_after = await asyncio.wait_for(sweeper, WAIT_S)
    finally:
        await replicas.close()
        await server.stop(0)
    entries = [e for out in outs for e in out.entries]
    assert swept_after < len(outs)  # the stream went on after its channel was swept
    assert sum(len(e.chunk.token_ids) for e in entries if e.WhichOneof("kind") == "chunk") == TOKENS
    assert [e.final.request_id for e in entries if e.WhichOneof("kind") == "final"] == ["r"]
