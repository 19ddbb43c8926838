"""Token acceptance for one request, owned by the scheduler (`Scheduler.update_from_output`): the stop
rules, the grammar's advance, and a request's output.

Invariants: a request's `GrammarState` accepts exactly the tokens it keeps (`keep`, in order; never a
token discarded after a stop, nor async scheduling's discarded token). A kept token stops the request
with "stop" on EOS or a stop token (not before `min_new_tokens` tokens came before it) or when its grammar
has ended (only EOS could follow), "length" at `max_new_tokens` or the context length, and "error" when
its grammar forbids it (`internal`: the mask let nothing else through) or the library gives up on the
grammar (`invalid_argument`). A request's prompt logprobs go out once, with its first token.
"""

from __future__ import annotations

from dataclasses import dataclass

from services.common.errors import INTERNAL, INVALID_ARGUMENT
from services.engine.core.grammar import GrammarError
from services.engine.core.params import RequestOutput, TokenLogprob
from services.engine.core.request import Request


@dataclass(frozen=True)
class Stop:
    """Why a kept token ends its request: a finish reason, with a class and detail for "error"."""

    reason: str
    error_code: str | None = None
    detail: str | None = None


def keep(req: Request, tok: int, max_model_len: int) -> Stop | None:
    """Advances `req`'s grammar with `tok`, its latest kept token (already in `token_ids`); the stop it
    causes, if any (see the module docstring)."""
    if req.grammar is not None:
        try:
            accepted = req.grammar.accept((tok,))
        except GrammarError as exc:  # the library gave up on the grammar: the request's own failure
            return Stop("error", INVALID_ARGUMENT, str(exc))
        if not accepted:
            return Stop("error", INTERNAL, f"token {tok} is outside the request's grammar")
    reason = stop_reason(req, tok, max_model_len)
    return Stop(reason) if reason is not None else None


def stop_reason(req: Request, tok: int, max_model_len: int) -> str | None:
    st = req.stopping
    # The sampler keeps stop tokens out until min_new_tokens tokens came before this one.
    if req.num_output_tokens > st.min_new_tokens and (
        tok in st.stop_token_ids or (not st.ignore_eos and tok in req.eos_ids)
    ):
        return "stop"
    if req.grammar is not None and req.grammar.is_terminated():
        return "stop"
    if req.num_output_tokens >= st.max_new_tokens or req.num_tokens >= max_model_len:
        return "length"
    return None


def drop_placeholder(req: Request) -> None:
    """A request ending before its pending token (async scheduling) is read ends without it."""
    if req.prev_row >= 0:
        req.token_ids.pop()
        req.prev_row = -1


def request_output(req: Request, tokens: list[int], logprobs: list | None = None) -> RequestOutput:
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
        error_code=req.error_code,
    )
