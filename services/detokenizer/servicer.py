"""gRPC servicer of the detokenizer: protobuf ↔ `incremental.Session`.

Every call owns one Session (its requests' decoding states). The CPU work runs on the worker thread:
the messages a call sent while its previous ones were processed go as one job, batched with other
calls' jobs; one call's messages are processed in order.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import AsyncIterator, Callable
from functools import partial
from typing import Any, TypeVar

import grpc
from opentelemetry import trace

from services.common import telemetry
from services.common.batching import MicroBatcher
from services.common.metrics import DetokenizerMetrics
from services.common.pb import detokenizer_pb2, detokenizer_pb2_grpc
from services.detokenizer.incremental import BadIds, Final, Session, Vocabulary

Job = Callable[[], Any]
T = TypeVar("T")


def _run_jobs(jobs: list[Job]) -> list[Any]:
    """Runs each job; a job's exception becomes its result, so one failure never fails the batch."""
    results: list[Any] = []
    for job in jobs:
        try:
            results.append(job())
        except Exception as exc:
            results.append(exc)
    return results


def process_message(session: Session, message: detokenizer_pb2.DetokenizeIn) -> detokenizer_pb2.DetokenizeOut:
    """All deltas and finals of one message's entries, processed in order. (The hot path: one chunk
    per request per engine step, so lookups are hoisted out of the loop.)"""
    out = detokenizer_pb2.DetokenizeOut()
    add = out.entries.add
    chunk_ids = session.chunk
    for entry in message.entries:
        kind = entry.WhichOneof("kind")
        final: Final | None
        if kind == "chunk":
            chunk = entry.chunk
            request_id = chunk.request_id
            text, num_ids, final = chunk_ids(request_id, chunk.token_ids)
        elif kind == "start":
            start = entry.start
            request_id, text, num_ids = start.request_id, "", 0
            final = session.start(
                request_id,
                prompt_ids=start.prompt_ids,
                skip_special_tokens=start.skip_special_tokens,
                keep_special_ids=start.keep_special_ids,
                stop=start.stop,
                include_stop_str_in_output=start.include_stop_str_in_output,
            )
        elif kind == "close":
            request_id = entry.close.request_id
            text, num_ids, final = session.close(request_id)
        else:
            continue
        if text:
            delta = add().delta
            delta.request_id = request_id
            delta.text = text
            delta.num_ids = num_ids
        if final is not None:
            add().final.CopyFrom(detokenizer_pb2.DetokenizeFinal(**dataclasses.asdict(final)))
    return out


async def read_ahead(items: AsyncIterator[T], limit: int) -> AsyncIterator[list[T]]:
    """The items of a request stream in order, in lists of those that arrived while the previous list
    was processed (at most `limit` each, and at most `limit` read ahead, so a fast writer meets
    back-pressure). Reading overlaps processing; a read error is raised after the items before it."""
    inbox: asyncio.Queue[T | _End] = asyncio.Queue()
    room = asyncio.Semaphore(limit)

    async def read_all() -> None:
        try:
            async for item in items:
                await room.acquire()
                inbox.put_nowait(item)
        finally:
            inbox.put_nowait(_END)

    reader = asyncio.create_task(read_all())
    try:
        done = False
        while not done:
            batch: list[T] = []
            item = await inbox.get()
            while True:
                if isinstance(item, _End):
                    done = True
                    break
                batch.append(item)
                room.release()
                if len(batch) >= limit or inbox.empty():
                    break
                item = inbox.get_nowait()
            if batch:
                yield batch
        await reader
    finally:
        reader.cancel()


class _End:
    """Marks the end of a request stream in `read_ahead`'s queue."""


_END = _End()


class RequestSpans:
    """One SERVER span per request of a stream call, from its start entry (child of the start's
    `trace_context`) to its final or close entry; `close` ends the ones still open (the call ended)."""

    def __init__(self, tracer: trace.Tracer, method: str) -> None:
        self.tracer = tracer
        self.name = f"sluice.v1.Detokenizer/{method}"
        self.open: dict[str, trace.Span] = {}

    def before(self, messages: list[detokenizer_pb2.DetokenizeIn]) -> None:
        for message in messages:
            for entry in message.entries:
                kind = entry.WhichOneof("kind")
                if kind == "start":
                    start = entry.start
                    span = self.tracer.start_span(
                        self.name, context=telemetry.extract(start.trace_context), kind=trace.SpanKind.SERVER
                    )
                    span.set_attribute("sluice.request_id", start.request_id)
                    previous = self.open.pop(start.request_id, None)
                    if previous is not None:
                        previous.end()
                    self.open[start.request_id] = span
                elif kind == "close":
                    self._end(entry.close.request_id, None)

    def after(self, outs: list[detokenizer_pb2.DetokenizeOut]) -> None:
        for out in outs:
            for entry in out.entries:
                if entry.WhichOneof("kind") == "final":
                    self._end(entry.final.request_id, entry.final)

    def _end(self, request_id: str, final: detokenizer_pb2.DetokenizeFinal | None) -> None:
        span = self.open.pop(request_id, None)
        if span is None:
            return
        if final is not None:
            span.set_attribute("sluice.detokenize.stopped", final.stopped)
            if final.error:
                span.set_status(trace.Status(trace.StatusCode.ERROR, final.error))
        span.end()

    def close(self) -> None:
        for span in self.open.values():
            span.end()
        self.open.clear()


class DetokenizerServicer(detokenizer_pb2_grpc.DetokenizerServicer):
    def __init__(
        self,
        vocab: Vocabulary,
        metrics: DetokenizerMetrics,
        *,
        max_batch_size: int,
        remember_finished: int,
        read_ahead: int,
    ) -> None:
        self.vocab = vocab
        self.remember_finished = remember_finished
        self.read_ahead = read_ahead
        self.metrics = metrics
        self.tracer = telemetry.get_tracer(__name__)
        self.batcher: MicroBatcher[Job, Any] = MicroBatcher(
            self._run_jobs, max_batch=max_batch_size, name="detokenize"
        )

    def _run_jobs(self, jobs: list[Job]) -> list[Any]:
        self.metrics.batch_size.observe(len(jobs))
        return _run_jobs(jobs)

    def _spans(self, method: str) -> RequestSpans | None:
        return RequestSpans(self.tracer, method) if telemetry.tracing_enabled() else None

    async def _process(
        self, session: Session, messages: list[detokenizer_pb2.DetokenizeIn], spans: RequestSpans | None
    ) -> list[detokenizer_pb2.DetokenizeOut]:
        """Processes one call's messages in order, on the worker thread."""
        began = time.monotonic()
        if spans is not None:
            spans.before(messages)
        result = await self.batcher.run(lambda: [process_message(session, m) for m in messages])
        self.metrics.duration.observe(time.monotonic() - began)
        if isinstance(result, Exception):
            raise result
        if spans is not None:
            spans.after(result)
        return result

    async def Stream(
        self,
        request_iterator: AsyncIterator[detokenizer_pb2.DetokenizeIn],
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[detokenizer_pb2.DetokenizeOut]:
        """One DetokenizeOut per DetokenizeIn, in order."""
        session = Session(self.vocab, remember_finished=self.remember_finished)
        spans = self._spans("Stream")
        try:
            async for messages in read_ahead(request_iterator, self.read_ahead):
                for out in await self._process(session, messages, spans):
                    yield out
        finally:
            if spans is not None:
                spans.close()

    async def DetokenizeStream(
        self,
        request_iterator: AsyncIterator[detokenizer_pb2.DetokenizeInEntry],
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[detokenizer_pb2.DetokenizeOutEntry]:
        """Out entries as they come; after the request's final, later entries are read and ignored."""
        session = Session(self.vocab, remember_finished=self.remember_finished)
        spans = self._spans("DetokenizeStream")
        finished = False
        try:
            async for entries in read_ahead(request_iterator, self.read_ahead):
                if finished:
                    continue
                message = detokenizer_pb2.DetokenizeIn(entries=entries)
                (out,) = await self._process(session, [message], spans)
                for out_entry in out.entries:
                    yield out_entry
                    if out_entry.WhichOneof("kind") == "final":
                        finished = True
                        break
        finally:
            if spans is not None:
                spans.close()

    async def _with_ids(
        self, ids: list[int], use: Callable[[list[int]], T], context: grpc.aio.ServicerContext
    ) -> T:
        """`use(ids)` on the worker thread once the ids are checked against the vocabulary;
        INVALID_ARGUMENT for an id outside it."""

        def job() -> T:
            self.vocab.check(ids)
            return use(ids)

        began = time.monotonic()
        result = await self.batcher.run(job)
        self.metrics.duration.observe(time.monotonic() - began)
        if isinstance(result, BadIds):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(result))
        if isinstance(result, Exception):
            raise result
        return result

    async def Decode(
        self, request: detokenizer_pb2.DecodeRequest, context: grpc.aio.ServicerContext
    ) -> detokenizer_pb2.DecodeResponse:
        decode = partial(self.vocab.decode, skip_special_tokens=request.skip_special_tokens)
        return detokenizer_pb2.DecodeResponse(text=await self._with_ids(list(request.ids), decode, context))

    async def TokenPieces(
        self, request: detokenizer_pb2.TokenPiecesRequest, context: grpc.aio.ServicerContext
    ) -> detokenizer_pb2.TokenPiecesResponse:
        """Each id's own bytes (`Vocabulary.piece`) and their text; INVALID_ARGUMENT for an id outside
        the vocabulary."""
        pieces = await self._with_ids(
            list(request.ids), lambda ids: list(map(self.vocab.piece, ids)), context
        )
        return detokenizer_pb2.TokenPiecesResponse(
            pieces=[detokenizer_pb2.TokenPiece(text=b.decode("utf-8", "replace"), bytes=b) for b in pieces]
        )

    def close(self) -> None:
        self.batcher.close()
