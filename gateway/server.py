"""The gateway process: the HTTP app (uvicorn) and the public gRPC API on one event loop, sharing
one pipeline to the upstream services.

`create_server(settings)` binds both ports (0 picks free ones) and returns a `GatewayServer`;
`start()` serves; `shutdown(grace_s)` drains: stops accepting, marks gRPC health NOT_SERVING, lets
generations in flight finish for up to `grace_s` seconds, fails the rest with "unavailable", then
closes connections and the upstream calls.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import socket
from collections.abc import Iterator

import uvicorn

from gateway.auth import ApiKeys
from gateway.grpc_api import GatewayServicer
from gateway.http_app import create_app, with_connection_drop
from gateway.pipeline import Pipeline
from gateway.settings import GatewaySettings
from services.common import decoding, grpc_server, telemetry
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

    def __init__(self, settings: GatewaySettings, pipeline: Pipeline, keys: ApiKeys) -> None:
        self.settings = settings
        self.pipeline = pipeline
        # The public API takes requests no larger than the HTTP API's bodies.
        self.grpc_server, self._health = grpc_server.new_server(
            [SERVICE_NAME], max_receive_bytes=settings.max_body_bytes
        )
        servicer = GatewayServicer(pipeline, settings, keys)
        service = gateway_pb2.DESCRIPTOR.services_by_name["Gateway"]
        decoding.add_servicer(self.grpc_server, service, servicer)
        self.grpc_port = grpc_server.bind(self.grpc_server, settings.host, settings.grpc_port)
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
        await self._health.set_serving(True)
        self._http_task = asyncio.get_running_loop().create_task(self._http.serve(sockets=[self._socket]))
        while not self._http.started:
            if self._http_task.done():
                self._http_task.result()
                raise RuntimeError("the HTTP server stopped during startup")
            await asyncio.sleep(0.01)

    async def shutdown(self, grace_s: float) -> None:
        """Graceful drain (see the module docstring); returns once everything is closed."""
        self.pipeline.start_draining()
        await self._health.set_serving(False)
        for server in getattr(self._http, "servers", []):
            server.close()  # stop accepting; open WebSockets go on
        grpc_stop = asyncio.get_running_loop().create_task(self.grpc_server.stop(grace_s))
        if not await self.pipeline.wait_idle(grace_s):
            log.warning(
                "%d generations still running after %.1fs; failing them", self.pipeline.in_flight, grace_s
            )
        await self.pipeline.close()
        self._http.should_exit = True
        if self._http_task is not None:
            await self._http_task
        await grpc_stop
        self._socket.close()


async def create_server(settings: GatewaySettings) -> GatewayServer:
    """Builds the pipeline and both servers, bound but not started (ports in `http_port`, `grpc_port`).
    Raises ValueError on bad settings, OSError when a port or the API keys file is unusable."""
    settings.validate()
    keys = ApiKeys.from_settings(settings)
    return GatewayServer(settings, Pipeline(settings), keys)


async def serve(settings: GatewaySettings) -> None:
    telemetry.init_tracing("gateway")
    server = await create_server(settings)
    await server.start()
    host = settings.host
    print(
        f"gateway listening on http://{host}:{server.http_port} (chat page /, WebSocket /v1/ws), "
        f"gRPC {host}:{server.grpc_port}",
        flush=True,
    )
    if not server.keys_enabled:
        print("gateway: no API keys configured, every API is open", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    log.info("gateway draining (grace %.1fs)", settings.grace_s)
    await server.shutdown(settings.grace_s)


def main(argv: list[str]) -> int:
    settings = load_settings(GatewaySettings, argv, prog="sluice serve gateway")
    return grpc_server.run(serve(settings))
