"""The scheduler: which requests run in the next step, and how many tokens each gets.

Each step gets a token budget (`max_num_batched_tokens`) and a cap on running requests
(`max_num_seqs`). Running requests are served first, oldest first; a request that needs a block when
none is free preempts the most recently admitted running request (its blocks are freed, its counters
reset, and it is recomputed later from its prompt plus the tokens it already generated). Waiting requests
are admitted in arrival order only in a step without preemption, and only when their blocks fit: the pool
never overflows. A prefill longer than the remaining budget is chunked across steps.

Continuous batching with prefix caching defers a waiting request whose next uncached block is one that a
running request is computing right now (a shared prompt prefix arriving in a burst): admitted at once,
both would compute that prefix; a step or so later the second finds it cached and computes only the
rest. Later waiting requests are admitted past a deferred one.

Batching policies share this code and differ only in admission:
- continuous: a waiting request joins at the next step;
- dynamic: when the previous batch has finished, a batch of up to `max_num_seqs` forms from the queue
  once it is full or its oldest request has waited `batch_wait_ms`; it runs to completion;
- static: the same with a fixed batch size `static_batch_size`.

KV groups: the layers of a model form groups that attend alike (block_manager.KVGroupSpec), each with
its block manager and a block table per request: one group for most models, a full-attention and a
sliding group for a hybrid one. Every group's table has an entry per logical block, so a step needs the
same number of new blocks in each group: a request is scheduled (or admitted) only when every group has
them, and one that lacks them in any group preempts as above.

Sliding windows: in a group whose layers attend within a window of `window` positions, a query at
position p never reads keys before p - window + 1, and later queries read later ones: after each step the
blocks wholly before the next position's window are freed (their table entries become the group's
`hole`), so a long request holds at most ceil((window - 1) / block_size) + 1 blocks of the group between
steps. A freed block keeps its prefix-cache content like any free block, until it is allocated again. A
prefix hit takes the longest prefix every group can serve (BlockManager.longest_hit): a sliding group
needs only the blocks the first computed position's window reads.

Speculative decoding: after `schedule`, the engine's `Speculator` may give drafts (`Request.draft_ids`)
to decoding requests of the step (one token left to compute); `schedule_drafts` then fits them after
every real token of the step, running and waiting, in the budget that is left: such a request computes
1 + len(draft_ids) tokens, its drafts trimmed to the budget and to the blocks free (drafts never preempt
anyone). Which requests may propose at all (batch size, preemption, acceptance) is the Speculator's gate,
not the scheduler's. After the step, `advance` counts the request's own token only; `accept_drafts`
counts the accepted ones once the engine has appended them, and frees the blocks that held only rejected
drafts. Block hashes come from `token_ids`, never from drafts.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from services.common.block_keys import BlockHash, chain_hashes, max_hit_blocks
from services.engine.core.block_manager import BlockManager, first_seen_block
from services.engine.core.request import Request, Status


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

    # ---- requests in and out -------------------------------------------------------------------

    def add(self, request: Request) -> None:
        request.status = Status.WAITING
        self.waiting.append(request)

    def finish(self, request: Request, reason: str, error: str | None = None) -> None:
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
