"""The Host allow-list against DNS rebinding: a page of another site whose name was rebound to the
gateway's address sends its own name as Host, and the `/v1/` routes and the WebSocket refuse it."""

from __future__ import annotations

import json
import re
import socket
from collections.abc import Awaitable, Callable

import httpx
import pytest
from websockets.asyncio.client import connect
from websockets.exceptions import InvalidStatus

from gateway.auth import allowed_hosts
from gateway.server import GatewayHandle
from gateway.settings import GatewaySettings
from services.common.settings import load_settings
from tests.gateway.conftest import WAIT_S
from tests.gateway.fakes import MODEL

MakeGateway = Callable[..., Awaitable[GatewayHandle]]
BODY = {"model": MODEL, "prompt": "x", "max_tokens": 2}


async def post_as(server: GatewayHandle, host: str) -> httpx.Response:
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{server.port}", timeout=WAIT_S) as http:
        return await http.post("/v1/completions", json=BODY, headers={"host": host})


async def ws_handshake_as(server: GatewayHandle, host: str) -> int:
    """The handshake's HTTP status for a WebSocket whose Host is `host` (101 when it opens)."""
    sock = socket.create_connection(("127.0.0.1", server.port))
    try:
        async with connect(f"ws://{host}/v1/ws", sock=sock, open_timeout=WAIT_S) as ws:
            await ws.send(
                json.dumps({"type": "generate", "id": "g", "prompt": "x", "params": {"max_tokens": 1}})
            )
            return 101
    except InvalidStatus as exc:
        return exc.response.status_code


async def test_a_rebound_name_is_refused_on_http_and_websocket(make_gateway: MakeGateway) -> None:
    server = await make_gateway()
    refused = await post_as(server, f"evil.example:{server.port}")
    assert refused.status_code == 403
    error = refused.json()["error"]
    assert error["code"] == "host_not_allowed" and "'evil.example'" in error["message"]
    assert await ws_handshake_as(server, f"evil.example:{server.port}") == 403
    for host in (f"localhost:{server.port}", f"127.0.0.1:{server.port}", "LOCALHOST"):
        assert (await post_as(server, host)).status_code == 200, host
    assert await ws_handshake_as(server, f"localhost:{server.port}") == 101
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{server.port}", timeout=WAIT_S) as http:
        assert (await http.get("/healthz", headers={"host": "evil.example"})).status_code == 200


async def test_the_allow_list_is_configurable(make_gateway: MakeGateway) -> None:
    named = await make_gateway(allowed_hosts=("api.example",))
    assert (await post_as(named, "api.example:443")).status_code == 200
    assert (await post_as(named, "localhost")).status_code == 403
    assert (await post_as(named, "")).status_code == 400
    anyone = await make_gateway(allowed_hosts=("*",))
    assert (await post_as(anyone, "evil.example")).status_code == 200
    assert await ws_handshake_as(anyone, "evil.example") == 101


@pytest.mark.parametrize(
    ("configured", "bound", "expected"),
    [
        ((), "127.0.0.1", {"localhost", "127.0.0.1", "::1"}),
        ((), "10.1.2.3", {"localhost", "127.0.0.1", "::1", "10.1.2.3"}),
        ((), "0.0.0.0", {"*"}),
        ((), "::", {"*"}),
        (("Api.Example", "[::1]"), "127.0.0.1", {"api.example", "::1"}),
    ],
)
def test_the_default_allow_list(configured: tuple[str, ...], bound: str, expected: set[str]) -> None:
    assert allowed_hosts(configured, bound) == expected


@pytest.mark.parametrize("entry", ["api.example:8000", "[::1]:8000", "http://api.example", "api.example/v1"])
def test_an_allowed_host_that_is_not_a_host_name_is_refused_at_start_up(entry: str) -> None:
    """A Host header is matched by its name whatever its port, so an entry with a port (or a scheme,
    or a path) would never match: the gateway refuses to start with it, naming it."""
    with pytest.raises(SystemExit):
        load_settings(GatewaySettings, ["--allowed-hosts", f"localhost,{entry}"])
    with pytest.raises(ValueError, match=re.escape(repr(entry)) + ".* is not a host name"):
        GatewaySettings(allowed_hosts=("localhost", entry))


@pytest.mark.parametrize("entry", ["api.example", "API.example", "10.0.0.5", "::1", "[::1]", "*"])
def test_host_names_and_addresses_are_accepted(entry: str) -> None:
    assert GatewaySettings(allowed_hosts=(entry,)).allowed_hosts == (entry,)
