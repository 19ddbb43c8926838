"""What every API hands out agrees with the text: the token ids, logprobs and `completion_tokens` are
those of the tokens whose text went out (the one that completed a stop string included, none after it),
and logprob `bytes` are each token's own bytes.

The engine sends several tokens per step, so a stop string completes in the middle of a chunk with more
tokens after it in the same chunk, and the gateway holds ids the detokenizer has not answered for yet.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest
from tokenizers import Tokenizer
from websockets.asyncio.client import connect

from gateway.events import Done, GenerateInput
from gateway.server import GatewayHandle
from services.common import grpc_server
from services.common.pb import common_pb2, gateway_pb2, gateway_pb2_grpc
from services.detokenizer.server import create_server as create_detokenizer
from services.detokenizer.settings import DetokenizerSettings
from tests.detokenizer.made_tokenizers import byte_level_bpe, sentencepiece_like
from tests.gateway.conftest import WAIT_S, collect, send
from tests.gateway.fakes import OUTPUT, FakeUpstreams

TOKENS_PER_STEP = 4  # OUTPUT "hello world. " arrives as "hell", "o wo", "rld.", " hel", ...
LONG = 1000


@pytest.fixture
def chunky(upstreams: FakeUpstreams) -> FakeUpstreams:
    upstreams.engine.tokens_per_step = TOKENS_PER_STEP
    return upstreams


def consumed(stop: str) -> str:
    """The generated text up to and including the token that completes `stop` (one char per token)."""
    return OUTPUT[: OUTPUT.index(stop) + len(stop)]


@pytest.mark.parametrize(
    ("stop", "include", "text"),
    [("ld", False, "hello wor"), ("wor", True, "hello wor"), ("o w", False, "hell")],
)
async def test_grpc_ids_and_logprobs_end_at_the_stop(
    gateway: GatewayHandle, chunky: FakeUpstreams, stop: str, include: bool, text: str
) -> None:
    request = gateway_pb2.PublicGenerateRequest(
        prompt="x",
        sampling=common_pb2.SamplingParams(logprobs=1),
        stopping=common_pb2.StoppingParams(
            max_new_tokens=LONG, stop=[stop], include_stop_str_in_output=include
        ),
        return_token_ids=True,
    )
    got_text, ids, logprobs = "", [], []
    async with grpc.aio.insecure_channel(f"127.0.0.1:{gateway.server.grpc_port}") as channel:
        async for response in gateway_pb2_grpc.GatewayStub(channel).Generate(request, timeout=WAIT_S):
            if response.WhichOneof("kind") == "delta":
                got_text += response.delta.text
                ids.extend(response.delta.token_ids)
                logprobs.extend(response.delta.logprobs)
                assert len(response.delta.logprobs) == len(response.delta.token_ids)
            else:
                final = response.final
    assert got_text == text
    assert ids == [ord(c) for c in consumed(stop)]
    assert len(logprobs) == len(ids)
    assert final.usage.completion_tokens == len(ids)
    assert final.finish_reason == common_pb2.FINISH_REASON_STOP and final.stop == stop


async def test_openai_chat_stream_logprobs_and_usage_end_at_the_stop(
    gateway: GatewayHandle, chunky: FakeUpstreams
) -> None:
    body = {
        "model": "fake-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": LONG,
        "stop": ["ld"], "logprobs": True, "stream": True, "stream_options": {"include_usage": True},
    }  # fmt: skip
    content, tokens, usage = "", [], None
    async with (
        httpx.AsyncClient(base_url=f"http://127.0.0.1:{gateway.port}", timeout=WAIT_S) as http,
        http.stream("POST", "/v1/chat/completions", json=body) as reply,
    ):
        assert reply.status_code == 200
        async for line in reply.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: ") :])
            usage = chunk.get("usage") or usage
            for choice in chunk["choices"]:
                content += choice["delta"].get("content") or ""
                tokens += [item["token"] for item in (choice["logprobs"] or {}).get("content", [])]
    assert content == "hello wor"
    assert "".join(tokens) == consumed("ld")
    assert usage is not None and usage["completion_tokens"] == len(tokens)


async def test_openai_completion_logprobs_and_usage_end_at_the_stop(
    gateway: GatewayHandle, chunky: FakeUpstreams
) -> None:
    body = {"model": "fake-model", "prompt": "x", "max_tokens": LONG, "stop": "ld", "logprobs": 1}
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{gateway.port}", timeout=WAIT_S) as http:
        reply = (await http.post("/v1/completions", json=body)).json()
    choice = reply["choices"][0]
    assert choice["text"] == "hello wor" and choice["finish_reason"] == "stop"
    assert "".join(choice["logprobs"]["tokens"]) == consumed("ld")
    assert (
        len(choice["logprobs"]["token_logprobs"])
        == reply["usage"]["completion_tokens"]
        == len(consumed("ld"))
    )


async def test_websocket_usage_ends_at_the_stop(gateway: GatewayHandle, chunky: FakeUpstreams) -> None:
    async with connect(f"ws://127.0.0.1:{gateway.port}/v1/ws") as ws:
        await send(
            ws, {"type": "generate", "id": "s", "prompt": "x", "params": {"max_tokens": LONG, "stop": "ld"}}
        )
        result = (await collect(ws, {"s"}))["s"]
    assert result["text"] == "hello wor"
    assert result["end"]["usage"]["completion_tokens"] == len(consumed("ld"))


async def test_cancelled_usage_counts_the_ids_handed_out(
    gateway: GatewayHandle, chunky: FakeUpstreams
) -> None:
    inp = GenerateInput(
        prompt="x", stopping=common_pb2.StoppingParams(max_new_tokens=LONG), return_token_ids=True
    )
    generation = gateway.core.generate(inp)
    ids = (await generation.next()).token_ids  # type: ignore[union-attr]
    generation.cancel()
    while not isinstance(event := await generation.next(), Done):
        ids += event.token_ids  # type: ignore[union-attr]
    assert event.finish_reason == "cancelled"
    assert event.completion_tokens == len(ids) > 0


# ----- the real detokenizer: byte-fallback tokens and tokens that hold part of a character

TEXT = "ab € cd. ef gh"  # "€" is three tokens of one byte each in both tokenizers
TOKENIZERS = {"sentencepiece": sentencepiece_like, "byte_level": byte_level_bpe}


@pytest.fixture(params=sorted(TOKENIZERS))
async def real_detokenizer(
    request: pytest.FixtureRequest, tmp_path: Path
) -> AsyncIterator[tuple[str, Tokenizer]]:
    tokenizer = TOKENIZERS[request.param]()
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    detokenizer = await create_detokenizer(DetokenizerSettings(model=str(tmp_path), port=0))
    await detokenizer.start()
    address = f"127.0.0.1:{detokenizer.port}"
    await grpc_server.wait_healthy(address, timeout_s=WAIT_S)
    try:
        yield address, tokenizer
    finally:
        await detokenizer.stop(None)


async def test_logprob_bytes_are_each_tokens_own_bytes(
    make_gateway: Callable[..., Awaitable[GatewayHandle]],
    upstreams: FakeUpstreams,
    real_detokenizer: tuple[str, Tokenizer],
) -> None:
    address, tokenizer = real_detokenizer
    ids = tokenizer.encode(TEXT, add_special_tokens=False).ids
    upstreams.engine.output_ids = ids
    upstreams.engine.tokens_per_step = len(ids)  # all in one chunk: the stop completes in its middle
    gateway = await make_gateway(detokenizer=(address,))
    body: dict[str, Any] = {
        "model": "fake-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": LONG,
        "stop": ["d."], "logprobs": True, "top_logprobs": 0,
    }  # fmt: skip
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{gateway.port}", timeout=WAIT_S) as http:
        reply = (await http.post("/v1/chat/completions", json=body)).json()
    choice = reply["choices"][0]
    entries = choice["logprobs"]["content"]
    through_stop = next(k for k in range(len(ids) + 1) if "d." in tokenizer.decode(ids[:k]))
    assert choice["message"]["content"].strip() == "ab € c"
    assert len(entries) == reply["usage"]["completion_tokens"] == through_stop
    pieces = [bytes(entry["bytes"]) for entry in entries]
    assert b"".join(pieces).decode().strip() == "ab € cd."
    assert {b"\xe2", b"\x82", b"\xac"} <= {piece.strip() for piece in pieces}
    assert [entry["token"] for entry in entries] == [p.decode(errors="replace") for p in pieces]
