"""Plain request parameters, their validation, and per-step outputs of the engine core (no protobuf here).

`validate_request` is the one check of a request (every API's): a pure function of the parameters and
the engine's fixed facts (`RequestLimits`: vocabulary, context length, grammar support), so any thread
may call it; it reads nothing a step changes (the duplicate-id check is the engine's, on its thread).
It also owns the context limit: `max_new_tokens` 0 (unset on the wire) becomes the rest of the context
(`max_model_len` − prompt tokens, capped by `default_max_new_tokens` when that is set), and a larger
`max_new_tokens` is cut to that rest: generation ends at the context with finish reason "length".
A `RequestOutput` that ends with "error" carries its class (`error_code`, services/common/errors.py)
and plain words (`error`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, fields, replace
from typing import TYPE_CHECKING

from services.common.limits import (
    MAX_ABS_LOGIT_BIAS,
    MAX_LOGIT_BIAS_ENTRIES,
    MAX_LOGPROBS,
    MAX_REPETITION_PENALTY,
    float32,
)
from services.common.limits import MIN_REPETITION_PENALTY as _MIN_REPETITION_PENALTY

if TYPE_CHECKING:
    from services.engine.core.grammar import GrammarSpec

GREEDY_BELOW = 1e-5  # a temperature this small samples as greedy (dividing by it overflows the logits)
# The bounds are services/common/limits.py's; the minimum repetition penalty as the wire's float32 carries
# it (a little below 0.01), so that 0.01 sent as float32 passes.
MIN_REPETITION_PENALTY = float32(_MIN_REPETITION_PENALTY)


@dataclass(frozen=True)
class SamplingParams:
    """How the next token is chosen. A temperature below `GREEDY_BELOW` (0 included) is greedy; the
    filters apply only when sampling.

    Penalties follow the usual conventions: `repetition_penalty` (`MIN_REPETITION_PENALTY` to
    `MAX_REPETITION_PENALTY`, 1 = off) divides positive and
    multiplies negative logits of every token seen in the prompt or output; `presence_penalty` and
    `frequency_penalty` subtract from the logits of tokens in the output (once, and once per occurrence).
    `seed` gives the request its own random generator: the same seed gives the same output whatever else
    is in the batch. `logprobs` asks for the top-n (0..20) alternatives of every generated token.

    `logit_bias` ((token id, bias) pairs, at most 300, each bias in [-100, 100]) is added to the logits
    before anything else. `grammar` constrains the output (services/engine/core/grammar.py): the tokens it
    forbids are masked after logit bias and penalties, before temperature / top-k / top-p (greedy too).
    `prompt_logprobs` (None: off) asks for the log-probability of every prompt token after the first and
    its top-n (0..20) alternatives, returned once with the first token; such a request takes no
    prefix-cache hit (its prompt is computed). Log-probabilities are the model's raw distribution's.
    """

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    logprobs: int = 0
    logit_bias: tuple[tuple[int, float], ...] = ()
    grammar: GrammarSpec | None = None
    prompt_logprobs: int | None = None

    def validate(self) -> None:
        """Raises ValueError with a clear message when a value is out of range."""
        for f in fields(self):
            if f.type == "float" and not math.isfinite(getattr(self, f.name)):
                raise ValueError(f"{f.name} must be a finite number")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if not MIN_REPETITION_PENALTY <= self.repetition_penalty <= MAX_REPETITION_PENALTY:
            raise ValueError(
                f"repetition_penalty must be between {MIN_REPETITION_PENALTY:g} and "
                f"{MAX_REPETITION_PENALTY:g}, got {self.repetition_penalty:g}"
            )
        if self.seed is not None and self.seed < 0:
            raise ValueError(f"seed must be >= 0, got {self.seed}")
        if not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise ValueError(f"logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs}")
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= MAX_LOGPROBS:
            raise ValueError(f"prompt_logprobs must be in [0, {MAX_LOGPROBS}], got {self.prompt_logprobs}")
        self._validate_logit_bias()

    def _validate_logit_bias(self) -> None:
        """Count and values; the ids against the vocabulary are the engine's check."""
        if len(self.logit_bias) > MAX_LOGIT_BIAS_ENTRIES:
            raise ValueError(
                f"logit_bias has {len(self.logit_bias)} entries; at most {MAX_LOGIT_BIAS_ENTRIES} are allowed"
            )
        for token, bias in self.logit_bias:
            if token < 0:
                raise ValueError(f"logit_bias: token id {token} is negative")
            if not (math.isfinite(bias) and -MAX_ABS_LOGIT_BIAS <= bias <= MAX_ABS_LOGIT_BIAS):
                raise ValueError(
                    f"logit_bias: the bias of token {token} must be in "
                    f"[-{MAX_ABS_LOGIT_BIAS:g}, {MAX_ABS_LOGIT_BIAS:g}], got {bias}"
                )

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW

    @property
    def has_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0


@dataclass(frozen=True)
class StoppingParams:
    """When generation ends: EOS (unless `ignore_eos`), a stop token id, `max_new_tokens`, or the model's
    context length. EOS and stop token ids cannot be produced before `min_new_tokens` tokens.
    `max_new_tokens` 0 asks for the rest of the context (`validate_request` fills it in)."""

    max_new_tokens: int = 256
    min_new_tokens: int = 0
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False

    def validate(self) -> None:
        if self.max_new_tokens < 0:
            raise ValueError(
                f"max_new_tokens must be >= 0 (0: the rest of the context), got {self.max_new_tokens}"
            )
        if self.min_new_tokens < 0:
            raise ValueError(f"min_new_tokens must be >= 0, got {self.min_new_tokens}")
        if any(t < 0 for t in self.stop_token_ids):
            raise ValueError("stop_token_ids must be >= 0")


@dataclass
class TokenLogprob:
    """Log-probability of one generated token under the model, and the top-n alternatives."""

    logprob: float
    top_ids: list[int] = field(default_factory=list)
    top_logprobs: list[float] = field(default_factory=list)


@dataclass
class RequestOutput:
    """What one step (or several merged steps) produced for one request.

    `new_token_ids` holds only the tokens since the previous output of this request. A finished output
    is the last one for its request. `prompt_logprobs` (one entry per prompt token after the first) comes
    once, with the request's first token; `cached_tokens`: the prompt tokens found in the prefix cache.
    """

    request_id: str
    new_token_ids: list[int]
    logprobs: list[TokenLogprob] | None
    finished: bool
    finish_reason: str | None  # "stop" | "length" | "cancelled" | "error"
    prompt_tokens: int
    completion_tokens: int
    error: str | None = None  # the detail, in plain words
    prompt_logprobs: list[TokenLogprob] | None = None
    cached_tokens: int = 0
    error_code: str | None = None  # the class of an "error" finish (services/common/errors.py)

    def merge(self, later: RequestOutput) -> None:
        """Appends a later output of the same request to this one (coalescing for slow readers)."""
        assert later.request_id == self.request_id
        self.new_token_ids.extend(later.new_token_ids)
        if later.logprobs is not None:
            self.logprobs = [*(self.logprobs or []), *later.logprobs]
        self.finished = later.finished
        self.finish_reason = later.finish_reason
        self.prompt_tokens = later.prompt_tokens
        self.completion_tokens = later.completion_tokens
        self.error = later.error
        self.error_code = later.error_code
        self.cached_tokens = later.cached_tokens
        if self.prompt_logprobs is None:
            self.prompt_logprobs = later.prompt_logprobs


@dataclass(frozen=True)
class RequestLimits:
    """What `validate_request` checks a request against: facts of the engine fixed when it is built."""

    vocab_size: int
    max_model_len: int
    grammar: bool  # structured outputs served (the model directory has a tokenizer.json)
    default_max_new_tokens: int = 0  # caps the fill of an unset max_new_tokens; 0 = no cap


def validate_request(
    prompt_ids: Sequence[int], sampling: SamplingParams, stopping: StoppingParams, limits: RequestLimits
) -> StoppingParams:
    """Raises ValueError with a clear message when the request cannot be served as given; returns its
    stopping parameters with `max_new_tokens` filled in (see the module docstring)."""
    if not prompt_ids:
        raise ValueError("prompt_ids must not be empty")
    context = limits.max_model_len
    if len(prompt_ids) >= context:
        raise ValueError(
            f"prompt has {len(prompt_ids)} tokens; the context length is {context}, "
            "so at most max_model_len - 1 prompt tokens"
        )
    vocab = limits.vocab_size
    _check_vocabulary("token id", prompt_ids, vocab)
    sampling.validate()
    stopping.validate()
    _check_vocabulary("logit_bias: token id", [t for t, _ in sampling.logit_bias], vocab)
    if sampling.grammar is not None and not limits.grammar:
        raise ValueError("structured outputs are not served: the model directory has no tokenizer.json")
    # A stop token outside the vocabulary could never be generated: a stop that silently never stops.
    _check_vocabulary("stop_token_ids: token id", stopping.stop_token_ids, vocab)
    rest = context - len(prompt_ids)
    if stopping.max_new_tokens == 0:
        fill = min(rest, limits.default_max_new_tokens) if limits.default_max_new_tokens else rest
        return replace(stopping, max_new_tokens=fill)
    if stopping.max_new_tokens > rest:  # ends at the context ("length"), as it always has
        return replace(stopping, max_new_tokens=rest)
    return stopping


def _check_vocabulary(what: str, ids: Sequence[int], vocab: int) -> None:
    bad = next((t for t in ids if not 0 <= t < vocab), None)
    if bad is not None:
        raise ValueError(f"{what} {bad} is outside the vocabulary [0, {vocab})")
