"""LLMEngine: the synchronous engine core (no gRPC, no asyncio).

    outputs = engine.step()   # schedule → execute the model → sample → postprocess

One thread drives it: `add_request`, `abort_request` and `step` are not thread-safe
(services/engine/core/async_engine.py runs it on its own thread for asyncio callers).
A request leaves the engine with exactly one finished `RequestOutput`: on EOS / a stop token
("stop"), max_new_tokens or the context length ("length"), `abort_request` ("cancelled", emitted by
the next step), or a failure inside a step ("error"; the loop goes on). Error messages carry their class
(services/engine/errors.py).

Async scheduling (`EngineSettings.async_scheduling`; auto = on for CUDA): a step launches step N+1 on
the device (execute and sample, results left there) before it reads step N's sampled ids, then
postprocesses step N and returns its outputs, so that the host's work overlaps the device's. A request
sampled in step N holds `PLACEHOLDER` as its last token until step N is read; step N+1 feeds it from the
device (`Request.prev_row`). Outputs are the same as without it:
- a request that stops at step N and was scheduled again in N+1 has that step's token discarded; one
  whose pending token is its last by count (max_new_tokens, context length) is not scheduled again;
- aborts, deadlines and failures end a request at once, dropping its pending token; its blocks are
  freed at once (a later step's writes to them follow the in-flight step's in stream order);
- a step that needs the host's values of pending tokens (penalties over the output) reads step N first;
  a request preempted while its token is pending is not scheduled again before step N is read.

Speculative decoding (`EngineSettings.speculative` ngram; synchronous steps only): before scheduling, each
running request about to decode proposes up to `num_speculative_tokens` drafts from its own tokens
(services/engine/core/speculative.py) into `Request.spec_ids`; the scheduler computes them with its last token
in one chunk when the step has budget and blocks to spare. `Sampler.verify` accepts the longest run the
model agrees with plus one more token (rejection sampling for temperature > 0: the output distribution is
the model's); the request appends them one by one under the stop rules, counts the accepted drafts as
computed and frees blocks that held only rejected ones (`Scheduler.accept_drafts`). A request never
proposes while it has penalties, is under `min_new_tokens`, or is paused by the acceptance gate (`_gate`),
nor more drafts than could be emitted before max_new_tokens or the context length.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch

from services.engine.core.block_manager import BlockManager
from services.engine.core.params import RequestOutput, SamplingParams, StoppingParams
from services.engine.core.request import PLACEHOLDER, Request
from services.engine.core.scheduler import Scheduler, SchedulerOutput
from services.engine.core.speculative import TokenMirror
from services.engine.errors import DEADLINE_EXCEEDED, INTERNAL, error_message
from services.engine.executor.sampler import SampleHandle, Sampler
from services.engine.settings import EngineSettings

log = logging.getLogger(__name__)

# The acceptance gate of speculative decoding (see LLMEngine._gate): a request's acceptance is judged over
# windows of this many verified drafts; one below `speculative_min_acceptance` pauses its proposals for
# SPEC_COOLDOWN output tokens, twice as long after each failed window in a row, up to SPEC_MAX_COOLDOWN.
SPEC_GATE_WINDOW = 8
SPEC_COOLDOWN = 16
SPEC_MAX_COOLDOWN = 256


class Proposer(Protocol):
    """Speculative drafts for a request (services/engine/core/speculative.py's NgramProposer, or a test's)."""

    def propose(
        self, token_ids: Sequence[int], max_tokens: int, mirror: TokenMirror | None = None
    ) -> list[int]:
        """Up to `max_tokens` tokens likely to follow `token_ids` (prompt + output); [] for none. `mirror`:
        the request's own copy of its tokens as an array, kept up to date across calls."""
        ...


class Runner(Protocol):
    """What the engine needs from a model runner (executor/model_runner.py, or a fake in tests)."""

    device: torch.device
    num_blocks: int
    vocab_size: int
    eos_ids: frozenset[int]
    max_position_embeddings: int
    last_forward_s: float  # forward seconds finished since the previous read (each reported once)

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

        Speculative decoding: a request with drafts (`spec_ids`) is scheduled for its last token plus
        them (positions num_tokens - 1 ...); its input is `token_ids + spec_ids` from
        `num_computed_tokens`, and it has 1 + len(spec_ids) consecutive rows in position order (row j:
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
    generated_tokens: int
    # Speculative decoding: drafts verified, drafts accepted, accepted / proposed, and the tokens emitted
    # per verification of a request with drafts (accepted + 1, averaged).
    spec_proposed_tokens: int = 0
    spec_accepted_tokens: int = 0
    spec_acceptance_rate: float = 0.0
    spec_mean_accepted_length: float = 0.0


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


class LLMEngine:
    def __init__(self, settings: EngineSettings, runner: Runner | None = None) -> None:
        settings.validate()
        self.settings = settings
        if runner is None:
            from services.engine.executor.model_runner import load_runner

            runner = load_runner(settings)
        self.runner = runner
        self.model_name = str(Path(settings.model).name) if settings.model else "sluice-tiny"
        bs = settings.block_size
        self.block_manager = BlockManager(runner.num_blocks, bs, settings.enable_prefix_caching)
        self.max_model_len = context_length(settings, runner, bs)
        runner.prepare(self.max_model_len, settings.max_num_seqs)
        self.scheduler = Scheduler(
            self.block_manager,
            max_num_seqs=settings.max_num_seqs,
            max_num_batched_tokens=settings.max_num_batched_tokens,
            max_model_len=self.max_model_len,
            policy=settings.batching,
            batch_size=settings.static_batch_size if settings.batching == "static" else settings.max_num_seqs,
            batch_wait_s=settings.batch_wait_ms / 1000.0,
            spec_disable_batch_size=(
                settings.speculative_disable_batch_size if settings.speculative != "off" else 0
            ),
        )
        self.sampler = Sampler(runner.device, settings.seed)
        mode = settings.async_scheduling
        # Speculation proposes from the host's tokens, so auto leaves async scheduling off with it.
        self.async_scheduling = mode == "on" or (
            mode == "auto" and runner.device.type == "cuda" and settings.speculative == "off"
        )
        self.proposer: Proposer | None = self._make_proposer(settings)
        assert self.proposer is None or not self.async_scheduling, "speculation needs synchronous steps"
        self._in_flight: _Launched | None = None  # async: the launched step whose results are not read
        self.requests: dict[str, Request] = {}
        self.observer: StepObserver | None = None  # set by the service when metrics or tracing are on
        self._pending: list[RequestOutput] = []  # finals of aborted requests, emitted by the next step
        self._forming_until = 0.0  # time.monotonic() until which the forming batch leaves nothing to run
        self._steps = 0
        self._forward_s = 0.0
        self._step_s = 0.0
        self._max_batch = 0
        self._max_batch_forward_s = 0.0
        self._max_batch_step_s = 0.0
        self._peak_blocks = 0
        self._peak_efficiency = 0.0
        self._generated = 0
        self._spec_proposed = 0
        self._spec_accepted = 0
        self._spec_verified = 0  # verifications of a request with drafts

    @staticmethod
    def _make_proposer(settings: EngineSettings) -> Proposer | None:
        if settings.speculative == "off":
            return None
        from services.engine.core.speculative import NgramProposer

        log.info(
            "speculative decoding: %s, up to %d tokens per step, n-grams of %d..%d tokens; no proposals in "
            "steps with more than %d running requests, paused for requests below %.0f%% acceptance",
            settings.speculative,
            settings.num_speculative_tokens,
            settings.ngram_min,
            settings.ngram_max,
            settings.speculative_disable_batch_size,
            100 * settings.speculative_min_acceptance,
        )
        return NgramProposer(settings.num_speculative_tokens, settings.ngram_min, settings.ngram_max)

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
        self.scheduler.finish(req, "cancelled")
        self._pending.append(self._output(req, []))

    def fail_all(self, detail: str) -> list[RequestOutput]:
        """Ends every request with finish_reason "error", class `internal` (after an unexpected failure
        of a step outside the model's execution)."""
        outputs, self._pending = self._pending, []
        self._in_flight = None  # its results are of no use now; the device finishes it in stream order
        for req in list(self.requests.values()):
            outputs.append(self._fail(req, INTERNAL, detail))
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
        return max(0.0, self._forming_until - time.monotonic())

    def step(self) -> list[RequestOutput]:
        """schedule → execute → sample → postprocess. Returns the outputs of this step, one per request
        that got a token or ended (with async scheduling, the tokens of the step launched before). Never
        blocks on a forming batch: it returns at once (see `idle_s`)."""
        start = time.perf_counter()
        outputs, self._pending = self._pending, []
        outputs.extend(self._expire(time.monotonic()))
        if self._in_flight is not None and self._needs_host_tokens():
            outputs.extend(self._drain())
        if self.proposer is not None:
            self._propose(self.proposer)
        sched = self.scheduler.schedule()
        self._forming_until = time.monotonic() + sched.wait_s
        if sched.empty:
            if self._in_flight is not None:
                outputs.extend(self._drain())
                self._account_drain(time.perf_counter() - start)
            elif sched.wait_s <= 0 and self.scheduler.waiting and not self.scheduler.running:
                # Unreachable while the context length fits the pool; never spin on a stuck request.
                stuck = self.scheduler.waiting[0]
                detail = "request cannot be scheduled: the KV cache is too small"
                outputs.append(self._fail(stuck, INTERNAL, detail))
            if outputs and self.observer is not None:
                self._observe(self.observer.on_step_end, None, outputs, time.perf_counter() - start)
            return outputs
        if self.observer is not None:
            self._observe(self.observer.on_scheduled, sched)
        ok = self._run_scheduled(sched, outputs)
        if ok:
            self._account(sched, time.perf_counter() - start)
        if self.observer is not None:
            self._observe(self.observer.on_step_end, sched, outputs, time.perf_counter() - start)
        return outputs

    def _run_scheduled(self, sched: SchedulerOutput, outputs: list[RequestOutput]) -> bool:
        """Launches `sched`, reads the step launched before it (async), settles `sched` and, without async
        scheduling, reads it too; appends the outputs. False when the step failed: a failing step fails
        its requests, never the loop (a request of the step before gets that step's token first)."""
        if sched.num_draft_tokens:
            return self._run_speculative(sched, outputs)
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
        return _Launched(sched, sampling, self.sampler.launch(logits, sampling))

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
            outputs.extend(self._postprocess(launched.reqs, result.token_ids, result.logprobs))
        except Exception as exc:
            log.exception("engine step failed")
            outputs.extend(self._fail_step(launched.sched, exc))
            return exc
        return None

    # ---- speculative decoding --------------------------------------------------------------------

    def _propose(self, proposer: Proposer) -> None:
        """Drafts for each running request about to decode that may speculate (see the module docstring),
        unless the batch is already past `speculative_disable_batch_size`."""
        running = self.scheduler.running
        if len(running) > self.settings.speculative_disable_batch_size:
            return
        k = self.settings.num_speculative_tokens
        for req in running:
            if req.num_tokens - req.num_computed_tokens != 1 or not self._may_speculate(req):
                continue
            # A step emits at most drafts + 1 tokens: never past max_new_tokens or the context length.
            room = min(
                k,
                req.stopping.max_new_tokens - req.num_output_tokens - 1,
                self.max_model_len - req.num_tokens - 1,
            )
            if room > 0:
                if req.token_mirror is None:
                    req.token_mirror = TokenMirror()
                req.spec_ids = list(proposer.propose(req.token_ids, room, req.token_mirror))[:room]

    @staticmethod
    def _may_speculate(req: Request) -> bool:
        return (
            req.prev_row < 0
            and not req.sampling.has_penalties
            and req.num_output_tokens >= req.stopping.min_new_tokens
            and req.num_output_tokens >= req.spec_resume_at
        )

    def _run_speculative(self, sched: SchedulerOutput, outputs: list[RequestOutput]) -> bool:
        """A step with drafts, synchronously: execute, verify, and each sampling request takes its
        accepted drafts and one more token. False when the step failed (its requests failed)."""
        assert self._in_flight is None, "speculative steps are synchronous"
        try:
            logits, rows = self.runner.execute(sched.scheduled)
            reqs = _row_owners(rows)
            result = self.sampler.verify(logits, reqs, [r.spec_ids for r in reqs])
            self.scheduler.advance(sched)  # each request's own token; the accepted drafts follow
            for req, tokens, logprobs in zip(reqs, result.token_ids, result.logprobs, strict=True):
                out = self._accept(sched, req, tokens, logprobs)
                if out is not None:
                    outputs.append(out)
        except Exception as exc:
            log.exception("engine step failed")
            outputs.extend(self._fail_step(sched, exc))
            return False
        return True

    def _accept(
        self, sched: SchedulerOutput, req: Request, tokens: list[int], logprobs: list
    ) -> RequestOutput | None:
        """Appends a verified run (accepted drafts, then one more token) token by token under the stop
        rules, counts the speculation figures and the gate, and settles the request's counters."""
        if req.finished:
            return None
        drafts = len(req.spec_ids)
        accepted = len(tokens) - 1
        assert 0 <= accepted <= drafts, "verify returns the accepted drafts and one token"
        if drafts:
            self._spec_proposed += drafts
            self._spec_accepted += accepted
            self._spec_verified += 1
            req.spec_proposed += drafts
            req.spec_accepted += accepted
            sched.spec_accepted_lengths.append(accepted + 1)
        emitted: list[int] = []
        for tok in tokens:
            req.token_ids.append(tok)
            emitted.append(tok)
            self._generated += 1
            reason = self._stop_reason(req, tok)
            if reason is not None:
                self.scheduler.finish(req, reason)
                self.requests.pop(req.request_id, None)
                break
        if not req.finished:
            if drafts:
                self._gate(req, drafts, accepted)
            self.scheduler.accept_drafts(req, accepted)
        lps = logprobs[: len(emitted)] if logprobs and logprobs[0] is not None else None
        return self._output(req, emitted, lps)

    def _gate(self, req: Request, drafts: int, accepted: int) -> None:
        """The acceptance gate: over tumbling windows of at least SPEC_GATE_WINDOW verified drafts, a
        request accepting less than `speculative_min_acceptance` of them stops proposing for a cool-down
        of output tokens (SPEC_COOLDOWN, doubled after each failed window in a row up to
        SPEC_MAX_COOLDOWN), then tries again; a window that passes resets the cool-down."""
        req.spec_window_proposed += drafts
        req.spec_window_accepted += accepted
        if req.spec_window_proposed < SPEC_GATE_WINDOW:
            return
        rate = req.spec_window_accepted / req.spec_window_proposed
        req.spec_window_proposed = req.spec_window_accepted = 0
        if rate >= self.settings.speculative_min_acceptance:
            req.spec_cooldown = 0
            return
        cooldown = 2 * req.spec_cooldown if req.spec_cooldown else SPEC_COOLDOWN
        req.spec_cooldown = min(cooldown, SPEC_MAX_COOLDOWN)
        req.spec_resume_at = req.num_output_tokens + req.spec_cooldown

    def _fail_step(self, sched: SchedulerOutput, exc: Exception) -> list[RequestOutput]:
        detail = f"internal error in engine step: {exc}"
        return [self._fail(req, INTERNAL, detail) for req, _ in sched.scheduled if not req.finished]

    def _drain(self) -> list[RequestOutput]:
        """Reads the launched step (async): afterwards every request holds its tokens on the host."""
        launched, self._in_flight = self._in_flight, None
        outputs: list[RequestOutput] = []
        if launched is not None:
            self._read(launched, outputs)
        return outputs

    def _needs_host_tokens(self) -> bool:
        """Whether the next step needs the host's values of pending tokens: penalties over the output."""
        return any(r.prev_row >= 0 and r.sampling.has_penalties for r in self.scheduler.running)

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

    def _postprocess(self, reqs: list[Request], tokens: list[int], logprobs: list) -> list[RequestOutput]:
        """Writes each sampled token over its request's placeholder and applies the stop rules; a request
        that ended since the step was launched (stopped, aborted, failed, expired) is skipped."""
        outputs: list[RequestOutput] = []
        for req, tok, lp in zip(reqs, tokens, logprobs, strict=True):
            if req.finished:
                continue
            assert req.prev_row >= 0 and req.token_ids[-1] == PLACEHOLDER, "no placeholder to fill"
            req.token_ids[-1] = tok
            req.prev_row = -1
            self._generated += 1
            reason = self._stop_reason(req, tok)
            if reason is not None:
                self.scheduler.finish(req, reason)
                self.requests.pop(req.request_id, None)
            outputs.append(self._output(req, [tok], [lp] if lp is not None else None))
        return outputs

    def _stop_reason(self, req: Request, tok: int) -> str | None:
        st = req.stopping
        # The sampler keeps stop tokens out until min_new_tokens tokens came before this one.
        if req.num_output_tokens > st.min_new_tokens and (
            tok in st.stop_token_ids or (not st.ignore_eos and tok in req.eos_ids)
        ):
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
        self.scheduler.finish(req, "error", error_message(error_class, detail))
        self.requests.pop(req.request_id, None)
        return self._output(req, [])

    @staticmethod
    def _output(req: Request, tokens: list[int], logprobs: list | None = None) -> RequestOutput:
        return RequestOutput(
            request_id=req.request_id,
            new_token_ids=tokens,
            logprobs=logprobs,
            finished=req.finished,
            finish_reason=req.finish_reason,
            prompt_tokens=req.num_prompt_tokens,
            completion_tokens=req.num_output_tokens,
            error=req.error,
        )

    # ---- figures -------------------------------------------------------------------------------

    def _account(self, sched: SchedulerOutput, step_s: float) -> None:
        self._steps += 1
        fwd = self.runner.last_forward_s
        self._forward_s += fwd
        self._step_s += step_s
        batch = len(sched.scheduled)
        if batch > self._max_batch:
            self._max_batch, self._max_batch_forward_s, self._max_batch_step_s = batch, 0.0, 0.0
        if batch == self._max_batch:
            self._max_batch_forward_s += fwd
            self._max_batch_step_s += step_s
        used = self.block_manager.num_blocks - self.block_manager.num_free_blocks
        if used > self._peak_blocks:
            running = self.scheduler.running
            stored = sum(r.num_computed_tokens for r in running)
            allocated = sum(len(r.block_ids) for r in running) * self.block_manager.block_size
            self._peak_blocks = used
            self._peak_efficiency = stored / allocated if allocated else 0.0

    def _account_drain(self, step_s: float) -> None:
        """A step that only read the launched step: its time counts in the totals (no step, no batch), and
        so do the forwards the runner saw finish meanwhile (it reports each once)."""
        self._forward_s += self.runner.last_forward_s
        self._step_s += step_s

    def stats(self) -> EngineStats:
        bm = self.block_manager
        return EngineStats(
            running=len(self.scheduler.running),
            waiting=len(self.scheduler.waiting),
            num_blocks=bm.num_blocks,
            free_blocks=bm.num_free_blocks,
            block_size=bm.block_size,
            steps=self._steps,
            max_model_len=self.max_model_len,
            model=self.model_name,
            forward_time_s=self._forward_s,
            step_time_s=self._step_s,
            forward_share=self._forward_s / self._step_s if self._step_s else 0.0,
            max_batch=self._max_batch,
            forward_share_at_max_batch=(
                self._max_batch_forward_s / self._max_batch_step_s if self._max_batch_step_s else 0.0
            ),
            peak_kv_efficiency=self._peak_efficiency,
            peak_blocks_used=self._peak_blocks,
            num_preemptions=self.scheduler.num_preemptions,
            prefix_hit_rate=bm.prefix_hit_blocks / bm.prefix_query_blocks if bm.prefix_query_blocks else 0.0,
            generated_tokens=self._generated,
            spec_proposed_tokens=self._spec_proposed,
            spec_accepted_tokens=self._spec_accepted,
            spec_acceptance_rate=self._spec_accepted / self._spec_proposed if self._spec_proposed else 0.0,
            spec_mean_accepted_length=(
                1.0 + self._spec_accepted / self._spec_verified if self._spec_verified else 0.0
            ),
        )

    def reset_stats(self) -> None:
        """Zeroes the timing and peak figures (e.g. after a warm-up run)."""
        self._steps = 0
        self._forward_s = self._step_s = 0.0
        self._max_batch = 0
        self._max_batch_forward_s = self._max_batch_step_s = 0.0
        self._peak_blocks = 0
        self._peak_efficiency = 0.0
        self._generated = 0
        self._spec_proposed = self._spec_accepted = self._spec_verified = 0


def _row_owners(rows: Sequence[Request]) -> list[Request]:
    """The requests of a step's logits rows, each once: a request with drafts owns 1 + len(spec_ids)
    consecutive rows (see `Runner.execute`)."""
    owners: list[Request] = []
    i = 0
    while i < len(rows):
        req = rows[i]
        span = 1 + len(req.spec_ids)
        if i + span > len(rows) or any(r is not req for r in rows[i : i + span]):
            raise RuntimeError(f"request {req.request_id}: its {span} rows are not together in the step")
        owners.append(req)
        i += span
    return owners
