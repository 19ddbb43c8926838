"""Tokenizer service process: `sluice serve tokenizer [--model DIR] [--port N] [--workers N]`."""

from __future__ import annotations

import grpc

from services.common import decoding, grpc_server
from services.common.grpc_server import ServerHandle
from services.common.metrics import TokenizerMetrics
from services.common.models import resolve_model_dir
from services.common.pb import tokenizer_pb2
from services.common.settings import load_settings
from services.common.workers import serve_workers
from services.tokenizer.core import TokenizerCore
from services.tokenizer.servicer import TokenizerServicer
from services.tokenizer.settings import TokenizerSettings

SERVICE_NAME = grpc_server.STAGE_SERVICES["tokenizer"]


async def create_server(
    settings: TokenizerSettings, *, reuse_port: bool = False
) -> ServerHandle[grpc.aio.Server, TokenizerCore]:
    """Builds and binds (not starts) the server (port 0 = a free port); its handle's `release` stops
    the servicer's batching thread."""
    core = TokenizerCore(resolve_model_dir(settings.model, settings.revision))
    server, health = grpc_server.new_server([SERVICE_NAME], reuse_port=reuse_port)
    metrics = TokenizerMetrics()
    servicer = TokenizerServicer(core, metrics, max_batch_size=settings.max_batch_size)
    # A corrupt request is INVALID_ARGUMENT (gRPC's own decoding answers UNKNOWN).
    decoding.add_servicer(server, tokenizer_pb2.DESCRIPTOR.services_by_name["Tokenizer"], servicer)
    port = grpc_server.bind(server, settings.host, settings.port, grpc_server.server_credentials(settings))

    async def release() -> None:
        servicer.close()

    return ServerHandle(server, port, core, health, metrics, release)


def main(argv: list[str]) -> int:
    settings = load_settings(TokenizerSettings, argv, prog="sluice serve tokenizer")
    return grpc_server.run(serve_workers("tokenizer", settings, create_server))
