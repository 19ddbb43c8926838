"""Replica health in routing: the gateway watches every replica's grpc.health.v1 status and gives no
new work to one that says it is not serving (an engine whose loop died stays up NOT_SERVING), until it
says SERVING again; a Tokenize or TokenPieces call whose replica went away is made once more elsewhere,
and logprobs that no detokenizer can give fail only their own request (503)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

import grpc
import httpx
import pytest

from gateway.server import GatewayHandle, create_server
from tests.gateway.conftest import WAIT_S, dead_address, gateway_settings, until
from tests.gateway.fakes import MODEL, FakeUpstreams, expected_text, start_upstreams

BODY = {"model": MODEL, "prompt": "hi", "max_tokens": 3}


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


async def logprob_completions(
    server: GatewayHandle, prompts: list[str], **extra: object
) -> list[httpx.Response]:
    """One completions request with echoed prompt logprobs per prompt, in turn: each prompt brings
    token ids the gateway has not looked up yet, so each needs a TokenPieces call."""
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{server.port}", timeout=WAIT_S) as http:
        body = {"model": MODEL, "max_tokens": 2, "logprobs": 1, "echo": True, **extra}
        return [await http.post("/v1/completions", json={**body, "prompt": p}) for p in prompts]


async def test_logprobs_while_a_detokenizer_replica_is_down(upstreams: FakeUpstreams) -> None:
    """Token pieces for logprobs come from a ready detokenizer replica, never from the one that is
    down (the detokenizer's streams already avoid it)."""
    detokenizers = (upstreams.addresses["detokenizer"], dead_address())
    server = await create_server(gateway_settings(upstreams, detokenizer=detokenizers))
    await server.start()
    try:
        replies = await logprob_completions(server, ["ab", "cd", "ef", "gh"])
    finally:
        await server.stop(0.5)
    assert [r.status_code for r in replies] == [200] * 4, [r.text for r in replies]
    assert [r.json()["choices"][0]["logprobs"]["tokens"][1:3] for r in replies] == [
        ["a", "b"], ["c", "d"], ["e", "f"], ["g", "h"]
    ]  # fmt: skip


async def test_a_token_pieces_call_whose_replica_goes_away_is_made_again_on_the_other(
    three: list[FakeUpstreams],
) -> None:
    first, second = three[0].detokenizer, three[1].detokenizer
    first.fail_next_pieces = second.fail_next_pieces = [grpc.StatusCode.UNAVAILABLE]  # whichever is first
    detokenizers = (three[0].addresses["detokenizer"], three[1].addresses["detokenizer"])
    server = await create_server(gateway_settings(three[0], detokenizer=detokenizers))
    await server.start()
    try:
        await until(lambda: len(server.core._stages.detokenizers.connected()) == 2)
        [reply] = await logprob_completions(server, ["ab"])
    finally:
        await server.stop(0.5)
    assert reply.status_code == 200, reply.text
    assert first.pieces_calls and second.pieces_calls and not first.fail_next_pieces


@pytest.mark.parametrize("stream", [False, True])
async def test_logprobs_no_detokenizer_can_give_fail_that_request_unavailable(
    upstreams: FakeUpstreams, stream: bool
) -> None:
    """Token pieces that no replica can give end that request with a clean 503 (a stream: an error
    event, then [DONE]), not a 500 or a stream cut off; the next request is served."""
    upstreams.detokenizer.fail_next_pieces = [grpc.StatusCode.UNAVAILABLE] * 2
    server = await create_server(gateway_settings(upstreams))
    await server.start()
    try:
        failed, served = await logprob_completions(server, ["ab", "cd"], stream=stream)
    finally:
        await server.stop(0.5)
    if stream:
        assert failed.status_code == 200
        events = [line[len("data: ") :] for line in failed.text.splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        error = json.loads(events[-2])["error"]
    else:
        assert failed.status_code == 503, failed.text
        error = failed.json()["error"]
    assert (error["code"], error["message"]) == ("unavailable", "detokenizer unavailable")
    assert served.status_code == 200, served.text
