"""The engine loop thread and its asyncio callers, on the fake model."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Iterator

import pytest

from services.common.errors import INTERNAL, INVALID_ARGUMENT, UNAVAILABLE
from services.engine.core.async_engine import AsyncEngine
from services.engine.core.params import RequestOutput, SamplingParams, StoppingParams
from services.engine.core.reports import Report
from services.engine.core.scheduler import SchedulerOutput
from tests.engine.fakes import expected_output, fake_engine


@pytest.fixture
def engine() -> Iterator[AsyncEngine]:
    core, _ = fake_engine(64)
    eng = AsyncEngine(core)
    eng.start()
    yield eng
    eng.stop()
    assert core.block_manager.num_free_blocks == core.block_manager.num_blocks


async def until_idle(engine: AsyncEngine) -> None:
    for _ in range(1000):
        if engine.idle():
            return
        await asyncio.sleep(0.005)
    raise AssertionError("engine did not go idle")


async def collect(caller) -> dict[str, list[RequestOutput]]:  # type: ignore[no-untyped-def]
    outs: dict[str, list[RequestOutput]] = {}
    while batch := await caller.get():
        for o in batch:
            outs.setdefault(o.request_id, []).append(o)
    return outs


async def test_slow_reader_gets_merged_outputs(engine: AsyncEngine) -> None:
    caller = engine.open_caller()
    for i in range(3):
        caller.submit(f"r{i}", [5, 6, i + 3], SamplingParams(), StoppingParams(max_new_tokens=10))
    caller.close_input()
    await until_idle(engine)
    batch = await caller.get()
    assert sorted(o.request_id for o in batch) == ["r0", "r1", "r2"]  # one merged entry per request
    for o in batch:
        assert o.finished and o.finish_reason == "length"
        assert o.new_token_ids == expected_output([5, 6, int(o.request_id[1]) + 3], 10)
    assert await caller.get() == []


async def test_callers_are_separate_and_ids_scoped(engine: AsyncEngine) -> None:
    a, b = engine.open_caller(), engine.open_caller()
    a.submit("x", [5, 6], SamplingParams(), StoppingParams(max_new_tokens=4))
    b.submit("x", [7, 8], SamplingParams(), StoppingParams(max_new_tokens=4))  # same id, other caller
    with pytest.raises(ValueError, match="in flight"):
        a.submit("x", [5], SamplingParams(), StoppingParams(max_new_tokens=4))
    a.close_input()
    b.close_input()
    outs_a, outs_b = await asyncio.gather(collect(a), collect(b))
    assert [t for o in outs_a["x"] for t in o.new_token_ids] == expected_output([5, 6], 4)
    assert [t for o in outs_b["x"] for t in o.new_token_ids] == expected_output([7, 8], 4)


async def test_close_aborts_everything_in_flight(engine: AsyncEngine) -> None:
    caller = engine.open_caller()
    for i in range(4):
        caller.submit(str(i), [5, 6], SamplingParams(), StoppingParams(max_new_tokens=0))
    await caller.get()
    caller.close()
    caller.close()
    await until_idle(engine)


async def test_abort_gives_a_cancelled_final(engine: AsyncEngine) -> None:
    caller = engine.open_caller()
    caller.submit("a", [5, 6], SamplingParams(), StoppingParams(max_new_tokens=0))
    await caller.get()
    caller.abort("a")
    caller.abort("a")
    caller.close_input()
    outs = await collect(caller)
    assert outs["a"][-1].finish_reason == "cancelled"
    assert sum(o.finished for o in outs["a"]) == 1


async def test_a_forming_batch_waits_on_the_loop_so_aborts_and_submits_act_at_once() -> None:
    """Dynamic batching with a 60 s window: every deadline below is far inside it, so only a loop that an
    abort or a submit wakes meets them (a step that slept out the window would not)."""
    core, _ = fake_engine(64, batching="dynamic", max_num_seqs=2, batch_wait_ms=60_000.0)
    forming = threading.Event()  # set when a step found a batch forming, with time left in its window
    schedule = core.scheduler.schedule

    def spy(now: float | None = None) -> SchedulerOutput:
        out = schedule(now)
        if out.wait_s > 0:
            forming.set()
        return out

    core.scheduler.schedule = spy  # type: ignore[method-assign]
    eng = AsyncEngine(core)
    eng.start()
    try:
        caller = eng.open_caller()
        caller.submit("a", [5, 6], SamplingParams(), StoppingParams(max_new_tokens=0))
        assert await asyncio.to_thread(forming.wait, 30)
        caller.abort("a")
        outs = await asyncio.wait_for(caller.get(), 20)
        assert [(o.request_id, o.finish_reason) for o in outs] == [("a", "cancelled")]
        forming.clear()
        caller.submit("b", [5, 6], SamplingParams(), StoppingParams(max_new_tokens=3))
        assert await asyncio.to_thread(forming.wait, 30)
        caller.submit("c", [5, 7], SamplingParams(), StoppingParams(max_new_tokens=3))  # the batch is full
        caller.close_input()
        got = await asyncio.wait_for(collect(caller), 20)
        assert [t for o in got["b"] for t in o.new_token_ids] == expected_output([5, 6], 3)
        assert [t for o in got["c"] for t in o.new_token_ids] == expected_output([5, 7], 3)
    finally:
        eng.stop()
    assert core.block_manager.num_free_blocks == core.block_manager.num_blocks


async def test_a_raising_step_fails_requests_and_the_loop_goes_on(engine: AsyncEngine) -> None:
    sched = engine.engine.scheduler
    real = sched.schedule
    calls = {"n": 0}

    def flaky(now: float | None = None):  # type: ignore[no-untyped-def]
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("scheduler bug")
        return real(now)

    sched.schedule = flaky  # type: ignore[method-assign]
    caller = engine.open_caller()
    caller.submit("a", [5, 6], SamplingParams(), StoppingParams(max_new_tokens=3))
    outs = await caller.get()
    assert outs[0].finish_reason == "error" and "scheduler bug" in (outs[0].error or "")
    caller.submit("b", [5, 6], SamplingParams(), StoppingParams(max_new_tokens=3))
    caller.close_input()
    got = await collect(caller)
    assert [t for o in got["b"] for t in o.new_token_ids] == expected_output([5, 6], 3)


async def test_rejected_duplicate_leaves_the_original_in_flight(engine: AsyncEngine) -> None:
    caller = engine.open_caller()
    caller.submit("a", [5, 6], SamplingParams(), StoppingParams(max_new_tokens=0))
    with pytest.raises(ValueError) as err:
        caller.submit("a", [7], SamplingParams(), StoppingParams(max_new_tokens=2))
    caller.reject("a", str(err.value))
    seen: list[RequestOutput] = []
    while not any(o.finished and o.finish_reason == "error" for o in seen):
        seen += await caller.get()
    caller.abort("a")  # the original is still in flight for this caller
    caller.close_input()
    outs = await collect(caller)
    assert outs["a"][-1].finish_reason == "cancelled"


async def test_build_constructs_and_steps_the_engine_on_one_thread() -> None:
    """Every torch operation of the engine process runs on one thread (one OpenMP pool): the factory
    and every step run on the loop thread, never on the event loop's."""
    import threading

    threads: dict[str, set[int]] = {"factory": set(), "step": set()}

    def factory():  # type: ignore[no-untyped-def]
        threads["factory"].add(threading.get_ident())
        core, _ = fake_engine(64)
        step = core.step

        def recorded_step():  # type: ignore[no-untyped-def]
            threads["step"].add(threading.get_ident())
            return step()

        core.step = recorded_step  # type: ignore[method-assign]
        return core

    eng = await AsyncEngine.build(factory)
    try:
        caller = eng.open_caller()
        caller.submit("a", [5, 6, 7], SamplingParams(), StoppingParams(max_new_tokens=3, ignore_eos=True))
        caller.close_input()
        outs = await collect(caller)
        assert sum(len(o.new_token_ids) for o in outs["a"]) == 3
    finally:
        eng.stop()
    assert len(threads["factory"]) == 1 and threads["step"] == threads["factory"]
    assert threading.get_ident() not in threads["step"]


async def test_build_raises_what_the_factory_raised() -> None:
    def factory():  # type: ignore[no-untyped-def]
        raise ValueError("no such model")

    with pytest.raises(ValueError, match="no such model"):
        await AsyncEngine.build(factory)


async def test_a_step_failing_after_the_model_fails_only_that_steps_requests() -> None:
    """A step that raises past the model's execution (here advancing the scheduled requests) fails the
    requests it ran; a request that waited outside that step still completes."""
    core, _ = fake_engine(64, max_num_seqs=1)
    real = core.scheduler.advance
    calls = {"n": 0}

    def flaky(sched: SchedulerOutput) -> None:
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("advance bug")
        real(sched)

    core.scheduler.advance = flaky  # type: ignore[method-assign]
    eng = AsyncEngine(core)
    eng.start()
    try:
        caller = eng.open_caller()
        caller.submit("a", [5, 6], SamplingParams(), StoppingParams(max_new_tokens=5))
        caller.submit("b", [5, 7], SamplingParams(), StoppingParams(max_new_tokens=3))
        caller.close_input()
        got = await asyncio.wait_for(collect(caller), 20)
    finally:
        eng.stop()
    assert got["a"][-1].finish_reason == "error" and got["a"][-1].error_code == INTERNAL
    assert "advance bug" in (got["a"][-1].error or "")
    assert [t for o in got["b"] for t in o.new_token_ids] == expected_output([5, 7], 3)
    assert got["b"][-1].finish_reason == "length"
    assert eng.failure() is None
    assert core.block_manager.num_free_blocks == core.block_manager.num_blocks


async def test_a_failing_fail_all_ends_every_caller_and_reports_the_failure() -> None:
    """When failing a broken step's requests raises too and no recovery is allowed (loop_recoveries 0),
    the loop cannot go on: every caller gets an `unavailable` final at once, later submits too, and the
    on_fatal callbacks learn why."""
    core, _ = fake_engine(64, loop_recoveries=0)

    def broken(*args: object) -> None:
        raise RuntimeError("broken engine")

    core.step = broken  # type: ignore[method-assign]
    core.fail_all = broken  # type: ignore[method-assign]
    eng = AsyncEngine(core)
    reasons: list[str] = []
    eng.on_fatal(reasons.append)
    eng.start()
    try:
        a, b = eng.open_caller(), eng.open_caller()
        a.submit("x", [5, 6], SamplingParams(), StoppingParams(max_new_tokens=5))
        b.submit("y", [5, 7], SamplingParams(), StoppingParams(max_new_tokens=5))
        a.close_input()
        outs_a, outs_b = await asyncio.wait_for(asyncio.gather(collect(a), b.get()), 20)
        assert [o.request_id for o in outs_b] == ["y"]
        for out in (outs_a["x"][-1], outs_b[0]):
            assert out.finished and out.finish_reason == "error"
            assert out.error_code == UNAVAILABLE and "broken engine" in (out.error or "")
        b.submit("z", [5], SamplingParams(), StoppingParams(max_new_tokens=2))
        b.close_input()
        late = await asyncio.wait_for(collect(b), 20)
        assert late["z"][-1].error_code == UNAVAILABLE
    finally:
        eng.stop()
    assert eng.failure() is not None and "broken engine" in eng.failure()  # type: ignore[operator]
    assert reasons == [eng.failure()]
    late_reasons: list[str] = []
    eng.on_fatal(late_reasons.append)  # registered after the failure: called at once
    assert late_reasons == reasons


def fail_after_next_token(eng: AsyncEngine) -> Callable[[], None]:
    """Returns `arm()`: once armed, the loop fails (the fault hook) right after the next step that gave a
    token, so the request that got it is still in flight when the loop fails."""
    core, armed = eng.engine, threading.Event()
    real_step = core.step

    def step() -> list[RequestOutput]:
        outputs = real_step()
        if armed.is_set() and any(o.new_token_ids for o in outputs):
            armed.clear()
            eng.inject_fault()
        return outputs

    core.step = step  # type: ignore[method-assign]
    return armed.set


async def until_ended(caller) -> RequestOutput:  # type: ignore[no-untyped-def]
    """The caller's next finished output (its outputs before are dropped)."""
    while True:
        for out in await asyncio.wait_for(caller.get(), 20):
            if out.finished:
                return out


async def test_a_failed_loop_recovers_in_process_and_serves_again() -> None:
    """A loop failure (the fault hook) within the budget: the request in flight ends `unavailable`, the
    recovery callbacks learn it failed, a submit during the rebuild is refused `unavailable`, the free
    list is full again with no cached block (a feed gets an empty snapshot), and the same caller's next
    request completes exactly; on_fatal never runs."""
    core, _ = fake_engine(64)
    eng = AsyncEngine(core)
    events: list[str] = []
    rebuild = threading.Event()
    real_reset = core.reset

    def held_reset() -> None:  # the rebuild waits until the test has looked at the engine meanwhile
        rebuild.wait(20)
        real_reset()

    core.reset = held_reset  # type: ignore[method-assign]
    arm = fail_after_next_token(eng)
    eng.on_recovery(lambda reason: events.append(f"failed: {reason}"), lambda n: events.append(f"back {n}"))
    eng.on_fatal(lambda reason: events.append(f"fatal: {reason}"))
    eng.start()
    try:
        feed = eng.open_feed()
        assert (await asyncio.wait_for(feed.next(), 20)).snapshot
        caller = eng.open_caller()
        arm()
        caller.submit("long", [5, 6, *range(10, 40)], SamplingParams(), StoppingParams(max_new_tokens=0))
        ended = await until_ended(caller)
        assert ended.request_id == "long"
        assert ended.error_code == UNAVAILABLE and "injected fault" in (ended.error or "")
        stored: set[bytes] = set()
        while len(stored) < 2:  # the prompt's two full blocks were cached and reported before the fault
            stored |= set((await asyncio.wait_for(feed.next(), 20)).stored)
        assert events == ["failed: engine loop stopped: injected fault"]
        caller.submit("during", [5, 6], SamplingParams(), StoppingParams(max_new_tokens=3))
        refused = await until_ended(caller)
        assert refused.request_id == "during" and refused.error_code == UNAVAILABLE
        rebuild.set()
        report: Report = await asyncio.wait_for(feed.next(), 20)
        while not report.snapshot:
            report = await asyncio.wait_for(feed.next(), 20)
        assert report.stored == [] and report.load.kv_blocks_used == 0
        caller.submit("after", [5, 7], SamplingParams(), StoppingParams(max_new_tokens=6))
        caller.close_input()
        got = await asyncio.wait_for(collect(caller), 20)
    finally:
        eng.stop()
    assert [t for o in got["after"] for t in o.new_token_ids] == expected_output([5, 7], 6)
    assert got["after"][-1].finish_reason == "length"
    assert events == ["failed: engine loop stopped: injected fault", "back 1"]
    assert eng.failure() is None
    assert core.block_manager.num_free_blocks == core.block_manager.num_blocks
    assert eng.stats().free_blocks == eng.stats().num_blocks


async def test_a_loop_failing_past_its_budget_is_for_good() -> None:
    """loop_recoveries 2 within the window: two failures recover, the third is for good (on_fatal,
    later submits refused `unavailable`)."""
    core, _ = fake_engine(64, loop_recoveries=2, loop_recovery_window_s=600.0)
    eng = AsyncEngine(core)
    arm = fail_after_next_token(eng)
    recovered: list[int] = []
    fatal: list[str] = []
    eng.on_recovery(lambda reason: None, recovered.append)
    eng.on_fatal(fatal.append)
    eng.start()
    try:
        caller = eng.open_caller()
        for n in range(3):
            while len(recovered) < n:  # submits are refused while the loop is rebuilt
                await asyncio.sleep(0.005)
            arm()
            caller.submit(f"r{n}", [5, 6], SamplingParams(), StoppingParams(max_new_tokens=0))
            ended = await until_ended(caller)
            assert ended.request_id == f"r{n}" and ended.error_code == UNAVAILABLE
            assert "injected fault" in (ended.error or "")
        for _ in range(1000):
            if fatal:
                break
            await asyncio.sleep(0.005)
        assert recovered == [1, 2]
        assert fatal == [eng.failure()] and "2 recoveries within 600s already" in fatal[0]
        caller.submit("late", [5], SamplingParams(), StoppingParams(max_new_tokens=2))
        late = await until_ended(caller)
        assert late.error_code == UNAVAILABLE
    finally:
        eng.stop()


async def test_a_rebuild_that_raises_is_for_good() -> None:
    core, _ = fake_engine(64)
    eng = AsyncEngine(core)
    fatal: list[str] = []

    def broken_reset() -> None:
        raise RuntimeError("no rebuild")

    core.reset = broken_reset  # type: ignore[method-assign]
    eng.on_fatal(fatal.append)
    eng.start()
    try:
        eng.inject_fault()
        for _ in range(1000):
            if fatal:
                break
            await asyncio.sleep(0.005)
    finally:
        eng.stop()
    assert fatal == [eng.failure()]
    assert "injected fault; rebuilding the engine failed: no rebuild" in fatal[0]


async def test_refused_submits_are_invalid_arguments(engine: AsyncEngine) -> None:
    caller = engine.open_caller()
    with pytest.raises(ValueError, match="context length") as err:
        caller.submit("big", [5] * engine.engine.max_model_len, SamplingParams(), StoppingParams())
    caller.reject("big", str(err.value))
    caller.close_input()
    outs = await asyncio.wait_for(collect(caller), 20)
    assert outs["big"][-1].finish_reason == "error"
    assert outs["big"][-1].error_code == INVALID_ARGUMENT
