"""Tokenizer service process: `sluice serve tokenizer [--model DIR] [--port N] [--workers N]`."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from pathlib import Path

import grpc

from services.common import grpc_server, metrics, telemetry
from services.common.pb import tokenizer_pb2_grpc
from services.common.settings import load_settings
from services.common.workers import serve_workers, signal_self_when
from services.tokenizer.core import TokenizerCore
from services.tokenizer.servicer import TokenizerServicer
from services.tokenizer.settings import TokenizerSettings

SERVICE_NAME = "sluice.v1.Tokenizer"


def resolve_model_dir(model: str) -> Path:
    """`model`, or the embedded tiny model when empty (built on first use)."""
    if model:
        return Path(model)
    from sluice.model.tiny import default_model_dir

    return default_model_dir()


async def create_server(
    settings: TokenizerSettings, *, reuse_port: bool = False
) -> tuple[grpc.aio.Server, int, grpc_server.ServiceHealth, TokenizerServicer]:
    """Builds and binds (not starts) the server; returns it, the bound port, its health state and the
    servicer (whose `close` the caller calls after stopping the server)."""
    core = TokenizerCore(resolve_model_dir(settings.model))
    server, health = grpc_server.new_server([SERVICE_NAME], reuse_port=reuse_port)
    servicer = TokenizerServicer(core, max_batch_size=settings.max_batch_size)
    tokenizer_pb2_grpc.add_TokenizerServicer_to_server(servicer, server)
    port = grpc_server.bind(server, settings.host, settings.port)
    return server, port, health, servicer


async def serve_one(
    settings: TokenizerSettings,
    *,
    reuse_port: bool,
    on_bound: Callable[[int], None] | None = None,
    on_drain: Callable[[], Awaitable[None]] | None = None,
    stop_when: Awaitable[None] | None = None,
) -> None:
    """One process: serve until SIGTERM/SIGINT (or `stop_when` completes), then drain. Tracing is set
    up from the `OTEL_*` variables; metrics are served when `metrics_port` is set."""
    telemetry.init_tracing("tokenizer")
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
        await grpc_server.serve_forever(server, health, name="tokenizer", port=port, grace_s=settings.grace_s,
                                        on_drain=drain)
    finally:
        if watcher is not None:
            watcher.cancel()


async def serve(settings: TokenizerSettings) -> None:
    await serve_workers(settings, __name__, serve_one)


def main(argv: list[str]) -> int:
    settings = load_settings(TokenizerSettings, argv, prog="sluice serve tokenizer")
    if settings.workers < 1:
        raise SystemExit("sluice serve tokenizer: --workers must be at least 1")
    grpc_server.run(serve(settings))
    return 0
