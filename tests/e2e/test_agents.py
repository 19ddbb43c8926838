"""Agent frameworks against a real `sluice up` (the untrained tiny model, so only the engine's grammar
makes a forced tool call or a typed output valid): the OpenAI Agents SDK's tool loop (a forced call,
the tool's result sent back, an answer), its loop through a tool call cut by `max_tokens` (the SDK
sends the cut arguments back as they are), and its `output_type`; pydantic-ai's `output_type`, through
its output tool (a forced call) and as a native JSON schema output.

Every schema bounds its output (string lengths, integer ranges), so a valid output fits in the token
budget whatever the model would rather write."""

from __future__ import annotations

import asyncio
from typing import Annotated, Literal

import openai
import pytest
from pydantic import BaseModel, ConfigDict, Field

from tests.e2e.conftest import Pipeline

pytestmark = pytest.mark.e2e

MAX_TOKENS = 400
TIMEOUT_S = 120.0


class Pet(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(min_length=1, max_length=8)
    kind: Literal["cat", "dog", "fish"]
    age: int = Field(ge=0, le=30)


def _client(pipeline: Pipeline) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(
        base_url=f"{pipeline.http_url}/v1", api_key="unused", timeout=TIMEOUT_S, max_retries=0
    )


async def _model_name(pipeline: Pipeline) -> str:
    async with _client(pipeline) as client:
        return (await client.models.list()).data[0].id


# ----- the OpenAI Agents SDK


def _agents_model(pipeline: Pipeline, name: str):  # type: ignore[no-untyped-def]
    from agents import OpenAIChatCompletionsModel, set_tracing_disabled

    set_tracing_disabled(True)  # nothing is sent to OpenAI's trace service
    return OpenAIChatCompletionsModel(model=name, openai_client=_client(pipeline))


async def _tool_loop(pipeline: Pipeline, max_tokens: int) -> tuple[list[tuple[str, int]], object, list[str]]:
    """One run of a weather agent whose first turn must call its tool: (the tool's calls, the final
    output, the kinds of the run's items)."""
    from agents import Agent, ModelSettings, Runner, function_tool

    calls: list[tuple[str, int]] = []

    @function_tool
    def get_forecast(
        city: Annotated[str, Field(min_length=1, max_length=8)], days: Annotated[int, Field(ge=1, le=7)]
    ) -> str:
        """The weather forecast for a city."""
        calls.append((city, days))
        return f"Sunny in {city} for {days} days."

    name = await _model_name(pipeline)
    agent = Agent(
        name="weather",
        instructions="Answer questions about the weather; call get_forecast first.",
        tools=[get_forecast],
        model=_agents_model(pipeline, name),
        model_settings=ModelSettings(tool_choice="required", max_tokens=max_tokens, temperature=0),
    )
    result = await Runner.run(agent, "Weather in Paris for three days?", max_turns=4)
    return calls, result.final_output, [item.type for item in result.new_items]


def test_agents_sdk_tool_loop_forced_call_result_back_then_an_answer(pipeline: Pipeline) -> None:
    """Turn 1: tool_choice required, a grammar-valid call, which the SDK runs; turn 2 (the SDK resets
    tool_choice to auto): the conversation with the call and its result goes back, and the model's
    text is the final output."""
    calls, output, items = asyncio.run(_tool_loop(pipeline, MAX_TOKENS))
    assert len(calls) == 1, (calls, items)
    city, days = calls[0]
    assert 1 <= len(city) <= 8 and 1 <= days <= 7
    assert items[:2] == ["tool_call_item", "tool_call_output_item"], items
    assert items[-1] == "message_output_item" and isinstance(output, str), (items, output)


CUT_MAX_TOKENS = 40  # past the forced call's opening and name (about 24 tokens), inside its arguments


def test_agents_sdk_sends_back_a_tool_call_cut_by_max_tokens(pipeline: Pipeline) -> None:
    """A forced call of a tool whose argument is an unbounded string, with too few tokens: the call is
    cut inside its arguments, which are not valid JSON. The SDK reports the tool's failure to the model
    and sends the assistant turn back as the server produced it; the server takes those arguments as
    they are (OpenAI does), so the loop goes on to an answer."""
    from agents import Agent, ModelSettings, Runner, function_tool

    calls: list[str] = []

    @function_tool
    def lookup(query: str) -> str:
        """Looks a query up."""
        calls.append(query)
        return "nothing found"

    async def run() -> tuple[object, list[str], list[str]]:
        name = await _model_name(pipeline)
        agent = Agent(
            name="lookup",
            instructions="Look things up.",
            tools=[lookup],
            model=_agents_model(pipeline, name),
            model_settings=ModelSettings(tool_choice="required", max_tokens=CUT_MAX_TOKENS, temperature=0),
        )
        result = await Runner.run(agent, "What is sluice?", max_turns=4)
        kinds = [item.type for item in result.new_items]
        arguments = [item.raw_item.arguments for item in result.new_items if item.type == "tool_call_item"]
        return result.final_output, kinds, arguments

    output, items, arguments = asyncio.run(run())
    assert items[:2] == ["tool_call_item", "tool_call_output_item"], items
    assert calls == [], (calls, arguments)  # the cut arguments did not parse: the tool never ran
    assert isinstance(output, str), (items, output)


def test_agents_sdk_output_type_gives_a_valid_object(pipeline: Pipeline) -> None:
    from agents import Agent, ModelSettings, Runner

    async def run() -> object:
        name = await _model_name(pipeline)
        agent = Agent(
            name="pets",
            instructions="Describe a pet.",
            model=_agents_model(pipeline, name),
            output_type=Pet,
            model_settings=ModelSettings(max_tokens=MAX_TOKENS, temperature=0),
        )
        return (await Runner.run(agent, "A pet, please.", max_turns=2)).final_output

    assert isinstance(asyncio.run(run()), Pet)


# ----- pydantic-ai


@pytest.mark.parametrize("mode", ["tool", "native"])
def test_pydantic_ai_output_type_gives_a_valid_object(pipeline: Pipeline, mode: str) -> None:
    """pydantic-ai's default output is a tool the model must call (tool_choice required); `NativeOutput`
    asks for a JSON schema response format instead. Either way the output is a valid `Pet`."""
    from pydantic_ai import Agent, NativeOutput
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai_compatible import OpenAICompatibleProvider

    async def run() -> object:
        name = await _model_name(pipeline)
        provider = OpenAICompatibleProvider("sluice", openai_client=_client(pipeline))
        model = OpenAIChatModel(name, provider=provider)
        output_type = Pet if mode == "tool" else NativeOutput(Pet)
        agent = Agent(model, output_type=output_type, instructions="Describe a pet.", retries=0)
        settings = {"max_tokens": MAX_TOKENS, "temperature": 0}
        return (await agent.run("A pet, please.", model_settings=settings)).output

    assert isinstance(asyncio.run(run()), Pet)
