"""The engine service: `sluice serve engine [--flags]`."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import time
from collections.abc import Awaitable, Callable
from typing import Any

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

SERVICE_NAME = grpc_server.STAGE_SERVICES["engine"]

log = logging.getLogger(__name__)


async def create_server(settings: EngineSettings) -> ServerHandle[grpc.aio.Server, AsyncEngine]:
    """Loads the model on the engine's loop thread (off the event loop; see AsyncEngine.build) and
    builds and binds the server (port 0 = a free port); its handle's `release` stops the engine's
    loop."""
    engine_metrics = metrics.EngineMetrics()
    engine = await AsyncEngine.build(lambda: _observed_engine(settings, engine_metrics))
    server, health = grpc_server.new_server([SERVICE_NAME])
    # A corrupt request is INVALID_ARGUMENT (gRPC's own decoding answers UNKNOWN).
    decoding.add_servicer(server, engine_pb2.DESCRIPTOR.services_by_name["Engine"], EngineServicer(engine))
    port = grpc_server.bind(server, settings.host, settings.port, grpc_server.server_credentials(settings))
    _report_health(engine, health, engine_metrics, settings, port)

    async def release() -> None:
        await asyncio.to_thread(engine.stop)

    return ServerHandle(server, port, engine, health, engine_metrics, release)


def _report_health(
    engine: AsyncEngine,
    health: ServiceHealth,
    engine_metrics: metrics.EngineMetrics,
    settings: EngineSettings,
    port: int,
) -> None:
    """Follows the engine's loop in the health service: NOT_SERVING while a failed loop is rebuilt,
    SERVING again once it serves (counted in `sluice_engine_loop_recoveries_total`), and NOT_SERVING for
    good after a failure it cannot recover from (AsyncEngine's module docstring). The changes are applied
    in order, one at a time."""
    loop = asyncio.get_running_loop()
    order = asyncio.Lock()
    tasks: set[asyncio.Task[None]] = set()
    where = f"engine on port {port} (pid {os.getpid()})"
    budget = f"{settings.loop_recoveries} allowed within {settings.loop_recovery_window_s:g}s"

    async def apply(change: Callable[[], Awaitable[None]]) -> None:
        async with order:
            await change()

    def later(change: Callable[[], Awaitable[None]]) -> None:
        def schedule() -> None:
            task = loop.create_task(apply(change))
            tasks.add(task)
            task.add_done_callback(tasks.discard)

        with contextlib.suppress(RuntimeError):  # the event loop is gone: nobody asks for health
            loop.call_soon_threadsafe(schedule)

    def on_failed(reason: str) -> None:
        log.error("%s: step loop failed, rebuilding it: %s", where, reason)
        later(lambda: health.set_serving(False))

    def on_recovered(count: int) -> None:
        engine_metrics.loop_recoveries.inc()
        log.warning("%s: step loop recovered (recovery %d of %s)", where, count, budget)
        later(lambda: health.set_serving(True))

    def on_fatal(reason: str) -> None:
        log.error("%s: engine unavailable for good: %s", where, reason)
        later(health.set_failed)

    engine.on_recovery(on_failed, on_recovered)
    engine.on_fatal(on_fatal)


RUNNER_FAULT_S = 2.0  # how long the model runner raises after SIGUSR2 (fault injection only)


def _install_fault_hook(engine: AsyncEngine) -> None:
    """With SLUICE_FAULT_INJECTION=1 in the environment, SIGUSR1 makes the engine's loop fail (its
    requests end `unavailable`): it recovers in-process within its budget, else the process stays up,
    NOT_SERVING for good; and SIGUSR2 makes every model execution raise for RUNNER_FAULT_S, as a sticky
    device error would, each such step failing as a step does (docs/reliability.md, the chaos test)."""
    if os.environ.get("SLUICE_FAULT_INJECTION") == "1":
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGUSR1, engine.inject_fault)
        loop.add_signal_handler(signal.SIGUSR2, _failing_runner(engine, RUNNER_FAULT_S))


def _failing_runner(engine: AsyncEngine, duration_s: float) -> Callable[[], None]:
    """Wraps the engine's model runner so that its `execute` raises until a deadline; returns what
    sets the deadline `duration_s` from now."""
    runner = engine.engine.runner
    execute = runner.execute
    until = [0.0]

    def failing(*args: Any, **kwargs: Any) -> Any:
        if time.monotonic() < until[0]:
            raise RuntimeError("injected model runner fault")
        return execute(*args, **kwargs)

    runner.execute = failing

    def start() -> None:
        log.warning("injected fault: the model runner raises for %gs", duration_s)
        until[0] = time.monotonic() + duration_s

    return start


def _observed_engine(settings: EngineSettings, engine_metrics: metrics.EngineMetrics) -> LLMEngine:
    core = LLMEngine(settings)
    core.observer = EngineObserver(
        engine_metrics,
        stats=core.recorder,
        model_name=core.model_name,
        step_sample_rate=settings.trace_step_sample_rate,
        expert_load=getattr(core.runner, "expert_load", None),  # a mixture-of-experts model's
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
