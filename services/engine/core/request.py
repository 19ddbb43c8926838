"""One request inside the engine: a list of token ids and counters, nothing more.

A request has no phases: `num_computed_tokens` (tokens whose KV is in the pool) catches up with
`num_tokens` (prompt plus kept tokens); a step that brings it level samples one more token. Prefill,
chunked prefill, decode, prefix-cache hits and recompute after preemption are the same arithmetic.
Per-feature state stays in one field each: speculation's `spec` (a `SpecState`; its `drafts` are never
part of `token_ids` nor of a block hash, accepted ones are appended after the step), structured outputs'
`grammar` (the state, once compiled: it has accepted exactly the kept output tokens), prompt logprobs'
`prompt_logprobs` (collected through chunked prefill, sent once: `prompt_logprobs_sent`).
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from services.common.block_keys import BlockHash
from services.engine.core.params import SamplingParams, StoppingParams, TokenLogprob
from services.engine.core.speculative import SpecState

if TYPE_CHECKING:
    from services.engine.core.grammar import GrammarState

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
    block_ids: list[int] = field(default_factory=list)  # the table of the first KV group (of layers)
    # A hybrid model's tables of its other KV groups (block_manager.KVGroupSpec), one entry per logical
    # block like `block_ids`; empty for a model with one group.
    group_block_ids: list[list[int]] = field(default_factory=list)
    block_hashes: list[BlockHash] = field(default_factory=list)
    num_registered_blocks: int = 0
    # Per KV group whose layers slide: table[:slid_blocks[g]] slid out of the group's window and were
    # freed (or never held: a prefix hit starts with holes); they read the group's hole since.
    slid_blocks: list[int] = field(default_factory=list)
    status: Status = Status.WAITING
    finish_reason: str | None = None
    error: str | None = None  # "error" finish: the detail, in plain words
    error_code: str | None = None  # "error" finish: its class (services/common/errors.py)
    num_preemptions: int = 0
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache at the first admission
    generator: Any = None  # torch.Generator of a seeded request, made by the sampler
    # Async scheduling: >= 0 while the last entry of token_ids is PLACEHOLDER for a token the previous
    # step sampled on the device and the host has not read yet; its row in that step's sampled ids.
    prev_row: int = -1
    plain_greedy: bool = field(init=False, default=False)
    spec: SpecState | None = None  # speculative decoding (see the module docstring)
    grammar: GrammarState | None = None  # structured outputs (see the module docstring)
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs_sent: bool = False

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = list(self.prompt_ids)
        self.num_prompt_tokens = len(self.prompt_ids)
        s = self.sampling
        # Greedy with nothing else to do: the sampler's fast path.
        self.plain_greedy = (
            s.greedy
            and not s.has_penalties
            and not s.logprobs
            and not self.stopping.min_new_tokens
            and not s.logit_bias
            and s.grammar is None
        )

    @property
    def tables(self) -> list[list[int]]:
        """The block table of every KV group, the first group's (`block_ids`) first."""
        return [self.block_ids, *self.group_block_ids]

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
    def wants_prompt_logprobs(self) -> bool:
        """Whether the prompt rows this request computes are kept (asked for, and not all collected)."""
        return (
            self.sampling.prompt_logprobs is not None
            and len(self.prompt_logprobs) < self.num_prompt_tokens - 1
        )

    @property
    def draft_ids(self) -> Sequence[int]:
        """The drafts scheduled with the last token in this step; empty outside a step that verifies them."""
        return self.spec.drafts if self.spec is not None else ()

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED
