"""The detokenizer service alone, through a gRPC client."""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator, Sequence

import grpc
import pytest
from tokenizers import Tokenizer

from services.common.pb import detokenizer_pb2 as pb
from tests.detokenizer.conftest import Served

TEXTS = [
    "Hello there, how are you today?",
    "Emoji 😀👍🏽 and CJK 世界你好, e\u0301 combining.",
    "Line one.\nLine two.\n\nDone!",
    "  leading spaces and trailing  ",
]


def start(rid: str, **kwargs: object) -> pb.DetokenizeInEntry:
    return pb.DetokenizeInEntry(start=pb.DetokenizeStart(request_id=rid, **kwargs))  # type: ignore[arg-type]


def chunk(rid: str, ids: Sequence[int]) -> pb.DetokenizeInEntry:
    return pb.DetokenizeInEntry(chunk=pb.DetokenizeChunk(request_id=rid, token_ids=ids))


def close(rid: str) -> pb.DetokenizeInEntry:
    return pb.DetokenizeInEntry(close=pb.DetokenizeClose(request_id=rid))


class MuxClient:
    """One multiplexed Stream call: `send` one message, get its one answer."""

    def __init__(self, served: Served) -> None:
        self.call = served.stub.Stream()

    async def send(self, *entries: pb.DetokenizeInEntry) -> pb.DetokenizeOut:
        await self.call.write(pb.DetokenizeIn(entries=entries))
        return await self.call.read()

    async def end(self) -> None:
        await self.call.done_writing()
        assert await self.call.read() is grpc.aio.EOF


def collect(outs: Sequence[pb.DetokenizeOut]) -> tuple[dict[str, str], dict[str, pb.DetokenizeFinal]]:
    texts: dict[str, str] = {}
    finals: dict[str, pb.DetokenizeFinal] = {}
    for out in outs:
        for entry in out.entries:
            if entry.WhichOneof("kind") == "delta":
                assert entry.delta.request_id not in finals, "delta after final"
                texts[entry.delta.request_id] = texts.get(entry.delta.request_id, "") + entry.delta.text
            else:
                assert entry.final.request_id not in finals, "two finals"
                finals[entry.final.request_id] = entry.final
    return texts, finals


async def test_decode(served: Served, tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("<|im_start|>user\nhé 世界<|im_end|>", add_special_tokens=True).ids
    reply = await served.stub.Decode(pb.DecodeRequest(ids=ids))
    assert reply.text == tokenizer.decode(ids, skip_special_tokens=False)
    skipped = await served.stub.Decode(pb.DecodeRequest(ids=ids, skip_special_tokens=True))
    assert skipped.text == "user\nhé 世界"
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await served.stub.Decode(pb.DecodeRequest(ids=[5, 10**6]))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "1000000" in (info.value.details() or "")


async def test_multiplexed_stream_is_exact(served: Served, tokenizer: Tokenizer) -> None:
    rng = random.Random(7)
    ids = {f"r{i}": tokenizer.encode(t, add_special_tokens=False).ids for i, t in enumerate(TEXTS)}
    client = MuxClient(served)
    outs = [await client.send(*(start(rid, prompt_ids=[1]) for rid in ids))]
    assert not outs[0].entries
    pos = dict.fromkeys(ids, 0)
    while any(pos[r] < len(ids[r]) for r in ids):
        step = []
        for rid, seq in ids.items():
            if pos[rid] < len(seq):
                n = rng.randint(1, 3)
                step.append(chunk(rid, seq[pos[rid] : pos[rid] + n]))
                pos[rid] += n
        outs.append(await client.send(*step))
    outs.append(await client.send(*(close(rid) for rid in ids)))
    await client.end()
    texts, finals = collect(outs)
    for rid, seq in ids.items():
        assert texts[rid] == tokenizer.decode(seq)
        assert not finals[rid].stopped and not finals[rid].error
        assert finals[rid].num_ids_consumed == len(seq)


async def test_stop_string_final_and_late_chunks(served: Served, tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("one two three. four five", add_special_tokens=False).ids
    client = MuxClient(served)
    outs = [
        await client.send(
            start("a", stop=["three."], include_stop_str_in_output=True), start("b", stop=["r fi", "zz"])
        )
    ]
    for i in ids:
        outs.append(await client.send(chunk("a", [i]), chunk("b", [i])))
    outs.append(await client.send(close("a"), close("b"), chunk("zzz", [5])))
    await client.end()
    texts, finals = collect(outs)
    assert texts["a"] == "one two three."
    assert finals["a"].stopped and finals["a"].stop == "three."
    assert tokenizer.decode(ids[: finals["a"].num_ids_consumed]).endswith("three.")
    assert not tokenizer.decode(ids[: finals["a"].num_ids_consumed - 1]).endswith("three.")
    assert texts["b"] == "one two three. fou"
    assert finals["b"].stopped and finals["b"].stop == "r fi"
    assert finals["zzz"].error and "unknown" in finals["zzz"].error


async def test_per_request_stream(served: Served, tokenizer: Tokenizer) -> None:
    text = "Per-request streaming: 😀 世界."
    ids = tokenizer.encode(text, add_special_tokens=False).ids

    async def entries() -> AsyncIterator[pb.DetokenizeInEntry]:
        yield start("x", prompt_ids=[1])
        for i in range(0, len(ids), 2):
            yield chunk("x", ids[i : i + 2])
        yield close("x")

    out = [e async for e in served.stub.DetokenizeStream(entries())]
    assert [e.WhichOneof("kind") for e in out][-1] == "final"
    assert "".join(e.delta.text for e in out[:-1]) == text
    assert out[-1].final.num_ids_consumed == len(ids)


async def test_256_concurrent_per_request_streams(served: Served, tokenizer: Tokenizer) -> None:
    """256 concurrent per-request calls, each exact and with its own text."""
    texts = [f"{i}: " + TEXTS[i % len(TEXTS)] for i in range(256)]

    async def one(i: int) -> str:
        ids = tokenizer.encode(texts[i], add_special_tokens=False).ids

        async def entries() -> AsyncIterator[pb.DetokenizeInEntry]:
            yield start(f"r{i}")
            for token in ids:
                yield chunk(f"r{i}", [token])
            yield close(f"r{i}")

        return "".join(
            [
                e.delta.text
                async for e in served.stub.DetokenizeStream(entries())
                if e.WhichOneof("kind") == "delta"
            ]
        )

    assert await asyncio.gather(*(one(i) for i in range(256))) == texts


async def test_256_requests_on_one_multiplexed_stream(served: Served, tokenizer: Tokenizer) -> None:
    rng = random.Random(3)
    texts = {f"q{i}": f"request {i} " + rng.choice(TEXTS) * rng.randint(1, 3) for i in range(256)}
    ids = {rid: tokenizer.encode(t, add_special_tokens=False).ids for rid, t in texts.items()}
    client = MuxClient(served)
    outs = [await client.send(*(start(rid) for rid in ids))]
    for step in range(max(map(len, ids.values()))):
        step_entries = [chunk(rid, [seq[step]]) for rid, seq in ids.items() if step < len(seq)]
        outs.append(await client.send(*step_entries))
    outs.append(await client.send(*(close(rid) for rid in ids)))
    await client.end()
    got, finals = collect(outs)
    assert got == texts
    assert all(finals[rid].num_ids_consumed == len(ids[rid]) for rid in ids)


async def test_special_tokens_and_bad_ids(served: Served, tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("<|im_start|>assistant\nHi there!<|im_end|>", add_special_tokens=False).ids
    client = MuxClient(served)
    outs = [await client.send(start("skip", skip_special_tokens=True), start("keep"), start("bad"))]
    outs.append(await client.send(chunk("skip", ids), chunk("keep", ids), chunk("bad", [3, -1])))
    outs.append(await client.send(close("skip"), close("keep"), chunk("bad", ids), close("bad")))
    await client.end()
    texts, finals = collect(outs)
    assert texts["skip"] == "assistant\nHi there!"
    assert texts["keep"] == "<|im_start|>assistant\nHi there!<|im_end|>"
    assert "bad" not in texts
    assert "-1" in finals["bad"].error and "vocabulary" in finals["bad"].error
    assert not finals["skip"].error and finals["skip"].num_ids_consumed == len(ids)


async def test_token_pieces(served: Served, tokenizer: Tokenizer) -> None:
    text = "héllo 世界 €"
    ids = tokenizer.encode(text, add_special_tokens=False).ids
    reply = await served.stub.TokenPieces(pb.TokenPiecesRequest(ids=ids))
    assert len(reply.pieces) == len(ids)
    assert b"".join(piece.bytes for piece in reply.pieces) == text.encode()
    assert [p.text for p in reply.pieces] == [p.bytes.decode("utf-8", "replace") for p in reply.pieces]
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await served.stub.TokenPieces(pb.TokenPiecesRequest(ids=[5, -1]))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT


async def test_deltas_count_the_ids_consumed_up_to_a_stop_mid_chunk(
    served: Served, tokenizer: Tokenizer
) -> None:
    ids = tokenizer.encode("one two three. four five", add_special_tokens=False).ids
    through_stop = next(k for k in range(len(ids) + 1) if "three." in tokenizer.decode(ids[:k]))
    client = MuxClient(served)
    await client.send(start("a", stop=["three."], include_stop_str_in_output=True), start("b"))
    first = await client.send(chunk("a", ids[:2]), chunk("b", ids[:2]))
    rest = await client.send(chunk("a", ids[2:]), chunk("b", ids[2:]))
    await client.end()
    deltas = [e.delta for out in (first, rest) for e in out.entries if e.WhichOneof("kind") == "delta"]
    expected = [("a", 2), ("b", 2), ("a", through_stop), ("b", len(ids))]
    assert [(d.request_id, d.num_ids) for d in deltas] == expected
    (final,) = [e.final for e in rest.entries if e.WhichOneof("kind") == "final"]
    assert final.request_id == "a" and final.stopped and final.num_ids_consumed == through_stop
