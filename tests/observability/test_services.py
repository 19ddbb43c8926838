"""Tracing and metrics of the tokenizer and detokenizer, as real processes exporting to a real OTLP/gRPC
receiver, driven by a traced client process (tests/observability/probe.py)."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from sluice.ports import free_port
from tests.observability.processes import Service, otel_env, scrape, start_service
from tests.observability.receiver import ReceivedSpan, TraceReceiver

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_ID = "00f067aa0ba902b7"
TRACEPARENT = f"00-{TRACE_ID}-{PARENT_ID}-01"


@pytest.fixture(scope="module")
def receiver() -> Iterator[TraceReceiver]:
    with TraceReceiver() as running:
        yield running


@pytest.fixture(scope="module")
def services(receiver: TraceReceiver, tiny_model_dir: Path) -> Iterator[dict[str, tuple[Service, int]]]:
    env = otel_env(receiver.endpoint)
    started: dict[str, tuple[Service, int]] = {}
    try:
        for name in ("tokenizer", "detokenizer"):
            metrics_port = free_port()
            started[name] = (
                start_service(name, tiny_model_dir, env, "--metrics-port", str(metrics_port)),
                metrics_port,
            )
        yield started
    finally:
        for service, _ in started.values():
            service.stop()


@pytest.fixture(scope="module")
def probed(
    services: dict[str, tuple[Service, int]], receiver: TraceReceiver
) -> tuple[int, list[ReceivedSpan]]:
    """Runs the probe once; returns its token count and the spans of its trace once all arrived."""
    tok, detok = services["tokenizer"][0].port, services["detokenizer"][0].port
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "tests.observability.probe",
            f"127.0.0.1:{tok}",
            f"127.0.0.1:{detok}",
            TRACEPARENT,
        ],
        env=otel_env(receiver.endpoint),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    count = int(done.stdout.strip().rpartition("ids=")[2])

    def complete(spans: list[ReceivedSpan]) -> bool:
        names = {(s.service, s.name) for s in spans if s.trace_id == TRACE_ID}
        return {
            ("sluice-tokenizer", "sluice.v1.Tokenizer/TokenizeStream"),
            ("sluice-detokenizer", "sluice.v1.Detokenizer/Stream"),
            ("sluice-gateway", "probe"),
        } <= names and sum(
            1 for s in spans if s.name == "sluice.v1.Tokenizer/Tokenize" and s.kind == "SERVER"
        ) >= 2

    spans = receiver.wait_for(complete, timeout_s=60)
    return count, [s for s in spans if s.trace_id == TRACE_ID]


def _one(spans: list[ReceivedSpan], **match: object) -> ReceivedSpan:
    found = [s for s in spans if all(getattr(s, k) == v for k, v in match.items())]
    assert len(found) == 1, (match, found)
    return found[0]


def test_unary_call_continues_the_client_span(probed: tuple[int, list[ReceivedSpan]]) -> None:
    count, spans = probed
    root = _one(spans, service="sluice-gateway", name="probe")
    assert root.parent_span_id == PARENT_ID
    clients = [s for s in spans if s.service == "sluice-gateway" and s.kind == "CLIENT"]
    assert len(clients) == 2 and all(c.parent_span_id == root.span_id for c in clients)
    servers = [
        s for s in spans if s.service == "sluice-tokenizer" and s.name == "sluice.v1.Tokenizer/Tokenize"
    ]
    assert sorted(s.parent_span_id for s in servers) == sorted(c.span_id for c in clients)
    good = next(s for s in servers if s.attributes.get("sluice.request_id") == "unary")
    assert good.kind == "SERVER"
    assert good.attributes["gen_ai.usage.input_tokens"] == count > 0
    assert good.attributes["rpc.system"] == "grpc"
    assert good.status_code != 2


def test_errors_set_the_span_status(probed: tuple[int, list[ReceivedSpan]]) -> None:
    _, spans = probed
    bad_server = _one(
        spans,
        service="sluice-tokenizer",
        name="sluice.v1.Tokenizer/Tokenize",
        parent_span_id=next(
            s.parent_span_id for s in spans if s.attributes.get("sluice.request_id") == "bad"
        ),
    )
    assert bad_server.status_code == 2 and "INVALID_ARGUMENT" in bad_server.status_message
    bad_client = next(s for s in spans if s.span_id == bad_server.parent_span_id)
    assert bad_client.kind == "CLIENT" and bad_client.status_code == 2


def test_stream_requests_carry_their_own_context(probed: tuple[int, list[ReceivedSpan]]) -> None:
    _, spans = probed
    root = _one(spans, service="sluice-gateway", name="probe")
    streamed = _one(spans, service="sluice-tokenizer", name="sluice.v1.Tokenizer/TokenizeStream")
    assert streamed.parent_span_id == root.span_id
    assert streamed.attributes["sluice.request_id"] == "streamed"
    detok = _one(spans, service="sluice-detokenizer", name="sluice.v1.Detokenizer/Stream")
    assert detok.parent_span_id == root.span_id and detok.kind == "SERVER"
    assert detok.attributes["sluice.request_id"] == "d1"
    assert detok.start_ns <= detok.end_ns


def test_health_checks_are_not_traced(
    probed: tuple[int, list[ReceivedSpan]], receiver: TraceReceiver
) -> None:
    assert not [s for s in receiver.snapshot() if "grpc.health" in s.name]


def test_metrics_count_the_requests(
    probed: tuple[int, list[ReceivedSpan]], services: dict[str, tuple[Service, int]]
) -> None:
    tok = scrape(f"http://127.0.0.1:{services['tokenizer'][1]}/metrics")
    # Tokenize twice (one invalid) and one TokenizeStream request.
    assert tok["sluice_tokenize_duration_seconds_count"] == 3
    assert tok["sluice_tokenize_duration_seconds_sum"] > 0
    assert tok["sluice_tokenize_batch_size_sum"] == 2  # the invalid one never reaches a batch
    detok = scrape(f"http://127.0.0.1:{services['detokenizer'][1]}/metrics")
    assert detok["sluice_detokenize_duration_seconds_count"] >= 1
    assert detok["sluice_detokenize_batch_size_count"] == detok["sluice_detokenize_duration_seconds_count"]
    assert "process_cpu_seconds_total" in tok
