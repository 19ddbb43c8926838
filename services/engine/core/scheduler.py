"""The scheduler: which requests run in the next step and how many tokens each gets, and, after the step,
which tokens each keeps (`update_from_output`, `update_from_verified`; rules: core/stopping.py).

Invariants: a step's tokens fit `max_num_batched_tokens` and its requests `max_num_seqs`; the pool never
overflows (check, then act: `can_allocate` before `allocate`). Running requests go first, oldest first; a
request short of a block preempts the most recently admitted one (freed, recomputed later from its kept
tokens). Waiting requests are admitted in arrival order, only in a step without preemption; a long
prefill is chunked; under continuous batching with prefix caching, a request whose next uncached block a
running request computes waits a step. dynamic/static differ only in admission. A request runs only when
every KV group has its new blocks; a prefix hit is the longest every group serves. Speculative drafts fit
after every real token, in the budget and blocks left, never preempting; hashes come from kept tokens.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from services.common.block_keys import BlockHash, chain_hashes, max_hit_blocks
from services.common.errors import INTERNAL
from services.engine.core.block_manager import BlockManager, first_seen_block
from services.engine.core.params import RequestOutput, TokenLogprob
from services.engine.core.request import PLACEHOLDER, Request, Status
from services.engine.core.stopping import drop_placeholder, keep, request_output

if TYPE_CHECKING:
    from services.engine.core.speculative import Speculator
    from services.engine.settings import EngineSettings

log = logging.getLogger(__name__)


@dataclass
class SchedulerOutput:
    """One step's work: `scheduled[i] = (request, num_new_tokens)`; a request samples a token when this
    step brings `num_computed_tokens` level with `num_tokens`."""

    scheduled: list[tuple[Request, int]] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    wait_s: float = 0.0  # batch forming: how long until the next batch may start
    num_running: int = 0  # scheduled[:num_running] were running before the step; the rest were admitted
    num_draft_tokens: int = 0  # speculative drafts scheduled (counted in num_tokens)
    # Filled by the engine once the drafts are verified: per request that had drafts, the tokens its
    # verification emitted (accepted drafts + 1).
    spec_accepted_lengths: list[int] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.scheduled)

    @property
    def empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    def __init__(
        self,
        block_manager: BlockManager,
        *,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        policy: str = "continuous",
        batch_size: int = 0,
        batch_wait_s: float = 0.0,
        sliding_window: int = 0,
        extra_groups: Sequence[tuple[BlockManager, int]] = (),
    ) -> None:
        """`block_manager` and `sliding_window` (0: none) are the first KV group's; `extra_groups` the
        (block manager, window) of a hybrid model's other groups, of the same block size."""
        assert policy in ("continuous", "dynamic", "static")
        self.bm = block_manager
        self.block_size = block_manager.block_size
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.policy = policy
        self.batch_size = min(batch_size or max_num_seqs, max_num_seqs)
        self.batch_wait_s = batch_wait_s
        # (block manager, window) per KV group, the first one's first
        self.groups: list[tuple[BlockManager, int]] = [(block_manager, sliding_window), *extra_groups]
        assert all(bm.block_size == self.block_size for bm, _ in self.groups)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # admission order: the last one is preempted first
        self.batch: set[Request] = set()  # dynamic/static: members of the batch in progress
        self.num_preemptions = 0

    @classmethod
    def from_settings(
        cls, settings: EngineSettings, max_model_len: int, groups: Sequence[tuple[BlockManager, int]]
    ) -> Scheduler:
        """The engine's scheduler: its limits and batching policy from `settings`, over `groups`
        ((block manager, window) per KV group, the full-attention or only group first)."""
        (first, window), *extra = groups
        static = settings.batching == "static"
        return cls(
            first,
            max_num_seqs=settings.max_num_seqs,
            max_num_batched_tokens=settings.max_num_batched_tokens,
            max_model_len=max_model_len,
            policy=settings.batching,
            batch_size=settings.static_batch_size if static else settings.max_num_seqs,
            batch_wait_s=settings.batch_wait_ms / 1000.0,
            sliding_window=window,
            extra_groups=extra,
        )

    # ---- requests in and out -------------------------------------------------------------------

    def add(self, request: Request) -> None:
        request.status = Status.WAITING
        self.waiting.append(request)

    def finish(
        self, request: Request, reason: str, error: str | None = None, error_code: str | None = None
    ) -> None:
        """Ends a request wherever it is and frees its blocks. Idempotent."""
        if request.finished:
            return
        if request.status is Status.RUNNING:
            self.running.remove(request)
        elif request in self.waiting:  # else never handed here (the engine held it back for its grammar)
            self.waiting.remove(request)
        self._release(request)
        request.status = Status.FINISHED
        request.finish_reason = reason
        request.error = error
        request.error_code = error_code
        self.batch.discard(request)

    # ---- one step ------------------------------------------------------------------------------

    def schedule(self, now: float | None = None) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        budget = self._schedule_running(out, budget)
        out.num_running = len(out.scheduled)
        if not out.preempted:
            self._schedule_waiting(out, budget, time.monotonic() if now is None else now)
        return out

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            if self._pending_token_is_last(req):
                i += 1
                continue
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            assert n > 0, "a running request always has a token to compute"
            need = self._blocks_needed(req, n)
            if need > 0:
                while not self._can_allocate(need):
                    victim = self.running.pop()
                    self._preempt(victim)
                    out.preempted.append(victim)
                    if victim is req:
                        return budget
                self._allocate(req, need)
            out.scheduled.append((req, n))
            budget -= n
            i += 1
        return budget

    def _schedule_waiting(self, out: SchedulerOutput, budget: int, now: float) -> None:
        """Admits waiting requests within `budget` tokens."""
        if self.policy != "continuous" and not self._batch_open(out, now):
            return
        pending = self._pending_hashes() if self.waiting else None  # nothing to defer: skip the scan
        i = 0
        while i < len(self.waiting) and budget > 0 and len(self.running) < self.max_num_seqs:
            req = self.waiting[i]
            if self.policy != "continuous" and req not in self.batch:
                return
            hits = self._prefix_hit(req)  # per group, of one length
            hit = hits[0]
            if pending and self._computed_elsewhere(req, len(hit), pending):
                i += 1
                continue
            computed = len(hit) * self.block_size
            n = min(req.num_tokens - computed, budget)
            need = -(-(computed + n) // self.block_size) - len(hit)
            if not self._can_allocate(need, hits):
                return
            tables = []
            for (bm, _), group_hit in zip(self.groups, hits, strict=True):
                bm.acquire(group_hit)
                tables.append([*group_hit, *bm.allocate(need)])
            req.block_ids, *req.group_block_ids = tables
            req.slid_blocks = [0] * len(self.groups)
            req.num_computed_tokens = computed
            # A prompt counts once, at its first admission: a recompute finding its own blocks is no hit
            # (nor in the prefix-cache statistics).
            if not req.num_preemptions:
                req.num_cached_tokens = computed
                if self.bm.enable_prefix_caching:
                    self.bm.record_query(self._max_hit_blocks(req), len(hit))
            del self.waiting[i]
            req.status = Status.RUNNING
            self.running.append(req)
            out.scheduled.append((req, n))
            budget -= n
            if pending is not None:
                pending.update(req.block_hashes[len(hit) : self._max_hit_blocks(req)])

    def schedule_drafts(self, out: SchedulerOutput) -> None:
        """After `schedule` and the Speculator's proposals: extends each request of `out` that holds drafts
        by as many of them as the budget left and the free blocks allow (its drafts trimmed to those, all
        dropped when none fit: drafts never preempt, and real tokens had the budget first)."""
        budget = self.max_num_batched_tokens - out.num_tokens
        for i, (req, n) in enumerate(out.scheduled):
            if req.spec is None or not req.spec.drafts:
                continue
            assert n == 1 and req.num_tokens - req.num_computed_tokens == 1, "drafts follow a decode's token"
            d = max(0, min(len(req.spec.drafts), budget, self._draft_room(req)))
            del req.spec.drafts[d:]
            if d == 0:
                continue
            need = self._blocks_needed(req, 1 + d)
            if need > 0:
                self._allocate(req, need)
            out.scheduled[i] = (req, 1 + d)
            out.num_draft_tokens += d
            budget -= d

    def _draft_room(self, req: Request) -> int:
        """How many drafts after its own token `req` can hold in its blocks and the free ones (of the
        group with the fewest)."""
        free = min(bm.num_free_blocks for bm, _ in self.groups)
        slots = (len(req.block_ids) + free) * self.block_size
        return slots - req.num_computed_tokens - 1

    def _pending_hashes(self) -> set[BlockHash] | None:
        """Keys of the prompt blocks that running requests are still computing (None when nothing is
        deferred: prefix caching off, or a batching policy whose batches are fixed)."""
        if self.policy != "continuous" or not self.bm.enable_prefix_caching:
            return None
        pending: set[BlockHash] = set()
        for req in self.running:
            if req.num_computed_tokens < req.num_prompt_tokens:
                pending.update(req.block_hashes[req.num_registered_blocks : self._max_hit_blocks(req)])
        return pending

    def _computed_elsewhere(self, req: Request, num_hit: int, pending: set[BlockHash]) -> bool:
        """Whether the first block `req` would compute is being computed by a running request (never for a
        request that takes no hit)."""
        return (
            req.sampling.prompt_logprobs is None
            and num_hit < self._max_hit_blocks(req)
            and req.block_hashes[num_hit] in pending
        )

    def _batch_open(self, out: SchedulerOutput, now: float) -> bool:
        """dynamic/static: True while a batch is in progress or a new one may start now."""
        if self.batch:
            return True
        if not self.waiting:
            return False
        full = len(self.waiting) >= self.batch_size
        waited = now - self.waiting[0].arrival_time
        if not full and waited < self.batch_wait_s:
            out.wait_s = self.batch_wait_s - waited
            return False
        self.batch = {self.waiting[i] for i in range(min(self.batch_size, len(self.waiting)))}
        return True

    # ---- after the model ran -------------------------------------------------------------------

    def advance(self, out: SchedulerOutput) -> None:
        """Counts the computed tokens of a step and registers blocks that became full. A request's drafts
        are not counted here (see `accept_drafts`)."""
        for req, n in out.scheduled:
            req.num_computed_tokens += n - len(req.draft_ids)
            self._register_full_blocks(req)
            self._free_slid_out(req)

    def accept_drafts(self, req: Request, num_accepted: int) -> None:
        """After the engine appended `req`'s accepted drafts and its new token to `token_ids`: counts the
        accepted drafts as computed (their KV was written in the step), registers blocks that became full
        of verified tokens, drops the drafts and frees the blocks past those the next step needs (they
        held only rejected drafts, whose stale KV is never read: a later step overwrites those slots)."""
        assert req.num_computed_tokens + num_accepted == req.num_tokens - 1, "accepted run out of step"
        if req.spec is not None:
            req.spec.drafts = []
        req.num_computed_tokens += num_accepted
        self._register_full_blocks(req)
        self._free_slid_out(req)
        keep = -(-req.num_tokens // self.block_size)
        for (bm, _), table in zip(self.groups, req.tables, strict=True):
            if len(table) > keep:
                bm.free_blocks(table[keep:])
                del table[keep:]

    def update_from_output(
        self, reqs: Sequence[Request], tokens: Sequence[int], logprobs: Sequence[TokenLogprob | None]
    ) -> list[RequestOutput]:
        """After a step (plain or async) was read: writes each sampled token over its request's
        placeholder, keeps it under the stop rules (services/engine/core/stopping.py) and returns the
        outputs. A request that ended since the step was launched is skipped; one whose acceptance raises
        ends alone (`internal`)."""
        if not len(reqs) == len(tokens) == len(logprobs):
            raise RuntimeError(f"{len(reqs)} sampling requests but {len(tokens)} tokens read")
        outputs: list[RequestOutput] = []
        for req, tok, lp in zip(reqs, tokens, logprobs, strict=True):
            if not req.finished:
                self._own_failure(req, outputs, lambda r=req, t=tok, p=lp: self._fill(r, t, p))
        return outputs

    def update_from_verified(
        self,
        sched: SchedulerOutput,
        reqs: Sequence[Request],
        runs: Sequence[list[int]],
        logprobs: Sequence[list],
        speculator: Speculator | None,
    ) -> list[RequestOutput]:
        """After a speculative step was verified: each request keeps its run (accepted drafts, then one
        more token) token by token under the stop rules, the Speculator hears of it, and the accepted drafts
        count as computed (`accept_drafts`). Failures as in `update_from_output`."""
        outputs: list[RequestOutput] = []
        for req, run, lps in zip(reqs, runs, logprobs, strict=True):
            self._own_failure(
                req, outputs, lambda r=req, t=run, p=lps: self._accept_run(sched, r, t, p, speculator)
            )
        return outputs

    def fail(self, req: Request, error_code: str, detail: str) -> RequestOutput:
        """Ends `req` with finish_reason "error" (its state untouched when it already ended)."""
        if not req.finished:
            drop_placeholder(req)
        self.finish(req, "error", detail, error_code)
        return request_output(req, [])

    def _fill(self, req: Request, tok: int, lp: TokenLogprob | None) -> RequestOutput:
        assert req.prev_row >= 0 and req.token_ids[-1] == PLACEHOLDER, "no placeholder to fill"
        req.token_ids[-1] = tok
        req.prev_row = -1
        self._keep(req, tok)
        return request_output(req, [tok], [lp] if lp is not None else None)

    def _accept_run(
        self,
        sched: SchedulerOutput,
        req: Request,
        run: list[int],
        logprobs: list,
        speculator: Speculator | None,
    ) -> RequestOutput | None:
        if req.finished:
            return None
        drafts = len(req.draft_ids)
        accepted = len(run) - 1
        assert 0 <= accepted <= drafts, "verify returns the accepted drafts and one token"
        emitted: list[int] = []
        for tok in run:
            req.token_ids.append(tok)
            emitted.append(tok)
            if self._keep(req, tok):
                break
        if drafts:
            assert speculator is not None, "drafts come from the speculator"
            speculator.verified(sched, req, drafts, accepted)
        if not req.finished:
            self.accept_drafts(req, accepted)
        lps = logprobs[: len(emitted)] if logprobs and logprobs[0] is not None else None
        return request_output(req, emitted, lps)

    def _keep(self, req: Request, tok: int) -> bool:
        """Keeps `tok` (already in `token_ids`) under the stop rules; whether it ended `req`."""
        stop = keep(req, tok, self.max_model_len)
        if stop is not None:
            self.finish(req, stop.reason, stop.detail, stop.error_code)
        return stop is not None

    def _own_failure(
        self, req: Request, outputs: list[RequestOutput], produce: Callable[[], RequestOutput | None]
    ) -> None:
        """Appends `produce()`, one request's output of a step; an exception there is that request's
        failure, never the step's: it ends the request (`internal`) and the step's other outputs stand."""
        try:
            out = produce()
        except Exception as exc:
            log.exception("request %s failed in postprocessing", req.request_id)
            out = self.fail(req, INTERNAL, f"internal error in the request's postprocessing: {exc}")
        if out is not None:
            outputs.append(out)

    def needs_host_tokens(self) -> bool:
        """Async scheduling: whether the next step needs the host's values of pending tokens (penalties
        over the output, or a grammar to advance before its next mask): the engine reads step N first."""
        return any(
            r.prev_row >= 0 and (r.sampling.has_penalties or r.grammar is not None) for r in self.running
        )

    # ---- helpers -------------------------------------------------------------------------------

    def _pending_token_is_last(self, req: Request) -> bool:
        """Async scheduling: the token the device is sampling for `req` (not read yet) is its last by
        count (max_new_tokens or the context length), so the request ends when it is read."""
        return req.prev_row >= 0 and (
            req.num_output_tokens >= req.stopping.max_new_tokens or req.num_tokens >= self.max_model_len
        )

    def _blocks_needed(self, req: Request, n: int) -> int:
        """New blocks `req` needs in each group to compute `n` more tokens."""
        return -(-(req.num_computed_tokens + n) // self.block_size) - len(req.block_ids)

    def _can_allocate(self, need: int, hits: Sequence[Sequence[int]] | None = None) -> bool:
        """Whether every group can allocate `need` fresh blocks (after acquiring its prefix hit)."""
        if hits is None:
            return all(bm.can_allocate(need) for bm, _ in self.groups)
        return all(bm.can_allocate(need, hit) for (bm, _), hit in zip(self.groups, hits, strict=True))

    def _allocate(self, req: Request, need: int) -> None:
        """Extends every group's table of `req` by `need` fresh blocks (`_can_allocate` said so)."""
        for (bm, _), table in zip(self.groups, req.tables, strict=True):
            table.extend(bm.allocate(need))

    def _max_hit_blocks(self, req: Request) -> int:
        return max_hit_blocks(req.num_tokens, self.block_size)

    def _prefix_hit(self, req: Request) -> list[list[int]]:
        """Per group, the table of cached blocks `req` would start from, all of one length: the longest
        every group can serve (a look-up only: a waiting request is looked up at every step until it is
        admitted). None for a request that asks for prompt logprobs: its whole prompt is computed, as
        they come from the prompt's rows."""
        if not self.bm.enable_prefix_caching or req.sampling.prompt_logprobs is not None:
            return [[] for _ in self.groups]
        max_blocks = self._max_hit_blocks(req)
        self._hash_blocks(req, max_blocks)
        hashes = req.block_hashes[:max_blocks]
        j, settled = max_blocks, False
        while not settled:  # each group's longest hit up to j, until all agree (j only shrinks)
            settled = True
            for bm, window in self.groups:
                k = bm.longest_hit(hashes, window, j)
                settled &= k == j
                j = k
        return [bm.hit_table(hashes[:j], window) for bm, window in self.groups]

    def _hash_blocks(self, req: Request, n: int) -> None:
        """Extends `req.block_hashes` to its first `n` blocks."""
        if len(req.block_hashes) < n:
            parent = req.block_hashes[-1] if req.block_hashes else None
            tokens = req.token_ids[: n * self.block_size]
            req.block_hashes.extend(chain_hashes(tokens, self.block_size, len(req.block_hashes), parent))

    def _register_full_blocks(self, req: Request) -> None:
        if not self.bm.enable_prefix_caching:
            return
        full = req.num_computed_tokens // self.block_size
        if full <= req.num_registered_blocks:
            return
        self._hash_blocks(req, full)
        for (bm, _), table in zip(self.groups, req.tables, strict=True):
            for i in range(req.num_registered_blocks, full):
                if table[i] != bm.hole:
                    bm.register(table[i], req.block_hashes[i])
        req.num_registered_blocks = full

    def _free_slid_out(self, req: Request) -> None:
        """Frees, in every sliding group, the blocks of `req` that lie wholly before the window of its
        next position (every later query sees even later keys), after they were registered in the prefix
        cache."""
        for g, ((bm, window), table) in enumerate(zip(self.groups, req.tables, strict=True)):
            if not window:
                continue
            slid = min(first_seen_block(req.num_computed_tokens, window, self.block_size), len(table))
            done = req.slid_blocks[g]
            if slid <= done:
                continue
            bm.free_blocks(table[done:slid])
            table[done:slid] = [bm.hole] * (slid - done)
            req.slid_blocks[g] = slid

    def _preempt(self, req: Request) -> None:
        self._release(req)
        req.status = Status.WAITING
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    def _release(self, req: Request) -> None:
        for (bm, _), table in zip(self.groups, req.tables, strict=True):
            bm.free_blocks(table)
        req.block_ids = []
        req.group_block_ids = []
        if req.spec is not None:
            req.spec.drafts = []
        req.num_computed_tokens = 0
        req.num_registered_blocks = 0
        req.slid_blocks = []
