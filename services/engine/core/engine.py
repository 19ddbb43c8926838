"""LLMEngine: the synchronous engine core (no gRPC, no asyncio, no device code).

    outputs = engine.step()   # schedule → execute the model → sample → postprocess

One thread drives it: `add_request`, `abort_request` and `step` are not thread-safe
(services/engine/core/async_engine.py runs it on its own thread for asyncio callers).
A request leaves the engine with exactly one finished `RequestOutput`: on EOS / a stop token
("stop"), max_new_tokens or the context length ("length"), `abort_request` ("cancelled", emitted by
the next step), or a failure inside a step ("error"; the loop goes on). Error messages carry their class
(services/common/errors.py). A failure belongs to the request that caused it: one request's grammar or
postprocessing failure ends that request only; only a failure of the step itself (the runner, the
sampler, reading the results) fails the step's requests, `internal`, and the engine counts such steps in
a row (`failed_steps_in_a_row`; a step that runs resets it): the one that reaches `max_step_failures`
fails its requests `unavailable` and is `step_broken`, for the driver to rebuild the loop.

A step runs in one of three modes:
- synchronous (`_run_scheduled`): execute, sample, read the sampled ids, postprocess;
- async scheduling (`EngineSettings.async_scheduling`; auto = on for CUDA; also `_run_scheduled`): a step
  launches step N+1 on the device (execute and sample, results left there) before it reads step N's
  sampled ids, then postprocesses step N and returns its outputs, so that the host's work overlaps the
  device's. A request sampled in step N holds `PLACEHOLDER` as its last token until step N is read; step
  N+1 feeds it from the device (`Request.prev_row`). Outputs are the same as without it:
  - a request that stops at step N and was scheduled again in N+1 has that step's token discarded; one
    whose pending token is its last by count (max_new_tokens, context length) is not scheduled again;
  - aborts, deadlines and failures end a request at once, dropping its pending token; its blocks are
    freed at once (a later step's writes to them follow the in-flight step's in stream order);
  - a step that needs the host's values of pending tokens (penalties over the output) reads step N first;
    a request preempted while its token is pending is not scheduled again before step N is read.
- speculative (`EngineSettings.speculative` ngram; synchronous steps only; `_run_speculative`): after
  scheduling, the `Speculator` (services/engine/core/speculative.py) gives drafts to the decoding requests
  that pass its gate, and the scheduler fits them into the step when it has budget and blocks to spare.
  `Sampler.verify` accepts the longest run the model agrees with plus one more token (rejection sampling
  for temperature > 0: the output distribution is the model's); the request appends them one by one under
  the stop rules, counts the accepted drafts as computed and frees blocks that held only rejected ones
  (`Scheduler.accept_drafts`).

Structured outputs: a request with a grammar (`SamplingParams.grammar`) has it compiled off the step thread
by the engine's `GrammarCompiler` (services/engine/core/grammar.py, one per model, cached by key, on
`grammar_compile_threads` threads) and is held back, outside the scheduler, until the compile is done: the
step never waits for it, and a compile error ends the request (`invalid_argument`, the message naming the
problem), as does a compile that has been RUNNING longer than `grammar_compile_timeout_s` (the grammar is
too complex: `invalid_argument`). Time spent queued behind other compiles never counts against it (a burst
of distinct grammars on a loaded machine queues legitimately): a queued request's wait is bounded by its own
deadline only. A request that ends meanwhile cancels its wait (a queued compile nobody else waits for never
runs). A grammar the library gives up on while the request generates (its parser's limits)
ends that request only (`invalid_argument`); one request's failure in postprocessing never fails the
step's other requests, whose outputs are always delivered. Its `GrammarState` accepts
each token the request keeps, in `_stopped` (never a token discarded after a stop, nor async scheduling's
discarded token); the sampler masks what the state forbids. Async scheduling reads a grammar request's
pending token before the next step, as for penalties; speculation gives it no drafts. Preemption keeps
`token_ids` (recompute), so the state, which holds exactly the kept output, stays as it is. A request
whose grammar has ended after a kept token finishes with "stop" (only EOS could follow).

Prompt logprobs: the runner keeps the prompt rows of a request that asks for them (`Runner.prompt_logits`)
through its chunked prefill; the engine turns them into log-probabilities with the sampler, collects them
on the request when the step is read, and sends them once, with its first token.

The figures (`stats()`) are kept by a `StatsRecorder` (services/engine/core/stats.py), one call per step.
Torch appears here only as types (the runner's device and logits, the sampler's handle), imported for type
checking; the executor (runner, sampler) is imported when an engine is built.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from services.common.errors import DEADLINE_EXCEEDED, INTERNAL, INVALID_ARGUMENT, UNAVAILABLE, error_message
from services.engine.core.block_manager import BlockManager, KVGroupSpec
from services.engine.core.grammar import GrammarCompiler, GrammarError, GrammarHandle
from services.engine.core.params import RequestOutput, SamplingParams, StoppingParams, TokenLogprob
from services.engine.core.request import PLACEHOLDER, Request
from services.engine.core.scheduler import Scheduler, SchedulerOutput
from services.engine.core.speculative import Speculator
from services.engine.core.stats import EngineStats, StatsRecorder
from services.engine.settings import EngineSettings

if TYPE_CHECKING:
    import torch

    from services.engine.executor.sampler import SampleHandle

log = logging.getLogger(__name__)

GRAMMAR_POLL_S = 0.001  # how often an engine with nothing else to do looks at grammars compiling


class Runner(Protocol):
    """What the engine needs from a model runner (executor/model_runner.py, or a fake in tests)."""

    device: torch.device
    num_blocks: int
    vocab_size: int
    eos_ids: frozenset[int]
    max_position_embeddings: int
    last_forward_s: float  # forward seconds finished since the previous read (each reported once)
    # The prompt rows the latest `execute` kept: (request, first position, logits (n, V)), row j predicting
    # the prompt token at position first + j + 1. Only for requests with `wants_prompt_logprobs`.
    prompt_logits: list[tuple[Request, int, torch.Tensor]]

    def prepare(self, max_model_len: int, max_num_seqs: int) -> None:
        """Called once by the engine before its first step, with the pool final: static buffers and CUDA
        graphs sized for `max_num_seqs` requests of up to `max_model_len` tokens."""
        ...

    def execute(
        self, scheduled: Sequence[tuple[Request, int]], prev_tokens: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, list[Request]]:
        """Runs one step; returns the logits (N, V) of the requests that sample (those whose chunk reaches
        their last token) and those requests, row i for logits row i. A request with `prev_row >= 0`
        takes its last input token from `prev_tokens[prev_row]` (the previous step's sampled ids, still on
        the device) instead of `token_ids[-1]`.

        Speculative decoding: a request with drafts (`draft_ids`) is scheduled for its last token plus
        them (positions num_tokens - 1 ...); its input is `token_ids + draft_ids` from
        `num_computed_tokens`, and it has 1 + len(draft_ids) consecutive rows in position order (row j:
        the distribution after its first j drafts), the request repeated once per row. Requests may come
        in any order, each one's rows together."""
        ...


class StepObserver(Protocol):
    """Metrics and tracing hooks (services/engine/observability.py), called on the engine's thread.
    A failing hook is logged and never fails a request or the step."""

    def on_arrival(self, request: Request, trace_context: Mapping[str, str] | None = None) -> None: ...

    def on_scheduled(self, sched: SchedulerOutput) -> None: ...

    def on_step_end(
        self, sched: SchedulerOutput | None, outputs: list[RequestOutput], step_s: float
    ) -> None: ...


@dataclass
class _Launched:
    """A step on the device: its schedule, the requests that sample (row i of the sampled ids) and the
    sampling, whose results the host has not read yet."""

    sched: SchedulerOutput
    reqs: list[Request]
    handle: SampleHandle
    prompts: list[tuple[Request, int, SampleHandle]]  # prompt logprobs: (request, first position, handle)


def context_length(settings: EngineSettings, runner: Runner, block_size: int) -> int:
    """The context length: `max_model_len`, else the model's own. A request alone must always fit in the
    pool, so a context length the pool cannot hold is refused with the numbers (never cut silently)."""
    capacity = runner.num_blocks * block_size
    model_len = settings.max_model_len or runner.max_position_embeddings or capacity
    if model_len > capacity:
        source = "max_model_len" if settings.max_model_len else "the model's max_position_embeddings"
        raise ValueError(
            f"context length {model_len} ({source}) does not fit the KV pool: {runner.num_blocks} blocks of "
            f"{block_size} tokens hold {capacity} tokens; give the pool more memory (kv_cache_gb, "
            "num_kv_blocks, gpu_memory_utilization) or set a smaller max_model_len"
        )
    return model_len


def uses_async_scheduling(settings: EngineSettings, runner: Runner) -> bool:
    """`async_scheduling` resolved: auto is on for CUDA, except with speculation (it proposes from the
    host's tokens; validate() refuses "on" with it)."""
    mode = settings.async_scheduling
    return mode == "on" or (mode == "auto" and runner.device.type == "cuda" and settings.speculative == "off")


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
            grammar_compiler = _grammar_compiler(
                loaded.model_dir, loaded.vocab_size, loaded.eos_ids, settings.grammar_compile_threads
            )
            runner = loaded
        self.runner = runner
        self.grammar_compiler = grammar_compiler
        self.model_name = str(Path(settings.model).name) if settings.model else "sluice-tiny"
        bs = settings.block_size
        self.block_manager, *self.group_block_managers = self._block_managers()
        self.max_model_len = context_length(settings, runner, bs)
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
        self._compiling: dict[Request, GrammarHandle] = {}  # held back until their grammar compiled
        self.observer: StepObserver | None = None  # set by the service when metrics or tracing are on
        self._pending: list[RequestOutput] = []  # finals of aborted requests, emitted by the next step
        self._forming_until = 0.0  # time.monotonic() until which the forming batch leaves nothing to run
        self.failed_steps_in_a_row = 0  # steps that failed since the latest one that ran without failing
        self.last_step_error = ""  # what the latest failed step raised
        self._step_failed = False  # the current (after it, the latest) step failed

    @property
    def step_broken(self) -> bool:
        """True when the latest step failed and made `max_step_failures` failed steps in a row: the step
        itself is broken (a sticky device error, a repeated OOM), not one request. The driver then rebuilds
        the loop (services/engine/core/async_engine.py)."""
        return self._step_failed and self.failed_steps_in_a_row >= self.settings.max_step_failures

    def _new_scheduler(self) -> Scheduler:
        settings = self.settings
        return Scheduler(
            self.block_manager,
            max_num_seqs=settings.max_num_seqs,
            max_num_batched_tokens=settings.max_num_batched_tokens,
            max_model_len=self.max_model_len,
            policy=settings.batching,
            batch_size=settings.static_batch_size if settings.batching == "static" else settings.max_num_seqs,
            batch_wait_s=settings.batch_wait_ms / 1000.0,
            sliding_window=self.kv_groups[0].window,
            extra_groups=[
                (bm, g.window) for bm, g in zip(self.group_block_managers, self.kv_groups[1:], strict=True)
            ],
        )

    @property
    def kv_groups(self) -> list[KVGroupSpec]:
        """The runner's KV groups (ModelRunner.kv_groups); one group of every layer for a runner without
        them (test fakes)."""
        groups = getattr(self.runner, "kv_groups", None)
        return list(groups) if groups else [KVGroupSpec(0, (), self.runner.num_blocks)]

    def _block_managers(self) -> list[BlockManager]:
        """A fresh block manager per KV group: every block free, no hash registered."""
        s = self.settings
        return [BlockManager(g.num_blocks, s.block_size, s.enable_prefix_caching) for g in self.kv_groups]

    def reset(self) -> None:
        """Drops every request and the whole prefix cache, keeping the loaded model, its KV tensors and
        the cumulative figures: a fresh block manager (every block free, no hash registered, since a
        failed step may have left blocks half-written) and scheduler over the same runner. The driver's
        recovery after its loop failed (services/engine/core/async_engine.py) calls it once it has told
        every request's caller; the requests dropped here get no output."""
        old_bm, old_scheduler = self.block_manager, self.scheduler
        bm, *self.group_block_managers = self._block_managers()
        bm.track_events = old_bm.track_events
        bm.prefix_hit_blocks, bm.prefix_query_blocks = old_bm.prefix_hit_blocks, old_bm.prefix_query_blocks
        self.block_manager = bm
        self.scheduler = self._new_scheduler()
        self.scheduler.num_preemptions = old_scheduler.num_preemptions
        self.recorder.scheduler, self.recorder.block_manager = self.scheduler, bm
        self._in_flight = None  # its results are of no use now; the device finishes it in stream order
        self.requests = {}
        for handle in self._compiling.values():
            handle.cancel()
        self._compiling = {}
        self._pending = []
        self._forming_until = 0.0
        self._step_failed = False  # the count of failed steps stays: one more failure rebuilds at once

    # ---- requests ------------------------------------------------------------------------------

    def validate_request(
        self, request_id: str, prompt_ids: Sequence[int], sampling: SamplingParams, stopping: StoppingParams
    ) -> None:
        """Raises ValueError with a clear message when the request cannot be served as given."""
        if not request_id:
            raise ValueError("request_id must not be empty")
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in flight")
        if not prompt_ids:
            raise ValueError("prompt_ids must not be empty")
        if len(prompt_ids) >= self.max_model_len:
            raise ValueError(
                f"prompt has {len(prompt_ids)} tokens; the context length is {self.max_model_len}, "
                "so at most max_model_len - 1 prompt tokens"
            )
        vocab = self.runner.vocab_size
        bad = next((t for t in prompt_ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise ValueError(f"token id {bad} is outside the vocabulary [0, {vocab})")
        sampling.validate()
        stopping.validate()
        bad = next((t for t, _ in sampling.logit_bias if t >= vocab), None)
        if bad is not None:
            raise ValueError(f"logit_bias: token id {bad} is outside the vocabulary [0, {vocab})")
        if sampling.grammar is not None and self.grammar_compiler is None:
            raise ValueError("structured outputs are not served: the model directory has no tokenizer.json")
        bad = next((t for t in stopping.stop_token_ids if t >= vocab), None)
        if bad is not None:  # it could never be generated: a stop that silently never stops
            raise ValueError(f"stop_token_ids: token id {bad} is outside the vocabulary [0, {vocab})")

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
        """Queues a request; it joins the batch at a coming step. ValueError on bad input.
        `trace_context` (W3C traceparent/tracestate) goes to the observer only. Past `deadline`
        (`time.monotonic()`), the request ends with finish_reason "error" (class `deadline_exceeded`)."""
        self.validate_request(request_id, prompt_ids, sampling, stopping)
        req = Request(
            request_id,
            list(prompt_ids),
            sampling,
            stopping,
            arrival_time=time.monotonic(),
            deadline=deadline,
            eos_ids=self.runner.eos_ids,
        )
        self.requests[request_id] = req
        if sampling.grammar is not None:
            assert self.grammar_compiler is not None, "validated"
            self._compiling[req] = self.grammar_compiler.submit(sampling.grammar)
        else:
            self.scheduler.add(req)
        if self.observer is not None:
            self._observe(self.observer.on_arrival, req, trace_context)

    def abort_request(self, request_id: str) -> None:
        """Ends the request and frees its blocks now; its final output ("cancelled") comes with the next
        step. Unknown or finished ids are ignored."""
        req = self.requests.pop(request_id, None)
        if req is None or req.finished:
            return
        self._drop_placeholder(req)
        self._stop_compile(req)
        self.scheduler.finish(req, "cancelled")
        self._pending.append(self._output(req, []))

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
        compiling = self._compiling and not self.scheduler.running and not self.scheduler.waiting
        if compiling and not any(self._compile_settled(h, now) for h in self._compiling.values()):
            idle = max(idle, GRAMMAR_POLL_S)  # only compiles to wait for: poll, never spin
        return idle

    def step(self) -> list[RequestOutput]:
        """schedule → execute → sample → postprocess. Returns the outputs of this step, one per request
        that got a token or ended (with async scheduling, the tokens of the step launched before). Never
        blocks on a forming batch: it returns at once (see `idle_s`)."""
        start = time.perf_counter()
        self._step_failed = False
        outputs, self._pending = self._pending, []
        outputs.extend(self._expire(time.monotonic()))
        if self._compiling:
            outputs.extend(self._admit_compiled())
        if self._in_flight is not None and self._needs_host_tokens():
            outputs.extend(self._drain())
        sched = self._schedule()
        if sched.empty:
            drained = self._run_nothing(sched, outputs)
            if drained and not self._step_failed:
                self.failed_steps_in_a_row = 0
            self._end_step(None, outputs, start, timed=drained)
            return outputs
        if self.observer is not None:
            self._observe(self.observer.on_scheduled, sched)
        run = self._run_speculative if sched.num_draft_tokens else self._run_scheduled
        ok = run(sched, outputs)
        if ok and not self._step_failed:
            self.failed_steps_in_a_row = 0
        self._end_step(sched, outputs, start, timed=ok)
        return outputs

    def _compile_settled(self, handle: GrammarHandle, now: float) -> bool:
        """Whether a request's compile is done or has been running longer than `grammar_compile_timeout_s`
        (the grammar is too complex). A compile still queued is never settled: the queue's length says
        nothing about the grammar, and the request's deadline (`_expire`) bounds its wait."""
        if handle.ready():
            return True
        started = handle.started
        return started is not None and now - started >= self.settings.grammar_compile_timeout_s

    def _compile_timed_out(self, req: Request) -> RequestOutput:
        timeout = f"grammar_compile_timeout_s ({self.settings.grammar_compile_timeout_s:g}s)"
        detail = f"grammar: compiling it took longer than {timeout}: it is too large or complex; simplify it"
        return self._fail(req, INVALID_ARGUMENT, detail)

    def _admit_compiled(self) -> list[RequestOutput]:
        """Hands the requests whose grammar compiled to the scheduler, in arrival order, each with its own
        grammar state; a compile that failed ends its request (`invalid_argument`, the compiler's words),
        and so does one that has run past its timeout (`_compile_settled`)."""
        outputs: list[RequestOutput] = []
        now = time.monotonic()
        for req, handle in list(self._compiling.items()):
            if not handle.ready():
                if self._compile_settled(handle, now):
                    outputs.append(self._compile_timed_out(req))
                continue
            del self._compiling[req]
            try:
                req.grammar = handle.result().new_state()
            except GrammarError as exc:
                outputs.append(self._fail(req, INVALID_ARGUMENT, str(exc)))
                continue
            except Exception as exc:  # the compiler itself failed (or was closed)
                outputs.append(self._fail(req, INTERNAL, f"grammar compile failed: {exc!r}"))
                continue
            self.scheduler.add(req)
        return outputs

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
            stuck = self.scheduler.waiting[0]
            detail = "request cannot be scheduled: the KV cache is too small"
            outputs.append(self._fail(stuck, INTERNAL, detail))
        return False

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
        prompts = self._launch_prompt_logprobs()
        return _Launched(sched, sampling, self.sampler.launch(logits, sampling), prompts)

    def _launch_prompt_logprobs(self) -> list[tuple[Request, int, SampleHandle]]:
        """The log-probabilities of the prompt rows the runner kept in its latest execute, launched."""
        launched = []
        for req, first, logits in self.runner.prompt_logits:
            targets = req.token_ids[first + 1 : first + 1 + logits.shape[0]]
            k = req.sampling.prompt_logprobs or 0
            launched.append((req, first, self.sampler.prompt_logprobs(logits, targets, k)))
        return launched

    @staticmethod
    def _collect_prompt_logprobs(prompts: list[tuple[Request, int, SampleHandle]]) -> None:
        """Appends read prompt log-probabilities to their requests, from the first position each lacks
        (a recompute after preemption may cover positions again)."""
        for req, first, handle in prompts:
            have = len(req.prompt_logprobs)
            if req.finished or first > have:
                continue
            entries = handle.result().logprobs[have - first :]
            req.prompt_logprobs.extend(e for e in entries if e is not None)

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
        """Waits for the step's sampled ids and postprocesses its requests into `outputs`. On a failure,
        fails them instead and returns the exception."""
        try:
            result = launched.handle.result()
            self._collect_prompt_logprobs(launched.prompts)
            self._postprocess(launched.reqs, result.token_ids, result.logprobs, outputs)
        except Exception as exc:
            log.exception("engine step failed")
            outputs.extend(self._fail_step(launched.sched, exc))
            return exc
        return None

    # ---- speculative decoding --------------------------------------------------------------------

    def _run_speculative(self, sched: SchedulerOutput, outputs: list[RequestOutput]) -> bool:
        """A step with drafts, synchronously: execute, verify, and each sampling request takes its
        accepted drafts and one more token. False when the step failed (its requests failed)."""
        assert self._in_flight is None, "speculative steps are synchronous"
        try:
            logits, rows = self.runner.execute(sched.scheduled)
            self._collect_prompt_logprobs(self._launch_prompt_logprobs())
            reqs = _row_owners(rows)
            result = self.sampler.verify(logits, reqs, [list(r.draft_ids) for r in reqs])
            self.scheduler.advance(sched)  # each request's own token; the accepted drafts follow
            for req, tokens, logprobs in zip(reqs, result.token_ids, result.logprobs, strict=True):
                self._own_failure(
                    req, outputs, lambda r=req, t=tokens, p=logprobs: self._accept(sched, r, t, p)
                )
        except Exception as exc:
            log.exception("engine step failed")
            outputs.extend(self._fail_step(sched, exc))
            return False
        return True

    def _accept(
        self, sched: SchedulerOutput, req: Request, tokens: list[int], logprobs: list
    ) -> RequestOutput | None:
        """Appends a verified run (accepted drafts, then one more token) token by token under the stop
        rules, tells the Speculator, and settles the request's counters."""
        if req.finished:
            return None
        drafts = len(req.draft_ids)
        accepted = len(tokens) - 1
        assert 0 <= accepted <= drafts, "verify returns the accepted drafts and one token"
        emitted: list[int] = []
        for tok in tokens:
            req.token_ids.append(tok)
            emitted.append(tok)
            if self._stopped(req, tok):
                break
        if drafts:
            assert self.speculator is not None, "drafts come from the speculator"
            self.speculator.verified(sched, req, drafts, accepted)
        if not req.finished:
            self.scheduler.accept_drafts(req, accepted)
        lps = logprobs[: len(emitted)] if logprobs and logprobs[0] is not None else None
        return self._output(req, emitted, lps)

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

    def _drain(self) -> list[RequestOutput]:
        """Reads the launched step (async): afterwards every request holds its tokens on the host."""
        launched, self._in_flight = self._in_flight, None
        outputs: list[RequestOutput] = []
        if launched is not None:
            self._read(launched, outputs)
        return outputs

    def _needs_host_tokens(self) -> bool:
        """Whether the next step needs the host's values of pending tokens: penalties over the output, or
        a grammar to advance before its next mask."""
        return any(
            r.prev_row >= 0 and (r.sampling.has_penalties or r.grammar is not None)
            for r in self.scheduler.running
        )

    @staticmethod
    def _drop_placeholder(req: Request) -> None:
        """A request ending before its pending token is read ends without it."""
        if req.prev_row >= 0:
            req.token_ids.pop()
            req.prev_row = -1

    @staticmethod
    def _observe(hook: Callable[..., None], *args: object) -> None:
        try:
            hook(*args)
        except Exception:
            log.exception("engine observer failed")

    def _postprocess(
        self, reqs: list[Request], tokens: list[int], logprobs: list, outputs: list[RequestOutput]
    ) -> None:
        """Writes each sampled token over its request's placeholder, applies the stop rules and appends
        the request's output to `outputs` as it goes; a request that ended since the step was launched
        (stopped, aborted, failed, expired) is skipped. A request whose postprocessing raises ends alone."""
        if not len(reqs) == len(tokens) == len(logprobs):
            raise RuntimeError(f"{len(reqs)} sampling requests but {len(tokens)} tokens read")
        for req, tok, lp in zip(reqs, tokens, logprobs, strict=True):
            if not req.finished:
                self._own_failure(req, outputs, lambda r=req, t=tok, p=lp: self._fill(r, t, p))

    def _fill(self, req: Request, tok: int, lp: TokenLogprob | None) -> RequestOutput:
        assert req.prev_row >= 0 and req.token_ids[-1] == PLACEHOLDER, "no placeholder to fill"
        req.token_ids[-1] = tok
        req.prev_row = -1
        self._stopped(req, tok)
        return self._output(req, [tok], [lp] if lp is not None else None)

    def _own_failure(
        self, req: Request, outputs: list[RequestOutput], produce: Callable[[], RequestOutput | None]
    ) -> None:
        """Appends `produce()`, one request's output of a step; an exception there is that request's
        failure, never the step's: it ends the request (`internal`) and the step's other outputs stand."""
        try:
            out = produce()
        except Exception as exc:
            log.exception("request %s failed in postprocessing", req.request_id)
            out = self._fail(req, INTERNAL, f"internal error in the request's postprocessing: {exc}")
        if out is not None:
            outputs.append(out)

    def _stopped(self, req: Request, tok: int) -> bool:
        """Advances `req`'s grammar with `tok`, its latest (kept) token, and ends `req` when `tok` stops it;
        whether it did. A token its grammar forbids (the mask let nothing else through: e.g. EOS held back
        by min_new_tokens where only EOS may come) ends it with an internal error; a grammar the library
        gives up on (GrammarError from `accept`) ends it with `invalid_argument`, naming the problem."""
        if req.grammar is not None:
            try:
                accepted = req.grammar.accept((tok,))
            except GrammarError as exc:  # the library gave up on the grammar: the request's own failure
                self._fail(req, INVALID_ARGUMENT, str(exc))
                return True
            if not accepted:
                self._fail(req, INTERNAL, f"token {tok} is outside the request's grammar")
                return True
        reason = self._stop_reason(req, tok)
        if reason is not None:
            self.scheduler.finish(req, reason)
            self.requests.pop(req.request_id, None)
        return reason is not None

    def _stop_reason(self, req: Request, tok: int) -> str | None:
        st = req.stopping
        # The sampler keeps stop tokens out until min_new_tokens tokens came before this one.
        if req.num_output_tokens > st.min_new_tokens and (
            tok in st.stop_token_ids or (not st.ignore_eos and tok in req.eos_ids)
        ):
            return "stop"
        if req.grammar is not None and req.grammar.is_terminated():
            return "stop"
        if req.num_output_tokens >= req.stopping.max_new_tokens or req.num_tokens >= self.max_model_len:
            return "length"
        return None

    def _expire(self, now: float) -> list[RequestOutput]:
        """Fails every request past its deadline, freeing its blocks before this step schedules."""
        expired = [r for r in self.requests.values() if r.deadline is not None and now > r.deadline]
        return [self._fail(req, DEADLINE_EXCEEDED, "deadline exceeded") for req in expired]

    def _fail(self, req: Request, error_class: str, detail: str) -> RequestOutput:
        """Ends the request with finish_reason "error" (a no-op on the state of one already finished)."""
        if not req.finished:
            self._drop_placeholder(req)
        self._stop_compile(req)
        self.scheduler.finish(req, "error", error_message(error_class, detail))
        self.requests.pop(req.request_id, None)
        return self._output(req, [])

    def _stop_compile(self, req: Request) -> None:
        """A request that ends while its grammar compiles no longer waits for it (a queued compile that
        nobody else waits for never runs)."""
        handle = self._compiling.pop(req, None)
        if handle is not None:
            handle.cancel()

    @staticmethod
    def _output(req: Request, tokens: list[int], logprobs: list | None = None) -> RequestOutput:
        """The output of `req` for `tokens`; its prompt logprobs go with its first token, once."""
        prompt: list[TokenLogprob] | None = None
        if tokens and req.sampling.prompt_logprobs is not None and not req.prompt_logprobs_sent:
            prompt, req.prompt_logprobs_sent = req.prompt_logprobs, True
        return RequestOutput(
            request_id=req.request_id,
            new_token_ids=tokens,
            logprobs=logprobs,
            finished=req.finished,
            finish_reason=req.finish_reason,
            prompt_tokens=req.num_prompt_tokens,
            completion_tokens=req.num_output_tokens,
            error=req.error,
            prompt_logprobs=prompt,
            cached_tokens=req.num_cached_tokens,
        )

    # ---- figures -------------------------------------------------------------------------------

    def stats(self) -> EngineStats:
        return self.recorder.snapshot()

    def reset_stats(self) -> None:
        """Zeroes the timing and peak figures (e.g. after a warm-up run)."""
        self.recorder.reset()


def _row_owners(rows: Sequence[Request]) -> list[Request]:
    """The requests of a step's logits rows, each once: a request with drafts owns 1 + len(draft_ids)
    consecutive rows (see `Runner.execute`)."""
    owners: list[Request] = []
    i = 0
    while i < len(rows):
        req = rows[i]
        span = 1 + len(req.draft_ids)
        if i + span > len(rows) or any(r is not req for r in rows[i : i + span]):
            raise RuntimeError(f"request {req.request_id}: its {span} rows are not together in the step")
        owners.append(req)
        i += span
    return owners


def _grammar_compiler(
    model_dir: Path, vocab_size: int, eos_ids: frozenset[int], threads: int
) -> GrammarCompiler | None:
    """The model's grammar compiler, from its tokenizer.json (None, with a warning, without one: requests
    with a grammar are then refused)."""
    if not (model_dir / "tokenizer.json").exists():
        log.warning("structured outputs off: %s has no tokenizer.json", model_dir)
        return None
    return GrammarCompiler.from_model_dir(
        model_dir, vocab_size=vocab_size, eos_ids=eos_ids, max_workers=threads
    )
