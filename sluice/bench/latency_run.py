"""Runs of `sluice bench latency`: one in-process LLMEngine per variant, timed at batch 1 and at N at once.

A variant is the engine's settings for one technique (VARIANTS: speculation off, n-gram speculation, int8
or fp8 weights). `build_engine` makes its engine (prefix caching off, so that no run reuses the KV of an
earlier one and every TTFT is a full prefill; a pool that holds the whole workload at once); one engine
lives at a time and `release` frees it before the next.

- `run_batch1`: the requests one at a time. Per request: TTFT (add_request to the first token out) and
  its decode time (first token to last); the batch-1 decode rate is the tokens after the first over the
  summed decode times, the output rate every token over the summed request times.
- `run_concurrent`: every request added at once, then stepped until all are done; the output rate is
  every token over that wall time, TTFT per request from the moment all were added.
Each run starts from `engine.reset_stats()`, and the run's engine statistics named `spec_*` (speculative
decoding's proposed and accepted tokens, acceptance rate, mean accepted length) are kept with it.
"""

from __future__ import annotations

import dataclasses
import gc
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from sluice.bench.latency_workload import LatencyRequest, LatencyWorkload

if TYPE_CHECKING:
    from services.engine.core.engine import LLMEngine

OFF = "off"
VARIANTS: dict[str, dict[str, str]] = {
    OFF: {},
    "ngram": {"speculative": "ngram"},
    "int8": {"quantization": "int8"},
    "fp8": {"quantization": "fp8"},
}
CUDA_ONLY = ("fp8",)
BLOCK_SIZE = 16
KV_SLACK = 1.25  # the pool holds the whole workload at once with this margin (and the drafts' slots)
MIN_KV_GB = 0.25

Progress = Callable[[int], None]


@dataclass(frozen=True)
class EngineSpec:
    """What every variant's engine shares: the model, where it runs, and speculative settings given on the
    command line (None keeps the engine's default)."""

    model_dir: Path
    device: str
    dtype: str
    spec_overrides: dict[str, Any] = field(default_factory=dict)
    threads: int = 0


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def kv_budget_gb(model_dir: Path, dtype: str, lengths: Sequence[int], extra: int) -> float:
    """GiB of a pool holding requests of these total lengths at once (`extra` more tokens each for
    drafts), KV_SLACK over, at least MIN_KV_GB."""
    from transformers import AutoConfig

    from sluice.bench.engine_roofline import kv_bytes_per_token

    element = torch.tensor([], dtype=getattr(torch, dtype)).element_size()
    per_token = kv_bytes_per_token(AutoConfig.from_pretrained(model_dir), element)
    tokens = sum(_round_up(n + extra, BLOCK_SIZE) + BLOCK_SIZE for n in lengths)
    return max(MIN_KV_GB, KV_SLACK * tokens * per_token / (1 << 30))


def engine_settings(spec: EngineSpec, variant: str, lengths: Sequence[int], max_num_seqs: int) -> Any:
    """EngineSettings of `variant` for requests of these total lengths (prompt + output) at most
    `max_num_seqs` at once."""
    from services.engine.settings import EngineSettings

    overrides = {**VARIANTS[variant]}
    if variant == "ngram":
        overrides.update({k: v for k, v in spec.spec_overrides.items() if v is not None})
    drafts = int(overrides.get("num_speculative_tokens", EngineSettings.num_speculative_tokens))
    return EngineSettings(
        model=str(spec.model_dir),
        device=spec.device,
        dtype=spec.dtype,
        threads=spec.threads,
        max_num_seqs=max_num_seqs,
        block_size=BLOCK_SIZE,
        kv_cache_gb=kv_budget_gb(spec.model_dir, spec.dtype, lengths, drafts + 1),
        max_model_len=_round_up(max(lengths) + drafts + 2, BLOCK_SIZE),
        enable_prefix_caching=False,
        **overrides,
    )


def build_engine(spec: EngineSpec, variant: str, lengths: Sequence[int], max_num_seqs: int) -> LLMEngine:
    from services.engine.core.engine import LLMEngine

    return LLMEngine(engine_settings(spec, variant, lengths, max_num_seqs))


def release(device: str) -> None:
    """Returns the memory of an engine no longer referenced (its pool and model) before the next loads."""
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _params(req: LatencyRequest) -> tuple[Any, Any]:
    from services.engine.core.params import SamplingParams, StoppingParams

    sampling = SamplingParams(temperature=req.temperature, seed=req.seed)
    return sampling, StoppingParams(max_new_tokens=req.max_new_tokens, ignore_eos=True)


@dataclass
class _Track:
    added: float
    first: float | None = None
    done: float | None = None
    tokens: list[int] = field(default_factory=list)


def _drive(engine: LLMEngine, tracks: dict[str, _Track], progress: Progress) -> None:
    """Steps the engine until it is empty, timing each tracked request's first token and end."""
    while engine.has_unfinished_requests():
        idle = engine.idle_s()
        if idle:
            time.sleep(idle)
        outputs = engine.step()
        now = time.perf_counter()
        for out in outputs:
            if out.error is not None:
                raise RuntimeError(f"engine failed request {out.request_id}: {out.error}")
            track = tracks.get(out.request_id)
            if track is None:
                continue
            if out.new_token_ids and track.first is None:
                track.first = now
            track.tokens.extend(out.new_token_ids)
            progress(len(out.new_token_ids))
            if out.finished:
                track.done = now


def _add(engine: LLMEngine, rid: str, req: LatencyRequest) -> None:
    sampling, stopping = _params(req)
    engine.add_request(rid, list(req.prompt), sampling, stopping)


def spec_stats(engine: LLMEngine) -> dict[str, float]:
    """The engine statistics named spec_* (empty when the engine has none)."""
    stats = engine.stats()
    names = [f.name for f in dataclasses.fields(stats)] if dataclasses.is_dataclass(stats) else []
    return {n: float(getattr(stats, n)) for n in names if n.startswith("spec_")}


def warm_up(engine: LLMEngine, workload: LatencyWorkload, concurrency: int, tokens: int = 8) -> None:
    """Outside any timed run: the workload's first request alone, then its first `concurrency` requests
    at once, each for `tokens` tokens, so that the shapes of both runs (a full step budget of prefill, decode
    batches up to `concurrency`) have run once (on CUDA the first large prefill pays one-time costs)."""
    rounds = [workload.requests[:1]] + ([workload.requests[:concurrency]] if concurrency > 1 else [])
    for k, requests in enumerate(rounds):
        for i, req in enumerate(requests):
            _add(
                engine,
                f"warmup{k}-{i}",
                dataclasses.replace(req, max_new_tokens=min(tokens, req.max_new_tokens)),
            )
        _drive(engine, {}, lambda _: None)


@dataclass
class RunFigures:
    """One timed run: `concurrency` 1 is the batch-1 run (requests one at a time)."""

    concurrency: int
    requests: int
    output_tokens: int
    wall_s: float  # batch 1: the summed request times; else add-all to last token
    decode_tokens: int  # tokens after each request's first
    decode_s: float  # batch 1: summed first-to-last times; else the wall time after the first token
    ttft_s: list[float]
    outputs: list[list[int]]
    spec: dict[str, float] = field(default_factory=dict)
    steps: int = 0
    repeats: list[float] = field(default_factory=list)  # the headline figure of every repeat (--repeat)

    @property
    def output_tok_s(self) -> float:
        return self.output_tokens / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def decode_tok_s(self) -> float:
        return self.decode_tokens / self.decode_s if self.decode_s > 0 else 0.0

    def ttft(self, q: float) -> float:
        return percentile(self.ttft_s, q)


def percentile(values: Sequence[float], q: float) -> float:
    """The q-quantile (0..1) by linear interpolation between closest ranks; nan when empty."""
    if not values:
        return math.nan
    ordered = sorted(values)
    pos = q * (len(ordered) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def _figures(
    concurrency: int, tracks: list[_Track], wall_s: float, decode_s: float, engine: LLMEngine
) -> RunFigures:
    assert all(t.first is not None and t.done is not None for t in tracks)
    return RunFigures(
        concurrency=concurrency,
        requests=len(tracks),
        output_tokens=sum(len(t.tokens) for t in tracks),
        wall_s=wall_s,
        decode_tokens=sum(max(0, len(t.tokens) - 1) for t in tracks),
        decode_s=decode_s,
        ttft_s=[t.first - t.added for t in tracks],  # type: ignore[operator]
        outputs=[t.tokens for t in tracks],
        spec=spec_stats(engine),
        steps=engine.stats().steps,
    )


def run_batch1(engine: LLMEngine, workload: LatencyWorkload, device: str, progress: Progress) -> RunFigures:
    """The workload's requests one at a time (see the module docstring)."""
    engine.reset_stats()
    tracks: list[_Track] = []
    for i, req in enumerate(workload.requests):
        _sync(device)
        track = _Track(added=time.perf_counter())
        _add(engine, f"b{i}", req)
        _drive(engine, {f"b{i}": track}, progress)
        tracks.append(track)
    wall = sum(t.done - t.added for t in tracks)  # type: ignore[operator]
    decode = sum(t.done - t.first for t in tracks)  # type: ignore[operator]
    return _figures(1, tracks, wall, decode, engine)


def run_concurrent(
    engine: LLMEngine, workload: LatencyWorkload, device: str, progress: Progress
) -> RunFigures:
    """Every request added at once (see the module docstring)."""
    engine.reset_stats()
    _sync(device)
    start = time.perf_counter()
    tracks = {f"c{i}": _Track(added=start) for i in range(len(workload))}
    for i, req in enumerate(workload.requests):
        _add(engine, f"c{i}", req)
    _drive(engine, tracks, progress)
    ordered = [tracks[f"c{i}"] for i in range(len(workload))]
    end = max(t.done for t in ordered)  # type: ignore[type-var]
    first = min(t.first for t in ordered)  # type: ignore[type-var]
    return _figures(len(workload), ordered, end - start, end - first, engine)  # type: ignore[operator]


def greedy_continuations(
    spec: EngineSpec, prompts: list[list[int]], n: int, max_num_seqs: int
) -> list[list[int]]:
    """Each prompt's `n` greedy tokens from a speculation-off engine (built for this and released)."""
    from services.engine.core.params import SamplingParams, StoppingParams

    engine = build_engine(spec, OFF, [len(p) + n for p in prompts], max_num_seqs)
    stopping = StoppingParams(max_new_tokens=n, ignore_eos=True)
    tracks = {f"g{i}": _Track(added=0.0) for i in range(len(prompts))}
    for i, prompt in enumerate(prompts):
        engine.add_request(f"g{i}", prompt, SamplingParams(temperature=0.0), stopping)
    _drive(engine, tracks, lambda _: None)
    del engine
    release(spec.device)
    return [tracks[f"g{i}"].tokens for i in range(len(prompts))]
