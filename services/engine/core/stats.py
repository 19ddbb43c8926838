"""The engine's figures: `StatsRecorder` accumulates them, one `record` call per step, and `snapshot`
returns them as an `EngineStats` (read by the service's load reports, the async engine and the benchmarks).

What a step counts (`record`):
- every step: the tokens of its outputs (`generated_tokens`);
- a step that ran the model and did not fail (`ran`): one step, its batch (the largest batch and the
  forward share over the steps of that size), the KV pool's peak use, and the drafts it verified;
- a step that only read the step launched before it (async scheduling, `timed` without `ran`): its time and
  the forwards the runner saw finish meanwhile, in the totals only;
- a step that failed or had nothing to run: its tokens only.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from services.engine.core.block_manager import BlockManager
from services.engine.core.params import RequestOutput
from services.engine.core.scheduler import Scheduler, SchedulerOutput


@dataclass
class EngineStats:
    running: int
    waiting: int
    num_blocks: int
    free_blocks: int
    block_size: int
    steps: int
    max_model_len: int
    model: str
    forward_time_s: float  # cumulative time inside the model forward
    step_time_s: float  # cumulative time of whole steps that ran the model
    forward_share: float  # forward_time_s / step_time_s
    max_batch: int  # the largest number of requests in one step
    forward_share_at_max_batch: float  # the same share over the steps with max_batch requests
    peak_kv_efficiency: float  # tokens stored / token slots allocated, at the step with most blocks in use
    peak_blocks_used: int
    num_preemptions: int
    prefix_hit_rate: float  # cached blocks reused / full prompt blocks, once per request at admission
    prefix_query_blocks: int  # full prompt blocks looked up in the prefix cache (the rate's denominator)
    prefix_hit_blocks: int  # of those, found cached
    generated_tokens: int
    # Speculative decoding: drafts verified, drafts accepted, accepted / proposed, and the tokens emitted
    # per verification of a request with drafts (accepted + 1, averaged).
    spec_proposed_tokens: int = 0
    spec_accepted_tokens: int = 0
    spec_acceptance_rate: float = 0.0
    spec_mean_accepted_length: float = 0.0


class ForwardTimer(Protocol):
    last_forward_s: float  # forward seconds finished since the previous read (each reported once)


def _ratio(num: float, den: float) -> float:
    return num / den if den else 0.0


class StatsRecorder:
    """Owns the engine's counters; reads the scheduler, block manager and runner it is given (never
    changes them). Not thread-safe: the engine's thread records, others read `snapshot()` results."""

    def __init__(
        self,
        scheduler: Scheduler,
        block_manager: BlockManager,
        runner: ForwardTimer,
        *,
        model: str,
        max_model_len: int,
    ) -> None:
        self.scheduler = scheduler
        self.block_manager = block_manager
        self.runner = runner
        self.model = model
        self.max_model_len = max_model_len
        self.reset()

    def reset(self) -> None:
        """Zeroes the counters (e.g. after a warm-up run)."""
        self.steps = 0
        self.forward_s = self.step_s = 0.0
        self.max_batch = 0
        self.max_batch_forward_s = self.max_batch_step_s = 0.0
        self.peak_blocks = 0
        self.peak_efficiency = 0.0
        self.generated = 0
        self.spec_proposed = self.spec_accepted = self.spec_verified = 0

    def record(
        self,
        outputs: Sequence[RequestOutput],
        step_s: float,
        *,
        ran: SchedulerOutput | None = None,
        timed: bool = False,
    ) -> None:
        """One step: its `outputs` and duration; `ran`, the schedule of a step that ran the model without
        failing; `timed`, whether the step's time counts (one that ran, or read the step before it)."""
        self.generated += sum(len(o.new_token_ids) for o in outputs)
        if not (timed or ran is not None):
            return
        forward_s = self.runner.last_forward_s
        self.forward_s += forward_s
        self.step_s += step_s
        if ran is not None:
            self._record_ran(ran, forward_s, step_s)

    def _record_ran(self, sched: SchedulerOutput, forward_s: float, step_s: float) -> None:
        self.steps += 1
        batch = len(sched.scheduled)
        if batch > self.max_batch:
            self.max_batch, self.max_batch_forward_s, self.max_batch_step_s = batch, 0.0, 0.0
        if batch == self.max_batch:
            self.max_batch_forward_s += forward_s
            self.max_batch_step_s += step_s
        lengths = sched.spec_accepted_lengths
        self.spec_proposed += sched.num_draft_tokens
        self.spec_accepted += sum(lengths) - len(lengths)
        self.spec_verified += len(lengths)
        bm = self.block_manager
        used = bm.num_blocks - bm.num_free_blocks
        if used > self.peak_blocks:
            running = self.scheduler.running
            stored = sum(r.num_computed_tokens for r in running)
            allocated = sum(len(r.block_ids) for r in running) * bm.block_size
            self.peak_blocks = used
            self.peak_efficiency = _ratio(stored, allocated)

    def snapshot(self) -> EngineStats:
        bm, scheduler = self.block_manager, self.scheduler
        verified = self.spec_verified
        return EngineStats(
            running=len(scheduler.running),
            waiting=len(scheduler.waiting),
            num_blocks=bm.num_blocks,
            free_blocks=bm.num_free_blocks,
            block_size=bm.block_size,
            steps=self.steps,
            max_model_len=self.max_model_len,
            model=self.model,
            forward_time_s=self.forward_s,
            step_time_s=self.step_s,
            forward_share=_ratio(self.forward_s, self.step_s),
            max_batch=self.max_batch,
            forward_share_at_max_batch=_ratio(self.max_batch_forward_s, self.max_batch_step_s),
            peak_kv_efficiency=self.peak_efficiency,
            peak_blocks_used=self.peak_blocks,
            num_preemptions=scheduler.num_preemptions,
            prefix_hit_rate=_ratio(bm.prefix_hit_blocks, bm.prefix_query_blocks),
            prefix_query_blocks=bm.prefix_query_blocks,
            prefix_hit_blocks=bm.prefix_hit_blocks,
            generated_tokens=self.generated,
            spec_proposed_tokens=self.spec_proposed,
            spec_accepted_tokens=self.spec_accepted,
            spec_acceptance_rate=_ratio(self.spec_accepted, self.spec_proposed),
            spec_mean_accepted_length=1.0 + self.spec_accepted / verified if verified else 0.0,
        )
