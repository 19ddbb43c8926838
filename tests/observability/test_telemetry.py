"""Configuration and propagation helpers of services/common/telemetry.py, and the metric names of
services/common/metrics.py (no tracer provider is installed in this process)."""

from __future__ import annotations

import pytest
from opentelemetry import trace

from services.common import metrics, telemetry

TRACEPARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


@pytest.mark.parametrize(
    ("env", "console", "expected"),
    [
        ({}, False, []),
        ({}, True, ["console"]),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4317"}, False, ["otlp"]),
        ({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://c:4318/v1/traces"}, True, ["otlp", "console"]),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4317", "OTEL_TRACES_EXPORTER": "none"}, False, []),
        ({"OTEL_TRACES_EXPORTER": "console,otlp"}, False, ["console", "otlp"]),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4317", "OTEL_SDK_DISABLED": "true"}, True, []),
    ],
)
def test_exporters_follow_the_standard_variables(
    env: dict[str, str], console: bool, expected: list[str]
) -> None:
    assert telemetry.exporters_from_env(env, console=console) == expected


def test_unknown_exporter_is_refused() -> None:
    with pytest.raises(ValueError, match="zipkin"):
        telemetry.exporters_from_env({"OTEL_TRACES_EXPORTER": "zipkin"})


def test_without_tracing_nothing_is_installed_or_injected() -> None:
    assert not telemetry.tracing_enabled()
    assert telemetry.server_interceptors() == []
    assert telemetry.client_interceptors() == []
    assert telemetry.inject() == {}


def test_extract_reads_a_traceparent() -> None:
    ctx = telemetry.extract({"traceparent": TRACEPARENT})
    span_context = trace.get_current_span(ctx).get_span_context()
    assert f"{span_context.trace_id:032x}" == "4bf92f3577b34da6a3ce929d0e0e4736"
    assert f"{span_context.span_id:016x}" == "00f067aa0ba902b7"
    assert span_context.is_remote
    assert not trace.get_current_span(telemetry.extract({})).get_span_context().is_valid
    garbage = telemetry.extract({"traceparent": "garbage"})
    assert not trace.get_current_span(garbage).get_span_context().is_valid
    from_metadata = telemetry.extract_metadata([("traceparent", TRACEPARENT), ("bin-bin", b"\x00")])
    assert trace.get_current_span(from_metadata).get_span_context() == span_context


ISSUE_NAMES = {
    "sluice_time_to_first_token_seconds_bucket",
    "sluice_inter_token_latency_seconds_bucket",
    "sluice_e2e_request_latency_seconds_bucket",
    "sluice_request_queue_time_seconds_bucket",
    "sluice_requests_running",
    "sluice_requests_waiting",
    "sluice_kv_cache_usage_ratio",
    "sluice_prompt_tokens_total",
    "sluice_generation_tokens_total",
    "sluice_requests_total",
    "sluice_prefix_cache_queries_total",
    "sluice_prefix_cache_hits_total",
    "sluice_preemptions_total",
    "sluice_batch_size_bucket",
    "sluice_step_duration_seconds_bucket",
    "sluice_tokenize_duration_seconds_bucket",
    "sluice_detokenize_duration_seconds_bucket",
}


def test_every_metric_of_the_issue_is_defined() -> None:
    assert metrics.exposed_names() >= ISSUE_NAMES


def test_metric_objects_are_independent() -> None:
    first, second = metrics.EngineMetrics(), metrics.EngineMetrics()
    first.requests.labels("stop").inc()
    assert first.registry.get_sample_value("sluice_requests_total", {"finish_reason": "stop"}) == 1
    assert second.registry.get_sample_value("sluice_requests_total", {"finish_reason": "stop"}) == 0
    text, content_type = metrics.render(first.registry)
    assert b'sluice_requests_total{finish_reason="stop"} 1.0' in text
    assert content_type.startswith("text/plain")


def test_metrics_endpoint_serves_and_closes() -> None:
    import httpx

    tok = metrics.TokenizerMetrics()
    tok.duration.observe(0.002)
    assert metrics.maybe_serve_metrics(tok.registry, "127.0.0.1", 0) is None
    endpoint = metrics.serve_metrics(tok.registry, "127.0.0.1", 0)
    try:
        body = httpx.get(f"http://127.0.0.1:{endpoint.port}/metrics", timeout=10).text
        assert "sluice_tokenize_duration_seconds_count 1.0" in body
    finally:
        endpoint.close()


def test_observe_many_equals_observe_one_by_one() -> None:
    values = [0.0, 0.001, 0.0025, 0.0026, 0.3, 0.3, 7.0, 1e9, 0.05]
    one, many = metrics.EngineMetrics(), metrics.EngineMetrics()
    for value in values:
        one.itl.observe(value)
    metrics.observe_many(many.itl, values)
    metrics.observe_many(many.itl, [])

    def samples(m: metrics.EngineMetrics) -> dict[tuple[str, str], float]:
        return {
            (s.name, s.labels.get("le", "")): s.value
            for family in m.registry.collect()
            if family.name == "sluice_inter_token_latency_seconds"
            for s in family.samples
            if not s.name.endswith("_created")
        }

    assert samples(many) == samples(one)
    assert samples(many)[("sluice_inter_token_latency_seconds_count", "")] == len(values)
