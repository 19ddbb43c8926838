"""What the gateway keeps per replica: one replica per process behind a dual-stack name, and nothing left
behind for replicas that are gone (issue 21)."""

from __future__ import annotations

import asyncio
import socket
from typing import Any

import grpc
import pytest
from websockets.asyncio.client import connect

from gateway.server import create_server
from gateway.upstream import Replicas, StreamLink, resolve_host
from services.common.pb import common_pb2, engine_pb2, engine_pb2_grpc
from tests.gateway.conftest import WAIT_S, collect, gateway_settings, send
from tests.gateway.fakes import FakeUpstreams
from tests.gateway.test_replicas import FakeDns


def _infos(*ips: str) -> list[tuple[Any, ...]]:
    """getaddrinfo answers for `ips`, in that order."""
    return [
        (socket.AF_INET6 if ":" in ip else socket.AF_INET, socket.SOCK_STREAM, 6, "", (ip, 50052))
        for ip in ips
    ]


async def test_a_dual_stack_name_gives_one_replica_per_process(monkeypatch: pytest.MonkeyPatch) -> None:
    """`localhost` resolving to 127.0.0.1 and ::1 is one process: counted twice, it got twice the work
    and twice the load estimate. The family of the resolver's first answer is kept."""
    answers = {"localhost": _infos("::1", "127.0.0.1"), "pods": _infos("10.0.0.1", "fd00::1", "10.0.0.2")}

    async def getaddrinfo(host: str, port: int, **_: Any) -> list[tuple[Any, ...]]:
        return answers[host]

    monkeypatch.setattr(asyncio.get_running_loop(), "getaddrinfo", getaddrinfo)
    assert await resolve_host("localhost", 50052) == ["::1"]
    assert await resolve_host("pods", 50052) == ["10.0.0.1", "10.0.0.2"]


async def test_retired_replicas_leave_no_tls_names_behind() -> None:
    """A name whose pods come and go (new addresses each time) must not grow the per-address state."""
    dns = FakeDns(engines=["127.0.0.1"])
    replicas = Replicas("engine", ["dns:///engines:1"], resolve=dns, resolve_interval_s=60)
    try:
        for i in range(2, 40):
            dns.names["engines"] = [f"127.0.0.{i}"]
            await replicas.refresh()
        assert replicas._target_host == {"127.0.0.39:1": "engines"}
    finally:
        await replicas.close()


async def test_a_broken_replica_link_is_dropped(upstreams: FakeUpstreams) -> None:
    """Once a replica's stream breaks (the replica gone, restarted elsewhere or retired), the gateway
    keeps no link to it: with replicas coming and going, dead links piled up."""
    server = await create_server(gateway_settings(upstreams))
    await server.start()
    stages: Any = server.core._stages
    try:
        async with connect(f"ws://127.0.0.1:{server.port}/v1/ws") as client:
            await send(client, {"type": "generate", "id": "a", "prompt": "hi", "params": {"max_tokens": 2}})
            await collect(client, {"a"})
        engine, detokenizer = upstreams.addresses["engine"], upstreams.addresses["detokenizer"]
        assert engine in stages._engine_links and detokenizer in stages._detok_links
        await upstreams.stop("engine")
        await upstreams.stop("detokenizer")
        async with asyncio.timeout(WAIT_S):
            while engine in stages._engine_links or detokenizer in stages._detok_links:
                await asyncio.sleep(0.01)
    finally:
        await server.stop(0.5)


async def test_a_link_whose_call_breaks_leaves_no_task_pending(upstreams: FakeUpstreams) -> None:
    """gRPC consumes a link's request iterator in a task of its own and stops it only when it cancels a
    call still running: when the replica ends the call, the link ends the iterator, so that task ends
    (else it is destroyed pending, and its generator's aclose() fails, when the link is collected)."""
    broken = asyncio.Event()
    async with grpc.aio.insecure_channel(upstreams.addresses["engine"]) as channel:
        link: StreamLink[engine_pb2.EngineIn, engine_pb2.EngineIn, engine_pb2.EngineOut] = StreamLink(
            kind="engine",
            address=upstreams.addresses["engine"],
            open_call=engine_pb2_grpc.EngineStub(channel).Stream,
            merge=lambda items: items,
            on_message=lambda link, out: None,
            on_broken=lambda link, reason: broken.set(),
        )
        submit = engine_pb2.GenerateRequest(
            request_id="a", prompt_ids=[1], stopping=common_pb2.StoppingParams(max_new_tokens=10**6)
        )
        link.send(engine_pb2.EngineIn(submit=submit))
        await asyncio.wait_for(upstreams.engine.submitted.wait(), WAIT_S)
        upstreams.engine.kill_streams()
        await asyncio.wait_for(broken.wait(), WAIT_S)
        poller = link._call._async_request_poller
        await asyncio.wait([poller], timeout=WAIT_S)  # not wait_for: that would cancel it when late
        ended = poller.done()
        await link.close()
    assert ended


class _MissedWakeup:
    """A real channel as it is after a GOAWAY whose reconnection came and went between two looks: IDLE
    until it is asked to connect again (after the first ask), and waits for a state change never
    return, since an IDLE channel that nobody asks to connect never changes."""

    def __init__(self, real: grpc.aio.Channel) -> None:
        self.real = real
        self.asks = 0

    def get_state(self, try_to_connect: bool = False) -> grpc.ChannelConnectivity:
        self.asks += try_to_connect
        if self.asks < 2:
            return grpc.ChannelConnectivity.IDLE
        return self.real.get_state(try_to_connect)

    async def wait_for_state_change(self, state: grpc.ChannelConnectivity) -> None:
        await asyncio.Event().wait()

    async def channel_ready(self) -> None:
        await asyncio.Event().wait()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.real, name)


async def test_a_channel_left_idle_by_a_goaway_is_asked_to_connect_again(upstreams: FakeUpstreams) -> None:
    """A stage whose server ends connections at a maximum age: a reconnection that came up and got its
    GOAWAY between the waiter's two looks leaves the channel IDLE, and a wait for its next state change
    waits for good (seen under CPU load in
    test_replicas.py::test_a_gateway_stream_outlives_the_servers_maximum_connection_age: a request that
    waited the whole upstream wait, then timed out). `pick_ready` and the health watch ask it to connect
    again while they wait, so the member is picked as soon as it is READY, within an hour's wait."""
    address = upstreams.addresses["tokenizer"]
    replicas = Replicas("tokenizer", [address], None)
    stuck = _MissedWakeup(replicas.channels[address])
    replicas.channels[address] = stuck  # type: ignore[assignment]
    try:
        picked = await asyncio.wait_for(replicas.pick_ready(3600.0), WAIT_S)
        assert picked == address and stuck.asks >= 2
        await asyncio.wait_for(_until_serving(replicas, address), WAIT_S)  # the watch got past it too
    finally:
        replicas.channels[address] = stuck.real
        await replicas.close()


async def _until_serving(replicas: Replicas, key: str) -> None:
    while not replicas._serving.get(key):
        await asyncio.sleep(0.01)
