"""Detokenizer service process: `sluice serve detokenizer [--model DIR] [--port N] [--workers N]`."""

from __future__ import annotations

from functools import partial
from typing import Any

import grpc

from services.common import decoding, grpc_server
from services.common.models import resolve_model_dir
from services.common.pb import detokenizer_pb2
from services.common.settings import load_settings
from services.common.workers import serve_worker, serve_workers
from services.detokenizer.incremental import Vocabulary
from services.detokenizer.servicer import DetokenizerServicer
from services.detokenizer.settings import DetokenizerSettings

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
    # A corrupt request is INVALID_ARGUMENT (gRPC's own decoding answers UNKNOWN).
    decoding.add_servicer(server, detokenizer_pb2.DESCRIPTOR.services_by_name["Detokenizer"], servicer)
    port = grpc_server.bind(server, settings.host, settings.port, grpc_server.server_credentials(settings))
    return server, port, health, servicer


async def serve_one(settings: DetokenizerSettings, *, reuse_port: bool, **hooks: Any) -> None:
    """One process of the pool (`services/common/workers.py`); `hooks` are `serve_worker`'s."""
    create = partial(create_server, settings, reuse_port=reuse_port)
    await serve_worker("detokenizer", settings, create, **hooks)


async def serve(settings: DetokenizerSettings) -> None:
    await serve_workers(settings, __name__, serve_one)


def main(argv: list[str]) -> int:
    settings = load_settings(DetokenizerSettings, argv, prog="sluice serve detokenizer")
    return grpc_server.run(serve(settings))
