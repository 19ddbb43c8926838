"""Every service has the same shape: `create_server(settings)` returns a `ServerHandle`."""

from __future__ import annotations

import importlib
import typing

import pytest

from services.common.grpc_server import ServerHandle

SERVER_MODULES = ("services.tokenizer.server", "services.engine.server", "services.detokenizer.server",
                  "gateway.server")  # fmt: skip


@pytest.mark.parametrize("module", SERVER_MODULES)
def test_every_create_server_returns_a_server_handle(module: str) -> None:
    create_server = importlib.import_module(module).create_server
    returned = typing.get_type_hints(create_server)["return"]
    assert typing.get_origin(returned) is ServerHandle, returned
