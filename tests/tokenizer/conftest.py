"""A served tokenizer on a free port, for the embedded tiny model (or a variant of its files)."""

from __future__ import annotations

import json
import shutil
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest

from services.common import grpc_server
from services.common.pb import tokenizer_pb2_grpc
from services.tokenizer.server import create_server
from services.tokenizer.settings import TokenizerSettings

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "config.json",
    "generation_config.json",
)


def write_tokenizer_dir(out: Path) -> Path:
    """The tiny model's tokenizer files and configs, without weights (what these services read)."""
    from sluice.model.tokenizer import BOS_ID, GENERATION_EOS_IDS, PAD_ID, save_tokenizer, train_tokenizer

    save_tokenizer(train_tokenizer(), out, model_max_length=2048)
    ids = {"bos_token_id": BOS_ID, "eos_token_id": GENERATION_EOS_IDS, "pad_token_id": PAD_ID}
    config = {"model_type": "llama", "max_position_embeddings": 2048, **ids}
    (out / "config.json").write_text(json.dumps(config))
    (out / "generation_config.json").write_text(json.dumps(ids))
    return out


@pytest.fixture(scope="session")
def model_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The project's tiny model: the suite-wide `tiny_model_dir` when it exists, else its tokenizer
    files written here."""
    try:
        return Path(request.getfixturevalue("tiny_model_dir"))
    except pytest.FixtureLookupError:
        return write_tokenizer_dir(tmp_path_factory.mktemp("tiny") / "model")


def variant_dir(model_dir: Path, dst: Path, **config_changes: object) -> Path:
    """A copy of the model's tokenizer files with `tokenizer_config.json` changed (None deletes a key)."""
    dst.mkdir(parents=True, exist_ok=True)
    for name in TOKENIZER_FILES:
        if (model_dir / name).exists():
            shutil.copy(model_dir / name, dst / name)
    config = json.loads((dst / "tokenizer_config.json").read_text())
    for key, value in config_changes.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    (dst / "tokenizer_config.json").write_text(json.dumps(config))
    return dst


@dataclass
class Served:
    stub: tokenizer_pb2_grpc.TokenizerStub
    address: str


async def serve(model_dir: Path, **settings: object) -> AsyncIterator[Served]:
    handle = await create_server(
        TokenizerSettings(model=str(model_dir), port=0, **settings)  # type: ignore[arg-type]
    )
    await handle.start()
    address = f"127.0.0.1:{handle.port}"
    await grpc_server.wait_healthy(address, timeout_s=10)
    try:
        async with grpc.aio.insecure_channel(address, options=grpc_server.CHANNEL_OPTIONS) as channel:
            yield Served(tokenizer_pb2_grpc.TokenizerStub(channel), address)
    finally:
        await handle.stop(None)


@pytest.fixture
async def served(model_dir: Path) -> AsyncIterator[Served]:
    async for s in serve(model_dir):
        yield s
