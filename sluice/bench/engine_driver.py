"""The engine core driven in-process by the benchmarks (the only benchmark module importing the engine's
modules): settings, KV sizing, requests, stepping, memory. A benchmark's engine holds its whole workload at
once: the KV pool is sized explicitly for the given request lengths (with `KV_SLACK`), so no request is
preempted and, on CUDA, the rest of the process keeps its memory.
"""

from __future__ import annotations

import dataclasses
import gc
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from transformers import AutoConfig, PretrainedConfig

from services.common.settings import load_settings
from services.engine.core.engine import LLMEngine
from services.engine.core.params import SamplingParams, StoppingParams
from services.engine.settings import BATCHING_POLICIES, EngineSettings

__all__ = ["BATCHING_POLICIES", "SamplingParams"]  # the engine's names the benchmarks use

KV_SLACK = 1.25  # the pool holds the whole workload at once with this margin: no request is preempted
MIN_KV_GB = 0.5  # the least KV pool
BLOCK_SIZE = EngineSettings.block_size
MAX_NUM_BATCHED_TOKENS = EngineSettings.max_num_batched_tokens
NUM_SPECULATIVE_TOKENS = EngineSettings.num_speculative_tokens

Progress = Callable[[int], None]  # called with the number of output tokens just delivered


def on_cuda(device: str) -> bool:
    return device.startswith("cuda")


def sync(device: str) -> None:
    if on_cuda(device):
        torch.cuda.synchronize()


def release_memory(device: str) -> None:
    """Returns the memory of engines, models and pools no longer referenced, before the next one loads."""
    gc.collect()
    if on_cuda(device):
        torch.cuda.empty_cache()


@contextmanager
def timed(device: str) -> Iterator[list[float]]:
    """Yields a one-element list that holds the elapsed seconds once the block ends (device synced)."""
    elapsed = [0.0]
    sync(device)
    start = time.perf_counter()
    yield elapsed
    sync(device)
    elapsed[0] = time.perf_counter() - start


def kv_bytes_per_token(config: PretrainedConfig, element_size: int) -> int:
    """Bytes of K and V of one token over all layers."""
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return 2 * config.num_hidden_layers * kv_heads * head_dim * element_size


def engine_settings(
    model_dir: Path, device: str, dtype: str, lengths: Sequence[int], extra: int = 0, **fields: Any
) -> EngineSettings:
    """Settings of an engine for requests of these total lengths (`extra` more tokens each) held at once:
    a pool of KV_SLACK over their blocks (at least MIN_KV_GB); `fields` are other EngineSettings fields."""
    element = torch.tensor([], dtype=getattr(torch, dtype)).element_size()
    per_token = kv_bytes_per_token(AutoConfig.from_pretrained(model_dir), element)
    tokens = sum(-(-(n + extra) // BLOCK_SIZE) * BLOCK_SIZE + BLOCK_SIZE for n in lengths)
    kv_gb = max(MIN_KV_GB, KV_SLACK * tokens * per_token / (1 << 30))
    max_len = -(-(max(lengths) + extra + 1) // BLOCK_SIZE) * BLOCK_SIZE
    model = {"model": str(model_dir), "device": device, "dtype": dtype, "max_model_len": max_len}
    return EngineSettings(**model, block_size=BLOCK_SIZE, kv_cache_gb=kv_gb, **fields)


def make_engine(settings: EngineSettings | None = None, **fields: Any) -> LLMEngine:
    """An engine of `settings`, or of EngineSettings(**fields)."""
    return LLMEngine(settings or EngineSettings(**fields))


def engine_from_flags(flags: Sequence[str]) -> LLMEngine:
    """An engine of command-line flags, as `sluice serve engine` parses them."""
    return LLMEngine(load_settings(EngineSettings, list(flags), prog="engine flags"))


def greedy() -> SamplingParams:
    return SamplingParams(temperature=0.0)


def stop_after(n: int) -> StoppingParams:
    """Exactly `n` new tokens: EOS ignored."""
    return StoppingParams(max_new_tokens=n, ignore_eos=True)


@dataclass
class Track:
    """One request as the engine delivers it: when it was added and when its first token and its end came
    (perf_counter seconds, the end of their step), its tokens and its prompt's log-probabilities (when it
    asked for them)."""

    added: float = 0.0
    first: float | None = None
    done: float | None = None
    tokens: list[int] = field(default_factory=list)
    prompt_logprobs: list[float] = field(default_factory=list)


def drain(
    engine: LLMEngine, tracks: Mapping[str, Track] | None = None, progress: Progress | None = None
) -> None:
    """Steps the engine until it has nothing left, filling in the track of each request in `tracks` (its
    new tokens reported to `progress`); waits out a forming batch (`idle_s`) instead of spinning. A failed
    request raises RuntimeError."""
    while engine.has_unfinished_requests():
        time.sleep(engine.idle_s())
        outputs = engine.step()
        now = time.perf_counter()
        for out in outputs:
            if out.error is not None:
                raise RuntimeError(f"engine failed request {out.request_id}: {out.error}")
            if (track := (tracks or {}).get(out.request_id)) is None:
                continue
            if out.new_token_ids and track.first is None:
                track.first = now
            track.tokens.extend(out.new_token_ids)
            track.prompt_logprobs.extend(p.logprob for p in out.prompt_logprobs or ())
            if progress is not None:
                progress(len(out.new_token_ids))
            if out.finished:
                track.done = now


def warm_up(engine: LLMEngine, prompt: Sequence[int], tokens: int = 4) -> None:
    """One greedy request outside any timed region, then the engine's statistics reset."""
    engine.add_request("warmup", list(prompt), greedy(), stop_after(tokens))
    drain(engine)
    engine.reset_stats()


def generate(
    engine: LLMEngine,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: Sequence[int],
    progress: Progress | None = None,
    device: str = "cpu",
) -> tuple[list[list[int]], float]:
    """Adds every prompt at once (greedy, exactly its `max_new_tokens`), steps until all are done; returns
    each prompt's tokens in order and the seconds it took (device synced)."""
    tracks = {f"r{i}": Track() for i in range(len(prompts))}
    with timed(device) as elapsed:
        for i, (prompt, n) in enumerate(zip(prompts, max_new_tokens, strict=True)):
            engine.add_request(f"r{i}", list(prompt), greedy(), stop_after(n))
        drain(engine, tracks, progress)
    return [t.tokens for t in tracks.values()], elapsed[0]


def spec_stats(engine: LLMEngine) -> dict[str, float]:
    """The engine statistics named spec_* (speculative decoding's; empty when the engine has none)."""
    stats = engine.stats()
    fields = [f.name for f in dataclasses.fields(stats)] if dataclasses.is_dataclass(stats) else []
    return {n: float(getattr(stats, n)) for n in fields if n.startswith("spec_")}
