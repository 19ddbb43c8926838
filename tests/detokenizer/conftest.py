"""A served detokenizer on a free port, for the embedded tiny model."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from tokenizers import Tokenizer

from services.common import grpc_server
from services.common.pb import detokenizer_pb2_grpc
from services.detokenizer.server import create_server
from services.detokenizer.settings import DetokenizerSettings
from tests.tokenizer.conftest import model_dir

__all__ = ["model_dir"]


@pytest.fixture(scope="session")
def tokenizer(model_dir: Path) -> Tokenizer:
    return Tokenizer.from_file(str(model_dir / "tokenizer.json"))


@dataclass
class Served:
    stub: detokenizer_pb2_grpc.DetokenizerStub
    address: str


@pytest.fixture
async def served(model_dir: Path) -> AsyncIterator[Served]:
    handle = await create_server(DetokenizerSettings(model=str(model_dir), port=0))
    await handle.start()
    address = f"127.0.0.1:{handle.port}"
    await grpc_server.wait_healthy(address, timeout_s=10)
    try:
        async with grpc.aio.insecure_channel(address, options=grpc_server.CHANNEL_OPTIONS) as channel:
            yield Served(detokenizer_pb2_grpc.DetokenizerStub(channel), address)
    finally:
        await handle.stop(None)
