"""The engine benchmark's fixed workload (random-token requests, a pure function of the seed) and the
methods it times (transformers baselines, the engine's policies). Every method returns, per request in
workload order, exactly its `max_new_tokens[i]` greedy tokens (EOS never ends a request), and runs a short
warm-up outside the timed region. Then what the report rests on: the greedy comparison with the reference's
logits.
"""

from __future__ import annotations

import functools
import math
import random
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, GenerationConfig, PreTrainedModel

from sluice.bench import engine_driver as drv
from sluice.bench.engine_driver import Progress, on_cuda, timed
from sluice.bench.report import EAGER, GREEDY_RULE, HF_METHODS, NOT_ON_CPU, REFERENCE, SLUICE_METHODS
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
    hf_batch_tokens: tuple[int, ...] = (256, 512, 1024)  # max_batch_tokens tried for hf-continuous
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
    setting: str = ""  # the configuration the figures belong to (e.g. hf-continuous's best)
    forward_share: float | None = None  # engine: time in the model forward / whole step time
    forward_share_max_batch: float | None = None  # engine: the same over the steps with the largest batch
    max_batch: int | None = None  # engine: the most requests in one step
    kv_efficiency: float | None = None  # engine: tokens stored / token slots allocated at peak block use
    preemptions: int | None = None  # engine: requests preempted (recomputed later)
    cuda_graphs: str | None = None  # engine: "on" | "off" on CUDA, NOT_ON_CPU elsewhere
    sweep: list[dict[str, Any]] = field(default_factory=list)  # hf-continuous: every setting tried
    runs_tokens_per_s: list[float] = field(default_factory=list)  # every repeat of the method

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.wall_s if self.wall_s > 0 else 0.0


def _count(outputs: list[list[int]]) -> int:
    return sum(len(o) for o in outputs)


def _warmup_prompt() -> list[int]:
    return list(range(FIRST_PLAIN_ID, FIRST_PLAIN_ID + 16))


def load_hf_model(ctx: BenchContext) -> PreTrainedModel:
    """The benchmark model through transformers, with EOS disabled so only max_new_tokens ends generation."""
    model = AutoModelForCausalLM.from_pretrained(ctx.model_dir, dtype=ctx.torch_dtype).to(ctx.device).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = PAD_ID
    return model


def _greedy_config(max_new_tokens: int, eos_token_id: int | None = None) -> GenerationConfig:
    """Greedy decoding; `generate` takes no EOS as None, continuous batching as -1."""
    return GenerationConfig(
        do_sample=False, max_new_tokens=max_new_tokens, eos_token_id=eos_token_id, pad_token_id=PAD_ID
    )


def _generate(model: PreTrainedModel, batch: list[tuple[int, ...]], max_new_tokens: int) -> list[list[int]]:
    """Greedy `generate` on a left-padded batch; returns each row's `max_new_tokens` new tokens."""
    width = max(len(p) for p in batch)
    ids = torch.full((len(batch), width), PAD_ID, dtype=torch.long)
    mask = torch.zeros((len(batch), width), dtype=torch.long)
    for row, prompt in enumerate(batch):  # left padding: prompts end at the right edge
        ids[row, width - len(prompt) :] = torch.tensor(prompt)
        mask[row, width - len(prompt) :] = 1
    out = model.generate(
        input_ids=ids.to(model.device),
        attention_mask=mask.to(model.device),
        generation_config=_greedy_config(max_new_tokens),
    )  # (B, width + max_new_tokens)
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
    return MethodResult(name, elapsed[0], _count(outputs), outputs, setting=setting)


run_hf_sequential = run_hf_batches
run_hf_static = functools.partial(run_hf_batches, batch_size=STATIC_BATCH_SIZE)


def reference_logits(ctx: BenchContext, work: Workload, outputs: list[list[int]]) -> Iterator[torch.Tensor]:
    """The logits behind a greedy reference's choices: for each request in workload order, one
    teacher-forced forward over its prompt and `outputs[i]` yields a (len(outputs[i]), vocab) fp32 CPU
    tensor whose row j scored `outputs[i][j]`. Loads its own model; runs outside any timed region.
    """
    model = load_hf_model(ctx)
    with torch.inference_mode():
        for prompt, output in zip(work.prompts, outputs, strict=True):
            assert output, "every request asks for at least one token"
            ids = torch.tensor([[*prompt, *output[:-1]]], device=ctx.device)  # (1, P + n - 1)
            logits = model(input_ids=ids, logits_to_keep=len(output)).logits  # (1, n, vocab)
            yield logits[0].float().cpu()


def _hf_cb_config(max_batch_tokens: int, work: Workload) -> Any:
    """A `ContinuousBatchingConfig` whose KV cache holds the whole workload at once (no eviction)."""
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    config = ContinuousBatchingConfig(max_batch_tokens=max_batch_tokens)
    page = config.page_size
    needed = sum(
        math.ceil((len(p) + n) / page) for p, n in zip(work.prompts, work.max_new_tokens, strict=True)
    )
    config.num_blocks = needed + len(work) + 4  # one spare block per request for the token being written
    return config


def _hf_cb_once(
    model: PreTrainedModel, work: Workload, max_batch_tokens: int, progress: Progress, device: str
) -> tuple[float, list[list[int]]]:
    """One timed pass of transformers' continuous batching: all requests added at once, own max_new_tokens.

    Set up as `generate_batch` does (workload hints, warm-up before the loop starts), but with
    `add_request` so that each request gets its own max_new_tokens.
    """
    from transformers.generation.continuous_batching.utils import WorkloadHints

    hints = WorkloadHints(
        max_prompt_length=max(len(p) for p in work.prompts),
        max_generated_length=max(work.max_new_tokens),
        num_requests=len(work),
    )
    manager = model.init_continuous_batching(
        generation_config=_greedy_config(max(work.max_new_tokens), eos_token_id=-1),
        continuous_batching_config=_hf_cb_config(max_batch_tokens, work),
        workload_hints=hints,
    )
    manager.warmup()
    manager.start()
    try:
        manager.add_request(_warmup_prompt(), request_id="warmup", max_new_tokens=4, eos_token_id=-1)
        _hf_cb_collect(manager, {"warmup"}, lambda _: None)
        ids = [f"r{i}" for i in range(len(work))]
        with timed(device) as elapsed:
            for rid, prompt, n in zip(ids, work.prompts, work.max_new_tokens, strict=True):
                manager.add_request(list(prompt), request_id=rid, max_new_tokens=n, eos_token_id=-1)
            results = _hf_cb_collect(manager, set(ids), progress)
    finally:
        manager.stop(block=True)
        manager.destroy()
    return elapsed[0], [results[rid] for rid in ids]


def _hf_cb_collect(manager: Any, pending: set[str], progress: Progress) -> dict[str, list[int]]:
    """Waits for every request id in `pending`; raises RuntimeError if one fails or the loop dies."""
    results: dict[str, list[int]] = {}
    while len(results) < len(pending):
        out = manager.get_result(timeout=1.0)
        if out is None:
            if not manager.is_running():
                raise RuntimeError("transformers' continuous batching loop stopped before finishing")
            continue
        if out.request_id not in pending or not out.is_finished():
            continue
        if out.error is not None:
            raise RuntimeError(f"transformers' continuous batching failed {out.request_id}: {out.error}")
        results[out.request_id] = list(out.generated_tokens)
        progress(len(out.generated_tokens))
    return results


def run_hf_continuous(
    ctx: BenchContext, model: PreTrainedModel, work: Workload, progress: Progress
) -> MethodResult:
    """transformers' continuous batching at each `ctx.hf_batch_tokens` setting; the fastest one is reported.

    The progress callback sees every pass (its total is the workload's tokens times the settings tried).
    """
    best: MethodResult | None = None
    sweep: list[dict[str, Any]] = []
    for tokens in ctx.hf_batch_tokens:
        wall_s, outputs = _hf_cb_once(model, work, tokens, progress, ctx.device)
        result = MethodResult(
            "hf-continuous", wall_s, _count(outputs), outputs, setting=f"max_batch_tokens={tokens}"
        )
        sweep.append({"max_batch_tokens": tokens, "wall_s": wall_s, "tokens_per_s": result.tokens_per_s})
        if best is None or result.tokens_per_s > best.tokens_per_s:
            best = result
    assert best is not None
    best.sweep = sweep
    return best


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
        _count(outputs),
        outputs,
        setting=f"batching={batching}, {stats.steps} steps",
        forward_share=stats.forward_share,
        forward_share_max_batch=stats.forward_share_at_max_batch,
        max_batch=stats.max_batch,
        kv_efficiency=stats.peak_kv_efficiency,
        preemptions=stats.num_preemptions,
        cuda_graphs=cuda_graphs if on_cuda(ctx.device) else NOT_ON_CPU,
    )


# Logit gap under which two correct greedy paths may pick different tokens by float noise alone, per dtype.
# Measured on the benchmark model on CPU (logits within ±1.7): the largest logit difference between
# hf-sequential and hf-static or a teacher-forced forward, up to their first differing token, is 1.7e-6 in
# float32, 1.2e-2 in bfloat16 and 1.5e-3 in float16 (1.5 units in the last place at 1). Each threshold is
# at least five times that (8 units in the last place at 1 for the 16-bit types).
NEAR_TIE_THRESHOLD = {torch.float32: 1e-4, torch.bfloat16: 6.25e-2, torch.float16: 7.8e-3}


@dataclass(frozen=True)
class GreedyMatch:
    """One method's greedy outputs against REFERENCE's, each request compared up to its first differing
    token: *equal* without one, *equal up to a near-tie* when the reference's logits there score the method's
    token within the threshold of its own (float noise can flip such a choice between two correct paths),
    else *differing* (a token the reference clearly ranks lower, or an output of another length)."""

    differing: int  # requests with a real difference
    near_ties: int  # requests equal up to a near-tie
    tokens_compared: int  # every position of an equal request; of another, up to its first difference

    @property
    def equal(self) -> bool:
        """Equal to the reference up to near-ties: no request differs."""
        return self.differing == 0


@dataclass(frozen=True)
class GreedyCheck:
    """The greedy comparison of every method with REFERENCE, and the reference margins it rested on."""

    threshold: float  # logit gap below which a first difference is a near-tie
    reference_tokens: int  # output positions of the reference, all requests
    close_calls: int  # of those, positions whose top-two logit margin is below the threshold
    min_margin: float  # smallest top-two logit margin of the reference over all its output positions
    methods: dict[str, GreedyMatch]

    def to_json(self) -> dict[str, Any]:
        return {
            "reference": REFERENCE,
            "rule": GREEDY_RULE,
            "near_tie_threshold": self.threshold,
            "reference_tokens": self.reference_tokens,
            "reference_close_calls": self.close_calls,
            "reference_min_top2_margin": self.min_margin,
        }


def first_difference(got: list[int], want: list[int]) -> int | None:
    """The first position where the two token lists differ (a missing token counts); None when equal."""
    for pos, (a, b) in enumerate(zip(got, want, strict=False)):
        if a != b:
            return pos
    return None if len(got) == len(want) else min(len(got), len(want))


def compare_request(
    got: list[int], want: list[int], logits: torch.Tensor, threshold: float
) -> tuple[str, int]:
    """Classifies one request as "equal", "near-tie" or "differs" (see GreedyMatch); returns the verdict and
    the positions compared. `logits` (len(want), vocab) are the reference's at each of its output positions.
    """
    pos = first_difference(got, want)
    if pos is None:
        return "equal", len(want)
    if pos == len(got) or pos == len(want) or not 0 <= got[pos] < logits.shape[-1]:
        return "differs", pos + 1
    gap = (logits[pos, want[pos]] - logits[pos, got[pos]]).item()
    return ("near-tie" if gap < threshold else "differs"), pos + 1


def top2_margins(logits: torch.Tensor) -> torch.Tensor:
    """(n, vocab) logits → (n,) gap between the largest and the second largest logit of each row."""
    top = logits.topk(2, dim=-1).values
    return top[:, 0] - top[:, 1]


def check_greedy(
    results: dict[str, MethodResult], reference_logits: Iterable[torch.Tensor], threshold: float
) -> GreedyCheck:
    """Compares every method's outputs with REFERENCE's (which must be in `results`).

    `reference_logits` yields, in workload order, each request's (len(output), vocab) reference logits.
    """
    want = results[REFERENCE].outputs
    verdicts: dict[str, list[tuple[str, int]]] = {name: [] for name in results}
    min_margin, close_calls = math.inf, 0
    for i, logits in enumerate(reference_logits):
        margins = top2_margins(logits)
        min_margin = min(min_margin, margins.min().item())
        close_calls += int((margins < threshold).sum())
        for name, result in results.items():
            verdicts[name].append(compare_request(result.outputs[i], want[i], logits, threshold))
    methods = {name: _match(v) for name, v in verdicts.items()}
    return GreedyCheck(threshold, sum(len(w) for w in want), close_calls, min_margin, methods)


def _match(verdicts: list[tuple[str, int]]) -> GreedyMatch:
    return GreedyMatch(
        differing=sum(v == "differs" for v, _ in verdicts),
        near_ties=sum(v == "near-tie" for v, _ in verdicts),
        tokens_compared=sum(n for _, n in verdicts),
    )
