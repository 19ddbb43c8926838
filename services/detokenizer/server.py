"""Detokenizer service process: `sluice serve detokenizer [--model DIR] [--port N] [--workers N]`."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import grpc

from services.common import grpc_server, metrics, telemetry
from services.common.pb import detokenizer_pb2_grpc
from services.common.settings import load_settings
from services.common.workers import serve_workers, signal_self_when
from services.detokenizer.incremental import Vocabulary
from services.detokenizer.servicer import DetokenizerServicer
from services.detokenizer.settings import DetokenizerSettings
from services.tokenizer.server import resolve_model_dir

SERVICE_NAME = "sluice.v1.Detokenizer"


async def create_server(
    settings: DetokenizerSettings, *, reuse_port: bool = False
) -> tuple[grpc.aio.Server, int, grpc_server.ServiceHealth, DetokenizerServicer]:
    """Builds and binds (not starts) the server; returns it, the bound port, its health state and the
    servicer (whose `close` the caller calls after stopping the server)."""
    vocab = Vocabulary.from_model_dir(resolve_model_dir(settings.model))
    server, health = grpc_server.new_server([SERVICE_NAME], reuse_port=reuse_port)
    servicer = DetokenizerServicer(vocab, max_batch_size=settings.max_batch_size,
                                   remember_finished=settings.remember_finished,
                                   read_ahead=settings.read_ahead)
    detokenizer_pb2_grpc.add_DetokenizerServicer_to_server(servicer, server)
    port = grpc_server.bind(server, settings.host, settings.port)
    return server, port, health, servicer


async def serve_one(
    settings: DetokenizerSettings,
    *,
    reuse_port: bool,
    on_bound: Callable[[int], None] | None = None,
    on_drain: Callable[[], Awaitable[None]] | None = None,
    stop_when: Awaitable[None] | None = None,
) -> None:
    """One process: serve until SIGTERM/SIGINT (or `stop_when` completes), then drain. Tracing is set
    up from the `OTEL_*` variables; metrics are served when `metrics_port` is set."""
    telemetry.init_tracing("detokenizer")
    server, port, health, servicer = await create_server(settings, reuse_port=reuse_port)
    endpoint = metrics.maybe_serve_metrics(servicer.metrics.registry, settings.host, settings.metrics_port)
    if on_bound is not None:
        on_bound(port)
    watcher = asyncio.ensure_future(signal_self_when(stop_when)) if stop_when is not None else None

    async def drain() -> None:
        servicer.close()
        if endpoint is not None:
            endpoint.close()
        if on_drain is not None:
            await on_drain()

    try:
        await grpc_server.serve_forever(server, health, name="detokenizer", port=port,
                                        grace_s=settings.grace_s, on_drain=drain)
    finally:
        if watcher is not None:
            watcher.cancel()


async def serve(settings: DetokenizerSettings) -> None:
    await serve_workers(settings, __name__, serve_one)


def main(argv: list[str]) -> int:
    settings = load_settings(DetokenizerSettings, argv, prog="sluice serve detokenizer")
    if settings.workers < 1:
        raise SystemExit("sluice serve detokenizer: --workers must be at least 1")
    grpc_server.run(serve(settings))
    return 0
