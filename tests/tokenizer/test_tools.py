"""Tools and tool-calling history through the chat template: the tiny model's template (plain chats
unchanged, tools in the Hermes style), the core's conversion of OpenAI's wire form to transformers'
convention, parity with `apply_chat_template(..., tools=...)`, and the service's proto fields."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import grpc
import pytest
from transformers import AutoTokenizer

from services.common.pb import common_pb2, tokenizer_pb2
from services.tokenizer.core import (
    InvalidInput,
    TokenizeJob,
    TokenizerCore,
    chat_message,
    compile_chat_template,
)
from sluice.model.tokenizer import BOS, CHAT_TEMPLATE, render_chat
from tests.tokenizer.conftest import Served, variant_dir

# The tiny model's template before tools were added, kept to prove plain chats render as before.
TEMPLATE_WITHOUT_TOOLS = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

PLAIN_CHATS = [
    [("user", "Hello!")],
    [
        ("system", "Be brief."),
        ("user", "  Why is the sky blue?  "),
        ("assistant", "Rayleigh scattering."),
        ("user", "世界 😀\n\n"),
    ],
    [("system", ""), ("user", "{{ not a template }} <tool_call>"), ("assistant", "")],
    [("developer", "x"), ("user", "y")],
]

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
CLOCK = {"type": "function", "function": {"name": "now", "parameters": {"type": "object", "properties": {}}}}

# What an OpenAI client sends: arguments as JSON text, content null beside tool calls.
OPENAI_CALLS = [
    {
        "id": "call_a",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
    },
    {"id": "call_b", "type": "function", "function": {"name": "now", "arguments": ""}},
]
HISTORY_WIRE: list[dict[str, Any]] = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Paris, and the time?"},
    {"role": "assistant", "content": None, "tool_calls_json": json.dumps(OPENAI_CALLS)},
    {"role": "tool", "content": "sunny, 21 C", "tool_call_id": "call_a"},
    {"role": "tool", "content": "10:30", "tool_call_id": "call_b"},
]

TOOLS_SYSTEM = (
    "<|im_start|>system\nBe brief.\n\n# Tools\n\nYou may call one or more functions to assist with the user "
    "query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
    + json.dumps(WEATHER, ensure_ascii=False)
    + "\n"
    + json.dumps(CLOCK, ensure_ascii=False)
    + "\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    '<tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": '
    "<args-json-object>}\n</tool_call><|im_end|>\n"
)
HISTORY_RENDERED = (
    "<|im_start|>user\nWeather in Paris, and the time?<|im_end|>\n"
    "<|im_start|>assistant\n"
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call><|im_end|>\n'
    "<|im_start|>tool\n<tool_response>\nsunny, 21 C\n</tool_response><|im_end|>\n"
    "<|im_start|>tool\n<tool_response>\n10:30\n</tool_response><|im_end|>\n"
    "<|im_start|>assistant\n"
)

# A template that reads tools and calls as Qwen2-family templates do: `tool_call.function`, arguments
# through `tojson` (so they must be a dict), tool results folded into a user turn.
QWEN_STYLE = """{%- if tools %}<|im_start|>system
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}<|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == "assistant" and message.tool_calls %}<|im_start|>assistant
{%- if message.content %}
{{ message.content }}{% endif %}
{%- for tool_call in message.tool_calls %}
{%- if tool_call.function is defined %}{% set tool_call = tool_call.function %}{% endif %}
<tool_call>
{"name": "{{ tool_call.name }}", "arguments": {{ tool_call.arguments | tojson }}}
</tool_call>
{%- endfor %}<|im_end|>
{% elif message.role == "tool" %}<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{% else %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""


def wire_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [
        chat_message(
            m["role"],
            m.get("content"),
            tool_call_id=m.get("tool_call_id", ""),
            tool_calls_json=m.get("tool_calls_json", ""),
            where=f"messages[{i}]",
        )
        for i, m in enumerate(messages)
    ]


def proto_message(m: dict[str, Any]) -> common_pb2.ChatMessage:
    fields = {k: v for k, v in m.items() if v is not None}
    return common_pb2.ChatMessage(**fields)


@pytest.mark.parametrize("turns", PLAIN_CHATS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_plain_chats_render_as_before(turns: list[tuple[str, str]], add_generation_prompt: bool) -> None:
    messages = [{"role": r, "content": c} for r, c in turns]
    old = compile_chat_template(TEMPLATE_WITHOUT_TOOLS).render(
        messages=messages, add_generation_prompt=add_generation_prompt, tools=None, bos_token=BOS
    )
    new = compile_chat_template(CHAT_TEMPLATE).render(
        messages=messages, add_generation_prompt=add_generation_prompt, tools=None, bos_token=BOS
    )
    assert new == old
    assert new.removesuffix("<|im_start|>assistant\n") == BOS + render_chat(turns)  # what the model learned


def test_tools_and_history_render_hermes_style(model_dir: Path) -> None:
    core = TokenizerCore(model_dir)
    text = core.render_chat(wire_messages(HISTORY_WIRE), add_generation_prompt=True, tools=[WEATHER, CLOCK])
    assert text == BOS + TOOLS_SYSTEM + HISTORY_RENDERED


def test_tools_without_system_message_get_their_own(model_dir: Path) -> None:
    core = TokenizerCore(model_dir)
    text = core.render_chat([{"role": "user", "content": "hi"}], add_generation_prompt=False, tools=[CLOCK])
    assert text.startswith(BOS + "<|im_start|>system\n# Tools\n\n")
    assert text.endswith("</tool_call><|im_end|>\n<|im_start|>user\nhi<|im_end|>\n")


def test_content_before_tool_calls_is_kept(model_dir: Path) -> None:
    core = TokenizerCore(model_dir)
    call = [{"type": "function", "function": {"name": "now", "arguments": "{}"}}]
    message = chat_message("assistant", "Checking.", tool_calls_json=json.dumps(call))
    text = core.render_chat([message], add_generation_prompt=False)
    assert text == (
        BOS + '<|im_start|>assistant\nChecking.\n<tool_call>\n{"name": "now", "arguments": {}}\n'
        "</tool_call><|im_end|>\n"
    )


@pytest.mark.parametrize("template", [CHAT_TEMPLATE, QWEN_STYLE], ids=["tiny", "qwen-style"])
def test_tools_match_transformers(model_dir: Path, tmp_path: Path, template: str) -> None:
    path = variant_dir(model_dir, tmp_path / "m", chat_template=template)
    core, hf = TokenizerCore(path), AutoTokenizer.from_pretrained(path)
    messages = wire_messages(HISTORY_WIRE)
    for add_generation_prompt in (True, False):
        want = hf.apply_chat_template(
            messages, tools=[WEATHER, CLOCK], add_generation_prompt=add_generation_prompt, tokenize=False
        )
        assert (
            core.render_chat(messages, add_generation_prompt=add_generation_prompt, tools=[WEATHER, CLOCK])
            == want
        )
    assert '"arguments": {"city": "Paris"}' in want  # the arguments reached the template as a dict


def test_chat_message_follows_transformers_convention() -> None:
    assistant = chat_message("assistant", None, tool_calls_json=json.dumps(OPENAI_CALLS))
    assert assistant == {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_a",
                "type": "function",
                "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
            },
            {"id": "call_b", "type": "function", "function": {"name": "now", "arguments": {}}},
        ],
    }
    assert chat_message("user", None) == {"role": "user", "content": ""}  # null only beside tool calls
    assert chat_message("tool", "ok", tool_call_id="call_a", name="get_weather") == {
        "role": "tool",
        "content": "ok",
        "name": "get_weather",
        "tool_call_id": "call_a",
    }


@pytest.mark.parametrize(
    ("tool_calls_json", "needle"),
    [
        ("{", "messages[2].tool_calls is not JSON"),
        ('{"id": "x"}', "messages[2].tool_calls must be an array"),
        ('[{"id": "x", "function": {}}]', "messages[2].tool_calls[0] must be an object with function.name"),
    ],
)
def test_malformed_tool_calls_name_the_field(tool_calls_json: str, needle: str) -> None:
    with pytest.raises(InvalidInput, match=re.escape(needle)):
        chat_message("assistant", None, tool_calls_json=tool_calls_json, where="messages[2]")


def test_arguments_that_are_not_json_stay_the_text_they_are() -> None:
    """A call cut by max_tokens, sent back in an agent's history, is rendered as it was written."""
    message = chat_message(
        "assistant", None, tool_calls_json='[{"function": {"name": "f", "arguments": "{\\"a\\": 1"}}]'
    )
    assert message["tool_calls"][0]["function"] == {"name": "f", "arguments": '{"a": 1'}


def test_template_type_error_fails_only_its_request(model_dir: Path, tmp_path: Path) -> None:
    path = variant_dir(model_dir, tmp_path / "m", chat_template="{{ messages[0]['content'] + '!' }}")
    core = TokenizerCore(path)
    null_content = chat_message("assistant", None, tool_calls_json=json.dumps(OPENAI_CALLS))
    results = core.tokenize_many(
        [TokenizeJob(messages=[null_content]), TokenizeJob(messages=[{"role": "user", "content": "a"}])]
    )
    assert isinstance(results[0], InvalidInput)
    assert "chat template rejected" in str(results[0])
    assert not isinstance(results[1], InvalidInput)
    assert core.encode("a!", add_special_tokens=False) == results[1].ids


async def test_service_renders_tools_and_history(served: Served, model_dir: Path) -> None:
    request = tokenizer_pb2.TokenizeRequest(
        chat=common_pb2.Conversation(messages=[proto_message(m) for m in HISTORY_WIRE]),
        tools_json=json.dumps([WEATHER, CLOCK]),
    )
    reply = await served.stub.Tokenize(request)
    core = TokenizerCore(model_dir)
    assert list(reply.ids) == core.encode(BOS + TOOLS_SYSTEM + HISTORY_RENDERED, add_special_tokens=False)


async def test_service_keeps_empty_content_apart_from_null(served: Served, model_dir: Path) -> None:
    calls = json.dumps(OPENAI_CALLS[1:])
    with_empty = common_pb2.ChatMessage(role="assistant", content="", tool_calls_json=calls)
    unset = common_pb2.ChatMessage(role="assistant", tool_calls_json=calls)
    assert with_empty.HasField("content") and not unset.HasField("content")
    replies = [
        await served.stub.Tokenize(
            tokenizer_pb2.TokenizeRequest(
                chat=common_pb2.Conversation(messages=[m]), add_generation_prompt=False
            )
        )
        for m in (with_empty, unset)
    ]
    want = (
        BOS + '<|im_start|>assistant\n<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call><|im_end|>\n'
    )
    core = TokenizerCore(model_dir)
    assert [list(r.ids) for r in replies] == [core.encode(want, add_special_tokens=False)] * 2


@pytest.mark.parametrize(
    ("field", "value", "needle"),
    [
        ("tools_json", "[1]", "tools must be an array of objects"),
        ("tools_json", "{", "tools is not JSON"),
    ],
)
async def test_service_refuses_malformed_tools(served: Served, field: str, value: str, needle: str) -> None:
    request = tokenizer_pb2.TokenizeRequest(
        chat=common_pb2.Conversation(messages=[common_pb2.ChatMessage(role="user", content="hi")]),
        **{field: value},
    )
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await served.stub.Tokenize(request)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert needle in (info.value.details() or "")


async def test_service_names_the_bad_message(served: Served) -> None:
    bad = common_pb2.ChatMessage(role="assistant", tool_calls_json='[{"function": {"arguments": "{}"}}]')
    request = tokenizer_pb2.TokenizeRequest(
        chat=common_pb2.Conversation(messages=[common_pb2.ChatMessage(role="user", content="hi"), bad])
    )
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await served.stub.Tokenize(request)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "chat.messages[1].tool_calls[0] must be an object with function.name" in (
        info.value.details() or ""
    )
