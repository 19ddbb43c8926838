"""Every service has the same shape: `create_server(settings)` returns a `ServerHandle`."""

from __future__ import annotations

import importlib
import typing

import pytest
from grpc_health.v1 import health_pb2

from services.common import grpc_server
from services.common.grpc_server import ServerHandle, ServiceHealth
from services.common.metrics import ServiceMetrics

SERVER_MODULES = ("services.tokenizer.server", "services.engine.server", "services.detokenizer.server",
                  "gateway.server")  # fmt: skip


@pytest.mark.parametrize("module", SERVER_MODULES)
def test_every_create_server_returns_a_server_handle(module: str) -> None:
    create_server = importlib.import_module(module).create_server
    returned = typing.get_type_hints(create_server)["return"]
    assert typing.get_origin(returned) is ServerHandle, returned


async def _status(health: ServiceHealth) -> int:
    request = health_pb2.HealthCheckRequest(service="")
    return (await health.servicer.Check(request, None)).status


async def test_a_stopped_handle_stays_not_serving_when_its_core_recovers_later() -> None:
    """An engine whose loop recovers while its server drains must not turn SERVING again."""
    server, health = grpc_server.new_server(["test.Service"])
    port = grpc_server.bind(server, "127.0.0.1", 0, None)

    async def release() -> None:
        await health.set_serving(True)  # a recovery that completes during the drain

    handle = ServerHandle(server, port, None, health, ServiceMetrics(), release)
    await handle.start()
    assert await _status(health) == health_pb2.HealthCheckResponse.SERVING
    await handle.stop(0)
    assert await _status(health) == health_pb2.HealthCheckResponse.NOT_SERVING
