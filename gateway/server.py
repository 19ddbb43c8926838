"""The gateway process: the HTTP app (uvicorn) and the public gRPC API on one event loop, sharing
one pipeline to the upstream services.

`create_server(settings)` builds the pipeline and binds both ports (0 picks free ones); it returns the
`ServerHandle` every service returns: its server a `GatewayServer` (both servers), its port the HTTP
port, its core the `Pipeline`, its health that of the gRPC API. `stop(grace_s)` drains: stops
accepting, marks gRPC health NOT_SERVING, lets generations in flight finish for up to `grace_s`
seconds, fails the rest with "unavailable", then closes connections and the upstream calls.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections.abc import Iterator

import grpc
import uvicorn

from gateway.auth import ApiKeys
from gateway.grpc_api import GatewayServicer
from gateway.http_app import create_app, with_connection_drop
from gateway.pipeline import Pipeline
from gateway.settings import GatewaySettings
from services.common import decoding, grpc_server, telemetry
from services.common.grpc_server import ServerHandle
from services.common.metrics import GatewayMetrics
from services.common.pb import gateway_pb2
from services.common.settings import load_settings

log = logging.getLogger(__name__)

SERVICE_NAME = "sluice.v1.Gateway"
HTTP_BACKLOG = 2048


class _EmbeddedUvicorn(uvicorn.Server):
    """uvicorn without its own signal handling: the gateway process owns SIGTERM/SIGINT."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


def _listen(host: str, port: int) -> socket.socket:
    family, kind, proto, _, address = socket.getaddrinfo(
        host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    )[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
    except OSError:
        sock.close()
        raise
    sock.listen(HTTP_BACKLOG)
    sock.setblocking(False)
    return sock


class GatewayServer:
    """Both servers of one gateway process and the pipeline they share. The HTTP socket listens as
    soon as this object exists (connections wait in the backlog until `start`)."""

    def __init__(
        self, settings: GatewaySettings, pipeline: Pipeline, keys: ApiKeys, grpc_api: grpc.aio.Server
    ) -> None:
        self.pipeline = pipeline
        self.grpc_server = grpc_api
        self.grpc_port = grpc_server.bind(grpc_api, settings.host, settings.grpc_port)
        self._socket = _listen(settings.host, settings.port)
        self.http_port: int = self._socket.getsockname()[1]
        config = uvicorn.Config(
            with_connection_drop(create_app(pipeline, settings, keys)),
            ws_max_size=settings.max_ws_frame_bytes,
            ws_ping_interval=settings.ws_ping_interval_s,
            ws_ping_timeout=settings.ws_ping_interval_s,
            lifespan="off",
            log_level="warning",
            access_log=False,
            timeout_graceful_shutdown=1,
        )
        self._http = _EmbeddedUvicorn(config)
        self.keys_enabled = keys.enabled
        self._http_task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        await self.grpc_server.start()
        self._http_task = asyncio.get_running_loop().create_task(self._http.serve(sockets=[self._socket]))
        while not self._http.started:
            if self._http_task.done():
                self._http_task.result()
                raise RuntimeError("the HTTP server stopped during startup")
            await asyncio.sleep(0.01)

    async def stop(self, grace: float | None) -> None:
        """Graceful drain (see the module docstring), up to `grace` seconds (None: none); returns once
        both servers are closed and every generation has ended. The upstream calls stay open for
        the pipeline's `close`."""
        grace_s = 0.0 if grace is None else grace
        self.pipeline.start_draining()
        for server in getattr(self._http, "servers", []):
            server.close()  # stop accepting; open WebSockets go on
        grpc_stop = asyncio.get_running_loop().create_task(self.grpc_server.stop(grace_s))
        if not await self.pipeline.wait_idle(grace_s):
            log.warning(
                "%d generations still running after %.1fs; failing them", self.pipeline.in_flight, grace_s
            )
        self.pipeline.end_all()
        self._http.should_exit = True
        if self._http_task is not None:
            await self._http_task
        await grpc_stop
        self._socket.close()


GatewayHandle = ServerHandle[GatewayServer, Pipeline]


async def create_server(settings: GatewaySettings) -> GatewayHandle:
    """Builds the pipeline and both servers, bound but not started. Raises OSError when a port or the
    API keys file is unusable."""
    keys = ApiKeys.from_settings(settings)
    metrics = GatewayMetrics()
    pipeline = Pipeline(settings, metrics)
    # The public API takes requests no larger than the HTTP API's bodies.
    grpc_api, health = grpc_server.new_server([SERVICE_NAME], max_receive_bytes=settings.max_body_bytes)
    service = gateway_pb2.DESCRIPTOR.services_by_name["Gateway"]
    decoding.add_servicer(grpc_api, service, GatewayServicer(pipeline, settings, keys))
    try:
        server = GatewayServer(settings, pipeline, keys, grpc_api)
    except OSError:
        await pipeline.close()
        raise
    return ServerHandle(server, server.http_port, pipeline, health, metrics, pipeline.close)


async def serve(settings: GatewaySettings) -> None:
    telemetry.init_tracing("gateway")
    handle = await create_server(settings)
    host, server = settings.host, handle.server
    banner = (
        f"gateway listening on http://{host}:{server.http_port} (chat page /, WebSocket /v1/ws), "
        f"gRPC {host}:{server.grpc_port}"
    )
    if not server.keys_enabled:
        banner += "\ngateway: no API keys configured, every API is open"
    await grpc_server.serve_forever(handle, name="gateway", grace_s=settings.grace_s, banner=banner)


def main(argv: list[str]) -> int:
    settings = load_settings(GatewaySettings, argv, prog="sluice serve gateway")
    return grpc_server.run(serve(settings))
