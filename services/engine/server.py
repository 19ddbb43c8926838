"""The engine service: `sluice serve engine [--flags]`."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal

import grpc

from services.common import decoding, grpc_server, metrics, telemetry
from services.common.grpc_server import ServiceHealth
from services.common.pb import engine_pb2
from services.common.settings import load_settings
from services.engine.async_engine import AsyncEngine
from services.engine.engine import LLMEngine
from services.engine.observability import EngineObserver
from services.engine.servicer import EngineServicer
from services.engine.settings import EngineSettings

SERVICE_NAME = "sluice.v1.Engine"

log = logging.getLogger(__name__)


async def create_server(
    settings: EngineSettings,
) -> tuple[grpc.aio.Server, int, AsyncEngine, ServiceHealth]:
    """Loads the model on the engine's loop thread (off the event loop; see AsyncEngine.build) and
    builds and binds the server (port 0 = a free port). The caller starts the server and, at the end,
    stops both (`await server.stop(grace)`, then `engine.stop()`)."""
    engine = await AsyncEngine.build(lambda: _observed_engine(settings))
    server, health = grpc_server.new_server([SERVICE_NAME])
    _report_fatal(engine, health)
    # A corrupt request is INVALID_ARGUMENT (gRPC's own decoding answers UNKNOWN).
    decoding.add_servicer(server, engine_pb2.DESCRIPTOR.services_by_name["Engine"], EngineServicer(engine))
    port = grpc_server.bind(server, settings.host, settings.port, grpc_server.server_credentials(settings))
    return server, port, engine, health


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


def _observed_engine(settings: EngineSettings) -> LLMEngine:
    core = LLMEngine(settings)
    core.observer = EngineObserver(
        metrics.EngineMetrics(),
        scheduler=core.scheduler,
        block_manager=core.block_manager,
        model_name=core.model_name,
        step_sample_rate=settings.trace_step_sample_rate,
    )
    return core


async def serve(settings: EngineSettings) -> None:
    """Serves until SIGTERM/SIGINT. Tracing is set up from the `OTEL_*` variables; metrics are served
    when `metrics_port` is set."""
    telemetry.init_tracing("engine")
    server, port, engine, health = await create_server(settings)
    _install_fault_hook(engine)
    observer = engine.engine.observer
    assert isinstance(observer, EngineObserver)
    endpoint = metrics.maybe_serve_metrics(observer.metrics.registry, settings.host, settings.metrics_port)

    async def drain() -> None:
        await asyncio.to_thread(engine.stop)
        if endpoint is not None:
            endpoint.close()

    await grpc_server.serve_forever(
        server, health, name="engine", port=port, grace_s=settings.grace_s, on_drain=drain
    )


def main(argv: list[str]) -> int:
    settings = load_settings(EngineSettings, argv, prog="sluice serve engine")
    return grpc_server.run(serve(settings))
