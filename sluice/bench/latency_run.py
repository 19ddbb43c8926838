"""The workloads (docs/benchmarks.md; a model without tokenizer.json gets words mapped to ids by crc32) and
timed runs of `sluice bench latency`: one in-process engine per variant, prefix caching off so every TTFT is
a full prefill. Batch 1: decode rate = tokens after the first ÷ summed first-to-last times; concurrent:
every request added at once, output rate = tokens ÷ wall time. Each run keeps the engine's `spec_*` stats.
"""

from __future__ import annotations

import dataclasses
import math
import random
import time
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from sluice.bench import engine_driver as drv
from sluice.bench.engine_driver import LLMEngine, Progress
from sluice.bench.perplexity import held_out_texts
from sluice.bench.report import OFF

REPETITIVE = "repetitive"
NON_REPETITIVE = "non-repetitive"
WORKLOADS = (REPETITIVE, NON_REPETITIVE)
SEED_TOKENS = 24  # tokens of a held-out paragraph the model continues into the document
COPY_NGRAM = 4  # a token counts as copied when it lies in a span of this many tokens found in the prompt
NON_REPETITIVE_TEMPERATURE = 0.9
FIRST_PLAIN_ID = 5  # ids below are special tokens in every model the benchmark makes (pad, bos, eos, ...)
BOS_ID = 1
QUESTIONS = (
    "What does {t} do?",
    "When would I use {t}?",
    "Give me an overview of {t}.",
    "What are the pitfalls of {t}?",
)


@dataclass(frozen=True)
class LatencyRequest:
    prompt: tuple[int, ...]
    max_new_tokens: int
    temperature: float = 0.0
    seed: int | None = None


@dataclass(frozen=True)
class LatencyWorkload:
    """Requests of one kind; `how` says in a sentence how they were built."""

    name: str
    requests: tuple[LatencyRequest, ...]
    how: str

    def __len__(self) -> int:
        return len(self.requests)

    def head(self, n: int) -> LatencyWorkload:
        return LatencyWorkload(self.name, self.requests[:n], self.how)

    @property
    def prompt_tokens(self) -> int:
        return sum(len(r.prompt) for r in self.requests)


Encoder = Callable[[str], list[int]]


def make_encoder(model_dir: Path, vocab_size: int) -> Encoder:
    """The model's tokenizer (no special tokens added; markup such as `<|im_start|>` is parsed as the
    special token it names), or, without tokenizer.json, each whitespace-separated word mapped to an id in
    [FIRST_PLAIN_ID, vocab_size) by crc32."""
    path = model_dir / "tokenizer.json"
    if path.is_file():
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(str(path))
        return lambda text: tok.encode(text, add_special_tokens=False).ids
    span = vocab_size - FIRST_PLAIN_ID
    return lambda text: [FIRST_PLAIN_ID + zlib.crc32(w.encode()) % span for w in text.split()]


def _user_turn(encode: Encoder, text: Sequence[int] | str) -> list[int]:
    body = encode(text) if isinstance(text, str) else list(text)
    return [BOS_ID, *encode("<|im_start|>user\n"), *body, *encode("<|im_end|>\n<|im_start|>assistant\n")]


def seed_texts(encode: Encoder, count: int, seed: int) -> list[list[int]]:
    """`count` distinct held-out paragraphs of at least SEED_TOKENS tokens, drawn with `seed`, each cut to
    its first SEED_TOKENS tokens."""
    usable = [ids[:SEED_TOKENS] for t in held_out_texts() if len(ids := encode(t)) >= SEED_TOKENS]
    if len(usable) < count:
        raise ValueError(f"only {len(usable)} held-out paragraphs are long enough, {count} wanted")
    return random.Random(seed).sample(usable, count)


Continue = Callable[[list[list[int]], int], list[list[int]]]  # prompts, n -> each one's n greedy tokens


def repetitive(
    encode: Encoder, continue_greedy: Continue, count: int, output_len: int, seed: int
) -> LatencyWorkload:
    """`count` user turns asking to repeat a document: a held-out seed and the model's own greedy continuation
    of it (`continue_greedy` runs the model); the answer starts with the seed."""
    seeds = seed_texts(encode, count, seed)
    instruction = encode("Repeat the following text exactly.\n\n")
    # The continuation is the model's own answer to the request with the seed alone as the document, so
    # that the answer to the full document, copied or freely continued, is (nearly) the same text.
    asked = [[*_user_turn(encode, [*instruction, *s]), *s] for s in seeds]
    continuations = continue_greedy(asked, output_len)
    requests = []
    for s, c in zip(seeds, continuations, strict=True):
        prompt = [*_user_turn(encode, [*instruction, *s, *c]), *s]
        requests.append(LatencyRequest(tuple(prompt), output_len))
    how = (
        f"a user turn asks to repeat a document: {SEED_TOKENS} tokens of a held-out paragraph and the "
        f"model's own greedy answer to that request with those tokens alone ({output_len} tokens); the "
        "answer starts with the "
        f"paragraph's {SEED_TOKENS} tokens; greedy, {output_len} tokens per request"
    )
    return LatencyWorkload(REPETITIVE, tuple(requests), how)


def _topic(encode: Encoder, text: str) -> str:
    """A few words from the start of a held-out paragraph, as the subject of a question."""
    return " ".join(text.split()[:4]).rstrip(".,:;")


def non_repetitive(encode: Encoder, count: int, output_len: int, seed: int) -> LatencyWorkload:
    """`count` short questions about held-out paragraphs' subjects, sampled at NON_REPETITIVE_TEMPERATURE."""
    rng = random.Random(seed + 1)
    texts = rng.sample(list(held_out_texts()), count)
    requests = []
    for i, text in enumerate(texts):
        question = rng.choice(QUESTIONS).format(t=_topic(encode, text))
        prompt = _user_turn(encode, question)
        requests.append(
            LatencyRequest(tuple(prompt), output_len, NON_REPETITIVE_TEMPERATURE, seed * 1000 + i)
        )
    how = (
        f"a user turn asks a short question about a held-out paragraph's first words; sampled at "
        f"temperature {NON_REPETITIVE_TEMPERATURE} with a seed per request, {output_len} tokens per request"
    )
    return LatencyWorkload(NON_REPETITIVE, tuple(requests), how)


def copy_fraction(prompt: Sequence[int], output: Sequence[int], n: int = COPY_NGRAM) -> float:
    """Share of `output`'s tokens that lie in some span of `n` output tokens also found in `prompt`."""
    if not output:
        return 0.0
    grams = {tuple(prompt[i : i + n]) for i in range(len(prompt) - n + 1)}
    covered = [False] * len(output)
    for j in range(len(output) - n + 1):
        if tuple(output[j : j + n]) in grams:
            covered[j : j + n] = [True] * n
    return sum(covered) / len(output)


def lookup_fraction(prompt: Sequence[int], output: Sequence[int], n: int = COPY_NGRAM) -> float:
    """Share of `output`'s tokens that lie in some span of `n` output tokens occurring earlier in the
    prompt followed by the output (what prompt lookup can propose)."""
    if not output:
        return 0.0
    seq = [*prompt, *output]
    first: dict[tuple[int, ...], int] = {}
    for i in range(len(seq) - n + 1):
        first.setdefault(tuple(seq[i : i + n]), i)
    covered = [False] * len(output)
    for j in range(len(output) - n + 1):
        start = len(prompt) + j
        if first[tuple(seq[start : start + n])] < start:
            covered[j : j + n] = [True] * n
    return sum(covered) / len(output)


def mean_fraction(
    fraction: Callable[[Sequence[int], Sequence[int]], float],
    prompts: Sequence[Sequence[int]],
    outputs: Sequence[Sequence[int]],
) -> float:
    """`fraction` over every request, weighted by output length."""
    total = sum(len(o) for o in outputs)
    if not total:
        return 0.0
    return sum(fraction(p, o) * len(o) for p, o in zip(prompts, outputs, strict=True)) / total


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


def build_engine(spec: EngineSpec, variant: str, lengths: Sequence[int], max_num_seqs: int) -> LLMEngine:
    """The engine of `variant` for requests of these total lengths (prompt + output) at most
    `max_num_seqs` at once; the pool also holds each request's drafts."""
    overrides = {**VARIANTS[variant]}
    if variant == "ngram":
        overrides.update({k: v for k, v in spec.spec_overrides.items() if v is not None})
    drafts = int(overrides.get("num_speculative_tokens", drv.NUM_SPECULATIVE_TOKENS))
    fixed = {"threads": spec.threads, "max_num_seqs": max_num_seqs, "enable_prefix_caching": False}
    model = (spec.model_dir, spec.device, spec.dtype)
    return drv.make_engine(drv.engine_settings(*model, lengths, extra=drafts + 1, **fixed, **overrides))


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
        drv.drain(engine)


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
    concurrency: int, tracks: list[drv.Track], wall_s: float, decode_s: float, engine: LLMEngine
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
    tracks: list[drv.Track] = []
    for i, req in enumerate(workload.requests):
        drv.sync(device)
        track = drv.Track(added=time.perf_counter())
        _add(engine, f"b{i}", req)
        drv.drain(engine, {f"b{i}": track}, progress)
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
    tracks = {f"c{i}": drv.Track(added=start) for i in range(len(workload))}
    for i, req in enumerate(workload.requests):
        _add(engine, f"c{i}", req)
    drv.drain(engine, tracks, progress)
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
