"""The engine benchmark's fixed workload (random-token requests, a pure function of the seed) and the
methods it times (transformers baselines, the engine's policies). Every method returns, per request in
workload order, exactly its `max_new_tokens[i]` greedy tokens (EOS never ends a request), and runs a short
warm-up outside the timed region.
"""

from __future__ import annotations

import functools
import random
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, GenerationConfig, PreTrainedModel

from sluice.bench import engine_driver as drv
from sluice.bench.engine_driver import Progress, on_cuda, timed
from sluice.bench.report import EAGER, HF_METHODS, NOT_ON_CPU, SLUICE_METHODS
from sluice.model.presets import FIRST_PLAIN_ID, PAD_ID

ALL_METHODS = HF_METHODS + SLUICE_METHODS
DEFAULT_METHODS = HF_METHODS + SLUICE_METHODS[:3]  # CPU: the eager method is the same engine there
STATIC_BATCH_SIZE = 16


@dataclass(frozen=True)
class Workload:
    """Requests that all arrive at once: `prompts[i]` asks for exactly `max_new_tokens[i]` tokens."""

    prompts: tuple[tuple[int, ...], ...]
    max_new_tokens: tuple[int, ...]

    def __post_init__(self) -> None:
        assert len(self.prompts) == len(self.max_new_tokens)

    def __len__(self) -> int:
        return len(self.prompts)

    @property
    def total_output_tokens(self) -> int:
        return sum(self.max_new_tokens)

    def describe(self, prompt_len: tuple[int, int], output_len: tuple[int, int], seed: int) -> dict:
        return {
            "num_requests": len(self),
            "prompt_len": list(prompt_len),
            "output_len": list(output_len),
            "seed": seed,
            "prompt_tokens": sum(len(p) for p in self.prompts),
            "output_tokens": self.total_output_tokens,
        }


def make_workload(
    num_requests: int,
    seed: int,
    vocab_size: int,
    prompt_len: tuple[int, int] = (16, 256),
    output_len: tuple[int, int] = (8, 256),
) -> Workload:
    """`num_requests` requests with lengths uniform in the inclusive ranges and uniform random token ids."""
    if num_requests < 1:
        raise ValueError(f"num_requests must be at least 1, got {num_requests}")
    for name, (lo, hi) in (("prompt_len", prompt_len), ("output_len", output_len)):
        if not 1 <= lo <= hi:
            raise ValueError(f"{name} must satisfy 1 <= min <= max, got {lo}..{hi}")
    rng = random.Random(seed)
    prompts: list[tuple[int, ...]] = []
    outputs: list[int] = []
    for _ in range(num_requests):
        length = rng.randint(*prompt_len)
        prompts.append(tuple(rng.randrange(FIRST_PLAIN_ID, vocab_size) for _ in range(length)))
        outputs.append(rng.randint(*output_len))
    return Workload(prompts=tuple(prompts), max_new_tokens=tuple(outputs))


@dataclass(frozen=True)
class BenchContext:
    """What every method and engine variant needs: the model directory, where to run, the engine's torch
    threads (0: torch's) and the transformers settings."""

    model_dir: Path
    device: str  # "cpu" | "cuda" | "cuda:N"
    dtype: str  # "float32" | "bfloat16" | "float16"
    threads: int = 0

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)


@dataclass
class MethodResult:
    """Timing and outputs of one method. `outputs[i]` are the tokens of request i (workload order)."""

    name: str
    wall_s: float
    output_tokens: int
    outputs: list[list[int]]
    setting: str = ""  # the configuration the figures belong to (e.g. hf-static's batch size)
    forward_share: float | None = None  # engine: time in the model forward / whole step time
    forward_share_max_batch: float | None = None  # engine: the same over the steps with the largest batch
    max_batch: int | None = None  # engine: the most requests in one step
    kv_efficiency: float | None = None  # engine: tokens stored / token slots allocated at peak block use
    preemptions: int | None = None  # engine: requests preempted (recomputed later)
    cuda_graphs: str | None = None  # engine: "on" | "off" on CUDA, NOT_ON_CPU elsewhere
    runs_tokens_per_s: list[float] = field(default_factory=list)  # every repeat of the method

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.wall_s if self.wall_s > 0 else 0.0


def _warmup_prompt() -> list[int]:
    return list(range(FIRST_PLAIN_ID, FIRST_PLAIN_ID + 16))


def load_hf_model(ctx: BenchContext) -> PreTrainedModel:
    """The benchmark model through transformers, with EOS disabled so only max_new_tokens ends generation."""
    model = AutoModelForCausalLM.from_pretrained(ctx.model_dir, dtype=ctx.torch_dtype).to(ctx.device).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = PAD_ID
    return model


def _generate(model: PreTrainedModel, batch: list[tuple[int, ...]], max_new_tokens: int) -> list[list[int]]:
    """Greedy `generate` on a left-padded batch, no EOS; returns each row's `max_new_tokens` new tokens."""
    width = max(len(p) for p in batch)
    ids = torch.full((len(batch), width), PAD_ID, dtype=torch.long)
    mask = torch.zeros((len(batch), width), dtype=torch.long)
    for row, prompt in enumerate(batch):  # left padding: prompts end at the right edge
        ids[row, width - len(prompt) :] = torch.tensor(prompt)
        mask[row, width - len(prompt) :] = 1
    greedy = GenerationConfig(do_sample=False, max_new_tokens=max_new_tokens, pad_token_id=PAD_ID)  # no EOS
    ids, mask = ids.to(model.device), mask.to(model.device)
    out = model.generate(input_ids=ids, attention_mask=mask, generation_config=greedy)  # (B, width + new)
    return out[:, width:].tolist()


def run_hf_batches(
    ctx: BenchContext, model: PreTrainedModel, work: Workload, progress: Progress, batch_size: int = 1
) -> MethodResult:
    """Left-padded batches of `batch_size` in arrival order, each run to its longest request: one
    `generate` call per request (hf-sequential), or batches of `STATIC_BATCH_SIZE` (hf-static)."""
    _generate(model, [tuple(_warmup_prompt())] * min(2, batch_size), 4)
    outputs: list[list[int]] = []
    with timed(ctx.device) as elapsed:
        for start in range(0, len(work), batch_size):
            prompts = list(work.prompts[start : start + batch_size])
            wanted = work.max_new_tokens[start : start + batch_size]
            rows = _generate(model, prompts, max(wanted))
            outputs.extend(row[:n] for row, n in zip(rows, wanted, strict=True))
            progress(sum(wanted))
    name, setting = ("hf-sequential", "") if batch_size == 1 else ("hf-static", f"batch {batch_size}")
    return MethodResult(name, elapsed[0], sum(map(len, outputs)), outputs, setting=setting)


run_hf_sequential = run_hf_batches
run_hf_static = functools.partial(run_hf_batches, batch_size=STATIC_BATCH_SIZE)


def run_sluice(
    ctx: BenchContext, work: Workload, batching: str, progress: Progress, cuda_graphs: str = "on"
) -> MethodResult:
    """The engine core with one batching policy: add every request, then `step()` until none is left."""
    lengths = [len(p) + n for p, n in zip(work.prompts, work.max_new_tokens, strict=True)]
    settings = drv.engine_settings(
        ctx.model_dir, ctx.device, ctx.dtype, lengths, batching=batching, static_batch_size=STATIC_BATCH_SIZE,
        cuda_graphs=cuda_graphs,
    )  # fmt: skip
    engine = drv.make_engine(settings)
    drv.warm_up(engine, _warmup_prompt())
    outputs, wall_s = drv.generate(engine, work.prompts, work.max_new_tokens, progress, ctx.device)
    stats = engine.stats()
    eager = cuda_graphs == "off" and batching == "continuous"
    return MethodResult(
        EAGER if eager else f"sluice-{batching}",
        wall_s,
        sum(map(len, outputs)),
        outputs,
        setting=f"batching={batching}, {stats.steps} steps",
        forward_share=stats.forward_share,
        forward_share_max_batch=stats.forward_share_at_max_batch,
        max_batch=stats.max_batch,
        kv_efficiency=stats.peak_kv_efficiency,
        preemptions=stats.num_preemptions,
        cuda_graphs=cuda_graphs if on_cuda(ctx.device) else NOT_ON_CPU,
    )
