"""Bad input, table by table, against one real stack: the WebSocket API, the OpenAI HTTP API, the
public gRPC API, and the tokenizer, engine and detokenizer called directly. Every case gets its
documented error (WebSocket `error` frame code or close code, HTTP status and OpenAI error body, gRPC
status code); while the cases run, good greedy requests on every API keep completing with exactly the
text a lone run gave, and afterwards every service is SERVING with nothing left running.

Where an error comes from (see docs/reliability.md): gateway/params.py validates the three public
APIs alike; gateway/openai_api.py answers 400/404/405/413 with OpenAI-style JSON; gateway/ws.py answers
an `error` frame (the socket goes on), and the server library closes a socket with 1009 (frame over
--max-ws-frame-bytes) or 1007 (a text frame that is not UTF-8); gRPC itself answers RESOURCE_EXHAUSTED
for a message over the public API's cap (--max-body-bytes, as HTTP) or 64 MiB inside; the services
answer INVALID_ARGUMENT for input they cannot serve, or an error final on their multiplexed streams
(services/*/servicer.py).
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import grpc
import httpx
import pytest
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import connect as sync_connect

from services.common.pb import (
    common_pb2,
    detokenizer_pb2,
    detokenizer_pb2_grpc,
    engine_pb2,
    engine_pb2_grpc,
    gateway_pb2,
    gateway_pb2_grpc,
    tokenizer_pb2,
    tokenizer_pb2_grpc,
)
from tests.reliability.conftest import WAIT_S, RealStack, sse_texts

pytestmark = pytest.mark.e2e

GOOD_PARAMS = {"temperature": 0, "max_tokens": 12, "ignore_eos": True}
GOOD_PROMPTS = ("Once upon a time", "The river ran under the old stone bridge", "red blue green")
BIG_PROMPT_CHARS = 1024 * 1024  # far over the context in tokens, under the 4 MiB body cap
BIG_WS_PROMPT_CHARS = 900 * 1024  # a frame under the 1 MiB cap
NESTED = "[" * 100_000 + "]" * 100_000
MANY_STOPS = [f"stop{i}" for i in range(1000)]
CORRUPT = b"\xff\xff\xff\xff"  # not a protobuf: a field with a truncated varint tag
NOT_UTF8 = b"\xed\xa0\xbd"  # the CESU-8 bytes of a lone surrogate: not UTF-8


def _field_bytes(number: int, payload: bytes) -> bytes:
    """A length-delimited protobuf field (small field numbers and payloads only)."""
    assert number < 16 and len(payload) < 128
    return bytes([number << 3 | 2, len(payload)]) + payload


def case(case_id: str, *values: Any, marks: Any = ()) -> Any:
    """One row of a table: its id first, for reading."""
    return pytest.param(*values, id=case_id, marks=marks)


# ---------------------------------------------------------------------------------------------- fixtures


@dataclass(frozen=True)
class Prompts:
    """Prompts sized against the model's context length (in tokens, BOS included)."""

    context_length: int
    at_context: str  # exactly the context length: the tokenizer passes it, the engine refuses it
    over_context: str  # the context length + 8: the tokenizer refuses it

    def ids_at_context(self) -> list[int]:
        return [5] * self.context_length


def _count(stub: tokenizer_pb2_grpc.TokenizerStub, text: str) -> int:
    return len(stub.Tokenize(tokenizer_pb2.TokenizeRequest(text=text), timeout=WAIT_S).ids)


@pytest.fixture(scope="module")
def prompts(real_stack: RealStack) -> Prompts:
    with grpc.insecure_channel(real_stack.address("tokenizer")) as channel:
        stub = tokenizer_pb2_grpc.TokenizerStub(channel)
        context = stub.Info(tokenizer_pb2.InfoRequest(), timeout=WAIT_S).context_length

        def words(n: int) -> str:
            return "hello" + " hello" * (n - 1)

        per_word = _count(stub, words(33)) - _count(stub, words(32))
        assert per_word == 1, "one token per ' hello' in the tiny model's vocabulary"
        n_at = context - (_count(stub, words(32)) - 32)
        assert _count(stub, words(n_at)) == context
        return Prompts(context, words(n_at), words(n_at + 8))


@dataclass
class GoodTraffic:
    """Good greedy requests on every public API, run by threads until `stop()`; each text is compared
    with the lone, non-streamed run of the same request."""

    stack: RealStack
    references: dict[str, str]
    completed: dict[str, int] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _threads: list[threading.Thread] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def start(self) -> None:
        for api, run in (("http", self._http), ("sse", self._sse), ("ws", self._ws), ("grpc", self._grpc)):
            thread = threading.Thread(target=self._loop, args=(api, run), name=f"good-{api}", daemon=True)
            thread.start()
            self._threads.append(thread)

    def stop(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(2 * WAIT_S)
            assert not thread.is_alive(), f"{thread.name} did not stop"

    def _loop(self, api: str, run: Callable[[str], str]) -> None:
        i = 0
        while not self._stop.is_set():
            prompt = GOOD_PROMPTS[i % len(GOOD_PROMPTS)]
            i += 1
            try:
                text = run(prompt)
            except Exception as exc:
                self._record(api, f"{api} {prompt!r} failed: {exc!r}")
                continue
            expected = self.references[prompt]
            self._record(api, None if text == expected else f"{api} {prompt!r}: {text!r} != {expected!r}")

    def _record(self, api: str, problem: str | None) -> None:
        with self._lock:
            if problem is None:
                self.completed[api] = self.completed.get(api, 0) + 1
            else:
                self.problems.append(problem)

    def _http(self, prompt: str) -> str:
        return complete(self.stack, prompt)

    def _sse(self, prompt: str) -> str:
        body = {"model": self.stack.model, "prompt": prompt, "stream": True, **GOOD_PARAMS}
        with httpx.stream(
            "POST", f"{self.stack.http_url}/v1/completions", json=body, timeout=WAIT_S
        ) as reply:
            assert reply.status_code == 200, reply.read()
            text, events = sse_texts(list(reply.iter_lines()))
        assert events[-1]["choices"][0]["finish_reason"] == "length"
        return text

    def _ws(self, prompt: str) -> str:
        with sync_connect(self.stack.ws_url, open_timeout=WAIT_S) as ws:
            ws.send(json.dumps({"type": "generate", "id": "g", "prompt": prompt, "params": GOOD_PARAMS}))
            text = ""
            while (frame := json.loads(ws.recv(timeout=WAIT_S)))["type"] == "delta":
                text += frame["text"]
        assert frame["type"] == "done" and frame["finish_reason"] == "length", frame
        return text

    def _grpc(self, prompt: str) -> str:
        request = gateway_pb2.PublicGenerateRequest(
            prompt=prompt,
            sampling=common_pb2.SamplingParams(temperature=0),
            stopping=common_pb2.StoppingParams(max_new_tokens=GOOD_PARAMS["max_tokens"], ignore_eos=True),
        )
        with grpc.insecure_channel(self.stack.address("gateway")) as channel:
            replies = list(gateway_pb2_grpc.GatewayStub(channel).Generate(request, timeout=WAIT_S))
        assert replies[-1].final.finish_reason == common_pb2.FINISH_REASON_LENGTH
        return "".join(r.delta.text for r in replies if r.WhichOneof("kind") == "delta")


def complete(stack: RealStack, prompt: str) -> str:
    """The text of one non-streamed greedy completion."""
    body = {"model": stack.model, "prompt": prompt, **GOOD_PARAMS}
    reply = httpx.post(f"{stack.http_url}/v1/completions", json=body, timeout=WAIT_S)
    assert reply.status_code == 200, reply.text
    return reply.json()["choices"][0]["text"]


@pytest.fixture(scope="module")
def good_traffic(real_stack: RealStack) -> Iterator[GoodTraffic]:
    """Started before the first case (after lone reference runs), stopped by the last test."""
    references = {prompt: complete(real_stack, prompt) for prompt in GOOD_PROMPTS}
    traffic = GoodTraffic(real_stack, references)
    traffic.start()
    yield traffic
    traffic.stop()


@pytest.fixture(autouse=True)
def _traffic_runs(good_traffic: GoodTraffic) -> None:
    """Every case of this module runs while the good traffic does."""


# ---------------------------------------------------------------------------------------------- WebSocket


@dataclass(frozen=True)
class WsError:
    """An `error` frame with this code and echoed id; the socket then serves a good request."""

    code: str = "invalid_argument"
    id: str | int | None = "a"
    message_has: str = ""


@dataclass(frozen=True)
class WsClosed:
    """The server closes the socket with this code."""

    code: int


Frames = Callable[[Prompts], list[str | bytes | tuple[bytes, bool]]]  # (bytes, True) = a text frame


def gen(prompt: Any = "hi", **extra: Any) -> str:
    """A generate frame with id "a"."""
    return json.dumps({"type": "generate", "id": "a", "prompt": prompt, **extra})


def chat_frame(role: str) -> str:
    return json.dumps({"type": "generate", "id": "a", "messages": [{"role": role, "content": "hi"}]})


def gen_params(**params: Any) -> str:
    return gen(params={"max_tokens": 4, **params})


WS_CASES = [
    case("ws-malformed-json", lambda p: ['{"type": "generate", "id": "a",'], WsError(id=None)),
    case("ws-not-an-object", lambda p: ["[1, 2, 3]"], WsError(id=None, message_has="object")),
    case("ws-binary-frame", lambda p: [b"\x00\x01binary"], WsError(id=None, message_has="binary")),
    case("ws-deeply-nested-json", lambda p: [NESTED], WsError(id=None, message_has="nested")),
    case("ws-missing-id", lambda p: ['{"type": "generate", "prompt": "hi"}'], WsError(id=None)),
    case("ws-id-wrong-type", lambda p: ['{"type": "generate", "id": 7, "prompt": "hi"}'], WsError(id=7)),
    case("ws-unknown-type", lambda p: ['{"type": "summon", "id": "a"}'], WsError()),
    case("ws-prompt-and-messages", lambda p: [gen(messages=[{"role": "user", "content": "hi"}])], WsError()),
    case("ws-prompt-wrong-type", lambda p: [gen(42)], WsError(message_has="prompt")),
    case("ws-params-wrong-type", lambda p: [gen(params="hot")], WsError(message_has="params")),
    case("ws-unknown-param", lambda p: [gen_params(warp=9)], WsError(message_has="warp")),
    case("ws-empty-prompt", lambda p: [gen("")], WsError(message_has="empty")),
    case("ws-lone-surrogate-prompt", lambda p: ['{"type": "generate", "id": "a", "prompt": "\\ud83d"}'],
         WsError(message_has="surrogate")),
    case("ws-lone-surrogate-stop",
         lambda p: ['{"type": "generate", "id": "a", "prompt": "hi", "params": {"stop": ["\\udc00"]}}'],
         WsError(message_has="surrogate")),
    case("ws-lone-surrogate-id", lambda p: ['{"type": "generate", "id": "\\ud83d", "prompt": "hi"}'],
         WsError(id=None, message_has="surrogate")),
    case("ws-unknown-chat-role", lambda p: [chat_frame("wizard")], WsError(message_has="role")),
    case("ws-temperature-3", lambda p: [gen_params(temperature=3)], WsError(message_has="temperature")),
    case("ws-top-p-0", lambda p: [gen_params(top_p=0)], WsError(message_has="top_p")),
    case("ws-max-tokens-negative", lambda p: [gen_params(max_tokens=-1)], WsError(message_has="max_tokens")),
    case("ws-seed-negative", lambda p: [gen_params(seed=-1)], WsError(message_has="seed")),
    case("ws-1000-stop-strings", lambda p: [gen_params(stop=MANY_STOPS)], WsError(message_has="stop")),
    case("ws-stop-string-too-long", lambda p: [gen_params(stop=["x" * 300])], WsError(message_has="stop")),
    case("ws-prompt-over-context", lambda p: [gen(p.over_context)], WsError(message_has="context")),
    case("ws-prompt-at-context", lambda p: [gen(p.at_context)], WsError(message_has="context")),
    case("ws-oversized-prompt", lambda p: [gen("x " * (BIG_WS_PROMPT_CHARS // 2))],
         WsError(message_has="context")),
    case("ws-oversized-frame", lambda p: [gen("x" * (1024 * 1024 + 16))], WsClosed(1009)),
    case("ws-invalid-utf8-text-frame",
         lambda p: [(b'{"type": "generate", "id": "a", "prompt": "\xff\xfe"}', True)],
         WsClosed(1007)),
]  # fmt: skip


async def ws_recv(ws: ClientConnection) -> dict[str, Any]:
    return json.loads(await asyncio.wait_for(ws.recv(), WAIT_S))


async def ws_good_after(ws: ClientConnection) -> None:
    """The socket still serves: a good request on it completes."""
    await ws.send(
        json.dumps({"type": "generate", "id": "after", "prompt": "hi", "params": {"max_tokens": 2}})
    )
    while (frame := await ws_recv(ws))["type"] == "delta":
        assert frame["id"] == "after"
    assert frame["type"] == "done" and frame["id"] == "after", frame


@pytest.mark.parametrize(("frames", "expected"), WS_CASES)
async def test_websocket(
    real_stack: RealStack, prompts: Prompts, frames: Frames, expected: WsError | WsClosed
) -> None:
    async with connect(real_stack.ws_url, max_size=None, open_timeout=WAIT_S) as ws:
        for frame in frames(prompts):
            if isinstance(frame, tuple):
                await ws.send(frame[0], text=frame[1])
            else:
                await ws.send(frame)
        if isinstance(expected, WsClosed):
            with pytest.raises(ConnectionClosed) as closed:
                await ws_recv(ws)
            assert closed.value.rcvd is not None and closed.value.rcvd.code == expected.code
            return
        reply = await ws_recv(ws)
        assert reply["type"] == "error" and reply["code"] == expected.code, reply
        assert reply["id"] == expected.id, reply
        assert expected.message_has in reply["message"], reply
        await ws_good_after(ws)


async def test_websocket_id_reused_in_flight(real_stack: RealStack) -> None:
    """A generate reusing an id in flight is refused with that id; the first generation goes on."""
    params = {"max_tokens": 64, "temperature": 0, "ignore_eos": True}
    async with connect(real_stack.ws_url, open_timeout=WAIT_S) as ws:
        await ws.send(json.dumps({"type": "generate", "id": "dup", "prompt": "Once upon", "params": params}))
        await ws.send(json.dumps({"type": "generate", "id": "dup", "prompt": "again", "params": params}))
        frames = []
        while not frames or frames[-1]["type"] not in ("done",):
            frames.append(await ws_recv(ws))
    errors = [f for f in frames if f["type"] == "error"]
    assert len(errors) == 1 and errors[0]["id"] == "dup" and errors[0]["code"] == "invalid_argument"
    assert "in flight" in errors[0]["message"]
    done = frames[-1]
    assert done["id"] == "dup" and done["finish_reason"] == "length"
    assert done["usage"]["completion_tokens"] == 64


# ---------------------------------------------------------------------------------------------- OpenAI HTTP


@dataclass(frozen=True)
class Http:
    """A POST (or `method`) and the OpenAI error it must get."""

    path: str
    body: Callable[[Prompts, str], dict[str, Any] | bytes]  # (prompts, model) → JSON object or raw bytes
    status: int = 400
    param: str | None = None
    code: str | None = None
    message_has: str = ""
    method: str = "POST"


def completion(**fields: Any) -> Callable[[Prompts, str], dict[str, Any]]:
    return lambda p, model: {"model": model, "prompt": "hi", "max_tokens": 4, **fields}


def chat(**fields: Any) -> Callable[[Prompts, str], dict[str, Any]]:
    messages = [{"role": "user", "content": "hi"}]
    return lambda p, model: {"model": model, "messages": messages, "max_tokens": 4, **fields}


def raw(data: bytes) -> Callable[[Prompts, str], bytes]:
    return lambda p, model: data


CMPL, CHAT = "/v1/completions", "/v1/chat/completions"

HTTP_CASES = [
    case("http-malformed-json", Http(CMPL, raw(b'{"prompt": "hi",'), message_has="JSON")),
    case("http-not-an-object", Http(CMPL, raw(b"[1, 2]"), message_has="object")),
    case("http-invalid-utf8", Http(CMPL, raw(b'{"prompt": "\xff\xfe"}'), message_has="JSON")),
    case("http-deeply-nested-json", Http(CMPL, raw(NESTED.encode()), message_has="nested")),
    case("http-lone-surrogate-prompt", Http(CMPL, raw(b'{"prompt": "\\ud83d"}'), param="prompt")),
    case("http-lone-surrogate-message",
         Http(CHAT, raw(b'{"messages": [{"role": "user", "content": "\\udc00"}]}'),
              param="messages[0].content")),
    case("http-lone-surrogate-stop",
         Http(CMPL, raw(b'{"prompt": "hi", "stop": ["\\ud83d"]}'), param="stop[0]")),
    case("http-prompt-wrong-type", Http(CMPL, completion(prompt=42), param="prompt")),
    case("http-messages-wrong-type", Http(CHAT, chat(messages="hi"), param="messages")),
    case("http-max-tokens-wrong-type", Http(CMPL, completion(max_tokens="ten"), param="max_tokens")),
    case("http-stream-wrong-type", Http(CMPL, completion(stream="yes"), param="stream")),
    case("http-empty-prompt", Http(CMPL, completion(prompt=""), message_has="empty")),
    case("http-empty-messages", Http(CHAT, chat(messages=[]), param="messages")),
    case("http-unknown-chat-role",
         Http(CHAT, chat(messages=[{"role": "wizard", "content": "hi"}]), param="messages[0]")),
    case("http-temperature-2.5", Http(CMPL, completion(temperature=2.5), param="temperature")),
    case("http-temperature-nan",
         Http(CMPL, raw(b'{"prompt": "hi", "temperature": NaN}'), param="temperature")),
    case("http-top-p-0", Http(CMPL, completion(top_p=0), param="top_p")),
    case("http-top-p-1.5", Http(CMPL, completion(top_p=1.5), param="top_p")),
    case("http-top-k-negative", Http(CMPL, completion(top_k=-2), param="top_k")),
    case("http-min-p-1.5", Http(CMPL, completion(min_p=1.5), param="min_p")),
    case("http-presence-penalty-3", Http(CMPL, completion(presence_penalty=3), param="presence_penalty")),
    case("http-repetition-penalty-negative",
         Http(CMPL, completion(repetition_penalty=-1), param="repetition_penalty")),
    case("http-seed-negative", Http(CMPL, completion(seed=-1), param="seed")),
    case("http-max-tokens-0", Http(CMPL, completion(max_tokens=0), param="max_tokens")),
    case("http-min-tokens-over-max", Http(CMPL, completion(min_tokens=9, max_tokens=4), param="min_tokens")),
    case("http-logprobs-6", Http(CMPL, completion(logprobs=6), param="logprobs")),
    case("http-top-logprobs-21", Http(CHAT, chat(logprobs=True, top_logprobs=21), param="top_logprobs")),
    case("http-1000-stop-strings", Http(CMPL, completion(stop=MANY_STOPS), param="stop")),
    case("http-stop-string-too-long", Http(CMPL, completion(stop=["x" * 300]), param="stop")),
    case("http-n-129", Http(CMPL, completion(n=129), param="n")),
    case("http-tools", Http(CHAT, chat(tools=[{"type": "function"}]), param="tools[0].function")),
    case("http-unknown-model",
         Http(CMPL, completion(model="no-such-model"), status=404, param="model", code="model_not_found")),
    case("http-prompt-over-context",
         Http(CMPL, lambda p, m: {"prompt": p.over_context}, message_has="context")),
    case("http-prompt-at-context", Http(CMPL, lambda p, m: {"prompt": p.at_context}, message_has="context")),
    case("http-prompt-at-context-streamed",
         Http(CMPL, lambda p, m: {"prompt": p.at_context, "stream": True}, message_has="context")),
    case("http-chat-over-context",
         Http(CHAT, lambda p, m: {"messages": [{"role": "user", "content": p.over_context}]},
              message_has="context")),
    case("http-oversized-prompt",
         Http(CMPL, completion(prompt="x " * (BIG_PROMPT_CHARS // 2)), message_has="context")),
    case("http-body-12mib",
         Http(CMPL, raw(b'{"prompt": "' + b"x" * (12 * 1024 * 1024) + b'"}'), status=413,
              code="request_too_large")),
    case("http-get-completions", Http(CMPL, raw(b""), status=405, method="GET")),
]  # fmt: skip


@pytest.mark.parametrize("case", HTTP_CASES)
async def test_openai_http(real_stack: RealStack, prompts: Prompts, case: Http) -> None:
    body = case.body(prompts, real_stack.model)
    if isinstance(body, dict):
        body = {"model": real_stack.model, **body}
    async with httpx.AsyncClient(base_url=real_stack.http_url, timeout=WAIT_S) as client:
        if isinstance(body, bytes):
            headers = {"content-type": "application/json"}
            reply = await client.request(case.method, case.path, content=body, headers=headers)
        else:
            reply = await client.request(case.method, case.path, json=body)
    assert reply.status_code == case.status, reply.text[:500]
    assert reply.headers["content-type"].startswith("application/json")
    error = reply.json()["error"]
    assert isinstance(error["message"], str) and error["message"] and isinstance(error["type"], str)
    if case.param is not None:
        assert error["param"] == case.param, error
    assert error["code"] == case.code, error
    assert case.message_has in error["message"], error


# ---------------------------------------------------------------------------------------------- gRPC calls


@dataclass(frozen=True)
class Rpc:
    """A call on a service's stub and the status it must end with."""

    service: str
    call: Callable[[grpc.aio.Channel, Prompts], Awaitable[Any]]
    status: grpc.StatusCode = grpc.StatusCode.INVALID_ARGUMENT
    details_has: str = ""


P, SP, ST = gateway_pb2.PublicGenerateRequest, common_pb2.SamplingParams, common_pb2.StoppingParams
Conv, Msg = common_pb2.Conversation, common_pb2.ChatMessage


def public(make: Callable[[Prompts], gateway_pb2.PublicGenerateRequest]) -> Callable[..., Awaitable[Any]]:
    async def call(channel: grpc.aio.Channel, p: Prompts) -> list[Any]:
        return [r async for r in gateway_pb2_grpc.GatewayStub(channel).Generate(make(p), timeout=WAIT_S)]

    return call


def tokenize(
    request: tokenizer_pb2.TokenizeRequest | Callable[[Prompts], Any],
) -> Callable[..., Awaitable[Any]]:
    async def call(channel: grpc.aio.Channel, p: Prompts) -> Any:
        message = request(p) if callable(request) else request
        return await tokenizer_pb2_grpc.TokenizerStub(channel).Tokenize(message, timeout=WAIT_S)

    return call


def generate(make: Callable[[Prompts], engine_pb2.GenerateRequest]) -> Callable[..., Awaitable[Any]]:
    async def call(channel: grpc.aio.Channel, p: Prompts) -> list[Any]:
        return [r async for r in engine_pb2_grpc.EngineStub(channel).Generate(make(p), timeout=WAIT_S)]

    return call


def decode(ids: list[int]) -> Callable[..., Awaitable[Any]]:
    async def call(channel: grpc.aio.Channel, p: Prompts) -> Any:
        request = detokenizer_pb2.DecodeRequest(ids=ids)
        return await detokenizer_pb2_grpc.DetokenizerStub(channel).Decode(request, timeout=WAIT_S)

    return call


def raw_unary(method: str, data: bytes, *, streamed_reply: bool = False) -> Callable[..., Awaitable[Any]]:
    """`data` as the request of `method`, bypassing the client's own protobuf encoding."""

    async def call(channel: grpc.aio.Channel, p: Prompts) -> Any:
        if streamed_reply:
            return [r async for r in channel.unary_stream(method)(data, timeout=WAIT_S)]
        return await channel.unary_unary(method)(data, timeout=WAIT_S)

    return call


def raw_stream(method: str, *messages: bytes) -> Callable[..., Awaitable[Any]]:
    """`messages` on a client-streaming `method`, then a half-close; the replies."""

    async def call(channel: grpc.aio.Channel, p: Prompts) -> list[Any]:
        return [r async for r in channel.stream_stream(method)(iter(messages), timeout=WAIT_S)]

    return call


def engine_request(**fields: Any) -> Callable[[Prompts], engine_pb2.GenerateRequest]:
    values = {"request_id": "a", "prompt_ids": [5, 6], **fields}
    return lambda p: engine_pb2.GenerateRequest(**values)


GOOD_SUBMIT = engine_pb2.EngineIn(
    submit=engine_pb2.GenerateRequest(
        request_id="g", prompt_ids=[5, 6], stopping=ST(max_new_tokens=3, ignore_eos=True)
    )
).SerializeToString()


def gw(case_id: str, make: Callable[[Prompts], Any], details_has: str = "", **rest: Any) -> Any:
    """A case of the public gRPC API: `make(prompts)` is the PublicGenerateRequest."""
    status = rest.pop("status", grpc.StatusCode.INVALID_ARGUMENT)
    return case(case_id, Rpc("gateway", public(make), status, details_has), **rest)


def tok(case_id: str, make: Callable[[Prompts], Any], details_has: str) -> Any:
    return case(case_id, Rpc("tokenizer", tokenize(make), details_has=details_has))


def eng(case_id: str, details_has: str, **fields: Any) -> Any:
    """An engine Generate call: `fields` of the GenerateRequest, request_id "a" and prompt [5, 6] by
    default."""
    return case(case_id, Rpc("engine", generate(engine_request(**fields)), details_has=details_has))


def bad_bytes(case_id: str, service: str, call: Callable[..., Awaitable[Any]], **rest: Any) -> Any:
    return case(case_id, Rpc(service, call, details_has="malformed"), **rest)


GATEWAY_GENERATE, TOKENIZE = "/sluice.v1.Gateway/Generate", "/sluice.v1.Tokenizer/Tokenize"
RPC_CASES = [
    # The public gRPC API (the gateway's sluice.v1.Gateway).
    gw("grpc-no-input", lambda p: P(), "prompt"),
    gw("grpc-empty-prompt", lambda p: P(prompt=""), "empty"),
    gw("grpc-empty-chat", lambda p: P(chat=Conv()), "message"),
    gw("grpc-unknown-chat-role", lambda p: P(chat=Conv(messages=[Msg(role="wizard", content="x")])), "role"),
    gw("grpc-temperature-3", lambda p: P(prompt="hi", sampling=SP(temperature=3)), "temperature"),
    gw("grpc-top-p-nan", lambda p: P(prompt="hi", sampling=SP(top_p=float("nan"))), "top_p"),
    gw("grpc-top-p-1.5", lambda p: P(prompt="hi", sampling=SP(top_p=1.5)), "top_p"),
    gw("grpc-logprobs-21", lambda p: P(prompt="hi", sampling=SP(logprobs=21)), "logprobs"),
    gw("grpc-1000-stop-strings", lambda p: P(prompt="hi", stopping=ST(stop=MANY_STOPS)), "stop"),
    gw("grpc-stop-string-too-long", lambda p: P(prompt="hi", stopping=ST(stop=["x" * 300])), "stop"),
    gw("grpc-min-tokens-over-max", lambda p: P(prompt="hi", stopping=ST(min_new_tokens=9, max_new_tokens=2)),
       "min_tokens"),
    gw("grpc-stop-token-id-negative", lambda p: P(prompt="hi", stopping=ST(stop_token_ids=[-1])),
       "stop_token_ids"),
    gw("grpc-stop-token-id-outside-vocabulary",
       lambda p: P(prompt="hi", stopping=ST(stop_token_ids=[1 << 30])), "stop_token_ids"),
    gw("grpc-prompt-over-context", lambda p: P(prompt=p.over_context), "context"),
    gw("grpc-prompt-at-context", lambda p: P(prompt=p.at_context), "context"),
    gw("grpc-message-over-the-body-cap", lambda p: P(prompt="x" * (4 * 1024 * 1024 + 16)),
       status=grpc.StatusCode.RESOURCE_EXHAUSTED),
    bad_bytes("grpc-malformed-protobuf", "gateway",
              raw_unary(GATEWAY_GENERATE, CORRUPT, streamed_reply=True)),
    bad_bytes("grpc-prompt-not-utf8", "gateway",
              raw_unary(GATEWAY_GENERATE, _field_bytes(2, NOT_UTF8), streamed_reply=True)),
    # The tokenizer, directly.
    tok("tokenizer-no-input", lambda p: tokenizer_pb2.TokenizeRequest(), "empty"),
    tok("tokenizer-empty-text", lambda p: tokenizer_pb2.TokenizeRequest(text=""), "empty"),
    tok("tokenizer-empty-chat", lambda p: tokenizer_pb2.TokenizeRequest(chat=Conv()), "messages"),
    tok("tokenizer-unknown-truncation-side",
        lambda p: tokenizer_pb2.TokenizeRequest(text="hi", truncation_side=7), "truncation_side"),
    tok("tokenizer-text-over-context", lambda p: tokenizer_pb2.TokenizeRequest(text=p.over_context),
        "context"),
    bad_bytes("tokenizer-malformed-protobuf", "tokenizer", raw_unary(TOKENIZE, CORRUPT)),
    bad_bytes("tokenizer-text-not-utf8", "tokenizer", raw_unary(TOKENIZE, _field_bytes(2, NOT_UTF8))),
    bad_bytes("tokenizer-stream-malformed-protobuf", "tokenizer",
              raw_stream("/sluice.v1.Tokenizer/TokenizeStream", CORRUPT)),
    # The engine, directly.
    eng("engine-id-outside-vocabulary", "vocabulary", prompt_ids=[5, 1 << 20]),
    eng("engine-negative-id", "vocabulary", prompt_ids=[5, -1]),
    eng("engine-empty-prompt", "empty", prompt_ids=[]),
    eng("engine-empty-request-id", "request_id", request_id=""),
    case("engine-prompt-at-context", Rpc("engine", generate(lambda p: engine_pb2.GenerateRequest(
        request_id="a", prompt_ids=p.ids_at_context())), details_has="context")),
    eng("engine-top-p-2", "top_p", sampling=SP(top_p=2)),
    eng("engine-temperature-nan", "temperature", sampling=SP(temperature=float("nan"))),
    eng("engine-logprobs-21", "logprobs", sampling=SP(logprobs=21)),
    eng("engine-repetition-penalty-negative", "repetition_penalty", sampling=SP(repetition_penalty=-1)),
    eng("engine-stop-token-id-negative", "stop_token_ids", stopping=ST(stop_token_ids=[-3])),
    eng("engine-stop-token-id-outside-vocabulary", "stop_token_ids", stopping=ST(stop_token_ids=[1 << 30])),
    bad_bytes("engine-malformed-protobuf", "engine",
              raw_unary("/sluice.v1.Engine/Generate", CORRUPT, streamed_reply=True)),
    bad_bytes("engine-stream-malformed-protobuf", "engine",
              raw_stream("/sluice.v1.Engine/Stream", GOOD_SUBMIT, CORRUPT)),
    # The detokenizer, directly.
    case("detokenizer-id-outside-vocabulary",
         Rpc("detokenizer", decode([5, 1 << 20]), details_has="vocabulary")),
    case("detokenizer-negative-id", Rpc("detokenizer", decode([-5]), details_has="vocabulary")),
    bad_bytes("detokenizer-malformed-protobuf", "detokenizer",
              raw_unary("/sluice.v1.Detokenizer/Decode", CORRUPT)),
    bad_bytes("detokenizer-stream-malformed-protobuf", "detokenizer",
              raw_stream("/sluice.v1.Detokenizer/Stream", CORRUPT)),
]  # fmt: skip


@pytest.mark.parametrize("case", RPC_CASES)
async def test_grpc(real_stack: RealStack, prompts: Prompts, case: Rpc) -> None:
    async with grpc.aio.insecure_channel(real_stack.address(case.service)) as channel:
        with pytest.raises(grpc.aio.AioRpcError) as failed:
            await case.call(channel, prompts)
    assert failed.value.code() == case.status, failed.value.details()
    assert case.details_has in (failed.value.details() or ""), failed.value.details()


# ---------------------------------------------------------------------------------------------- streams


class Duplex:
    """A bidirectional call driven message by message."""

    def __init__(self, call_factory: Callable[[AsyncIterator[Any]], Any]) -> None:
        self._queue: asyncio.Queue[Any] = asyncio.Queue()
        self.call = call_factory(self._messages())

    async def _messages(self) -> AsyncIterator[Any]:
        while (message := await self._queue.get()) is not None:
            yield message

    def send(self, message: Any) -> None:
        self._queue.put_nowait(message)

    async def read(self) -> Any:
        reply = await asyncio.wait_for(self.call.read(), WAIT_S)
        assert reply is not grpc.aio.EOF, "the call ended early"
        return reply

    async def close(self) -> grpc.StatusCode:
        self._queue.put_nowait(None)
        while await asyncio.wait_for(self.call.read(), WAIT_S) is not grpc.aio.EOF:
            pass
        return await self.call.code()


def submit(request_id: str, ids: list[int], max_new_tokens: int = 3) -> engine_pb2.EngineIn:
    stopping = ST(max_new_tokens=max_new_tokens, ignore_eos=True)
    return engine_pb2.EngineIn(
        submit=engine_pb2.GenerateRequest(request_id=request_id, prompt_ids=ids, stopping=stopping)
    )


async def engine_finals(stream: Duplex, want: set[str]) -> dict[str, engine_pb2.RequestFinal]:
    """Reads the engine stream until every id in `want` has its final; token counts are checked."""
    finals: dict[str, engine_pb2.RequestFinal] = {}
    while not want <= finals.keys():
        for entry in (await stream.read()).entries:
            if entry.WhichOneof("kind") == "final":
                finals[entry.final.request_id] = entry.final
    return finals


async def engine_bad_submit_then_good(stack: RealStack) -> None:
    """A submit with ids outside the vocabulary gets an invalid_argument error final; the call goes on."""
    async with grpc.aio.insecure_channel(stack.address("engine")) as channel:
        stream = Duplex(engine_pb2_grpc.EngineStub(channel).Stream)
        stream.send(submit("bad", [5, 1 << 20]))
        stream.send(submit("good", [5, 6]))
        finals = await engine_finals(stream, {"bad", "good"})
        assert finals["bad"].finish_reason == common_pb2.FINISH_REASON_ERROR
        assert finals["bad"].error_code == common_pb2.ERROR_CODE_INVALID_ARGUMENT
        assert "vocabulary" in finals["bad"].error
        assert finals["good"].finish_reason == common_pb2.FINISH_REASON_LENGTH
        assert finals["good"].usage.completion_tokens == 3
        assert await stream.close() == grpc.StatusCode.OK


async def engine_id_reused_in_flight(stack: RealStack) -> None:
    """A submit reusing an id in flight gets an error final; the first request completes."""
    async with grpc.aio.insecure_channel(stack.address("engine")) as channel:
        stream = Duplex(engine_pb2_grpc.EngineStub(channel).Stream)
        stream.send(submit("dup", [5, 6], max_new_tokens=40))
        stream.send(submit("dup", [7]))
        tokens, finals = 0, []
        while not finals or finals[-1].finish_reason == common_pb2.FINISH_REASON_ERROR:
            for entry in (await stream.read()).entries:
                if entry.WhichOneof("kind") == "chunk":
                    tokens += len(entry.chunk.token_ids)
                else:
                    finals.append(entry.final)
        assert [f.finish_reason for f in finals] == [
            common_pb2.FINISH_REASON_ERROR,
            common_pb2.FINISH_REASON_LENGTH,
        ]
        assert "in flight" in finals[0].error and tokens == 40 == finals[1].usage.completion_tokens
        assert await stream.close() == grpc.StatusCode.OK


E = detokenizer_pb2.DetokenizeInEntry
Start, Chunk, Close = (
    detokenizer_pb2.DetokenizeStart,
    detokenizer_pb2.DetokenizeChunk,
    detokenizer_pb2.DetokenizeClose,
)


def detok_in(*entries: detokenizer_pb2.DetokenizeInEntry) -> detokenizer_pb2.DetokenizeIn:
    return detokenizer_pb2.DetokenizeIn(entries=list(entries))


def finals_of(out: detokenizer_pb2.DetokenizeOut) -> dict[str, detokenizer_pb2.DetokenizeFinal]:
    return {e.final.request_id: e.final for e in out.entries if e.WhichOneof("kind") == "final"}


def text_of(out: detokenizer_pb2.DetokenizeOut, request_id: str) -> str:
    return "".join(e.delta.text for e in out.entries if e.WhichOneof("kind") == "delta"
                   and e.delta.request_id == request_id)  # fmt: skip


async def detokenizer_bad_entries(stack: RealStack) -> None:
    """Ids outside the vocabulary (in a chunk or as prompt ids) and a chunk for an unknown request each
    get an error final; a good request on the same call decodes as Decode does."""
    async with grpc.aio.insecure_channel(stack.address("detokenizer")) as channel:
        stub = detokenizer_pb2_grpc.DetokenizerStub(channel)
        stream = Duplex(stub.Stream)
        stream.send(
            detok_in(E(start=Start(request_id="a")), E(chunk=Chunk(request_id="a", token_ids=[1 << 20])))
        )
        stream.send(detok_in(E(chunk=Chunk(request_id="nobody", token_ids=[5]))))
        stream.send(detok_in(E(start=Start(request_id="b", prompt_ids=[-1]))))
        stream.send(
            detok_in(
                E(start=Start(request_id="c")),
                E(chunk=Chunk(request_id="c", token_ids=[500, 501])),
                E(close=Close(request_id="c")),
            )
        )
        replies = [await stream.read() for _ in range(4)]
        assert "vocabulary" in finals_of(replies[0])["a"].error
        assert "unknown request" in finals_of(replies[1])["nobody"].error
        assert "vocabulary" in finals_of(replies[2])["b"].error
        expected = (await stub.Decode(detokenizer_pb2.DecodeRequest(ids=[500, 501]), timeout=WAIT_S)).text
        assert text_of(replies[3], "c") == expected and not finals_of(replies[3])["c"].error
        assert await stream.close() == grpc.StatusCode.OK


async def detokenizer_id_reused_in_flight(stack: RealStack) -> None:
    """A start reusing an open id gets an error final; the open request decodes on."""
    async with grpc.aio.insecure_channel(stack.address("detokenizer")) as channel:
        stub = detokenizer_pb2_grpc.DetokenizerStub(channel)
        stream = Duplex(stub.Stream)
        stream.send(detok_in(E(start=Start(request_id="d")), E(chunk=Chunk(request_id="d", token_ids=[500]))))
        first = await stream.read()
        stream.send(
            detok_in(
                E(start=Start(request_id="d", stop=["x"])),
                E(chunk=Chunk(request_id="d", token_ids=[501])),
                E(close=Close(request_id="d")),
            )
        )
        second = await stream.read()
        finals = [e.final for e in second.entries if e.WhichOneof("kind") == "final"]
        assert "already open" in finals[0].error and not finals[1].error
        expected = (await stub.Decode(detokenizer_pb2.DecodeRequest(ids=[500, 501]), timeout=WAIT_S)).text
        assert text_of(first, "d") + text_of(second, "d") == expected
        assert await stream.close() == grpc.StatusCode.OK


async def detokenizer_1000_stop_strings(stack: RealStack) -> None:
    """The detokenizer itself takes 1,000 stop strings (the gateway caps them) and matches the right one."""
    async with grpc.aio.insecure_channel(stack.address("detokenizer")) as channel:
        stub = detokenizer_pb2_grpc.DetokenizerStub(channel)
        ids = [500, 501, 502, 503]
        text = (await stub.Decode(detokenizer_pb2.DecodeRequest(ids=ids), timeout=WAIT_S)).text
        stop = text[len(text) // 2 :][:3]
        assert len(stop) == 3 and not any(s in text for s in MANY_STOPS), text
        stream = Duplex(stub.Stream)
        stream.send(
            detok_in(
                E(start=Start(request_id="s", stop=[*MANY_STOPS, stop])),
                E(chunk=Chunk(request_id="s", token_ids=ids)),
            )
        )
        reply = await stream.read()
        final = finals_of(reply)["s"]
        assert final.stopped and final.stop == stop and not final.error
        assert text_of(reply, "s") == text[: text.index(stop)]
        assert await stream.close() == grpc.StatusCode.OK


async def tokenizer_stream_bad_then_good(stack: RealStack) -> None:
    """On TokenizeStream a bad request gets a response with `error`; the call goes on."""
    async with grpc.aio.insecure_channel(stack.address("tokenizer")) as channel:
        stream = Duplex(tokenizer_pb2_grpc.TokenizerStub(channel).TokenizeStream)
        stream.send(tokenizer_pb2.TokenizeRequest(request_id="bad"))
        first = await stream.read()
        stream.send(tokenizer_pb2.TokenizeRequest(request_id="good", text="hello"))
        second = await stream.read()
        assert first.request_id == "bad" and "empty" in first.error and not first.ids
        assert second.request_id == "good" and not second.error and len(second.ids) >= 1
        assert await stream.close() == grpc.StatusCode.OK


STREAM_CASES = [
    case("engine-stream-id-outside-vocabulary", engine_bad_submit_then_good),
    case("engine-stream-id-reused-in-flight", engine_id_reused_in_flight),
    case("detokenizer-stream-bad-entries", detokenizer_bad_entries),
    case("detokenizer-stream-id-reused-in-flight", detokenizer_id_reused_in_flight),
    case("detokenizer-stream-1000-stop-strings", detokenizer_1000_stop_strings),
    case("tokenizer-stream-bad-request", tokenizer_stream_bad_then_good),
]


@pytest.mark.parametrize("case", STREAM_CASES)
async def test_stream(real_stack: RealStack, case: Callable[[RealStack], Awaitable[None]]) -> None:
    await case(real_stack)


# ---------------------------------------------------------------------------------------------- afterwards


async def test_good_requests_were_exact_and_every_service_still_serves(
    real_stack: RealStack, good_traffic: GoodTraffic
) -> None:
    """Runs last: the good traffic that ran beside every case above completed with the lone run's text
    on every API, and the services are SERVING with nothing left in flight."""
    good_traffic.stop()
    print(f"good requests beside the battery: {good_traffic.completed}")
    assert not good_traffic.problems, good_traffic.problems[:5]
    assert set(good_traffic.completed) == {"http", "sse", "ws", "grpc"}, good_traffic.completed
    assert await real_stack.health() == dict.fromkeys(
        ("gateway", "tokenizer", "engine", "detokenizer"), "SERVING"
    )
    await real_stack.wait_quiet()
    assert (
        await asyncio.to_thread(complete, real_stack, GOOD_PROMPTS[0])
        == good_traffic.references[GOOD_PROMPTS[0]]
    )
