"""Structured outputs and tool calls through real clients against a real `sluice up` (the untrained tiny
model, so only the engine's grammar makes its output valid): the official `openai` SDK's `parse()`
and a streamed required tool call, JSON schema outputs over HTTP, the WebSocket and gRPC at
temperature 0 and 1, and LangChain's `ChatOpenAI` `bind_tools` and `with_structured_output`.

Every schema bounds its output (string lengths, integer ranges, array sizes), so a valid output
always fits in `MAX_TOKENS` and a random model cannot run past it."""

from __future__ import annotations

import asyncio
import itertools
import json
from collections.abc import Iterator
from typing import Annotated, Any, Literal

import grpc
import jsonschema
import openai
import pytest
import websockets
from pydantic import BaseModel, ConfigDict, Field

from services.common.pb import common_pb2, gateway_pb2, gateway_pb2_grpc
from tests.e2e.conftest import Pipeline

pytestmark = pytest.mark.e2e

MAX_TOKENS = 400
TIMEOUT_S = 120.0
CONCURRENCY = 16


class Pet(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(min_length=1, max_length=8)
    kind: Literal["cat", "dog", "fish"]
    age: int = Field(ge=0, le=30)


class Order(BaseModel):
    model_config = ConfigDict(extra="forbid")
    items: list[Annotated[str, Field(max_length=8)]] = Field(max_length=3)
    paid: bool
    total: int = Field(ge=0, le=1000)


class Point(BaseModel):
    model_config = ConfigDict(extra="forbid")
    x: int = Field(ge=-100, le=100)
    y: int = Field(ge=-100, le=100)
    label: str | None = Field(default=None, max_length=6)


class Forecast(BaseModel):
    model_config = ConfigDict(extra="forbid")
    city: str = Field(min_length=1, max_length=12)
    days: int = Field(ge=1, le=7)


MODELS: list[type[BaseModel]] = [Pet, Order, Point, Forecast]
SCHEMAS = {model.__name__: model.model_json_schema() for model in MODELS}
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_forecast",
        "description": "The weather forecast for a city",
        "parameters": Forecast.model_json_schema(),
    },
}
MESSAGES = [{"role": "user", "content": "Answer in JSON."}]


@pytest.fixture(scope="module")
def client(pipeline: Pipeline) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(
        base_url=f"{pipeline.http_url}/v1", api_key="unused", timeout=TIMEOUT_S, max_retries=0
    ) as c:
        yield c


@pytest.fixture(scope="module")
def model(client: openai.OpenAI) -> str:
    return client.models.list().data[0].id


def response_format(name: str) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": name, "schema": SCHEMAS[name], "strict": True}}


def test_parse_gives_a_valid_object(client: openai.OpenAI, model: str) -> None:
    completion = client.chat.completions.parse(
        model=model, messages=MESSAGES, response_format=Pet, max_tokens=MAX_TOKENS, temperature=0
    )
    pet = completion.choices[0].message.parsed
    assert isinstance(pet, Pet), completion
    assert completion.choices[0].finish_reason == "stop"


def test_a_streamed_required_tool_call_assembles_into_a_valid_call(client: openai.OpenAI, model: str) -> None:
    stream = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Weather in Paris for three days?"}],
        tools=[WEATHER_TOOL],  # type: ignore[list-item]
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=MAX_TOKENS,
        temperature=1,
        stream=True,
    )
    calls: dict[int, dict[str, str]] = {}
    reasons = []
    for chunk in stream:
        choice = chunk.choices[0]
        for delta in choice.delta.tool_calls or []:
            if delta.id is not None:
                assert delta.function is not None and delta.function.name
                calls[delta.index] = {"id": delta.id, "name": delta.function.name, "arguments": ""}
            assert delta.function is not None
            calls[delta.index]["arguments"] += delta.function.arguments or ""
        reasons.append(choice.finish_reason)
    assert reasons[-1] == "tool_calls"
    assert list(calls) == [0] and calls[0]["name"] == "get_forecast"
    Forecast.model_validate_json(calls[0]["arguments"])


async def http_outputs(url: str, model: str, jobs: list[tuple[str, float]]) -> list[tuple[str, str, str]]:
    """(schema name, output, finish reason) of each job, over the OpenAI API."""
    gate = asyncio.Semaphore(CONCURRENCY)
    async with openai.AsyncOpenAI(
        base_url=f"{url}/v1", api_key="unused", timeout=TIMEOUT_S, max_retries=0
    ) as c:

        async def one(name: str, temperature: float) -> tuple[str, str, str]:
            async with gate:
                reply = await c.chat.completions.create(
                    model=model,
                    messages=MESSAGES,  # type: ignore[arg-type]
                    response_format=response_format(name),  # type: ignore[arg-type]
                    max_tokens=MAX_TOKENS,
                    temperature=temperature,
                )
            return name, reply.choices[0].message.content or "", reply.choices[0].finish_reason

        return await asyncio.gather(*(one(name, t) for name, t in jobs))


async def ws_outputs(url: str, jobs: list[tuple[str, float]]) -> list[tuple[str, str, str]]:
    """The same over WebSockets of 10 generations each (under `--ws-max-in-flight`), with vLLM's
    `guided_json` in `params`."""
    parts = await asyncio.gather(*(ws_socket_outputs(url, jobs[i : i + 10]) for i in range(0, len(jobs), 10)))
    return [output for part in parts for output in part]


async def ws_socket_outputs(url: str, jobs: list[tuple[str, float]]) -> list[tuple[str, str, str]]:
    async with websockets.connect(url) as ws:
        for i, (name, temperature) in enumerate(jobs):
            params = {"guided_json": SCHEMAS[name], "max_tokens": MAX_TOKENS, "temperature": temperature}
            await ws.send(
                json.dumps({"type": "generate", "id": str(i), "messages": MESSAGES, "params": params})
            )
        texts, ends = {str(i): "" for i in range(len(jobs))}, {}
        while len(ends) < len(jobs):
            frame = json.loads(await asyncio.wait_for(ws.recv(), TIMEOUT_S))
            if frame["type"] == "delta":
                texts[frame["id"]] += frame["text"]
            else:
                assert frame["type"] == "done", frame
                ends[frame["id"]] = frame["finish_reason"]
    return [(name, texts[str(i)], ends[str(i)]) for i, (name, _) in enumerate(jobs)]


async def grpc_outputs(address: str, jobs: list[tuple[str, float]]) -> list[tuple[str, str, str]]:
    """The same over the public gRPC API (`SamplingParams.structured`)."""
    async with grpc.aio.insecure_channel(address) as channel:
        stub = gateway_pb2_grpc.GatewayStub(channel)

        async def one(name: str, temperature: float) -> tuple[str, str, str]:
            structured = common_pb2.StructuredOutput(
                kind="json_schema", text=json.dumps(SCHEMAS[name]), strict=True
            )
            request = gateway_pb2.PublicGenerateRequest(
                chat=common_pb2.Conversation(messages=[common_pb2.ChatMessage(**m) for m in MESSAGES]),
                sampling=common_pb2.SamplingParams(temperature=temperature, structured=structured),
                stopping=common_pb2.StoppingParams(max_new_tokens=MAX_TOKENS),
            )
            text, reason = "", ""
            async for reply in stub.Generate(request, timeout=TIMEOUT_S):
                if reply.HasField("delta"):
                    text += reply.delta.text
                else:
                    reason = common_pb2.FinishReason.Name(reply.final.finish_reason)
            return name, text, "stop" if reason == "FINISH_REASON_STOP" else reason

        return await asyncio.gather(*(one(name, t) for name, t in jobs))


def mixed_jobs(n: int) -> list[tuple[str, float]]:
    """`n` (schema, temperature) pairs: every schema at temperature 0 and 1, in turn."""
    pairs = itertools.cycle(itertools.product(SCHEMAS, (0.0, 1.0)))
    return [next(pairs) for _ in range(n)]


def invalid(outputs: list[tuple[str, str, str]]) -> list[tuple[str, str, str]]:
    """The outputs that did not end by themselves or do not validate against their schema."""
    bad = []
    for name, text, reason in outputs:
        try:
            jsonschema.validate(json.loads(text), SCHEMAS[name])
        except (ValueError, jsonschema.ValidationError):
            bad.append((name, text, reason))
            continue
        if reason != "stop":
            bad.append((name, text, reason))
    return bad


def test_a_hundred_json_schema_outputs_over_http_are_valid(pipeline: Pipeline, model: str) -> None:
    outputs = asyncio.run(http_outputs(pipeline.http_url, model, mixed_jobs(100)))
    assert len(outputs) == 100 and invalid(outputs) == []


def test_json_schema_outputs_over_the_websocket_are_valid(pipeline: Pipeline) -> None:
    outputs = asyncio.run(ws_outputs(pipeline.ws_url, mixed_jobs(50)))
    assert len(outputs) == 50 and invalid(outputs) == []


def test_json_schema_outputs_over_grpc_are_valid(pipeline: Pipeline) -> None:
    outputs = asyncio.run(grpc_outputs(f"127.0.0.1:{pipeline.grpc_base_port}", mixed_jobs(50)))
    assert len(outputs) == 50 and invalid(outputs) == []


def test_langchain_bind_tools_and_with_structured_output(pipeline: Pipeline, model: str) -> None:
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(
        model=model,
        base_url=f"{pipeline.http_url}/v1",
        api_key="unused",
        max_tokens=MAX_TOKENS,
        temperature=0,
    )  # type: ignore[call-arg]
    message = llm.bind_tools([WEATHER_TOOL], tool_choice="required", parallel_tool_calls=False).invoke(
        "Weather in Paris?"
    )
    [call] = message.tool_calls  # type: ignore[attr-defined]
    assert call["name"] == "get_forecast"
    Forecast.model_validate(call["args"])
    pet = llm.with_structured_output(Pet, method="json_schema", strict=True).invoke("A pet, please.")
    assert isinstance(pet, Pet)
