"""LLMEngine: the synchronous engine core (no gRPC, no asyncio, no device code): `outputs = engine.step()`.

One thread drives it (`add`, `abort_request`, `step`); `make_request` (the one validation) is safe on any
thread. A request leaves with exactly one finished `RequestOutput`: "stop", "length", "cancelled" (emitted
by the next step) or "error" with its class (services/common/errors.py). A failure belongs to the request
that caused it; only a failure of the step itself fails the step's requests (`internal`), and the step that
makes `max_step_failures` in a row fails them `unavailable` and is `step_broken`, for the driver to rebuild.
Each mode is one path below: plain and async-scheduled steps (`_run_scheduled`: with async scheduling, step
N+1 is launched before step N is read, with the same outputs), speculative steps (`_run_speculative`).
Tokens are accepted by the scheduler (`update_from_output`); grammars wait in a `GrammarQueue` until
compiled. docs/architecture.md walks the modes and their invariants.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from services.common.errors import DEADLINE_EXCEEDED, INTERNAL, UNAVAILABLE
from services.engine.core import prompt_logprobs
from services.engine.core.block_manager import BlockManager, KVGroupSpec
from services.engine.core.grammar import GrammarCompiler, GrammarQueue, model_grammar_compiler
from services.engine.core.interfaces import Runner, StepObserver, context_length, uses_async_scheduling
from services.engine.core.params import RequestLimits, RequestOutput, SamplingParams, StoppingParams
from services.engine.core.params import validate_request as check_request
from services.engine.core.prompt_logprobs import PromptRows
from services.engine.core.request import PLACEHOLDER, Request
from services.engine.core.scheduler import Scheduler, SchedulerOutput
from services.engine.core.speculative import Speculator, row_owners
from services.engine.core.stats import EngineStats, StatsRecorder
from services.engine.core.stopping import drop_placeholder, request_output
from services.engine.settings import EngineSettings

if TYPE_CHECKING:
    from services.engine.executor.sampler import SampleHandle

log = logging.getLogger(__name__)


@dataclass
class _Launched:
    """A step on the device: its schedule, its sampling requests (row i) and its unread sampling."""

    sched: SchedulerOutput
    reqs: list[Request]
    handle: SampleHandle
    prompts: PromptRows  # prompt logprobs, launched with the step


class LLMEngine:
    """The engine core. `runner`: None loads the model from `settings` (and, from its tokenizer.json, the
    grammar compiler); a given runner (tests) comes with its `grammar_compiler`, None serving no grammar."""

    def __init__(
        self,
        settings: EngineSettings,
        runner: Runner | None = None,
        grammar_compiler: GrammarCompiler | None = None,
    ) -> None:
        self.settings = settings
        # The executor (torch) is imported when an engine is built: importing the core needs none of it.
        from services.engine.executor.grammar_mask import GrammarBatch
        from services.engine.executor.sampler import Sampler

        if runner is None:
            from services.engine.executor.model_runner import load_runner

            loaded = load_runner(settings)
            grammar_compiler = model_grammar_compiler(
                loaded.model_dir, loaded.vocab_size, loaded.eos_ids, settings.grammar_compile_threads
            )
            runner = loaded
        self.runner = runner
        self.grammar_compiler = grammar_compiler
        self.model_name = str(Path(settings.model).name) if settings.model else "sluice-tiny"
        bs = settings.block_size
        one_group = [KVGroupSpec(0, (), runner.num_blocks)]  # a fake runner's pool
        self.kv_groups: list[KVGroupSpec] = getattr(runner, "kv_groups", None) or one_group  # layer groups
        self.block_manager, *self.group_block_managers = (
            BlockManager(g.num_blocks, bs, settings.enable_prefix_caching) for g in self.kv_groups
        )
        self.max_model_len = context_length(settings, runner, bs)
        served, cap = grammar_compiler is not None, settings.default_max_new_tokens
        self.limits = RequestLimits(runner.vocab_size, self.max_model_len, served, cap)
        runner.prepare(self.max_model_len, settings.max_num_seqs)
        self.scheduler = self._new_scheduler()
        masks = GrammarBatch(grammar_compiler.vocab_size) if grammar_compiler is not None else None
        self.sampler = Sampler(runner.device, settings.seed, masks)
        self.async_scheduling = uses_async_scheduling(settings, runner)
        self.speculator = Speculator.create(settings, self.max_model_len)  # None: speculation off
        assert self.speculator is None or not self.async_scheduling, "speculation needs synchronous steps"
        self.recorder = StatsRecorder(
            self.scheduler,
            self.block_manager,
            runner,
            model=self.model_name,
            max_model_len=self.max_model_len,
        )
        self._in_flight: _Launched | None = None  # async: the launched step whose results are not read
        self.requests: dict[str, Request] = {}
        self.grammars = GrammarQueue(grammar_compiler, settings.grammar_compile_timeout_s)
        self.observer: StepObserver | None = None  # set by the service when metrics or tracing are on
        self._pending: list[RequestOutput] = []  # finals of aborted requests, emitted by the next step
        self._forming_until = 0.0  # time.monotonic() until which the forming batch leaves nothing to run
        self.failed_steps_in_a_row = 0  # steps that failed since the latest one that ran without failing
        self.last_step_error = ""  # what the latest failed step raised
        self._step_failed = False  # the current (after it, the latest) step failed

    @property
    def step_broken(self) -> bool:
        """True when the latest step failed and made `max_step_failures` failed steps in a row: the step
        itself is broken (a sticky device error, a repeated OOM), not one request; the driver rebuilds."""
        return self._step_failed and self.failed_steps_in_a_row >= self.settings.max_step_failures

    def _new_scheduler(self) -> Scheduler:
        groups = [*zip([self.block_manager, *self.group_block_managers], self.kv_groups, strict=True)]
        return Scheduler.from_settings(
            self.settings, self.max_model_len, [(bm, g.window) for bm, g in groups]
        )

    def reset(self) -> None:
        """Drops every request and the whole prefix cache (a failed step may have left blocks half-written),
        keeping the loaded model, its KV tensors and the cumulative figures. The driver's recovery after its
        loop failed (services/engine/core/async_engine.py) calls it once it has told every request's
        caller; the requests dropped here get no output."""
        old_scheduler = self.scheduler
        self.block_manager = bm = self.block_manager.renewed()
        self.group_block_managers = [m.renewed() for m in self.group_block_managers]
        self.scheduler = self._new_scheduler()
        self.scheduler.num_preemptions = old_scheduler.num_preemptions
        self.recorder.scheduler, self.recorder.block_manager = self.scheduler, bm
        self._in_flight = None  # its results are of no use now; the device finishes it in stream order
        self.requests = {}
        self.grammars.clear()
        self._pending = []
        self._forming_until = 0.0
        self._step_failed = False  # the count of failed steps stays: one more failure rebuilds at once

    # ---- requests ------------------------------------------------------------------------------

    def make_request(
        self,
        request_id: str,
        prompt_ids: Sequence[int],
        sampling: SamplingParams,
        stopping: StoppingParams,
        deadline: float | None = None,
    ) -> Request:
        """A validated request (`params.validate_request`: ValueError on bad input; `max_new_tokens` 0
        filled with the rest of the context). Safe on any thread. Past `deadline` (`time.monotonic()`),
        the request ends with finish_reason "error" (class `deadline_exceeded`)."""
        if not request_id:
            raise ValueError("request_id must not be empty")
        stopping = check_request(prompt_ids, sampling, stopping, self.limits)
        arrival, eos_ids = time.monotonic(), self.runner.eos_ids
        return Request(request_id, list(prompt_ids), sampling, stopping, arrival, deadline, eos_ids)

    def add(self, req: Request, *, trace_context: Mapping[str, str] | None = None) -> None:
        """Queues a request from `make_request`; it joins the batch at a coming step (a grammar request once
        its grammar compiled). ValueError when its id is already in flight. `trace_context` (W3C
        traceparent/tracestate) goes to the observer only."""
        if req.request_id in self.requests:
            raise ValueError(f"request id {req.request_id!r} is already in flight")
        self.requests[req.request_id] = req
        if req.sampling.grammar is not None:
            self.grammars.submit(req)
        else:
            self.scheduler.add(req)
        if self.observer is not None:
            self._observe(self.observer.on_arrival, req, trace_context)

    def add_request(
        self,
        request_id: str,
        prompt_ids: Sequence[int],
        sampling: SamplingParams,
        stopping: StoppingParams,
        *,
        trace_context: Mapping[str, str] | None = None,
        deadline: float | None = None,
    ) -> None:
        """`add(make_request(...))`, for a caller on the engine's thread. ValueError on bad input."""
        req = self.make_request(request_id, prompt_ids, sampling, stopping, deadline)
        self.add(req, trace_context=trace_context)

    def abort_request(self, request_id: str) -> None:
        """Ends the request and frees its blocks now; its final output ("cancelled") comes with the next
        step. Unknown or finished ids are ignored."""
        req = self.requests.pop(request_id, None)
        if req is None or req.finished:
            return
        drop_placeholder(req)
        self.grammars.cancel(req)
        self.scheduler.finish(req, "cancelled")
        self._pending.append(request_output(req, []))

    def fail_all(self, detail: str) -> list[RequestOutput]:
        """Ends every request with finish_reason "error" after an unexpected failure of a step outside the
        model's execution (`step` raised): a failed step, counted as `_fail_step` counts them, its
        requests ending `internal`, or `unavailable` once the step is broken."""
        outputs, self._pending = self._pending, []
        self._in_flight = None  # its results are of no use now; the device finishes it in stream order
        error_class = self._count_step_failure(detail)
        for req in list(self.requests.values()):
            outputs.append(self._fail(req, error_class, detail))
        if outputs and self.observer is not None:
            self._observe(self.observer.on_step_end, None, outputs, 0.0)
        return outputs

    def has_unfinished_requests(self) -> bool:
        """True while a request is in the engine, a final is to be emitted or a launched step is unread."""
        return bool(self.requests) or bool(self._pending) or self._in_flight is not None

    # ---- one step ------------------------------------------------------------------------------

    def idle_s(self) -> float:
        """Seconds left, after the latest step, while a dynamic or static batch forms and no step can run
        anything (0 when there is work). The driver waits that long, or until it adds or aborts a
        request, before the next step; a step before then is harmless and finds nothing to run."""
        if self._in_flight is not None:
            return 0.0
        now = time.monotonic()
        idle = max(0.0, self._forming_until - now)
        if not self.scheduler.running and not self.scheduler.waiting:
            idle = max(idle, self.grammars.idle_s(now))  # only compiles to wait for: poll, never spin
        return idle

    def step(self) -> list[RequestOutput]:
        """schedule → execute → sample → postprocess. Returns the outputs of this step, one per request
        that got a token or ended (with async scheduling, the tokens of the step launched before). Never
        blocks on a forming batch: it returns at once (see `idle_s`)."""
        start = time.perf_counter()
        self._step_failed = False
        outputs, self._pending = self._pending, []
        outputs.extend(self._expire(time.monotonic()))
        outputs.extend(self._admit_compiled())
        if self._in_flight is not None and self.scheduler.needs_host_tokens():
            outputs.extend(self._drain())
        sched = self._schedule()
        if sched.empty:
            ok = self._run_nothing(sched, outputs)
        else:
            if self.observer is not None:
                self._observe(self.observer.on_scheduled, sched)
            run = self._run_speculative if sched.num_draft_tokens else self._run_scheduled
            ok = run(sched, outputs)
        if ok and not self._step_failed:
            self.failed_steps_in_a_row = 0
        self._forget_finished(outputs)
        self._end_step(None if sched.empty else sched, outputs, start, timed=ok)
        return outputs

    def _admit_compiled(self) -> list[RequestOutput]:
        """Hands the requests whose grammar compiled to the scheduler; fails those whose compile failed."""
        if not len(self.grammars):
            return []
        ready, failed = self.grammars.take(time.monotonic())
        for req in ready:
            self.scheduler.add(req)
        return [self._fail(req, code, detail) for req, code, detail in failed]

    def _schedule(self) -> SchedulerOutput:
        """The scheduler's step, with the Speculator's drafts fitted into it."""
        sched = self.scheduler.schedule()
        if self.speculator is not None and self.speculator.propose(sched, len(self.scheduler.running)):
            self.scheduler.schedule_drafts(sched)
        self._forming_until = time.monotonic() + sched.wait_s
        return sched

    def _run_nothing(self, sched: SchedulerOutput, outputs: list[RequestOutput]) -> bool:
        """A step with nothing scheduled: reads the launched step, if any (True: the step's time counts),
        else fails a request that can never be scheduled."""
        if self._in_flight is not None:
            outputs.extend(self._drain())
            return True
        if sched.wait_s <= 0 and self.scheduler.waiting and not self.scheduler.running:
            # Unreachable while the context length fits the pool; never spin on a stuck request.
            detail = "request cannot be scheduled: the KV cache is too small"
            outputs.append(self._fail(self.scheduler.waiting[0], INTERNAL, detail))
        return False

    def _forget_finished(self, outputs: list[RequestOutput]) -> None:
        """Drops the requests that ended in this step (the scheduler ended them) from `requests`."""
        for out in outputs:
            req = self.requests.get(out.request_id) if out.finished else None
            if req is not None and req.finished:
                del self.requests[out.request_id]

    def _end_step(
        self, sched: SchedulerOutput | None, outputs: list[RequestOutput], start: float, timed: bool
    ) -> None:
        """The step's figures and the observer's end of step (for a step with nothing scheduled, only when
        it emitted something). `timed`: the step ran `sched` without failing, or read the step before."""
        step_s = time.perf_counter() - start
        ran = sched if sched is not None and timed else None
        self.recorder.record(outputs, step_s, ran=ran, timed=timed)
        if self.observer is not None and (sched is not None or outputs):
            self._observe(self.observer.on_step_end, sched, outputs, step_s)

    # ---- plain and async-scheduled steps ---------------------------------------------------------

    def _run_scheduled(self, sched: SchedulerOutput, outputs: list[RequestOutput]) -> bool:
        """Launches `sched`, reads the step launched before it (async), settles `sched` and, without async
        scheduling, reads it too; appends the outputs. False when the step failed: a failing step fails
        its requests, never the loop (a request of the step before gets that step's token first)."""
        prev, self._in_flight = self._in_flight, None
        try:
            launched = self._launch(sched, prev)
        except Exception as exc:
            log.exception("engine step failed")
            if prev is not None:
                self._read(prev, outputs)
            outputs.extend(self._fail_step(sched, exc))
            return False
        if prev is not None and (exc := self._read(prev, outputs)) is not None:
            outputs.extend(self._fail_step(sched, exc))  # it was fed that step's tokens
            return False
        try:
            self._settle(launched)
        except Exception as exc:
            log.exception("engine step failed")
            outputs.extend(self._fail_step(sched, exc))
            return False
        if self.async_scheduling:
            self._in_flight = launched
            return True
        return self._read(launched, outputs) is None

    def _launch(self, sched: SchedulerOutput, prev: _Launched | None) -> _Launched:
        """execute → sample, leaving the results on the device. `prev`: the step before, if unread."""
        if prev is None:
            logits, sampling = self.runner.execute(sched.scheduled)
        else:
            logits, sampling = self.runner.execute(sched.scheduled, prev.handle.token_ids)
        prompts = prompt_logprobs.launch(self.runner, self.sampler)
        return _Launched(sched, sampling, self.sampler.launch(logits, sampling), prompts)

    def _settle(self, launched: _Launched) -> None:
        """Once the tokens before `launched` are on the host: counts its computed tokens (registering full
        blocks) and gives each of its sampling requests a placeholder for the token it samples. Requests
        that ended meanwhile are left out."""
        live = [(req, n) for req, n in launched.sched.scheduled if not req.finished]
        self.scheduler.advance(SchedulerOutput(scheduled=live))
        for row, req in enumerate(launched.reqs):
            if not req.finished:
                req.token_ids.append(PLACEHOLDER)
                req.prev_row = row

    def _read(self, launched: _Launched, outputs: list[RequestOutput]) -> Exception | None:
        """Waits for the step's sampled ids and hands them to the scheduler (`update_from_output`), its
        outputs into `outputs`. On a failure, fails the step's requests instead and returns the exception."""
        try:
            result = launched.handle.result()
            prompt_logprobs.collect(launched.prompts)
            outputs.extend(
                self.scheduler.update_from_output(launched.reqs, result.token_ids, result.logprobs)
            )
        except Exception as exc:
            log.exception("engine step failed")
            outputs.extend(self._fail_step(launched.sched, exc))
            return exc
        return None

    def _drain(self) -> list[RequestOutput]:
        """Reads the launched step (async): afterwards every request holds its tokens on the host."""
        launched, self._in_flight = self._in_flight, None
        outputs: list[RequestOutput] = []
        if launched is not None:
            self._read(launched, outputs)
        return outputs

    # ---- speculative steps ---------------------------------------------------------------------

    def _run_speculative(self, sched: SchedulerOutput, outputs: list[RequestOutput]) -> bool:
        """A step with drafts, synchronously: execute, verify, and each sampling request keeps its
        accepted drafts and one more token (`update_from_verified`). False when the step failed."""
        assert self._in_flight is None, "speculative steps are synchronous"
        try:
            logits, rows = self.runner.execute(sched.scheduled)
            prompt_logprobs.collect(prompt_logprobs.launch(self.runner, self.sampler))
            reqs = row_owners(rows)
            result = self.sampler.verify(logits, reqs, [list(r.draft_ids) for r in reqs])
            self.scheduler.advance(sched)  # each request's own token; the accepted drafts follow
            outputs.extend(
                self.scheduler.update_from_verified(
                    sched, reqs, result.token_ids, result.logprobs, self.speculator
                )
            )
        except Exception as exc:
            log.exception("engine step failed")
            outputs.extend(self._fail_step(sched, exc))
            return False
        return True

    # ---- failures ------------------------------------------------------------------------------

    def _fail_step(self, sched: SchedulerOutput, exc: Exception) -> list[RequestOutput]:
        """Fails the requests of a step that failed (outputs already produced stand), counting the failed
        step: `internal` while one failure may be a request's own doing, `unavailable` once
        `max_step_failures` steps failed in a row (the step is broken: the gateway may retry elsewhere)."""
        detail = f"internal error in engine step: {exc}"
        error_class = self._count_step_failure(str(exc))
        if error_class == UNAVAILABLE:
            detail = f"{self.failed_steps_in_a_row} engine steps failed in a row: {exc}"
        return [self._fail(req, error_class, detail) for req, _ in sched.scheduled if not req.finished]

    def _count_step_failure(self, error: str) -> str:
        """Counts the current step as failed (once, however many parts of it failed); the class of its
        requests' errors."""
        if not self._step_failed:
            self._step_failed = True
            self.failed_steps_in_a_row += 1
        self.last_step_error = error
        return UNAVAILABLE if self.step_broken else INTERNAL

    def _expire(self, now: float) -> list[RequestOutput]:
        """Fails every request past its deadline, freeing its blocks before this step schedules."""
        expired = [r for r in self.requests.values() if r.deadline is not None and now > r.deadline]
        return [self._fail(req, DEADLINE_EXCEEDED, "deadline exceeded") for req in expired]

    def _fail(self, req: Request, error_class: str, detail: str) -> RequestOutput:
        """Ends the request with finish_reason "error", wherever it waits (a no-op on the state of one
        already finished)."""
        self.grammars.cancel(req)
        self.requests.pop(req.request_id, None)
        return self.scheduler.fail(req, error_class, detail)

    @staticmethod
    def _observe(hook: Callable[..., None], *args: object) -> None:
        try:
            hook(*args)
        except Exception:
            log.exception("engine observer failed")

    # ---- figures -------------------------------------------------------------------------------

    def stats(self) -> EngineStats:
        return self.recorder.snapshot()

    def reset_stats(self) -> None:
        """Zeroes the timing and peak figures (e.g. after a warm-up run)."""
        self.recorder.reset()
