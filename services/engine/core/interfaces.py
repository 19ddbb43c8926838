"""What the engine core needs from outside it, and what its settings resolve to against a runner.

`Runner`: the model on its device (services/engine/executor/model_runner.py, or a fake in tests).
`StepObserver`: metrics and tracing hooks (services/engine/observability.py), on the engine's thread; a
failing hook is logged and never fails a request or the step. `context_length` and
`uses_async_scheduling` resolve the settings once, when an engine is built: a context length the KV pool
cannot hold is refused with the numbers (a request alone must always fit), never cut silently.
Torch appears here only as types.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Protocol

from services.engine.settings import EngineSettings

if TYPE_CHECKING:
    import torch

    from services.engine.core.params import RequestOutput
    from services.engine.core.request import Request
    from services.engine.core.scheduler import SchedulerOutput


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
