"""The KV pool's size: explicit, or on CUDA a share of the memory left once the model runs.

`kv_cache_gb = 0` and `num_kv_blocks = 0` (the defaults) mean "size it for me": on CPU
`DEFAULT_KV_CACHE_GB`; on CUDA the runner starts with that provisional pool and `fit_kv_pool` runs one
warm-up step as large as any (`max_num_batched_tokens` prompt tokens asking for prompt logprobs), then
replaces the pool with `gpu_memory_utilization` × (free memory + the provisional pool), never more blocks
than `max_num_seqs` full contexts fill (`useful_blocks`). `KVLayout` splits a pool among the KV groups
(full-attention layers first, then one group per window, widest first): `num_kv_blocks` is the first
group's size, a sliding group gets min(that, `window_blocks`), and `blocks_for_bytes` gives the most
blocks whose groups fit a byte budget together. Why, and the figures: docs/architecture.md ("The pool
sized from memory", "Paged KV cache").
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from services.engine.core.block_manager import KVGroupSpec
from services.engine.core.params import MAX_LOGPROBS, SamplingParams, StoppingParams
from services.engine.core.request import Request
from services.engine.executor.sampler import Sampler

log = logging.getLogger(__name__)

GiB = 1 << 30
DEFAULT_KV_CACHE_GB = 0.5  # the pool when sized automatically on a CPU, and the provisional one on CUDA
WARM_UP_ID = "kv-sizing-warm-up"

MemGetInfo = Callable[[torch.device], tuple[int, int]]  # (free, total) bytes, as torch.cuda.mem_get_info


class SizingSettings(Protocol):
    kv_cache_gb: float
    num_kv_blocks: int
    gpu_memory_utilization: float
    max_num_batched_tokens: int
    max_num_seqs: int
    max_model_len: int


def sized_automatically(settings: SizingSettings) -> bool:
    """True when neither a budget in GiB nor a block count is given."""
    return settings.kv_cache_gb <= 0 and settings.num_kv_blocks <= 0


def initial_kv_cache_gb(settings: SizingSettings) -> float:
    """The budget the runner is built with: the explicit one, else `DEFAULT_KV_CACHE_GB` (final on CPU,
    provisional on CUDA until `fit_kv_pool` replaces it)."""
    return settings.kv_cache_gb if settings.kv_cache_gb > 0 else DEFAULT_KV_CACHE_GB


def block_bytes(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, element_size: int) -> int:
    """Bytes of one KV block: a K and a V slot per token, per layer."""
    return 2 * num_layers * block_size * num_kv_heads * head_dim * element_size


def group_layers(windows: Sequence[int]) -> list[tuple[int, tuple[int, ...]]]:
    """Layers grouped by window, as (window, layer indices): full attention (window 0) first, then one
    group per window, the widest first (the first group's size is the pool's `num_blocks`)."""
    order = sorted(set(windows), key=lambda w: (w != 0, -w))
    return [(w, tuple(i for i, x in enumerate(windows) if x == w)) for w in order]


def window_blocks(window: int, block_size: int, max_num_seqs: int, max_num_batched_tokens: int) -> int:
    """The most blocks a sliding group's requests can hold at once: between steps a running request
    holds at most ceil((window - 1) / block_size) + 1 (the scheduler frees the rest), and a step's chunks
    of n tokens add at most ceil(n / block_size) + 1 each, max_num_batched_tokens tokens in all."""
    per_request = -(-(window - 1) // block_size) + 2
    return max_num_seqs * per_request + -(-max_num_batched_tokens // block_size)


@dataclass(frozen=True)
class KVLayout:
    """How a pool of `num_blocks` blocks is split among the KV groups of a model (see the module
    docstring): `groups` as `group_layers` gives them, `layer_block_bytes` one block of one layer (its K
    and V), `max_num_seqs` and `max_num_batched_tokens` bounding what a sliding group can hold."""

    groups: tuple[tuple[int, tuple[int, ...]], ...]
    block_size: int
    layer_block_bytes: int
    max_num_seqs: int
    max_num_batched_tokens: int

    def group_blocks(self, num_blocks: int) -> list[int]:
        """Blocks of each group's pool: the first group `num_blocks`, a later (sliding) one at most its
        `window_blocks`."""
        sizes = [num_blocks]
        for window, _ in self.groups[1:]:
            bound = window_blocks(window, self.block_size, self.max_num_seqs, self.max_num_batched_tokens)
            sizes.append(min(num_blocks, bound))
        return sizes

    def specs(self, num_blocks: int) -> list[KVGroupSpec]:
        return [
            KVGroupSpec(window, layers, n)
            for (window, layers), n in zip(self.groups, self.group_blocks(num_blocks), strict=True)
        ]

    def pool_bytes(self, num_blocks: int) -> int:
        """Bytes of the pool of `num_blocks` (scratch blocks not counted)."""
        sizes = self.group_blocks(num_blocks)
        return sum(n * len(layers) for n, (_, layers) in zip(sizes, self.groups, strict=True)) * (
            self.layer_block_bytes
        )

    def blocks_for_bytes(self, budget: int) -> int:
        """The largest `num_blocks` whose pool fits in `budget` bytes (0 when not one block does)."""
        lo, hi = 0, budget // (self.layer_block_bytes * len(self.groups[0][1])) + 1
        while hi - lo > 1:  # pool_bytes(lo) <= budget < pool_bytes(hi)
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if self.pool_bytes(mid) <= budget else (lo, mid)
        return lo

    def describe(self, num_blocks: int) -> str:
        """The pool per group for the start-up log: e.g. "full: 2 layers × 300 blocks; window 512: 2
        layers × 96 blocks"."""
        return "; ".join(
            f"{f'window {s.window}' if s.window else 'full'}: {len(s.layers)} "
            f"layer{'s' if len(s.layers) != 1 else ''} × {s.num_blocks} blocks"
            for s in self.specs(num_blocks)
        )


def pool_block_bytes(runner: Any) -> int:
    """Bytes of one block of `runner`'s KV pool, in the pool's dtype (`kv_dtype`)."""
    element = torch.tensor([], dtype=runner.kv_dtype).element_size()
    return block_bytes(runner.num_layers, runner.block_size, runner.num_kv_heads, runner.head_dim, element)


def blocks_from_free_memory(
    free_bytes: int, released_bytes: int, fraction: float, bytes_per_block: int
) -> int:
    """Blocks in `fraction` of the memory the pool may use: `free_bytes` the device reports free after the
    warm-up, plus `released_bytes` of the provisional pool the new one replaces. Raises ValueError when
    not one block fits, or the fraction is not in (0, 1]."""
    return checked_blocks(budget_from_free_memory(free_bytes, released_bytes, fraction), bytes_per_block)


def budget_from_free_memory(free_bytes: int, released_bytes: int, fraction: float) -> int:
    """`fraction` of the free memory plus the released pool, in bytes; ValueError for a bad fraction."""
    if not 0.0 < fraction <= 1.0:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {fraction}")
    return int((free_bytes + released_bytes) * fraction)


def checked_blocks(budget: int, bytes_per_block: int, blocks: int | None = None) -> int:
    """`blocks` (default budget // bytes_per_block); ValueError when not one block fits the budget."""
    blocks = budget // bytes_per_block if blocks is None else blocks
    if blocks < 1:
        raise ValueError(
            f"KV cache: {budget / GiB:.2f} GiB of free device memory after the warm-up is less than one "
            f"block of {bytes_per_block} bytes; lower max_num_batched_tokens or set kv_cache_gb"
        )
    return blocks


def useful_blocks(max_num_seqs: int, context_len: int, block_size: int) -> int:
    """The most blocks the engine can ever fill: every running request at the full context length. A
    small model on a large GPU would otherwise get millions of blocks it cannot use (each one costs the
    block manager's bookkeeping too)."""
    return max_num_seqs * -(-context_len // block_size)


def fit_kv_pool(runner: Any, settings: SizingSettings, mem_get_info: MemGetInfo | None = None) -> int:
    """Resizes `runner`'s KV pool (a ModelRunner just built with `initial_kv_cache_gb`) from the device's
    free memory after a warm-up forward, when the size is automatic and the device is CUDA (or when
    `mem_get_info` is given, as tests do on CPU). Returns the pool's size in blocks; otherwise the pool is
    left as built."""
    if not sized_automatically(settings) or (runner.device.type != "cuda" and mem_get_info is None):
        return int(runner.num_blocks)
    per_block = pool_block_bytes(runner)
    warm_up(runner, settings.max_num_batched_tokens)
    free, _ = (mem_get_info or torch.cuda.mem_get_info)(runner.device)
    released = runner.kv_layout.pool_bytes(runner.num_blocks)
    budget = budget_from_free_memory(free, released, settings.gpu_memory_utilization)
    blocks = checked_blocks(budget, per_block, runner.kv_layout.blocks_for_bytes(budget))
    context_len = settings.max_model_len or runner.max_position_embeddings
    if context_len:
        blocks = min(blocks, useful_blocks(settings.max_num_seqs, context_len, runner.block_size))
    runner.allocate_pool(blocks)
    log.info(
        "KV pool sized from free memory after a warm-up: %d blocks (%s; %.2f GiB, %.0f%% of %.2f GiB)",
        blocks,
        runner.kv_layout.describe(blocks),
        runner.kv_layout.pool_bytes(blocks) / GiB,
        100 * settings.gpu_memory_utilization,
        (free + released) / GiB,
    )
    return blocks


def warm_up(runner: Any, max_tokens: int) -> None:
    """One step as large as the largest the engine will run (capped by the provisional pool and the
    context length): a prompt of that many tokens asking for prompt logprobs, its forward and the
    log-probabilities of its prompt rows, so that their memory is reserved before free memory is read."""
    limit = runner.num_blocks * runner.block_size
    if runner.max_position_embeddings:
        limit = min(limit, runner.max_position_embeddings)
    n = max(1, min(max_tokens, limit))
    sampling = SamplingParams(prompt_logprobs=MAX_LOGPROBS)
    request = Request(WARM_UP_ID, [0] * n, sampling, StoppingParams(max_new_tokens=1))
    request.block_ids = list(range(-(-n // runner.block_size)))
    request.group_block_ids = [list(request.block_ids) for _ in runner.kv_groups[1:]]
    runner.execute([(request, n)])
    sampler = Sampler(runner.device)
    for req, first, logits in runner.prompt_logits:  # (n - 1, V): every prompt position but the last
        targets = req.token_ids[first + 1 : first + 1 + logits.shape[0]]
        sampler.prompt_logprobs(logits, targets, MAX_LOGPROBS).result()
    runner.prompt_logits = []
    if runner.device.type == "cuda":
        torch.cuda.synchronize(runner.device)
