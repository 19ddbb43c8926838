"""The engine's metrics (services/engine/observability.py) on the engine core with a fake model runner:
counts equal to requests made, tokens equal to usage, gauges back to idle."""

from __future__ import annotations

from services.common.metrics import EngineMetrics
from services.engine.core.engine import LLMEngine
from services.engine.core.params import RequestOutput, SamplingParams, StoppingParams
from services.engine.observability import EngineObserver
from tests.engine.fakes import FakeRunner, fake_engine

GREEDY = SamplingParams()


def observed(num_blocks: int = 64, **settings: object) -> tuple[LLMEngine, EngineMetrics, FakeRunner]:
    engine, runner = fake_engine(num_blocks, **settings)
    metrics = EngineMetrics()
    engine.observer = EngineObserver(metrics, stats=engine.recorder, model_name="fake", step_sample_rate=1.0)
    return engine, metrics, runner


def run(engine: LLMEngine) -> list[RequestOutput]:
    """Steps until idle; returns every output."""
    outputs: list[RequestOutput] = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    return outputs


def value(metrics: EngineMetrics, name: str, labels: dict[str, str] | None = None) -> float:
    found = metrics.registry.get_sample_value(name, labels or {})
    assert found is not None, name
    return found


def test_counts_equal_requests_and_tokens() -> None:
    engine, m, runner = observed()
    prompts = {"a": [5, 6, 7], "b": [9] * 20, "c": [4, 4]}
    lengths = {"a": 4, "b": 7, "c": 30}
    for rid, prompt in prompts.items():
        engine.add_request(rid, prompt, GREEDY, StoppingParams(max_new_tokens=lengths[rid]))
    outputs = [o for _ in range(3) for o in engine.step()]
    engine.abort_request("c")
    outputs += run(engine)
    finals = {o.request_id: o for o in outputs if o.finished}
    assert {r: o.finish_reason for r, o in finals.items()} == {"a": "length", "b": "length", "c": "cancelled"}
    generated = sum(len(o.new_token_ids) for o in outputs)

    assert value(m, "sluice_requests_total", {"finish_reason": "length"}) == 2
    assert value(m, "sluice_requests_total", {"finish_reason": "cancelled"}) == 1
    assert value(m, "sluice_requests_total", {"finish_reason": "stop"}) == 0
    assert value(m, "sluice_prompt_tokens_total") == sum(len(p) for p in prompts.values())
    usage = sum(o.completion_tokens for o in finals.values())
    assert value(m, "sluice_generation_tokens_total") == generated == usage
    assert value(m, "sluice_time_to_first_token_seconds_count") == 3
    assert value(m, "sluice_request_queue_time_seconds_count") == 3
    assert value(m, "sluice_e2e_request_latency_seconds_count") == 3
    assert value(m, "sluice_inter_token_latency_seconds_count") == generated - 3
    assert value(m, "sluice_request_prefill_time_seconds_count") == 3
    # One observation per step that ran the model (the fake runner records each).
    steps = len(runner.steps)
    assert value(m, "sluice_batch_size_count") == value(m, "sluice_step_duration_seconds_count") == steps
    assert value(m, "sluice_batch_size_sum") == sum(len(step) for step in runner.steps)
    assert value(m, "sluice_step_tokens_sum") == sum(n for step in runner.steps for _, n in step)
    assert value(m, "sluice_requests_running") == value(m, "sluice_requests_waiting") == 0
    assert value(m, "sluice_kv_cache_usage_ratio") == 0


def test_queue_gauges_while_running() -> None:
    engine, m, _ = observed(max_num_seqs=1)
    engine.add_request("a", [5, 6], GREEDY, StoppingParams(max_new_tokens=5))
    engine.add_request("b", [5, 7], GREEDY, StoppingParams(max_new_tokens=5))
    engine.step()
    assert value(m, "sluice_requests_running") == 1
    assert value(m, "sluice_requests_waiting") == 1
    assert 0 < value(m, "sluice_kv_cache_usage_ratio") <= 1
    run(engine)
    assert value(m, "sluice_requests_running") == value(m, "sluice_requests_waiting") == 0


def test_prefix_cache_and_preemption_counters() -> None:
    engine, m, _ = observed(num_blocks=8, block_size=4)
    shared = list(range(3, 3 + 12))  # three full blocks
    engine.add_request("first", [*shared, 20], GREEDY, StoppingParams(max_new_tokens=1))
    run(engine)
    engine.add_request("second", [*shared, 21], GREEDY, StoppingParams(max_new_tokens=1))
    run(engine)
    bm = engine.block_manager
    assert value(m, "sluice_prefix_cache_queries_total") == bm.prefix_query_blocks * 4 > 0
    assert value(m, "sluice_prefix_cache_hits_total") == bm.prefix_hit_blocks * 4 > 0
    # Two requests that outgrow the pool together: one is preempted and recomputed.
    engine.add_request("x", [5] * 10, GREEDY, StoppingParams(max_new_tokens=12))
    engine.add_request("y", [6] * 10, GREEDY, StoppingParams(max_new_tokens=12))
    run(engine)
    assert engine.scheduler.num_preemptions > 0
    assert value(m, "sluice_preemptions_total") == engine.scheduler.num_preemptions


def test_requests_failed_by_fail_all_are_counted() -> None:
    engine, m, _ = observed()
    engine.add_request("a", [5, 6], GREEDY, StoppingParams(max_new_tokens=50))
    engine.add_request("b", [5, 7], GREEDY, StoppingParams(max_new_tokens=50))
    engine.step()
    outputs = engine.fail_all("the step loop failed")
    assert sorted(o.request_id for o in outputs if o.finish_reason == "error") == ["a", "b"]
    assert value(m, "sluice_requests_total", {"finish_reason": "error"}) == 2
    assert value(m, "sluice_e2e_request_latency_seconds_count") == 2
