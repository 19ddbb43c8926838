"""A failure belongs to the request that caused it (docs/reliability.md): a grammar the matcher gives up
on ends that request only, with `invalid_argument`; every other request of the step gets its outputs
(one that finished in the same step included), and with async scheduling the next step is unaffected.
Steps that fail N times in a row go to the loop's in-process recovery (AsyncEngine), then, past its
budget, NOT_SERVING; their requests end `unavailable` once the step is known to be broken."""

from __future__ import annotations

import asyncio
import json
import threading
from pathlib import Path

import pytest

from services.common.errors import INTERNAL, INVALID_ARGUMENT, UNAVAILABLE
from services.engine.core.async_engine import AsyncEngine
from services.engine.core.engine import LLMEngine
from services.engine.core.grammar import GrammarSpec
from services.engine.core.params import RequestOutput, SamplingParams, StoppingParams
from services.engine.settings import EngineSettings
from tests.engine.conftest import TEST_DEVICE
from tests.engine.fakes import expected_output, fake_engine

# llguidance follows at most 2,000 alternatives in one Earley row: a choice of 2,001 strings that share a
# prefix compiles and masks, then the matcher refuses the first token ("Current row has 2002 items").
TOO_MANY = GrammarSpec("choice", json.dumps([f"answer number {i}" for i in range(2001)]))


def engine_for(model_dir: Path, async_scheduling: str) -> LLMEngine:
    settings = EngineSettings(
        model=str(model_dir),
        device=TEST_DEVICE,
        dtype="float32",
        max_num_batched_tokens=512,
        num_kv_blocks=64,
        max_num_seqs=16,
        max_model_len=256,
        async_scheduling=async_scheduling,
    )
    engine = LLMEngine(settings)
    assert engine.grammar_compiler is not None
    engine.grammar_compiler.submit(TOO_MANY).result(timeout=60)  # compiled: admitted at the first step
    return engine


def stopping(n: int) -> StoppingParams:
    return StoppingParams(max_new_tokens=n, ignore_eos=True)


def by_request(outputs: list[RequestOutput], into: dict[str, list[RequestOutput]]) -> None:
    for out in outputs:
        into.setdefault(out.request_id, []).append(out)


def ids(seq: list[RequestOutput]) -> list[int]:
    return [t for o in seq for t in o.new_token_ids]


@pytest.mark.parametrize("async_scheduling", ["off", "on"])
def test_a_grammar_the_matcher_gives_up_on_ends_only_its_request(
    tiny_model_dir: Path, async_scheduling: str
) -> None:
    engine = engine_for(tiny_model_dir, async_scheduling)
    assert engine.async_scheduling == (async_scheduling == "on")
    reference = engine_for(tiny_model_dir, "off")
    plain = [([5, 6, 7], 1), ([5, 6, 8], 6), ([9, 10], 12)]
    expected: dict[str, list[int]] = {}
    for i, (prompt, n) in enumerate(plain):  # each plain request's output, alone
        reference.add_request(f"p{i}", prompt, SamplingParams(), stopping(n))
    while reference.has_unfinished_requests():
        for out in reference.step():
            expected.setdefault(out.request_id, []).extend(out.new_token_ids)

    engine.add_request("bad", [5, 6], SamplingParams(grammar=TOO_MANY), StoppingParams(max_new_tokens=8))
    for i, (prompt, n) in enumerate(plain):
        engine.add_request(f"p{i}", prompt, SamplingParams(), stopping(n))
    outs: dict[str, list[RequestOutput]] = {}
    for _ in range(100):
        if not engine.has_unfinished_requests():
            break
        by_request(engine.step(), outs)
    assert not engine.has_unfinished_requests() and not engine.requests

    for i, (_, n) in enumerate(plain):  # the 1-token request finished in the failing step: delivered
        seq = outs[f"p{i}"]
        assert [o.finished for o in seq] == [False] * (len(seq) - 1) + [True]
        assert seq[-1].finish_reason == "length" and seq[-1].error is None
        assert ids(seq) == expected[f"p{i}"] and len(ids(seq)) == n
    final = outs["bad"][-1]
    assert final.finished and final.finish_reason == "error"
    assert final.error_code == INVALID_ARGUMENT
    assert "grammar" in (final.error or "") and "2000" in (final.error or "")
    assert len(final.error or "") < 1000, "the library's parser-state dump is not passed on"
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


async def test_an_async_engine_keeps_serving_the_others_of_the_step(tiny_model_dir: Path) -> None:
    core = engine_for(tiny_model_dir, "on")
    eng = AsyncEngine(core)
    eng.start()
    try:
        caller = eng.open_caller()
        caller.submit("bad", [5, 6], SamplingParams(grammar=TOO_MANY), StoppingParams(max_new_tokens=8))
        for i in range(4):
            caller.submit(f"p{i}", [5, 6, i + 3], SamplingParams(), stopping(1 + i))
        caller.close_input()
        outs: dict[str, list[RequestOutput]] = {}
        while batch := await asyncio.wait_for(caller.get(), 60):
            by_request(batch, outs)
    finally:
        eng.stop()
    assert outs["bad"][-1].error_code == INVALID_ARGUMENT
    for i in range(4):
        assert outs[f"p{i}"][-1].finish_reason == "length" and len(ids(outs[f"p{i}"])) == 1 + i
    assert eng.failure() is None


async def until_final(caller) -> RequestOutput:  # type: ignore[no-untyped-def]
    while True:
        for out in await asyncio.wait_for(caller.get(), 20):
            if out.finished:
                return out


# ---- steps that fail every time ---------------------------------------------------------------------


def broken_runner_engine(**settings: object) -> tuple[LLMEngine, object]:
    """The fake engine, its runner raising on every step from now on (a sticky device error)."""
    core, runner = fake_engine(64, **settings)

    def broken(*args: object, **kwargs: object) -> object:
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    runner.execute = broken  # type: ignore[method-assign]
    return core, runner


def test_the_engine_counts_consecutive_failed_steps_and_a_success_resets_the_count() -> None:
    core, runner = fake_engine(64, max_step_failures=3)
    assert core.failed_steps_in_a_row == 0
    finals: list[RequestOutput] = []
    for n in range(1, 4):
        runner.fail_next = True
        core.add_request(f"r{n}", [5, 6], SamplingParams(), StoppingParams(max_new_tokens=3))
        finals += [o for o in core.step() if o.finished]
        assert core.failed_steps_in_a_row == n
    # Below the budget a failed step's requests end `internal`; the step that reaches it, `unavailable`.
    assert [o.error_code for o in finals] == [INTERNAL, INTERNAL, UNAVAILABLE]
    core.add_request("ok", [5, 6], SamplingParams(), StoppingParams(max_new_tokens=2))
    got: list[int] = []
    while core.has_unfinished_requests():
        got += [t for o in core.step() for t in o.new_token_ids]
    assert got == expected_output([5, 6], 2)
    assert core.failed_steps_in_a_row == 0


async def test_a_step_that_always_fails_goes_to_recovery_then_not_serving() -> None:
    """A runner that raises on every step: after `max_step_failures` failed steps in a row the loop recovers
    in-process (the recovery callbacks run: the server turns NOT_SERVING), and past the recovery budget the
    engine is unavailable for good; once the step is known to be broken its requests end `unavailable`
    (the gateway retries those elsewhere before their first token), never `internal` forever."""
    core, _ = broken_runner_engine(max_step_failures=2, loop_recoveries=1, loop_recovery_window_s=600.0)
    eng = AsyncEngine(core)
    events: list[str] = []
    eng.on_recovery(lambda reason: events.append(f"failed: {reason}"), lambda n: events.append(f"back {n}"))
    eng.on_fatal(lambda reason: events.append(f"fatal: {reason}"))
    eng.start()
    classes: list[str] = []
    try:
        caller = eng.open_caller()
        for n in range(1000):  # one request at a time until the engine is unavailable for good
            if events and events[-1].startswith("fatal: "):
                break
            caller.submit(f"r{n}", [5, 6], SamplingParams(), StoppingParams(max_new_tokens=3))
            final = await until_final(caller)
            assert final.finish_reason == "error" and not final.new_token_ids
            classes.append(final.error_code)
            await asyncio.sleep(0.001)
    finally:
        eng.stop()
    assert classes[0] == INTERNAL, "one failed step may be the request's own doing"
    assert classes[1:] == [UNAVAILABLE] * (len(classes) - 1), "the second failure in a row: broken"
    assert events[0].startswith("failed: ") and "2 engine steps failed in a row" in events[0]
    assert "back 1" in events and events[-1].startswith("fatal: ")
    assert "illegal memory access" in events[-1]
    assert eng.failure() is not None


# ---- report feeds across a recovery -----------------------------------------------------------------


async def test_a_feed_opened_during_recovery_gets_reports_once_the_engine_serves_again() -> None:
    core, _ = fake_engine(64)
    eng = AsyncEngine(core)
    rebuild, failed = threading.Event(), threading.Event()
    real_reset = core.reset

    def held_reset() -> None:  # the rebuild waits until the feed has been opened meanwhile
        rebuild.wait(20)
        real_reset()

    core.reset = held_reset  # type: ignore[method-assign]
    eng.on_recovery(lambda reason: failed.set(), lambda n: None)
    eng.start()
    try:
        eng.inject_fault()
        for _ in range(4000):
            if failed.is_set():
                break
            await asyncio.sleep(0.005)
        assert failed.is_set()
        feed = eng.open_feed()  # while the loop is rebuilt
        rebuild.set()
        first = await asyncio.wait_for(feed.next(), 20)
        assert first.snapshot and first.stored == [] and first.load.kv_blocks_used == 0
        caller = eng.open_caller()
        prompt = list(range(5, 45))  # two full blocks of 16, cached once computed
        caller.submit("a", prompt, SamplingParams(), StoppingParams(max_new_tokens=3))
        caller.close_input()
        while await asyncio.wait_for(caller.get(), 20):
            pass
        stored: set[bytes] = set()
        while len(stored) < 2:
            stored |= set((await asyncio.wait_for(feed.next(), 20)).stored)
    finally:
        eng.stop()
    assert eng.failure() is None
