"""Prompt logprobs (echo) from the prefill the engine runs anyway, kept off every other request's path.

The runner keeps the prompt rows of a request that asks for them (`Runner.prompt_logits`) through its
chunked prefill; `launch` turns the latest step's rows into log-probabilities with the sampler (left on
the device with the step), `collect` appends them to their requests once read, position by position (a
recompute after preemption may cover positions again). They go out once, with the request's first token
(services/engine/core/stopping.py's `request_output`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from services.engine.core.interfaces import Runner
from services.engine.core.request import Request

if TYPE_CHECKING:
    from services.engine.executor.sampler import SampleHandle, Sampler

PromptRows = list[tuple[Request, int, "SampleHandle"]]  # (request, first position, its launched handle)


def launch(runner: Runner, sampler: Sampler) -> PromptRows:
    """The log-probabilities of the prompt rows the runner kept in its latest execute, launched."""
    launched = []
    for req, first, logits in runner.prompt_logits:
        targets = req.token_ids[first + 1 : first + 1 + logits.shape[0]]
        k = req.sampling.prompt_logprobs or 0
        launched.append((req, first, sampler.prompt_logprobs(logits, targets, k)))
    return launched


def collect(prompts: PromptRows) -> None:
    """Appends read prompt log-probabilities to their requests, from the first position each lacks."""
    for req, first, handle in prompts:
        have = len(req.prompt_logprobs)
        if req.finished or first > have:
            continue
        entries = handle.result().logprobs[have - first :]
        req.prompt_logprobs.extend(e for e in entries if e is not None)
