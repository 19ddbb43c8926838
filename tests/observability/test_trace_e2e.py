"""One trace per request across all four services: `sluice up` exporting to a real OTLP/gRPC receiver,
one WebSocket chat carrying a given `traceparent`, then every service's `/metrics`."""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import websockets

from sluice.ports import free_port_run
from tests.e2e.conftest import Pipeline, start_pipeline
from tests.observability.processes import scrape
from tests.observability.receiver import ReceivedSpan, TraceReceiver

pytestmark = pytest.mark.e2e

TRACE_ID = "0af7651916cd43dd8448eb211c80319c"
PARENT_ID = "b7ad6b7169203331"
TRACEPARENT = f"00-{TRACE_ID}-{PARENT_ID}-01"
SERVICES = {"sluice-gateway", "sluice-tokenizer", "sluice-engine", "sluice-detokenizer"}
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def receiver() -> Iterator[TraceReceiver]:
    with TraceReceiver() as running:
        yield running


@pytest.fixture(scope="module")
def traced_pipeline(receiver: TraceReceiver, tiny_model_dir: Path) -> Iterator[tuple[Pipeline, int]]:
    metrics_base = free_port_run(3)
    with pytest.MonkeyPatch.context() as patch:
        for key in [k for k in os.environ if k.startswith("OTEL_")]:
            patch.delenv(key)
        patch.setenv("OTEL_BSP_SCHEDULE_DELAY", "100")
        patch.setenv("SLUICE_TRACE_STEP_SAMPLE_RATE", "1.0")
        running = start_pipeline(
            tiny_model_dir, "--otlp-endpoint", receiver.endpoint, "--metrics-base-port", str(metrics_base)
        )
    yield running, metrics_base
    code = running.stop()
    assert code == 0, running.output()


async def _chat(url: str, frames: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    done: dict[str, dict[str, Any]] = {}
    async with websockets.connect(url) as ws:
        for frame in frames:
            await ws.send(json.dumps(frame))
        while len(done) < len(frames):
            frame = json.loads(await asyncio.wait_for(ws.recv(), timeout=120))
            assert frame["type"] in ("delta", "done"), frame
            if frame["type"] == "done":
                done[frame["id"]] = frame
    return done


@pytest.fixture(scope="module")
def chats(traced_pipeline: tuple[Pipeline, int]) -> dict[str, dict[str, Any]]:
    """Three chats: `traced` with the given traceparent, then two more on one socket."""
    pipeline, _ = traced_pipeline
    params = {"max_tokens": MAX_TOKENS, "temperature": 0.7, "top_p": 0.9}
    traced = {
        "type": "generate",
        "id": "traced",
        "messages": [{"role": "user", "content": "hello"}],
        "params": params,
        "traceparent": TRACEPARENT,
    }
    done = asyncio.run(_chat(pipeline.ws_url, [traced]))
    others = [
        {"type": "generate", "id": f"more{i}", "prompt": f"Once upon {i}", "params": params} for i in range(2)
    ]
    done.update(asyncio.run(_chat(pipeline.ws_url, others)))
    return done


def _complete(spans: list[ReceivedSpan]) -> bool:
    mine = [s for s in spans if s.trace_id == TRACE_ID]
    names = {s.name for s in mine}
    return {s.service for s in mine} == SERVICES and {
        "queue",
        "prefill",
        "decode",
        "sluice.gateway.generate",
    } <= names


@pytest.fixture(scope="module")
def trace(chats: dict[str, dict[str, Any]], receiver: TraceReceiver) -> list[ReceivedSpan]:
    spans = receiver.wait_for(_complete, timeout_s=60)
    return [s for s in spans if s.trace_id == TRACE_ID]


def _one(spans: list[ReceivedSpan], **match: object) -> ReceivedSpan:
    found = [s for s in spans if all(getattr(s, k) == v for k, v in match.items())]
    assert len(found) == 1, (match, [(s.service, s.name) for s in spans])
    return found[0]


def test_one_trace_continues_the_given_traceparent(
    trace: list[ReceivedSpan], receiver: TraceReceiver
) -> None:
    assert {s.service for s in trace} == SERVICES
    root = _one(trace, service="sluice-gateway", name="sluice.gateway.generate")
    assert root.kind == "SERVER" and root.parent_span_id == PARENT_ID
    request_id = root.attributes["sluice.request_id"]
    # Every span of this request, in any service, is in this one trace.
    tagged = [s for s in receiver.snapshot() if s.attributes.get("sluice.request_id") == request_id]
    assert {s.service for s in tagged} >= {"sluice-gateway", "sluice-engine", "sluice-detokenizer"}
    assert {s.trace_id for s in tagged} == {TRACE_ID}


def test_parent_chain_gateway_to_each_stage(trace: list[ReceivedSpan]) -> None:
    by_id = {s.span_id: s for s in trace}
    root = _one(trace, service="sluice-gateway", name="sluice.gateway.generate")
    stages = {
        "sluice-tokenizer": _one(trace, service="sluice-tokenizer", name="sluice.v1.Tokenizer/Tokenize"),
        "sluice-engine": _one(trace, service="sluice-engine", name="sluice.engine.generate"),
        "sluice-detokenizer": _one(trace, service="sluice-detokenizer", name="sluice.v1.Detokenizer/Stream"),
    }
    for service, span in stages.items():
        assert span.kind == "SERVER", service
        client = by_id[span.parent_span_id]
        assert client.service == "sluice-gateway" and client.kind == "CLIENT", service
        assert client.parent_span_id == root.span_id, service
        assert client.start_ns <= span.end_ns and span.start_ns <= client.end_ns, service


def test_queue_prefill_decode_are_present_and_ordered(trace: list[ReceivedSpan]) -> None:
    engine = _one(trace, service="sluice-engine", name="sluice.engine.generate")
    phases = [_one(trace, service="sluice-engine", name=name) for name in ("queue", "prefill", "decode")]
    assert all(p.parent_span_id == engine.span_id for p in phases)
    queue, prefill, decode = phases
    assert engine.start_ns == queue.start_ns <= queue.end_ns == prefill.start_ns
    assert prefill.start_ns <= prefill.end_ns == decode.start_ns <= decode.end_ns == engine.end_ns


def test_genai_attributes(trace: list[ReceivedSpan], chats: dict[str, dict[str, Any]]) -> None:
    usage, reason = chats["traced"]["usage"], chats["traced"]["finish_reason"]
    root = _one(trace, service="sluice-gateway", name="sluice.gateway.generate")
    engine = _one(trace, service="sluice-engine", name="sluice.engine.generate")
    for span in (root, engine):
        a = span.attributes
        assert a["gen_ai.request.max_tokens"] == MAX_TOKENS
        assert a["gen_ai.request.temperature"] == pytest.approx(0.7)
        assert a["gen_ai.request.top_p"] == pytest.approx(0.9)
        assert a["gen_ai.request.model"]
        assert a["gen_ai.usage.input_tokens"] == usage["prompt_tokens"]
        assert a["gen_ai.usage.output_tokens"] == usage["completion_tokens"]
        assert a["gen_ai.response.finish_reasons"] == [reason]
        assert a["sluice.time_to_first_token_s"] > 0
        assert a["sluice.batch_size_at_first_token"] >= 1
        assert span.status_code != 2
    assert root.attributes["sluice.request_id"] == engine.attributes["sluice.request_id"]
    tokenize = _one(trace, service="sluice-tokenizer", name="sluice.v1.Tokenizer/Tokenize")
    assert tokenize.attributes["gen_ai.usage.input_tokens"] == usage["prompt_tokens"]


def test_engine_steps_are_traced_and_linked(trace: list[ReceivedSpan], receiver: TraceReceiver) -> None:
    engine = _one(trace, service="sluice-engine", name="sluice.engine.generate")
    steps = [s for s in receiver.snapshot() if s.name == "sluice.engine.step"]
    linked = [s for s in steps if (TRACE_ID, engine.span_id) in s.links]
    # Sample rate 1: every step of the request, one per output token at least.
    assert len(linked) >= engine.attributes["gen_ai.usage.output_tokens"]
    assert all(s.attributes["sluice.batch_size"] >= 1 for s in linked)


def test_every_service_exports_its_metrics(
    chats: dict[str, dict[str, Any]], traced_pipeline: tuple[Pipeline, int]
) -> None:
    pipeline, base = traced_pipeline
    prompt = sum(d["usage"]["prompt_tokens"] for d in chats.values())
    completion = sum(d["usage"]["completion_tokens"] for d in chats.values())
    engine = scrape(f"http://127.0.0.1:{base + 1}/metrics")
    finished = {k: v for k, v in engine.items() if k.startswith("sluice_requests_total{")}
    assert sum(finished.values()) == len(chats)
    for reason in {d["finish_reason"] for d in chats.values()}:
        assert engine[f'sluice_requests_total{{finish_reason="{reason}"}}'] >= 1
    assert engine["sluice_prompt_tokens_total"] == prompt
    assert engine["sluice_generation_tokens_total"] == completion
    for name in ("time_to_first_token_seconds", "e2e_request_latency_seconds", "request_queue_time_seconds"):
        assert engine[f"sluice_{name}_count"] == len(chats), name
    assert engine["sluice_inter_token_latency_seconds_count"] == completion - len(chats)
    assert engine["sluice_batch_size_count"] == engine["sluice_step_duration_seconds_count"] > 0
    assert engine["sluice_requests_running"] == engine["sluice_requests_waiting"] == 0
    assert 0 <= engine["sluice_kv_cache_usage_ratio"] <= 1
    assert engine["sluice_prefix_cache_queries_total"] >= engine["sluice_prefix_cache_hits_total"] >= 0
    assert engine["sluice_preemptions_total"] == 0
    tokenizer = scrape(f"http://127.0.0.1:{base}/metrics")
    assert tokenizer["sluice_tokenize_duration_seconds_count"] == len(chats)
    detokenizer = scrape(f"http://127.0.0.1:{base + 2}/metrics")
    assert detokenizer["sluice_detokenize_duration_seconds_count"] >= 1
    gateway = scrape(f"http://127.0.0.1:{pipeline.http_port}/metrics")
    answered = {k: v for k, v in gateway.items() if k.startswith('sluice_gateway_requests_total{api="ws"')}
    assert sum(answered.values()) == len(chats)
    assert gateway["sluice_gateway_time_to_first_token_seconds_count"] == len(chats)
