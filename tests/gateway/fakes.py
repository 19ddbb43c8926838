"""Fake upstream services for gateway tests: the simplest servicers that honour the protos.

Tokenizer: id 1 (bos) then one id per character (its code point); a conversation renders as "role:
content\n" lines then "assistant: " (bos and "assistant: " left out when the request's options say so);
Info's context length is `CONTEXT_LENGTH`, the fake engine's `max_model_len`. Engine: one token per step
per request (`tokens_per_step`), cycling through the code points of `OUTPUT` (or through `output_ids`);
finishes with LENGTH at max_new_tokens (0: the rest of its context, `max_model_len` less the prompt, as a
real engine fills it); prompt logprobs (when asked) are `PROMPT_LOGPROB` for every prompt token after the
first, its top alternative the token itself; `Stats` gives `max_model_len`. Detokenizer: id → chr(id)
(bos skipped), stop strings matched across chunks with the possible prefix held back; each delta carries
the running count of ids consumed.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import grpc

from services.common import errors
from services.common.grpc_server import ServiceHealth, bind, new_server
from services.common.pb import (
    common_pb2,
    detokenizer_pb2,
    detokenizer_pb2_grpc,
    engine_pb2,
    engine_pb2_grpc,
    tokenizer_pb2,
    tokenizer_pb2_grpc,
)

BOS = 1
OUTPUT = "hello world. "
MODEL = "fake-model"
PROMPT_LOGPROB = -0.25
CONTEXT_LENGTH = 64  # the model's context: the tokenizer's Info and the engine's max_model_len


def expected_text(n: int) -> str:
    return "".join(OUTPUT[i % len(OUTPUT)] for i in range(n))


def encode(text: str) -> list[int]:
    return [BOS, *(ord(c) for c in text)]


class FakeTokenizer(tokenizer_pb2_grpc.TokenizerServicer):
    """While `gate` is set and not open, Tokenize calls wait for it (`arrived` is set as each one
    starts waiting). Each status in `fail_next` fails one Tokenize call, in order (the list may be
    shared by several fakes)."""

    def __init__(self) -> None:
        self.requests: list[tokenizer_pb2.TokenizeRequest] = []
        self.gate: asyncio.Event | None = None
        self.arrived = asyncio.Event()
        self.fail_next: list[grpc.StatusCode] = []
        self.chat_template = ""  # what Info says of the model's template
        self.generation_prompt = ""
        self.special_tokens: dict[str, int] = {}  # and of its special tokens (text → id)
        self.context_length = CONTEXT_LENGTH

    async def Tokenize(
        self, request: tokenizer_pb2.TokenizeRequest, context: grpc.aio.ServicerContext
    ) -> tokenizer_pb2.TokenizeResponse:
        self.requests.append(request)
        if self.fail_next:
            await context.abort(self.fail_next.pop(0), "tokenizer going away")
        if self.gate is not None:
            self.arrived.set()
            await self.gate.wait()
        if request.WhichOneof("input") == "chat":
            text = "".join(f"{m.role}: {m.content}\n" for m in request.chat.messages)
            if not request.HasField("add_generation_prompt") or request.add_generation_prompt:
                text += "assistant: "
        else:
            text = request.text
        if "INVALID" in text:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "text the tokenizer refuses")
        ids = encode(text)
        if request.HasField("add_special_tokens") and not request.add_special_tokens:
            ids = ids[1:]
        return tokenizer_pb2.TokenizeResponse(request_id=request.request_id, ids=ids)

    async def Info(
        self, request: tokenizer_pb2.InfoRequest, context: grpc.aio.ServicerContext
    ) -> tokenizer_pb2.InfoResponse:
        return tokenizer_pb2.InfoResponse(
            model=MODEL,
            vocab_size=0x110000,
            context_length=self.context_length,
            chat_template=self.chat_template,
            generation_prompt=self.generation_prompt,
            special_tokens=[
                tokenizer_pb2.SpecialToken(name=text, text=text, id=i)
                for text, i in self.special_tokens.items()
            ],
        )


@dataclass
class _Running:
    request: engine_pb2.GenerateRequest
    generated: int = 0


@dataclass
class FakeEngine(engine_pb2_grpc.EngineServicer):
    """`fail_next_submit` breaks the Stream call (UNAVAILABLE) when the next submit arrives;
    `error_next_submit` (`"<class>: <detail>"`: the final's error code and words; without a known class,
    the code is unspecified) answers the next submit with an ERROR final.
    `report`, when set, is the first message of every Stream call (a load and cache snapshot);
    `paused` holds every request queued (no tokens); `kill_streams()` breaks every open Stream call
    (UNAVAILABLE) at its next step. Every final's usage says `cached_tokens`."""

    step_s: float = 0.001
    submits: list[engine_pb2.GenerateRequest] = field(default_factory=list)
    aborts: list[str] = field(default_factory=list)
    aborted: asyncio.Event = field(default_factory=asyncio.Event)
    submitted: asyncio.Event = field(default_factory=asyncio.Event)
    stream_calls: int = 0
    outs: int = 0  # EngineOut messages sent
    fail_next_submit: bool = False
    error_next_submit: str = ""
    tokens_per_step: int = 1
    output_ids: list[int] = field(default_factory=list)  # cycled through instead of OUTPUT's code points
    report: engine_pb2.EngineReport | None = None
    paused: bool = False
    max_model_len: int = CONTEXT_LENGTH
    cached_tokens: int = 0
    _open: list[tuple[list[str], asyncio.Event]] = field(default_factory=list)

    def _filled(self, submit: engine_pb2.GenerateRequest) -> engine_pb2.GenerateRequest:
        """`submit` with max_new_tokens 0 filled with the rest of the context."""
        if submit.stopping.max_new_tokens:
            return submit
        filled = engine_pb2.GenerateRequest()
        filled.CopyFrom(submit)
        filled.stopping.max_new_tokens = max(1, self.max_model_len - len(submit.prompt_ids))
        return filled

    def kill_streams(self) -> None:
        for broken, wake in self._open:
            broken.append("engine killed")
            wake.set()

    async def Stream(
        self, request_iterator: AsyncIterator[engine_pb2.EngineIn], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[engine_pb2.EngineOut]:
        self.stream_calls += 1
        running: dict[str, _Running] = {}
        pending: list[engine_pb2.StepEntry] = []
        wake = asyncio.Event()
        broken: list[str] = []

        async def read() -> None:
            async for message in request_iterator:
                if message.WhichOneof("kind") == "submit":
                    self.submits.append(message.submit)
                    self.submitted.set()
                    if self.fail_next_submit:
                        self.fail_next_submit = False
                        broken.append("engine crashed")
                    elif self.error_next_submit:
                        code, _, detail = self.error_next_submit.partition(": ")
                        if code not in errors.CLASSES:  # no class: the code stays unspecified
                            code, detail = None, self.error_next_submit
                        final = engine_pb2.RequestFinal(
                            request_id=message.submit.request_id,
                            finish_reason=common_pb2.FINISH_REASON_ERROR,
                            error=detail,
                            error_code=errors.code_value(code),
                        )
                        self.error_next_submit = ""
                        pending.append(engine_pb2.StepEntry(final=final))
                    else:
                        running[message.submit.request_id] = _Running(self._filled(message.submit))
                else:
                    request_id = message.abort.request_id
                    self.aborts.append(request_id)
                    self.aborted.set()
                    if running.pop(request_id, None) is not None:
                        final = engine_pb2.RequestFinal(
                            request_id=request_id, finish_reason=common_pb2.FINISH_REASON_CANCELLED
                        )
                        pending.append(engine_pb2.StepEntry(final=final))
                wake.set()

        reader = asyncio.get_running_loop().create_task(read())
        self._open.append((broken, wake))
        try:
            if self.report is not None:
                yield engine_pb2.EngineOut(report=self.report)
            while True:
                await wake.wait()
                wake.clear()
                if broken:
                    await context.abort(grpc.StatusCode.UNAVAILABLE, broken[0])
                while running or pending:
                    self.outs += 1
                    yield engine_pb2.EngineOut(entries=[*pending, *self._step(running)])
                    pending.clear()
                    await asyncio.sleep(self.step_s)  # the duration of one fake engine step
                    if broken:
                        await context.abort(grpc.StatusCode.UNAVAILABLE, broken[0])
        finally:
            self._open.remove((broken, wake))
            reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await reader

    async def Stats(
        self, request: engine_pb2.StatsRequest, context: grpc.aio.ServicerContext
    ) -> engine_pb2.StatsResponse:
        return engine_pb2.StatsResponse(model=MODEL, max_model_len=self.max_model_len)

    @staticmethod
    def _prompt_logprobs(request: engine_pb2.GenerateRequest) -> list[common_pb2.TokenLogprob]:
        if not request.sampling.HasField("prompt_logprobs"):
            return []
        top = request.sampling.prompt_logprobs
        return [
            common_pb2.TokenLogprob(
                logprob=PROMPT_LOGPROB, top_token_ids=[token][:top], top_logprobs=[PROMPT_LOGPROB][:top]
            )
            for token in request.prompt_ids[1:]
        ]

    def _step(self, running: dict[str, _Running]) -> list[engine_pb2.StepEntry]:
        entries = []
        if self.paused:
            return entries
        output = self.output_ids or [ord(c) for c in OUTPUT]
        for request_id, state in list(running.items()):
            n = max(1, min(self.tokens_per_step, state.request.stopping.max_new_tokens - state.generated))
            tokens = [output[(state.generated + i) % len(output)] for i in range(n)]
            state.generated += n
            logprobs = [common_pb2.TokenLogprob(logprob=-0.5)] * n if state.request.sampling.logprobs else []
            chunk = engine_pb2.TokenChunk(request_id=request_id, token_ids=tokens, logprobs=logprobs)
            if not state.generated - n:
                chunk.prompt_logprobs.extend(self._prompt_logprobs(state.request))
            entries.append(engine_pb2.StepEntry(chunk=chunk))
            if state.generated >= state.request.stopping.max_new_tokens:
                del running[request_id]
                usage = common_pb2.Usage(
                    prompt_tokens=len(state.request.prompt_ids),
                    completion_tokens=state.generated,
                    cached_tokens=self.cached_tokens,
                )
                final = engine_pb2.RequestFinal(
                    request_id=request_id, finish_reason=common_pb2.FINISH_REASON_LENGTH, usage=usage
                )
                entries.append(engine_pb2.StepEntry(final=final))
        return entries


@dataclass
class _Decoding:
    start: detokenizer_pb2.DetokenizeStart
    text: str = ""
    emitted: int = 0
    consumed: int = 0


@dataclass
class FakeDetokenizer(detokenizer_pb2_grpc.DetokenizerServicer):
    """`fail_next_start` breaks the Stream call (UNAVAILABLE) when the next start arrives; each
    status in `fail_next_pieces` fails one TokenPieces call, in order."""

    starts: list[detokenizer_pb2.DetokenizeStart] = field(default_factory=list)
    closes: list[str] = field(default_factory=list)
    closed: asyncio.Event = field(default_factory=asyncio.Event)
    messages_in: int = 0
    stream_calls: int = 0
    fail_next_start: bool = False
    fail_next_pieces: list[grpc.StatusCode] = field(default_factory=list)
    pieces_calls: int = 0

    async def Stream(
        self, request_iterator: AsyncIterator[detokenizer_pb2.DetokenizeIn], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[detokenizer_pb2.DetokenizeOut]:
        self.stream_calls += 1
        states: dict[str, _Decoding] = {}
        finished: set[str] = set()
        async for message in request_iterator:
            self.messages_in += 1
            out = detokenizer_pb2.DetokenizeOut()
            for entry in message.entries:
                kind = entry.WhichOneof("kind")
                if kind == "start":
                    self.starts.append(entry.start)
                    if self.fail_next_start:
                        self.fail_next_start = False
                        await context.abort(grpc.StatusCode.UNAVAILABLE, "detokenizer crashed")
                    states[entry.start.request_id] = _Decoding(entry.start)
                elif kind == "chunk":
                    self._chunk(entry.chunk, states, finished, out)
                else:
                    self.closes.append(entry.close.request_id)
                    self.closed.set()
                    state = states.pop(entry.close.request_id, None)
                    if state is not None:
                        self._emit(out, state, len(state.text))
                        out.entries.add().final.CopyFrom(
                            detokenizer_pb2.DetokenizeFinal(
                                request_id=state.start.request_id, num_ids_consumed=state.consumed
                            )
                        )
            yield out

    def _chunk(
        self,
        chunk: detokenizer_pb2.DetokenizeChunk,
        states: dict[str, _Decoding],
        finished: set[str],
        out: detokenizer_pb2.DetokenizeOut,
    ) -> None:
        state = states.get(chunk.request_id)
        if state is None:
            if chunk.request_id not in finished:
                final = out.entries.add().final
                final.request_id, final.error = chunk.request_id, "chunk for an unknown request"
            return
        stops = list(state.start.stop)
        for token in chunk.token_ids:
            state.consumed += 1
            if token == BOS and state.start.skip_special_tokens:
                continue
            state.text += chr(token)
            matched = next((s for s in stops if state.text.endswith(s)), None)
            if matched is not None:
                end = (
                    len(state.text)
                    if state.start.include_stop_str_in_output
                    else len(state.text) - len(matched)
                )
                self._emit(out, state, end)
                final = out.entries.add().final
                final.request_id, final.stopped, final.stop = chunk.request_id, True, matched
                final.num_ids_consumed = state.consumed
                del states[chunk.request_id]
                finished.add(chunk.request_id)
                return
        held = max((k for s in stops for k in range(1, len(s)) if state.text.endswith(s[:k])), default=0)
        self._emit(out, state, len(state.text) - held)

    async def Decode(
        self, request: detokenizer_pb2.DecodeRequest, context: grpc.aio.ServicerContext
    ) -> detokenizer_pb2.DecodeResponse:
        ids = [i for i in request.ids if not (request.skip_special_tokens and i == BOS)]
        return detokenizer_pb2.DecodeResponse(text="".join(chr(i) for i in ids))

    async def TokenPieces(
        self, request: detokenizer_pb2.TokenPiecesRequest, context: grpc.aio.ServicerContext
    ) -> detokenizer_pb2.TokenPiecesResponse:
        self.pieces_calls += 1
        if self.fail_next_pieces:
            await context.abort(self.fail_next_pieces.pop(0), "detokenizer going away")
        pieces = [detokenizer_pb2.TokenPiece(text=chr(i), bytes=chr(i).encode()) for i in request.ids]
        return detokenizer_pb2.TokenPiecesResponse(pieces=pieces)

    @staticmethod
    def _emit(out: detokenizer_pb2.DetokenizeOut, state: _Decoding, end: int) -> None:
        if end > state.emitted:
            delta = out.entries.add().delta
            delta.request_id, delta.text = state.start.request_id, state.text[state.emitted : end]
            delta.num_ids = state.consumed
            state.emitted = end


@dataclass
class FakeUpstreams:
    tokenizer: FakeTokenizer
    engine: FakeEngine
    detokenizer: FakeDetokenizer
    servers: dict[str, grpc.aio.Server]
    addresses: dict[str, str]
    health: dict[str, ServiceHealth]

    async def stop(self, name: str | None = None) -> None:
        for key, server in self.servers.items():
            if name is None or key == name:
                await server.stop(0)


async def start_upstreams() -> FakeUpstreams:
    """Starts the three fake services, each on its own free port with grpc.health.v1."""
    tokenizer, engine, detokenizer = FakeTokenizer(), FakeEngine(), FakeDetokenizer()
    servers: dict[str, grpc.aio.Server] = {}
    addresses: dict[str, str] = {}
    healths: dict[str, ServiceHealth] = {}
    adders = {
        "tokenizer": ("sluice.v1.Tokenizer", tokenizer_pb2_grpc.add_TokenizerServicer_to_server, tokenizer),
        "engine": ("sluice.v1.Engine", engine_pb2_grpc.add_EngineServicer_to_server, engine),
        "detokenizer": (
            "sluice.v1.Detokenizer",
            detokenizer_pb2_grpc.add_DetokenizerServicer_to_server,
            detokenizer,
        ),
    }
    for name, (service, add, servicer) in adders.items():
        server, health = new_server([service])
        add(servicer, server)
        port = bind(server, "127.0.0.1", 0)
        await server.start()
        await health.set_serving(True)
        servers[name] = server
        addresses[name] = f"127.0.0.1:{port}"
        healths[name] = health
    return FakeUpstreams(tokenizer, engine, detokenizer, servers, addresses, healths)
