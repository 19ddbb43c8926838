"""Each family's tool calls through the real tokenizer and detokenizer (the family's tokenizer
directory, tests/tokenizer/families.py) and the gateway, with an engine that writes the ids of what a
model of the family writes for a call: the parser is chosen from the template, the marks that are
special tokens (Mistral's `[TOOL_CALLS]` and `[ARGS]`, Llama's `<|python_tag|>`) reach it, and eos does
not reach the text. Whole replies and streamed ones."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import openai
import pytest

from gateway.server import create_server
from services.detokenizer.server import create_server as create_detokenizer
from services.detokenizer.settings import DetokenizerSettings
from services.tokenizer.core import TokenizerCore
from services.tokenizer.server import create_server as create_tokenizer
from services.tokenizer.settings import TokenizerSettings
from tests.gateway.conftest import WAIT_S, gateway_settings
from tests.gateway.fakes import FakeUpstreams
from tests.tokenizer.families import family_tokenizer_dir

ARGS = {"city": "Paris"}
CALL = json.dumps({"name": "get_weather", "arguments": ARGS})
# family, what its model writes for one call, the content before the call.
WRITTEN = [
    ("qwen3", f"Let me check.\n<tool_call>\n{CALL}\n</tool_call>", "Let me check."),
    ("llama3", "<|python_tag|>" + CALL.replace('"arguments"', '"parameters"'), ""),
    ("mistral", f"[TOOL_CALLS][{CALL}]", ""),
    ("mistral", f"Sure.[TOOL_CALLS]get_weather[ARGS]{json.dumps(ARGS)}", "Sure."),
]
TOOLS: list[Any] = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]


@pytest.fixture
async def stack(
    request: pytest.FixtureRequest, upstreams: FakeUpstreams, tmp_path: Path
) -> AsyncIterator[tuple[openai.AsyncOpenAI, FakeUpstreams, TokenizerCore]]:
    """The gateway with the family's real tokenizer and detokenizer, and the fake engine."""
    family_dir = family_tokenizer_dir(request.param, tmp_path / "model")
    tokenizer = await create_tokenizer(TokenizerSettings(model=str(family_dir), port=0))
    detokenizer = await create_detokenizer(DetokenizerSettings(model=str(family_dir), port=0))
    await tokenizer.start()
    await detokenizer.start()
    settings = gateway_settings(
        upstreams, tokenizer=(f"127.0.0.1:{tokenizer.port}",), detokenizer=(f"127.0.0.1:{detokenizer.port}",)
    )
    gateway = await create_server(settings)
    await gateway.start()
    client = openai.AsyncOpenAI(
        base_url=f"http://127.0.0.1:{gateway.port}/v1", api_key="unused", max_retries=0, timeout=WAIT_S
    )
    try:
        yield client, upstreams, TokenizerCore(family_dir)
    finally:
        await client.close()
        await gateway.stop(0.1)
        await detokenizer.stop(None)
        await tokenizer.stop(None)


@pytest.mark.parametrize(
    ("stack", "written", "content"),
    WRITTEN,
    indirect=["stack"],
    ids=["qwen3", "llama3", "mistral", "mistral-args"],
)
@pytest.mark.parametrize("stream", [False, True])
async def test_a_familys_call_is_read_through_the_real_stages(
    stack: tuple[openai.AsyncOpenAI, FakeUpstreams, TokenizerCore], written: str, content: str, stream: bool
) -> None:
    client, upstreams, core = stack
    ids = [*core.encode(written, add_special_tokens=False), core.eos_token_ids[0]]
    upstreams.engine.output_ids = ids
    model = (await client.models.list()).data[0].id
    messages: Any = [{"role": "user", "content": "Weather in Paris?"}]
    kwargs: dict[str, Any] = {"model": model, "messages": messages, "tools": TOOLS, "max_tokens": len(ids)}
    if not stream:
        message = (await client.chat.completions.create(**kwargs)).choices[0].message
        [call] = message.tool_calls or []
        assert (call.function.name, json.loads(call.function.arguments)) == ("get_weather", ARGS)
        assert (message.content or "").strip() == content  # SentencePiece text may open with a space
        return
    names, arguments, text = [], "", ""
    async for chunk in await client.chat.completions.create(**kwargs, stream=True):
        delta: Any = chunk.choices[0].delta
        text += delta.content or ""
        for call in delta.tool_calls or []:
            names += [call.function.name] if call.function.name else []
            arguments += call.function.arguments or ""
    assert names == ["get_weather"] and json.loads(arguments) == ARGS
    assert text.strip() == content
