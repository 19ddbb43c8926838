"""What the gateway keeps per replica: one replica per process behind a dual-stack name, and nothing left
behind for replicas that are gone (issue 21)."""

from __future__ import annotations

import asyncio
import socket
from typing import Any

import pytest
from websockets.asyncio.client import connect

from gateway.server import create_server
from gateway.upstream import Replicas, resolve_host
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
