"""gRPC servicer of sluice.v1.Engine: protobuf ↔ the engine core, status codes at the boundary."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Iterable
from typing import Any, TypeVar

import grpc
from google.protobuf.message import Message

from services.common import errors, telemetry
from services.common.pb import common_pb2, engine_pb2, engine_pb2_grpc
from services.engine.core.async_engine import AsyncEngine, Caller
from services.engine.core.grammar import GrammarSpec
from services.engine.core.params import RequestOutput, SamplingParams, StoppingParams, TokenLogprob
from services.engine.core.reports import Report, ReportFeed

log = logging.getLogger(__name__)

M = TypeVar("M", bound=Message)
Entry = TypeVar("Entry", engine_pb2.StepEntry, engine_pb2.GenerateResponse)


def params_from_proto(request: engine_pb2.GenerateRequest) -> tuple[SamplingParams, StoppingParams]:
    """Maps protobuf parameters to the core's, zero values meaning the documented defaults
    (`max_new_tokens` 0: the rest of the context, filled by the engine). Their ranges are checked once,
    by the engine when the request is submitted (`validate_request`, services/engine/core/params.py); a
    structured output whose kind is unknown or whose text is malformed JSON raises GrammarError (a
    ValueError) here."""
    s = request.sampling
    structured = s.structured
    grammar = GrammarSpec(structured.kind, structured.text, structured.strict) if structured.kind else None  # type: ignore[arg-type]
    sampling = SamplingParams(
        temperature=s.temperature,
        top_p=s.top_p or 1.0,
        top_k=s.top_k,
        min_p=s.min_p,
        repetition_penalty=s.repetition_penalty or 1.0,
        presence_penalty=s.presence_penalty,
        frequency_penalty=s.frequency_penalty,
        seed=s.seed if s.HasField("seed") else None,
        logprobs=s.logprobs,
        logit_bias=tuple(sorted(s.logit_bias.items())),
        grammar=grammar,
        prompt_logprobs=s.prompt_logprobs if s.HasField("prompt_logprobs") else None,
    )
    st = request.stopping
    stopping = StoppingParams(
        max_new_tokens=st.max_new_tokens,
        min_new_tokens=st.min_new_tokens,
        stop_token_ids=tuple(st.stop_token_ids),
        ignore_eos=st.ignore_eos,
    )
    return sampling, stopping


def chunk_to_proto(out: RequestOutput) -> engine_pb2.TokenChunk:
    chunk = engine_pb2.TokenChunk(request_id=out.request_id, token_ids=out.new_token_ids)
    _add_logprobs(chunk.logprobs, out.logprobs or ())
    _add_logprobs(chunk.prompt_logprobs, out.prompt_logprobs or ())
    return chunk


def _add_logprobs(field: Any, entries: Iterable[TokenLogprob]) -> None:
    for lp in entries:
        field.add(logprob=lp.logprob, top_token_ids=lp.top_ids, top_logprobs=lp.top_logprobs)


def final_to_proto(out: RequestOutput) -> engine_pb2.RequestFinal:
    reason = errors.FINISH_REASONS.get(out.finish_reason or "", common_pb2.FINISH_REASON_UNSPECIFIED)
    return engine_pb2.RequestFinal(
        request_id=out.request_id,
        finish_reason=reason,
        usage=common_pb2.Usage(
            prompt_tokens=out.prompt_tokens,
            completion_tokens=out.completion_tokens,
            cached_tokens=out.cached_tokens,
        ),
        error=out.error or "",
        error_code=errors.code_value(out.error_code),
    )


def entries_to_proto(
    outputs: Iterable[RequestOutput], entry: type[Entry] = engine_pb2.StepEntry
) -> list[Entry]:
    """One chunk per request that got tokens, then its final if it ended, each an `entry` (a Stream
    message's StepEntry, or Generate's response)."""
    entries: list[Entry] = []
    for out in outputs:
        if out.new_token_ids:
            entries.append(entry(chunk=chunk_to_proto(out)))
        if out.finished:
            entries.append(entry(final=final_to_proto(out)))
    return entries


def fields_from(message: type[M], source: object) -> M:
    """A `message` whose every field is the attribute of `source` of the same name."""
    return message(**{field.name: getattr(source, field.name) for field in message.DESCRIPTOR.fields})


TRACE_KEYS = ("traceparent", "tracestate")


def deadline_of(request: engine_pb2.GenerateRequest, call_remaining_s: float | None) -> float | None:
    """The request's deadline on `time.monotonic()`: the earlier of its `timeout_ms` and the call's
    own gRPC deadline (`call_remaining_s`); None when neither is set."""
    own_s = request.timeout_ms / 1000 if request.timeout_ms else None
    remaining = [r for r in (own_s, call_remaining_s) if r]
    return time.monotonic() + min(remaining) if remaining else None


def trace_context(context: grpc.aio.ServicerContext) -> dict[str, str] | None:
    """The caller's W3C trace context for a request of this call: the current span's (the server
    interceptor continues the call's metadata when tracing is on), else the metadata's, if any."""
    metadata = context.invocation_metadata() or ()
    return telemetry.inject() or {k: v for k, v in metadata if k in TRACE_KEYS and isinstance(v, str)} or None


OutQueue = asyncio.Queue[engine_pb2.EngineOut | None]  # None: the call ends


def report_to_proto(report: Report) -> engine_pb2.EngineReport:
    return engine_pb2.EngineReport(
        load=fields_from(engine_pb2.EngineLoad, report.load),
        snapshot=report.snapshot,
        stored=report.stored,
        removed=report.removed,
        prefix_caching=report.load.prefix_caching,
    )


class EngineServicer(engine_pb2_grpc.EngineServicer):
    def __init__(self, engine: AsyncEngine) -> None:
        self.engine = engine
        settings = engine.engine.settings
        self.report_interval_s = settings.report_interval_ms / 1000.0

    async def Stream(
        self, request_iterator: AsyncIterator[engine_pb2.EngineIn], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[engine_pb2.EngineOut]:
        """Submits and aborts in; one EngineOut per step with this caller's chunks and finals out, and
        load and cache reports (a snapshot first, then changes at most every `report_interval_ms`). Bad
        submits get a final with FINISH_REASON_ERROR; when the call ends its requests are aborted."""
        caller = self.engine.open_caller()
        feed = self.engine.open_feed()
        # One message waits at most: while the writer is behind, outputs merge in the caller and
        # cache changes in the feed, never in a queue here.
        queue: OutQueue = asyncio.Queue(maxsize=1)
        tasks = [
            asyncio.create_task(self._read(request_iterator, caller, trace_context(context))),
            asyncio.create_task(self._pump_outputs(caller, queue)),
            asyncio.create_task(self._pump_reports(feed, queue)),
        ]
        try:
            while (out := await queue.get()) is not None:
                yield out
        finally:
            for task in tasks:
                task.cancel()
            caller.close()
            feed.close()

    async def _pump_outputs(self, caller: Caller, queue: OutQueue) -> None:
        while outputs := await caller.get():
            # Requests in the engine's latest step (0 when unknown).
            batch_size = getattr(self.engine.engine.observer, "last_batch_size", 0)
            await queue.put(engine_pb2.EngineOut(entries=entries_to_proto(outputs), batch_size=batch_size))
        await queue.put(None)

    async def _pump_reports(self, feed: ReportFeed, queue: OutQueue) -> None:
        while True:
            report = await feed.next()
            await queue.put(engine_pb2.EngineOut(report=report_to_proto(report)))
            await asyncio.sleep(self.report_interval_s)

    async def _read(
        self,
        request_iterator: AsyncIterator[engine_pb2.EngineIn],
        caller: Caller,
        trace: dict[str, str] | None,
    ) -> None:
        try:
            async for message in request_iterator:
                kind = message.WhichOneof("kind")
                if kind == "submit":
                    request = message.submit
                    try:
                        self._submit(caller, request, trace, deadline_of(request, None))
                    except ValueError as exc:
                        caller.reject(request.request_id, str(exc))
                elif kind == "abort":
                    caller.abort(message.abort.request_id)
        except asyncio.CancelledError:
            raise
        except Exception:  # the client went away mid-read; the writer side ends the call
            log.debug("engine stream input ended", exc_info=True)
        finally:
            caller.close_input()

    def _submit(
        self,
        caller: Caller,
        request: engine_pb2.GenerateRequest,
        trace: dict[str, str] | None,
        deadline: float | None,
    ) -> None:
        """Submits `request` under its own trace context (a multiplexed stream's request), else `trace`
        (the call's); raises ValueError for parameters the engine refuses."""
        sampling, stopping = params_from_proto(request)
        trace = dict(request.trace_context) or trace
        prompt = list(request.prompt_ids)
        caller.submit(request.request_id, prompt, sampling, stopping, trace_context=trace, deadline=deadline)

    async def Generate(
        self, request: engine_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[engine_pb2.GenerateResponse]:
        """One request per call: chunks, then one final. Bad input → INVALID_ARGUMENT; cancelling the
        call aborts the request."""
        caller = self.engine.open_caller()
        try:
            try:
                self._submit(
                    caller, request, trace_context(context), deadline_of(request, context.time_remaining())
                )
            except ValueError as exc:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
            caller.close_input()
            while outputs := await caller.get():
                for response in entries_to_proto(outputs, engine_pb2.GenerateResponse):
                    yield response
        finally:
            caller.close()

    async def Stats(
        self, request: engine_pb2.StatsRequest, context: grpc.aio.ServicerContext
    ) -> engine_pb2.StatsResponse:
        return fields_from(engine_pb2.StatsResponse, self.engine.stats())
