"""Detokenizer service process: `sluice serve detokenizer [--model DIR] [--port N] [--workers N]`."""

from __future__ import annotations

import grpc

from services.common import decoding, grpc_server
from services.common.grpc_server import ServerHandle
from services.common.metrics import DetokenizerMetrics
from services.common.models import resolve_model_dir
from services.common.pb import detokenizer_pb2
from services.common.settings import load_settings
from services.common.workers import serve_workers
from services.detokenizer.incremental import Vocabulary
from services.detokenizer.servicer import DetokenizerServicer
from services.detokenizer.settings import DetokenizerSettings

SERVICE_NAME = grpc_server.STAGE_SERVICES["detokenizer"]


async def create_server(
    settings: DetokenizerSettings, *, reuse_port: bool = False
) -> ServerHandle[grpc.aio.Server, Vocabulary]:
    """Builds and binds (not starts) the server (port 0 = a free port); its core is the model's
    vocabulary, and its handle's `release` stops the servicer's batching thread."""
    vocab = Vocabulary.from_model_dir(resolve_model_dir(settings.model, settings.revision))
    server, health = grpc_server.new_server([SERVICE_NAME], reuse_port=reuse_port)
    metrics = DetokenizerMetrics()
    servicer = DetokenizerServicer(
        vocab,
        metrics,
        max_batch_size=settings.max_batch_size,
        remember_finished=settings.remember_finished,
        read_ahead=settings.read_ahead,
    )
    # A corrupt request is INVALID_ARGUMENT (gRPC's own decoding answers UNKNOWN).
    decoding.add_servicer(server, detokenizer_pb2.DESCRIPTOR.services_by_name["Detokenizer"], servicer)
    port = grpc_server.bind(server, settings.host, settings.port, grpc_server.server_credentials(settings))

    async def release() -> None:
        servicer.close()

    return ServerHandle(server, port, vocab, health, metrics, release)


def main(argv: list[str]) -> int:
    settings = load_settings(DetokenizerSettings, argv, prog="sluice serve detokenizer")
    return grpc_server.run(serve_workers("detokenizer", settings, create_server))
