"""The WebSocket protocol of `/v1/ws` against fake upstream services."""

from __future__ import annotations

import asyncio
import base64
import json
import os
import socket
from collections.abc import Awaitable, Callable

import pytest
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed, InvalidStatus

from gateway.server import GatewayHandle, create_server
from tests.gateway.conftest import WAIT_S, collect, dead_address, gateway_settings, recv, send, wait_for
from tests.gateway.fakes import OUTPUT, FakeUpstreams, encode, expected_text

LONG = 10**6  # max_tokens of a generation that runs until it is cancelled
DEEP = "[" * 100_000 + "]" * 100_000  # JSON nested past any recursion limit

MakeGateway = Callable[..., Awaitable[GatewayHandle]]


async def test_two_concurrent_generations_stream_and_finish_with_usage(
    ws: ClientConnection, upstreams: FakeUpstreams
) -> None:
    await send(ws, {"type": "generate", "id": "a", "prompt": "Once upon", "params": {"max_tokens": 20}})
    messages = [{"role": "user", "content": "hi"}]
    await send(ws, {"type": "generate", "id": "b", "messages": messages, "params": {"max_tokens": 7}})
    results = await collect(ws, {"a", "b"})

    assert results["a"]["text"] == expected_text(20)
    assert results["a"]["end"] == {
        "type": "done",
        "id": "a",
        "finish_reason": "length",
        "usage": {"prompt_tokens": len(encode("Once upon")), "completion_tokens": 20, "cached_tokens": 0},
    }
    chat_prompt = "user: hi\nassistant: "
    assert results["b"]["text"] == expected_text(7)
    usage = {"prompt_tokens": len(encode(chat_prompt)), "completion_tokens": 7, "cached_tokens": 0}
    assert results["b"]["end"]["usage"] == usage
    assert all(f["type"] == "delta" for r in results.values() for f in r["frames"][:-1])
    # Both requests went over one multiplexed call to each stage.
    assert upstreams.engine.stream_calls == 1
    assert upstreams.detokenizer.stream_calls == 1
    # One DetokenizeIn per engine step at most (starts may ride along or come alone).
    assert upstreams.detokenizer.messages_in <= upstreams.engine.outs + 2
    chats = [r for r in upstreams.tokenizer.requests if r.WhichOneof("input") == "chat"]
    assert [(m.role, m.content) for m in chats[0].chat.messages] == [("user", "hi")]


async def test_params_reach_the_upstreams(ws: ClientConnection, upstreams: FakeUpstreams) -> None:
    params = {"max_tokens": 3, "temperature": 0, "top_p": 0.5, "top_k": 7, "seed": 11, "stop": ["zz"]}
    await send(ws, {"type": "generate", "id": "p", "prompt": "abcdefgh", "params": params})
    await collect(ws, {"p"})
    submit = upstreams.engine.submits[-1]
    assert submit.sampling.temperature == 0.0  # greedy
    assert submit.sampling.top_p == pytest.approx(0.5)
    assert submit.sampling.top_k == 7
    assert submit.sampling.HasField("seed") and submit.sampling.seed == 11
    assert submit.stopping.max_new_tokens == 3
    assert list(submit.prompt_ids) == encode("abcdefgh")
    start = upstreams.detokenizer.starts[-1]
    assert list(start.stop) == ["zz"]
    assert list(start.prompt_ids) == encode("abcdefgh")[-4:]
    assert start.skip_special_tokens
    # The engine gets the request's deadline as time left.
    assert 0 < submit.timeout_ms <= gateway_settings(upstreams).request_timeout_s * 1000


async def test_fixed_length_params_reach_the_engine(ws: ClientConnection, upstreams: FakeUpstreams) -> None:
    params = {"max_tokens": 6, "ignore_eos": True, "min_tokens": 6}
    await send(ws, {"type": "generate", "id": "f", "prompt": "x", "params": params})
    result = await collect(ws, {"f"})
    assert result["f"]["end"]["usage"]["completion_tokens"] == 6
    stopping = upstreams.engine.submits[-1].stopping
    assert (stopping.max_new_tokens, stopping.min_new_tokens, stopping.ignore_eos) == (6, 6, True)


async def test_defaults_when_params_are_absent(ws: ClientConnection, upstreams: FakeUpstreams) -> None:
    await send(ws, {"type": "generate", "id": "d", "prompt": "x"})
    result = await collect(ws, {"d"})
    settings = gateway_settings(upstreams)
    rest_of_context = upstreams.engine.max_model_len - len(encode("x"))
    assert result["d"]["end"]["usage"]["completion_tokens"] == rest_of_context
    assert upstreams.engine.submits[-1].sampling.temperature == settings.default_temperature
    stopping = upstreams.engine.submits[-1].stopping
    assert (stopping.min_new_tokens, stopping.ignore_eos) == (0, False)


async def test_cancel_ends_cancelled_and_aborts_the_engine(
    ws: ClientConnection, upstreams: FakeUpstreams
) -> None:
    await send(ws, {"type": "generate", "id": "c", "prompt": "go", "params": {"max_tokens": LONG}})
    first = await recv(ws)
    assert first["type"] == "delta" and first["id"] == "c"
    await send(ws, {"type": "cancel", "id": "c"})
    result = await collect(ws, {"c"})
    end = result["c"]["end"]
    assert end["type"] == "done" and end["finish_reason"] == "cancelled"
    assert 0 < end["usage"]["completion_tokens"] < LONG
    await wait_for(upstreams.engine.aborted)
    await wait_for(upstreams.detokenizer.closed)
    assert upstreams.engine.aborts == [upstreams.engine.submits[0].request_id]
    assert upstreams.detokenizer.closes == [upstreams.engine.submits[0].request_id]


async def test_cancel_while_tokenizing_never_reaches_the_engine(
    ws: ClientConnection, upstreams: FakeUpstreams
) -> None:
    upstreams.tokenizer.gate = asyncio.Event()
    await send(ws, {"type": "generate", "id": "early", "prompt": "x"})
    await wait_for(upstreams.tokenizer.arrived)
    await send(ws, {"type": "cancel", "id": "early"})
    end = (await collect(ws, {"early"}))["early"]["end"]
    assert end["finish_reason"] == "cancelled"
    assert end["usage"] == {"prompt_tokens": 0, "completion_tokens": 0, "cached_tokens": 0}
    upstreams.tokenizer.gate.set()
    upstreams.tokenizer.gate = None
    await send(ws, {"type": "generate", "id": "next", "prompt": "x", "params": {"max_tokens": 2}})
    await collect(ws, {"next"})
    assert len(upstreams.engine.submits) == 1
    assert upstreams.detokenizer.starts[0].request_id == upstreams.engine.submits[0].request_id


async def test_duplicate_id_is_refused_and_the_first_goes_on(ws: ClientConnection) -> None:
    await send(ws, {"type": "generate", "id": "dup", "prompt": "go", "params": {"max_tokens": LONG}})
    assert (await recv(ws))["type"] == "delta"
    await send(ws, {"type": "generate", "id": "dup", "prompt": "again"})
    frame = await recv(ws)
    while frame["type"] == "delta":
        frame = await recv(ws)
    assert frame["type"] == "error" and frame["id"] == "dup" and frame["code"] == "invalid_argument"
    # The first generation still streams, then ends once, on cancel.
    assert (await recv(ws))["type"] == "delta"
    await send(ws, {"type": "cancel", "id": "dup"})
    result = await collect(ws, {"dup"})
    assert result["dup"]["end"]["finish_reason"] == "cancelled"
    # The id is free again once its generation ended.
    await send(ws, {"type": "generate", "id": "dup", "prompt": "again", "params": {"max_tokens": 2}})
    assert (await collect(ws, {"dup"}))["dup"]["end"]["type"] == "done"


@pytest.mark.parametrize(
    ("raw", "carried"),
    [
        ("not json", None),
        ("[1, 2]", None),
        ('{"type": "generate", "prompt": "x"}', None),
        ('{"type": "generate", "id": 5, "prompt": "x"}', 5),
        ('{"type": "explode", "id": "t1"}', "t1"),
        ('{"id": "t2", "prompt": "x"}', "t2"),
        ('{"type": "generate", "id": "t3"}', "t3"),
        ('{"type": "generate", "id": "t4", "prompt": "x", "messages": []}', "t4"),
        ('{"type": "generate", "id": "t5", "prompt": 3}', "t5"),
        ('{"type": "generate", "id": "t6", "messages": [{"role": "user"}]}', "t6"),
        ('{"type": "generate", "id": "t7", "prompt": "x", "params": {"temperature": -1}}', "t7"),
        ('{"type": "generate", "id": "t8", "prompt": "x", "params": {"max_tokens": 0}}', "t8"),
        ('{"type": "generate", "id": "t9", "prompt": "x", "params": {"bogus": 1}}', "t9"),
        ('{"type": "generate", "id": "t10", "prompt": "x", "params": {"stop": [""]}}', "t10"),
        ('{"type": "generate", "id": "t11", "prompt": "x", "params": {"max_tokens": true}}', "t11"),
        ('{"type": "generate", "id": "t12", "prompt": "x", "params": []}', "t12"),
        (
            '{"type": "generate", "id": "t13", "prompt": "x", "params": {"max_tokens": 4, "min_tokens": 5}}',
            "t13",
        ),
        ('{"type": "generate", "id": "t14", "prompt": "x", "params": {"ignore_eos": 1}}', "t14"),
        # A lone surrogate (what JavaScript gives when it slices an emoji) is not text.
        ('{"type": "generate", "id": "t15", "prompt": "a\\ud83d"}', "t15"),
        ('{"type": "generate", "id": "t16", "messages": [{"role": "user", "content": "\\ud83d"}]}', "t16"),
        ('{"type": "generate", "id": "t17", "prompt": "x", "params": {"stop": ["\\udc00"]}}', "t17"),
        ('{"type": "generate", "id": "\\ud83d", "prompt": "x"}', None),
        ('{"type": "auth", "token": "\\ud83d"}', None),
        ('{"type": "generate", "id": "t18", "prompt": "x", "\\ud83d": 1}', "t18"),
        ('{"type": "generate", "id": "t19", "prompt": "x", "params": ' + DEEP + "}", None),
        ('{"type": "generate", "id": "t20", "messages": [{"role": "wizard", "content": "x"}]}', "t20"),
    ],
)
async def test_invalid_frames_get_an_error_with_their_id(
    ws: ClientConnection,
    gateway: GatewayHandle,
    upstreams: FakeUpstreams,
    raw: str,
    carried: str | int | None,
) -> None:
    await ws.send(raw)
    frame = await recv(ws)
    assert frame["type"] == "error" and frame["code"] == "invalid_argument"
    assert frame["id"] == carried
    assert frame["message"]
    assert upstreams.engine.submits == []
    assert gateway.core.in_flight == 0
    # The socket still works.
    await send(ws, {"type": "generate", "id": "ok", "prompt": "x", "params": {"max_tokens": 2}})
    assert (await collect(ws, {"ok"}))["ok"]["text"] == expected_text(2)


@pytest.mark.parametrize("top_p", [0, -0.5, 1.5])
async def test_top_p_outside_0_1_is_refused_naming_it(ws: ClientConnection, top_p: float) -> None:
    await send(ws, {"type": "generate", "id": "p", "prompt": "x", "params": {"top_p": top_p}})
    frame = await recv(ws)
    assert frame["type"] == "error" and frame["id"] == "p" and frame["code"] == "invalid_argument"
    assert "top_p" in frame["message"]


async def test_binary_frame_gets_an_error(ws: ClientConnection) -> None:
    await ws.send(b"\x00\x01")
    frame = await recv(ws)
    assert frame == {"type": "error", "id": None, "code": "invalid_argument", "message": frame["message"]}


async def test_cancel_of_an_unknown_id_is_ignored(ws: ClientConnection) -> None:
    await send(ws, {"type": "cancel", "id": "nobody"})
    await send(ws, {"type": "generate", "id": "g", "prompt": "x", "params": {"max_tokens": 2}})
    result = await collect(ws, {"g"})  # would fail on a frame for "nobody"
    assert result["g"]["end"]["finish_reason"] == "length"


async def test_closing_the_socket_aborts_its_generations(
    gateway: GatewayHandle, upstreams: FakeUpstreams
) -> None:
    async with connect(f"ws://127.0.0.1:{gateway.port}/v1/ws") as client:
        for name in ("x", "y"):
            await send(
                client, {"type": "generate", "id": name, "prompt": "go", "params": {"max_tokens": LONG}}
            )
        seen: set[str] = set()
        while seen != {"x", "y"}:
            seen.add((await recv(client))["id"])
    await wait_for(upstreams.engine.aborted)
    submitted = {s.request_id for s in upstreams.engine.submits}
    while set(upstreams.engine.aborts) != submitted:
        upstreams.engine.aborted.clear()
        await wait_for(upstreams.engine.aborted)
    assert gateway.core.in_flight == 0


async def test_stop_string_finishes_stop_and_aborts_the_engine(
    ws: ClientConnection, upstreams: FakeUpstreams
) -> None:
    await send(
        ws, {"type": "generate", "id": "s", "prompt": "x", "params": {"max_tokens": LONG, "stop": "world"}}
    )
    result = await collect(ws, {"s"})
    assert result["s"]["text"] == "hello "
    consumed = OUTPUT.index("world") + len("world")
    assert result["s"]["end"]["finish_reason"] == "stop"
    assert result["s"]["end"]["usage"]["completion_tokens"] == consumed
    await wait_for(upstreams.engine.aborted)
    assert upstreams.engine.aborts == [upstreams.engine.submits[0].request_id]
    # The detokenizer ended that request itself: nothing is closed there.
    assert upstreams.detokenizer.closes == []


async def test_engine_stream_failure_is_unavailable_then_reconnects(
    ws: ClientConnection, upstreams: FakeUpstreams
) -> None:
    upstreams.engine.fail_next_submit = True
    await send(ws, {"type": "generate", "id": "f", "prompt": "x", "params": {"max_tokens": LONG}})
    end = (await collect(ws, {"f"}))["f"]["end"]
    assert end["type"] == "error" and end["code"] == "unavailable" and end["id"] == "f"
    await send(ws, {"type": "generate", "id": "g", "prompt": "x", "params": {"max_tokens": 4}})
    result = await collect(ws, {"g"})
    assert result["g"]["text"] == expected_text(4)
    assert upstreams.engine.stream_calls == 2


async def test_detokenizer_failure_is_unavailable_and_aborts_the_engine(
    ws: ClientConnection, upstreams: FakeUpstreams
) -> None:
    upstreams.detokenizer.fail_next_start = True
    await send(ws, {"type": "generate", "id": "f", "prompt": "x", "params": {"max_tokens": LONG}})
    end = (await collect(ws, {"f"}))["f"]["end"]
    assert end["type"] == "error" and end["code"] == "unavailable"
    await wait_for(upstreams.engine.aborted)
    await send(ws, {"type": "generate", "id": "g", "prompt": "x", "params": {"max_tokens": 3}})
    assert (await collect(ws, {"g"}))["g"]["text"] == expected_text(3)
    assert upstreams.detokenizer.stream_calls == 2


@pytest.mark.parametrize(
    ("error", "code", "message"),
    [
        ("internal: step failed at 0x7f3a", "internal", "engine failed"),
        ("no class given", "internal", "engine failed"),
        ("unavailable: engine loop stopped: CUDA error", "unavailable", "engine unavailable"),
        ("deadline_exceeded: deadline exceeded", "deadline_exceeded", "the request ran past its deadline"),
        ("invalid_argument: too long", "invalid_argument", "engine: too long"),
    ],
)
async def test_engine_error_final_keeps_its_class_and_only_client_facing_words(
    ws: ClientConnection, upstreams: FakeUpstreams, error: str, code: str, message: str
) -> None:
    upstreams.engine.error_next_submit = error
    await send(ws, {"type": "generate", "id": "e", "prompt": "x"})
    end = (await collect(ws, {"e"}))["e"]["end"]
    assert (end["type"], end["code"], end["message"]) == ("error", code, message)
    await wait_for(upstreams.detokenizer.closed)
    assert upstreams.detokenizer.closes == [upstreams.engine.submits[0].request_id]


async def test_tokenizer_refusal_is_invalid_argument(ws: ClientConnection, upstreams: FakeUpstreams) -> None:
    await send(ws, {"type": "generate", "id": "i", "prompt": "INVALID"})
    end = (await collect(ws, {"i"}))["i"]["end"]
    assert end["type"] == "error" and end["code"] == "invalid_argument"
    assert upstreams.engine.submits == []


async def test_unreachable_tokenizer_is_unavailable(upstreams: FakeUpstreams) -> None:
    # upstream_wait_s: how long a request waits for the tokenizer before failing (default 5 s)
    settings = gateway_settings(upstreams, tokenizer=(dead_address(),), upstream_wait_s=0.2)
    server = await create_server(settings)
    await server.start()
    try:
        async with connect(f"ws://127.0.0.1:{server.port}/v1/ws") as client:
            await send(client, {"type": "generate", "id": "u", "prompt": "x"})
            end = (await collect(client, {"u"}))["u"]["end"]
            assert end["type"] == "error" and end["code"] == "unavailable"
    finally:
        await server.stop(0.1)


async def test_request_timeout_is_deadline_exceeded(upstreams: FakeUpstreams) -> None:
    server = await create_server(gateway_settings(upstreams, request_timeout_s=0.2))
    await server.start()
    try:
        async with connect(f"ws://127.0.0.1:{server.port}/v1/ws") as client:
            await send(client, {"type": "generate", "id": "t", "prompt": "x", "params": {"max_tokens": LONG}})
            end = (await collect(client, {"t"}))["t"]["end"]
            assert (end["type"], end["code"]) == ("error", "deadline_exceeded")
            assert "longer than" in end["message"]
        await wait_for(upstreams.engine.aborted)
    finally:
        await server.stop(0.1)


async def test_shutdown_lets_short_generations_finish_and_fails_the_rest(
    gateway: GatewayHandle, upstreams: FakeUpstreams
) -> None:
    async with connect(f"ws://127.0.0.1:{gateway.port}/v1/ws") as client:
        await send(client, {"type": "generate", "id": "long", "prompt": "x", "params": {"max_tokens": LONG}})
        assert (await recv(client))["type"] == "delta"
        await send(client, {"type": "generate", "id": "short", "prompt": "x", "params": {"max_tokens": 50}})
        short = ""
        while not short:
            frame = await recv(client)
            short += frame["text"] if frame["id"] == "short" else ""
        gateway.core.start_draining()
        await send(client, {"type": "generate", "id": "late", "prompt": "x"})
        results = await collect(client, {"short", "late"}, skip=frozenset({"long"}))
        assert results["short"]["end"]["finish_reason"] == "length"
        assert short + results["short"]["text"] == expected_text(50)
        assert results["late"]["end"]["code"] == "unavailable"
        await gateway.stop(0.1)
        results = await collect(client, {"long"})
        assert results["long"]["end"]["code"] == "unavailable"
    await wait_for(upstreams.engine.aborted)


def ws_url(server: GatewayHandle) -> str:
    return f"ws://127.0.0.1:{server.port}/v1/ws"


async def handshake_status(server: GatewayHandle, origin: str) -> int:
    """The HTTP status of a handshake sending `origin` (101 when the socket opened)."""
    try:
        async with connect(ws_url(server), origin=origin) as client:  # type: ignore[arg-type]
            await send(client, {"type": "generate", "id": "o", "prompt": "x", "params": {"max_tokens": 1}})
            assert (await collect(client, {"o"}))["o"]["end"]["type"] == "done"
            return 101
    except InvalidStatus as exc:
        return exc.response.status_code


@pytest.mark.parametrize(
    "origin",
    [
        "http://evil.example",
        "http://127.0.0.1",
        "http://127.0.0.1:1",
        "https://localhost",
        "null",
        "nonsense",
    ],
)
async def test_a_page_of_another_origin_is_refused_before_the_socket_opens(
    gateway: GatewayHandle, upstreams: FakeUpstreams, origin: str
) -> None:
    assert await handshake_status(gateway, origin) == 403
    assert upstreams.tokenizer.requests == [] and gateway.core.in_flight == 0


async def test_the_gateways_own_page_and_non_browsers_are_accepted(gateway: GatewayHandle) -> None:
    assert await handshake_status(gateway, f"http://127.0.0.1:{gateway.port}") == 101
    assert await handshake_status(gateway, f"HTTP://127.0.0.1:{gateway.port}") == 101
    async with connect(ws_url(gateway)) as client:  # no Origin header: not a browser
        await send(client, {"type": "generate", "id": "n", "prompt": "x", "params": {"max_tokens": 1}})
        assert (await collect(client, {"n"}))["n"]["end"]["type"] == "done"


async def test_allowed_origins_are_accepted_and_a_star_accepts_any(make_gateway: MakeGateway) -> None:
    listed = await make_gateway(allowed_origins=("https://app.example", "http://tools.example:8080"))
    assert await handshake_status(listed, "https://app.example") == 101
    assert await handshake_status(listed, "https://app.example:443") == 101
    assert await handshake_status(listed, "http://tools.example:8080") == 101
    assert await handshake_status(listed, f"http://127.0.0.1:{listed.port}") == 101  # its own page
    assert await handshake_status(listed, "http://app.example") == 403  # another scheme
    assert await handshake_status(listed, "http://tools.example") == 403  # another port
    anyone = await make_gateway(allowed_origins=("*",))
    assert await handshake_status(anyone, "http://evil.example") == 101


async def test_a_socket_that_never_authenticates_is_closed(make_gateway: MakeGateway) -> None:
    server = await make_gateway(api_keys=("k1",), ws_auth_timeout_s=0.2)
    async with connect(ws_url(server)) as client:
        frame = await recv(client)
        assert (frame["type"], frame["code"], frame["id"]) == ("error", "unauthenticated", None)
        with pytest.raises(ConnectionClosed):
            await asyncio.wait_for(client.recv(), WAIT_S)
    assert client.close_code == 1008
    assert client.close_reason == "authentication timed out"


async def test_an_authenticated_socket_is_not_timed_out(make_gateway: MakeGateway) -> None:
    server = await make_gateway(api_keys=("k1",), ws_auth_timeout_s=0.2)
    async with connect(ws_url(server)) as client:
        await send(client, {"type": "auth", "token": "k1"})
        await send(client, {"type": "generate", "id": "a", "prompt": "x", "params": {"max_tokens": 2}})
        assert (await collect(client, {"a"}))["a"]["end"]["type"] == "done"
        await asyncio.sleep(0.4)  # past the auth timeout: the socket stays open
        await send(client, {"type": "generate", "id": "b", "prompt": "x", "params": {"max_tokens": 2}})
        assert (await collect(client, {"b"}))["b"]["end"]["type"] == "done"


async def test_one_socket_runs_at_most_ws_max_in_flight_generations(
    make_gateway: MakeGateway, upstreams: FakeUpstreams
) -> None:
    server = await make_gateway(ws_max_in_flight=2)
    async with connect(ws_url(server)) as client:
        for name in ("g1", "g2"):
            await send(
                client, {"type": "generate", "id": name, "prompt": "x", "params": {"max_tokens": LONG}}
            )
        await send(client, {"type": "generate", "id": "g3", "prompt": "x"})
        results = await collect(client, {"g3"}, skip=frozenset({"g1", "g2"}))
        end = results["g3"]["end"]
        assert (end["type"], end["code"]) == ("error", "resource_exhausted")
        assert "2" in end["message"]
        assert server.core.in_flight == 2
        # The socket goes on: once one generation ends, a new one may start.
        await send(client, {"type": "cancel", "id": "g1"})
        await collect(client, {"g1"}, skip=frozenset({"g2"}))
        await send(client, {"type": "generate", "id": "g4", "prompt": "x", "params": {"max_tokens": 2}})
        assert (await collect(client, {"g4"}, skip=frozenset({"g2"})))["g4"]["end"]["type"] == "done"
    # Other sockets have their own cap.
    async with connect(ws_url(server)) as other:
        await send(other, {"type": "generate", "id": "h", "prompt": "x", "params": {"max_tokens": 2}})
        assert (await collect(other, {"h"}))["h"]["end"]["type"] == "done"


def close_code(data: bytes) -> int | None:
    """The code of the close frame among the unmasked server frames in `data`, if one is whole."""
    at = 0
    while at + 2 <= len(data):
        opcode, length, header = data[at] & 0x0F, data[at + 1] & 0x7F, 2
        if length >= 126:
            header += 2 if length == 126 else 8
            if at + header > len(data):
                return None
            length = int.from_bytes(data[at + 2 : at + header], "big")
        if at + header + length > len(data):
            return None
        if opcode == 0x8:
            return int.from_bytes(data[at + header : at + header + 2], "big")
        at += header + length
    return None


class RawClient:
    """A WebSocket client on a bare socket with a small receive buffer, so that a client that stops
    reading stops the gateway's writes after a few KiB."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock

    @classmethod
    async def open(cls, port: int) -> RawClient:
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.setblocking(False)
        loop = asyncio.get_running_loop()
        await loop.sock_connect(sock, ("127.0.0.1", port))
        key = base64.b64encode(os.urandom(16)).decode()
        request = (
            f"GET /v1/ws HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nUpgrade: websocket\r\n"
            f"Connection: Upgrade\r\nSec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n\r\n"
        )
        await loop.sock_sendall(sock, request.encode())
        head = b""
        while b"\r\n\r\n" not in head:
            head += await asyncio.wait_for(loop.sock_recv(sock, 1), WAIT_S)
        assert head.startswith(b"HTTP/1.1 101"), head
        return cls(sock)

    async def send_text(self, text: str) -> None:
        payload, mask = text.encode(), os.urandom(4)
        assert len(payload) < 2**16
        header = bytes([0x81, 0x80 | 126]) + len(payload).to_bytes(2, "big") + mask
        masked = bytes(b ^ mask[i % 4] for i, b in enumerate(payload))
        await asyncio.get_running_loop().sock_sendall(self._sock, header + masked)

    async def drain(self) -> tuple[int, int | None]:
        """Reads what the gateway sent until its close frame or the end of the connection. Returns
        the bytes read and the close code (None when the connection ended without a close frame)."""
        loop, data = asyncio.get_running_loop(), bytearray()
        while True:
            chunk = await asyncio.wait_for(loop.sock_recv(self._sock, 65536), WAIT_S)
            if not chunk:
                return len(data), None
            data += chunk
            code = close_code(data)
            if code is not None:
                return len(data), code

    def close(self) -> None:
        self._sock.close()


async def test_a_client_that_stops_reading_is_timed_out_and_its_generation_cancelled(
    make_gateway: MakeGateway, upstreams: FakeUpstreams
) -> None:
    upstreams.engine.step_s = 0  # tokens as fast as the fake engine goes
    server = await make_gateway(send_timeout_s=0.5)
    # Connections accepted from now on get a small kernel send buffer (no autotuning to MiBs), so the
    # gateway's writes block after tens of KiB rather than after megabytes.
    server.server._socket.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    client = await RawClient.open(server.port)
    try:
        frame = {"type": "generate", "id": "slow-" + "x" * 250, "prompt": "x", "params": {"max_tokens": LONG}}
        await client.send_text(json.dumps(frame))
        await wait_for(upstreams.engine.submitted)
        # The client reads nothing: the gateway's send blocks, times out, and the generation ends.
        await wait_for(upstreams.engine.aborted)
        assert upstreams.engine.aborts == [upstreams.engine.submits[0].request_id]
        assert server.core.in_flight == 0
        # What the gateway buffered for this client is bounded; once drained, the connection ends (with
        # the close frame when the client read again before the gateway stopped waiting to send it).
        size, code = await client.drain()
        assert size < 2**20 and code in (None, 1008)
    finally:
        client.close()
    # The gateway goes on serving other clients.
    async with connect(ws_url(server)) as other:
        await send(other, {"type": "generate", "id": "ok", "prompt": "x", "params": {"max_tokens": 2}})
        assert (await collect(other, {"ok"}))["ok"]["end"]["type"] == "done"


async def test_a_client_that_stops_reading_is_cut_off_at_once(
    make_gateway: MakeGateway, upstreams: FakeUpstreams
) -> None:
    """After the send timeout the gateway drops the connection (aborts its transport): while the client
    still reads nothing, the server holds no connection for it and nothing is in flight."""
    upstreams.engine.step_s = 0
    server = await make_gateway(send_timeout_s=0.5)
    server.server._socket.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    connections = server.server._http.server_state.connections
    client = await RawClient.open(server.port)
    try:
        assert len(connections) == 1
        frame = {"type": "generate", "id": "stuck", "prompt": "x", "params": {"max_tokens": LONG}}
        await client.send_text(json.dumps(frame))
        await wait_for(upstreams.engine.aborted)
        async with asyncio.timeout(WAIT_S):
            while connections:
                await asyncio.sleep(0.01)
        assert server.core.in_flight == 0
    finally:
        client.close()
