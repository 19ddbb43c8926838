"""Trace spans and metrics of the gateway's generations (used by gateway/pipeline.py).

One `RequestTrace` per generation: every method is cheap and safe in any order (a request may fail at
any point) and `finish` runs once. When tracing is on it owns the generation's `sluice.gateway.generate`
span (SERVER, or INTERNAL under a local span), child of the caller's W3C context, and the CLIENT spans of
the request on the multiplexed Detokenizer and Engine streams, whose contexts `submit_contexts` gives for
the `trace_context` fields. Metrics (always): requests by API and outcome, in flight, time to first
text, end to end, and the stage durations. The span tree and metric names: docs/architecture.md
("Observability").
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator, Mapping

from opentelemetry import trace
from opentelemetry.trace import SpanKind, Status, StatusCode

from services.common import telemetry
from services.common.metrics import GatewayMetrics

_tracer = telemetry.get_tracer(__name__)


class RequestTrace:
    """Timing and spans of one generation; every method is cheap and safe to call in any order
    (a request may fail at any point), and `finish` runs once."""

    def __init__(
        self,
        metrics: GatewayMetrics,
        request_id: str,
        api: str,
        trace_context: Mapping[str, str],
        attributes: Mapping[str, object],
    ) -> None:
        self.metrics = metrics
        self.api = api or "internal"
        self.arrival = time.monotonic()
        self.submitted = 0.0
        self.first_chunk = 0.0
        self.first_text = 0.0
        self.batch_at_first_token = 0
        self.span: trace.Span | None = None
        self.engine_span: trace.Span | None = None
        self.detok_span: trace.Span | None = None
        metrics.in_flight.inc()
        if telemetry.tracing_enabled():
            if trace_context:
                parent, kind = telemetry.extract(trace_context), SpanKind.SERVER
            else:
                local = trace.get_current_span().get_span_context().is_valid
                parent, kind = None, (SpanKind.INTERNAL if local else SpanKind.SERVER)
            own = {"sluice.request_id": request_id, "sluice.api": self.api, "gen_ai.operation.name": "chat"}
            self.span = _tracer.start_span(
                "sluice.gateway.generate", context=parent, kind=kind, attributes={**own, **attributes}
            )

    def set_attribute(self, key: str, value: str | int | float) -> None:
        if self.span is not None:
            self.span.set_attribute(key, value)

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        """Makes the generation's span current (for the Tokenize call's client span)."""
        if self.span is None:
            yield
            return
        with trace.use_span(self.span, end_on_exit=False):
            yield

    def tokenized(self, num_ids: int) -> None:
        self.metrics.stage_duration.labels("tokenize").observe(time.monotonic() - self.arrival)
        self.set_attribute("gen_ai.usage.input_tokens", num_ids)

    def submit_contexts(self) -> tuple[dict[str, str], dict[str, str]]:
        """Starts the detokenizer and engine CLIENT spans; returns their contexts for the
        DetokenizeStart and GenerateRequest messages (empty when tracing is off)."""
        self.submitted = time.monotonic()
        if self.span is None:
            return {}, {}
        parent = trace.set_span_in_context(self.span)
        rpc = {"rpc.system": "grpc"}
        self.detok_span = _tracer.start_span(
            "sluice.v1.Detokenizer/Stream", context=parent, kind=SpanKind.CLIENT, attributes=rpc
        )
        self.engine_span = _tracer.start_span(
            "sluice.v1.Engine/Stream", context=parent, kind=SpanKind.CLIENT, attributes=rpc
        )
        return (
            telemetry.inject(ctx=trace.set_span_in_context(self.detok_span)),
            telemetry.inject(ctx=trace.set_span_in_context(self.engine_span)),
        )

    def on_chunk(self, batch_size: int) -> None:
        """Token ids arrived from the engine (in a step of `batch_size` requests, 0 if unknown)."""
        if self.first_chunk:
            return
        self.first_chunk = time.monotonic()
        self.batch_at_first_token = batch_size
        if self.submitted:
            waited = self.first_chunk - self.submitted
            self.metrics.stage_duration.labels("engine_first_token").observe(waited)

    def on_text(self) -> None:
        """Text (or ids) went to the client."""
        if self.first_text:
            return
        self.first_text = time.monotonic()
        self.metrics.ttft.observe(self.first_text - self.arrival)
        if self.first_chunk:
            self.metrics.stage_duration.labels("detokenize").observe(self.first_text - self.first_chunk)

    def engine_done(self, error: str = "") -> None:
        self.engine_span = _end(self.engine_span, error)

    def detok_done(self, error: str = "") -> None:
        self.detok_span = _end(self.detok_span, error)

    def finish(
        self, outcome: str, *, finish_reason: str = "", output_tokens: int = 0, error: str = ""
    ) -> None:
        """The generation ended: `outcome` is a finish reason ("stop", ...) or an error code."""
        now = time.monotonic()
        m = self.metrics
        m.in_flight.dec()
        m.requests.labels(self.api, outcome).inc()
        m.e2e.observe(now - self.arrival)
        self.engine_span = _end(self.engine_span, "")
        self.detok_span = _end(self.detok_span, "")
        span = self.span
        if span is None:
            return
        self.span = None
        if finish_reason:
            span.set_attribute("gen_ai.response.finish_reasons", [finish_reason])
            span.set_attribute("gen_ai.usage.output_tokens", output_tokens)
        if self.first_text:
            span.set_attribute("sluice.time_to_first_token_s", self.first_text - self.arrival)
        if self.first_chunk:
            span.set_attribute("sluice.batch_size_at_first_token", self.batch_at_first_token)
        if error:
            span.set_attribute("error.type", outcome)
            span.set_status(Status(StatusCode.ERROR, error))
        span.end()


def _end(span: trace.Span | None, error: str) -> None:
    if span is not None:
        if error:
            span.set_status(Status(StatusCode.ERROR, error))
        span.end()
    return None


TRACE_KEYS = ("traceparent", "tracestate")


def trace_context_from(get: Callable[[str], object]) -> dict[str, str]:
    """The W3C trace context among headers, metadata or a JSON frame (`get(key)` → value or None):
    string `traceparent` / `tracestate` values only."""
    found = {key: get(key) for key in TRACE_KEYS}
    return {key: value for key, value in found.items() if isinstance(value, str) and value}
