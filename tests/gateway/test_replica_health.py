"""Replica health in routing: the gateway watches every replica's grpc.health.v1 status and gives no
new work to one that says it is not serving (an engine whose loop died stays up NOT_SERVING), until it
says SERVING again; a Tokenize call whose replica went away is made once more elsewhere."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

import grpc
import httpx
import pytest

from gateway.server import GatewayHandle, create_server
from tests.gateway.conftest import WAIT_S, gateway_settings
from tests.gateway.fakes import MODEL, FakeUpstreams, expected_text, start_upstreams

BODY = {"model": MODEL, "prompt": "hi", "max_tokens": 3}


async def until(condition: Callable[[], bool]) -> None:
    async with asyncio.timeout(WAIT_S):
        while not condition():
            await asyncio.sleep(0.01)


@pytest.fixture
async def three() -> AsyncIterator[list[FakeUpstreams]]:
    fakes = [await start_upstreams() for _ in range(3)]
    yield fakes
    for one in fakes:
        await one.stop()


async def post_all(server: GatewayHandle, n: int) -> list[httpx.Response]:
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{server.port}", timeout=WAIT_S) as http:
        return list(await asyncio.gather(*(http.post("/v1/completions", json=BODY) for _ in range(n))))


async def test_engines_not_serving_get_no_work_and_no_retry_until_they_serve_again(
    three: list[FakeUpstreams],
) -> None:
    engines = tuple(f.addresses["engine"] for f in three)
    server = await create_server(gateway_settings(three[0], engine=engines))
    await server.start()
    replicas = server.core._stages.engines
    try:
        for dead in three[1:]:
            await dead.health["engine"].set_serving(False)
        await until(lambda: len(replicas.connected()) == 1 and len(replicas._serving) == 3)
        replies = await post_all(server, 6)
        assert [r.status_code for r in replies] == [200] * 6
        # The live engine breaks before the first token: the retry finds no other serving engine.
        three[0].engine.fail_next_submit = True
        [failed] = await post_all(server, 1)
        assert failed.status_code == 503, failed.text
        assert [len(f.engine.submits) for f in three] == [7, 0, 0]
        await three[1].health["engine"].set_serving(True)
        await until(lambda: len(replicas.connected()) == 2)
        replies = await post_all(server, 8)
    finally:
        await server.stop(0.5)
    assert [r.status_code for r in replies] == [200] * 8
    assert len(three[1].engine.submits) > 0 and len(three[2].engine.submits) == 0


async def test_a_tokenizer_not_serving_gets_no_work(three: list[FakeUpstreams]) -> None:
    tokenizers = tuple(f.addresses["tokenizer"] for f in three[:2])
    server = await create_server(gateway_settings(three[0], tokenizer=tokenizers))
    await server.start()
    replicas = server.core._stages.tokenizers
    try:
        await three[0].health["tokenizer"].set_serving(False)
        await until(lambda: len(replicas.connected()) == 1 and len(replicas._serving) == 2)
        replies = await post_all(server, 4)
    finally:
        await server.stop(0.5)
    assert [r.status_code for r in replies] == [200] * 4
    assert (len(three[0].tokenizer.requests), len(three[1].tokenizer.requests)) == (0, 4)


async def test_a_cancelled_tokenize_is_made_again_on_the_other_tokenizer(three: list[FakeUpstreams]) -> None:
    """A draining tokenizer cancels the calls still running when its grace ends: the call goes to the
    other tokenizer, and the client sees nothing of it."""
    first, second = three[0].tokenizer, three[1].tokenizer
    first.fail_next = second.fail_next = [grpc.StatusCode.CANCELLED]  # whichever is asked first
    tokenizers = (three[0].addresses["tokenizer"], three[1].addresses["tokenizer"])
    server = await create_server(gateway_settings(three[0], tokenizer=tokenizers))
    await server.start()
    try:
        await until(lambda: len(server.core._stages.tokenizers.connected()) == 2)
        [reply] = await post_all(server, 1)
    finally:
        await server.stop(0.5)
    assert reply.status_code == 200, reply.text
    assert reply.json()["choices"][0]["text"] == expected_text(3)
    assert (len(first.requests), len(second.requests)) == (1, 1)


@pytest.mark.parametrize("status", [grpc.StatusCode.CANCELLED, grpc.StatusCode.UNAVAILABLE])
async def test_a_tokenizer_that_keeps_going_away_fails_the_request_unavailable(
    upstreams: FakeUpstreams, status: grpc.StatusCode
) -> None:
    upstreams.tokenizer.fail_next = [status, status]
    server = await create_server(gateway_settings(upstreams))
    await server.start()
    try:
        [reply] = await post_all(server, 1)
    finally:
        await server.stop(0.5)
    assert reply.status_code == 503, reply.text
    error = reply.json()["error"]
    assert (error["code"], error["message"]) == ("unavailable", "tokenizer unavailable")
    assert len(upstreams.tokenizer.requests) == 2
