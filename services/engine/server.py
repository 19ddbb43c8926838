"""The engine service: `sluice serve engine [--flags]`."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal

import grpc

from services.common import decoding, grpc_server, metrics, telemetry
from services.common.grpc_server import ServerHandle, ServiceHealth
from services.common.pb import engine_pb2
from services.common.settings import load_settings
from services.engine.core.async_engine import AsyncEngine
from services.engine.core.engine import LLMEngine
from services.engine.observability import EngineObserver
from services.engine.servicer import EngineServicer
from services.engine.settings import EngineSettings

SERVICE_NAME = "sluice.v1.Engine"

log = logging.getLogger(__name__)


async def create_server(settings: EngineSettings) -> ServerHandle[grpc.aio.Server, AsyncEngine]:
    """Loads the model on the engine's loop thread (off the event loop; see AsyncEngine.build) and
    builds and binds the server (port 0 = a free port); its handle's `release` stops the engine's
    loop."""
    engine_metrics = metrics.EngineMetrics()
    engine = await AsyncEngine.build(lambda: _observed_engine(settings, engine_metrics))
    server, health = grpc_server.new_server([SERVICE_NAME])
    _report_fatal(engine, health)
    # A corrupt request is INVALID_ARGUMENT (gRPC's own decoding answers UNKNOWN).
    decoding.add_servicer(server, engine_pb2.DESCRIPTOR.services_by_name["Engine"], EngineServicer(engine))
    port = grpc_server.bind(server, settings.host, settings.port, grpc_server.server_credentials(settings))

    async def release() -> None:
        await asyncio.to_thread(engine.stop)

    return ServerHandle(server, port, engine, health, engine_metrics, release)


def _report_fatal(engine: AsyncEngine, health: ServiceHealth) -> None:
    """Marks the service NOT_SERVING for good if the engine's loop stops after an unrecoverable failure."""
    loop = asyncio.get_running_loop()
    tasks: set[asyncio.Task[None]] = set()

    def mark_failed() -> None:
        task = loop.create_task(health.set_failed())
        tasks.add(task)
        task.add_done_callback(tasks.discard)

    def on_fatal(reason: str) -> None:
        log.error("engine unavailable: %s", reason)
        with contextlib.suppress(RuntimeError):  # the event loop is gone: nobody asks for health
            loop.call_soon_threadsafe(mark_failed)

    engine.on_fatal(on_fatal)


def _install_fault_hook(engine: AsyncEngine) -> None:
    """With SLUICE_FAULT_INJECTION=1 in the environment, SIGUSR1 makes the engine's loop fail as after an
    unrecoverable failure: the process stays up, NOT_SERVING (docs/reliability.md, the chaos test)."""
    if os.environ.get("SLUICE_FAULT_INJECTION") == "1":
        asyncio.get_running_loop().add_signal_handler(signal.SIGUSR1, engine.inject_fault)


def _observed_engine(settings: EngineSettings, engine_metrics: metrics.EngineMetrics) -> LLMEngine:
    core = LLMEngine(settings)
    core.observer = EngineObserver(
        engine_metrics,
        stats=core.recorder,
        model_name=core.model_name,
        step_sample_rate=settings.trace_step_sample_rate,
    )
    return core


async def serve(settings: EngineSettings) -> None:
    """Serves until SIGTERM/SIGINT. Tracing is set up from the `OTEL_*` variables; metrics are served
    when `metrics_port` is set."""
    telemetry.init_tracing("engine")
    handle = await create_server(settings)
    _install_fault_hook(handle.core)
    endpoint = metrics.maybe_serve_metrics(handle.metrics.registry, settings.host, settings.metrics_port)

    async def drain() -> None:
        if endpoint is not None:
            endpoint.close()

    await grpc_server.serve_forever(handle, name="engine", grace_s=settings.grace_s, on_drain=drain)


def main(argv: list[str]) -> int:
    settings = load_settings(EngineSettings, argv, prog="sluice serve engine")
    return grpc_server.run(serve(settings))
