"""JSON schemas are closed (`services.common.constraints.closed_schema`): an object schema that declares
its properties and says nothing of others admits only those, for a forced tool call's arguments and a
response format alike, so a model cannot write invented keys until its max tokens. Against the real
stages in this process (the untrained tiny model: only the grammar makes its output valid)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from gateway.server import GatewayHandle, create_server
from gateway.settings import GatewaySettings
from gateway.tool_parsers.hermes import HermesToolCalls
from gateway.tools import tool_request
from services.detokenizer.server import create_server as create_detokenizer
from services.detokenizer.settings import DetokenizerSettings
from services.engine.server import create_server as create_engine
from services.engine.settings import EngineSettings
from services.tokenizer.server import create_server as create_tokenizer
from services.tokenizer.settings import TokenizerSettings

TIMEOUT_S = 120.0
SEEDS = range(12)
MAX_TOKENS = 200
# No additionalProperties: the output may hold only city and days.
FORECAST = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "minLength": 1, "maxLength": 8},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "days"],
}
TOOL = {"type": "function", "function": {"name": "get_forecast", "parameters": FORECAST}}
MESSAGES = [{"role": "user", "content": "Weather in Paris for three days?"}]


@pytest.fixture
async def gateway(tiny_model_dir: Path) -> AsyncIterator[GatewayHandle]:
    model = str(tiny_model_dir)
    stages = [
        await create_tokenizer(TokenizerSettings(model=model, port=0)),
        await create_detokenizer(DetokenizerSettings(model=model, port=0)),
        await create_engine(EngineSettings(model=model, port=0, device="cpu", num_kv_blocks=256)),
    ]
    for stage in stages:
        await stage.start()
    tok, det, eng = (f"127.0.0.1:{stage.port}" for stage in stages)
    settings = GatewaySettings(port=0, grpc_port=0, tokenizer=(tok,), engine=(eng,), detokenizer=(det,))
    server = await create_server(settings)
    await server.start()
    try:
        yield server
    finally:
        await server.stop(0.5)
        for stage in stages:
            await stage.stop(0)


async def completions(server: GatewayHandle, body: dict[str, Any]) -> list[dict[str, Any]]:
    """One chat completion per seed, at temperature 1."""
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{server.port}", timeout=TIMEOUT_S) as http:
        replies = await asyncio.gather(*(
            http.post("/v1/chat/completions", json={
                "messages": MESSAGES, "max_tokens": MAX_TOKENS, "temperature": 1, "seed": seed, **body
            })
            for seed in SEEDS
        ))  # fmt: skip
    assert all(r.status_code == 200 for r in replies), [r.text for r in replies]
    return [r.json()["choices"][0] for r in replies]


def assert_declared_only(text: str) -> None:
    value = json.loads(text)
    assert set(value) == {"city", "days"}, text
    assert isinstance(value["city"], str) and 1 <= value["days"] <= 7, text


async def test_a_forced_tool_call_writes_only_the_declared_properties(gateway: GatewayHandle) -> None:
    named = {"type": "function", "function": {"name": "get_forecast"}}
    choices = await completions(
        gateway, {"tools": [TOOL], "tool_choice": named, "parallel_tool_calls": False}
    )
    for choice in choices:
        assert choice["finish_reason"] == "tool_calls", choice
        [call] = choice["message"]["tool_calls"]
        assert call["function"]["name"] == "get_forecast"
        assert_declared_only(call["function"]["arguments"])


async def test_a_response_format_writes_only_the_declared_properties(gateway: GatewayHandle) -> None:
    schema = {"type": "json_schema", "json_schema": {"name": "forecast", "schema": FORECAST}}
    for choice in await completions(gateway, {"response_format": schema}):
        assert choice["finish_reason"] == "stop", choice
        assert_declared_only(choice["message"]["content"])


def arguments_schema(parameters: dict[str, Any], *, strict: bool = False) -> dict[str, Any]:
    """The schema a forced call's grammar holds for these parameters."""
    function = {"name": "f", "parameters": parameters, "strict": strict}
    tools = tool_request({"tools": [{"type": "function", "function": function}], "tool_choice": "required"})
    assert tools is not None
    grammar = tools.grammar(HermesToolCalls)
    assert grammar is not None
    return json.loads(grammar[1].split(" %json ")[1].rsplit(" ", 1)[0])


def test_a_schema_that_allows_other_properties_keeps_them() -> None:
    """Closing fills in only what the schema leaves unsaid: additionalProperties given (true or a
    schema) stays; an object that declares no properties stays any object unless the tool is strict
    (then, as OpenAI's strict mode, every object is closed)."""
    assert arguments_schema(FORECAST)["additionalProperties"] is False
    open_one = {**FORECAST, "additionalProperties": True}
    assert arguments_schema(open_one)["additionalProperties"] is True
    nested = {"type": "object", "properties": {"tags": {"type": "object"}, "meta": {"properties": {"a": {}}}}}
    closed = arguments_schema(nested)
    assert "additionalProperties" not in closed["properties"]["tags"]
    assert closed["properties"]["meta"]["additionalProperties"] is False
    assert arguments_schema(nested, strict=True)["properties"]["tags"]["additionalProperties"] is False
