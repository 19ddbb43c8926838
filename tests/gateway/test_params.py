"""One validator for the three APIs: the same sampling or stopping value is refused the same way over
the WebSocket, the OpenAI-compatible HTTP API and the public gRPC API, before anything reaches the
engine."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest
from websockets.asyncio.client import connect

from gateway import params
from gateway.server import GatewayHandle
from gateway.settings import GatewaySettings
from gateway.structured import STRUCTURED_KEYS
from services.common.pb import gateway_pb2, gateway_pb2_grpc
from tests.gateway.conftest import WAIT_S, collect, send
from tests.gateway.fakes import FakeUpstreams

README = Path(__file__).resolve().parents[2] / "README.md"
LONG_STOP = "x" * (params.MAX_STOP_CHARS + 1)
MANY_IDS = list(range(params.MAX_STOP_TOKEN_IDS + 1))

# (values as the JSON APIs take them, the words every API's error message holds)
REFUSED = [
    ({"temperature": 5}, "temperature must be between 0 and 2"),
    ({"top_k": -5}, "top_k must be between -1 and"),
    ({"presence_penalty": 3}, "presence_penalty must be between -2 and 2"),
    ({"repetition_penalty": 11}, "repetition_penalty must be between 0 and 10"),
    ({"repetition_penalty": 1e-40}, "repetition_penalty must be 0 (off) or between 0.01 and 10"),
    ({"top_p": 1.5}, "top_p must be greater than 0 and at most 1"),
    ({"max_tokens": 4, "min_tokens": 5}, "min_tokens (5) must not exceed max_tokens (4)"),
    ({"stop": ["ok", LONG_STOP]}, f"at most {params.MAX_STOP_CHARS} characters"),
    ({"stop": [str(i) for i in range(params.MAX_STOP_STRINGS + 1)]}, f"at most {params.MAX_STOP_STRINGS}"),
    ({"stop_token_ids": [5, -1]}, "stop_token_ids must hold integers from 0 to"),
    ({"stop_token_ids": MANY_IDS}, f"at most {params.MAX_STOP_TOKEN_IDS} ids"),
]

# JSON name → (protobuf message, field) of a PublicGenerateRequest
_GRPC_FIELDS = {
    "temperature": ("sampling", "temperature"),
    "top_k": ("sampling", "top_k"),
    "top_p": ("sampling", "top_p"),
    "presence_penalty": ("sampling", "presence_penalty"),
    "repetition_penalty": ("sampling", "repetition_penalty"),
    "max_tokens": ("stopping", "max_new_tokens"),
    "min_tokens": ("stopping", "min_new_tokens"),
    "min_p": ("sampling", "min_p"),
    "ignore_eos": ("stopping", "ignore_eos"),
}


async def refusal_over_ws(server: GatewayHandle, values: dict[str, Any]) -> tuple[str, str]:
    async with connect(f"ws://127.0.0.1:{server.port}/v1/ws") as client:
        await send(client, {"type": "generate", "id": "v", "prompt": "x", "params": values})
        end = (await collect(client, {"v"}))["v"]["end"]
    assert end["type"] == "error"
    return end["code"], end["message"]


async def refusal_over_http(server: GatewayHandle, values: dict[str, Any]) -> tuple[str, str]:
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{server.port}", timeout=WAIT_S) as http:
        response = await http.post("/v1/completions", content=json.dumps({"prompt": "x", **values}))
    assert response.status_code == 400
    error = response.json()["error"]
    return error["type"], error["message"]


async def refusal_over_grpc(server: GatewayHandle, values: dict[str, Any]) -> tuple[str, str]:
    request = gateway_pb2.PublicGenerateRequest(prompt="x")
    for name, value in values.items():
        if name in ("stop", "stop_token_ids"):
            getattr(request.stopping, name).extend(value)
        else:
            message, field = _GRPC_FIELDS[name]
            setattr(getattr(request, message), field, value)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.server.grpc_port}") as channel:
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            async for _ in gateway_pb2_grpc.GatewayStub(channel).Generate(request, timeout=WAIT_S):
                pass
    return caught.value.code().name, caught.value.details() or ""


REFUSALS = {
    "ws": (refusal_over_ws, "invalid_argument"),
    "http": (refusal_over_http, "invalid_request_error"),
    "grpc": (refusal_over_grpc, "INVALID_ARGUMENT"),
}


@pytest.mark.parametrize("api", sorted(REFUSALS))
@pytest.mark.parametrize(("values", "words"), REFUSED)
async def test_out_of_range_values_are_refused_alike_on_every_api(
    gateway: GatewayHandle, upstreams: FakeUpstreams, api: str, values: dict[str, Any], words: str
) -> None:
    refuse, expected_code = REFUSALS[api]
    code, message = await refuse(gateway, values)
    assert code == expected_code and words in message
    assert upstreams.engine.submits == [] and gateway.core.in_flight == 0


def test_limits_are_inclusive() -> None:
    values = {"temperature": 2, "stop": ["y" * params.MAX_STOP_CHARS] * params.MAX_STOP_STRINGS}
    sampling, stopping = params.generation_params(values, GatewaySettings().default_temperature)
    assert sampling.temperature == 2.0 and len(stopping.stop) == params.MAX_STOP_STRINGS
    assert stopping.stop[0] == "y" * params.MAX_STOP_CHARS


# One value of each OpenAI extension, and what the engine must receive for it.
EXTENSIONS = {
    "ignore_eos": True,
    "min_p": 0.25,
    "min_tokens": 2,
    "repetition_penalty": 1.5,
    "stop_token_ids": [7, 9],
    "top_k": 5,
}


async def accept_over_ws(server: GatewayHandle, values: dict[str, Any]) -> None:
    async with connect(f"ws://127.0.0.1:{server.port}/v1/ws") as client:
        await send(client, {"type": "generate", "id": "v", "prompt": "x", "params": values})
        assert (await collect(client, {"v"}))["v"]["end"]["type"] == "done"


async def accept_over_http(server: GatewayHandle, values: dict[str, Any], path: str) -> None:
    body = {"prompt": "x"} if path == "/v1/completions" else {"messages": [{"role": "user", "content": "x"}]}
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{server.port}", timeout=WAIT_S) as http:
        response = await http.post(path, content=json.dumps({**body, **values}))
    assert response.status_code == 200, response.text


async def accept_over_grpc(server: GatewayHandle, values: dict[str, Any]) -> None:
    request = gateway_pb2.PublicGenerateRequest(prompt="x")
    for name, value in values.items():
        if name == "stop_token_ids":
            request.stopping.stop_token_ids.extend(value)
        else:
            message, field = _GRPC_FIELDS[name]
            setattr(getattr(request, message), field, value)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.server.grpc_port}") as channel:
        replies = [r async for r in gateway_pb2_grpc.GatewayStub(channel).Generate(request, timeout=WAIT_S)]
    assert replies[-1].HasField("final")


ACCEPTS = {
    "ws": accept_over_ws,
    "completions": lambda server, values: accept_over_http(server, values, "/v1/completions"),
    "chat": lambda server, values: accept_over_http(server, values, "/v1/chat/completions"),
    "grpc": accept_over_grpc,
}


@pytest.mark.parametrize("api", sorted(ACCEPTS))
async def test_every_extension_reaches_the_engine_on_every_api(
    gateway: GatewayHandle, upstreams: FakeUpstreams, api: str
) -> None:
    assert sorted(EXTENSIONS) == sorted(params.OPENAI_EXTENSIONS)
    await ACCEPTS[api](gateway, {"max_tokens": 3, **EXTENSIONS})
    submit = upstreams.engine.submits[-1]
    assert submit.stopping.ignore_eos is True
    assert submit.sampling.min_p == pytest.approx(0.25)
    assert submit.stopping.min_new_tokens == 2
    assert submit.sampling.repetition_penalty == pytest.approx(1.5)
    assert list(submit.stopping.stop_token_ids) == [7, 9]
    assert submit.sampling.top_k == 5


def documented_extensions() -> list[str]:
    """The field names of the README's "Request fields" table marked (vLLM)."""
    text = README.read_text(encoding="utf-8")
    start = text.index("**Request fields.**")
    rows = []
    for line in text[start:].splitlines()[1:]:
        if rows and not line.startswith("|"):
            break
        match = re.match(r"\| `(\w+)` \(vLLM\) \|", line)
        if match:
            rows.append(match.group(1))
    return rows


def test_the_readme_documents_exactly_the_accepted_extensions() -> None:
    vllm_constraints = [key for key in STRUCTURED_KEYS if key != "response_format"]
    assert documented_extensions() == sorted([*params.OPENAI_EXTENSIONS, *vllm_constraints])
    assert set(params.OPENAI_EXTENSIONS) <= params.GENERATION_KEYS


def test_stop_token_ids_are_checked_and_kept_in_order() -> None:
    _, stopping = params.generation_params({"stop_token_ids": [0, 2**31 - 1, 3]}, 1.0)
    assert list(stopping.stop_token_ids) == [0, 2**31 - 1, 3]
    for bad in ([1.0], [True], [2**31], "7", {"a": 1}):
        with pytest.raises(params.ParamError) as caught:
            params.generation_params({"stop_token_ids": bad}, 1.0, where="params.")
        assert caught.value.param == "params.stop_token_ids"


@pytest.mark.parametrize("api", ["ws", "http"])
async def test_an_integer_past_any_float_is_refused_not_an_internal_error(
    gateway: GatewayHandle, upstreams: FakeUpstreams, api: str
) -> None:
    refuse, expected_code = REFUSALS[api]
    code, message = await refuse(gateway, {"temperature": 10**400})
    assert code == expected_code and "temperature must be between 0 and 2" in message
    assert upstreams.engine.submits == [] and gateway.core.in_flight == 0


@pytest.mark.parametrize("api", ["ws", "completions", "chat"])  # gRPC's top_p is a float32 already
async def test_a_tiny_top_p_is_not_read_as_off(
    gateway: GatewayHandle, upstreams: FakeUpstreams, api: str
) -> None:
    await ACCEPTS[api](gateway, {"max_tokens": 1, "top_p": 1e-50})
    assert upstreams.engine.submits[-1].sampling.top_p > 0  # float32 0 would be off: the whole nucleus


def test_the_default_max_tokens_is_0_on_the_wire() -> None:
    """Unset max tokens go to the engine as 0: the engine, which owns the context limit, fills the rest
    of the context (`test_an_unset_max_tokens_reaches_the_engine_as_0`)."""
    assert params.generation_params({}, 1.0)[1].max_new_tokens == 0
    assert params.generation_params({"max_tokens": 3}, 1.0)[1].max_new_tokens == 3


def test_logprobs_above_the_limit_are_refused() -> None:
    assert params.logprobs(params.MAX_LOGPROBS, "sampling.logprobs") == params.MAX_LOGPROBS
    with pytest.raises(params.ParamError, match="at most"):
        params.logprobs(params.MAX_LOGPROBS + 1, "sampling.logprobs")
