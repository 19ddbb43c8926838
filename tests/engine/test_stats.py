"""StatsRecorder: what each kind of step counts (tokens always; time for a step that ran the model or read
the step before it; steps, batch, KV peak and speculation for a step that ran), and the ratios of its
snapshot."""

from __future__ import annotations

import pytest

from services.engine.core.block_manager import BlockManager
from services.engine.core.params import RequestOutput, SamplingParams, StoppingParams
from services.engine.core.request import Request
from services.engine.core.scheduler import Scheduler, SchedulerOutput
from services.engine.core.stats import StatsRecorder


class Timer:
    """A runner's `last_forward_s`: the given values in turn, counting the reads."""

    def __init__(self, *values: float) -> None:
        self.values = list(values)
        self.reads = 0

    @property
    def last_forward_s(self) -> float:
        self.reads += 1
        return self.values.pop(0)


def setup(*forwards: float) -> tuple[StatsRecorder, Scheduler, Timer]:
    bm = BlockManager(8, 4)
    scheduler = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=64, max_model_len=32)
    timer = Timer(*forwards)
    return StatsRecorder(scheduler, bm, timer, model="m", max_model_len=32), scheduler, timer


def out(rid: str, n: int) -> RequestOutput:
    return RequestOutput(rid, list(range(n)), None, False, None, prompt_tokens=3, completion_tokens=n)


def admit(scheduler: Scheduler, *prompt_lens: int) -> SchedulerOutput:
    """A step of the running requests (each given a new token) and of new ones of `prompt_lens` tokens."""
    for r in scheduler.running:
        r.token_ids.append(9)
    for i, n in enumerate(prompt_lens):
        scheduler.add(Request(f"r{len(scheduler.running)}-{i}", [5] * n, SamplingParams(), StoppingParams(8)))
    sched = scheduler.schedule()
    scheduler.advance(sched)
    return sched


def test_a_step_that_ran_nothing_counts_its_tokens_only() -> None:
    recorder, _, timer = setup()
    recorder.record([out("a", 2), out("b", 0)], 1.0)
    st = recorder.snapshot()
    assert st.generated_tokens == 2
    assert (st.steps, st.step_time_s, st.forward_time_s, st.max_batch) == (0, 0.0, 0.0, 0)
    assert timer.reads == 0, "the runner's forwards stay unread for the next timed step"


def test_a_step_that_read_the_step_before_counts_its_time_only() -> None:
    recorder, _, timer = setup(0.25)
    recorder.record([out("a", 1)], 0.5, timed=True)
    st = recorder.snapshot()
    assert (st.generated_tokens, st.steps, st.max_batch) == (1, 0, 0)
    assert (st.forward_time_s, st.step_time_s, st.forward_share) == (0.25, 0.5, 0.5)
    assert timer.reads == 1


def test_steps_that_ran_count_batch_peak_and_speculation() -> None:
    recorder, scheduler, _ = setup(1.0, 3.0, 0.5)
    two = admit(scheduler, 3, 3)  # two requests of 3 tokens, a block each
    recorder.record([], 2.0, ran=two, timed=True)
    one = SchedulerOutput(scheduled=two.scheduled[:1], num_draft_tokens=5, spec_accepted_lengths=[3, 1])
    recorder.record([out("a", 4)], 4.0, ran=one, timed=True)
    again = SchedulerOutput(scheduled=two.scheduled)
    recorder.record([], 1.0, ran=again, timed=True)
    st = recorder.snapshot()
    assert (st.steps, st.max_batch, st.generated_tokens) == (3, 2, 4)
    assert st.forward_share == pytest.approx(4.5 / 7.0)
    assert st.forward_share_at_max_batch == pytest.approx(1.5 / 3.0), "the steps of two requests only"
    assert (st.peak_blocks_used, st.peak_kv_efficiency) == (2, 6 / 8)
    assert (st.spec_proposed_tokens, st.spec_accepted_tokens) == (5, 2)
    assert st.spec_acceptance_rate == pytest.approx(0.4)
    assert st.spec_mean_accepted_length == pytest.approx(2.0)
    assert (st.running, st.waiting, st.num_blocks, st.free_blocks) == (2, 0, 8, 6)


def test_a_larger_batch_restarts_the_share_at_max_batch_and_reset_zeroes() -> None:
    recorder, scheduler, _ = setup(1.0, 1.0)
    first = admit(scheduler, 3)
    recorder.record([], 4.0, ran=first, timed=True)
    second = admit(scheduler, 3, 3)
    recorder.record([], 2.0, ran=second, timed=True)
    st = recorder.snapshot()
    assert st.max_batch == 3 and st.forward_share_at_max_batch == pytest.approx(0.5)
    recorder.reset()
    st = recorder.snapshot()
    assert (st.steps, st.max_batch, st.peak_blocks_used, st.generated_tokens) == (0, 0, 0, 0)
    assert st.step_time_s == 0.0
    assert (st.forward_share, st.spec_acceptance_rate, st.spec_mean_accepted_length) == (0.0, 0.0, 0.0)
    assert st.running == 3, "live figures still come from the scheduler"
