"""Orchestration of generations across tokenizer, engine and detokenizer: the per-request state machine,
with its single exit `_finish`; no HTTP, no public API. The links to the stages are `gateway.stages`,
the events the edges read `gateway.events`; the path and its rules: docs/architecture.md ("One request").

Invariants: every generation ends with exactly one terminal event (`Done` or `Failed`), after its
deltas; a request is in `_requests` from `generate` until then, later upstream entries for its id are
ignored and ids are never reused; whoever finishes a request releases its upstream state (an `Abort`, a
`DetokenizeClose`) unless that side already sent its final; a broken upstream call fails its requests
"unavailable", but resubmits once to another engine those with no token yet; a new call waits at most
`upstream_wait_s` (within the deadline) for a connected, SERVING replica; admission (tokenize, pick,
submit) ends its request on any error, never leaving it to its timeout.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import secrets
import time
from dataclasses import dataclass, field

import grpc

from gateway.events import (
    Done,
    EventSlot,
    Failed,
    GenerateInput,
    Generation,
    engine_failure,
    tokenizer_failure,
)
from gateway.observability import RequestTrace
from gateway.settings import GatewaySettings
from gateway.stages import DetokLink, EngineLink, Stages, TokenizeOptions
from services.common import errors
from services.common.errors import (
    DEADLINE_EXCEEDED,
    INTERNAL,
    INVALID_ARGUMENT,
    RESOURCE_EXHAUSTED,
    UNAVAILABLE,
)
from services.common.metrics import GatewayMetrics
from services.common.pb import common_pb2, detokenizer_pb2, engine_pb2

log = logging.getLogger(__name__)


def _finish_reason(final: engine_pb2.RequestFinal) -> str:
    """The finish reason of an engine final that ended its request well ("stop", "length",
    "cancelled"); "" for an error final."""
    reason = errors.finish_reason_name(final.finish_reason)
    return "" if reason == "error" else reason


@dataclass(eq=False)
class _Request:
    """Gateway-side state of one generation (see the module invariants)."""

    id: str
    input: GenerateInput
    slot: EventSlot
    trace: RequestTrace
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
    prompt_out: bool = False  # the prompt's ids and logprobs went out (prompt logprobs asked for)
    admit_task: asyncio.Task[None] | None = None
    submit: engine_pb2.GenerateRequest | None = None  # as sent to the engine, kept for a retry
    deadline: float = 0.0  # time.monotonic()
    engine_tries: int = 0  # engine replicas the request was submitted to
    timer: asyncio.TimerHandle | None = None

    @property
    def keep_ids(self) -> bool:
        return self.input.return_token_ids or self.input.sampling.logprobs > 0

    @property
    def engine_done(self) -> bool:
        return self.engine_final is not None


class Pipeline:
    """Runs generations through the upstream services. Create it inside the event loop that will use
    it; `close()` fails what is still running and closes every upstream call and channel. `metrics`
    is the gateway's, created by its `create_server`."""

    def __init__(self, settings: GatewaySettings, metrics: GatewayMetrics) -> None:
        self._settings = settings
        self.metrics = metrics
        self._stages = Stages(
            settings,
            on_engine_out=self._on_engine_out,
            on_detok_out=self._on_detok_out,
            on_broken=self._on_broken,
        )
        self._requests: dict[str, _Request] = {}
        self._prefix = secrets.token_hex(4)
        self._counter = itertools.count(1)
        self._idle = asyncio.Event()
        self._idle.set()
        self._draining = False
        # What the edges ask the stages besides generations (see `Stages`; each raises AioRpcError).
        self.check_ready = self._stages.check_ready
        self.model_info = self._stages.model_info
        self.max_model_len = self._stages.max_model_len  # shown by /v1/models and /tokenize only
        self.token_pieces = self._stages.token_pieces
        self.decode = self._stages.decode

    # ----- public interface

    @property
    def in_flight(self) -> int:
        return len(self._requests)

    async def context_length(self) -> int:
        """The model's context length, from the tokenizer's Info (fetched once): what the gateway's own
        caps count in. The engine owns the limit itself. Raises AioRpcError."""
        return (await self._stages.model_info()).context_length

    def generate(self, inp: GenerateInput) -> Generation:
        """Starts one generation at once (tokenizing runs in the background) and returns its handle."""
        given = (inp.prompt, inp.messages, inp.prompt_ids)
        assert sum(x is not None for x in given) == 1, "exactly one of prompt, messages and prompt_ids"
        request_id = f"{self._prefix}-{next(self._counter)}"
        request = _Request(request_id, inp, EventSlot(), self._start_trace(request_id, inp))
        generation = Generation(request.id, request.slot, lambda: self.cancel(request))
        refusal = self._refusal()
        if refusal is not None:
            self._finish(request, refusal)
            return generation
        self._requests[request.id] = request
        self._idle.clear()
        timeout = self._settings.request_timeout_s
        if inp.timeout_s is not None:
            timeout = min(timeout, inp.timeout_s)
        loop = asyncio.get_running_loop()
        request.timer = loop.call_later(timeout, self._on_timeout, request, timeout)
        request.admit_task = loop.create_task(self._admit(request, time.monotonic() + timeout))
        return generation

    def _start_trace(self, request_id: str, inp: GenerateInput) -> RequestTrace:
        attributes: dict[str, object] = {
            "gen_ai.request.temperature": inp.sampling.temperature,
            "gen_ai.request.top_p": inp.sampling.top_p,
        }
        if inp.stopping.max_new_tokens:  # else set once the prompt's length is known
            attributes["gen_ai.request.max_tokens"] = inp.stopping.max_new_tokens
        if self._stages.info is not None:
            attributes["gen_ai.request.model"] = self._stages.info.model
        if inp.user:
            attributes["user.id"] = inp.user
        if inp.request_id:  # the span is named by the client's id; the stages' spans by the gateway's
            attributes["sluice.upstream_request_id"] = request_id
        trace_id = inp.request_id or request_id
        return RequestTrace(self.metrics, trace_id, inp.api, inp.trace_context, attributes)

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

    def end_all(self) -> None:
        """Fails every generation still running with "unavailable"; new ones are refused from now on."""
        self._draining = True
        for request in list(self._requests.values()):
            self._finish(request, Failed(UNAVAILABLE, "the gateway is shutting down"))

    async def close(self) -> None:
        """Ends every generation (`end_all`), then closes every upstream call and channel."""
        self.end_all()
        await self._stages.close()

    async def tokenize(self, inp: GenerateInput, options: TokenizeOptions) -> list[int]:
        """The ids of `inp`'s prompt or messages, tokenized with `options`, outside any generation.
        Raises AioRpcError."""
        deadline = time.monotonic() + self._settings.tokenize_timeout_s
        return await self._stages.tokenize(f"{self._prefix}-t{next(self._counter)}", inp, deadline, options)

    # ----- admission

    async def _admit(self, request: _Request, deadline: float) -> None:
        """Tokenizes, picks the replicas and submits; any failure on the way ends the request (an
        unexpected one "internal", or "unavailable" for an OSError reaching a replica), so that no
        client waits for its timeout and no later request is affected."""
        try:
            await self._admit_steps(request, deadline)
        except Exception as exc:
            log.exception("cannot admit request %s", request.id)
            if isinstance(exc, OSError):
                self._finish(request, Failed(UNAVAILABLE, "cannot reach an upstream service"))
            else:
                self._finish(request, Failed(INTERNAL, "internal error while admitting the request"))

    async def _admit_steps(self, request: _Request, deadline: float) -> None:
        try:
            ids = await self._prompt_ids(request, deadline)
        except grpc.aio.AioRpcError as exc:
            self._finish(request, tokenizer_failure(exc))
            return
        if self._stages.info is None:  # fetched once, from a tokenizer that just answered
            with contextlib.suppress(grpc.aio.AioRpcError):
                await self._stages.model_info()
        if request.finished:
            return
        request.trace.tokenized(len(ids))
        refusal = self._prompt_refusal(ids)
        if refusal is not None:  # before routing, which hashes the prompt's blocks
            self._finish(request, refusal)
            return
        if self._stages.info is not None:
            request.trace.set_attribute("gen_ai.request.model", self._stages.info.model)
        wait_until = min(time.monotonic() + self._settings.upstream_wait_s, deadline)
        detok = await self._stages.detokenizers.pick_ready(wait_until - time.monotonic())
        engine = await self._stages.pick_engine(ids, wait_until - time.monotonic())
        if request.finished:
            return
        try:
            self._submit(request, ids, deadline, detok, engine)
        except Exception:
            log.exception("cannot submit request %s", request.id)
            self._finish(request, Failed(INTERNAL, "internal error while submitting the request"))

    async def _prompt_ids(self, request: _Request, deadline: float) -> list[int]:
        """The request's prompt ids: as given, else from the tokenizer. Raises AioRpcError."""
        if request.input.prompt_ids is not None:
            return list(request.input.prompt_ids)
        with request.trace.active():
            return await self._stages.tokenize(request.id, request.input, deadline)

    def _prompt_refusal(self, ids: list[int]) -> Failed | None:
        """Why a tokenized prompt cannot be submitted, or None: empty; over `max_prompt_tokens` (the
        gateway's own cap, when set); else, once the tokenizer's Info is known, the engine's rule
        early: a prompt must leave the context room for one token (prompt < context length). The
        engine owns that rule (it refuses the same prompt, and a prompt and max tokens past its
        context); refusing it here spares routing, which hashes the prompt's blocks."""
        if not ids:
            return Failed(INVALID_ARGUMENT, "the prompt is empty")
        cap = self._settings.max_prompt_tokens
        if cap and len(ids) > cap:
            return Failed(INVALID_ARGUMENT, f"the prompt has {len(ids)} tokens, more than the {cap} allowed")
        context = self._stages.info.context_length if self._stages.info is not None else 0
        if not cap and context and len(ids) >= context:
            return Failed(
                INVALID_ARGUMENT, f"the prompt has {len(ids)} tokens, more than the {context - 1} allowed "
                f"(the context length is {context}, and the output needs at least one token of it)"
            )  # fmt: skip
        return None

    def _submit(
        self,
        request: _Request,
        ids: list[int],
        deadline: float,
        detok_address: str,
        engine_address: str,
    ) -> None:
        """Opens the request's decoding state, then submits it to the engine (in that order, so that
        its first chunk always finds the state), on the replicas given. The engine gets the time left
        until `deadline` (`time.monotonic()`), so it ends the request itself if the gateway's own timer
        cannot."""
        request.prompt_tokens = len(ids)
        request.deadline = deadline
        detok_context, engine_context = request.trace.submit_contexts()
        detok = self._stages.detok_link(detok_address)
        engine = self._stages.engine_link(engine_address)
        request.detok_link, request.engine_link = detok, engine
        detok.request_ids.add(request.id)
        engine.request_ids.add(request.id)
        inp, context = request.input, self._settings.detokenizer_context_ids
        start = detokenizer_pb2.DetokenizeStart(  # the last prompt ids as context, the stop strings
            request_id=request.id,
            prompt_ids=ids[-context:] if context else [],
            skip_special_tokens=inp.skip_special_tokens,
            keep_special_ids=list(inp.keep_special_ids),
            stop=list(inp.stopping.stop),
            include_stop_str_in_output=inp.stopping.include_stop_str_in_output,
            trace_context=detok_context,
        )
        detok.send(detokenizer_pb2.DetokenizeInEntry(start=start))
        request.submit = engine_pb2.GenerateRequest(
            request_id=request.id,
            prompt_ids=ids,
            sampling=inp.sampling,
            stopping=inp.stopping,  # max_new_tokens 0: the engine fills the rest of its context
            trace_context=engine_context,
        )
        self._send_submit(request, engine)

    def _send_submit(self, request: _Request, engine: EngineLink) -> None:
        """Submits the request on `engine` with the time left until its deadline."""
        assert request.submit is not None
        request.submit.timeout_ms = max(1, int(1000 * (request.deadline - time.monotonic())))
        request.engine_tries += 1
        engine.send(engine_pb2.EngineIn(submit=request.submit))

    # ----- upstream messages (synchronous: no await between reading a message and acting on it)

    def _on_engine_out(self, link: EngineLink, out: engine_pb2.EngineOut) -> None:
        for entry in out.entries:
            if entry.WhichOneof("kind") == "chunk":
                self._on_token_chunk(entry.chunk, out.batch_size)
            else:
                self._on_engine_final(entry.final)

    def _on_token_chunk(self, chunk: engine_pb2.TokenChunk, batch_size: int) -> None:
        request = self._requests.get(chunk.request_id)
        if request is None or request.engine_done or request.detok_link is None:
            return
        if not request.num_generated:
            request.trace.on_chunk(batch_size)
        if not request.prompt_out and request.input.sampling.HasField("prompt_logprobs"):
            request.prompt_out = True
            assert request.submit is not None
            request.slot.push_prompt(list(request.submit.prompt_ids), list(chunk.prompt_logprobs))
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
            not _finish_reason(final)
            and errors.code_name(final.error_code) == UNAVAILABLE
            and failed is not None
            and self._retry_engine(request, failed.address)
        ):
            return
        request.engine_final = final
        request.trace.engine_done(final.error)
        if not _finish_reason(final):
            self._finish(request, engine_failure(request.id, final.error, final.error_code))
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
        request.trace.detok_done(final.error)
        if final.error:
            self._finish(request, Failed(INTERNAL, f"detokenizer: {final.error}"))
        elif final.stopped:
            self._hand_out(request, "", final.num_ids_consumed)
            cached = request.engine_final.usage.cached_tokens if request.engine_final is not None else 0
            self._finish(request, Done("stop", request.prompt_tokens, request.ids_out, final.stop, cached))
        elif request.engine_final is not None:
            usage = request.engine_final.usage
            self._hand_out(request, "", final.num_ids_consumed)
            reason = _finish_reason(request.engine_final)
            prompt_tokens = usage.prompt_tokens or request.prompt_tokens
            done = Done(reason, prompt_tokens, request.ids_out, cached_tokens=usage.cached_tokens)
            self._finish(request, done)
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
            request.trace.on_text()
            request.slot.push(text, ids, logprobs)

    def _on_broken(self, link: EngineLink | DetokLink, reason: str) -> None:
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
        address = self._stages.retry_engine(failed, list(request.submit.prompt_ids))
        if address is None:
            return False
        engine = self._stages.engine_link(address)
        log.info(
            "request %s: engine %s failed before its first token; retried on %s", request.id, failed, address
        )
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
                close = detokenizer_pb2.DetokenizeClose(request_id=request.id)
                detok.send(detokenizer_pb2.DetokenizeInEntry(close=close))
        if isinstance(event, Done):
            request.trace.finish(
                event.finish_reason,
                finish_reason=event.finish_reason,
                output_tokens=event.completion_tokens,
            )
        else:
            request.trace.finish(event.code, error=event.message)
        request.slot.finish(event)
        if not self._requests:
            self._idle.set()
