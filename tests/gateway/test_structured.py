"""Structured outputs: every way of asking for one becomes the same `SamplingParams.structured` on the
engine's submit, on every API; a malformed or doubled constraint is refused before the engine."""

from __future__ import annotations

import json
from typing import Any

import grpc
import httpx
import pytest
from websockets.asyncio.client import connect

from gateway.params import ParamError
from gateway.server import GatewayHandle
from gateway.structured import check_structured, structured_output
from services.common.constraints import MAX_CONSTRAINT_CHARS
from services.common.pb import common_pb2, gateway_pb2, gateway_pb2_grpc
from tests.gateway.conftest import WAIT_S, collect, send
from tests.gateway.fakes import FakeUpstreams

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
# what the engine gets: the schema closed (it declares properties and says nothing of others)
SCHEMA_TEXT = json.dumps({**SCHEMA, "additionalProperties": False}, separators=(",", ":"))
MESSAGES = [{"role": "user", "content": "x"}]

# body fields → (kind, text, strict) the engine must receive
ACCEPTED: list[tuple[dict[str, Any], tuple[str, str, bool]]] = [
    ({"response_format": {"type": "json_object"}}, ("json_object", "", False)),
    (
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "a", "schema": SCHEMA, "strict": True},
            }
        },
        ("json_schema", SCHEMA_TEXT, True),
    ),
    (
        {"response_format": {"type": "json_schema", "json_schema": {"name": "any"}}},
        ("json_object", "", False),
    ),
    ({"structured_outputs": {"json": SCHEMA}}, ("json_schema", SCHEMA_TEXT, False)),
    ({"structured_outputs": {"json": json.dumps(SCHEMA)}}, ("json_schema", SCHEMA_TEXT, False)),
    ({"structured_outputs": {"json_object": True}}, ("json_object", "", False)),
    ({"structured_outputs": {"regex": "[a-z]+"}}, ("regex", "[a-z]+", False)),
    ({"structured_outputs": {"choice": ["yes", "no"]}}, ("choice", '["yes", "no"]', False)),
    ({"structured_outputs": {"grammar": 'start: "x"'}}, ("grammar", 'start: "x"', False)),
    ({"guided_json": SCHEMA}, ("json_schema", SCHEMA_TEXT, False)),
    ({"guided_regex": "\\d+"}, ("regex", "\\d+", False)),
    ({"guided_choice": ["a"]}, ("choice", '["a"]', False)),
    ({"guided_grammar": 'root ::= "x"'}, ("grammar", 'root ::= "x"', False)),
]

# body fields → the param the 400 names
REFUSED: list[tuple[dict[str, Any], str]] = [
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"response_format": {"type": "json_object", "schema": {}}}, "response_format.schema"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    (
        {"response_format": {"type": "json_schema", "json_schema": {"schema": SCHEMA}}},
        "response_format.json_schema.name",
    ),
    (
        {"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": {"type": "wat"}}}},
        "response_format.json_schema.schema.type",
    ),
    (
        {"response_format": {"type": "json_schema", "json_schema": {"name": "a", "strict": "yes"}}},
        "response_format.json_schema.strict",
    ),
    ({"structured_outputs": {"json": "{not json"}}, "structured_outputs.json"),
    ({"structured_outputs": {"json": [1]}}, "structured_outputs.json"),
    ({"structured_outputs": {"regex": ""}}, "structured_outputs.regex"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs.choice"),
    ({"structured_outputs": {"choice": ["a", 1]}}, "structured_outputs.choice"),
    ({"structured_outputs": {"json_object": "yes"}}, "structured_outputs.json_object"),
    ({"structured_outputs": {"structural_tag": "x"}}, "structured_outputs.structural_tag"),
    ({"structured_outputs": "x"}, "structured_outputs"),
    ({"guided_grammar": 3}, "guided_grammar"),
    ({"guided_regex": "x" * (MAX_CONSTRAINT_CHARS + 1)}, "guided_regex"),
]

# two constraints → the two fields the 400 names
DOUBLED: list[tuple[dict[str, Any], str, str]] = [
    ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "response_format", "guided_regex"),
    (
        {"structured_outputs": {"regex": "a", "choice": ["a"]}},
        "structured_outputs.regex",
        "structured_outputs.choice",
    ),
    ({"guided_json": SCHEMA, "guided_choice": ["a"]}, "guided_json", "guided_choice"),
]


def as_tuple(spec: common_pb2.StructuredOutput) -> tuple[str, str, bool]:
    return spec.kind, spec.text, spec.strict


@pytest.mark.parametrize(("body", "expected"), ACCEPTED)
def test_every_source_becomes_the_same_protobuf(
    body: dict[str, Any], expected: tuple[str, str, bool]
) -> None:
    found = structured_output(body)
    assert found is not None
    assert found[0].split(".")[0] == next(iter(body))
    assert as_tuple(found[1]) == expected
    assert as_tuple(check_structured(found[1], "x")) == expected  # what gRPC takes, the same rules


def test_text_and_null_are_no_constraint() -> None:
    assert structured_output({"response_format": {"type": "text"}}) is None
    assert structured_output({"guided_json": None, "structured_outputs": {"regex": None}}) is None
    assert structured_output({}) is None


@pytest.mark.parametrize(("body", "param"), REFUSED)
def test_malformed_or_doubled_constraints_are_refused(body: dict[str, Any], param: str) -> None:
    with pytest.raises(ParamError) as caught:
        structured_output(body)
    assert caught.value.param == param


@pytest.mark.parametrize(("body", "first", "second"), DOUBLED)
def test_two_constraints_are_refused_naming_both(body: dict[str, Any], first: str, second: str) -> None:
    with pytest.raises(ParamError) as caught:
        structured_output(body)
    assert caught.value.param == second
    assert caught.value.message == f"{first} and {second} both constrain the output: give at most one"


@pytest.mark.parametrize(
    ("spec", "param"),
    [
        (common_pb2.StructuredOutput(kind="yaml", text="x"), "s.kind"),
        (common_pb2.StructuredOutput(kind="", text="x"), "s.text"),
        (common_pb2.StructuredOutput(kind="json_object", text="{}"), "s.text"),
        (common_pb2.StructuredOutput(kind="json_schema", text="{"), "s.text"),
        (common_pb2.StructuredOutput(kind="json_schema", text="[]"), "s.text"),
        (common_pb2.StructuredOutput(kind="json_schema", text='{"required": 3}'), "s.text.required"),
        (common_pb2.StructuredOutput(kind="choice", text='"a"'), "s.text"),
        (common_pb2.StructuredOutput(kind="regex"), "s.text"),
        (common_pb2.StructuredOutput(kind="grammar", text="x" * (MAX_CONSTRAINT_CHARS + 1)), "s.text"),
    ],
)
def test_the_grpc_protobuf_is_checked(spec: common_pb2.StructuredOutput, param: str) -> None:
    with pytest.raises(ParamError) as caught:
        check_structured(spec, "s")
    assert caught.value.param == param


# ---- through the gateway, on each API ----------------------------------------------------------------

REGEX = {"guided_regex": "[0-9]{3}"}


async def over_chat(server: GatewayHandle, values: dict[str, Any]) -> tuple[int, str]:
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{server.port}", timeout=WAIT_S) as http:
        body = {"messages": MESSAGES, "max_tokens": 2, **values}
        response = await http.post("/v1/chat/completions", content=json.dumps(body))
    return response.status_code, response.text


async def over_completions(server: GatewayHandle, values: dict[str, Any]) -> tuple[int, str]:
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{server.port}", timeout=WAIT_S) as http:
        response = await http.post(
            "/v1/completions", content=json.dumps({"prompt": "x", "max_tokens": 2, **values})
        )
    return response.status_code, response.text


async def over_ws(server: GatewayHandle, values: dict[str, Any]) -> tuple[int, str]:
    async with connect(f"ws://127.0.0.1:{server.port}/v1/ws") as client:
        await send(
            client, {"type": "generate", "id": "s", "prompt": "x", "params": {"max_tokens": 2, **values}}
        )
        end = (await collect(client, {"s"}))["s"]["end"]
    return (200 if end["type"] == "done" else 400), json.dumps(end)


async def over_grpc(server: GatewayHandle, values: dict[str, Any]) -> tuple[int, str]:
    request = gateway_pb2.PublicGenerateRequest(prompt="x")
    request.stopping.max_new_tokens = 2
    request.sampling.structured.kind = "regex"
    request.sampling.structured.text = values.get("guided_regex", "")
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.server.grpc_port}") as channel:
        try:
            async for _ in gateway_pb2_grpc.GatewayStub(channel).Generate(request, timeout=WAIT_S):
                pass
        except grpc.aio.AioRpcError as exc:
            assert exc.code() == grpc.StatusCode.INVALID_ARGUMENT
            return 400, exc.details() or ""
    return 200, ""


APIS = {"chat": over_chat, "completions": over_completions, "ws": over_ws, "grpc": over_grpc}


@pytest.mark.parametrize("api", sorted(APIS))
async def test_a_constraint_reaches_the_engine_on_every_api(
    gateway: GatewayHandle, upstreams: FakeUpstreams, api: str
) -> None:
    status, text = await APIS[api](gateway, REGEX)
    assert status == 200, text
    assert as_tuple(upstreams.engine.submits[-1].sampling.structured) == ("regex", "[0-9]{3}", False)


@pytest.mark.parametrize("api", sorted(APIS))
async def test_a_bad_constraint_is_refused_on_every_api(
    gateway: GatewayHandle, upstreams: FakeUpstreams, api: str
) -> None:
    status, text = await APIS[api](gateway, {"guided_regex": ""})
    assert status == 400 and ("must not be empty" in text or "non-empty string" in text)
    assert upstreams.engine.submits == []


async def test_no_constraint_leaves_the_engine_unconstrained(
    gateway: GatewayHandle, upstreams: FakeUpstreams
) -> None:
    status, _ = await over_chat(gateway, {"response_format": {"type": "text"}})
    assert status == 200
    assert not upstreams.engine.submits[-1].sampling.HasField("structured")
