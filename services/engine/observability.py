"""Metrics and trace spans of the engine core, recorded on the engine thread once per request event
and once per step (never per token).

The engine calls, on its own thread: `on_arrival(request, trace_context)` when a request is added,
`on_scheduled(sched)` after the scheduler built a step, and `on_step_end(sched, outputs, step_s)` at the
end of every step that ran the model (`sched=None` for steps that only emitted finals). Per request it
keeps a few `time.monotonic()` timestamps (arrival, first schedule, first token, last token) until its
final. Spans only when tracing is on; `RouterGauges` are the gauges inference routers read, under
vLLM's names; an MoE model's `ExpertCounts` feed the expert metrics. Span tree, metric names and the
gauges' meanings: docs/architecture.md ("Observability").
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol

import numpy as np
from opentelemetry import trace
from opentelemetry.trace import Link, SpanKind, Status, StatusCode
from prometheus_client import CollectorRegistry, Gauge

from services.common import telemetry
from services.common.metrics import EngineMetrics, observe_many
from services.engine.core.params import RequestOutput
from services.engine.core.request import Request
from services.engine.core.scheduler import SchedulerOutput
from services.engine.core.stats import StatsRecorder

MAX_STEP_LINKS = 128


class ExpertCounts(Protocol):
    """Where the expert load comes from (executor/moe.py `ExpertLoad`)."""

    layers: list[int]  # decoder layer index of each row of a step's counts

    def take(self) -> list[np.ndarray]:
        """(layers, experts) tokens routed, one array per step finished since the previous call."""
        ...


def max_load_ratio(counts: np.ndarray) -> float | None:
    """The largest, over the MoE layers that routed tokens, of the most loaded expert's tokens over the
    mean per expert (1 = every expert equally loaded, num_experts / top_k = every token on the same top-k);
    None when no layer routed any. `counts`: (layers, experts)."""
    totals = counts.sum(axis=1)
    routed = totals > 0
    if not routed.any():
        return None
    mean = totals[routed] / counts.shape[1]
    return float((counts[routed].max(axis=1) / mean).max())


class RouterGauges:
    """The model-server gauges of inference routers, under vLLM's names (docs/architecture.md)."""

    def __init__(
        self, registry: CollectorRegistry, model_name: str, block_size: int, num_blocks: int
    ) -> None:
        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, ["model_name"], registry=registry).labels(model_name)

        self.waiting = gauge("vllm:num_requests_waiting", "Requests waiting to be scheduled.")
        self.running = gauge("vllm:num_requests_running", "Requests in the running batch.")
        self.kv_usage = gauge("vllm:kv_cache_usage_perc", "KV cache usage, 1 = 100%.")
        self.kv_usage_legacy = gauge("vllm:gpu_cache_usage_perc", "KV cache usage, 1 = 100% (older name).")
        info = Gauge(
            "vllm:cache_config_info",
            "KV cache shape: tokens per block, blocks in the pool.",
            ["model_name", "block_size", "num_gpu_blocks"],
            registry=registry,
        )
        info.labels(model_name, str(block_size), str(num_blocks)).set(1)

    def update(self, waiting: int, running: int, kv_usage: float) -> None:
        self.waiting.set(waiting)
        self.running.set(running)
        self.kv_usage.set(kv_usage)
        self.kv_usage_legacy.set(kv_usage)


@dataclass
class _Timeline:
    """What the observer remembers of one request in flight."""

    request: Request
    span: trace.Span | None
    first_scheduled: float = 0.0
    first_token: float = 0.0
    last_token: float = 0.0
    batch_at_first_token: int = 0


class EngineObserver:
    """Owns nothing of the engine: it reads the engine's figures from its `StatsRecorder` (`stats`) for the
    gauges and counters, and records metrics into `metrics` (and spans when tracing is on)."""

    def __init__(
        self,
        metrics: EngineMetrics,
        *,
        stats: StatsRecorder,
        model_name: str,
        step_sample_rate: float = 0.0,
        expert_load: ExpertCounts | None = None,
    ) -> None:
        self.metrics = metrics
        self.expert_load = expert_load
        self.stats = stats
        self.model_name = model_name
        self.step_sample_rate = step_sample_rate
        self.tracer = telemetry.get_tracer(__name__)
        self.timelines: dict[str, _Timeline] = {}
        self._wall_offset_ns = time.time_ns() - time.monotonic_ns()
        self.last_batch_size = 0  # requests in the latest step (read by the servicer's thread)
        self._step_credit = 0.0
        self._preemptions = 0
        self._prefix_queries = 0
        self._prefix_hits = 0
        first = stats.snapshot()
        self.router_gauges = RouterGauges(metrics.registry, model_name, first.block_size, first.num_blocks)
        self._update_gauges()

    def _wall_ns(self, monotonic_s: float) -> int:
        return int(monotonic_s * 1e9) + self._wall_offset_ns

    # ---- events ---------------------------------------------------------------------------------

    def on_arrival(self, request: Request, trace_context: Mapping[str, str] | None = None) -> None:
        """A request was queued (its `arrival_time` set). `trace_context` is the caller's W3C context
        (a request message's `trace_context`, or the call's)."""
        span = None
        if telemetry.tracing_enabled():
            sampling, stopping = request.sampling, request.stopping
            # AsyncEngine names a request `<caller key>/<caller's id>`; the caller's id is the one to show.
            caller_id = request.request_id.partition("/")[2] or request.request_id
            span = self.tracer.start_span(
                "sluice.engine.generate",
                context=telemetry.extract(trace_context or {}),
                kind=SpanKind.SERVER,
                start_time=self._wall_ns(request.arrival_time),
                attributes={
                    "sluice.request_id": caller_id,
                    "gen_ai.operation.name": "text_completion",
                    "gen_ai.request.model": self.model_name,
                    "gen_ai.request.max_tokens": stopping.max_new_tokens,
                    "gen_ai.request.temperature": sampling.temperature,
                    "gen_ai.request.top_p": sampling.top_p,
                    "gen_ai.usage.input_tokens": request.num_prompt_tokens,
                },
            )
        self.timelines[request.request_id] = _Timeline(request, span)

    def on_scheduled(self, sched: SchedulerOutput) -> None:
        now = time.monotonic()
        queued: list[float] = []
        timelines = self.timelines
        for request, _ in sched.scheduled:
            timeline = timelines.get(request.request_id)
            if timeline is not None and not timeline.first_scheduled:
                timeline.first_scheduled = now
                queued.append(now - request.arrival_time)
        if queued:
            observe_many(self.metrics.queue_time, queued)

    def on_step_end(self, sched: SchedulerOutput | None, outputs: list[RequestOutput], step_s: float) -> None:
        now = time.monotonic()
        m = self.metrics
        batch = len(sched.scheduled) if sched is not None else 0
        step_links = self._sampled_step_links(sched) if sched is not None else None
        itl: list[float] = []
        ttft: list[float] = []
        generated = 0
        timelines = self.timelines
        for out in outputs:
            timeline = timelines.get(out.request_id)
            if timeline is None:
                continue
            if out.new_token_ids:
                generated += len(out.new_token_ids)
                if timeline.first_token:
                    itl.append(now - timeline.last_token)
                else:
                    timeline.first_token = now
                    timeline.batch_at_first_token = batch
                    ttft.append(now - timeline.request.arrival_time)
                timeline.last_token = now
            if out.finished:
                del timelines[out.request_id]
                self._finish(timeline, out, now)
        if generated:
            m.generation_tokens.inc(generated)
        observe_many(m.itl, itl)
        observe_many(m.ttft, ttft)
        if sched is not None:
            self.last_batch_size = batch
            m.batch_size.observe(batch)
            m.step_tokens.observe(sched.num_tokens)
            m.step_duration.observe(step_s)
            if sched.spec_accepted_lengths:
                self._count_speculation(sched)
            if step_links is not None:
                self._step_span(sched, step_links, now, step_s)
        if self.expert_load is not None:
            self._count_experts(self.expert_load)
        self._update_gauges()

    # ---- per request ----------------------------------------------------------------------------

    def _finish(self, timeline: _Timeline, out: RequestOutput, now: float) -> None:
        m = self.metrics
        request = timeline.request
        reason = out.finish_reason or "error"
        m.requests.labels(reason).inc()
        m.prompt_tokens.inc(out.prompt_tokens)
        m.e2e.observe(now - request.arrival_time)
        if timeline.first_token:
            m.prefill_time.observe(timeline.first_token - timeline.first_scheduled)
            m.decode_time.observe(now - timeline.first_token)
        if timeline.span is not None:
            self._end_span(timeline, out, now)

    def _end_span(self, timeline: _Timeline, out: RequestOutput, now: float) -> None:
        span = timeline.span
        assert span is not None
        request = timeline.request
        parent = trace.set_span_in_context(span)
        phases = (
            ("queue", request.arrival_time, timeline.first_scheduled or now),
            ("prefill", timeline.first_scheduled, timeline.first_token),
            ("decode", timeline.first_token, now),
        )
        for name, start, end in phases:
            if start and end:
                child = self.tracer.start_span(name, context=parent, start_time=self._wall_ns(start))
                child.end(end_time=self._wall_ns(end))
        span.set_attribute("gen_ai.usage.output_tokens", out.completion_tokens)
        span.set_attribute("gen_ai.response.finish_reasons", [out.finish_reason or "error"])
        span.set_attribute("sluice.num_preemptions", request.num_preemptions)
        span.set_attribute("sluice.num_cached_tokens", request.num_cached_tokens)
        if timeline.first_token:
            span.set_attribute("sluice.time_to_first_token_s", timeline.first_token - request.arrival_time)
            span.set_attribute("sluice.batch_size_at_first_token", timeline.batch_at_first_token)
        if out.finish_reason == "error":
            span.set_status(Status(StatusCode.ERROR, f"{out.error_code or 'error'}: {out.error or ''}"))
        span.end(end_time=self._wall_ns(now))

    # ---- per step -------------------------------------------------------------------------------

    def _sampled_step_links(self, sched: SchedulerOutput) -> list[Link] | None:
        """Links to the requests of this step when it is one of the sampled steps (a deterministic
        `step_sample_rate` share), else None."""
        if not self.step_sample_rate or not telemetry.tracing_enabled():
            return None
        self._step_credit += self.step_sample_rate
        if self._step_credit < 1.0:
            return None
        self._step_credit -= 1.0
        links = []
        for request, _ in sched.scheduled[:MAX_STEP_LINKS]:
            timeline = self.timelines.get(request.request_id)
            if timeline is not None and timeline.span is not None:
                links.append(Link(timeline.span.get_span_context()))
        return links

    def _step_span(self, sched: SchedulerOutput, links: list[Link], now: float, step_s: float) -> None:
        span = self.tracer.start_span(
            "sluice.engine.step",
            context=telemetry.extract({}),
            links=links,
            start_time=self._wall_ns(now - step_s),
            attributes={
                "sluice.batch_size": len(sched.scheduled),
                "sluice.step_tokens": sched.num_tokens,
                "sluice.preempted": len(sched.preempted),
            },
        )
        span.end(end_time=self._wall_ns(now))

    def _count_speculation(self, sched: SchedulerOutput) -> None:
        """The drafts a step verified: proposed and accepted counts, and each request's accepted length."""
        m = self.metrics
        lengths = sched.spec_accepted_lengths
        m.spec_proposed.inc(sched.num_draft_tokens)
        m.spec_accepted.inc(sum(lengths) - len(lengths))
        observe_many(m.spec_accepted_length, lengths)

    def _count_experts(self, source: ExpertCounts) -> None:
        """The expert load of the steps the runner finished since the previous step's end."""
        m = self.metrics
        for counts in source.take():
            m.expert_tokens.add(source.layers, counts)
            ratio = max_load_ratio(counts)
            if ratio is not None:
                m.expert_load_ratio.observe(ratio)

    def _update_gauges(self) -> None:
        m, s = self.metrics, self.stats.snapshot()
        kv_usage = 1.0 - s.free_blocks / s.num_blocks if s.num_blocks else 0.0
        m.running.set(s.running)
        m.waiting.set(s.waiting)
        m.kv_usage.set(kv_usage)
        self.router_gauges.update(s.waiting, s.running, kv_usage)
        if s.num_preemptions != self._preemptions:
            m.preemptions.inc(s.num_preemptions - self._preemptions)
            self._preemptions = s.num_preemptions
        queries, hits = s.prefix_query_blocks, s.prefix_hit_blocks
        if queries != self._prefix_queries:
            m.prefix_queries.inc((queries - self._prefix_queries) * s.block_size)
            m.prefix_hits.inc((hits - self._prefix_hits) * s.block_size)
            self._prefix_queries, self._prefix_hits = queries, hits
