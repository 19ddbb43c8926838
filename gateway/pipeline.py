"""Orchestration of generations across tokenizer, engine and detokenizer; no HTTP, no public API.

One request: Tokenize (unary, with a deadline) → a `DetokenizeStart` on the one multiplexed
`Detokenizer.Stream` call → a submit on the one multiplexed `Engine.Stream` call. Each `EngineOut`
(one engine step) becomes one `DetokenizeIn`: a chunk per request, plus a close for each request
whose `RequestFinal` arrived (entries queued while a write is pending go out together, so a slow
detokenizer gets fewer, larger messages). Each `DetokenizeOut` carries text deltas for the requests'
event slots and finals: a stop-string final aborts the engine request (finish "stop"); a final after a
close finishes with the engine's reason. Ids and logprobs go out with the text: each delta says how
many generated ids the detokenizer has consumed, and the held ids up to that count go with it, so ids
after the one that completed a stop string never go out, and `completion_tokens` is the number of ids
handed out. Admission: beyond `max_in_flight` running generations, or while draining, a new
generation fails at once; a prompt longer than `max_prompt_tokens` fails after tokenizing.

Invariants:
- every generation ends with exactly one terminal event (`Done` or `Failed`), after its deltas;
- a request is in `_requests` from `generate` until that terminal event; afterwards every upstream
  entry for its id is ignored, and ids are never reused, so late entries cannot reach another request;
- whoever finishes a request releases its upstream state: an `Abort` to the engine unless the engine
  already sent its final, a `DetokenizeClose` unless the detokenizer already sent its final or was
  closed (a detokenizer final is the request's last entry there: nothing is sent after it);
- a broken upstream call fails every request that depends on it with "unavailable", but for engine
  requests that had no token yet: each is submitted once more, to another connected engine replica
  (failing "unavailable" when there is none or it breaks too), as is one that the engine ends with an
  `unavailable` error final before its first token (its loop stopped); the next request opens a new
  call, on a replica whose channel is connected: when no replica of a stage is (it is starting or
  restarting), it waits up to `upstream_wait_s` (within its deadline) for one, then fails with
  "unavailable" (`Replicas.pick_ready`).

Engine replicas: the gateway holds a `Engine.Stream` call open to every connected engine replica; each
reports its load and prefix cache there, and `gateway.routing.Router` picks the replica of each request
by the `routing` policy.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import secrets
import time
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field

import grpc

from gateway.observability import RequestTrace
from gateway.routing import Router
from gateway.settings import GatewaySettings
from gateway.upstream import Replicas, StreamLink
from services.common.grpc_server import ChannelTls
from services.common.metrics import GatewayMetrics
from services.common.pb import (
    common_pb2,
    detokenizer_pb2,
    detokenizer_pb2_grpc,
    engine_pb2,
    engine_pb2_grpc,
    tokenizer_pb2,
    tokenizer_pb2_grpc,
)
from services.engine import errors as engine_errors

log = logging.getLogger(__name__)

# Error codes of `Failed`; the edges map them to their own vocabulary.
INVALID_ARGUMENT = "invalid_argument"
RESOURCE_EXHAUSTED = "resource_exhausted"
UNAVAILABLE = "unavailable"
DEADLINE_EXCEEDED = "deadline_exceeded"
INTERNAL = "internal"

TOKEN_PIECE_CACHE = 200_000  # token id → piece entries kept for logprobs

_FINISH_REASONS = {
    common_pb2.FINISH_REASON_STOP: "stop",
    common_pb2.FINISH_REASON_LENGTH: "length",
    common_pb2.FINISH_REASON_CANCELLED: "cancelled",
}

_RPC_CODES = {
    grpc.StatusCode.INVALID_ARGUMENT: INVALID_ARGUMENT,
    grpc.StatusCode.RESOURCE_EXHAUSTED: RESOURCE_EXHAUSTED,
    grpc.StatusCode.UNAVAILABLE: UNAVAILABLE,
    grpc.StatusCode.DEADLINE_EXCEEDED: DEADLINE_EXCEEDED,
}


@dataclass(frozen=True)
class GenerateInput:
    """One generation as the edges hand it over. Exactly one of `prompt` and `messages` is set
    (messages are (role, content) pairs). `stopping.max_new_tokens` 0 means the gateway's default.
    `timeout_s` is the caller's own deadline; the gateway's `request_timeout_s` caps it.
    `api` names the edge (metrics label); `trace_context` is the caller's W3C context (traceparent,
    tracestate), empty for none."""

    prompt: str | None = None
    messages: tuple[tuple[str, str], ...] | None = None
    sampling: common_pb2.SamplingParams = field(default_factory=common_pb2.SamplingParams)
    stopping: common_pb2.StoppingParams = field(default_factory=common_pb2.StoppingParams)
    skip_special_tokens: bool = True
    return_token_ids: bool = False
    timeout_s: float | None = None
    api: str = ""
    trace_context: Mapping[str, str] = field(default_factory=dict)


@dataclass
class Delta:
    """New text since the previous event, merged if the consumer lagged. `token_ids` (and
    `logprobs`, one per id) only when asked for. Over a generation the ids are exactly those of its
    text: through the one that completed a stop string, none after it. In one delta they may lead
    the text by the tokens whose text is still held back (part of a character, a possible start of a
    stop string); they never lag it."""

    text: str
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[common_pb2.TokenLogprob] = field(default_factory=list)


@dataclass(frozen=True)
class Done:
    finish_reason: str  # "stop" | "length" | "cancelled"
    prompt_tokens: int
    completion_tokens: int  # the generated ids handed out (whether or not they were asked for)
    stop: str = ""  # the stop string that matched, if any


@dataclass(frozen=True)
class TokenPiece:
    """One token on its own, for logprobs: its bytes (a byte token's one byte, part of a character's
    bytes) and those as text (an incomplete character as U+FFFD)."""

    text: str
    data: bytes


@dataclass(frozen=True)
class Failed:
    code: str  # one of the error codes above
    message: str


Event = Delta | Done | Failed


class _EventSlot:
    """Events of one generation for one consumer. Deltas pushed while the consumer is busy merge
    into one, so a slow client costs memory for the text only, never a growing queue of events.
    The terminal event comes after every delta and only once."""

    def __init__(self) -> None:
        self._text: list[str] = []
        self._ids: list[int] = []
        self._logprobs: list[common_pb2.TokenLogprob] = []
        self._terminal: Done | Failed | None = None
        self._terminal_taken = False
        self._wake = asyncio.Event()

    def push(self, text: str, ids: list[int], logprobs: list[common_pb2.TokenLogprob]) -> None:
        assert self._terminal is None
        if text:
            self._text.append(text)
        self._ids.extend(ids)
        self._logprobs.extend(logprobs)
        self._wake.set()

    def finish(self, event: Done | Failed) -> None:
        assert self._terminal is None
        self._terminal = event
        self._wake.set()

    @property
    def ended(self) -> bool:
        return self._terminal_taken

    async def get(self) -> Event:
        """The next event; raises EOFError after the terminal event was taken."""
        while True:
            if self._text or self._ids:
                delta = Delta("".join(self._text), self._ids, self._logprobs)
                self._text, self._ids, self._logprobs = [], [], []
                return delta
            if self._terminal is not None:
                if self._terminal_taken:
                    raise EOFError("generation already ended")
                self._terminal_taken = True
                return self._terminal
            self._wake.clear()
            await self._wake.wait()


def _tokenizer_failure(exc: grpc.aio.AioRpcError) -> Failed:
    """A failed Tokenize call as the client sees it: the tokenizer's own words when it refused the
    input, else only the class of the failure (the log has the details, addresses included)."""
    code = _RPC_CODES.get(exc.code(), INTERNAL)
    if code in (INVALID_ARGUMENT, RESOURCE_EXHAUSTED):
        return Failed(code, f"tokenizer: {exc.details() or exc.code().name}")
    log.warning("tokenize failed: %s: %s", exc.code().name, exc.details())
    words = {UNAVAILABLE: "unavailable", DEADLINE_EXCEEDED: "deadline exceeded"}.get(code, "failed")
    return Failed(code, f"tokenizer {words}")


def _engine_failure(request_id: str, error: str) -> Failed:
    """An engine error final (`services.engine.errors`) as the client sees it: its class, with the
    engine's words only when it refused the request as given (the log has the rest)."""
    code = engine_errors.error_class(error)
    if code == INVALID_ARGUMENT:
        return Failed(code, f"engine: {engine_errors.error_detail(error)}")
    log.warning("engine failed request %s: %s", request_id, error)
    if code == DEADLINE_EXCEEDED:
        return Failed(code, "the request ran past its deadline")
    return Failed(code, "engine unavailable" if code == UNAVAILABLE else "engine failed")


EngineLink = StreamLink[engine_pb2.EngineIn, engine_pb2.EngineIn, engine_pb2.EngineOut]
DetokLink = StreamLink[
    detokenizer_pb2.DetokenizeInEntry, detokenizer_pb2.DetokenizeIn, detokenizer_pb2.DetokenizeOut
]


@dataclass(eq=False)
class _Request:
    """Gateway-side state of one generation (see the module invariants)."""

    id: str
    input: GenerateInput
    slot: _EventSlot
    prompt_tokens: int = 0
    num_generated: int = 0  # token ids received from the engine
    engine_link: EngineLink | None = None
    detok_link: DetokLink | None = None
    engine_final: engine_pb2.RequestFinal | None = None
    detok_closed: bool = False  # a DetokenizeClose was sent
    detok_done: bool = False  # the detokenizer's final arrived
    finished: bool = False
    held_ids: list[int] = field(default_factory=list)  # kept ids not yet handed out with text
    held_logprobs: list[common_pb2.TokenLogprob] = field(default_factory=list)
    ids_out: int = 0  # generated ids handed out so far (counted whether kept or not)
    admit_task: asyncio.Task[None] | None = None
    submit: engine_pb2.GenerateRequest | None = None  # as sent to the engine, kept for a retry
    deadline: float = 0.0  # time.monotonic()
    engine_tries: int = 0  # engine replicas the request was submitted to
    timer: asyncio.TimerHandle | None = None
    trace: RequestTrace | None = None

    @property
    def keep_ids(self) -> bool:
        return self.input.return_token_ids or self.input.sampling.logprobs > 0

    @property
    def engine_done(self) -> bool:
        return self.engine_final is not None


class Generation:
    """Handle of one generation: iterate it for its events (deltas, then exactly one `Done` or
    `Failed`); `cancel()` ends it with `Done("cancelled")` unless it already ended."""

    def __init__(self, pipeline: Pipeline, request: _Request) -> None:
        self._pipeline = pipeline
        self._request = request

    @property
    def id(self) -> str:
        return self._request.id

    async def next(self) -> Event:
        return await self._request.slot.get()

    def cancel(self) -> None:
        self._pipeline.cancel(self._request)

    async def __aiter__(self) -> AsyncIterator[Event]:
        while not self._request.slot.ended:
            yield await self._request.slot.get()


class Pipeline:
    """Runs generations through the upstream services. Create it inside the event loop that will use
    it; `close()` fails what is still running and closes every upstream call and channel."""

    def __init__(self, settings: GatewaySettings) -> None:
        self._settings = settings
        tls = ChannelTls.from_settings(settings)
        per_replica, interval = settings.channels_per_replica, settings.resolve_interval_s
        self._tokenizers = Replicas("tokenizer", settings.tokenizer, tls, channels_per_replica=per_replica,
                                    resolve_interval_s=interval)
        self._engines = Replicas("engine", settings.engine, tls, resolve_interval_s=interval)
        self._detokenizers = Replicas("detokenizer", settings.detokenizer, tls,
                                      channels_per_replica=per_replica, resolve_interval_s=interval)
        self.metrics = GatewayMetrics()
        self._engine_links: dict[str, EngineLink] = {}
        self._router = Router(
            settings.routing, self._engine_load, settings.routing_margin, settings.routing_margin_ratio
        )
        self._detok_links: dict[str, DetokLink] = {}
        self._requests: dict[str, _Request] = {}
        self._prefix = secrets.token_hex(4)
        self._counter = itertools.count(1)
        self._idle = asyncio.Event()
        self._idle.set()
        self._draining = False
        self._model_info: tokenizer_pb2.InfoResponse | None = None
        self._token_pieces: dict[int, TokenPiece] = {}

    # ----- public interface

    @property
    def in_flight(self) -> int:
        return len(self._requests)

    def generate(self, inp: GenerateInput) -> Generation:
        """Starts one generation at once (tokenizing runs in the background) and returns its handle."""
        assert (inp.prompt is None) != (inp.messages is None), "exactly one of prompt and messages"
        request = _Request(id=f"{self._prefix}-{next(self._counter)}", input=inp, slot=_EventSlot())
        request.trace = self._start_trace(request)
        refusal = self._refusal()
        if refusal is not None:
            request.finished = True
            request.trace.finish(refusal.code, error=refusal.message)
            request.slot.finish(refusal)
            return Generation(self, request)
        self._requests[request.id] = request
        self._idle.clear()
        timeout = self._settings.request_timeout_s
        if inp.timeout_s is not None:
            timeout = min(timeout, inp.timeout_s)
        loop = asyncio.get_running_loop()
        request.timer = loop.call_later(timeout, self._on_timeout, request, timeout)
        request.admit_task = loop.create_task(self._admit(request, time.monotonic() + timeout))
        return Generation(self, request)

    def _start_trace(self, request: _Request) -> RequestTrace:
        inp = request.input
        attributes: dict[str, object] = {
            "gen_ai.request.max_tokens": inp.stopping.max_new_tokens or self._settings.default_max_tokens,
            "gen_ai.request.temperature": inp.sampling.temperature,
            "gen_ai.request.top_p": inp.sampling.top_p,
        }
        if self._model_info is not None:
            attributes["gen_ai.request.model"] = self._model_info.model
        return RequestTrace(self.metrics, request.id, inp.api, inp.trace_context, attributes)

    def _refusal(self) -> Failed | None:
        """Why a new generation cannot start now (admission control), or None."""
        if self._draining:
            return Failed(UNAVAILABLE, "the gateway is shutting down")
        cap = self._settings.max_in_flight
        if cap and len(self._requests) >= cap:
            return Failed(RESOURCE_EXHAUSTED, f"{cap} requests are in flight, the most allowed; retry later")
        return None

    def cancel(self, request: _Request) -> None:
        self._finish(request, Done("cancelled", request.prompt_tokens, request.ids_out))

    def start_draining(self) -> None:
        """New generations fail with "unavailable" from now on; running ones go on."""
        self._draining = True

    async def wait_idle(self, timeout_s: float) -> bool:
        """Waits until no generation is running; False if some still are after `timeout_s`."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout_s)
        except TimeoutError:
            return False
        return True

    async def close(self) -> None:
        self._draining = True
        for request in list(self._requests.values()):
            self._finish(request, Failed(UNAVAILABLE, "the gateway is shutting down"))
        links: list[EngineLink | DetokLink] = [*self._engine_links.values(), *self._detok_links.values()]
        self._engine_links.clear()
        self._detok_links.clear()
        for link in links:
            await link.close()
        for replicas in (self._tokenizers, self._engines, self._detokenizers):
            await replicas.close()

    async def check_ready(self) -> dict[str, bool]:
        """Health of every upstream replica: "kind address" → SERVING."""
        timeout = self._settings.health_timeout_s
        results = await asyncio.gather(
            *(r.check_health(timeout) for r in (self._tokenizers, self._engines, self._detokenizers))
        )
        kinds = ("tokenizer", "engine", "detokenizer")
        return {
            f"{kind} {address}": ok
            for kind, res in zip(kinds, results, strict=True)
            for address, ok in res.items()
        }

    async def model_info(self) -> tokenizer_pb2.InfoResponse:
        """The tokenizer's Info (model name, context length), fetched once. Raises AioRpcError."""
        if self._model_info is None:
            address = await self._tokenizers.pick_ready(self._settings.upstream_wait_s)
            stub = tokenizer_pb2_grpc.TokenizerStub(self._tokenizers.channels[address])
            self._model_info = await stub.Info(
                tokenizer_pb2.InfoRequest(), timeout=self._settings.tokenize_timeout_s
            )
        return self._model_info

    async def token_pieces(self, ids: list[int]) -> list[TokenPiece]:
        """Each token id on its own (special tokens kept), for logprobs: its text and bytes, from the
        detokenizer's vocabulary in one call for the ids not yet cached. Raises AioRpcError."""
        missing = sorted({i for i in ids if i not in self._token_pieces})
        if missing:
            stub = detokenizer_pb2_grpc.DetokenizerStub(
                self._detokenizers.channels[self._detokenizers.pick()]
            )
            reply = await stub.TokenPieces(
                detokenizer_pb2.TokenPiecesRequest(ids=missing), timeout=self._settings.tokenize_timeout_s
            )
            if len(reply.pieces) != len(missing):
                raise RuntimeError(f"detokenizer gave {len(reply.pieces)} pieces for {len(missing)} ids")
            if len(self._token_pieces) + len(missing) > TOKEN_PIECE_CACHE:
                self._token_pieces.clear()
            self._token_pieces.update(
                (i, TokenPiece(p.text, p.bytes)) for i, p in zip(missing, reply.pieces, strict=True)
            )
        return [self._token_pieces[i] for i in ids]

    # ----- admission

    async def _admit(self, request: _Request, deadline: float) -> None:
        assert request.trace is not None
        if request.trace.traced and self._model_info is None:
            with contextlib.suppress(grpc.aio.AioRpcError):
                await self.model_info()
        try:
            with request.trace.active():
                ids = await self._tokenize(request, deadline)
        except grpc.aio.AioRpcError as exc:
            self._finish(request, _tokenizer_failure(exc))
            return
        if request.finished:
            return
        request.trace.tokenized(len(ids))
        if self._model_info is not None:
            request.trace.set_attribute("gen_ai.request.model", self._model_info.model)
        wait_until = min(time.monotonic() + self._settings.upstream_wait_s, deadline)
        detok = await self._detokenizers.pick_ready(wait_until - time.monotonic())
        engine = await self._pick_engine(ids, wait_until - time.monotonic())
        if request.finished:
            return
        try:
            self._submit(request, ids, deadline, detok, engine)
        except Exception:
            log.exception("cannot submit request %s", request.id)
            self._finish(request, Failed(INTERNAL, "internal error while submitting the request"))

    def _submit(
        self, request: _Request, ids: list[int], deadline: float, detok_address: str, engine_address: str
    ) -> None:
        """Opens the request's decoding state, then submits it to the engine (in that order, so that
        its first chunk always finds the state), on the replicas given. The engine gets the time left
        until `deadline` (`time.monotonic()`), so it ends the request itself if the gateway's own timer
        cannot."""
        if not ids:
            self._finish(request, Failed(INVALID_ARGUMENT, "the prompt is empty"))
            return
        cap = self._settings.max_prompt_tokens
        if cap and len(ids) > cap:
            message = f"the prompt has {len(ids)} tokens, more than the {cap} allowed"
            self._finish(request, Failed(INVALID_ARGUMENT, message))
            return
        request.prompt_tokens = len(ids)
        request.deadline = deadline
        assert request.trace is not None
        detok_context, engine_context = request.trace.submit_contexts()
        inp = request.input
        context = self._settings.detokenizer_context_ids
        detok = self._detok_link(detok_address)
        engine = self._engine_link(engine_address)
        request.detok_link, request.engine_link = detok, engine
        detok.request_ids.add(request.id)
        engine.request_ids.add(request.id)
        start = detokenizer_pb2.DetokenizeStart(
            request_id=request.id,
            prompt_ids=ids[-context:] if context else [],
            skip_special_tokens=inp.skip_special_tokens,
            stop=list(inp.stopping.stop),
            include_stop_str_in_output=inp.stopping.include_stop_str_in_output,
            trace_context=detok_context,
        )
        detok.send(detokenizer_pb2.DetokenizeInEntry(start=start))
        stopping = common_pb2.StoppingParams()
        stopping.CopyFrom(inp.stopping)
        if stopping.max_new_tokens == 0:
            stopping.max_new_tokens = self._settings.default_max_tokens
        request.submit = engine_pb2.GenerateRequest(
            request_id=request.id, prompt_ids=ids, sampling=inp.sampling, stopping=stopping,
            trace_context=engine_context,
        )
        self._send_submit(request, engine)

    def _send_submit(self, request: _Request, engine: EngineLink) -> None:
        """Submits the request on `engine` with the time left until its deadline."""
        assert request.submit is not None
        request.submit.timeout_ms = max(1, int(1000 * (request.deadline - time.monotonic())))
        request.engine_tries += 1
        engine.send(engine_pb2.EngineIn(submit=request.submit))

    async def _pick_engine(self, ids: list[int], wait_s: float) -> str:
        """The engine replica for a prompt of `ids`, by the routing policy among the connected replicas
        (each gets a report stream), waiting up to `wait_s` for one when none is connected."""
        ready = self._engines.connected()
        if not ready:
            fallback = await self._engines.pick_ready(wait_s, self._engine_load)
            ready = self._engines.connected() or [fallback]
        for address in ready:
            self._engine_link(address)
        return self._router.pick(ready, ids)

    async def _tokenize(self, request: _Request, deadline: float) -> list[int]:
        inp = request.input
        if inp.messages is not None:
            chat = common_pb2.Conversation(
                messages=[
                    common_pb2.ChatMessage(role=role, content=content) for role, content in inp.messages
                ]
            )
            message = tokenizer_pb2.TokenizeRequest(request_id=request.id, chat=chat)
        else:
            message = tokenizer_pb2.TokenizeRequest(request_id=request.id, text=inp.prompt)
        wait_s = min(self._settings.upstream_wait_s, deadline - time.monotonic())
        address = await self._tokenizers.pick_ready(wait_s)
        timeout = max(0.001, min(self._settings.tokenize_timeout_s, deadline - time.monotonic()))
        stub = tokenizer_pb2_grpc.TokenizerStub(self._tokenizers.channels[address])
        reply = await stub.Tokenize(message, timeout=timeout)
        return list(reply.ids)

    def _engine_load(self, address: str) -> int:
        """Requests in flight on an engine replica, as this gateway sent them."""
        link = self._engine_links.get(address)
        return len(link.request_ids) if link is not None and link.alive else 0

    def _engine_link(self, address: str) -> EngineLink:
        link = self._engine_links.get(address)
        if link is None or not link.alive:
            stub = engine_pb2_grpc.EngineStub(self._engines.channels[address])
            link = StreamLink(
                kind="engine",
                address=address,
                open_call=stub.Stream,
                merge=lambda items: items,
                on_message=self._on_engine_out,
                on_broken=self._on_broken,
            )
            self._engine_links[address] = link
        return link

    def _detok_link(self, address: str) -> DetokLink:
        link = self._detok_links.get(address)
        if link is None or not link.alive:
            stub = detokenizer_pb2_grpc.DetokenizerStub(self._detokenizers.channels[address])
            link = StreamLink(
                kind="detokenizer",
                address=address,
                open_call=stub.Stream,
                merge=lambda entries: [detokenizer_pb2.DetokenizeIn(entries=entries)],
                on_message=self._on_detok_out,
                on_broken=self._on_broken,
            )
            self._detok_links[address] = link
        return link

    # ----- upstream messages (synchronous: no await between reading a message and acting on it)

    def _on_engine_out(self, link: EngineLink, out: engine_pb2.EngineOut) -> None:
        if out.HasField("report"):
            self._router.on_report(link.address, out.report)
        for entry in out.entries:
            if entry.WhichOneof("kind") == "chunk":
                self._on_token_chunk(entry.chunk, out.batch_size)
            else:
                self._on_engine_final(entry.final)

    def _on_token_chunk(self, chunk: engine_pb2.TokenChunk, batch_size: int) -> None:
        request = self._requests.get(chunk.request_id)
        if request is None or request.engine_done or request.detok_link is None:
            return
        if not request.num_generated and request.trace is not None:
            request.trace.on_chunk(batch_size)
        request.num_generated += len(chunk.token_ids)
        if request.keep_ids:
            request.held_ids.extend(chunk.token_ids)
            request.held_logprobs.extend(chunk.logprobs)
        dchunk = detokenizer_pb2.DetokenizeChunk(request_id=request.id, token_ids=chunk.token_ids)
        request.detok_link.send(detokenizer_pb2.DetokenizeInEntry(chunk=dchunk))

    def _on_engine_final(self, final: engine_pb2.RequestFinal) -> None:
        request = self._requests.get(final.request_id)
        if request is None or request.engine_done or request.detok_link is None:
            return
        failed = request.engine_link
        if (  # the engine stopped serving (its loop failed) before the request's first token
            final.finish_reason not in _FINISH_REASONS
            and engine_errors.error_class(final.error) == UNAVAILABLE
            and failed is not None
            and self._retry_engine(request, failed.address)
        ):
            return
        request.engine_final = final
        if request.trace is not None:
            request.trace.engine_done(final.error)
        if final.finish_reason not in _FINISH_REASONS:
            self._finish(request, _engine_failure(request.id, final.error))
            return
        request.detok_closed = True
        close = detokenizer_pb2.DetokenizeClose(request_id=request.id)
        request.detok_link.send(detokenizer_pb2.DetokenizeInEntry(close=close))

    def _on_detok_out(self, link: DetokLink, out: detokenizer_pb2.DetokenizeOut) -> None:
        for entry in out.entries:
            if entry.WhichOneof("kind") == "delta":
                request = self._requests.get(entry.delta.request_id)
                if request is not None and not request.detok_done:
                    self._hand_out(request, entry.delta.text, entry.delta.num_ids)
            else:
                self._on_detok_final(entry.final)

    def _on_detok_final(self, final: detokenizer_pb2.DetokenizeFinal) -> None:
        request = self._requests.get(final.request_id)
        if request is None or request.detok_done:
            return
        request.detok_done = True
        if request.trace is not None:
            request.trace.detok_done(final.error)
        if final.error:
            self._finish(request, Failed(INTERNAL, f"detokenizer: {final.error}"))
        elif final.stopped:
            self._hand_out(request, "", final.num_ids_consumed)
            self._finish(request, Done("stop", request.prompt_tokens, request.ids_out, final.stop))
        elif request.engine_final is not None:
            usage = request.engine_final.usage
            self._hand_out(request, "", final.num_ids_consumed)
            reason = _FINISH_REASONS[request.engine_final.finish_reason]
            prompt_tokens = usage.prompt_tokens or request.prompt_tokens
            self._finish(request, Done(reason, prompt_tokens, request.ids_out))
        else:
            self._finish(request, Failed(INTERNAL, "detokenizer ended the request before it was closed"))

    def _hand_out(self, request: _Request, text: str, through: int) -> None:
        """Pushes `text` and the generated ids after those already handed out up to the `through`-th
        (with their logprobs, when kept) to the consumer. `through` is the detokenizer's count of ids
        consumed, so an id after the one that completed a stop string never goes out."""
        num_ids = max(0, min(through, request.num_generated) - request.ids_out)
        request.ids_out += num_ids
        ids: list[int] = []
        logprobs: list[common_pb2.TokenLogprob] = []
        if num_ids and request.keep_ids:
            ids, request.held_ids = request.held_ids[:num_ids], request.held_ids[num_ids:]
            logprobs, request.held_logprobs = request.held_logprobs[:num_ids], request.held_logprobs[num_ids:]
        if text or ids:
            if request.trace is not None:
                request.trace.on_text()
            request.slot.push(text, ids, logprobs)

    def _on_broken(self, link: EngineLink | DetokLink, reason: str) -> None:
        # A broken link leaves its map, so a retired replica's link and report mirror do not stay behind.
        if link.kind == "engine" and self._engine_links.get(link.address) is link:
            del self._engine_links[link.address]
            self._router.forget(link.address)
        if link.kind == "detokenizer" and self._detok_links.get(link.address) is link:
            del self._detok_links[link.address]
        request_ids = list(link.request_ids)
        link.request_ids.clear()
        for request_id in request_ids:
            request = self._requests.get(request_id)
            if request is None:
                continue
            if link.kind == "engine" and self._retry_engine(request, link.address):
                continue
            self._finish(request, Failed(UNAVAILABLE, f"{link.kind} unavailable"))

    def _retry_engine(self, request: _Request, failed: str) -> bool:
        """Submits a request whose engine call broke before its first token once more, to another
        connected engine replica; False when it cannot be (it had tokens, was retried already, or no
        other replica is connected)."""
        if request.num_generated or request.engine_done or request.engine_tries > 1 or request.submit is None:
            return False
        if request.detok_link is None or not request.detok_link.alive:
            return False
        others = [a for a in self._engines.connected() if a != failed]
        if not others:
            return False
        address = self._router.pick(others, request.submit.prompt_ids)
        engine = self._engine_link(address)
        log.info("request %s: engine %s failed before its first token; retried on %s", request.id, failed,
                 address)
        if request.engine_link is not None:
            request.engine_link.request_ids.discard(request.id)
        request.engine_link = engine
        engine.request_ids.add(request.id)
        self._send_submit(request, engine)
        return True

    def _on_timeout(self, request: _Request, timeout_s: float) -> None:
        request.timer = None
        self._finish(request, Failed(DEADLINE_EXCEEDED, f"the request ran longer than {timeout_s:g}s"))

    # ----- the one way out

    def _finish(self, request: _Request, event: Done | Failed) -> None:
        """Ends a request exactly once: releases its upstream state, then emits the terminal event."""
        if request.finished:
            return
        request.finished = True
        self._requests.pop(request.id, None)
        if request.timer is not None:
            request.timer.cancel()
        task = request.admit_task
        if task is not None and not task.done() and task is not asyncio.current_task():
            task.cancel()
        engine, detok = request.engine_link, request.detok_link
        if engine is not None:
            engine.request_ids.discard(request.id)
            if not request.engine_done:
                engine.send(engine_pb2.EngineIn(abort=engine_pb2.Abort(request_id=request.id)))
        if detok is not None:
            detok.request_ids.discard(request.id)
            if not request.detok_done and not request.detok_closed:
                detok.send(
                    detokenizer_pb2.DetokenizeInEntry(
                        close=detokenizer_pb2.DetokenizeClose(request_id=request.id)
                    )
                )
        if request.trace is not None:
            if isinstance(event, Done):
                request.trace.finish(event.finish_reason, finish_reason=event.finish_reason,
                                     output_tokens=event.completion_tokens)
            else:
                request.trace.finish(event.code, error=event.message)
        request.slot.finish(event)
        if not self._requests:
            self._idle.set()
