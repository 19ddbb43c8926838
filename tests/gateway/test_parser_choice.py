"""The chat parsers chosen from the model's chat template (the tokenizer's Info), through the gateway
with fake stages: each family's tool-call format read back as calls, whole and streamed; a required
call's grammar in that format; `--tool-call-parser` and `--reasoning-parser` overriding; a reply read
as reasoning from its start when the generation prompt opened a think block."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import openai
import pytest

from gateway.chat_output import ChatParsers, chosen
from gateway.choices import TOOL_CALL_PARSERS
from gateway.tool_parsers import PARSERS, infer_parser
from tests.gateway.fakes import FakeUpstreams
from tests.gateway.test_chat_tools import TOOLS, Make, chat, script
from tests.gateway.test_chat_tools import client_for as openai_clients
from tests.tokenizer.families import (
    GEMMA_TEMPLATE,
    LLAMA3_TEMPLATE,
    MISTRAL_TEMPLATE,
    QWEN3_TEMPLATE,
    QWEN3_THINKING_TEMPLATE,
)

ARGS = {"city": "Paris"}
CALL = f'{{"name": "get_weather", "arguments": {json.dumps(ARGS)}}}'
# Each family's template, the parser it implies and what its model writes for one call of get_weather.
FORMATS = {
    "qwen3": (QWEN3_TEMPLATE, "hermes", f"<tool_call>\n{CALL}\n</tool_call>"),
    "llama3": (LLAMA3_TEMPLATE, "llama3_json", CALL.replace('"arguments"', '"parameters"')),
    "mistral": (MISTRAL_TEMPLATE, "mistral", f"[TOOL_CALLS][{CALL}]"),
}

Client = Callable[..., openai.AsyncOpenAI]
THINKING_PROMPT = "<|im_start|>assistant\n<think>\n"
client_for = openai_clients  # the fixture, under its name here


def test_each_family_template_names_its_parser() -> None:
    assert {family: infer_parser(template) for family, (template, _, _) in FORMATS.items()} == {
        family: parser for family, (_, parser, _) in FORMATS.items()
    }
    assert infer_parser(GEMMA_TEMPLATE) is None


@pytest.mark.parametrize(
    ("settings", "template", "prompt", "want"),
    [
        (("auto", "auto"), MISTRAL_TEMPLATE, "", ChatParsers("mistral", False, False)),
        (("auto", "auto"), GEMMA_TEMPLATE, "<start_of_turn>model\n", ChatParsers("hermes", False, False)),
        (("auto", "auto"), QWEN3_TEMPLATE, "<|im_start|>assistant\n", ChatParsers("hermes", True, False)),
        (("auto", "auto"), QWEN3_THINKING_TEMPLATE, THINKING_PROMPT, ChatParsers("hermes", True, True)),
        (("llama3_json", "none"), QWEN3_THINKING_TEMPLATE, THINKING_PROMPT, ChatParsers("llama3_json")),
        (("auto", "think"), LLAMA3_TEMPLATE, "", ChatParsers("llama3_json", True, False)),
        (("auto", "auto"), "", "", ChatParsers("hermes", False, False)),
    ],
)  # fmt: skip
def test_chosen(settings: tuple[str, str], template: str, prompt: str, want: ChatParsers) -> None:
    assert chosen(*settings, template, prompt) == want


@pytest.mark.parametrize("family", sorted(FORMATS))
@pytest.mark.parametrize("stream", [False, True])
async def test_the_template_chooses_the_tool_call_parser(
    make_gateway: Make, upstreams: FakeUpstreams, client_for: Client, family: str, stream: bool
) -> None:
    template, _, written = FORMATS[family]
    upstreams.tokenizer.chat_template = template
    server = await make_gateway()
    script(upstreams, "Checking. " + written if family != "llama3" else written)
    if not stream:
        reply = await chat(client_for(server), tools=TOOLS)
        [call] = reply.choices[0].message.tool_calls
        assert (call.function.name, json.loads(call.function.arguments)) == ("get_weather", ARGS)
        assert reply.choices[0].finish_reason == "tool_calls"
        assert (reply.choices[0].message.content or "") == ("" if family == "llama3" else "Checking.")
        return
    chunks = await chat(client_for(server), tools=TOOLS, stream=True)
    names, arguments, content, finish = [], "", "", None
    async for chunk in chunks:
        delta: Any = chunk.choices[0].delta
        content += delta.content or ""
        for call in delta.tool_calls or []:
            if call.function.name:
                names.append(call.function.name)
            arguments += call.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert names == ["get_weather"] and json.loads(arguments) == ARGS
    assert content == ("" if family == "llama3" else "Checking.")
    assert finish == "tool_calls"


async def test_the_setting_overrides_the_template(
    make_gateway: Make, upstreams: FakeUpstreams, client_for: Client
) -> None:
    upstreams.tokenizer.chat_template = MISTRAL_TEMPLATE
    server = await make_gateway(tool_call_parser="hermes")
    written = FORMATS["mistral"][2]
    script(upstreams, written)
    reply = await chat(client_for(server), tools=TOOLS)
    assert reply.choices[0].message.tool_calls is None
    assert reply.choices[0].message.content == written


async def test_a_required_call_follows_the_chosen_format(
    make_gateway: Make, upstreams: FakeUpstreams, client_for: Client
) -> None:
    upstreams.tokenizer.chat_template = MISTRAL_TEMPLATE
    server = await make_gateway()
    script(upstreams, FORMATS["mistral"][2])
    await chat(client_for(server), tools=TOOLS, tool_choice="required")
    structured = upstreams.engine.submits[-1].sampling.structured
    assert structured.kind == "grammar"
    assert '"[TOOL_CALLS]["' in structured.text and "<tool_call>" not in structured.text


@pytest.mark.parametrize("stream", [False, True])
async def test_a_prompt_that_opens_think_is_read_as_reasoning_from_the_start(
    make_gateway: Make, upstreams: FakeUpstreams, client_for: Client, stream: bool
) -> None:
    upstreams.tokenizer.chat_template = QWEN3_THINKING_TEMPLATE
    upstreams.tokenizer.generation_prompt = THINKING_PROMPT
    server = await make_gateway()
    script(upstreams, "plan it\n</think>\n\nThe answer.")
    reasoning, content = await _reasoning_and_content(client_for(server), stream)
    assert (reasoning, content) == ("plan it", "The answer.")


async def test_think_blocks_are_split_only_for_templates_that_write_them(
    make_gateway: Make, upstreams: FakeUpstreams, client_for: Client
) -> None:
    upstreams.tokenizer.chat_template = QWEN3_TEMPLATE
    script(upstreams, "<think>plan</think>Answer.")
    assert await _reasoning_and_content(client_for(await make_gateway()), False) == ("plan", "Answer.")
    upstreams.tokenizer.chat_template = GEMMA_TEMPLATE
    gemma = await make_gateway()
    assert await _reasoning_and_content(client_for(gemma), False) == ("", "<think>plan</think>Answer.")


async def _reasoning_and_content(client: openai.AsyncOpenAI, stream: bool) -> tuple[str, str]:
    if not stream:
        message: Any = (await chat(client)).choices[0].message
        return getattr(message, "reasoning_content", None) or "", message.content or ""
    reasoning, content = "", ""
    async for chunk in await chat(client, stream=True):
        delta: Any = chunk.choices[0].delta
        reasoning += getattr(delta, "reasoning_content", None) or ""
        content += delta.content or ""
    return reasoning, content


def test_the_parsers_marks_are_the_special_ids_kept() -> None:
    special = {"[TOOL_CALLS]": 5, "[ARGS]": 6, "</s>": 2, "<think>": 9, "</think>": 10, "<|python_tag|>": 7}
    mistral = chosen("auto", "auto", MISTRAL_TEMPLATE, "", special)
    assert mistral.keep_special_ids(reads_calls=True) == (5, 6)
    assert mistral.keep_special_ids(reads_calls=False) == ()
    thinking = chosen("llama3_json", "think", "", "", special)
    assert thinking.keep_special_ids(reads_calls=True) == (7, 9, 10)
    assert chosen("auto", "auto", MISTRAL_TEMPLATE, "", {}).keep_special_ids(reads_calls=True) == ()


async def test_the_detokenizer_is_asked_to_keep_the_marks(
    make_gateway: Make, upstreams: FakeUpstreams, client_for: Client
) -> None:
    upstreams.tokenizer.chat_template = MISTRAL_TEMPLATE
    upstreams.tokenizer.special_tokens = {"[TOOL_CALLS]": 5, "[ARGS]": 6, "</s>": 2}
    server = await make_gateway()
    script(upstreams, FORMATS["mistral"][2])
    await chat(client_for(server), tools=TOOLS)
    assert list(upstreams.detokenizer.starts[-1].keep_special_ids) == [5, 6]
    await chat(client_for(server))  # no tools: nothing to keep
    assert list(upstreams.detokenizer.starts[-1].keep_special_ids) == []


def test_the_settings_accept_the_formats_by_their_names() -> None:
    """`--tool-call-parser` takes auto or the name of one format's class, and each class is named once."""
    assert ("auto", *PARSERS) == TOOL_CALL_PARSERS
    assert all(name == cls.NAME for name, cls in PARSERS.items())
