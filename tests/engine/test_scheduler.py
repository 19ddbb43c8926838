"""Scheduler and block manager with a fake model: budgets, chunked prefill, preemption, prefix caching,
abort, batching policies. Every test ends with the free list back to full."""

from __future__ import annotations

import os
import random
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from services.common.block_keys import chain_hashes
from services.common.errors import DEADLINE_EXCEEDED, INTERNAL
from services.engine.core.block_manager import BlockManager
from services.engine.core.engine import LLMEngine
from services.engine.core.params import RequestOutput, SamplingParams, StoppingParams
from tests.engine.fakes import FakeRunner, expected_output, fake_engine

GREEDY = SamplingParams()
ROOT = Path(__file__).resolve().parents[2]


def stop(n: int, **kw: object) -> StoppingParams:
    return StoppingParams(max_new_tokens=n, **kw)  # type: ignore[arg-type]


def run(engine: LLMEngine, max_steps: int = 10_000) -> dict[str, list[RequestOutput]]:
    """Steps until idle; returns every output by request id."""
    outs: dict[str, list[RequestOutput]] = {}
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            break
        for o in engine.step():
            outs.setdefault(o.request_id, []).append(o)
    assert not engine.has_unfinished_requests()
    return outs


def tokens(outs: list[RequestOutput]) -> list[int]:
    return [t for o in outs for t in o.new_token_ids]


def assert_pool_full(engine: LLMEngine) -> None:
    bm = engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks
    assert all(c == 0 for c in bm.ref_counts)
    assert not engine.scheduler.running and not engine.scheduler.waiting


@pytest.fixture
def engines() -> Iterator[list[LLMEngine]]:
    made: list[LLMEngine] = []
    yield made
    for e in made:
        assert_pool_full(e)


def make(engines: list[LLMEngine], num_blocks: int = 64, **settings: object) -> tuple[LLMEngine, FakeRunner]:
    engine, runner = fake_engine(num_blocks, **settings)
    engines.append(engine)
    return engine, runner


# ---- block manager -------------------------------------------------------------------------------


def test_block_manager_allocate_free_and_ref_counts() -> None:
    bm = BlockManager(8, 4)
    assert bm.can_allocate(8) and not bm.can_allocate(9)
    a = bm.allocate(3)
    b = bm.allocate(5)
    assert len(set(a) | set(b)) == 8 and bm.num_free_blocks == 0
    assert not bm.can_allocate(1)
    bm.acquire(a[:2])  # shared by a second owner
    assert [bm.ref_counts[x] for x in a] == [2, 2, 1]
    bm.free_blocks(a)
    assert bm.num_free_blocks == 1
    bm.free_blocks(a[:2])
    bm.free_blocks(b)
    assert bm.num_free_blocks == 8 and all(c == 0 for c in bm.ref_counts)
    with pytest.raises(AssertionError):
        bm.free_blocks([a[0]])


def test_chain_hashes_depend_on_whole_prefix() -> None:
    x = list(range(40))
    y = [*range(16), *range(100, 124)]
    hx, hy = chain_hashes(x, 16, 0, None), chain_hashes(y, 16, 0, None)
    assert len(hx) == 2  # only full blocks
    assert hx[0] == hy[0] and hx[1] != hy[1]
    assert chain_hashes(x, 16, 1, hx[0]) == hx[1:]
    # Same block content after a different prefix hashes differently.
    z = [*range(100, 116), *range(16, 32)]
    assert chain_hashes(z, 16, 0, None)[1] != hx[1]


def test_chain_hashes_are_stable_across_processes() -> None:
    """The prefix cache key is a digest of the token ids, never Python's salted `hash()`."""
    tokens = [*range(3, 35), 70_000, 2**32 - 1]
    code = (
        "from services.common.block_keys import chain_hashes; "
        f"print(repr(chain_hashes({tokens!r}, 16, 0, None)))"
    )
    printed = []
    for seed in ("1", "2"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        done = subprocess.run(
            [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, check=True
        )
        printed.append(done.stdout.strip())
    assert printed[0] == printed[1] == repr(chain_hashes(tokens, 16, 0, None))
    assert len(chain_hashes(tokens, 16, 0, None)) == 2


def test_chain_hashes_are_sha256_of_parent_and_ids() -> None:
    import hashlib
    import struct

    block = list(range(100, 116))
    first = chain_hashes(block, 16, 0, None)[0]
    assert first == hashlib.sha256(struct.pack("<16I", *block)).digest()
    after = chain_hashes([*range(16), *block], 16, 1, first)[0]
    assert after == hashlib.sha256(first + struct.pack("<16I", *block)).digest()
    assert after != first  # the same block after another parent is another key


def test_prefix_cache_revives_free_blocks_and_forgets_on_reuse() -> None:
    bm = BlockManager(4, 4)
    blocks = bm.allocate(2)
    hashes = chain_hashes(list(range(8)), 4, 0, None)
    for blk, h in zip(blocks, hashes, strict=True):
        bm.register(blk, h)
    bm.free_blocks(blocks)
    assert bm.match_prefix(hashes) == blocks  # cached while free
    assert bm.can_allocate(2, blocks) and not bm.can_allocate(3, blocks)
    bm.acquire(blocks)
    assert bm.num_free_blocks == 2
    bm.free_blocks(blocks)
    # Fresh allocations take the other blocks first, then evict the cached ones.
    fresh = bm.allocate(3)
    assert bm.match_prefix(hashes) != blocks
    bm.free_blocks(fresh)
    assert bm.num_free_blocks == 4


# ---- scheduling ----------------------------------------------------------------------------------


def test_token_budget_and_seq_cap(engines: list[LLMEngine]) -> None:
    engine, runner = make(engines, max_num_batched_tokens=32, max_num_seqs=3)
    prompts = [list(range(3 + i, 23 + i)) for i in range(5)]  # no shared prefix: nothing is deferred
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, GREEDY, stop(4))
    outs = run(engine)
    for step in runner.steps:
        assert sum(n for _, n in step) <= 32
        assert len(step) <= 3
    assert sum(n for _, n in runner.steps[0]) == 32  # the budget is used up, prefill chunked
    assert all(tokens(outs[f"r{i}"]) == expected_output(prompt, 4) for i, prompt in enumerate(prompts))


def test_chunked_prefill_matches_unchunked(engines: list[LLMEngine]) -> None:
    prompt = [random.Random(1).randrange(3, 60) for _ in range(100)]
    engine, runner = make(engines, max_num_batched_tokens=32)
    engine.add_request("long", prompt, GREEDY, stop(5))
    outs = run(engine)
    assert [n for step in runner.steps for _, n in step][:4] == [32, 32, 32, 4]
    assert [len(o.new_token_ids) for o in outs["long"]] == [1] * 5  # nothing before the prefill ends
    assert tokens(outs["long"]) == expected_output(prompt, 5)


def test_preemption_and_resume_give_the_same_outputs(engines: list[LLMEngine]) -> None:
    rng = random.Random(2)
    prompts = [[rng.randrange(3, 60) for _ in range(rng.randint(5, 40))] for _ in range(8)]
    engine, _ = make(engines, num_blocks=12, max_num_batched_tokens=64, enable_prefix_caching=False)
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, GREEDY, stop(30))
    outs = run(engine)
    assert engine.stats().num_preemptions > 0
    for i, p in enumerate(prompts):
        assert tokens(outs[str(i)]) == expected_output(p, 30)
        assert outs[str(i)][-1].finish_reason == "length"
        assert outs[str(i)][-1].completion_tokens == 30


def test_preempts_most_recently_admitted(engines: list[LLMEngine]) -> None:
    engine, _ = make(engines, num_blocks=4, block_size=4, enable_prefix_caching=False)
    engine.add_request("old", [3] * 4, GREEDY, stop(8))
    engine.step()
    engine.add_request("new", [4] * 4, GREEDY, stop(8))
    preempted = []
    while engine.has_unfinished_requests():
        before = {r.request_id: r.num_preemptions for r in engine.requests.values()}
        engine.step()
        preempted += [
            rid
            for rid, n in before.items()
            if rid in engine.requests and engine.requests[rid].num_preemptions > n
        ]
    assert preempted and set(preempted) == {"new"}


def test_prefix_hits_share_blocks(engines: list[LLMEngine]) -> None:
    shared = list(range(3, 3 + 48))
    engine, runner = make(engines)
    engine.add_request("a", [*shared, 60], GREEDY, stop(3))
    engine.step()  # a is prefilled; its 3 full blocks are cached
    engine.add_request("b", [*shared, 61, 62], GREEDY, stop(3))
    engine.step()
    a, b = engine.requests["a"], engine.requests["b"]
    assert b.num_cached_tokens == 48
    assert runner.steps[-1] == [("a", 1), ("b", 2)]
    assert a.block_ids[:3] == b.block_ids[:3]
    assert all(engine.block_manager.ref_counts[x] == 2 for x in a.block_ids[:3])
    outs = run(engine)
    assert tokens(outs["b"])[-2:] == expected_output([*shared, 61, 62], 3)[-2:]
    # A later identical prompt reuses cached blocks even after both finished; at least one token is computed.
    engine.add_request("c", shared, GREEDY, stop(2))
    engine.step()
    assert engine.requests["c"].num_cached_tokens == 32
    outs = run(engine)
    assert engine.stats().prefix_hit_rate > 0


def test_prefix_hit_rate_counts_each_admission_once(engines: list[LLMEngine]) -> None:
    shared = list(range(3, 3 + 48))
    # a takes the whole pool, so b waits, and is looked up at every step, until a has finished.
    engine, _ = make(engines, num_blocks=4)
    engine.add_request("a", [*shared, 60], GREEDY, stop(6))
    engine.add_request("b", [*shared, 61, 62], GREEDY, stop(3))
    run(engine)
    bm = engine.block_manager
    # a: 3 full prompt blocks, none cached; b: the same 3 blocks, all cached by a.
    assert (bm.prefix_query_blocks, bm.prefix_hit_blocks) == (6, 3)
    assert engine.stats().prefix_hit_rate == 0.5


def test_prefix_hit_rate_is_zero_without_shared_prompts(engines: list[LLMEngine]) -> None:
    rng = random.Random(5)
    prompts = [[rng.randrange(3, 60) for _ in range(rng.randint(17, 40))] for _ in range(8)]
    engine, _ = make(engines, num_blocks=12, max_num_batched_tokens=64)
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, GREEDY, stop(30))
    outs = run(engine)
    st = engine.stats()
    assert st.num_preemptions > 0  # preempted requests re-found their own cached blocks
    assert engine.block_manager.prefix_query_blocks == sum((len(p) - 1) // 16 for p in prompts)
    assert st.prefix_hit_rate == 0.0
    assert all(tokens(outs[str(i)]) == expected_output(p, 30) for i, p in enumerate(prompts))


def test_abort_at_every_stage(engines: list[LLMEngine]) -> None:
    engine, _ = make(engines, max_num_batched_tokens=16, max_num_seqs=2)
    for rid in ("waiting", "prefilling", "decoding", "done"):
        engine.add_request(rid, list(range(3, 40)), GREEDY, stop(3 if rid == "done" else 50))
    engine.abort_request("waiting")  # before any step
    outs: dict[str, list[RequestOutput]] = {}

    def step() -> None:
        for o in engine.step():
            outs.setdefault(o.request_id, []).append(o)

    step()
    step()
    assert engine.requests["prefilling"].num_computed_tokens > 0
    engine.abort_request("prefilling")  # mid chunked prefill
    for _ in range(8):
        step()
    assert engine.requests["decoding"].num_output_tokens > 0
    engine.abort_request("decoding")
    engine.abort_request("decoding")  # idempotent
    engine.abort_request("unknown")
    while engine.has_unfinished_requests():
        step()
    engine.abort_request("done")  # after it finished
    for rid in ("waiting", "prefilling", "decoding"):
        finals = [o for o in outs[rid] if o.finished]
        assert len(finals) == 1 and finals[0].finish_reason == "cancelled"
    assert outs["done"][-1].finish_reason == "length"
    assert sum(o.finished for o in outs["done"]) == 1


def test_abort_frees_blocks_before_next_step(engines: list[LLMEngine]) -> None:
    engine, _ = make(engines, num_blocks=8)
    engine.add_request("a", list(range(3, 50)), GREEDY, stop(50))
    engine.step()
    assert engine.block_manager.num_free_blocks < 8
    engine.abort_request("a")
    assert engine.block_manager.num_free_blocks == 8
    assert [o.finish_reason for o in engine.step()] == ["cancelled"]


@pytest.mark.parametrize("policy", ["continuous", "dynamic", "static"])
def test_policies_give_same_outputs(engines: list[LLMEngine], policy: str) -> None:
    rng = random.Random(3)
    engine, runner = make(engines, batching=policy, static_batch_size=3, max_num_seqs=4, batch_wait_ms=0.0)
    prompts = [[rng.randrange(3, 60) for _ in range(rng.randint(1, 30))] for _ in range(7)]
    lengths = [rng.randint(1, 12) for _ in prompts]
    for i, (p, n) in enumerate(zip(prompts, lengths, strict=True)):
        engine.add_request(str(i), p, GREEDY, stop(n))
    outs: dict[str, list[RequestOutput]] = {}
    batches: list[set[str]] = []  # dynamic/static: the batch after each step only shrinks until empty
    while engine.has_unfinished_requests():
        for o in engine.step():
            outs.setdefault(o.request_id, []).append(o)
        batch = {r.request_id for r in engine.scheduler.batch}
        if batch and (not batches or not batch <= batches[-1]):
            assert not batches or not (batch & set().union(*batches)), "a new batch holds only new requests"
            batches.append(batch)
    for i, (p, n) in enumerate(zip(prompts, lengths, strict=True)):
        assert tokens(outs[str(i)]) == expected_output(p, n)
    if policy == "continuous":
        assert not batches
    else:
        size = 3 if policy == "static" else 4
        assert [len(b) for b in batches] == ([4, 3] if policy == "dynamic" else [3, 3, 1])
        assert max(len(step) for step in runner.steps) <= size


def test_static_batches_run_to_completion(engines: list[LLMEngine]) -> None:
    engine, runner = make(engines, batching="static", static_batch_size=2, batch_wait_ms=0.0)
    for i, n in enumerate([2, 9, 3, 3, 1]):
        engine.add_request(str(i), [5, 6, 7], GREEDY, stop(n))
    run(engine)
    first_step_of = {}
    last_step_of = {}
    for k, step in enumerate(runner.steps):
        for rid, _ in step:
            first_step_of.setdefault(rid, k)
            last_step_of[rid] = k
    # Batch {0, 1} runs until 1 (9 tokens) ends; only then does {2, 3} start.
    assert first_step_of["2"] > last_step_of["1"]
    assert first_step_of["3"] == first_step_of["2"]
    assert first_step_of["4"] > max(last_step_of["2"], last_step_of["3"])


def test_dynamic_batch_waits_for_window(engines: list[LLMEngine]) -> None:
    engine, runner = make(engines, batching="dynamic", max_num_seqs=2, batch_wait_ms=10_000.0)
    engine.add_request("a", [5, 6], GREEDY, stop(2))
    engine.add_request("b", [5, 7], GREEDY, stop(2))  # the batch is full: it starts without waiting
    engine.add_request("c", [5, 8], GREEDY, stop(2))
    engine.step()
    assert {rid for rid, _ in runner.steps[0]} == {"a", "b"}
    for rid in ("a", "b", "c"):
        engine.abort_request(rid)
    engine.step()


def test_stop_conditions(engines: list[LLMEngine]) -> None:
    engine, _ = make(engines, max_model_len=24)
    prompt = [3, 4, 5]
    first = expected_output(prompt, 3)
    engine.add_request("stop_id", prompt, GREEDY, stop(10, stop_token_ids=(first[1],)))
    engine.add_request("min_new", prompt, GREEDY, stop(10, stop_token_ids=(first[0],), min_new_tokens=2))
    engine.add_request("ctx", list(range(3, 23)), GREEDY, stop(0))  # 0: the rest of the context
    engine.add_request("over", list(range(3, 23)), GREEDY, stop(5))  # past the context: cut to its 4
    outs = run(engine)
    assert tokens(outs["stop_id"]) == first[:2] and outs["stop_id"][-1].finish_reason == "stop"
    # The stop id is kept out until min_new_tokens, so generation goes on past it.
    assert outs["min_new"][-1].finish_reason in ("length", "stop")
    assert tokens(outs["min_new"])[0] != first[0]
    assert outs["ctx"][-1].finish_reason == "length" and outs["ctx"][-1].completion_tokens == 4


def test_eos_and_ignore_eos(engines: list[LLMEngine]) -> None:
    engine, runner = make(engines)
    # A fake model that always predicts EOS.
    import torch

    def always_eos(scheduled):  # type: ignore[no-untyped-def]
        rows = [r for r, n in scheduled if r.num_computed_tokens + n == r.num_tokens]
        logits = torch.full((len(rows), 64), -10.0)
        logits[:, 2] = 10.0
        return logits, rows

    runner.execute = always_eos  # type: ignore[method-assign]
    engine.add_request("eos", [5], GREEDY, stop(5))
    engine.add_request("ignore", [5], GREEDY, stop(5, ignore_eos=True))
    engine.add_request("min", [5], GREEDY, stop(5, min_new_tokens=3))
    outs = run(engine)
    assert tokens(outs["eos"]) == [2] and outs["eos"][-1].finish_reason == "stop"
    assert tokens(outs["ignore"]) == [2] * 5 and outs["ignore"][-1].finish_reason == "length"
    assert len(tokens(outs["min"])) == 4 and outs["min"][-1].finish_reason == "stop"


def test_bad_requests_are_refused(engines: list[LLMEngine]) -> None:
    engine, _ = make(engines, max_model_len=32)
    engine.add_request("dup", [5], GREEDY, stop(2))
    bad = [
        ("empty", [], GREEDY, stop(2)),
        ("long", [5] * 32, GREEDY, stop(2)),
        ("vocab", [5, 64], GREEDY, stop(2)),
        ("neg", [5, -1], GREEDY, stop(2)),
        ("dup", [5], GREEDY, stop(2)),
        ("lp", [5], SamplingParams(logprobs=21), stop(2)),
        ("temp", [5], SamplingParams(temperature=-1.0), stop(2)),
        ("nan", [5], SamplingParams(top_p=float("nan")), stop(2)),
        ("max", [5], GREEDY, stop(-1)),
    ]
    for rid, prompt, sampling, stopping in bad:
        with pytest.raises(ValueError):
            engine.add_request(rid, prompt, sampling, stopping)
    run(engine)


def test_failing_step_fails_its_requests_and_goes_on(engines: list[LLMEngine]) -> None:
    engine, runner = make(engines)
    engine.add_request("a", [5, 6], GREEDY, stop(3))
    runner.fail_next = True
    outs = engine.step()
    assert [(o.request_id, o.finish_reason) for o in outs] == [("a", "error")]
    assert "injected failure" in (outs[0].error or "")
    engine.add_request("b", [5, 6], GREEDY, stop(3))
    assert tokens(run(engine)["b"]) == expected_output([5, 6], 3)


def test_an_injected_step_fault_fails_only_that_steps_requests(engines: list[LLMEngine]) -> None:
    """A fault injected into the model's execution of one step fails that step's requests only: one that
    waited outside the step (the batch was full) and one that arrives after it complete exactly."""
    engine, runner = make(engines, max_num_seqs=2)
    for rid, prompt in (("a", [5, 6]), ("b", [5, 7]), ("w", [5, 8])):
        engine.add_request(rid, prompt, GREEDY, stop(4))
    assert sorted(o.request_id for o in engine.step()) == ["a", "b"]  # w waits: the batch holds two
    runner.fail_next = True
    failed = engine.step()
    assert sorted((o.request_id, o.finish_reason) for o in failed) == [("a", "error"), ("b", "error")]
    for out in failed:
        assert out.error_code == INTERNAL and "injected failure" in (out.error or "")
    engine.add_request("late", [5, 9], GREEDY, stop(4))
    rest = run(engine)
    assert sorted(rest) == ["late", "w"]
    for rid, prompt in (("w", [5, 8]), ("late", [5, 9])):
        assert tokens(rest[rid]) == expected_output(prompt, 4) and rest[rid][-1].finish_reason == "length"


def test_stop_token_ids_outside_the_vocabulary_are_refused(engines: list[LLMEngine]) -> None:
    """A stop token id the model cannot generate would never stop anything: refused, not ignored."""
    engine, runner = make(engines)
    with pytest.raises(ValueError, match="stop_token_ids: token id 64 is outside the vocabulary"):
        engine.add_request("a", [5], GREEDY, stop(2, stop_token_ids=(3, runner.vocab_size)))
    engine.add_request("b", [5], GREEDY, stop(2, stop_token_ids=(runner.vocab_size - 1,)))
    assert len(tokens(run(engine)["b"])) >= 1


def test_stats_after_run(engines: list[LLMEngine]) -> None:
    engine, _ = make(engines)
    for i in range(4):
        engine.add_request(str(i), list(range(3, 20)), GREEDY, stop(5))
    run(engine)
    st = engine.stats()
    assert st.steps > 0 and st.generated_tokens == 20 and st.max_batch == 4
    assert 0 < st.peak_kv_efficiency <= 1
    assert st.free_blocks == st.num_blocks


def test_abort_while_preempted(engines: list[LLMEngine]) -> None:
    engine, _ = make(engines, num_blocks=6, block_size=4, enable_prefix_caching=False)
    for rid in ("a", "b", "c"):
        engine.add_request(rid, [5, 6, 7], GREEDY, stop(12))
    outs: list[RequestOutput] = []
    preempted = None
    while preempted is None and engine.has_unfinished_requests():
        outs += engine.step()
        preempted = next((r for r in engine.scheduler.waiting if r.num_preemptions), None)
    assert preempted is not None and not preempted.block_ids
    engine.abort_request(preempted.request_id)
    outs += run(engine).get(preempted.request_id, [])
    finals = [o for o in outs if o.request_id == preempted.request_id and o.finished]
    assert [o.finish_reason for o in finals] == ["cancelled"]


def test_observer_hooks_and_a_failing_observer(engines: list[LLMEngine]) -> None:
    engine, _ = make(engines)
    calls: list[tuple[str, object]] = []

    class Recorder:
        def on_arrival(self, request, trace_context=None):  # type: ignore[no-untyped-def]
            calls.append(("arrival", trace_context))

        def on_scheduled(self, sched):  # type: ignore[no-untyped-def]
            calls.append(("scheduled", len(sched.scheduled)))
            raise RuntimeError("observer bug")  # logged, never fails the step

        def on_step_end(self, sched, outputs, step_s):  # type: ignore[no-untyped-def]
            calls.append(("end", sched is not None))

    engine.observer = Recorder()
    engine.add_request("a", [5, 6], GREEDY, stop(2), trace_context={"traceparent": "00-ab-cd-01"})
    engine.add_request("b", [5, 7], GREEDY, stop(50))
    got = [o for _ in range(3) for o in engine.step()]
    engine.abort_request("b")
    got += engine.step()
    assert [t for o in got if o.request_id == "a" for t in o.new_token_ids] == expected_output([5, 6], 2)
    assert not engine.has_unfinished_requests()
    assert calls[0] == ("arrival", {"traceparent": "00-ab-cd-01"})
    assert ("scheduled", 2) in calls and ("end", True) in calls
    assert calls[-1] == ("end", False)  # a step that only emitted the cancelled final


def test_a_request_past_its_deadline_fails_and_frees_its_blocks() -> None:
    engine, _ = fake_engine(32)
    now = time.monotonic()
    engine.add_request(
        "late", [5, 6, 7], SamplingParams(), StoppingParams(max_new_tokens=0), deadline=now + 3600
    )
    engine.add_request(
        "on-time", [5, 6], SamplingParams(), StoppingParams(max_new_tokens=3), deadline=now + 3600
    )
    engine.step()
    assert engine.block_manager.num_free_blocks < engine.block_manager.num_blocks
    engine.requests["late"].deadline = now  # its deadline passes while it runs
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    finals = {o.request_id: o for o in outputs if o.finished}
    assert finals["late"].finish_reason == "error"
    assert finals["late"].error == "deadline exceeded" and finals["late"].error_code == DEADLINE_EXCEEDED
    assert finals["on-time"].finish_reason == "length"
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_a_burst_sharing_a_prefix_computes_it_once(engines: list[LLMEngine]) -> None:
    shared = list(range(3, 3 + 48))  # three full blocks
    prompts = {str(i): [*shared, 60 + i, 61] for i in range(4)}
    engine, _ = make(engines, num_blocks=64)
    for rid, prompt in prompts.items():
        engine.add_request(rid, prompt, GREEDY, stop(4))
    outs = run(engine)
    bm = engine.block_manager
    # The first computes the three shared blocks; the other three wait a step and find them cached.
    assert (bm.prefix_query_blocks, bm.prefix_hit_blocks) == (12, 9)
    assert all(tokens(outs[rid]) == expected_output(p, 4) for rid, p in prompts.items())


def test_a_deferred_request_lets_later_ones_in(engines: list[LLMEngine]) -> None:
    shared = list(range(3, 3 + 32))
    engine, _ = make(engines, num_blocks=64)
    engine.add_request("a", [*shared, 60], GREEDY, stop(3))
    engine.add_request("b", [*shared, 61], GREEDY, stop(3))  # waits for a's blocks
    engine.add_request("c", list(range(40, 60)), GREEDY, stop(3))  # shares nothing: admitted at once
    engine.step()
    scheduler = engine.scheduler
    assert [r.request_id for r in scheduler.running] == ["a", "c"]
    assert [r.request_id for r in scheduler.waiting] == ["b"]
    run(engine)
    assert engine.stats().prefix_hit_rate > 0


def test_blocks_sliding_out_of_every_window_are_freed_while_the_request_runs() -> None:
    """Every layer windowed (8 positions, blocks of 4): after each step the blocks wholly before the
    next position's window go back to the free list and read as the hole; a request keeps at most
    window / block_size + 2 blocks however long it runs, the pool returns whole at the end, and a
    prefix registered before sliding is still found by a later request."""
    from services.engine.core.request import Request
    from services.engine.core.scheduler import Scheduler

    bm = BlockManager(12, 4)
    sched = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=6, max_model_len=64, sliding_window=8)
    req = Request("a", list(range(10, 30)), GREEDY, stop(30))
    sched.add(req)
    held = []
    while req.num_computed_tokens < 40:
        out = sched.schedule()
        assert out.scheduled, "one request always fits: its old blocks are freed"
        sched.advance(out)
        if req.num_computed_tokens >= req.num_tokens:
            req.token_ids.append(7)  # the sampled token
        first_seen = max(0, req.num_computed_tokens - 8 + 1)
        assert all(b == bm.hole for b in req.block_ids[: first_seen // 4])
        assert all(b != bm.hole for b in req.block_ids[first_seen // 4 :])
        held.append(sum(b != bm.hole for b in req.block_ids))
    assert max(held) <= 8 // 4 + 2
    assert bm.num_free_blocks == 12 - held[-1]
    again = Request("b", list(range(10, 30)), GREEDY, stop(1))
    sched.add(again)
    sched.schedule()
    assert again.num_computed_tokens == 16, "the first 4 full blocks of the shared prompt are cached"
    sched.finish(req, "stop")
    sched.finish(again, "stop")
    assert bm.num_free_blocks == 12
