"""Prompt lookup: proposing a request's next tokens from its own earlier tokens (n-gram speculation).

A proposal is the tokens that followed the latest earlier occurrence of the request's last n tokens
(prompt + output); the engine runs them as extra positions of the request's chunk and `Sampler.verify`
keeps the longest prefix the model agrees with plus one token of its own, so the output is the model's
alone. The engine holds one `Speculator` unless `EngineSettings.speculative` is "off": `propose` gives
drafts to the requests that pass the gate (`_gate`: batch size, per-request acceptance; the one place)
before `Scheduler.schedule_drafts` fits them, and `verified` moves the acceptance window. Per-request
state: one `SpecState` at `Request.spec`. Host-side only: no torch here. Why no draft model, and what a
search costs: docs/architecture.md ("Fewer forwards per token").
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import numpy as np

if TYPE_CHECKING:
    from services.engine.core.request import Request
    from services.engine.core.scheduler import SchedulerOutput
    from services.engine.settings import EngineSettings

log = logging.getLogger(__name__)

# The acceptance rule of the gate: a request's acceptance is judged over windows of this many verified
# drafts; one below `speculative_min_acceptance` pauses its proposals for SPEC_COOLDOWN output tokens,
# twice as long after each failed window in a row, up to SPEC_MAX_COOLDOWN.
SPEC_GATE_WINDOW = 8
SPEC_COOLDOWN = 16
SPEC_MAX_COOLDOWN = 256


class TokenMirror:
    """A request's token ids as an int64 numpy array, brought up to date incrementally.

    Contract: between two `update` calls for the same request its token list only grows, except that
    the last entry the previous call saw may have changed (a placeholder replaced by its value). For
    anything else (a list that shrank or was edited further back) use a new mirror."""

    def __init__(self) -> None:
        self._buf = np.empty(0, dtype=np.int64)
        self._n = 0

    def update(self, token_ids: Sequence[int]) -> np.ndarray:
        """The whole of `token_ids` as an array (a view valid until the next call); copies only the
        entries not seen before, and the last one seen."""
        n = len(token_ids)
        if n > len(self._buf):
            grown = np.empty(max(n, 2 * len(self._buf), 64), dtype=np.int64)
            grown[: self._n] = self._buf[: self._n]
            self._buf = grown
        start = max(0, min(self._n, n) - 1)
        if n > start:
            self._buf[start:n] = token_ids[start:n]
        self._n = n
        return self._buf[:n]


class NgramProposer:
    """Prompt-lookup proposals (see the module docstring). Stateless: one instance serves every request;
    per-request state, if wanted, is a `TokenMirror` the caller keeps and passes in."""

    def __init__(self, num_tokens: int, ngram_min: int, ngram_max: int) -> None:
        if num_tokens < 1 or ngram_min < 1 or ngram_max < ngram_min:
            raise ValueError(
                f"need num_tokens >= 1 and 1 <= ngram_min <= ngram_max, got {num_tokens}, "
                f"{ngram_min}, {ngram_max}"
            )
        self.num_tokens = num_tokens
        self.ngram_min = ngram_min
        self.ngram_max = ngram_max

    def propose(
        self, token_ids: Sequence[int], max_tokens: int, mirror: TokenMirror | None = None
    ) -> list[int]:
        """Up to min(num_tokens, max_tokens) tokens: for n from ngram_max down to ngram_min, find the
        latest earlier occurrence of the last n tokens of `token_ids` (prompt + output) and return the
        tokens that followed it; [] when no n-gram matches (or max_tokens <= 0).

        "Earlier" means the occurrence ends before the last token (the suffix never matches itself; it
        may overlap the occurrence). When the tokens that followed run into the end of `token_ids`, the
        proposal continues the same way, with the period of the repetition (after "a b a b" the 2-gram
        "a b" matched two tokens back proposes "a b a b ..."), up to the same limit.

        `mirror`: the request's `TokenMirror`, to avoid converting the whole list on every call."""
        k = min(self.num_tokens, max_tokens)
        n_tokens = len(token_ids)
        if k <= 0 or n_tokens <= self.ngram_min:
            return []
        if mirror is not None:
            arr = mirror.update(token_ids)
        else:
            arr = np.fromiter(token_ids, dtype=np.int64, count=n_tokens)
        end = self._latest_match_end(arr)
        if end < 0:
            return []
        return _continuation(arr, end, k)

    def _latest_match_end(self, arr: np.ndarray) -> int:
        """The end index of the latest earlier occurrence of the longest matching suffix n-gram
        (ngram_min <= n <= ngram_max), or -1."""
        last = len(arr) - 1
        ends = np.flatnonzero(arr[:last] == arr[last])  # every earlier end of a matching 1-gram
        matched, length = ends, 1
        for n in range(2, min(self.ngram_max, last) + 1):
            # The occurrences of the n-gram are those of the (n-1)-gram preceded by the right token.
            ends = ends[ends >= n - 1]
            ends = ends[arr[ends - (n - 1)] == arr[last - (n - 1)]]
            if not len(ends):
                break
            matched, length = ends, n
        if length < self.ngram_min or not len(matched):
            return -1
        return int(matched[-1])


def _continuation(arr: np.ndarray, end: int, k: int) -> list[int]:
    """k tokens after index `end`, continuing periodically past the end of `arr` (period len(arr)-1-end,
    the distance between the occurrence and the suffix it matched)."""
    out = arr[end + 1 : end + 1 + k].tolist()
    period = len(arr) - 1 - end
    while len(out) < k:
        out.append(out[len(out) - period])
    return out


class Proposer(Protocol):
    """Speculative drafts for a request (`NgramProposer`, or a test's)."""

    def propose(
        self, token_ids: Sequence[int], max_tokens: int, mirror: TokenMirror | None = None
    ) -> list[int]:
        """Up to `max_tokens` tokens likely to follow `token_ids` (prompt + output); [] for none. `mirror`:
        the request's own copy of its tokens as an array, kept up to date across calls."""
        ...


@dataclass(eq=False)
class SpecState:
    """One request's speculation, made when it first may propose. `drafts`: those scheduled for the next
    step (set by `Speculator.propose`, trimmed by the scheduler, empty outside a step that verifies them).
    `mirror`: its tokens as an array for the proposer (token_ids only grows while speculating: async
    scheduling is off). The acceptance window: drafts verified and accepted in the current window, the
    output length before which the request does not propose, and the length of its next cool-down."""

    drafts: list[int] = field(default_factory=list)
    mirror: TokenMirror = field(default_factory=TokenMirror)
    window_proposed: int = 0
    window_accepted: int = 0
    resume_at: int = 0
    cooldown: int = 0


class Speculator:
    """Speculative decoding's host side: which requests propose in a step, their drafts, and what the
    verification tells the acceptance rule. Owns no blocks: the scheduler fits the drafts into the step
    and frees what rejected drafts held (`Scheduler.schedule_drafts`, `Scheduler.accept_drafts`)."""

    def __init__(self, proposer: Proposer, settings: EngineSettings, max_model_len: int) -> None:
        self.proposer = proposer
        self.num_tokens = settings.num_speculative_tokens
        self.disable_batch_size = settings.speculative_disable_batch_size
        self.min_acceptance = settings.speculative_min_acceptance
        self.max_model_len = max_model_len

    @classmethod
    def create(cls, settings: EngineSettings, max_model_len: int) -> Speculator | None:
        """The engine's speculator: None when `settings.speculative` is "off"."""
        if settings.speculative == "off":
            return None
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
        proposer = NgramProposer(settings.num_speculative_tokens, settings.ngram_min, settings.ngram_max)
        return cls(proposer, settings, max_model_len)

    def propose(self, sched: SchedulerOutput, num_running: int) -> bool:
        """Drafts for each request of `sched` that passes the gate, never more than could be emitted before
        max_new_tokens or the context length (a step emits at most drafts + 1 tokens). True when any
        request got drafts: the scheduler then fits them into the step."""
        drafted = False
        for req in self._gate(sched, num_running):
            room = min(
                self.num_tokens,
                req.stopping.max_new_tokens - req.num_output_tokens - 1,
                self.max_model_len - req.num_tokens - 1,
            )
            if room <= 0:
                continue
            if req.spec is None:
                req.spec = SpecState()
            req.spec.drafts = list(self.proposer.propose(req.token_ids, room, req.spec.mirror))[:room]
            drafted = drafted or bool(req.spec.drafts)
        return drafted

    def _gate(self, sched: SchedulerOutput, num_running: int) -> list[Request]:
        """The gate, whole: the requests of `sched` that may propose. None in a step that preempts (blocks
        are short: those freed go back to the preempted request first) or that runs more than
        `speculative_disable_batch_size` requests (a full batch has no compute to spare). Of the others,
        those that were running before the step and decode one token with nothing pending on the device
        (async scheduling), sample without penalties or a grammar (structured outputs never draft), are past
        min_new_tokens, and are not paused by the acceptance rule (`verified`)."""
        if sched.preempted or num_running > self.disable_batch_size:
            return []
        return [
            req
            for req, n in sched.scheduled[: sched.num_running]
            if n == 1
            and req.num_tokens - req.num_computed_tokens == 1
            and req.prev_row < 0
            and not req.sampling.has_penalties
            and req.sampling.grammar is None
            and req.num_output_tokens >= req.stopping.min_new_tokens
            and (req.spec is None or req.num_output_tokens >= req.spec.resume_at)
        ]

    def verified(self, sched: SchedulerOutput, req: Request, drafts: int, accepted: int) -> None:
        """After `req`'s `drafts` were verified and `accepted` of them appended with one more token: the
        step's figure (`sched.spec_accepted_lengths`) and the acceptance rule. Over tumbling windows of at
        least SPEC_GATE_WINDOW verified drafts, a request accepting less than `speculative_min_acceptance`
        of them stops proposing for a cool-down of output tokens (SPEC_COOLDOWN, doubled after each failed
        window in a row up to SPEC_MAX_COOLDOWN), then tries again; a window that passes resets it."""
        state = req.spec
        assert state is not None and drafts > 0, "only a request that proposed has drafts verified"
        sched.spec_accepted_lengths.append(accepted + 1)
        state.window_proposed += drafts
        state.window_accepted += accepted
        if state.window_proposed < SPEC_GATE_WINDOW:
            return
        rate = state.window_accepted / state.window_proposed
        state.window_proposed = state.window_accepted = 0
        if rate >= self.min_acceptance:
            state.cooldown = 0
            return
        state.cooldown = min(2 * state.cooldown if state.cooldown else SPEC_COOLDOWN, SPEC_MAX_COOLDOWN)
        state.resume_at = req.num_output_tokens + state.cooldown


def row_owners(rows: Sequence[Request]) -> list[Request]:
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
