"""Property tests (hypothesis) of what clients send: the one parameter validator, as the JSON APIs and
the public gRPC API call it, and the WebSocket frame handler. Whatever arrives, the answer is either
valid protobufs / a started generation or the documented error (`ParamError`, an `error` frame with a
protocol code), never another exception, an `internal` error or a hang.

Derandomized with modest example counts and no deadlines, so the suite stays fast and repeatable.
"""

from __future__ import annotations

import asyncio
import json
from collections import deque
from collections.abc import AsyncIterator
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gateway import grpc_api, params
from gateway.auth import ApiKeys
from gateway.pipeline import Pipeline
from gateway.settings import GatewaySettings
from gateway.ws import SocketSession
from services.common.metrics import GatewayMetrics
from services.common.pb import common_pb2, gateway_pb2
from tests.gateway.conftest import WAIT_S, gateway_settings
from tests.gateway.fakes import FakeUpstreams

PROPERTY = settings(max_examples=200, deadline=None, derandomize=True, database=None)
SETTINGS = GatewaySettings()

# ----- strategies

LONE_SURROGATES = st.sampled_from(["\ud83d", "a\udc00b", "\udfff"])
TEXT = st.one_of(st.text(max_size=12), LONE_SURROGATES)
# Numbers at the edges: past any float, below float32's precision, not finite, just past a limit.
NOT_FINITE = [float("nan"), float("inf"), float("-inf")]
EDGES = st.sampled_from(
    [0, -0.0, 1e-50, 5e-324, 10**400, -(10**400), 2**31, 2**63, 2**64, 1.0000001, 2.0000001, -1, *NOT_FINITE]
)
NUMBERS = st.one_of(st.integers(), st.floats(allow_nan=True, allow_infinity=True), EDGES)
JSON_LEAVES = st.one_of(st.none(), st.booleans(), NUMBERS, TEXT)
JSON_VALUES = st.recursive(
    JSON_LEAVES,
    lambda inner: st.one_of(st.lists(inner, max_size=5), st.dictionaries(TEXT, inner, max_size=5)),
    max_leaves=12,
)
# Values near each parameter's limits, so that valid documents are common too.
PLAUSIBLE: dict[str, st.SearchStrategy[Any]] = {
    "temperature": st.floats(-0.5, 2.5),
    "top_p": st.floats(-0.1, 1.1),
    "top_k": st.integers(-3, 100),
    "min_p": st.floats(-0.1, 1.1),
    "presence_penalty": st.floats(-2.5, 2.5),
    "frequency_penalty": st.floats(-2.5, 2.5),
    "repetition_penalty": st.floats(-1, 11),
    "seed": st.integers(-1, 2**64),
    "max_tokens": st.integers(-1, 2**31),
    "min_tokens": st.integers(-1, 300),
    "ignore_eos": st.booleans(),
    "stop": st.one_of(TEXT, st.lists(TEXT, max_size=params.MAX_STOP_STRINGS + 2)),
    "stop_token_ids": st.lists(st.integers(-2, 2**31), max_size=params.MAX_STOP_TOKEN_IDS + 2),
    "logit_bias": st.dictionaries(
        st.one_of(st.integers(-2, 2**31).map(str), TEXT), st.one_of(st.floats(-110, 110), EDGES), max_size=4
    ),
}
assert set(PLAUSIBLE) == params.GENERATION_KEYS
PARAM_VALUES = st.fixed_dictionaries(
    {}, optional={name: st.one_of(plausible, EDGES, JSON_VALUES) for name, plausible in PLAUSIBLE.items()}
)


def check_valid(sampling: common_pb2.SamplingParams, stopping: common_pb2.StoppingParams) -> None:
    """What every accepted request holds, whatever it sent (protobuf 0 = off or default)."""
    assert 0 <= sampling.temperature <= params.MAX_TEMPERATURE
    assert 0 <= sampling.top_p <= 1 and 0 <= sampling.min_p <= 1 and sampling.top_k >= 0
    assert -2 <= sampling.presence_penalty <= 2 and -2 <= sampling.frequency_penalty <= 2
    penalty = sampling.repetition_penalty
    assert penalty == 0 or params.MIN_REPETITION_PENALTY <= round(penalty, 6) <= params.MAX_REPETITION_PENALTY
    assert 0 <= stopping.max_new_tokens <= params.MAX_INT32  # 0: the rest of the context
    assert 0 <= stopping.min_new_tokens <= (stopping.max_new_tokens or params.MAX_INT32)
    assert len(sampling.logit_bias) <= params.MAX_LOGIT_BIAS_ENTRIES
    assert all(0 <= t <= params.MAX_INT32 and -100 <= b <= 100 for t, b in sampling.logit_bias.items())
    assert len(stopping.stop) <= params.MAX_STOP_STRINGS
    assert all(0 < len(s) <= params.MAX_STOP_CHARS for s in stopping.stop)
    assert len(stopping.stop_token_ids) <= params.MAX_STOP_TOKEN_IDS
    assert all(t >= 0 for t in stopping.stop_token_ids)
    sampling.SerializeToString()  # every string is text the wire can carry
    stopping.SerializeToString()


def check_refusal(exc: params.ParamError, names: set[str], where: str) -> None:
    assert isinstance(exc.message, str) and exc.message
    assert exc.param is None or exc.param.removeprefix(where).split("[")[0].split(".")[0] in names


# ----- the validator


@PROPERTY
@given(values=PARAM_VALUES)
def test_validator_gives_valid_params_or_a_param_error(values: dict[str, Any]) -> None:
    document = {"params": values}
    try:
        params.check_text(document)  # as every API does with the whole document first
        sampling, stopping = params.generation_params(values, SETTINGS.default_temperature, where="params.")
    except params.ParamError as exc:
        check_refusal(exc, set(values) | {"params"}, "params.")
        return
    check_valid(sampling, stopping)
    top_p = values.get("top_p")
    if top_p is not None:  # a top_p given is never read as off
        assert sampling.top_p > 0
    if values.get("temperature") is not None:
        assert sampling.temperature == pytest.approx(values["temperature"], rel=1e-6, abs=1e-30)


@PROPERTY
@given(document=st.dictionaries(st.sampled_from(sorted(params.GENERATION_KEYS)), JSON_VALUES, max_size=6))
def test_validator_takes_any_json_values(document: dict[str, Any]) -> None:
    raw = json.dumps(document)  # what the wire carries; Python's json writes NaN and Infinity too
    try:
        values = params.parse_json(raw)
        params.check_text(values)
        sampling, stopping = params.generation_params(values, SETTINGS.default_temperature)
    except params.ParamError as exc:
        check_refusal(exc, set(document), "")
        return
    check_valid(sampling, stopping)


FLOAT32 = st.floats(width=32, allow_nan=True, allow_infinity=True)
GRPC_REQUESTS = st.builds(
    gateway_pb2.PublicGenerateRequest,
    prompt=st.text(max_size=8),
    sampling=st.builds(
        common_pb2.SamplingParams,
        temperature=FLOAT32,
        top_p=FLOAT32,
        top_k=st.integers(-(2**31), 2**31 - 1),
        min_p=FLOAT32,
        repetition_penalty=FLOAT32,
        presence_penalty=FLOAT32,
        frequency_penalty=FLOAT32,
        seed=st.one_of(st.none(), st.integers(0, 2**64 - 1)),
        logprobs=st.integers(0, 2**32 - 1),
    ),
    stopping=st.builds(
        common_pb2.StoppingParams,
        max_new_tokens=st.integers(0, 2**32 - 1),
        min_new_tokens=st.integers(0, 2**32 - 1),
        stop_token_ids=st.lists(st.integers(-(2**31), 2**31 - 1), max_size=params.MAX_STOP_TOKEN_IDS + 2),
        stop=st.lists(st.text(max_size=300), max_size=params.MAX_STOP_STRINGS + 2),
        ignore_eos=st.booleans(),
    ),
)


@PROPERTY
@given(
    request=GRPC_REQUESTS,
    chat_roles=st.lists(st.sampled_from(["user", "assistant", "wizard", ""]), max_size=3),
)
def test_grpc_requests_give_valid_params_or_a_param_error(
    request: gateway_pb2.PublicGenerateRequest, chat_roles: list[str]
) -> None:
    for role in chat_roles:  # any role turns the request into a chat
        request.chat.messages.add(role=role, content="x")
    try:
        inp = grpc_api.generation_input(request)
    except params.ParamError as exc:
        assert isinstance(exc.message, str) and exc.message
        return
    check_valid(inp.sampling, inp.stopping)
    assert (inp.prompt is None) != (inp.messages is None)


# ----- the WebSocket frame handler

PROTOCOL_CODES = {
    "invalid_argument",
    "resource_exhausted",
    "unavailable",
    "deadline_exceeded",
    "unauthenticated",
}
KEY = "fuzz-key"

IDS = st.one_of(st.sampled_from(["a", "b"]), JSON_LEAVES)
MESSAGES = st.one_of(
    st.lists(
        st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "x"]), "content": TEXT}), max_size=3
    ),
    JSON_VALUES,
)
FRAME_OBJECTS = st.fixed_dictionaries(
    {},
    optional={
        "type": st.one_of(st.sampled_from(["generate", "cancel", "auth", "explode"]), JSON_LEAVES),
        "id": IDS,
        "prompt": st.one_of(TEXT, JSON_VALUES),
        "messages": MESSAGES,
        "params": st.one_of(PARAM_VALUES, JSON_VALUES),
        "token": st.one_of(st.just(KEY), JSON_LEAVES),
        "traceparent": JSON_LEAVES,
        "extra": JSON_VALUES,
    },
)
# Well-formed generates whose params are fuzzed, so that the params reach the validator.
GENERATES = st.builds(
    lambda frame_id, values: {"type": "generate", "id": frame_id, "prompt": "x", "params": values},
    st.sampled_from(["a", "b", "c"]),
    PARAM_VALUES,
)
TEXT_FRAMES = st.one_of(
    GENERATES.map(json.dumps),
    FRAME_OBJECTS.map(json.dumps),
    JSON_VALUES.map(json.dumps),
    st.text(max_size=40),  # anything at all, JSON or not
)
MESSAGES_IN = st.one_of(
    TEXT_FRAMES.map(lambda text: {"type": "websocket.receive", "text": text}),
    st.binary(max_size=40).map(lambda data: {"type": "websocket.receive", "bytes": data}),
)


class FakeSocket:
    """The part of starlette's WebSocket that `SocketSession` uses: hands out `incoming`, then a
    disconnect; records what the session sends and how it closes."""

    def __init__(self, incoming: list[dict[str, Any]], headers: dict[str, str]) -> None:
        self.headers = headers
        self._incoming = deque(incoming)
        self.sent: list[dict[str, Any]] = []
        self.close_code: int | None = None

    async def accept(self) -> None:
        pass

    async def receive(self) -> dict[str, Any]:
        if self._incoming:
            return self._incoming.popleft()
        return {"type": "websocket.disconnect", "code": 1000}

    async def send_text(self, text: str) -> None:
        self.sent.append(json.loads(text))

    async def close(self, code: int = 1000, reason: str | None = None) -> None:
        self.close_code = code


@pytest.fixture
async def stack(upstreams: FakeUpstreams) -> AsyncIterator[tuple[Pipeline, GatewaySettings]]:
    """A pipeline to the fake services, shared by every example of a test."""
    settings = gateway_settings(upstreams, ws_max_in_flight=2)
    pipeline = Pipeline(settings, GatewayMetrics())
    yield pipeline, settings
    await pipeline.close()


@settings(
    max_examples=150,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(incoming=st.lists(MESSAGES_IN, min_size=1, max_size=4), keys_on=st.booleans())
async def test_frame_handler_answers_every_frame_with_an_error_or_proceeds(
    stack: tuple[Pipeline, GatewaySettings], incoming: list[dict[str, Any]], keys_on: bool
) -> None:
    pipeline, settings = stack
    socket = FakeSocket(incoming, {})
    session = SocketSession(socket, pipeline, settings, ApiKeys([KEY] if keys_on else []))  # type: ignore[arg-type]
    await asyncio.wait_for(session.run(), WAIT_S)  # never a hang, never an exception
    for frame in socket.sent:
        assert frame["type"] in ("delta", "done", "error")
        if frame["type"] == "error":
            assert frame["code"] in PROTOCOL_CODES and frame["message"]
            assert frame["id"] is None or isinstance(frame["id"], str | int)
    if socket.close_code is not None:
        assert socket.close_code == 1008 and keys_on
        assert [f["code"] for f in socket.sent] == ["unauthenticated"]
    assert pipeline.in_flight == 0  # the disconnect cancelled whatever started
