"""One request inside the engine: a list of token ids and counters, nothing more.

A request has no phases: `num_computed_tokens` (tokens whose KV is in the pool) catches up with
`num_tokens` (prompt plus generated tokens). A step that brings it level samples one more token.
Prefill, chunked prefill, decode, prefix-cache hits and recompute after preemption are all the same
arithmetic on these counters.

Speculative decoding adds `spec_ids`: tokens proposed for the positions after `token_ids`, computed in
the next step together with the request's own last token and verified by the sampler. They are never
part of `token_ids` (nor of a block hash); accepted ones are appended to it after the step.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from services.engine.core.block_manager import BlockHash
from services.engine.core.params import SamplingParams, StoppingParams

# The value of a token the device sampled and the host has not read yet (async scheduling): never a
# vocabulary id, so that hashing or feeding it by mistake fails loudly.
PLACEHOLDER = -1


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_ids: list[int]
    sampling: SamplingParams
    stopping: StoppingParams
    arrival_time: float = 0.0
    deadline: float | None = None  # time.monotonic() past which the request fails; None = none
    eos_ids: frozenset[int] = frozenset()
    token_ids: list[int] = field(default_factory=list)
    num_prompt_tokens: int = 0
    num_computed_tokens: int = 0
    block_ids: list[int] = field(default_factory=list)
    block_hashes: list[BlockHash] = field(default_factory=list)
    num_registered_blocks: int = 0
    status: Status = Status.WAITING
    finish_reason: str | None = None
    error: str | None = None
    num_preemptions: int = 0
    num_cached_tokens: int = 0
    generator: Any = None  # torch.Generator of a seeded request, made by the sampler
    # Async scheduling: >= 0 while the last entry of token_ids is PLACEHOLDER for a token the previous
    # step sampled on the device and the host has not read yet; its row in that step's sampled ids.
    prev_row: int = -1
    plain_greedy: bool = field(init=False, default=False)
    # Speculative decoding: the drafts scheduled for the next step (set by the engine, trimmed by the
    # scheduler; empty outside a step that verifies them).
    spec_ids: list[int] = field(default_factory=list)
    # Its tokens as an array for the proposer (speculative.TokenMirror), made by the engine: token_ids only
    # grows while speculating (async scheduling is off), so it is brought up to date, never rebuilt.
    token_mirror: Any = None
    spec_proposed: int = 0  # drafts verified over the request's life
    spec_accepted: int = 0  # of those, accepted
    # The acceptance gate (LLMEngine._gate): drafts verified and accepted in the current window, the
    # output length before which the request does not propose, and the length of its next cool-down.
    spec_window_proposed: int = 0
    spec_window_accepted: int = 0
    spec_resume_at: int = 0
    spec_cooldown: int = 0

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = list(self.prompt_ids)
        self.num_prompt_tokens = len(self.prompt_ids)
        s = self.sampling
        # Greedy with nothing else to do: the sampler's fast path.
        self.plain_greedy = (
            s.greedy and not s.has_penalties and not s.logprobs and not self.stopping.min_new_tokens
        )

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED
