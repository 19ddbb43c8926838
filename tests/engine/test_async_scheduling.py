"""Async scheduling (the host schedules and launches step N+1 before it reads step N's tokens) gives the
same outputs as the synchronous engine: on the fake model over a mixed workload with preemption, on the
real tiny model against `generate`; aborts, deadlines and failures take effect within one step, a
discarded token is never emitted, and the free list returns to full."""

from __future__ import annotations

import asyncio
import dataclasses
import random
import time
from pathlib import Path

import pytest

from services.common.errors import DEADLINE_EXCEEDED, INTERNAL
from services.engine.core.async_engine import AsyncEngine
from services.engine.core.engine import LLMEngine
from services.engine.core.params import RequestOutput, SamplingParams, StoppingParams
from tests.engine.conftest import VOCAB
from tests.engine.fakes import FAKE_VOCAB, FakeRunner, expected_output, fake_engine
from tests.engine.test_model import reference, run_engine, small_engine, workload

GREEDY = SamplingParams()
Item = tuple[int, list[int], SamplingParams, StoppingParams]  # (arrival step, prompt, sampling, stopping)
Outputs = dict[str, list[RequestOutput]]


def mixed_items(seed: int, vocab: int, n: int, max_prompt: int, long_prompt: int) -> list[Item]:
    """Greedy and seeded sampling, stop ids met early, min_new_tokens over a stop id, logprobs,
    penalties that change the pick, max_new_tokens 1 and more, prompts that reach the context length (their
    max_new_tokens 0: the rest of the context)."""
    rng = random.Random(seed)
    shared = [rng.randrange(3, vocab) for _ in range(12)]
    items: list[Item] = []
    for i in range(n):
        prompt = (shared if i % 3 == 0 else []) + [
            rng.randrange(3, vocab) for _ in range(rng.randint(1, max_prompt))
        ]
        if i % 11 == 10:
            prompt = [rng.randrange(3, vocab) for _ in range(long_prompt)]  # ends by the context length
        max_new = rng.choice([1, 2, 5, 9, 16])
        kind = i % 6
        sampling, stopping = GREEDY, StoppingParams(max_new_tokens=max_new)
        if kind == 1:
            sampling = SamplingParams(temperature=5.0, top_k=20, seed=i)
        elif kind == 2 and vocab == FAKE_VOCAB:
            first = expected_output(prompt, max_new)
            stopping = StoppingParams(
                max_new_tokens=max_new, stop_token_ids=(first[rng.randrange(len(first))],)
            )
        elif kind == 3:
            stopping = StoppingParams(max_new_tokens=max_new + 3, min_new_tokens=3, stop_token_ids=(5, 7, 9))
        elif kind == 4:
            sampling = SamplingParams(temperature=2.0, seed=100 + i, logprobs=3)
        elif kind == 5:
            sampling = SamplingParams(frequency_penalty=25.0, presence_penalty=0.5, repetition_penalty=1.3)
        if len(prompt) == long_prompt:  # max_new_tokens 0: the rest of the context
            stopping = dataclasses.replace(stopping, max_new_tokens=0)
        items.append((rng.randint(0, 12), prompt, sampling, stopping))
    return items


def drive(engine: LLMEngine, items: list[Item], outs: Outputs | None = None) -> Outputs:
    """Adds each request at its arrival step and steps until idle; returns every output by request, added
    to `outs` (the outputs of every earlier step of the engine)."""
    outs = {} if outs is None else outs
    pending = sorted(enumerate(items), key=lambda x: x[1][0])
    step = 0
    while pending or engine.has_unfinished_requests():
        while pending and pending[0][1][0] <= step:
            i, (_, prompt, sampling, stopping) = pending.pop(0)
            engine.add_request(str(i), prompt, sampling, stopping)
        for o in engine.step():
            outs.setdefault(o.request_id, []).append(o)
        step += 1
        assert step < 10_000
    assert_done(engine, outs)
    emitted = sum(len(o.new_token_ids) for seq in outs.values() for o in seq)
    assert engine.stats().generated_tokens == emitted, "a discarded token is not counted"
    return outs


def assert_done(engine: LLMEngine, outs: Outputs) -> None:
    bm = engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks and all(c == 0 for c in bm.ref_counts)
    assert not engine.scheduler.running and not engine.scheduler.waiting
    for rid, seq in outs.items():
        assert [o.finished for o in seq].count(True) == 1 and seq[-1].finished, rid
        assert seq[-1].completion_tokens == sum(len(o.new_token_ids) for o in seq), rid


async def until_idle(engine: AsyncEngine, timeout_s: float = 60.0) -> None:
    """Polls until the loop holds no request and no unread step (generous: the machine is shared)."""
    deadline = time.monotonic() + timeout_s
    while not engine.idle():
        assert time.monotonic() < deadline, "engine did not go idle"
        await asyncio.sleep(0.005)


def tokens(seq: list[RequestOutput]) -> list[int]:
    return [t for o in seq for t in o.new_token_ids]


def fake(mode: str, num_blocks: int = 64, **settings: object) -> tuple[LLMEngine, FakeRunner]:
    engine, runner = fake_engine(num_blocks, async_scheduling=mode, **settings)
    assert engine.async_scheduling is (mode == "on")
    return engine, runner


def test_auto_is_off_on_cpu() -> None:
    assert fake_engine(8)[0].async_scheduling is False


def test_async_equals_sync_on_a_mixed_workload_with_preemption() -> None:
    items = mixed_items(seed=3, vocab=FAKE_VOCAB, n=60, max_prompt=30, long_prompt=60)
    settings = dict(block_size=4, max_model_len=64, max_num_batched_tokens=48)
    sync, _ = fake("off", 40, **settings)
    eager, runner = fake("on", 40, **settings)
    expected = drive(sync, items)
    got = drive(eager, items)
    assert got == expected
    assert runner.fed_from_device > 0, "decode inputs came from the previous step on the device"
    assert eager.stats().num_preemptions > 0, "the pool is too small for all: preemption must happen"
    reasons = {o.finish_reason for seq in got.values() for o in seq if o.finished}
    assert reasons == {"stop", "length"}
    for i, (_, prompt, sampling, stopping) in enumerate(items):
        if sampling == GREEDY and not stopping.stop_token_ids:  # plain greedy: the fake's own sequence
            assert tokens(got[str(i)]) == expected_output(prompt, len(tokens(got[str(i)])))


def test_a_request_stopped_at_step_n_has_its_token_of_step_n_plus_1_discarded() -> None:
    engine, runner = fake("on")
    want = expected_output([5], 6)
    engine.add_request("a", [5], GREEDY, StoppingParams(max_new_tokens=6, stop_token_ids=(want[2],)))
    outs = drive(engine, [])
    assert tokens(outs["a"]) == want[:3] and outs["a"][-1].finish_reason == "stop"
    # Four steps ran: the fourth was launched before the third's stop token was read, and was discarded.
    assert runner.steps == [[("a", 1)]] * 4


def test_a_request_whose_pending_token_is_its_last_is_not_scheduled_again() -> None:
    engine, runner = fake("on", max_model_len=8)
    engine.add_request("n", [5], GREEDY, StoppingParams(max_new_tokens=3))
    engine.add_request("ctx", [5, 6, 7, 8, 9], GREEDY, StoppingParams(max_new_tokens=0))
    outs = drive(engine, [])
    assert tokens(outs["n"]) == expected_output([5], 3) and outs["n"][-1].finish_reason == "length"
    assert (
        tokens(outs["ctx"]) == expected_output([5, 6, 7, 8, 9], 3)
        and outs["ctx"][-1].finish_reason == "length"
    )
    assert sum(1 for s in runner.steps for rid, _ in s if rid == "n") == 3
    assert sum(1 for s in runner.steps for rid, _ in s if rid == "ctx") == 3


def test_abort_between_steps_ends_the_request_at_the_next_step_with_no_token_after_it() -> None:
    engine, _ = fake("on")
    engine.add_request("a", [5, 6], GREEDY, StoppingParams(max_new_tokens=50))
    engine.add_request("b", [5, 7], GREEDY, StoppingParams(max_new_tokens=8))
    outs: Outputs = {}
    for _ in range(4):
        for o in engine.step():
            outs.setdefault(o.request_id, []).append(o)
    before = tokens(outs["a"])
    assert before == expected_output([5, 6], len(before)) and len(before) == 3  # the fourth is in flight
    engine.abort_request("a")
    after = engine.step()
    final = [o for o in after if o.request_id == "a"]
    outs["b"] += [o for o in after if o.request_id == "b"]
    assert len(final) == 1 and final[0].finished and final[0].finish_reason == "cancelled"
    assert final[0].new_token_ids == [] and final[0].completion_tokens == len(before)
    outs["a"] += final
    n = len(outs["a"])
    drive(engine, [], outs)
    assert len(outs["a"]) == n, "nothing after the final"
    assert tokens(outs["b"]) == expected_output([5, 7], 8)


def test_a_deadline_ends_the_request_at_the_next_step_without_its_pending_token() -> None:
    engine, _ = fake("on")
    engine.add_request(
        "a", [5, 6], GREEDY, StoppingParams(max_new_tokens=50), deadline=time.monotonic() + 3600
    )
    outs: Outputs = {}
    for _ in range(3):
        for o in engine.step():
            outs.setdefault(o.request_id, []).append(o)
    assert len(tokens(outs["a"])) == 2
    engine.requests["a"].deadline = time.monotonic() - 1.0  # passed: no waiting in the test
    out = engine.step()
    assert len(out) == 1 and out[0].finish_reason == "error" and out[0].new_token_ids == []
    assert out[0].error_code == DEADLINE_EXCEEDED and out[0].completion_tokens == 2
    outs["a"] += out
    drive(engine, [], outs)
    assert len(outs["a"]) == 3


@pytest.mark.parametrize("mode", ["off", "on"])
def test_a_failing_step_fails_only_its_requests(mode: str) -> None:
    engine, runner = fake(mode, max_num_seqs=2)
    for rid, prompt in (("a", [5, 6]), ("b", [5, 7]), ("w", [5, 8])):
        engine.add_request(rid, prompt, GREEDY, StoppingParams(max_new_tokens=6))
    got: Outputs = {}
    for _ in range(2):
        for o in engine.step():
            got.setdefault(o.request_id, []).append(o)
    runner.fail_next = True
    for o in engine.step():
        got.setdefault(o.request_id, []).append(o)
    for rid, prompt in (("a", [5, 6]), ("b", [5, 7])):
        assert got[rid][-1].finish_reason == "error" and "injected failure" in (got[rid][-1].error or "")
        assert got[rid][-1].error_code == INTERNAL
        assert tokens(got[rid]) == expected_output(prompt, 2)  # both steps before the failing one
        assert got[rid][-1].completion_tokens == 2
    engine.add_request("late", [5, 9], GREEDY, StoppingParams(max_new_tokens=4))
    failed = {rid: len(got[rid]) for rid in ("a", "b")}
    drive(engine, [], got)
    assert {rid: len(got[rid]) for rid in ("a", "b")} == failed
    assert tokens(got["w"]) == expected_output([5, 8], 6)
    assert tokens(got["late"]) == expected_output([5, 9], 4)


async def test_the_loop_thread_drains_the_step_in_flight() -> None:
    """Requests that stop on a stop id leave a launched step behind them; the loop reads it (nothing of
    it is emitted) and then goes idle."""
    core, runner = fake("on")
    eng = AsyncEngine(core)
    eng.start()
    want = {f"r{i}": expected_output([5, 6, i + 3], 8) for i in range(4)}
    try:
        caller = eng.open_caller()
        for i in range(4):
            stopping = StoppingParams(max_new_tokens=8, stop_token_ids=(want[f"r{i}"][i + 1],))
            caller.submit(f"r{i}", [5, 6, i + 3], GREEDY, stopping)
        caller.close_input()
        outs: Outputs = {}
        while batch := await asyncio.wait_for(caller.get(), 30):
            for o in batch:
                outs.setdefault(o.request_id, []).append(o)
        await until_idle(eng)
        assert core._in_flight is None
    finally:
        eng.stop()
    assert {rid: tokens(seq) for rid, seq in outs.items()} == {
        rid: w[: int(rid[1]) + 2] for rid, w in want.items()
    }
    assert {seq[-1].finish_reason for seq in outs.values()} == {"stop"}
    assert runner.fed_from_device > 0
    assert core.block_manager.num_free_blocks == core.block_manager.num_blocks


# ---- the real tiny model -------------------------------------------------------------------------


def test_greedy_equals_generate_with_async_scheduling(llama_dir: Path) -> None:
    items = workload(seed=11)
    engine = small_engine(llama_dir, async_scheduling="on")
    assert run_engine(engine, items) == reference(llama_dir, items)
    assert engine.stats().num_preemptions > 0, "the pool is too small for all: preemption must happen"


def test_async_equals_sync_on_the_model(llama_dir: Path) -> None:
    items = mixed_items(seed=5, vocab=VOCAB, n=24, max_prompt=40, long_prompt=250)
    expected = drive(small_engine(llama_dir, async_scheduling="off"), items)
    got = drive(small_engine(llama_dir, async_scheduling="on"), items)
    assert {k: tokens(v) for k, v in got.items()} == {k: tokens(v) for k, v in expected.items()}
    assert [o.finish_reason for v in got.values() for o in v] == [
        o.finish_reason for v in expected.values() for o in v
    ]
    lps = [(o.request_id, o.logprobs) for v in got.values() for o in v if o.logprobs]
    assert lps, "some requests ask for logprobs"
    for rid, seq in got.items():
        for mine, theirs in zip(seq, expected[rid], strict=True):
            if mine.logprobs is None:
                assert theirs.logprobs is None
                continue
            assert theirs.logprobs is not None
            for a, b in zip(mine.logprobs, theirs.logprobs, strict=True):
                assert a.top_ids == b.top_ids
                assert a.logprob == pytest.approx(b.logprob, abs=1e-4)
