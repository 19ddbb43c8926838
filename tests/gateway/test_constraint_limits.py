"""Output constraints are bounded at the gateway, the same on every API (`services.common.constraints`):
a constraint with more alternatives at one point than the engine's grammar parser can hold in a row (a
choice of 2,001 strings, a schema's anyOf of 2,001 objects, alternatives nested so that they add up),
or the grammar of a required tool call past the size limit, is refused with 400 / INVALID_ARGUMENT
naming the field before it reaches an engine; an engine's refusal never carries a compiler's backtrace;
and a large tools body is validated off the event loop, so other streams go on meanwhile."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import grpc
import httpx
import llguidance
import pytest
from tokenizers import Tokenizer
from websockets.asyncio.client import connect

from gateway import openai_protocol
from gateway.server import GatewayHandle
from gateway.structured import structured_output
from services.common.constraints import MAX_CONSTRAINT_CHARS, MAX_ROW_ITEMS, schema_row_items
from services.common.pb import common_pb2, gateway_pb2, gateway_pb2_grpc
from tests.gateway.conftest import WAIT_S, collect
from tests.gateway.fakes import MODEL, FakeUpstreams

MakeGateway = Callable[..., Awaitable[GatewayHandle]]
MESSAGES = [{"role": "user", "content": "x"}]


def objects(n: int, prefix: str = "k") -> list[dict[str, Any]]:
    """n object schemas, each with one required property of its own."""
    return [
        {"type": "object", "properties": {f"{prefix}{i}": {"type": "integer"}}, "required": [f"{prefix}{i}"]}
        for i in range(n)
    ]


def optional_properties(n: int) -> dict[str, Any]:
    return {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(n)}}


# Past the limit: (schema, a valid output) — each overflows llguidance's row of 2,000 items.
TOO_WIDE = [
    ({"anyOf": objects(2001)}, '{"k5": 1}'),
    ({"anyOf": [{"anyOf": objects(1100, "a")}, {"oneOf": objects(1100, "b")}]}, '{"a5": 1}'),
    (optional_properties(520), '{"p5": 1}'),
    ({"enum": [{"v": i} for i in range(2500)]}, '{"v": 5}'),
]
# At the limit: the widest of each kind the gateway takes — each fits the row.
WIDEST = [
    ({"anyOf": objects(MAX_ROW_ITEMS)}, '{"k5": 1}'),
    ({"anyOf": [{"anyOf": objects(500, "a")}, {"oneOf": objects(500, "b")}]}, '{"a5": 1}'),
    (optional_properties(MAX_ROW_ITEMS // 4), '{"p5": 1}'),
    ({"anyOf": [{"type": "array", "prefixItems": [{"const": i}]} for i in range(MAX_ROW_ITEMS // 3)]}, "[5]"),
    ({"enum": list(range(5000))}, "5"),  # scalars: one lexeme, no row items
]
CHOICES_TOO_MANY = [f"item{i}" for i in range(2001)]


def parses(tokenizer: llguidance.LLTokenizer, hf: Tokenizer, grammar: str, output: str) -> bool:
    """Whether llguidance's matcher takes every token of `output` under `grammar`."""
    matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
    assert not matcher.is_error(), matcher.get_error()
    for token in hf.encode(output, add_special_tokens=False).ids:
        if matcher.validate_tokens([token]) != 1 or not matcher.consume_token(token):
            return False
    return not matcher.is_error()


def json_grammar(schema: dict[str, Any]) -> str:
    return llguidance.LLMatcher.grammar_from_json_schema(schema, overrides={"lenient": True})


def test_the_limit_follows_the_parser(tiny_model_dir: Path) -> None:
    """The estimate refuses what overflows the engine's parser row, and takes the widest constraint of
    each kind that fits it (checked against llguidance itself, on the tiny model's vocabulary)."""
    text = (tiny_model_dir / "tokenizer.json").read_text()
    hf = Tokenizer.from_str(text)
    tokenizer = llguidance.LLTokenizer(text, n_vocab=hf.get_vocab_size(with_added_tokens=True))
    for schema, output in TOO_WIDE:
        assert schema_row_items(schema) > MAX_ROW_ITEMS
        assert not parses(tokenizer, hf, json_grammar(schema), output), output
    for schema, output in WIDEST:
        assert schema_row_items(schema) <= MAX_ROW_ITEMS
        assert parses(tokenizer, hf, json_grammar(schema), output), output
    choice = "start: " + " | ".join(json.dumps(c) for c in CHOICES_TOO_MANY)
    assert not parses(tokenizer, hf, llguidance.LLMatcher.grammar_from_lark(choice), "item5")
    widest = "start: " + " | ".join(json.dumps(c) for c in CHOICES_TOO_MANY[:MAX_ROW_ITEMS])
    assert parses(tokenizer, hf, llguidance.LLMatcher.grammar_from_lark(widest), "item5")


@pytest.mark.parametrize("schema", [schema for schema, _ in TOO_WIDE])
def test_schemas_too_wide_are_refused_naming_the_field(schema: dict[str, Any]) -> None:
    body = {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}}
    with pytest.raises(openai_protocol.ParamError, match=f"more than the {MAX_ROW_ITEMS} allowed") as caught:
        structured_output(body)
    assert caught.value.param == "response_format.json_schema.schema"


async def post(server: GatewayHandle, body: dict[str, Any]) -> httpx.Response:
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{server.port}", timeout=WAIT_S) as http:
        return await http.post("/v1/chat/completions", json={"model": MODEL, "messages": MESSAGES, **body})


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"structured_outputs": {"choice": CHOICES_TOO_MANY}}, "structured_outputs.choice"),
        ({"guided_choice": CHOICES_TOO_MANY}, "guided_choice"),
        ({"guided_json": {"anyOf": objects(2001)}}, "guided_json"),
        ({"guided_grammar": "start: " + " | ".join(f'"x{i}"' for i in range(2001))}, "guided_grammar"),
    ],
)
async def test_too_many_alternatives_are_400_over_http(
    make_gateway: MakeGateway, upstreams: FakeUpstreams, body: dict[str, Any], param: str
) -> None:
    response = await post(await make_gateway(), {**body, "max_tokens": 2})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and f"the {MAX_ROW_ITEMS} allowed" in error["message"]
    assert upstreams.engine.submits == []


async def test_too_many_choices_over_the_websocket(
    make_gateway: MakeGateway, upstreams: FakeUpstreams
) -> None:
    server = await make_gateway()
    async with connect(f"ws://127.0.0.1:{server.port}/v1/ws", max_size=None) as ws:
        frame = {"type": "generate", "id": "c", "prompt": "x", "params": {"guided_choice": CHOICES_TOO_MANY}}
        await ws.send(json.dumps(frame))
        end = (await collect(ws, {"c"}))["c"]["end"]
    assert (end["type"], end["code"]) == ("error", "invalid_argument")
    assert "params.guided_choice has 2001 strings" in end["message"]
    assert upstreams.engine.submits == []


async def test_too_many_choices_over_grpc(make_gateway: MakeGateway, upstreams: FakeUpstreams) -> None:
    server = await make_gateway()
    structured = common_pb2.StructuredOutput(kind="choice", text=json.dumps(CHOICES_TOO_MANY))
    request = gateway_pb2.PublicGenerateRequest(
        prompt="x", sampling=common_pb2.SamplingParams(structured=structured)
    )
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.server.grpc_port}") as channel:
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            async for _ in gateway_pb2_grpc.GatewayStub(channel).Generate(request, timeout=WAIT_S):
                pass
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "sampling.structured.text has 2001 strings" in (caught.value.details() or "")
    assert upstreams.engine.submits == []


def big_tools(n: int, properties: int) -> list[dict[str, Any]]:
    schema = {
        "type": "object",
        "properties": {
            f"p{i}_{'x' * 20}": {"type": "string", "description": "d" * 100} for i in range(properties)
        },
        "required": [f"p{i}_{'x' * 20}" for i in range(properties)],
    }
    return [{"type": "function", "function": {"name": f"t{j}", "parameters": schema}} for j in range(n)]


async def test_a_required_tool_call_grammar_past_the_size_limit_is_400(
    make_gateway: MakeGateway, upstreams: FakeUpstreams
) -> None:
    """The tool-call grammar goes through the size limit of every constraint: a large tools list with
    tool_choice required is refused naming `tools`; the same tools with tool_choice auto (no grammar:
    the tools only go into the prompt) are served."""
    server = await make_gateway()
    tools = big_tools(16, 120)
    assert len(json.dumps(tools)) > MAX_CONSTRAINT_CHARS
    refused = await post(server, {"tools": tools, "tool_choice": "required", "max_tokens": 2})
    assert refused.status_code == 400, refused.text
    error = refused.json()["error"]
    assert error["param"] == "tools" and f"more than the {MAX_CONSTRAINT_CHARS} allowed" in error["message"]
    assert upstreams.engine.submits == []
    served = await post(server, {"tools": tools, "tool_choice": "auto", "max_tokens": 2})
    assert served.status_code == 200, served.text


async def test_a_required_tool_schema_too_wide_is_400(
    make_gateway: MakeGateway, upstreams: FakeUpstreams
) -> None:
    server = await make_gateway()
    tools = [
        {
            "type": "function",
            "function": {"name": "f", "parameters": {"type": "object", "anyOf": objects(2001)}},
        }
    ]
    named = {"type": "function", "function": {"name": "f"}}
    refused = await post(server, {"tools": tools, "tool_choice": named, "max_tokens": 2})
    assert refused.status_code == 400, refused.text
    assert refused.json()["error"]["param"] == "tools[0].function.parameters"
    assert upstreams.engine.submits == []


async def test_an_engine_refusal_never_carries_a_backtrace(
    make_gateway: MakeGateway, upstreams: FakeUpstreams
) -> None:
    """A grammar compiler that panics (llguidance on a grammar past its symbol table) answers with a
    Rust backtrace: the client gets a sentence, not the backtrace; a refusal's parser-state dump is cut."""
    server = await make_gateway()
    upstreams.engine.error_next_submit = (
        "invalid_argument: grammar: panic: assertion failed: grammar.symbols.len() < u16::MAX as usize - 10\n"
        "<backtrace>\n   0: <unknown>\n  16: type_call\n"
        "             at Objects/typeobject.c:1091:11\n</backtrace>"
    )
    panicked = await post(server, {"max_tokens": 2})
    assert panicked.status_code == 400
    message = panicked.json()["error"]["message"]
    assert (
        message
        == "engine: grammar: the grammar compiler could not build this constraint (too large or too complex)"
    )
    upstreams.engine.error_next_submit = (
        "invalid_argument: grammar: expected rule at (1, 3)\n<state>\nTokens: ⟦x⟧\nParser: {...}"
    )
    refused = await post(server, {"max_tokens": 2})
    assert refused.json()["error"]["message"] == "engine: grammar: expected rule at (1, 3)"


async def test_a_large_tools_body_is_validated_off_the_event_loop(
    make_gateway: MakeGateway, upstreams: FakeUpstreams, monkeypatch: pytest.MonkeyPatch
) -> None:
    """While a large body's tools are being validated (held here until another request has been
    served), the event loop serves other requests: validating on the loop would stall every stream
    (and this test: the other request could not be served until the hold times out)."""
    holding, release = threading.Event(), threading.Event()
    served_meanwhile: list[bool] = []
    validate = openai_protocol.tool_request

    def held(body: dict[str, Any]) -> Any:
        holding.set()
        served_meanwhile.append(release.wait(WAIT_S))
        return validate(body)

    monkeypatch.setattr(openai_protocol, "tool_request", held)
    server = await make_gateway()
    big = asyncio.ensure_future(post(server, {"tools": big_tools(16, 120), "max_tokens": 2}))
    async with asyncio.timeout(WAIT_S):
        while not holding.is_set():
            await asyncio.sleep(0.01)
    monkeypatch.setattr(openai_protocol, "tool_request", validate)
    other = await post(server, {"max_tokens": 3})
    release.set()
    assert other.status_code == 200, other.text
    assert (await big).status_code == 200
    assert served_meanwhile == [True]
