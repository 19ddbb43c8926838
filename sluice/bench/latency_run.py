"""Timed runs of `sluice bench latency`, one in-process engine per variant (prefix caching off, so every
TTFT is a full prefill). Batch 1: decode rate = tokens after the first ÷ summed first-to-last times.
Concurrent: every request added at once; output rate = tokens ÷ wall time. Each run keeps the engine's
`spec_*` statistics.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from sluice.bench import engine_driver as drv
from sluice.bench.engine_driver import LLMEngine, Progress
from sluice.bench.latency_workload import LatencyRequest, LatencyWorkload

OFF = "off"
VARIANTS: dict[str, dict[str, str]] = {
    OFF: {},
    "ngram": {"speculative": "ngram"},
    "int8": {"quantization": "int8"},
    "fp8": {"quantization": "fp8"},
}
CUDA_ONLY = ("fp8",)


@dataclass(frozen=True)
class EngineSpec:
    """What every variant's engine shares: the model, where it runs, and speculative settings given on the
    command line (None keeps the engine's default)."""

    model_dir: Path
    device: str
    dtype: str
    spec_overrides: dict[str, Any] = field(default_factory=dict)
    threads: int = 0


def engine_settings(spec: EngineSpec, variant: str, lengths: Sequence[int], max_num_seqs: int) -> Any:
    """EngineSettings of `variant` for requests of these total lengths (prompt + output) at most
    `max_num_seqs` at once; the pool also holds each request's drafts."""
    overrides = {**VARIANTS[variant]}
    if variant == "ngram":
        overrides.update({k: v for k, v in spec.spec_overrides.items() if v is not None})
    drafts = int(overrides.get("num_speculative_tokens", drv.NUM_SPECULATIVE_TOKENS))
    fixed = {"threads": spec.threads, "max_num_seqs": max_num_seqs, "enable_prefix_caching": False}
    model = (spec.model_dir, spec.device, spec.dtype)
    return drv.engine_settings(*model, lengths, extra=drafts + 1, **fixed, **overrides)


def build_engine(spec: EngineSpec, variant: str, lengths: Sequence[int], max_num_seqs: int) -> LLMEngine:
    return drv.make_engine(engine_settings(spec, variant, lengths, max_num_seqs))


@dataclass
class _Track:
    added: float
    first: float | None = None
    done: float | None = None
    tokens: list[int] = field(default_factory=list)


def _drive(engine: LLMEngine, tracks: dict[str, _Track], progress: Progress) -> None:
    """Steps the engine until it is empty, timing each tracked request's first token and end."""

    def on_output(out: Any, now: float) -> None:
        track = tracks.get(out.request_id)
        if track is None:
            return
        if out.new_token_ids and track.first is None:
            track.first = now
        track.tokens.extend(out.new_token_ids)
        progress(len(out.new_token_ids))
        if out.finished:
            track.done = now

    drv.drain(engine, on_output)


def _add(engine: LLMEngine, rid: str, req: LatencyRequest) -> None:
    engine.add_request(
        rid, list(req.prompt), drv.sampling(req.temperature, req.seed), drv.stop_after(req.max_new_tokens)
    )


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
    return float(np.percentile(values, 100 * q)) if len(values) else math.nan


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
        spec=drv.spec_stats(engine),
        steps=engine.stats().steps,
    )


def run_batch1(engine: LLMEngine, workload: LatencyWorkload, device: str, progress: Progress) -> RunFigures:
    """The workload's requests one at a time (see the module docstring)."""
    engine.reset_stats()
    tracks: list[_Track] = []
    for i, req in enumerate(workload.requests):
        drv.sync(device)
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
    drv.sync(device)
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
    engine = build_engine(spec, OFF, [len(p) + n for p in prompts], max_num_seqs)
    outputs, _ = drv.generate(engine, prompts, [n] * len(prompts))
    del engine
    drv.release_memory(spec.device)
    return outputs
