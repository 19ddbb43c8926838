"""Prometheus metrics of every service, one `ServiceMetrics` class per service, each with its own registry.

Contract: a service's `create_server` creates its metrics object (`TokenizerMetrics()`, ...), hands it to
the core that observes (servicer, engine observer, gateway pipeline) and returns it in its
`ServerHandle`; nothing is module-global. `render` gives a registry's exposition for the gateway's
`/metrics`; `serve_metrics` / `maybe_serve_metrics` serve one on its own thread (`--metrics-port`, 0 =
none). Intervals are `time.monotonic()` within one process; histograms are in seconds. The names are a
contract too (the Grafana dashboard and the tests read them; `exposed_names` lists every sample):
docs/architecture.md ("Observability") has the table.
"""

from __future__ import annotations

import bisect
import logging
import threading
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    ProcessCollector,
    generate_latest,
    start_http_server,
)
from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

from services.common import errors

log = logging.getLogger(__name__)

# Bucket upper bounds, seconds unless named otherwise.
TTFT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
ITL_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.015,
    0.02,
    0.025,
    0.03,
    0.04,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
)
REQUEST_BUCKETS = (
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    60.0,
    120.0,
    240.0,
    480.0,
)
STEP_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
CPU_STAGE_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)
COUNT_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)
SPEC_LENGTH_BUCKETS = (1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 16)
LOAD_RATIO_BUCKETS = (1.0, 1.1, 1.25, 1.5, 2.0, 2.5, 3.0, 4.0, 6.0, 8.0, 16.0, 32.0, 64.0)

GATEWAY_STAGES = ("tokenize", "engine_first_token", "detokenize")  # see gateway/observability.py


class ServiceMetrics:
    """The metrics of one service, in `registry`: its own (with the process collector), so that
    several services in one process (tests, benchmarks) never share a metric."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        ProcessCollector(registry=self.registry)

    def _histogram(
        self, name: str, doc: str, buckets: Sequence[float], labels: Sequence[str] = ()
    ) -> Histogram:
        return Histogram(name, doc, labels, buckets=buckets, registry=self.registry)

    def _counter(self, name: str, doc: str, labels: Sequence[str] = ()) -> Counter:
        return Counter(name, doc, labels, registry=self.registry)

    def _gauge(self, name: str, doc: str) -> Gauge:
        return Gauge(name, doc, registry=self.registry)


class EngineMetrics(ServiceMetrics):
    """Engine metrics. Per request: `queue_time`, `prefill_time`, `ttft`, `decode_time`, `e2e` once;
    `itl` once per step in which it got tokens (the step's interval divided over its tokens is not
    done: one observation per step and request). Per step: `batch_size` (requests in the step),
    `step_tokens` (tokens computed, speculative drafts included), `step_duration`, and the gauges.
    Speculative decoding, per step that verified drafts: `spec_proposed` and `spec_accepted` (drafts),
    and `spec_accepted_length` once per request with drafts (tokens its verification emitted).
    `loop_recoveries`: failures of the step loop recovered in-process (services/engine/server.py)."""

    def __init__(self) -> None:
        super().__init__()
        histogram, counter, gauge = self._histogram, self._counter, self._gauge
        self.ttft = histogram(
            "sluice_time_to_first_token_seconds", "Arrival at the engine to first token.", TTFT_BUCKETS
        )
        self.itl = histogram(
            "sluice_inter_token_latency_seconds",
            "Time between successive output tokens of a request.",
            ITL_BUCKETS,
        )
        self.e2e = histogram(
            "sluice_e2e_request_latency_seconds", "Arrival at the engine to finish.", REQUEST_BUCKETS
        )
        self.queue_time = histogram(
            "sluice_request_queue_time_seconds", "Arrival to first schedule.", REQUEST_BUCKETS
        )
        self.prefill_time = histogram(
            "sluice_request_prefill_time_seconds", "First schedule to first token.", REQUEST_BUCKETS
        )
        self.decode_time = histogram(
            "sluice_request_decode_time_seconds", "First token to finish.", REQUEST_BUCKETS
        )
        self.running = gauge("sluice_requests_running", "Requests in the running batch.")
        self.waiting = gauge("sluice_requests_waiting", "Requests waiting to be scheduled.")
        self.kv_usage = gauge("sluice_kv_cache_usage_ratio", "Fraction of KV cache blocks in use (0..1).")
        self.prompt_tokens = counter("sluice_prompt_tokens", "Prompt tokens of finished requests.")
        self.generation_tokens = counter("sluice_generation_tokens", "Tokens generated.")
        self.requests = counter("sluice_requests", "Finished requests by finish reason.", ["finish_reason"])
        for reason in errors.FINISH_REASONS:
            self.requests.labels(reason)
        self.prefix_queries = counter(
            "sluice_prefix_cache_queries", "Prompt tokens looked up in the prefix cache."
        )
        self.prefix_hits = counter("sluice_prefix_cache_hits", "Prompt tokens found in the prefix cache.")
        self.preemptions = counter(
            "sluice_preemptions", "Requests preempted (KV blocks freed, recomputed later)."
        )
        self.batch_size = histogram("sluice_batch_size", "Requests in one engine step.", COUNT_BUCKETS)
        self.step_tokens = histogram(
            "sluice_step_tokens", "Tokens computed in one engine step.", COUNT_BUCKETS
        )
        self.step_duration = histogram(
            "sluice_step_duration_seconds", "Wall time of one engine step.", STEP_BUCKETS
        )
        self.spec_proposed = counter("sluice_spec_proposed_tokens", "Speculative draft tokens verified.")
        self.spec_accepted = counter("sluice_spec_accepted_tokens", "Speculative draft tokens accepted.")
        self.spec_accepted_length = histogram(
            "sluice_spec_accepted_length",
            "Tokens emitted by one verification of a request's drafts (accepted drafts + 1).",
            SPEC_LENGTH_BUCKETS,
        )
        self.loop_recoveries = counter(
            "sluice_engine_loop_recoveries",
            "Failures of the engine's step loop recovered in-process (requests ended, model kept).",
        )
        self.expert_load_ratio = histogram(
            "sluice_moe_expert_load_ratio",
            "Per step: the most loaded expert's routed tokens over the mean per expert, in the step's most "
            "unbalanced MoE layer (1 = balanced).",
            LOAD_RATIO_BUCKETS,
        )
        self.expert_tokens = ExpertTokens()
        self.registry.register(self.expert_tokens)


class ExpertTokens(Collector):
    """`sluice_moe_expert_tokens_total{layer,expert}`: running totals of the tokens routed to each expert
    of each MoE layer, added to once per step (`add`, one array addition) and turned into samples only
    when scraped. No samples for a dense model."""

    def __init__(self) -> None:
        self.layers: list[int] = []
        self.totals: np.ndarray | None = None  # (layers, experts) int64

    def add(self, layers: Sequence[int], counts: np.ndarray) -> None:
        """One step's counts, (len(layers), experts); `layers` are the decoder layer indices of its rows."""
        if self.totals is None:
            self.layers = list(layers)
            self.totals = np.zeros(counts.shape, dtype=np.int64)
        self.totals += counts

    def collect(self) -> list[CounterMetricFamily]:
        family = CounterMetricFamily(
            "sluice_moe_expert_tokens",
            "Tokens routed to each expert of each MoE layer (a token once per expert of its top-k).",
            labels=["layer", "expert"],
        )
        totals = self.totals
        if totals is not None:
            for row, layer in enumerate(self.layers):
                for expert, value in enumerate(totals[row].tolist()):
                    family.add_metric([str(layer), str(expert)], value)
        return [family]


class TokenizerMetrics(ServiceMetrics):
    """`duration`: one observation per tokenize request (arrival at the servicer to ids ready);
    `batch_size`: requests per encode batch."""

    def __init__(self) -> None:
        super().__init__()
        self.duration = self._histogram(
            "sluice_tokenize_duration_seconds", "Tokenize request, arrival to ids.", CPU_STAGE_BUCKETS
        )
        self.batch_size = self._histogram(
            "sluice_tokenize_batch_size", "Requests in one encode batch.", COUNT_BUCKETS
        )


class DetokenizerMetrics(ServiceMetrics):
    """`duration`: one observation per batch of stream messages processed together (arrival of the
    batch to its deltas ready) and per Decode call; `batch_size`: jobs per worker batch."""

    def __init__(self) -> None:
        super().__init__()
        self.duration = self._histogram(
            "sluice_detokenize_duration_seconds", "Detokenize work, arrival to text.", CPU_STAGE_BUCKETS
        )
        self.batch_size = self._histogram(
            "sluice_detokenize_batch_size", "Jobs in one decode batch.", COUNT_BUCKETS
        )


class GatewayMetrics(ServiceMetrics):
    """Gateway metrics, seen from the client's side of the pipeline. `stage_duration{stage}`:
    tokenize call, submit to first token from the engine, and each detokenize round trip."""

    def __init__(self) -> None:
        super().__init__()
        self.requests = self._counter(
            "sluice_gateway_requests", "Requests answered, by API and outcome.", ["api", "outcome"]
        )
        self.in_flight = self._gauge("sluice_gateway_requests_in_flight", "Requests in progress.")
        self.ttft = self._histogram(
            "sluice_gateway_time_to_first_token_seconds",
            "Request arrival at the gateway to first text sent.",
            TTFT_BUCKETS,
        )
        self.e2e = self._histogram(
            "sluice_gateway_e2e_request_latency_seconds",
            "Request arrival at the gateway to its end.",
            REQUEST_BUCKETS,
        )
        self.stage_duration = self._histogram(
            "sluice_gateway_stage_duration_seconds",
            "Time spent in each upstream stage.",
            TTFT_BUCKETS,
            ["stage"],
        )
        for stage in GATEWAY_STAGES:
            self.stage_duration.labels(stage)


def observe_many(histogram: Histogram, values: Sequence[float]) -> None:
    """`histogram.observe(v)` for every value, one locked update per bucket touched instead of two per
    value (for per-request observations inside one engine step). `histogram` has no labels, or is a
    labelled child."""
    if len(values) < 4:
        for value in values:
            histogram.observe(value)
        return
    bounds = histogram._upper_bounds  # inclusive upper bounds, the last one +Inf
    counts = [0] * len(bounds)
    for value in values:
        counts[bisect.bisect_left(bounds, value)] += 1
    for bucket, count in zip(histogram._buckets, counts, strict=True):
        if count:
            bucket.inc(count)
    histogram._sum.inc(sum(values))


def render(registry: CollectorRegistry) -> tuple[bytes, str]:
    """The exposition text of `registry` and its content type (for an HTTP `/metrics` handler)."""
    return generate_latest(registry), CONTENT_TYPE_LATEST


@dataclass
class MetricsEndpoint:
    """A running `/metrics` HTTP server on its own thread; `close` stops it."""

    port: int
    _server: object
    _thread: threading.Thread

    def close(self) -> None:
        self._server.shutdown()  # type: ignore[attr-defined]
        self._server.server_close()  # type: ignore[attr-defined]
        self._thread.join(timeout=5.0)


def serve_metrics(registry: CollectorRegistry, host: str, port: int) -> MetricsEndpoint:
    """Serves `registry` at http://host:port/metrics on a daemon thread (port 0 = any free port)."""
    server, thread = start_http_server(port, addr=host, registry=registry)
    bound = server.server_address[1]
    log.info("metrics on http://%s:%d/metrics", host, bound)
    return MetricsEndpoint(bound, server, thread)


def maybe_serve_metrics(registry: CollectorRegistry, host: str, port: int) -> MetricsEndpoint | None:
    """`serve_metrics` when the service's `metrics_port` setting is set; None for 0 (off)."""
    if port <= 0:
        return None
    return serve_metrics(registry, host, port)


def exposed_names() -> set[str]:
    """Every sample name the services expose (e.g. `sluice_batch_size_bucket`, `sluice_requests_total`),
    for checking dashboards and alerts against the code."""
    suffixes = {
        "counter": ("_total", "_created"),
        "histogram": ("_bucket", "_sum", "_count", "_created"),
        "gauge": ("",),
    }
    names: set[str] = set()
    for cls in (EngineMetrics, TokenizerMetrics, DetokenizerMetrics, GatewayMetrics):
        for family in cls().registry.collect():
            names.update(family.name + suffix for suffix in suffixes.get(family.type, ("",)))
    return names
