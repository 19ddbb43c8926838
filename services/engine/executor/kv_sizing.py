"""The KV pool's size: explicit, or on CUDA a share of the memory left once the model runs.

`kv_cache_gb = 0` and `num_kv_blocks = 0` (the defaults) mean "size it for me". On CPU that is
`DEFAULT_KV_CACHE_GB`. On CUDA the runner is built with that provisional pool, then `fit_kv_pool` runs one
warm-up forward as large as the biggest step (`max_num_batched_tokens` prompt tokens), reads the free device
memory, and replaces the pool with one of `gpu_memory_utilization` × (free memory + the provisional pool it
releases). The warm-up's activations stay reserved by torch's caching allocator, so the free figure already
leaves room for the largest step: the pool takes what the model and its activations do not need (as vLLM's
`gpu_memory_utilization` does after its profiling run), rather than a fixed 0.5 GiB on an 80 GiB GPU. It
never takes more blocks than `max_num_seqs` requests at the full context length can fill.

The warm-up step asks for prompt logprobs (at the most alternatives a request may ask for), since that is
the largest step there is: the runner keeps a logits row per prompt position (up to
`max_num_batched_tokens` − 1 rows × the vocabulary) and the sampler turns them into log-probabilities in
fp32 (2,047 × 151,936 × 4 bytes = 1.2 GiB on a Qwen2-sized vocabulary, beside the row copies and the
top-k). Its peak is reserved before free memory is read, so a prompt-logprobs request at the full step
budget fits beside the pool instead of running the device out of memory.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, Protocol

import torch

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
    if not 0.0 < fraction <= 1.0:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {fraction}")
    budget = int((free_bytes + released_bytes) * fraction)
    blocks = budget // bytes_per_block
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
    released = runner.num_blocks * per_block
    blocks = blocks_from_free_memory(free, released, settings.gpu_memory_utilization, per_block)
    context_len = settings.max_model_len or runner.max_position_embeddings
    if context_len:
        blocks = min(blocks, useful_blocks(settings.max_num_seqs, context_len, runner.block_size))
    runner.allocate_pool(blocks)
    log.info(
        "KV pool sized from free memory after a warm-up: %d blocks (%.2f GiB, %.0f%% of %.2f GiB)",
        blocks,
        blocks * per_block / GiB,
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
    runner.execute([(request, n)])
    sampler = Sampler(runner.device)
    for req, first, logits in runner.prompt_logits:  # (n - 1, V): every prompt position but the last
        targets = req.token_ids[first + 1 : first + 1 + logits.shape[0]]
        sampler.prompt_logprobs(logits, targets, MAX_LOGPROBS).result()
    runner.prompt_logits = []
    if runner.device.type == "cuda":
        torch.cuda.synchronize(runner.device)
