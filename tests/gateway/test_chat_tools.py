"""Tools and reasoning on chat completions, through the gateway with fake stages: the tools reach the
tokenizer, the generated text comes back as tool calls (whole or streamed) and reasoning, and a
required call becomes the engine's grammar. The fake engine writes `SCRIPT`'s characters, one a step,
and the stop string `END` ends the output with finish reason "stop"."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from tokenizers import Tokenizer

from gateway.server import GatewayHandle, create_server
from gateway.tool_parsers import PARSERS
from services.tokenizer.server import create_server as create_tokenizer
from services.tokenizer.settings import TokenizerSettings
from tests.gateway.conftest import WAIT_S, gateway_settings
from tests.gateway.fakes import MODEL, FakeUpstreams

END = "#END"
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
TOOLS: list[Any] = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    },
    {"type": "function", "function": {"name": "get_time"}},
]
MESSAGES: list[Any] = [{"role": "user", "content": "weather in Paris?"}]

Make = Callable[..., Awaitable[GatewayHandle]]


def script(upstreams: FakeUpstreams, text: str) -> None:
    """The fake engine writes `text` then `END`."""
    upstreams.engine.output_ids = [ord(c) for c in text + END]


@pytest.fixture
async def client_for() -> AsyncIterator[Callable[[GatewayHandle], openai.AsyncOpenAI]]:
    clients: list[openai.AsyncOpenAI] = []

    def make(server: GatewayHandle) -> openai.AsyncOpenAI:
        client = openai.AsyncOpenAI(
            base_url=f"http://127.0.0.1:{server.port}/v1", api_key="unused", max_retries=0, timeout=WAIT_S
        )
        clients.append(client)
        return client

    yield make
    for client in clients:
        await client.close()


async def chat(client: openai.AsyncOpenAI, **extra: Any) -> Any:
    return await client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=500, stop=[END], **extra
    )


async def test_a_tool_call_comes_back_as_message_tool_calls(
    gateway: GatewayHandle,
    upstreams: FakeUpstreams,
    client_for: Callable[[GatewayHandle], openai.AsyncOpenAI],
) -> None:
    script(upstreams, "Let me look.\n" + CALL)
    reply = await chat(client_for(gateway), tools=TOOLS)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Let me look."
    [call] = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}
    request = upstreams.tokenizer.requests[-1]
    assert json.loads(request.tools_json) == TOOLS
    assert not upstreams.engine.submits[-1].sampling.HasField("structured")  # auto: unconstrained


async def test_content_is_null_when_the_output_is_only_calls(
    gateway: GatewayHandle,
    upstreams: FakeUpstreams,
    client_for: Callable[[GatewayHandle], openai.AsyncOpenAI],
) -> None:
    script(upstreams, CALL + "\n" + CALL.replace("get_weather", "get_time"))
    reply = await chat(client_for(gateway), tools=TOOLS)
    message = reply.choices[0].message
    assert message.content is None
    assert [c.function.name for c in message.tool_calls] == ["get_weather", "get_time"]


async def test_plain_text_with_tools_is_content_and_stop(
    gateway: GatewayHandle,
    upstreams: FakeUpstreams,
    client_for: Callable[[GatewayHandle], openai.AsyncOpenAI],
) -> None:
    script(upstreams, "It is sunny.")
    reply = await chat(client_for(gateway), tools=TOOLS)
    assert reply.choices[0].finish_reason == "stop"
    assert reply.choices[0].message.content == "It is sunny."
    assert reply.choices[0].message.tool_calls is None


async def test_streamed_tool_call_deltas_assemble_into_the_call(
    gateway: GatewayHandle,
    upstreams: FakeUpstreams,
    client_for: Callable[[GatewayHandle], openai.AsyncOpenAI],
) -> None:
    script(upstreams, "ok " + CALL)
    stream = await chat(client_for(gateway), tools=TOOLS, tool_choice="auto", stream=True)
    content, calls, reasons, argument_deltas = "", {}, [], 0
    async for chunk in stream:
        choice = chunk.choices[0]
        content += choice.delta.content or ""
        for delta in choice.delta.tool_calls or []:
            if delta.id is not None:
                calls[delta.index] = {"id": delta.id, "name": delta.function.name, "arguments": ""}
            calls[delta.index]["arguments"] += delta.function.arguments or ""
            argument_deltas += 1
        reasons.append(choice.finish_reason)
    assert content == "ok"
    assert list(calls) == [0] and calls[0]["name"] == "get_weather"
    assert json.loads(calls[0]["arguments"]) == {"city": "Paris"}
    assert argument_deltas > 2  # one character a step: the arguments come in pieces
    assert reasons[-1] == "tool_calls" and set(reasons[:-1]) == {None}


@pytest.mark.parametrize(
    ("tool_choice", "names"),
    [
        ("required", ["get_weather", "get_time"]),
        ({"type": "function", "function": {"name": "get_time"}}, ["get_time"]),
    ],
)
async def test_a_required_call_is_the_engines_grammar(
    gateway: GatewayHandle,
    upstreams: FakeUpstreams,
    client_for: Callable[[GatewayHandle], openai.AsyncOpenAI],
    tool_choice: Any,
    names: list[str],
) -> None:
    script(upstreams, CALL)
    await chat(client_for(gateway), tools=TOOLS, tool_choice=tool_choice)
    structured = upstreams.engine.submits[-1].sampling.structured
    assert structured.kind == "grammar"
    assert [n for n in ("get_weather", "get_time") if f'\\"name\\": \\"{n}\\"' in structured.text] == names


@pytest.mark.parametrize("parser", sorted(PARSERS))
async def test_a_required_call_is_written_in_the_format_the_parser_reads(
    make_gateway: Make,
    upstreams: FakeUpstreams,
    client_for: Callable[[GatewayHandle], openai.AsyncOpenAI],
    parser: str,
) -> None:
    """With `--tool-call-parser llama3_json` (or any other), `tool_choice: required` constrains the
    engine to that format's calls, not hermes' `<tool_call>` blocks, which the llama3_json parser would
    read as content: the call the grammar makes the model write comes back as a tool call."""
    fmt = PARSERS[parser]
    server = await make_gateway(tool_call_parser=parser)
    arguments = '{"city": "Paris"}'
    written = fmt.CALLS_OPEN + fmt.CALL_OPEN.format(name="get_weather") + arguments + fmt.CALL_CLOSE
    script(upstreams, written + fmt.CALLS_CLOSE)
    reply = await chat(client_for(server), tools=TOOLS, tool_choice="required")
    grammar = upstreams.engine.submits[-1].sampling.structured.text
    assert json.dumps(fmt.CALL_OPEN.format(name="get_weather")) in grammar
    assert ("<tool_call>" in grammar) == (parser == "hermes")
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and not choice.message.content
    [call] = choice.message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == ("get_weather", {"city": "Paris"})


async def test_tool_choice_none_renders_the_tools_and_reads_no_calls(
    gateway: GatewayHandle,
    upstreams: FakeUpstreams,
    client_for: Callable[[GatewayHandle], openai.AsyncOpenAI],
) -> None:
    script(upstreams, CALL)
    reply = await chat(client_for(gateway), tools=TOOLS, tool_choice="none")
    assert reply.choices[0].message.content == CALL
    assert reply.choices[0].finish_reason == "stop"
    assert json.loads(upstreams.tokenizer.requests[-1].tools_json) == TOOLS


async def test_a_required_call_and_a_response_format_are_refused_naming_both(
    gateway: GatewayHandle,
    upstreams: FakeUpstreams,
    client_for: Callable[[GatewayHandle], openai.AsyncOpenAI],
) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        await chat(
            client_for(gateway), tools=TOOLS, tool_choice="required", response_format={"type": "json_object"}
        )
    error = caught.value.body
    assert isinstance(error, dict)
    assert "tool_choice" in error["message"] and "response_format" in error["message"]
    assert upstreams.engine.submits == []


async def test_auto_tools_and_a_response_format_go_together(
    gateway: GatewayHandle,
    upstreams: FakeUpstreams,
    client_for: Callable[[GatewayHandle], openai.AsyncOpenAI],
) -> None:
    script(upstreams, "{}")
    await chat(client_for(gateway), tools=TOOLS, response_format={"type": "json_object"})
    assert upstreams.engine.submits[-1].sampling.structured.kind == "json_object"


async def test_history_with_calls_and_tool_results_reaches_the_tokenizer(
    gateway: GatewayHandle,
    upstreams: FakeUpstreams,
    client_for: Callable[[GatewayHandle], openai.AsyncOpenAI],
) -> None:
    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
    }
    history = [
        *MESSAGES,
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]
    script(upstreams, "Sunny.")
    reply = await client_for(gateway).chat.completions.create(
        model=MODEL, messages=history, tools=TOOLS, max_tokens=50, stop=[END]
    )
    assert reply.choices[0].message.content == "Sunny."
    user, assistant, tool = upstreams.tokenizer.requests[-1].chat.messages
    assert user.content == MESSAGES[0]["content"]
    assert not assistant.HasField("content") and json.loads(assistant.tool_calls_json) == [call]
    assert tool.role == "tool" and tool.tool_call_id == "call_1" and tool.content == "sunny"


@pytest.mark.parametrize(
    ("message", "param"),
    [
        ({"role": "tool", "content": "x"}, "messages[1].tool_call_id"),
        ({"role": "user", "content": None}, "messages[1]"),
        ({"role": "user", "content": "x", "tool_calls": []}, "messages[1].tool_calls"),
        ({"role": "assistant", "content": None, "tool_calls": [{"id": "c"}]}, "messages[1].tool_calls[0]"),
        ({"role": "user", "content": "x", "audio": {"id": "a"}}, "messages[1].audio"),
        ({"role": "user", "content": "x", "name": 3}, "messages[1].name"),
    ],
)
async def test_malformed_history_is_refused_naming_the_field(
    gateway: GatewayHandle,
    upstreams: FakeUpstreams,
    client_for: Callable[[GatewayHandle], openai.AsyncOpenAI],
    message: dict[str, Any],
    param: str,
) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        await client_for(gateway).post(
            "/chat/completions", cast_to=object, body={"messages": [*MESSAGES, message], "tools": TOOLS}
        )
    error = caught.value.body
    assert isinstance(error, dict) and error["param"] == param
    assert upstreams.engine.submits == []


async def test_the_llama3_json_parser_reads_its_format(
    make_gateway: Make, upstreams: FakeUpstreams, client_for: Callable[[GatewayHandle], openai.AsyncOpenAI]
) -> None:
    server = await make_gateway(tool_call_parser="llama3_json")
    script(upstreams, '<|python_tag|>{"name": "get_time", "parameters": {}}')
    reply = await chat(client_for(server), tools=TOOLS)
    [call] = reply.choices[0].message.tool_calls
    assert (call.function.name, call.function.arguments) == ("get_time", "{}")
    assert reply.choices[0].finish_reason == "tool_calls"


async def test_reasoning_goes_to_reasoning_content_and_the_rest_to_content_and_calls(
    make_gateway: Make, upstreams: FakeUpstreams, client_for: Callable[[GatewayHandle], openai.AsyncOpenAI]
) -> None:
    server = await make_gateway(reasoning_parser="think")
    script(upstreams, "<think>\nneeds a tool\n</think>\n\nChecking.\n" + CALL)
    reply = await chat(client_for(server), tools=TOOLS)
    message: Any = reply.choices[0].message
    assert message.reasoning_content == "needs a tool"
    assert message.content == "Checking."
    assert [c.function.name for c in message.tool_calls] == ["get_weather"]
    stream = await chat(client_for(server), stream=True)
    reasoning, content = "", ""
    async for chunk in stream:
        delta: Any = chunk.choices[0].delta
        reasoning += getattr(delta, "reasoning_content", None) or ""
        content += delta.content or ""
    assert (reasoning, content) == ("needs a tool", "Checking.\n" + CALL)  # no tools: no call parsing


async def test_without_the_reasoning_parser_think_tags_are_content(
    gateway: GatewayHandle,
    upstreams: FakeUpstreams,
    client_for: Callable[[GatewayHandle], openai.AsyncOpenAI],
) -> None:
    script(upstreams, "<think>x</think>y")
    reply = await chat(client_for(gateway))
    message: Any = reply.choices[0].message
    assert message.content == "<think>x</think>y" and getattr(message, "reasoning_content", None) is None


async def test_tools_on_completions_are_refused(
    gateway: GatewayHandle, client_for: Callable[[GatewayHandle], openai.AsyncOpenAI]
) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        await client_for(gateway).post("/completions", cast_to=object, body={"prompt": "x", "tools": TOOLS})
    error = caught.value.body
    assert isinstance(error, dict) and error["param"] == "tools"


async def test_a_call_cut_by_max_tokens_in_the_history_is_rendered_as_it_was_written(
    upstreams: FakeUpstreams, tiny_model_dir: Path
) -> None:
    """An agent sends back the assistant turn the server wrote, whose call was cut by max_tokens: its
    arguments are not valid JSON. The conversation is accepted (as OpenAI accepts it), and the real
    tokenizer renders the arguments as they are, in the model's own call format."""
    tokenizer = await create_tokenizer(TokenizerSettings(model=str(tiny_model_dir), port=0))
    await tokenizer.start()
    settings = gateway_settings(upstreams, tokenizer=(f"127.0.0.1:{tokenizer.port}",))
    server = await create_server(settings)
    await server.start()
    cut = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Pa'},
    }
    history = [*MESSAGES, {"role": "assistant", "content": None, "tool_calls": [cut]}]
    history.append({"role": "tool", "tool_call_id": "call_1", "content": "error: the call was cut"})
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{server.port}", timeout=WAIT_S) as http:
            body = {"messages": history, "tools": TOOLS, "max_tokens": 3}
            reply = await http.post("/v1/chat/completions", json=body)
    finally:
        await server.stop(0.5)
        await tokenizer.stop(0)
    assert reply.status_code == 200, reply.text
    rendered = Tokenizer.from_file(str(tiny_model_dir / "tokenizer.json")).decode(
        list(upstreams.engine.submits[-1].prompt_ids), skip_special_tokens=False
    )
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa}\n</tool_call>' in rendered
