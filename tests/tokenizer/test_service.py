"""The tokenizer service alone, through a gRPC client."""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
import pytest
from tokenizers import Tokenizer
from transformers import AutoTokenizer

from services.common.pb import common_pb2, tokenizer_pb2
from tests.tokenizer.conftest import Served, serve, variant_dir

CONVERSATIONS = [
    [("user", "hi")],
    [("system", "You are terse."), ("user", "What is 2+2?")],
    [("user", "héllo 😀 世界, naïve café"), ("assistant", "Bonjour!"), ("user", "  spaces\tand\nlines  ")],
    [("user", "<|im_start|> looks special"), ("assistant", ""), ("user", "ok")],
]


def chat(turns: list[tuple[str, str]]) -> common_pb2.Conversation:
    return common_pb2.Conversation(messages=[common_pb2.ChatMessage(role=r, content=c) for r, c in turns])


async def expect_invalid(call: object, *needles: str) -> str:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await call  # type: ignore[misc]
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    details = info.value.details() or ""
    for needle in needles:
        assert needle in details, details
    return details


async def test_info(served: Served, model_dir: Path) -> None:
    info = await served.stub.Info(tokenizer_pb2.InfoRequest())
    hf = AutoTokenizer.from_pretrained(model_dir)
    assert info.model == model_dir.name
    assert info.vocab_size == len(hf)
    assert info.context_length == 2048
    assert info.has_chat_template
    named = {t.name: (t.text, t.id) for t in info.special_tokens}
    assert named["bos"] == (hf.bos_token, hf.bos_token_id)
    assert named["eos"] == (hf.eos_token, hf.eos_token_id)
    assert named["pad"] == (hf.pad_token, hf.pad_token_id)
    assert "<|im_start|>" in named
    assert list(info.eos_token_ids) == [4, 2]


@pytest.mark.parametrize("text", ["Hello world", " leading space", "naïve 😀 世界\n\ttabs", "<|im_end|>x"])
async def test_text_matches_tokenizers(served: Served, model_dir: Path, text: str) -> None:
    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    reply = await served.stub.Tokenize(tokenizer_pb2.TokenizeRequest(request_id="r", text=text))
    assert reply.request_id == "r"
    assert list(reply.ids) == tok.encode(text, add_special_tokens=True).ids
    assert not reply.truncated
    plain = await served.stub.Tokenize(tokenizer_pb2.TokenizeRequest(text=text, add_special_tokens=False))
    assert list(plain.ids) == tok.encode(text, add_special_tokens=False).ids
    assert list(reply.ids) == [1, *plain.ids]


@pytest.mark.parametrize("turns", CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
async def test_chat_matches_apply_chat_template(
    served: Served, model_dir: Path, turns: list[tuple[str, str]], add_generation_prompt: bool
) -> None:
    hf = AutoTokenizer.from_pretrained(model_dir)
    messages = [{"role": r, "content": c} for r, c in turns]
    expected = hf.apply_chat_template(
        messages, add_generation_prompt=add_generation_prompt, tokenize=True, return_dict=False
    )
    reply = await served.stub.Tokenize(
        tokenizer_pb2.TokenizeRequest(chat=chat(turns), add_generation_prompt=add_generation_prompt)
    )
    assert list(reply.ids) == list(expected)


async def test_chat_generation_prompt_defaults_on(served: Served) -> None:
    on = await served.stub.Tokenize(tokenizer_pb2.TokenizeRequest(chat=chat([("user", "hi")])))
    off = await served.stub.Tokenize(
        tokenizer_pb2.TokenizeRequest(chat=chat([("user", "hi")]), add_generation_prompt=False)
    )
    assert len(on.ids) > len(off.ids)
    assert list(on.ids[: len(off.ids)]) == list(off.ids)


async def test_validation(served: Served) -> None:
    stub = served.stub
    await expect_invalid(stub.Tokenize(tokenizer_pb2.TokenizeRequest(text="")), "empty")
    await expect_invalid(stub.Tokenize(tokenizer_pb2.TokenizeRequest()), "empty")
    await expect_invalid(
        stub.Tokenize(tokenizer_pb2.TokenizeRequest(chat=common_pb2.Conversation())), "no messages"
    )
    long_text = "word " * 3000
    n = len(
        (
            await stub.Tokenize(
                tokenizer_pb2.TokenizeRequest(text=long_text, max_tokens=2048, truncation_side=1)
            )
        ).ids
    )
    assert n == 2048
    details = await expect_invalid(stub.Tokenize(tokenizer_pb2.TokenizeRequest(text=long_text)), "2048")
    assert "context length" in details
    await expect_invalid(
        stub.Tokenize(tokenizer_pb2.TokenizeRequest(text="a b c d e", max_tokens=3)), "more than 3"
    )
    await expect_invalid(
        stub.Tokenize(tokenizer_pb2.TokenizeRequest(text="hi", max_tokens=4096)), "4096", "2048"
    )
    # The service is still fine after bad requests.
    assert (await stub.Tokenize(tokenizer_pb2.TokenizeRequest(text="ok"))).ids


async def test_truncation_sides(served: Served) -> None:
    text = "one two three four five six seven eight nine ten"
    full = list((await served.stub.Tokenize(tokenizer_pb2.TokenizeRequest(text=text))).ids)
    left = await served.stub.Tokenize(
        tokenizer_pb2.TokenizeRequest(
            text=text, max_tokens=4, truncation_side=tokenizer_pb2.TRUNCATION_SIDE_LEFT
        )
    )
    right = await served.stub.Tokenize(
        tokenizer_pb2.TokenizeRequest(
            text=text, max_tokens=4, truncation_side=tokenizer_pb2.TRUNCATION_SIDE_RIGHT
        )
    )
    assert left.truncated and right.truncated
    assert list(left.ids) == full[-4:]
    assert list(right.ids) == full[:4]
    fits = await served.stub.Tokenize(
        tokenizer_pb2.TokenizeRequest(
            text=text, max_tokens=len(full), truncation_side=tokenizer_pb2.TRUNCATION_SIDE_LEFT
        )
    )
    assert list(fits.ids) == full and not fits.truncated


async def test_no_chat_template(model_dir: Path, tmp_path: Path) -> None:
    plain = variant_dir(model_dir, tmp_path / "plain", chat_template=None)
    async for s in serve(plain):
        info = await s.stub.Info(tokenizer_pb2.InfoRequest())
        assert not info.has_chat_template
        await expect_invalid(
            s.stub.Tokenize(tokenizer_pb2.TokenizeRequest(chat=chat([("user", "hi")]))), "no chat template"
        )
        assert (await s.stub.Tokenize(tokenizer_pb2.TokenizeRequest(text="hi"))).ids


async def test_template_errors_are_invalid_argument(model_dir: Path, tmp_path: Path) -> None:
    strict = variant_dir(
        model_dir,
        tmp_path / "strict",
        chat_template=(
            "{% for m in messages %}{% if m['role'] == 'system' %}{{ raise_exception('no system turns') }}"
            "{% endif %}{{ m['content'] }}{% endfor %}"
        ),
    )
    async for s in serve(strict):
        await expect_invalid(
            s.stub.Tokenize(tokenizer_pb2.TokenizeRequest(chat=chat([("system", "x"), ("user", "y")]))),
            "no system turns",
        )


async def test_stream_answers_every_request(served: Served, model_dir: Path) -> None:
    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    texts = {f"r{i}": f"text number {i} " * (i % 7 + 1) for i in range(50)}

    async def requests():  # type: ignore[no-untyped-def]
        for rid, text in texts.items():
            yield tokenizer_pb2.TokenizeRequest(request_id=rid, text=text)
        yield tokenizer_pb2.TokenizeRequest(request_id="bad", text="")
        yield tokenizer_pb2.TokenizeRequest(request_id="chat", chat=chat([("user", "hi")]))

    replies = {r.request_id: r async for r in served.stub.TokenizeStream(requests())}
    assert set(replies) == {*texts, "bad", "chat"}
    for rid, text in texts.items():
        assert not replies[rid].error
        assert list(replies[rid].ids) == tok.encode(text).ids
    assert "empty" in replies["bad"].error and not replies["bad"].ids
    assert replies["chat"].ids and not replies["chat"].error


async def test_concurrent_calls(served: Served, model_dir: Path) -> None:
    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    texts = [f"concurrent request {i}: " + "lorem ipsum " * (i % 5) for i in range(64)]
    replies = await asyncio.gather(
        *(
            served.stub.Tokenize(tokenizer_pb2.TokenizeRequest(request_id=str(i), text=t))
            for i, t in enumerate(texts)
        )
    )
    assert [r.request_id for r in replies] == [str(i) for i in range(64)]
    assert [list(r.ids) for r in replies] == [e.ids for e in tok.encode_batch(texts)]
